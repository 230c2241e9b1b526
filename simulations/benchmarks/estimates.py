"""Benchmark of analyst requests on a large domain: the code before and after their bounds,
side by side in one run.

Run from the repository root (a script, not a test)::

    python -m simulations.benchmarks.estimates --base OLD       # against the checkout OLD
    python -m simulations.benchmarks.estimates --base PATH --concurrent 6

Setup. For each code tree (``--base``, the code before, and this repository), a SQLite
file in a temporary directory holds the metric ``bench.huge`` (``hr``, d = 2^20, epsilon
4) with the statistics of 30,000 reports in one hourly bucket: the mechanism's own
aggregate of reports it encoded from a seeded generator (5 heavy categories and the rest
uniform), written as ingestion writes them (``ReportsRepository.add_partial_rows``).
Each tree's file is prepared by that tree's code (``--prepare``, run with ``PYTHONPATH``
set to it; a tree from before ``Services`` through its ``Aggregator``'s ``storage``),
and ``ldp-aggregator serve`` of that tree serves it on a free loopback port.

Measured over HTTP (``httpx``, one client on the same machine), for each server:

* ``GET .../estimate`` with no parameters (the default answer: every category before,
  the 1,000 largest after): the wall time, the response's size, and the server's peak
  resident memory during the request (``VmHWM`` of ``/proc/PID/status``, reset before
  it through ``/proc/PID/clear_refs``);
* ``--concurrent`` such requests at once (default 6): the time until the last answered,
  and the server's peak memory;
* after only: ``values=`` of 10 categories, and ``format=vectors`` (the whole vector as
  base64 float32).

And the CPU time (``time.process_time``, one process per tree) of PEM
``heavy_hitters(k=100)`` over 10^6 simulated users of 10^4 words of 1 to 6 letters
(epsilon 4, max_length 6, Zipf(1.1) by rank), and of k=10.

Targets: the default estimate under 1 s and 5 MB. The machine this runs on may be shared
with other work: compare the two columns of one run, not figures across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from simulations.server import Server, start_server

REPO_ROOT = Path(__file__).resolve().parents[2]
METRIC = "bench.huge"
DOMAIN = 1 << 20
REPORTS = 30_000
TARGET_SECONDS = 1.0
TARGET_BYTES = 5_000_000
MB = 1_000_000


def open_service(database: str) -> tuple[Any, Any, Callable[[], None]]:
    """``(aggregator, reports, close)`` over ``database`` in the tree on ``sys.path``:
    ``reports`` is what stores partial rows (``add_partial_rows``), ``close`` closes both.

    This tree opens ``Services``; a tree from before them (``--base``) has no such class,
    and its ``Aggregator(settings)`` opens the storage itself, as ``storage``.
    """
    from aggregator import service
    from aggregator.settings import Settings

    settings = Settings(database=database, compaction_interval=0)
    if hasattr(service, "Services"):
        services = service.Services.open(settings)
        return services.aggregator, services.repositories.reports, services.close
    before: Any = service.Aggregator(settings)  # type: ignore[call-arg]
    return before, before.storage, before.close


def prepare(database: str) -> None:
    """Define ``bench.huge`` in ``database`` and store the statistics of its reports (with
    the code on ``sys.path``: this tree's or the one ``PYTHONPATH`` names)."""
    from aggregator.storage import PartialRow
    from shared.mechanisms import make_mechanism
    from shared.schemas import MechanismSpec, MetricDefinition

    spec = MechanismSpec.model_validate({"mechanism": "hr", "epsilon": 4.0, "domain_size": DOMAIN})
    service, reports, close = open_service(database)
    try:
        service.define_missing({METRIC: MetricDefinition(mechanism=spec)})
        mechanism = make_mechanism(spec)
        rng = np.random.default_rng(2026)
        heavy = np.repeat([777_777, 3, 1_048_575, 524_288, 65_536], [6000, 5000, 4000, 3000, 2000])
        values = np.concatenate([heavy, rng.integers(0, DOMAIN, REPORTS - heavy.size)])
        stats = mechanism.aggregate(mechanism.encode(values, rng))
        bucket = 3600 * (int(time.time()) // 3600 - 1)
        row = PartialRow(METRIC, 1, bucket, stats.n, stats.to_bytes())
        reports.add_partial_rows([row])
    finally:
        close()


def pem_seconds() -> dict[str, float]:
    """CPU seconds of PEM heavy hitters at k = 10 and k = 100 (module docstring)."""
    from shared.mechanisms import make_mechanism
    from shared.schemas import MechanismSpec

    spec = {"mechanism": "pem", "epsilon": 4.0, "max_length": 6}
    mechanism = make_mechanism(MechanismSpec.model_validate(spec))
    rng = np.random.default_rng(2027)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words: dict[str, None] = {}
    while len(words) < 10_000:
        words.setdefault("".join(rng.choice(letters, int(rng.integers(1, 7)))), None)
    ranks = np.arange(1, len(words) + 1, dtype=np.float64)
    counts = rng.multinomial(1_000_000, ranks**-1.1 / (ranks**-1.1).sum())
    stats = mechanism.simulate_statistics(list(words), counts, rng)  # type: ignore[attr-defined]
    seconds = {}
    for k in (10, 100):
        started = time.process_time()
        mechanism.heavy_hitters(stats, k)  # type: ignore[attr-defined]
        seconds[f"k={k}"] = time.process_time() - started
    return seconds


def in_tree(root: Path, *arguments: str) -> str:
    """Run this script with ``root``'s code first on the path; its standard output."""
    environment = {**os.environ, "PYTHONPATH": str(root)}
    command = [sys.executable, "-P", str(Path(__file__).resolve()), *arguments]
    done = subprocess.run(
        command, cwd=root, env=environment, capture_output=True, text=True, check=False
    )
    if done.returncode:
        raise RuntimeError(f"{' '.join(arguments)} in {root} failed:\n{done.stderr}")
    return done.stdout


def launch(root: Path, database: str, workdir: Path) -> Server:
    """``ldp-aggregator serve`` of the code in ``root`` on a free loopback port."""
    return start_server(database, workdir, root=root)


def peak_mb(server: Server, reset: bool = False) -> float:
    """The server's peak resident memory (MB) since the last reset; reset it if asked."""
    pid = server.process.pid
    status = Path(f"/proc/{pid}/status").read_text()
    peak = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM"))
    if reset:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    return peak * 1024 / MB


def timed(server: Server, **params: object) -> tuple[float, int]:
    """(seconds, response bytes) of one estimate request."""
    started = time.perf_counter()
    response = httpx.get(
        f"{server.url}/v1/metrics/{METRIC}/estimate",
        params=params,  # type: ignore[arg-type]
        headers=server.headers("analyst"),
        timeout=900,
    )
    response.raise_for_status()
    return time.perf_counter() - started, len(response.content)


def measure(server: Server, concurrent: int, extras: bool) -> dict[str, tuple[float, ...]]:
    """Rows of (seconds, MB, peak MB) for each request of the module docstring."""
    rows: dict[str, tuple[float, ...]] = {}
    peak_mb(server, reset=True)
    seconds, size = timed(server)
    rows["default estimate"] = (seconds, size / MB, peak_mb(server, reset=True))
    started = time.perf_counter()
    with ThreadPoolExecutor(concurrent) as pool:
        sizes = list(pool.map(lambda _: timed(server)[1], range(concurrent)))
    rows[f"{concurrent} default estimates at once"] = (
        time.perf_counter() - started,
        sum(sizes) / MB,
        peak_mb(server, reset=True),
    )
    if extras:
        chosen = [str(i) for i in range(0, DOMAIN, DOMAIN // 10)]
        seconds, size = timed(server, values=chosen)
        rows["values= (10 categories)"] = (seconds, size / MB, peak_mb(server, reset=True))
        seconds, size = timed(server, format="vectors")
        rows["format=vectors (all 2^20)"] = (seconds, size / MB, peak_mb(server, reset=True))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--base", type=Path, help="a checkout of the code to compare against (required)"
    )
    parser.add_argument("--concurrent", type=int, default=6, help="requests at once")
    parser.add_argument("--prepare", help=argparse.SUPPRESS)
    parser.add_argument("--pem", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.prepare:
        prepare(args.prepare)
        return
    if args.pem:
        print(json.dumps(pem_seconds()))
        return
    if args.base is None:  # not required of the runs in one tree (--prepare, --pem)
        parser.error("the following argument is required: --base")
    trees = {"before": args.base.resolve(), "after": REPO_ROOT}
    results: dict[str, dict[str, tuple[float, ...]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-estimates-") as scratch:
        workdir = Path(scratch)
        for label, root in trees.items():
            database = str(workdir / f"{label}.sqlite3")
            in_tree(root, "--prepare", database)
            server = launch(root, database, workdir)
            try:
                results[label] = measure(server, args.concurrent, extras=label == "after")
            finally:
                server.stop()
        pem = {label: json.loads(in_tree(root, "--pem")) for label, root in trees.items()}
    print(f"GET /v1/metrics/{METRIC}/estimate, hr, d = 2^20, reports: {REPORTS:,}")
    print(f"{'request':32} {'':6} {'seconds':>8} {'MB':>8} {'peak RSS MB':>12}")
    for request in results["after"]:
        for label in trees:
            row = results[label].get(request)
            if row is not None:
                seconds, size, peak = row
                print(f"{request:32} {label:6} {seconds:8.2f} {size:8.2f} {peak:12.0f}")
    seconds, size, _ = results["after"]["default estimate"]
    print(
        f"default estimate after: {seconds / TARGET_SECONDS:.2f} of the 1 s target, "
        f"{size * MB / TARGET_BYTES:.2f} of the 5 MB target"
    )
    print("PEM heavy hitters, CPU seconds (epsilon 4, max_length 6, 10^6 users)")
    for k in ("k=10", "k=100"):
        print(f"  {k:6} before {pem['before'][k]:7.2f}   after {pem['after'][k]:7.2f}")


if __name__ == "__main__":
    main()
