"""Benchmark of the poisoning defences (issue 29): what fake devices gain, with and without
each defence, and what the defences cost honest estimates.

Run from the repository root (a script, not a test)::

    python -m simulations.benchmarks.poisoning_bench --quick    # smoke run, seconds
    python -m simulations.benchmarks.poisoning_bench            # the issue's sizes, minutes
    python -m simulations.benchmarks.poisoning_bench --out poisoning.json

Three tables, each row with its ratio and the issue's target:

1. **MGA frequency gain** (Cao, Jia and Gong, USENIX Security 2021, the maximal gain
   attack; fake reports from ``simulations.attacks.fake_reports``, its theory from
   ``simulations.attacks.expected_gain``) against ``grr``, ``oue`` and ``olh``: beta = 5%
   fake devices among all, r = 10 targets drawn uniformly, d = 1024, epsilon 1, n = 10^5
   honest devices whose values follow Zipf(1.1) over a seeded permutation of the items.
   The gain is sum_t (f~_t - f_t) over the targets, f the honest devices' true frequencies.
   Defences: ``none``; ``normalization`` (the estimate projected onto the simplex,
   Norm-Sub, ``Estimate.postprocessed``); ``detection`` (``shared.fake_detection``: the
   estimate from the reports not flagged; unary encodings and olh only); ``refusal``
   (reports breaking a refusal rule dropped, ``Mechanism.refusals``; MGA's reports are
   built to look honest, so it survives where no rule catches it); ``all`` (refusal, then
   detection, then normalization). Mean gain over reps with its standard error; ratio =
   mean defended gain / mean undefended gain, with the delta-method standard error.
   Target: ``all`` cuts the gain on OUE and OLH to at most 0.5 of the undefended gain.
2. **One forged laplace report** (epsilon 1, [0, 100], n = 1000 honest devices with
   uniform values): the shift of the mean when the largest accepted report is added,
   under no refusal (only ``check_reports``' 2^-60 structural bound), the refusal rule at
   2^-40 (``laplace.noise_tail``), and the winsorized mean (``BoundedInfluence.robust_mean``
   with the refusal rule). Divided by the largest shift one honest report of the same run
   makes (leave-one-out, exact from sums: |v_i - mean of the others| / n, v_i the report's
   value under the same estimator, winsorized for the robust mean), and by (upper - lower)
   / n. Target: the robust mean's ratio at most 2 (mean over runs).
3. **Honest cost**: the MSE of each defence's estimate on honest reports only, over its
   undefended MSE (frequencies: summed over the d items, from the reps of table 1;
   numeric: the robust mean against the plain mean over the runs of table 2). Target: at
   most 1.05.

Lines ``MISS`` name a target not met; the run then exits with status 1.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shared.fake_detection import detect_fake_reports
from shared.integrity import as_bounded_influence, as_profiled
from shared.mechanisms import as_numeric, make_mechanism
from shared.schemas import MechanismSpec
from simulations.attacks import expected_gain, fake_reports, numeric_fake_reports

#: Targets of the issue.
GAIN_RATIO_TARGET = 0.5
INFLUENCE_RATIO_TARGET = 2.0
MSE_RATIO_TARGET = 1.05
#: Mechanisms whose reports the detection reads (several items supported per report).
DETECTABLE = frozenset({"oue", "olh"})
DEFENCES = ("none", "normalization", "detection", "refusal", "all")


@dataclass(frozen=True)
class Settings:
    users: int
    reps: int
    numeric_runs: int


FULL = Settings(users=100_000, reps=5, numeric_runs=400)
QUICK = Settings(users=20_000, reps=2, numeric_runs=60)


@dataclass(frozen=True)
class Summary:
    """Mean and standard error of the mean of a few repetitions."""

    mean: float
    se: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Summary:
        array = np.asarray(values, dtype=np.float64)
        se = float(array.std(ddof=1) / math.sqrt(array.size)) if array.size > 1 else math.nan
        return cls(float(array.mean()), se)


def ratio_of_means(top: Sequence[float], bottom: Sequence[float]) -> Summary:
    """mean(top) / mean(bottom), its standard error by the delta method over paired reps:
    Var(A / B) ~ (Var A - 2 R Cov(A, B) + R^2 Var B) / (reps B^2), R = A / B."""
    a, b = np.asarray(top, np.float64), np.asarray(bottom, np.float64)
    ratio = float(a.mean() / b.mean())
    if a.size < 2:
        return Summary(ratio, math.nan)
    cov = np.cov(a, b)
    variance = (cov[0, 0] - 2 * ratio * cov[0, 1] + ratio**2 * cov[1, 1]) / a.size
    return Summary(ratio, float(math.sqrt(max(variance, 0.0)) / abs(b.mean())))


def categorical(name: str, epsilon: float, d: int) -> Any:
    spec = {"mechanism": name, "epsilon": epsilon, "domain_size": d}
    return make_mechanism(MechanismSpec.model_validate(spec))


def zipf_population(n: int, d: int, rng: np.random.Generator) -> np.ndarray:
    """n values, Zipf(1.1) over a random permutation of the d items."""
    weights = 1.0 / np.arange(1, d + 1) ** 1.1
    return rng.permutation(d)[rng.choice(d, size=n, p=weights / weights.sum())]


def defended_frequencies(
    mech: Any, reports: np.ndarray, defence: str
) -> tuple[np.ndarray, np.ndarray] | None:
    """The frequency estimate under one defence and the mask of the reports it kept, or
    None where the defence does not apply."""
    kept = np.ones(reports.shape[0], dtype=bool)
    if defence in ("refusal", "all"):
        kept &= mech.refusals(reports) < 0
    if defence in ("detection", "all") and mech.name in DETECTABLE:
        remaining = np.flatnonzero(kept)
        kept[remaining[detect_fake_reports(mech, reports[remaining]).flagged]] = False
    elif defence == "detection":
        return None
    estimate = mech.estimate(mech.aggregate(reports[kept]))
    if defence in ("normalization", "all"):
        return np.asarray(estimate.postprocessed().frequencies), kept
    return np.asarray(estimate.frequencies), kept


def gain_table(settings: Settings, seed: int, beta: float, targets: int, d: int) -> list[dict]:
    """Table 1 and the frequency rows of table 3."""
    rows: list[dict[str, Any]] = []
    for name in ("grr", "oue", "olh"):
        mech = categorical(name, 1.0, d)
        gains: dict[str, list[float]] = {defence: [] for defence in DEFENCES}
        dropped_fakes: dict[str, list[float]] = {defence: [] for defence in DEFENCES}
        dropped_honest: dict[str, list[float]] = {defence: [] for defence in DEFENCES}
        honest_mse: dict[str, list[float]] = {defence: [] for defence in DEFENCES}
        theory: list[float] = []
        started = time.perf_counter()
        for rep in range(settings.reps):
            rng = np.random.default_rng([seed, rep, len(name)])
            values = zipf_population(settings.users, d, rng)
            truth = np.bincount(values, minlength=d) / values.size
            chosen = np.sort(rng.choice(d, size=targets, replace=False))
            fakes_count = round(beta * settings.users / (1 - beta))
            honest = mech.encode(values, rng=rng)
            forged = fake_reports(mech, "mga", chosen, fakes_count, rng)
            attacked = np.concatenate([honest, forged])
            theory.append(expected_gain(mech, "mga", chosen, beta, truth))
            is_fake = np.arange(attacked.shape[0]) >= honest.shape[0]
            for defence in DEFENCES:
                under_attack = defended_frequencies(mech, attacked, defence)
                if under_attack is None:
                    continue
                frequencies, kept = under_attack
                gains[defence].append(float(np.sum(frequencies[chosen] - truth[chosen])))
                dropped_fakes[defence].append(float(np.mean(~kept[is_fake])))
                dropped_honest[defence].append(float(np.mean(~kept[~is_fake])))
                clean = defended_frequencies(mech, honest, defence)
                assert clean is not None
                honest_mse[defence].append(float(np.sum((clean[0] - truth) ** 2)))
        seconds = time.perf_counter() - started
        for defence in DEFENCES:
            if not gains[defence]:
                continue
            rows.append(
                {
                    "mechanism": name,
                    "defence": defence,
                    "gain": Summary.of(gains[defence]).__dict__,
                    "theory_undefended": float(np.mean(theory)),
                    "fakes_dropped": float(np.mean(dropped_fakes[defence])),
                    "honest_dropped": float(np.mean(dropped_honest[defence])),
                    "gain_ratio": ratio_of_means(gains[defence], gains["none"]).__dict__,
                    "honest_mse_ratio": ratio_of_means(
                        honest_mse[defence], honest_mse["none"]
                    ).__dict__,
                    "seconds": seconds,
                }
            )
    return rows


def laplace_table(settings: Settings, seed: int, n: int) -> list[dict]:
    """Table 2 and the numeric row of table 3: one forged report's reach against an honest
    report's, per estimator."""
    spec = {"mechanism": "laplace", "epsilon": 1.0, "lower": 0.0, "upper": 100.0}
    mech = make_mechanism(MechanismSpec.model_validate(spec))
    profiled, bounded = as_profiled(mech), as_bounded_influence(mech)
    if profiled is None or bounded is None:
        raise RuntimeError("laplace has no profile or robust mean: table 2 needs both")
    numeric = as_numeric(mech)
    assert numeric is not None
    width = numeric.upper - numeric.lower
    largest = numeric_fake_reports(mech, "mean-max", 1, refusal=False)[0]  # check_reports'
    kept = numeric_fake_reports(mech, "mean-max", 1, refusal=True)[0]  # the refusal rule's
    forged_index = {"none": largest, "refusal": kept, "robust": kept}
    for setting in ("refusal", "robust"):
        assert mech.refusals(np.array([forged_index[setting]]))[0] < 0
    assert mech.refusals(np.array([forged_index["none"]]))[0] >= 0
    shifts: dict[str, list[float]] = {key: [] for key in forged_index}
    reaches: dict[str, list[float]] = {key: [] for key in forged_index}
    errors: dict[str, list[float]] = {"plain": [], "robust": []}

    def robust(reports: np.ndarray) -> Any:
        return bounded.robust_mean(mech.aggregate(reports), profiled.profile(reports))

    for run in range(settings.numeric_runs):
        rng = np.random.default_rng([seed, 29, run])
        values = rng.uniform(numeric.lower, numeric.upper, n)
        honest = mech.encode(values, rng=rng)
        truth = float(values.mean())
        plain = numeric.estimate(mech.aggregate(honest)).mean
        clean = robust(honest)
        errors["plain"].append((plain - truth) ** 2)
        errors["robust"].append((clean.mean - truth) ** 2)
        debiased = numeric.debias(honest)
        winsorized = np.clip(debiased, clean.low, clean.high)
        for setting, index in forged_index.items():
            with_forged = np.append(honest, index)
            if setting == "robust":
                shift = robust(with_forged).mean - clean.mean
                own = winsorized
            else:
                shift = numeric.estimate(mech.aggregate(with_forged)).mean - plain
                own = debiased
            others = (own.sum() - own) / (n - 1)
            shifts[setting].append(abs(shift))
            reaches[setting].append(float(np.max(np.abs(own - others)) / n))
    rows: list[dict[str, Any]] = []
    for setting in forged_index:
        ratio = np.asarray(shifts[setting]) / np.asarray(reaches[setting])
        rows.append(
            {
                "mechanism": "laplace",
                "defence": setting,
                "forged_shift": Summary.of(shifts[setting]).__dict__,
                "honest_reach": Summary.of(reaches[setting]).__dict__,
                "influence_ratio": Summary.of(ratio.tolist()).__dict__,
                "range_ratio": Summary.of(
                    (np.asarray(shifts[setting]) * n / width).tolist()
                ).__dict__,
            }
        )
    rows.append(
        {
            "mechanism": "laplace",
            "defence": "robust",
            "honest_mse_ratio": ratio_of_means(errors["robust"], errors["plain"]).__dict__,
        }
    )
    return rows


def fmt(summary: dict[str, float], digits: int = 3) -> str:
    if math.isnan(summary["se"]):
        return f"{summary['mean']:.{digits}f}"
    return f"{summary['mean']:.{digits}f} ± {summary['se']:.{digits}f}"


def render(gain_rows: list[dict], numeric_rows: list[dict]) -> tuple[str, list[str]]:
    """The three tables as text, and the MISS lines."""
    lines, misses = [], []
    lines.append("1. MGA frequency gain (sum over targets), undefended vs each defence")
    header = (
        f"{'mechanism':<9} {'defence':<13} {'gain':>17} {'theory':>7} {'fakes out':>9} "
        f"{'honest out':>10} {'ratio':>16}  target"
    )
    lines += [header, "-" * len(header)]
    for row in gain_rows:
        target = ""
        if row["defence"] == "all" and row["mechanism"] in DETECTABLE:
            met = row["gain_ratio"]["mean"] <= GAIN_RATIO_TARGET
            target = f"<= {GAIN_RATIO_TARGET} {'ok' if met else 'MISS'}"
            if not met:
                misses.append(f"MISS gain ratio {row['mechanism']} all > {GAIN_RATIO_TARGET}")
        theory = f"{row['theory_undefended']:.3f}" if row["defence"] == "none" else ""
        lines.append(
            f"{row['mechanism']:<9} {row['defence']:<13} {fmt(row['gain']):>17} {theory:>7} "
            f"{row['fakes_dropped']:>9.1%} {row['honest_dropped']:>10.3%} "
            f"{fmt(row['gain_ratio']):>16}  {target}"
        )
    lines += ["", "2. one forged laplace report (eps 1, [0, 100]): shift of the mean"]
    header = (
        f"{'estimator':<22} {'forged shift':>16} {'honest reach':>16} {'ratio':>14} "
        f"{'x (range/n)':>14}  target"
    )
    lines += [header, "-" * len(header)]
    names = {
        "none": "plain, 2^-60 bound",
        "refusal": "plain, refusal 2^-40",
        "robust": "winsorized + refusal",
    }
    for row in numeric_rows:
        if "influence_ratio" not in row:
            continue
        target = ""
        if row["defence"] == "robust":
            met = row["influence_ratio"]["mean"] <= INFLUENCE_RATIO_TARGET
            target = f"<= {INFLUENCE_RATIO_TARGET:g} {'ok' if met else 'MISS'}"
            if not met:
                misses.append(f"MISS laplace influence ratio > {INFLUENCE_RATIO_TARGET:g}")
        lines.append(
            f"{names[row['defence']]:<22} {fmt(row['forged_shift']):>16} "
            f"{fmt(row['honest_reach']):>16} {fmt(row['influence_ratio'], 2):>14} "
            f"{fmt(row['range_ratio'], 1):>14}  {target}"
        )
    lines += ["", "3. honest cost: MSE with the defence / MSE without (honest reports only)"]
    header = f"{'mechanism':<9} {'defence':<13} {'MSE ratio':>16}  target"
    lines += [header, "-" * len(header)]
    for row in [*gain_rows, *numeric_rows]:
        if "honest_mse_ratio" not in row or row["defence"] == "none":
            continue
        met = row["honest_mse_ratio"]["mean"] <= MSE_RATIO_TARGET
        if not met:
            misses.append(f"MISS honest MSE ratio {row['mechanism']} {row['defence']}")
        lines.append(
            f"{row['mechanism']:<9} {row['defence']:<13} {fmt(row['honest_mse_ratio']):>16}  "
            f"<= {MSE_RATIO_TARGET} {'ok' if met else 'MISS'}"
        )
    return "\n".join(lines), misses


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: fewer users, reps")
    parser.add_argument("--seed", type=int, default=29, help="seed of every run")
    parser.add_argument("--users", type=int, help="honest devices per rep (table 1)")
    parser.add_argument("--reps", type=int, help="repetitions of table 1")
    parser.add_argument("--out", help="write the rows as JSON to this file")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    base = QUICK if args.quick else FULL
    settings = Settings(
        users=args.users or base.users, reps=args.reps or base.reps, numeric_runs=base.numeric_runs
    )
    started = time.perf_counter()
    gain_rows = gain_table(settings, args.seed, beta=0.05, targets=10, d=1024)
    numeric_rows = laplace_table(settings, args.seed, n=1000)
    text, misses = render(gain_rows, numeric_rows)
    print(
        f"n = {settings.users} honest devices, beta = 5%, r = 10, d = 1024, epsilon 1, "
        f"{settings.reps} reps; laplace n = 1000, {settings.numeric_runs} runs "
        f"({time.perf_counter() - started:.0f} s)"
    )
    print(text)
    for miss in misses:
        print(miss)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            json.dump({"settings": settings.__dict__, "rows": [*gain_rows, *numeric_rows]}, handle)
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
