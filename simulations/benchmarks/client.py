"""Benchmark of the client SDK: what ``TelemetryClient.record`` costs, and what a queued
report weighs.

Run from the repository root (a script, not a test)::

    python -m simulations.benchmarks.client --quick      # smoke run, about 30 s
    python -m simulations.benchmarks.client              # 20,000 records per cell, ~1-2 min
    python -m simulations.benchmarks.client --records 50000 --output client.csv

It starts one real aggregator (``ldp-aggregator serve`` on a free loopback port, SQLite
in a temporary directory) and defines one metric per cell: ``grr`` and ``oue`` with
d = 16 and d = 1024, and ``piecewise`` (epsilon 1 throughout). Every cell runs in a
fresh process (``multiprocessing`` spawn), so that one cell's memory and background
uploads do not disturb the next, and every cell runs in two modes:

* ``offline``: the uploader points at an unreachable endpoint (a loopback port nothing
  listens on), so records only queue in the outbox. The metric spec is cached first by
  a session against the real aggregator on the same state directory, as on a device
  that restarts without network. SDK defaults otherwise: once 512 reports wait, every
  ``record`` notifies the uploader thread, which wakes (and, while its spec refresh has
  not succeeded, tries the network again).
* ``idle``: the same, with a batch size larger than the run, so the uploader thread
  never wakes during it: the cost of ``record`` alone.
* ``online``: the uploader points at the real aggregator with the SDK's defaults
  (batches of 512, every 5 s), so batches are posted in the background while records
  are made; ``record`` shares the interpreter with the uploader thread.

For each, after ``--warmup`` unmeasured records (the spec fetch, the ledger's
reservation ramp), it times ``--records`` calls one by one (``time.perf_counter_ns``)
and prints the mean, p50 and p99 in microseconds. Values are drawn up front from a
seeded generator (categories uniform over d, numbers uniform over the range); the SDK
perturbs them with the OS CSPRNG, as on a device. The ledger's limits are set high so
that no cap is reached; the ledger still makes a durable debit (write, fsync, rename)
for every reservation (up to ``client.ledger.MAX_RESERVED_REPORTS`` reports).

Memory (idle and offline modes, where reports accumulate): the outbox's JSON bytes per queued
report (what ``Outbox`` counts against its byte bound), the on-disk bytes per report of
the outbox's SQLite files (main file and WAL), and the growth of the process's resident
set (``VmRSS``) over the measured records, scaled to 10,000 queued reports.

Stages (idle mode, same process, same objects, after the measured run): the parts of a
record timed separately over ``--stage-records`` calls each: spec lookup and value check
(``TelemetryClient._lookup`` and the value conversion), ledger debit
(``PrivacyLedger.debit``, amortized over reservations), ``encode`` of one value,
``to_payloads``, the outbox insert (``Outbox.add`` of one prebuilt report: JSON and one
SQLite commit), the uploader's ``notify`` (a wake-up of its thread when a batch waits:
free here, as in ``idle`` mode it never has one), and the envelope (report id, hour
stamp: the report dict around the payload, with a fresh ``random_uuid4`` and a fixed
hour stamp, the SDK's cached one). It reads the client's private attributes (its
``_lookup``, ``_ledger``, ``_outbox`` and ``_uploader``) to time them; ``sum`` is their
total, beside the measured mean of ``record``.

Target (from the SDK's specification): ``record`` under ``TARGET_MEAN_US`` microseconds
on average for grr and oue with d <= 1024. Rows it applies to are marked ``OK`` or
``MISSED`` (every mode is shown; ``idle`` is the cost of ``record`` itself).
"""

from __future__ import annotations

import argparse
import csv
import multiprocessing
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from simulations.benchmarks.ingest import Server, free_port, start_server

TARGET_MEAN_US = 50.0
EPSILON = 1.0
NUMERIC_RANGE = (0.0, 100.0)
#: (mechanism, domain size); None: numeric.
CELLS: tuple[tuple[str, int | None], ...] = (
    ("grr", 16),
    ("grr", 1024),
    ("oue", 16),
    ("oue", 1024),
    ("piecewise", None),
)
MODES = ("idle", "offline", "online")
STAGES = (
    "lookup+check",
    "ledger debit",
    "encode",
    "to_payloads",
    "outbox add",
    "notify",
    "envelope",
)
#: Modes where reports accumulate (memory is measured there).
QUEUING = ("idle", "offline")


def metric_name(mechanism: str, domain: int | None) -> str:
    return f"bench.client.{mechanism}" + (f"-{domain}" if domain is not None else "")


def definition(mechanism: str, domain: int | None) -> dict[str, Any]:
    spec: dict[str, Any] = {"mechanism": mechanism, "epsilon": EPSILON}
    if domain is None:
        spec["lower"], spec["upper"] = NUMERIC_RANGE
    else:
        spec["domain_size"] = domain
    return {"description": "client benchmark metric", "mechanism": spec}


@dataclass
class Cell:
    """One measured (mechanism, d, mode)."""

    mechanism: str
    domain: int | None
    mode: str
    records: int = 0
    mean_us: float = float("nan")
    p50_us: float = float("nan")
    p99_us: float = float("nan")
    max_us: float = float("nan")
    queued: int = 0
    json_bytes_per_report: float = float("nan")
    file_bytes_per_report: float = float("nan")
    rss_kib_per_10k: float = float("nan")
    stages_us: dict[str, float] = field(default_factory=dict)
    error: str = ""

    @property
    def target(self) -> str:
        if self.mechanism not in ("grr", "oue") or (self.domain or 0) > 1024:
            return "-"
        if self.error or not self.mean_us == self.mean_us:
            return "?"
        return "OK" if self.mean_us < TARGET_MEAN_US else "MISSED"


def rss_kib() -> int:
    """The resident set of this process, in KiB (``VmRSS`` of ``/proc/self/status``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def outbox_file_bytes(state: Path) -> int:
    return sum(path.stat().st_size for path in state.glob("outbox.sqlite3*"))


def draw_values(mechanism: str, domain: int | None, count: int, seed: int) -> list[Any]:
    rng = np.random.default_rng(seed)
    if domain is None:
        return [float(x) for x in rng.uniform(*NUMERIC_RANGE, size=count)]
    return [int(x) for x in rng.integers(0, domain, size=count)]


def measure_cell(
    mechanism: str,
    domain: int | None,
    mode: str,
    url: str,
    device_key: str,
    workdir: str,
    records: int,
    warmup: int,
    stage_records: int,
    seed: int,
) -> Cell:
    """One cell, in the calling (fresh) process; see the module docstring."""
    from client import BudgetLimits, TelemetryClient

    cell = Cell(mechanism, domain, mode)
    metric = metric_name(mechanism, domain)
    state = Path(tempfile.mkdtemp(prefix=f"{mechanism}-{domain}-{mode}-", dir=workdir))
    limits = BudgetLimits(per_metric_per_period=1e12, total_per_period=1e12, lifetime=float("inf"))
    values = draw_values(mechanism, domain, warmup + records, seed)
    with TelemetryClient(url, device_key, state, limits=limits) as first:
        first.record(metric, values[0])  # fetches and caches the spec
        first.flush(timeout=30.0)
    endpoint = url if mode == "online" else f"http://127.0.0.1:{free_port()}"
    batch_size = 2 * (warmup + records + stage_records) if mode == "idle" else 512
    client = TelemetryClient(endpoint, device_key, state, limits=limits, batch_size=batch_size)
    try:
        for value in values[1:warmup]:
            client.record(metric, value)
        before_rss, before_queued = rss_kib(), client.queued
        before_bytes, before_file = client._outbox.queued_bytes, outbox_file_bytes(state)
        samples = np.empty(records, dtype=np.int64)
        clock = time.perf_counter_ns
        record = client.record
        for i, value in enumerate(values[warmup:]):
            started = clock()
            record(metric, value)
            samples[i] = clock() - started
        after_rss = rss_kib()
        cell.records = records
        micro = samples / 1_000.0
        cell.mean_us = float(micro.mean())
        cell.p50_us, cell.p99_us = (float(x) for x in np.percentile(micro, [50, 99]))
        cell.max_us = float(micro.max())
        if mode in QUEUING:
            added = client.queued - before_queued
            cell.queued = client.queued
            cell.json_bytes_per_report = (client._outbox.queued_bytes - before_bytes) / added
            cell.file_bytes_per_report = (outbox_file_bytes(state) - before_file) / added
            cell.rss_kib_per_10k = (after_rss - before_rss) / added * 10_000
            if mode == "idle":
                cell.stages_us = time_stages(client, metric, values[:stage_records])
        else:
            cell.rss_kib_per_10k = (after_rss - before_rss) / records * 10_000
            client.flush(timeout=60.0)
            cell.queued = client.queued
    finally:
        client.close(timeout=0.0 if mode in QUEUING else 30.0)
    return cell


def time_stages(client: Any, metric: str, values: list[Any]) -> dict[str, float]:
    """Mean microseconds of each stage of ``record`` (private attributes of the SDK)."""
    from client import sdk
    from shared.mechanisms import as_categorical

    clock = time.perf_counter_ns
    spec, digest, mechanism = client._lookup(metric)
    categories = as_categorical(mechanism)
    context = client._context(digest)

    def timed(action: Any, items: list[Any]) -> tuple[float, list[Any]]:
        results = []
        started = clock()
        for item in items:
            results.append(action(item))
        return (clock() - started) / 1_000.0 / len(items), results

    def check(value: Any) -> Any:
        client._lookup(metric)
        if categories is not None:
            return sdk.category_index(spec, categories.domain_size, value)
        return sdk.numeric_value(metric, value)

    stages: dict[str, float] = {}
    stages["lookup+check"], encoded = timed(check, values)
    stages["ledger debit"], _ = timed(
        lambda _: client._ledger.debit(metric, spec.mechanism.epsilon), values
    )
    stages["encode"], reports = timed(
        lambda values: mechanism.encode(values, context=context), encoded
    )
    stages["to_payloads"], payloads = timed(lambda r: mechanism.to_payloads(r)[0], reports)
    stamp = "2026-01-01T00:00:00Z"

    def envelope(payload: dict[str, Any]) -> dict[str, Any]:
        return {
            "report_id": sdk.random_uuid4(),
            "metric": spec.name,
            "version": spec.version,
            "payload": payload,
            "time": stamp,
        }

    stages["envelope"], prebuilt = timed(envelope, payloads)
    stages["outbox add"], _ = timed(lambda report: client._outbox.add([report]), prebuilt)
    stages["notify"], _ = timed(lambda _: client._uploader.notify(), values)
    return stages


def run_cell_in_process(arguments: tuple[Any, ...]) -> dict[str, Any]:
    """Entry point of a spawned worker: returns the cell as a dict (or its error)."""
    try:
        return asdict(measure_cell(*arguments))
    except Exception as error:  # noqa: BLE001 - reported in the table
        mechanism, domain, mode = arguments[:3]
        return asdict(Cell(mechanism, domain, mode, error=repr(error)[:300]))


def print_cells(cells: list[Cell]) -> None:
    header = (
        f"{'mechanism':<10}{'d':>6} {'mode':<8}{'records':>9}{'mean us':>9}{'p50 us':>8}"
        f"{'p99 us':>8}{'max us':>9}  target (< {TARGET_MEAN_US:g} us mean)"
    )
    print(header)
    print("-" * len(header))
    for c in cells:
        domain = "-" if c.domain is None else str(c.domain)
        if c.error:
            print(f"{c.mechanism:<10}{domain:>6} {c.mode:<8} error: {c.error}")
            continue
        print(
            f"{c.mechanism:<10}{domain:>6} {c.mode:<8}{c.records:>9,}{c.mean_us:>9.1f}"
            f"{c.p50_us:>8.1f}{c.p99_us:>8.1f}{c.max_us:>9.0f}  {c.target}"
        )


def print_memory(cells: list[Cell]) -> None:
    header = (
        f"{'mechanism':<10}{'d':>6} {'mode':<8}{'queued':>9}"
        f"{'JSON B/report':>15}{'file B/report':>15}{'RSS KiB per 10k':>17}"
    )
    print(header)
    print("-" * len(header))
    for c in cells:
        if c.mode not in QUEUING or c.error:
            continue
        domain = "-" if c.domain is None else str(c.domain)
        print(
            f"{c.mechanism:<10}{domain:>6} {c.mode:<8}{c.queued:>9,}"
            f"{c.json_bytes_per_report:>15.0f}{c.file_bytes_per_report:>15.0f}"
            f"{c.rss_kib_per_10k:>17.0f}"
        )


def print_stages(cells: list[Cell]) -> None:
    header = (
        f"{'mechanism':<10}{'d':>6}"
        + "".join(f"{name:>13}" for name in STAGES)
        + f"{'sum':>8}{'record':>8}"
    )
    print(header)
    print("-" * len(header))
    for c in cells:
        if c.mode != "idle" or c.error or not c.stages_us:
            continue
        domain = "-" if c.domain is None else str(c.domain)
        total = sum(c.stages_us.values())
        print(
            f"{c.mechanism:<10}{domain:>6}"
            + "".join(f"{c.stages_us[name]:>13.1f}" for name in STAGES)
            + f"{total:>8.1f}{c.mean_us:>8.1f}"
        )


def write_csv(path: Path, cells: list[Cell]) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(
            [
                "mechanism",
                "d",
                "mode",
                "records",
                "mean_us",
                "p50_us",
                "p99_us",
                "max_us",
                "target",
                "queued",
                "json_bytes_per_report",
                "file_bytes_per_report",
                "rss_kib_per_10k",
                *[f"stage_{name}_us" for name in STAGES],
                "error",
            ]
        )
        for c in cells:
            writer.writerow(
                [
                    c.mechanism,
                    c.domain if c.domain is not None else "",
                    c.mode,
                    c.records,
                    f"{c.mean_us:.3f}",
                    f"{c.p50_us:.3f}",
                    f"{c.p99_us:.3f}",
                    f"{c.max_us:.3f}",
                    c.target,
                    c.queued,
                    f"{c.json_bytes_per_report:.1f}",
                    f"{c.file_bytes_per_report:.1f}",
                    f"{c.rss_kib_per_10k:.1f}",
                    *[f"{c.stages_us.get(name, float('nan')):.3f}" for name in STAGES],
                    c.error,
                ]
            )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3,000 records per cell")
    parser.add_argument("--records", type=int, help="timed records per cell (default 20,000)")
    parser.add_argument("--warmup", type=int, default=600, help="unmeasured records first")
    parser.add_argument(
        "--stage-records", type=int, help="calls per stage in the breakdown (default 5,000)"
    )
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--output", type=Path, help="write the rows as CSV")
    args = parser.parse_args(argv)
    args.records = args.records or (3_000 if args.quick else 20_000)
    args.stage_records = args.stage_records or (1_000 if args.quick else 5_000)
    if args.records < 1 or args.warmup < 2 or args.stage_records < 1:
        parser.error("--records and --stage-records must be positive, --warmup at least 2")
    args.stage_records = min(args.stage_records, args.warmup + args.records)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cells: list[Cell] = []
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="ldp-client-bench-") as tmp:
        workdir = Path(tmp)
        server: Server = start_server(str(workdir / "aggregator.sqlite3"), workdir, 1)
        try:
            for mechanism, domain in CELLS:
                response = httpx.put(
                    f"{server.url}/v1/metrics/{metric_name(mechanism, domain)}",
                    json=definition(mechanism, domain),
                    headers=server.headers("admin"),
                    timeout=30.0,
                )
                response.raise_for_status()
            print(
                f"{os.cpu_count()} cores; epsilon {EPSILON:g}; {args.records:,} timed records per "
                f"cell after {args.warmup:,} unmeasured; state directories under {tmp}\n"
            )
            for index, (mechanism, domain) in enumerate(CELLS):
                for mode in MODES:
                    arguments = (
                        mechanism,
                        domain,
                        mode,
                        server.url,
                        server.keys["device"],
                        str(workdir),
                        args.records,
                        args.warmup,
                        args.stage_records,
                        args.seed + index,
                    )
                    with context.Pool(1) as pool:
                        result = pool.apply(run_cell_in_process, (arguments,))
                    cells.append(Cell(**result))
        finally:
            server.stop()
    print("record() cost, one call at a time (microseconds)")
    print_cells(cells)
    print("\nMemory of queued reports")
    print_memory(cells)
    print("\nWhere a record's time goes (idle mode; mean microseconds per call)")
    print_stages(cells)
    missed = [c for c in cells if c.target == "MISSED"]
    if missed:
        print(
            f"\nMISSED: record() mean under {TARGET_MEAN_US:g} us for grr/oue with d <= 1024 in "
            + ", ".join(f"{c.mechanism} d={c.domain} {c.mode} ({c.mean_us:.0f} us)" for c in missed)
        )
    if args.output is not None:
        write_csv(args.output, cells)
        print(f"\nwrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
