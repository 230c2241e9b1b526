"""Benchmark of RAPPOR: the reference regression-test setups, and a large decode.

Run from the repository root (a script, not a test)::

    python -m simulations.benchmarks.rappor            # full run, a few minutes
    python -m simulations.benchmarks.rappor --quick    # smoke run
    python -m simulations.benchmarks.rappor --repeats 10 --output rappor.csv

Setups (google/rappor ``tests/regtest_spec.py`` and ``tests/gen_counts.R``): 100 true
values v1..v100 whose shares follow one of five shapes, exp (proportional to
e^(-5x/100)), gauss (normal density on -49..50, sd 100/6), unif, zipf1 (1/x) and zipf1.5
(x^-1.5); the candidates are the true values except the 10 matching ``v[0-9]*9$`` (the
reference's "10%" missing strings) plus 100 decoys v101..v200, as in its demo rows. The
RAPPOR parameters are the demo's (k=32, h=1, m=64, p=0.25, q=0.75, f=0.5) at 10^5 and
10^6 reports, and the regression tests' eps_1 ~ 1 (k=8, h=2, m=128, p=0.39, q=0.61,
f=0.45) at 10^6 reports. One report per device, as the reference's "small" cases.

Each case runs ``--repeats`` times. The first run is the device path: every device has a
fresh 16-byte secret and a uniformly drawn cohort, ``encode`` perturbs its value (the
``enc s`` column times it), ``aggregate`` sums the bits (``agg s``). The other runs draw
the same statistics through ``Rappor.simulate_statistics`` (exact in distribution, O(V m h)
whatever n). The metrics are averaged over the runs, with the reference's definitions
(``tests/compare_dist.R``): ``tv`` total variation between the true shares and the
detected strings' proportions over the union of both; ``fp`` detected strings that no
device holds; ``fn`` true strings not detected (the 10 missing from the candidates
included, as in the reference); ``am`` allocated mass, the detected proportions' sum.

Decoders, side by side on the same statistics:

* ``ours``: ``estimate(stats, candidates)`` with its defaults: Benjamini-Hochberg at a
  false discovery rate of 0.2 (the reference's own false-positive share is near 0.1);
* ``bh.1``: the same fit, Benjamini-Hochberg at a false discovery rate of 0.1;
* ``bonf``: the same fit, Bonferroni over the candidates at alpha = 0.05 (probability
  of any false positive at most ~5%);
* ``2sd``: the same fit with the reference's own rule, an estimate above 2 standard
  errors and no multiple-testing correction (``correction="none"``, alpha =
  1 - Phi(2)): the comparison of the estimators at equal rules;
* ``ref``: a port of the reference decoder (``analysis/R/decode.R``, ``Decode``) on the
  same statistics: per-cohort fractions t_jb / N_j, the unweighted constrained least
  squares of ``alternative.R`` (x >= 0, sum x <= 1, and each bin's fit at most
  min(1, max(0.01, Y + 3 sd))), run 5 times (the estimates, then 4 copies with
  N(0, sd^2) noise and sd * sqrt(2)), reporting the strings whose mean exceeds
  1e-6 + 2 sample sds. Its LASSO stage (glmnet) only runs when the candidates exceed
  0.8 m k, which none of these cases do, so it is not ported. The resampling makes it
  random: seeded here.

The published regression-test pages of google/rappor show these metrics per run, but the
figures themselves were not available to this benchmark, so the reference decoder is
compared by running its algorithm (above) on the same statistics, not by quoting numbers.

The large case: 10^4 candidates (1000 true strings with Zipf(1) shares and 9000 decoys),
k = 128, h = 2, m = 64, p = 0.25, q = 0.75, f = 0.5, 10^7 reports through the fast path;
target: decoded in under a minute on one core.
"""

from __future__ import annotations

import argparse
import csv
import math
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import NormalDist
from typing import Any, Literal

import numpy as np

from shared.mechanisms import DeviceContext
from shared.mechanisms.rappor import Rappor, RapporEstimate, RapporSpec
from shared.mechanisms.rappor_decode import nonnegative_qp
from shared.statistics import CountStatistics

SHAPES = ("exp", "gauss", "unif", "zipf1", "zipf1.5")
VALUES = 100
DECOYS = 100
MISSING = re.compile(r"v[0-9]*9$")
DEMO = {"num_bits": 32, "num_hashes": 1, "num_cohorts": 64, "f": 0.5, "p": 0.25, "q": 0.75}
EPS_1 = {"num_bits": 8, "num_hashes": 2, "num_cohorts": 128, "f": 0.45, "p": 0.39, "q": 0.61}
CASES: tuple[tuple[str, dict[str, Any], int], ...] = (
    ("demo", DEMO, 10**5),
    ("demo", DEMO, 10**6),
    ("eps_1", EPS_1, 10**6),
)
LARGE: dict[str, Any] = {
    "num_bits": 128,
    "num_hashes": 2,
    "num_cohorts": 64,
    "f": 0.5,
    "p": 0.25,
    "q": 0.75,
}
LARGE_TRUE, LARGE_CANDIDATES, LARGE_REPORTS = 1000, 10_000, 10**7
LARGE_TARGET_SECONDS = 60.0
#: The reference decoder's resampling runs and its detection rule (decode.R).
REF_RUNS = 5
REF_SDS = 2.0
#: Our operating points: (correction, alpha) per decoder name; "ref" is the port.
OURS: dict[str, tuple[Literal["bonferroni", "bh", "none"], float]] = {
    "ours": ("bh", 0.2),
    "bh.1": ("bh", 0.1),
    "bonf": ("bonferroni", 0.05),
    "2sd": ("none", 1 - NormalDist().cdf(2.0)),
}
DECODERS = (*OURS, "ref")


def shape_pdf(shape: str, size: int = VALUES) -> np.ndarray:
    """``ComputePdf`` of google/rappor tests/gen_counts.R, normalized."""
    x = np.arange(1, size + 1, dtype=np.float64)
    if shape == "exp":
        weights = np.exp(-5 * x / size)
    elif shape == "gauss":
        half = size // 2
        grid = np.arange(-half + 1, half + 1, dtype=np.float64)
        weights = np.exp(-0.5 * (grid / (size / 6)) ** 2)
    elif shape == "unif":
        weights = np.ones(size)
    elif shape == "zipf1":
        weights = 1 / x
    elif shape == "zipf1.5":
        weights = x**-1.5
    else:
        raise ValueError(f"unknown shape {shape!r}")
    return weights / weights.sum()


@dataclass
class Metrics:
    tv: float
    fp: int
    fn: int
    am: float


def metrics(detected: dict[str, float], truth: dict[str, float]) -> Metrics:
    """tests/compare_dist.R: TV over the union, false positives and negatives, allocated mass."""
    actual = {name for name, share in truth.items() if share > 0}
    union = actual | set(detected)
    tv = 0.5 * sum(abs(truth.get(name, 0.0) - detected.get(name, 0.0)) for name in union)
    return Metrics(
        tv, len(set(detected) - actual), len(actual - set(detected)), sum(detected.values())
    )


def detected_of(est: RapporEstimate) -> dict[str, float]:
    return {
        name: float(share)
        for name, share, hit in zip(est.candidates, est.frequencies, est.detected, strict=True)
        if hit
    }


# ---------------------------------------------------------------------------------------
# The reference decoder, ported
# ---------------------------------------------------------------------------------------


def reference_decode(
    mech: Rappor, stats: CountStatistics, candidates: list[str], rng: np.random.Generator
) -> dict[str, float]:
    """``Decode`` of google/rappor analysis/R/decode.R (no LASSO stage: see the module doc)."""
    counts = mech.bloom_counts(stats)
    live = counts.reports > 0
    reports = counts.reports[live][:, None]
    p11, p01 = mech.q_star, mech.p_star
    shares = counts.counts[live] / reports  # EstimateBloomCounts: estimates
    clamped = np.clip(shares, 0.0, 1.0)
    expected = clamped * p11 + (1 - clamped) * p01
    sds = np.sqrt(reports * expected * (1 - expected)) / (p11 - p01) / reports
    k = mech.num_bits
    bits = mech.candidate_bits(candidates)[:, live, :]
    design = np.zeros((int(live.sum()) * k, len(candidates)))
    cells = bits + (np.arange(int(live.sum())) * k)[None, :, None]
    columns = np.repeat(np.arange(len(candidates)), int(live.sum()))
    for hash_index in range(bits.shape[2]):  # the reference's 0/1 "map" matrix
        design[cells[:, :, hash_index].reshape(-1), columns] = 1.0
    gram = design.T @ design
    runs = []
    for run in range(REF_RUNS):
        if run == 0:
            target, spread = shares, sds
        else:  # Resample(): estimates + N(0, sd), sd * sqrt(2)
            target, spread = shares + rng.normal(0.0, sds), sds * math.sqrt(2)
        y = target.reshape(-1)
        caps = np.clip(target + 3 * spread, 0.01, 1.0).reshape(-1)  # MakeH
        coef = _sum_constrained(gram, design.T @ y)
        if np.any(design @ coef > caps + 1e-12):  # the bin caps bind: the full QP
            coef = _capped_fit(design, y, caps, coef)
        runs.append(coef)
    table = np.array(runs) * stats.n
    mean, sd = table.mean(axis=0), table.std(axis=0, ddof=1)
    reported = mean > 1e-6 + REF_SDS * sd
    return {
        name: math.floor(value) / stats.n
        for name, value, keep in zip(candidates, mean, reported, strict=True)
        if keep
    }


def _capped_fit(
    design: np.ndarray, y: np.ndarray, caps: np.ndarray, start: np.ndarray
) -> np.ndarray:
    """alternative.R's lsei problem with its bin caps: x >= 0, sum x <= 1, design x <= caps.

    Solved by SLSQP on the caps that bind, adding any cap the solution violates until
    none does (the caps left out are then inactive, so this is the full problem's optimum).
    """
    from scipy import optimize

    gram, target = design.T @ design, design.T @ y  # 1/2 ||Ax - y||^2 = 1/2 x'Gx - b'x + c
    coef = start
    active = np.zeros(0, dtype=np.int64)
    for _ in range(50):
        violated = np.flatnonzero(design @ coef > caps + 1e-9)
        new = np.setdiff1d(violated, active)
        if not new.size:
            break
        active = np.union1d(active, new)
        rows, bounds = design[active], caps[active]
        result = optimize.minimize(
            lambda x: 0.5 * float(x @ gram @ x) - float(target @ x),
            coef,
            jac=lambda x: gram @ x - target,
            method="SLSQP",
            bounds=[(0.0, None)] * design.shape[1],
            constraints=[
                {"type": "ineq", "fun": lambda x: 1.0 - x.sum(), "jac": lambda x: -np.ones_like(x)},
                {
                    "type": "ineq",
                    "fun": lambda x, rows=rows, bounds=bounds: bounds - rows @ x,
                    "jac": lambda x, rows=rows: -rows,
                },
            ],
            options={"maxiter": 1000, "ftol": 1e-14},
        )
        coef = np.maximum(result.x, 0.0)
    return coef


def _sum_constrained(gram: np.ndarray, target: np.ndarray) -> np.ndarray:
    """argmin 1/2 x'Gx - b'x over x >= 0, sum x <= 1 (bisection on the sum's multiplier)."""
    coef = nonnegative_qp(gram, target)
    if coef.sum() <= 1.0:
        return coef
    low, high = 0.0, float(max(target.max(), 0.0)) + 1.0
    for _ in range(100):
        mu = (low + high) / 2
        coef = nonnegative_qp(gram, target - mu, coef)
        if coef.sum() > 1.0:
            low = mu
        else:
            high = mu
    coef = nonnegative_qp(gram, target - high, coef)
    return coef / max(1.0, coef.sum())


# ---------------------------------------------------------------------------------------
# The cases
# ---------------------------------------------------------------------------------------


@dataclass
class Row:
    setup: str
    k: int
    h: int
    m: int
    n: int
    shape: str
    epsilon_one: float
    epsilon_infinity: float
    encode_s: float = math.nan
    aggregate_s: float = math.nan
    decode_s: dict[str, float] = field(default_factory=dict)
    results: dict[str, list[Metrics]] = field(default_factory=dict)

    def mean(self, decoder: str, name: str) -> float:
        return float(np.mean([getattr(item, name) for item in self.results[decoder]]))


def device_statistics(
    mech: Rappor, names: list[str], counts: np.ndarray, rng: np.random.Generator
) -> tuple[CountStatistics, float, float]:
    """Every device encodes its value (fresh secret, uniform cohort); returns the timings."""
    n = int(counts.sum())
    values = np.array(names, dtype=object)[
        rng.permutation(np.repeat(np.arange(len(names)), counts))
    ]
    cohorts = rng.integers(0, mech.num_cohorts, n)
    secrets = rng.integers(0, 256, (n, 16), dtype=np.uint8)
    start = time.perf_counter()
    reports = mech.encode(values, rng, DeviceContext(secrets=secrets, cohorts=cohorts))
    encoded = time.perf_counter()
    stats = mech.aggregate(reports)
    return stats, encoded - start, time.perf_counter() - encoded


def run_case(
    setup: str, params: dict[str, Any], n: int, shape: str, repeats: int, seed: int
) -> Row:
    mech = Rappor(RapporSpec.model_validate({"mechanism": "rappor", **params}))
    names = [f"v{i}" for i in range(1, VALUES + 1)]
    candidates = [name for name in names if not MISSING.search(name)] + [
        f"v{i}" for i in range(VALUES + 1, VALUES + DECOYS + 1)
    ]
    row = Row(
        setup,
        mech.num_bits,
        mech.num_hashes,
        mech.num_cohorts,
        n,
        shape,
        mech.epsilon_one,
        mech.epsilon_infinity,
    )
    row.results = {decoder: [] for decoder in DECODERS}
    row.decode_s = {decoder: 0.0 for decoder in DECODERS}
    rng = np.random.default_rng([seed, n, SHAPES.index(shape), params["num_bits"]])
    bits = mech.candidate_bits(names)
    for repeat in range(repeats):
        counts = rng.multinomial(n, shape_pdf(shape))
        if repeat == 0:
            stats, row.encode_s, row.aggregate_s = device_statistics(mech, names, counts, rng)
        else:
            stats = mech.simulate_statistics(names, counts, rng, bits=bits)
        truth = dict(zip(names, counts / n, strict=True))
        for decoder in DECODERS:
            start = time.perf_counter()
            if decoder == "ref":
                found = reference_decode(mech, stats, candidates, rng)
            else:
                correction, alpha = OURS[decoder]
                est = mech.estimate(
                    stats, candidates=candidates, correction=correction, alpha=alpha
                )
                found = detected_of(est)
            row.decode_s[decoder] += (time.perf_counter() - start) / repeats
            row.results[decoder].append(metrics(found, truth))
    return row


@dataclass
class LargeResult:
    candidates: int
    true_strings: int
    n: int
    simulate_s: float
    decode_s: float
    selected: int
    detected: int
    fp: int
    fn: int
    tv: float
    am: float
    smallest_detectable: float


def run_large(seed: int, reports: int = LARGE_REPORTS) -> LargeResult:
    mech = Rappor(RapporSpec.model_validate({"mechanism": "rappor", **LARGE}))
    rng = np.random.default_rng([seed, 7])
    names = [f"string-{i}" for i in range(LARGE_TRUE)]
    shares = 1 / np.arange(1, LARGE_TRUE + 1)
    counts = rng.multinomial(reports, shares / shares.sum())
    start = time.perf_counter()
    stats = mech.simulate_statistics(names, counts, rng)
    simulated = time.perf_counter()
    candidates = names + [f"decoy-{i}" for i in range(LARGE_CANDIDATES - LARGE_TRUE)]
    est = mech.estimate(stats, candidates=candidates)
    decoded = time.perf_counter()
    truth = dict(zip(names, counts / reports, strict=True))
    result = metrics(detected_of(est), truth)
    return LargeResult(
        len(candidates),
        LARGE_TRUE,
        reports,
        simulated - start,
        decoded - simulated,
        int(est.selected.sum()),
        int(est.detected.sum()),
        result.fp,
        result.fn,
        result.tv,
        result.am,
        est.smallest_detectable_frequency,
    )


# ---------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------


def print_rows(rows: list[Row]) -> None:
    header = (
        f"{'setup':<6}{'k':>4}{'h':>3}{'m':>5}{'n':>9} {'shape':<8}{'eps1':>6}{'epsinf':>7}"
        f"{'enc s':>7}{'agg s':>7} | " + " | ".join(f"{decoder:^27}" for decoder in DECODERS)
    )
    sub = (
        " " * 72
        + " | "
        + " | ".join(f"{'tv':>6}{'fp':>5}{'fn':>5}{'am':>6}{'dec s':>6}" for _ in DECODERS)
    )
    print(header)
    print(sub)
    for row in rows:
        cells = " | ".join(
            f"{row.mean(d, 'tv'):>6.3f}{row.mean(d, 'fp'):>5.1f}{row.mean(d, 'fn'):>5.1f}"
            f"{row.mean(d, 'am'):>6.3f}{row.decode_s[d]:>6.2f}"
            for d in DECODERS
        )
        print(
            f"{row.setup:<6}{row.k:>4}{row.h:>3}{row.m:>5}{row.n:>9} {row.shape:<8}"
            f"{row.epsilon_one:>6.3f}{row.epsilon_infinity:>7.3f}{row.encode_s:>7.2f}"
            f"{row.aggregate_s:>7.2f} | {cells}"
        )


def summarize(rows: list[Row], large: LargeResult | None) -> list[str]:
    """Where ours does not match the reference port (averages over the runs)."""
    notes = []
    for decoder in DECODERS:
        averages = {m: np.mean([row.mean(decoder, m) for row in rows]) for m in ("tv", "fp", "fn")}
        notes.append(
            f"{decoder:>5}: mean over the cases tv {averages['tv']:.3f}, fp {averages['fp']:.2f}, "
            f"fn {averages['fn']:.1f}"
        )
    for decoder in OURS:
        wins = {
            metric: sum(
                row.mean(decoder, metric) <= row.mean("ref", metric) + 1e-12 for row in rows
            )
            for metric in ("tv", "fp", "fn")
        }
        notes.append(
            f"{decoder} vs ref: tv no worse in {wins['tv']}/{len(rows)} cases, fp in "
            f"{wins['fp']}/{len(rows)}, fn in {wins['fn']}/{len(rows)}"
        )
    ours = {m: np.mean([row.mean("ours", m) for row in rows]) for m in ("tv", "fp", "fn")}
    ref = {m: np.mean([row.mean("ref", m) for row in rows]) for m in ("tv", "fp", "fn")}
    worse = [m for m in ours if ours[m] > ref[m] + 1e-12]
    if worse:
        notes.append(f"MISSED: the default decoder's mean {', '.join(worse)} above the reference's")
    if large is not None and large.decode_s > LARGE_TARGET_SECONDS:
        notes.append(f"MISSED: large decode took {large.decode_s:.1f} s > {LARGE_TARGET_SECONDS} s")
    return notes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs per case (first: device path)")
    parser.add_argument("--seed", type=int, default=2014)
    parser.add_argument(
        "--quick", action="store_true", help="10^5 reports, 2 runs, small large case"
    )
    parser.add_argument("--no-large", action="store_true", help="skip the 10^4-candidate case")
    parser.add_argument("--output", type=Path, help="write the rows as CSV")
    args = parser.parse_args(argv)
    import scipy.linalg
    import scipy.optimize
    import scipy.sparse  # noqa: F401  (imported before timing: decode imports them lazily)

    cases = [(s, p, min(n, 10**5) if args.quick else n) for s, p, n in CASES]
    repeats = 2 if args.quick else args.repeats
    rows = [
        run_case(setup, params, n, shape, repeats, args.seed)
        for setup, params, n in cases
        for shape in SHAPES
    ]
    print(f"RAPPOR decoding, means over {repeats} runs (run 1 through the device path)")
    print_rows(rows)
    large = None
    if not args.no_large:
        large = run_large(args.seed, 10**6 if args.quick else LARGE_REPORTS)
        print(
            f"\nLarge: {large.candidates} candidates ({large.true_strings} true, Zipf(1)), k=128 "
            f"h=2 m=64, n={large.n:,} (fast path {large.simulate_s:.2f} s): decoded in "
            f"{large.decode_s:.1f} s (target < {LARGE_TARGET_SECONDS:.0f} s); LASSO kept "
            f"{large.selected}, detected {large.detected}, fp {large.fp}, fn {large.fn}, "
            f"tv {large.tv:.3f}, am {large.am:.3f}, smallest detectable frequency "
            f"{large.smallest_detectable:.5f}"
        )
    print()
    for note in summarize(rows, large):
        print(note)
    if args.output:
        with args.output.open("w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(
                [
                    "setup",
                    "k",
                    "h",
                    "m",
                    "n",
                    "shape",
                    "epsilon_one",
                    "epsilon_infinity",
                    "encode_s",
                    "aggregate_s",
                    "decoder",
                    "tv",
                    "fp",
                    "fn",
                    "am",
                    "decode_s",
                ]
            )
            for row in rows:
                for decoder in DECODERS:
                    writer.writerow(
                        [
                            row.setup,
                            row.k,
                            row.h,
                            row.m,
                            row.n,
                            row.shape,
                            row.epsilon_one,
                            row.epsilon_infinity,
                            row.encode_s,
                            row.aggregate_s,
                            decoder,
                        ]
                        + [row.mean(decoder, metric) for metric in ("tv", "fp", "fn", "am")]
                        + [row.decode_s[decoder]]
                    )
        if large is not None:
            print(f"large case: {asdict(large)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
