"""Benchmark: a flood of large report batches against a real server, old code beside new.

Run from the repository root (a script, not a test)::

    python -m simulations.benchmarks.flood                      # this checkout only
    python -m simulations.benchmarks.flood --compare OLD  # another checkout beside it
    python -m simulations.benchmarks.flood --bodies 40 --settle 5   # a quick run

For each checkout (``--compare`` first, then this one) and each body size it starts that
checkout's ``ldp-aggregator serve`` (one worker, SQLite in a temporary directory, its own
demo metrics, the per-key rate limit lifted) on a free loopback port and:

1. warms it up (20 batches of 100 reports, a few health checks), waits 2 s and reads its
   resident memory (``VmRSS`` of ``/proc/<pid>/status``): the **baseline**;
2. starts a normal client in a separate process that asks ``GET /healthz`` every 50 ms
   (each request waits for the previous answer) until told to stop;
3. posts ``--bodies`` bodies of valid reports (one ``app.theme`` GRR batch, the same
   body each time, made by the mechanism's own ``encode``), all at once, one connection
   each, and waits for every answer: ``accepted`` (200), ``413``, ``503`` (refused for
   lack of room, with ``Retry-After``), ``other`` (any other answer or a broken
   connection), and the upload latencies (p50, p99 and max);
4. reads the server's memory every 100 ms from the start of the flood to ``--settle``
   seconds after its end: its peak (``VmHWM``, the high-water mark since the start), its
   size at the end of the settling time (``after``), and how long after the flood it
   first came back within 20% of the baseline (``back in``; "never" if it did not within
   ``--settle`` seconds);
5. reports the health checks answered during the flood (from its first post to its last
   answer): p50, p99 and max latency, and how many failed.

The bodies: the issue's 8 MiB of reports (about 76,000), 2.56 MB of reports (about
23,000: the new default body limit), and a full batch of 10,000 reports (the largest
batch the service takes, 1.1 MB). Old code
refuses the first with 413 only after validating every report; new code refuses it from
its ``Content-Length``, before reading it. The machine's cores are shared by the server,
the flood, the health checks and whatever else runs: compare the rows of one run with
each other, not with another machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import secrets
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from pathlib import Path

import httpx
import numpy as np

from shared.mechanisms import make_mechanism
from shared.schemas import MechanismSpec
from simulations.server import Server, start_server

REPO_ROOT = Path(__file__).resolve().parents[2]
METRIC = "app.theme"
SPEC = MechanismSpec.model_validate({"mechanism": "grr", "epsilon": 2.0, "domain_size": 3})
MIB = 1024 * 1024
#: Health checks: one every this many seconds (after the previous answer).
PROBE_INTERVAL = 0.05
#: RSS within this fraction of the baseline counts as "back".
BACK_WITHIN = 0.2


@contextmanager
def serve(root: Path, workdir: Path) -> Iterator[Server]:
    """``ldp-aggregator serve`` of the checkout at ``root``, until the block ends."""
    database = workdir / f"flood-{secrets.token_hex(4)}.sqlite3"
    server = start_server(str(database), workdir, root=root)
    try:
        yield server
    finally:
        server.stop()


def batch_body(reports: int, rng: np.random.Generator) -> bytes:
    """A valid ``POST /v1/reports`` body of ``reports`` GRR reports of ``METRIC``."""
    mechanism = make_mechanism(SPEC)
    payloads = mechanism.to_payloads(mechanism.encode(rng.integers(0, 3, reports), rng=rng))
    items = [
        {"report_id": str(uuid.UUID(bytes=rng.bytes(16), version=4)), "metric": METRIC,
         "version": 1, "payload": payload}
        for payload in payloads
    ]  # fmt: skip
    return json.dumps({"reports": items}, separators=(",", ":")).encode()


def body_of_size(size: int, rng: np.random.Generator) -> bytes:
    """The body of the most reports that fit in ``size`` bytes."""
    per_report = len(batch_body(100, rng)) / 100
    count = int(size / per_report)
    body = batch_body(count, rng)
    while len(body) > size:
        count -= max(1, (len(body) - size) // int(per_report) + 1)
        body = batch_body(count, rng)
    return body


def memory(pid: int) -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` of process ``pid``, in bytes."""
    values = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            values[key] = int(rest.split()[0]) * 1024
    return values


def probe(url: str, stop: Connection, results: Connection) -> None:
    """Ask ``/healthz`` every ``PROBE_INTERVAL`` s until ``stop`` has a message; send back
    ``(started, seconds, ok)`` of every request."""
    samples: list[tuple[float, float, bool]] = []
    with httpx.Client(timeout=120) as client:
        while not stop.poll():
            started = time.monotonic()
            try:
                ok = client.get(f"{url}/healthz").status_code == 200
            except httpx.HTTPError:
                ok = False
            samples.append((started, time.monotonic() - started, ok))
            time.sleep(PROBE_INTERVAL)
    results.send(samples)


async def flood(server: Server, body: bytes, count: int) -> list[tuple[int, float]]:
    """Post ``body`` ``count`` times at once; ``(status or 0, seconds)`` of each."""
    limits = httpx.Limits(max_connections=count, max_keepalive_connections=0)
    headers = {
        "Authorization": f"Bearer {server.keys['device']}",
        "Content-Type": "application/json",
    }
    async with httpx.AsyncClient(limits=limits, timeout=300) as client:

        async def one() -> tuple[int, float]:
            started = time.monotonic()
            try:
                response = await client.post(
                    f"{server.url}/v1/reports", content=body, headers=headers
                )
                status = response.status_code
            except httpx.HTTPError:
                status = 0
            return status, time.monotonic() - started

        return list(await asyncio.gather(*(one() for _ in range(count))))


def quantile(values: list[float], q: float) -> float:
    return float(np.quantile(values, q)) if values else float("nan")


def run_case(root: Path, body: bytes, bodies: int, settle: float) -> dict[str, object]:
    rng = np.random.default_rng(7)
    with (
        tempfile.TemporaryDirectory(prefix="flood-") as directory,
        serve(root, Path(directory)) as server,
    ):
        headers = {"Authorization": f"Bearer {server.keys['device']}"}
        for _ in range(20):
            small = batch_body(100, rng)
            httpx.post(f"{server.url}/v1/reports", content=small, headers=headers, timeout=60)
            httpx.get(f"{server.url}/healthz", timeout=60)
        time.sleep(2)
        pid = server.process.pid
        baseline = memory(pid)["VmRSS"]
        samples: list[tuple[float, int]] = []
        sampling = threading.Event()

        def sample() -> None:
            while not sampling.is_set():
                samples.append((time.monotonic(), memory(pid)["VmRSS"]))
                time.sleep(0.1)

        stop_send, stop_receive = multiprocessing.Pipe()
        results_receive, results_send = multiprocessing.Pipe(duplex=False)
        prober = multiprocessing.Process(
            target=probe, args=(server.url, stop_receive, results_send)
        )
        prober.start()
        time.sleep(0.5)
        sampler = threading.Thread(target=sample)
        sampler.start()
        started = time.monotonic()
        outcomes = asyncio.run(flood(server, body, bodies))
        ended = time.monotonic()
        time.sleep(settle)
        sampling.set()
        sampler.join()
        stop_send.send(True)
        probes = results_receive.recv()
        prober.join()
        peak = memory(pid)["VmHWM"]
        after = memory(pid)["VmRSS"]
    during = [s for s in probes if started <= s[0] <= ended]
    latencies = [seconds for _, seconds, ok in during if ok]
    back = next(
        (t - ended for t, rss in samples if t >= ended and rss <= baseline * (1 + BACK_WITHIN)),
        None,
    )
    statuses = [status for status, _ in outcomes]
    return {
        "body MiB": len(body) / MIB,
        "healthz p50 s": quantile(latencies, 0.5),
        "healthz p99 s": quantile(latencies, 0.99),
        "healthz max s": max(latencies, default=float("nan")),
        "healthz failed": sum(not ok for _, _, ok in during),
        "upload p50 s": quantile([s for _, s in outcomes], 0.5),
        "upload p99 s": quantile([s for _, s in outcomes], 0.99),
        "accepted": statuses.count(200),
        "413": statuses.count(413),
        "503": statuses.count(503),
        "other": sum(s not in (200, 413, 503) for s in statuses),
        "flood s": ended - started,
        "baseline MiB": baseline / MIB,
        "peak MiB": peak / MIB,
        "after MiB": after / MIB,
        "back in s": "never" if back is None else f"{back:.1f}",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", type=Path, help="another checkout to run first (old code)")
    parser.add_argument("--bodies", type=int, default=200, help="concurrent bodies")
    parser.add_argument("--settle", type=float, default=15.0, help="seconds watched after")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(20261122)
    bodies = {
        "8 MiB": body_of_size(8 * MIB, rng),
        "2.56 MB": body_of_size(2_560_000, rng),
        "10,000 reports": batch_body(10_000, rng),
    }
    roots = [("old", args.compare)] if args.compare else []
    roots.append(("new", REPO_ROOT))
    rows = []
    for kind, body in bodies.items():
        for label, root in roots:
            print(f"{label}: {args.bodies} bodies of {kind} ...", file=sys.stderr, flush=True)
            rows.append(
                {"code": label, "bodies of": kind, **run_case(root, body, args.bodies, args.settle)}
            )
    columns = list(rows[0])
    print(" | ".join(columns))
    for row in rows:
        print(" | ".join(f"{v:.3g}" if isinstance(v, float) else str(v) for v in row.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
