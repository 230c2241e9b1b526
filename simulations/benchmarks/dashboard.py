"""Benchmark of the analyst dashboard: first paint and time to data on loopback, with 100
metrics and a 90-day hourly series.

Run from the repository root (a script, not a test)::

    python -m simulations.benchmarks.dashboard --quick    # one load of each page, ~30 s
    python -m simulations.benchmarks.dashboard            # five loads of each page

Setup. A SQLite file in a temporary directory holds 96 metrics (categorical ``grr``,
``oue`` and ``olh`` over 3 to 64 categories, numeric ``piecewise`` and ``laplace``, and
RAPPOR, each with labels and a description); ``ldp-aggregator serve`` adds its 4 demo
metrics, so the metric list holds 100. Two of them, ``bench.dashboard.categorical``
(``oue``, d = 8, epsilon 1) and ``bench.dashboard.numeric`` (``piecewise`` on [0, 120]),
get statistics in every hour of the last 90 days (2,160 hourly buckets): the
aggregate of ``REPORTS_PER_HOUR`` reports encoded by the metric's mechanism from a
seeded generator, stored as ingestion stores them (``ReportsRepository.add_partial_rows``;
the report ids are not needed here). The service runs as ``ldp-aggregator serve`` on a free
loopback port (``simulations/server.py``).

Measured, with Debian's headless Chromium (``/usr/bin/chromium``) driven by Playwright,
each load in a fresh browser context (empty cache), the analyst key put into the tab's
``sessionStorage`` before the page's scripts run:

* ``first paint``: the page's first contentful paint (Paint Timing API), from the start
  of navigation, for the metric list (``/ui/``) and for a metric page whose window is
  the last 90 days in steps of one hour;
* ``series drawn``: from the start of navigation to the moment the metric page's series
  chart holds all its steps (its estimate and series fetched from the API and drawn):
  2,160 hourly steps, and the 91 daily steps (90 days widened to whole UTC days) the page
  picks itself for a 90-day window;
* the API alone (``httpx``, median of the repetitions): ``GET .../series`` of the 90
  days in hourly steps, and ``GET .../estimate`` of the same window.

The target is first paint under ``TARGET_FIRST_PAINT_MS`` (1 s); the table gives each
figure's ratio to it. There is no peer dashboard to compare with; the service's own API
documentation page (``/docs``: Swagger UI, served locally) is loaded the same way as a
reference.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
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
from simulations.server import Server, start_server

CHROMIUM = Path("/usr/bin/chromium")
TARGET_FIRST_PAINT_MS = 1000.0
DAYS = 90
REPORTS_PER_HOUR = 500
CATEGORICAL = "bench.dashboard.categorical"
NUMERIC = "bench.dashboard.numeric"
#: Metrics the benchmark defines; the service adds its demo metrics to make 100.
DEFINED = 96
KEY_ITEM = "ldp-analyst-key"


@dataclass
class Row:
    what: str
    samples_ms: list[float]
    target_ms: float | None = None

    @property
    def median(self) -> float:
        return statistics.median(self.samples_ms)

    def line(self) -> str:
        ratio = f"{self.median / self.target_ms:8.2f}" if self.target_ms else f"{'-':>8}"
        target = f"{self.target_ms:10.0f}" if self.target_ms else f"{'-':>10}"
        return f"{self.what:<62}{self.median:>10.0f}{max(self.samples_ms):>10.0f}{target}{ratio}"


def definitions() -> dict[str, MetricDefinition]:
    """``DEFINED`` metrics of every common kind, the two with a series among them."""
    found: dict[str, MetricDefinition] = {
        CATEGORICAL: MetricDefinition(
            description="Benchmark: 90 days of hourly statistics.",
            mechanism=MechanismSpec.model_validate(
                {"mechanism": "oue", "epsilon": 1.0, "domain_size": 8}
            ),
            labels=tuple(f"screen-{i}" for i in range(8)),
        ),
        NUMERIC: MetricDefinition(
            description="Benchmark: 90 days of hourly statistics.",
            mechanism=MechanismSpec.model_validate(
                {"mechanism": "piecewise", "epsilon": 1.0, "lower": 0.0, "upper": 120.0}
            ),
        ),
    }
    kinds = ["grr", "oue", "olh", "piecewise", "laplace", "rappor"]
    for i in range(DEFINED - len(found)):
        kind = kinds[i % len(kinds)]
        name = f"bench.dashboard.m{i:03d}-{kind}"
        spec: dict[str, Any] = {"mechanism": kind, "epsilon": 0.5 + (i % 4) * 0.5}
        labels: tuple[str, ...] | None = None
        if kind in ("piecewise", "laplace"):
            spec |= {"lower": 0.0, "upper": 100.0}
        elif kind == "rappor":
            spec = {"mechanism": "rappor", "num_bits": 32, "num_hashes": 2, "num_cohorts": 16,
                    "f": 0.5, "p": 0.25, "q": 0.75}  # fmt: skip
            labels = tuple(f"site-{j}.example" for j in range(12))
        else:
            d = 3 + i % 62
            spec["domain_size"] = d
            labels = tuple(f"value {j}" for j in range(d))
        found[name] = MetricDefinition(
            description=f"Benchmark metric {i} ({kind}).",
            mechanism=MechanismSpec.model_validate(spec),
            labels=labels,
        )
    return found


def hourly_rows(
    name: str, mechanism: Mechanism, now: datetime, rng: np.random.Generator
) -> list[PartialRow]:
    """``DAYS`` x 24 hourly buckets up to ``now``, each the statistics of
    ``REPORTS_PER_HOUR`` reports encoded by ``mechanism``."""
    current = int(now.timestamp()) // 3600 * 3600
    rows = []
    for hour in range(DAYS * 24):
        values: np.ndarray
        if as_numeric(mechanism) is not None:
            values = rng.beta(2.0, 5.0, REPORTS_PER_HOUR) * 120.0
        else:
            values = rng.integers(0, 8, REPORTS_PER_HOUR)
        stats = mechanism.aggregate(mechanism.encode(values, rng=rng))
        rows.append(PartialRow(name, 1, current - hour * 3600, stats.n, stats.to_bytes()))
    return rows


def prepare(database: Path) -> None:
    """Define the metrics and store the two series' statistics (see the module docstring)."""
    services = Services.open(Settings(database=str(database), compaction_interval=0))
    try:
        services.aggregator.define_missing(definitions())
        rng = np.random.default_rng(2026)
        now = datetime.now(UTC)
        for name in (CATEGORICAL, NUMERIC):
            mechanism = services.aggregator.catalog.mechanism(name, 1)
            assert mechanism is not None
            rows = hourly_rows(name, mechanism, now, rng)
            services.repositories.reports.add_partial_rows(rows)
    finally:
        services.close()


def first_paint(page: Any) -> float:
    """The first contentful paint, in ms from the start of navigation."""
    return float(
        page.wait_for_function(
            "() => performance.getEntriesByName('first-contentful-paint')[0]?.startTime"
        ).json_value()
    )


def load_page(browser: Any, server: Server, path: str, series_steps: int | None) -> list[float]:
    """Load ``path`` in a fresh context: [first paint] or [first paint, series drawn]."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    context.add_init_script(f"sessionStorage.setItem({KEY_ITEM!r}, {server.keys['analyst']!r})")
    page = context.new_page()
    page.goto(server.url + path, wait_until="commit")
    measured = [first_paint(page)]
    if series_steps is not None:
        drawn = page.wait_for_function(
            f"""() => {{
                const canvas = document.getElementById("series-chart");
                const chart = canvas && window.Chart && Chart.getChart(canvas);
                return chart && chart.data.labels.length >= {series_steps}
                    && performance.now();
            }}""",
            polling="raf",
            timeout=120_000,
        )
        measured.append(float(drawn.json_value()))
    context.close()
    return measured


def api_times(server: Server, repetitions: int) -> list[Row]:
    end = datetime.now(UTC).replace(minute=0, second=0, microsecond=0).timestamp() + 3600
    start = end - DAYS * 86400
    window = {
        "start": datetime.fromtimestamp(start, UTC).isoformat(),
        "end": datetime.fromtimestamp(end, UTC).isoformat(),
    }
    rows = []
    with httpx.Client(headers=server.headers("analyst"), timeout=300) as client:
        for name in (CATEGORICAL, NUMERIC):
            for route, params in (("series", {**window, "step": "1h"}), ("estimate", window)):
                samples = []
                for _ in range(repetitions):
                    started = time.perf_counter()
                    response = client.get(f"{server.url}/v1/metrics/{name}/{route}", params=params)
                    samples.append((time.perf_counter() - started) * 1000)
                    response.raise_for_status()
                if route == "series":
                    assert len(response.json()["steps"]) == DAYS * 24
                kind = name.rsplit(".", 1)[1]
                what = f"API {route} {kind}, 90 d" + (" hourly" if route == "series" else "")
                rows.append(Row(what, samples))
    return rows


def run(repetitions: int) -> list[Row]:
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory(prefix="bench-dashboard-") as directory:
        workdir = Path(directory)
        database = workdir / "dashboard.sqlite3"
        started = time.perf_counter()
        prepare(database)
        print(f"prepared 100 metrics and 2 x {DAYS * 24} hourly buckets in "
              f"{time.perf_counter() - started:.1f} s", file=sys.stderr)  # fmt: skip
        with start_server(str(database), workdir) as server:
            metrics = httpx.get(f"{server.url}/v1/metrics").json()
            assert len(metrics) == DEFINED + 4, len(metrics)
            rows = api_times(server, repetitions)
            with sync_playwright() as playwright:
                browser = playwright.chromium.launch(
                    executable_path=str(CHROMIUM), args=["--no-sandbox"]
                )
                pages = {
                    "metric list (/ui/, 100 metrics)": ("/ui/", None),
                    "metric page, 90 d hourly (categorical)": (
                        f"/ui/metrics/{CATEGORICAL}?window=90d&step=1h",
                        DAYS * 24,
                    ),
                    "metric page, 90 d hourly (numeric)": (
                        f"/ui/metrics/{NUMERIC}?window=90d&step=1h",
                        DAYS * 24,
                    ),
                    "metric page, 90 d daily (the page's default step)": (
                        f"/ui/metrics/{CATEGORICAL}?window=90d&step=auto",
                        DAYS,
                    ),
                    "reference: API docs (/docs, Swagger UI)": ("/docs", None),
                }
                load_page(browser, server, "/ui/", None)  # the first launch warms up
                for what, (path, steps) in pages.items():
                    loads = [load_page(browser, server, path, steps) for _ in range(repetitions)]
                    rows.append(
                        Row(f"first paint: {what}", [m[0] for m in loads], TARGET_FIRST_PAINT_MS)
                    )
                    if steps is not None:
                        rows.append(Row(f"series drawn: {what}", [m[1] for m in loads]))
                browser.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one repetition of each")
    parser.add_argument("--repetitions", type=int, default=5)
    args = parser.parse_args(argv)
    if not CHROMIUM.exists():
        parser.exit(2, f"dashboard benchmark: {CHROMIUM} is missing (Debian package chromium)\n")
    rows = run(1 if args.quick else args.repetitions)
    print(f"{'what':<62}{'median ms':>10}{'max ms':>10}{'target ms':>10}{'ratio':>8}")
    for row in rows:
        print(row.line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
