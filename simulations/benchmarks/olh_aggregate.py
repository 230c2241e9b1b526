"""Benchmark of OLH aggregation: seconds per ``aggregate`` call, from one report to 10^6.

Run from the repository root (a script, not a test)::

    python -m simulations.benchmarks.olh_aggregate --quick     # smoke run, seconds
    python -m simulations.benchmarks.olh_aggregate             # full run
    python -m simulations.benchmarks.olh_aggregate --baseline OLD/shared/mechanisms/olh.py

Each row aggregates n reports of ``encode`` (uniform values, a seeded generator) at
domain size d and epsilon, in this process on one core, and prints the best of several
runs (``time.perf_counter``; the best run is the least disturbed by other processes).
With ``--baseline``, the given file (another version of ``shared/mechanisms/olh.py``) is
loaded under another module name and its ``OptimizedLocalHashing.aggregate`` timed on the
same reports in the same run, so the ratio ``x`` (baseline seconds over ours) compares
the two under the same load; the two results must be equal statistics, or the row says
``DIFFER``. A baseline slower than ``--baseline-limit`` seconds in its first run is run
once; it is not run on one report at d = 2^20, epsilon 0.5 (2^19 items per report), where
a walk that costs P per step takes over ten minutes.

The cost to expect (``shared.mechanisms.olh``): a report supports at most ceil(P / g)
items (P the smallest prime >= d, g = round(e^eps) + 1), and the aggregate touches
O(n P / g + P) entries.

Targets (MISS lines, the run exits with status 1): one report at d = 2^20, epsilon 4
in under 10 ms; with a baseline, 10^6 reports at d = 1024 no slower than it (within
``NOISE`` of its time, since the two runs share a loaded machine).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import numpy as np

from shared.mechanisms.olh import OlhSpec, OptimizedLocalHashing
from shared.statistics import CountStatistics
from simulations.benchmarks.mechanisms import times

#: One report at the largest domain: the time it may take.
ONE_REPORT_DOMAIN = 1 << 20
ONE_REPORT_SECONDS = 0.010
#: The many-report cell that must not get slower than the baseline, and the noise allowed.
MANY_REPORTS = (10**6, 1024)
NOISE = 0.05


@dataclass(frozen=True)
class Case:
    n: int
    d: int
    epsilon: float
    compare: bool = True  # time the baseline too (when one is given)


FULL = (
    *(Case(1, 1 << k, 1.0) for k in (14, 16)),
    *(Case(1, 1 << k, 4.0) for k in (14, 16, 18, 20)),
    Case(1, 1 << 20, 0.5, compare=False),
    Case(100, 1 << 20, 4.0),
    Case(10**4, 1 << 16, 4.0),
    *(Case(10**6, 1024, eps) for eps in (0.5, 1.0, 4.0)),
)
QUICK = (
    Case(1, 1 << 14, 4.0),
    Case(1, 1 << 16, 4.0),
    Case(1, 1 << 20, 4.0),
    Case(1000, 1 << 14, 4.0),
    Case(10**5, 1024, 1.0),
)

HEADER = (
    f"{'n':>8} {'d':>8} {'eps':>4} {'g':>5} {'items/rep':>9} | {'ours s':>9} "
    f"{'base s':>9} {'x':>7}  check"
)


def load_baseline(path: Path) -> ModuleType:
    """The file at ``path`` as a module named ``olh_baseline`` (the registry is untouched)."""
    spec = importlib.util.spec_from_file_location("olh_baseline", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load a module from {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "OptimizedLocalHashing"):
        raise SystemExit(f"{path} defines no OptimizedLocalHashing")
    return module


def best_seconds(run: Callable[[], CountStatistics], repeats: int, limit: float) -> float:
    """The least of ``repeats`` timed calls (one call if the first took over ``limit``)."""
    best = float("inf")
    for attempt in range(repeats):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
        if attempt == 0 and best > limit:
            break
    return best


def seconds_text(value: float) -> str:
    return f"{value * 1e3:.2f}ms" if value < 1 else f"{value:.2f}s"


def measure(
    case: Case, baseline: ModuleType | None, repeats: int, limit: float
) -> tuple[str, list[str]]:
    """One row of the table, and the targets it misses."""
    spec = OlhSpec(mechanism="olh", epsilon=case.epsilon, domain_size=case.d)
    ours = OptimizedLocalHashing(spec)
    rng = np.random.default_rng(case.n * 7919 + case.d)
    reports = ours.encode(rng.integers(0, case.d, case.n), rng=rng)
    result = ours.aggregate(reports)
    seconds = best_seconds(lambda: ours.aggregate(reports), repeats, limit)
    items = -(-ours.prime // ours.buckets)
    row = (
        f"{case.n:>8} {case.d:>8} {case.epsilon:>4g} {ours.buckets:>5} {items:>9} | "
        f"{seconds_text(seconds):>9} "
    )
    misses = []
    label = f"n = {case.n}, d = {case.d}, eps = {case.epsilon:g}"
    if (case.n, case.d, case.epsilon) == (1, ONE_REPORT_DOMAIN, 4.0):
        if seconds >= ONE_REPORT_SECONDS:
            misses.append(f"{label}: {seconds_text(seconds)} (target < 10 ms)")
    if baseline is None or not case.compare:
        return row + f"{'-':>9} {'-':>7}  -", misses
    old = baseline.OptimizedLocalHashing(spec)
    old_result = old.aggregate(reports)
    old_seconds = best_seconds(lambda: old.aggregate(reports), repeats, limit)
    check = "equal" if old_result == result else "DIFFER"
    if check == "DIFFER":
        misses.append(f"{label}: the statistics differ from the baseline's")
    if (case.n, case.d) == MANY_REPORTS and seconds > (1 + NOISE) * old_seconds:
        misses.append(f"{label}: {seconds_text(seconds)} against {seconds_text(old_seconds)}")
    row += f"{seconds_text(old_seconds):>9} {times(old_seconds / seconds):>7}  {check}"
    return row, misses


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: small cases")
    parser.add_argument(
        "--baseline", type=Path, help="another version of shared/mechanisms/olh.py to compare"
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per cell (best)")
    parser.add_argument(
        "--baseline-limit",
        type=float,
        default=5.0,
        help="seconds: a first run slower than this is not repeated",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    baseline = load_baseline(args.baseline) if args.baseline else None
    print(HEADER)
    misses: list[str] = []
    for case in QUICK if args.quick else FULL:
        row, missed = measure(case, baseline, args.repeats, args.baseline_limit)
        print(row, flush=True)
        misses += missed
    for miss in misses:
        print(f"MISS: {miss}")
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
