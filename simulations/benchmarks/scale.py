"""Benchmark of the simulation paths at scale: users per second, a billion users, Dask.

Run from the repository root (a script, not a test)::

    python -m simulations.benchmarks.scale            # full run, about a minute
    python -m simulations.benchmarks.scale --quick    # smoke run

Three measurements, side by side in one run:

1. **Exact path, users per second**: every user encoded by the mechanism's ``encode``
   and folded by ``aggregate`` (``simulations.accuracy.compute_statistics`` on one work
   unit), d = 1024, epsilon 1, a Zipf(1.1) population of ``--exact-users`` users (ten
   times as many for grr and hr, which are that much faster; one core: in this
   process). Then the same work as two shards on a ``LocalCluster`` of two
   single-threaded worker processes (two cores; the cluster is started and warmed
   before the clock), and the speed-up.
2. **Fast path, a billion users**: ``ldp-sim frequency``'s grid for every categorical
   mechanism (grr, sue, oue, olh, hr, auto) at epsilon 0.5, 1, 2, 4, 8, d = 1024,
   n = 10^9, one repetition each: the statistics drawn from their law. The wall time of
   the whole grid (30 cells), and the largest MSE / theory ratio as a sanity check.
3. **Dask overhead**: ``--overhead-units`` small fast-path units in-process and on a
   ``LocalCluster`` of two: the cluster's start-up time, and the per-unit cost of
   scheduling beside the in-process cost.

Targets (from the simulation specification): exact path at least 10^7 users/s for grr
and 10^6 users/s for oue with d = 1024 on one core; the billion-user fast-path grid in
under 10 s. Rows are marked ``OK`` or ``MISSED``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import time

import numpy as np

from simulations.accuracy import (
    FrequencyCell,
    Unit,
    compute_statistics,
    run_frequency,
    summarize,
)
from simulations.execution import local_cluster
from simulations.populations import parse_categorical_shape

EXACT_TARGETS = {"grr": 1e7, "oue": 1e6}
FAST_TARGET_SECONDS = 10.0
MECHANISMS = ["grr", "sue", "oue", "olh", "hr", "auto"]
EPSILONS = [0.5, 1.0, 2.0, 4.0, 8.0]


def _unit(cell: FrequencyCell, start: int, stop: int, seed: int) -> Unit:
    return Unit(cell, 0, "exact", start, stop, np.random.SeedSequence(seed))


#: grr and hr encode ~30x faster than the unary mechanisms: they get 10x the users, so
#: that every row runs about a second and the two-core figure is not Dask's overhead.
FAST_ENCODERS = {"grr": 10, "hr": 10}


def exact_throughput(base_users: int, client: object | None) -> list[dict[str, object]]:
    shape = parse_categorical_shape("zipf:1.1")
    rows = []
    for name in ["grr", "oue", "sue", "olh", "hr"]:
        users = base_users * FAST_ENCODERS.get(name, 1)
        cell = FrequencyCell(name, 1.0, 1024, users, shape)
        compute_statistics(_unit(cell, 0, min(users, 10_000), 0))  # warm up
        started = time.perf_counter()
        compute_statistics(_unit(cell, 0, users, 1))
        one = users / (time.perf_counter() - started)
        two = float("nan")
        if client is not None:
            half = users // 2
            units = [_unit(cell, 0, half, 2), _unit(cell, half, users, 3)]
            warm = [_unit(cell, 0, 10_000, 4 + i) for i in range(4)]  # both workers, warm
            client.gather(client.map(compute_statistics, warm, pure=False))  # type: ignore[attr-defined]
            started = time.perf_counter()
            client.gather(client.map(compute_statistics, units, pure=False))  # type: ignore[attr-defined]
            two = users / (time.perf_counter() - started)
        target = EXACT_TARGETS.get(name)
        verdict = "" if target is None else ("OK" if one >= target else "MISSED")
        rows.append(
            {"mechanism": name, "users": users, "one_core": one, "two_cores": two,
             "speedup": two / one,
             "target": target, "verdict": verdict}
        )  # fmt: skip
    return rows


def fast_billion(users: int) -> tuple[float, float]:
    shape = parse_categorical_shape("zipf:1.1")
    cells = [FrequencyCell(m, e, 1024, users, shape) for m in MECHANISMS for e in EPSILONS]
    started = time.perf_counter()
    rows = summarize(run_frequency(cells, 1, "fast", seed=0, progress=False))
    seconds = time.perf_counter() - started
    worst = max(max(row["ratio"], 1 / row["ratio"]) for row in rows)
    return seconds, worst


def dask_overhead(units: int) -> dict[str, float]:
    shape = parse_categorical_shape("uniform")
    cells = [FrequencyCell("grr", 1.0, 64, 10_000, shape)]
    started = time.perf_counter()
    run_frequency(cells, units, "fast", seed=0, progress=False)
    in_process = time.perf_counter() - started
    from dask.distributed import Client

    started = time.perf_counter()
    cluster = local_cluster(2)
    client = Client(cluster)
    startup = time.perf_counter() - started
    try:
        plan = [_unit(cells[0], 0, 10_000, i) for i in range(units)]
        fast = [Unit(u.cell, u.rep, "fast", u.start, u.stop, u.seed) for u in plan]
        client.gather(client.map(compute_statistics, fast[:2], pure=False))
        started = time.perf_counter()
        client.gather(client.map(compute_statistics, fast, pure=False))
        on_dask = time.perf_counter() - started
    finally:
        client.close()
        cluster.close()
    return {
        "units": units,
        "in_process_ms_per_unit": 1e3 * in_process / units,
        "dask_ms_per_unit": 1e3 * on_dask / units,
        "cluster_startup_s": startup,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes (smoke run)")
    parser.add_argument("--exact-users", type=int, default=2_000_000)
    parser.add_argument("--fast-users", type=int, default=1_000_000_000)
    parser.add_argument("--overhead-units", type=int, default=400)
    args = parser.parse_args(argv)
    if args.quick:
        args.exact_users, args.overhead_units = 200_000, 50
    print(f"machine: {os.cpu_count()} cpus; exact path n = {args.exact_users:,} per mechanism")

    from dask.distributed import Client

    cluster = local_cluster(2)
    client = Client(cluster)
    client.run(importlib.import_module, "simulations.accuracy")  # imports done before timing
    try:
        rows = exact_throughput(args.exact_users, client)
    finally:
        client.close()
        cluster.close()
    print("\n1. exact path, d = 1024, epsilon 1 (users per second)")
    print(
        f"{'mechanism':<10}{'users':>12}{'one core':>12}{'two cores':>12}{'speed-up':>10}  target"
    )
    for row in rows:
        target = "" if row["target"] is None else f">= {row['target']:.0e} {row['verdict']}"
        print(
            f"{row['mechanism']:<10}{row['users']:>12,}{row['one_core']:>12.3g}"
            f"{row['two_cores']:>12.3g}{row['speedup']:>10.2f}  {target}"
        )
    seconds, worst = fast_billion(args.fast_users)
    verdict = "OK" if seconds < FAST_TARGET_SECONDS else "MISSED"
    print(
        f"\n2. fast path: {len(MECHANISMS)} mechanisms x {len(EPSILONS)} epsilons, d = 1024, "
        f"n = {args.fast_users:.0e}: {seconds:.2f} s (target < {FAST_TARGET_SECONDS:g} s: "
        f"{verdict}); largest MSE/theory ratio (either way) {worst:.2f}"
    )
    overhead = dask_overhead(args.overhead_units)
    print(
        f"\n3. Dask LocalCluster of 2: start-up {overhead['cluster_startup_s']:.2f} s; "
        f"{overhead['units']} small units: {overhead['in_process_ms_per_unit']:.2f} ms/unit "
        f"in-process vs {overhead['dask_ms_per_unit']:.2f} ms/unit on Dask"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
