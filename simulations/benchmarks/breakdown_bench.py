"""Benchmark of breakdowns: ``GET .../estimate?by=a,b`` over 4,096 cells, beside the same
estimate without ``by=``, in one run.

Run from the repository root (a script, not a test)::

    python -m simulations.benchmarks.breakdown_bench
    python -m simulations.benchmarks.breakdown_bench --reports-per-cell 100 --repeat 11

Setup. A SQLite file in a temporary directory holds two metrics with the dimensions
``a`` and ``b`` of 64 values each (64 x 64 = 4,096 cells, the most a metric may have):
``bench.categorical`` (GRR, d = 8, epsilon 2) and ``bench.numeric`` (piecewise, epsilon
1, [0, 120]). Each cell holds the statistics of ``--reports-per-cell`` reports (default
50) in one hourly bucket, encoded by the metric's own mechanism from a seeded generator
(categories uniform, minutes 120 Beta(2, 5)), written as ingestion writes them: one
partial row per (bucket, cell) (``ReportsRepository.add_partial_rows``).

Measured, median of ``--repeat`` runs (default 7) after one warm-up, for each metric:

* in process: ``Aggregator.estimate(name)`` and ``Aggregator.estimate(name, by="a,b")``
  (reading the rows from SQLite, releasing per (bucket, cell), summing the statistics per
  group, 4,096 group estimates, JSON-ready objects);
* over HTTP: ``GET /v1/metrics/{name}/estimate`` and ``...?by=a,b`` (``httpx``, one client
  on the same machine) against a real ``ldp-aggregator serve`` process on a free loopback
  port, the answer serialized to JSON; with the answer's size.

The table gives each median in ms and the ratio of the ``by=`` estimate to the same
estimate without it. Target: ``by=`` over 4,096 cells under ``TARGET_MS`` (200 ms) in
process. The machine may be shared with other work: compare the columns of one run.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from aggregator.service import Services
from aggregator.settings import Settings
from aggregator.storage import PartialRow
from shared.mechanisms import Mechanism, as_numeric
from shared.schemas import MechanismSpec, MetricDefinition
from simulations.server import start_server
from simulations.text import counted

#: The breakdown's two dimensions, 64 values each: 4,096 cells.
DIMENSIONS = {
    "a": tuple(f"a{i:02d}" for i in range(64)),
    "b": tuple(f"b{i:02d}" for i in range(64)),
}
CATEGORICAL, NUMERIC = "bench.categorical", "bench.numeric"
SPECS = {
    CATEGORICAL: {"mechanism": "grr", "epsilon": 2.0, "domain_size": 8},
    NUMERIC: {"mechanism": "piecewise", "epsilon": 1.0, "lower": 0.0, "upper": 120.0},
}
BY = "a,b"
TARGET_MS = 200.0


@dataclass
class Row:
    metric: str
    path: str
    plain_ms: float
    by_ms: float
    groups: int
    by_bytes: int | None

    @property
    def ratio(self) -> float:
        return self.by_ms / self.plain_ms


def cell_rows(
    name: str, mechanism: Mechanism[Any], per_cell: int, bucket: int, rng: np.random.Generator
) -> list[PartialRow]:
    """One partial row per cell: the statistics of ``per_cell`` reports encoded by
    ``mechanism`` (one ``encode`` for all cells, one ``aggregate`` per cell)."""
    cells = 64 * 64
    values: np.ndarray
    if as_numeric(mechanism) is not None:
        values = 120.0 * rng.beta(2.0, 5.0, cells * per_cell)
    else:
        values = rng.integers(0, 8, cells * per_cell)
    reports = mechanism.encode(values, rng=rng)
    rows = []
    for cell in range(cells):
        stats = mechanism.aggregate(reports[cell * per_cell : (cell + 1) * per_cell])
        rows.append(PartialRow(name, 1, bucket, stats.n, stats.to_bytes(), cell))
    return rows


def prepare(database: Path, per_cell: int) -> None:
    """Define the two metrics and store one row per cell of each (module docstring)."""
    services = Services.open(Settings(database=str(database), compaction_interval=0))
    try:
        rng = np.random.default_rng(2027)
        bucket = int(datetime.now(UTC).timestamp()) // 3600 * 3600 - 3600  # the last hour
        for name, spec in SPECS.items():
            definition = MetricDefinition(
                description=f"Breakdown benchmark ({name}).",
                mechanism=MechanismSpec.model_validate(spec),
                dimensions=DIMENSIONS,
            )
            services.aggregator.define(name, definition)
            mechanism = services.aggregator.catalog.mechanism(name, 1)
            assert mechanism is not None
            services.repositories.reports.add_partial_rows(
                cell_rows(name, mechanism, per_cell, bucket, rng)
            )
    finally:
        services.close()


def median_ms(call: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    """The median wall time of ``call`` over ``repeat`` runs after a warm-up, and its answer."""
    answer = call()
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        answer = call()
        times.append(time.perf_counter() - started)
    return 1000.0 * statistics.median(times), answer


def in_process(database: Path, repeat: int) -> list[Row]:
    services = Services.open(
        Settings(database=str(database), min_reports=1, compaction_interval=0), create=False
    )
    rows = []
    try:
        aggregator = services.aggregator
        for name in SPECS:
            plain, _ = median_ms(lambda n=name: aggregator.estimate(n), repeat)  # type: ignore[misc]
            by, answer = median_ms(lambda n=name: aggregator.estimate(n, by=BY), repeat)  # type: ignore[misc]
            rows.append(Row(name, "in process", plain, by, len(answer["groups"]), None))
    finally:
        services.close()
    return rows


def over_http(database: Path, workdir: Path, repeat: int) -> list[Row]:
    rows = []
    with start_server(str(database), workdir) as server, httpx.Client(timeout=120.0) as client:
        headers = server.headers("analyst")

        def get(name: str, **params: str) -> httpx.Response:
            response = client.get(
                f"{server.url}/v1/metrics/{name}/estimate", params=params, headers=headers
            )
            response.raise_for_status()
            return response

        for name in SPECS:
            plain, _ = median_ms(lambda n=name: get(n), repeat)  # type: ignore[misc]
            by, answer = median_ms(lambda n=name: get(n, by=BY), repeat)  # type: ignore[misc]
            groups = len(answer.json()["groups"])
            rows.append(Row(name, "HTTP", plain, by, groups, len(answer.content)))
    return rows


def table(rows: list[Row], per_cell: int, repeat: int) -> str:
    lines = [
        f"estimate?by={BY} over 64 x 64 = 4,096 cells, {counted(per_cell, 'report')} per "
        f"cell in one hourly bucket; median of {repeat}",
        f"{'metric':<20}{'path':<12}{'plain ms':>10}{'by= ms':>10}{'ratio':>8}"
        f"{'groups':>8}{'by= bytes':>12}{'target':>10}",
    ]
    for row in rows:
        size = f"{row.by_bytes:,}" if row.by_bytes is not None else "-"
        target = ("met" if row.by_ms < TARGET_MS else "missed") if row.path == "in process" else "-"
        lines.append(
            f"{row.metric:<20}{row.path:<12}{row.plain_ms:>10.1f}{row.by_ms:>10.1f}"
            f"{row.ratio:>8.1f}{row.groups:>8,}{size:>12}{target:>10}"
        )
    lines.append(f"target: by= over 4,096 cells under {TARGET_MS:.0f} ms in process")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reports-per-cell", type=int, default=50)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="breakdown-bench-") as directory:
        workdir = Path(directory)
        database = workdir / "breakdown.sqlite3"
        prepare(database, args.reports_per_cell)
        rows = in_process(database, args.repeat) + over_http(database, workdir, args.repeat)
    print(table(rows, args.reports_per_cell, args.repeat))


if __name__ == "__main__":
    main()
