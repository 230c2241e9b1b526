"""Benchmark of the memoized mechanisms: accuracy, lifetime epsilon, speed against
multi-freq-ldpy, and what a stateless implementation leaks.

Run from the repository root (a script, not a test)::

    python -m simulations.benchmarks.longitudinal_bench --quick     # smoke run, about a minute
    python -m simulations.benchmarks.longitudinal_bench             # full run, about 5 minutes

One drifting population (``simulations.longitudinal.Population``: Zipf(1.1) categories
over d, uniform numbers on [0, 1], each device drawing a new value with probability
``--change`` each period) and one privacy pair (``--epsilon`` per distinct value,
``--epsilon-report`` per report) for every part:

1. Accuracy and lifetime (``simulate``, ``--reps`` repetitions, more up to ``--max-reps``
   where the ratio's standard error is above ``--se-target``): per-period MSE over the
   analytical variance, with its standard error across repetitions; the lifetime epsilon
   over devices (mean, median, 99th percentile, maximum) beside T x epsilon_report, what
   one-shot reporting spends; and a year of daily reports of one unchanging value, which
   must cost exactly epsilon memoized (365 epsilon_report one-shot).
2. Speed: our encode (memoized: ``SimulatedMemo``, built per block inside the timing) and
   aggregate (including the estimate) rates over ``--n`` devices, best of
   ``SPEED_REPEATS``, against multi-freq-ldpy 0.2.5 (``long_freq_est``: ``L_GRR``,
   ``L_SUE``, ``L_OUE``, ``L_OSUE``, ``dBitFlipPM``) timed by ``peers.time_peer`` on
   ``--peer-n`` devices: one Python call per report, no state between calls.
   ``L_SOUE`` (SUE then OUE) has no counterpart here. dBitFlipPM gives every sampled bit
   epsilon / 2 whatever the number of bits, so with one bit per device its reports are
   epsilon / 2-LDP at the same nominal epsilon.
3. Peer accuracy over the same data (the first ``--peer-n-mse`` devices for
   ``--peer-periods`` periods): the peer's unbiased estimate, taken before its
   aggregator clips and renormalizes (for ``L_*`` its ``MI_long`` is given the
   unclipped f_v = (C_v - n q1 (p2 - q2) - n q2) / (n (p1 - q1)(p2 - q2)) for the call,
   which also shows its chain's (p1, q1, p2, q2); for ``dBitFlipPM`` the paper's
   f_j = (d / (n s)) sum over devices that sampled j of (b (e^(eps/2) + 1) - 1) /
   (e^(eps/2) - 1), from its reports), its MSE over our analytical variance at the same
   data, beside ours; for ``L_*`` also its analytical variance (the frequency-oracle
   formula at its chain's p = p1 p2 + (1 - p1) q2, q = q1 p2 + (1 - q1) q2) over ours.
4. The stateless leak: devices with one unchanging value, uniform over d, report it for
   up to ``--leak-periods`` periods; an adversary guesses each device's value from its
   first t reports (``simulations.longitudinal.reidentified``). Memoized (our
   ``SimulatedMemo``), the success rate stays below e^eps / (e^eps + d - 1), the most
   any guess achieves from one eps-LDP response; stateless (ours with ``memo=None`` and
   multi-freq-ldpy's clients, which redraw the permanent response on every call) it
   climbs towards 1: the average of a device's reports converges to its value.

Checks (the run exits with status 1 when one fails): a year of one value costs exactly
epsilon (memoized) or 365 epsilon_report (one-shot); every mechanism's MSE ratio within
``mechanisms.SUSPICIOUS_Z`` standard errors of 1; every memoized success rate at most the
bound plus the exact binomial margin (``leak_threshold``, false alarm 1e-6 per rate); our
stateless rate at the last t above the bound by more than that. Targets (MISS lines, not
failures): the MSE ratio within 0.9-1.1; at least 20x the peer's encode and aggregate
rates; the peer's MSE not below ours beyond noise; the peer's stateless leak showing by
the last t (its L_GRR reveals less per report than epsilon_report for d > 2, and its
dBitFlipPM epsilon / 2 per bit, so it leaks more slowly).

multi-freq-ldpy is the optional ``bench`` extra; without it the peer columns are
skipped with a message.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import math
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from shared.mechanisms import as_categorical, as_memoized, make_mechanism
from shared.memo import SimulatedMemo
from shared.schemas import MechanismSpec
from simulations.benchmarks import peers as peer_lib
from simulations.benchmarks.mechanisms import (
    MSE_BAND,
    SPEED_TARGET,
    estimated,
    mse_verdict,
    si,
    times,
)
from simulations.longitudinal import (
    MEMOIZED,
    NUMERIC,
    ONE_SHOT,
    Population,
    encode,
    frequency_variances,
    guess_bound,
    leak_threshold,
    make_specs,
    reidentified,
    simulate,
)
from simulations.populations import parse_categorical_shape, parse_numeric_shape
from simulations.text import counted

#: multi-freq-ldpy's module and function prefix for each of our mechanisms it implements.
PEER_PROTOCOLS: dict[str, str] = {
    "lgrr": "L_GRR",
    "lsue": "L_SUE",
    "loue": "L_OUE",
    "losue": "L_OSUE",
    "dbitflip": "dBitFlipPM",
}
PEER_PACKAGE = "multi_freq_ldpy.long_freq_est"
PEER_DISTRIBUTION = "multi-freq-ldpy"
#: Runs of our encode and aggregate whose best rate counts.
SPEED_REPEATS = 3
#: Daily reports of one unchanging value for a year, by this many devices.
YEAR = 365
YEAR_DEVICES = 1000

FULL = {
    "n": 10**6,
    "sim_n": 100_000,
    "periods": 30,
    "domain": 32,
    "reps": 16,
    "se_target": 0.025,
    "max_reps": 128,
    "peer_n": 10_000,
    "peer_time": 3.0,
    "peer_n_mse": 2000,
    "peer_periods": 10,
    "leak_devices": 1000,
    "leak_periods": [1, 10, 30, 100, 200],
}
QUICK = {
    "n": 100_000,
    "sim_n": 20_000,
    "periods": 10,
    "domain": 16,
    "reps": 6,
    "se_target": 0.05,
    "max_reps": 12,
    "peer_n": 500,
    "peer_time": 0.3,
    "peer_n_mse": 300,
    "peer_periods": 4,
    "leak_devices": 400,
    "leak_periods": [1, 10, 100],
}


# ---------------------------------------------------------------------------- the peer


@dataclass
class PeerProtocol:
    """multi-freq-ldpy's version of one of our mechanisms, at our spec's parameters."""

    mechanism: str
    name: str
    module: Any
    encode_one: Callable[[int], Any]
    aggregate: Callable[[list[Any]], np.ndarray]
    report_bytes: int

    def timing_view(self) -> peer_lib.PeerMechanism:
        return peer_lib.PeerMechanism(
            PEER_DISTRIBUTION, self.mechanism, self.name, self.encode_one, self.aggregate,
            self.report_bytes,
        )  # fmt: skip


def peer_status() -> str:
    """``"<version>"`` of multi-freq-ldpy, or ``"unavailable (<reason>)"``."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for name in PEER_PROTOCOLS.values():
                importlib.import_module(f"{PEER_PACKAGE}.{name}")
        return importlib.metadata.version(PEER_DISTRIBUTION)
    except Exception as error:  # noqa: BLE001 - any failure means "not available"
        return f"unavailable ({type(error).__name__}: {error})"


def make_peer(spec: MechanismSpec) -> PeerProtocol | None:
    """The peer's protocol for ``spec`` (None when it has none)."""
    name = PEER_PROTOCOLS.get(spec.mechanism)
    if name is None:
        return None
    module = importlib.import_module(f"{PEER_PACKAGE}.{name}")
    fields = spec.model_dump()  # the published spec: its fields by name
    d, epsilon = int(fields["domain_size"]), spec.epsilon
    if spec.mechanism == "dbitflip":
        bits = int(fields["bits_per_device"])
        client, aggregator = module.dBitFlipPM_Client, module.dBitFlipPM_Aggregator_MI
        return PeerProtocol(
            spec.mechanism, name, module,
            lambda x: client(x, d, d, bits, epsilon),
            lambda reports: np.asarray(aggregator(reports, d, bits, epsilon)),
            8 * d + 112,
        )  # fmt: skip
    report = spec.report_epsilon
    client = getattr(module, f"{name}_Client")
    aggregator = getattr(module, f"{name}_Aggregator_MI")
    if spec.mechanism == "lgrr":
        return PeerProtocol(
            spec.mechanism, name, module,
            lambda x: client(x, d, epsilon, report),
            lambda reports: np.asarray(aggregator(reports, d, epsilon, report)),
            64,
        )  # fmt: skip
    return PeerProtocol(
        spec.mechanism, name, module,
        lambda x: client(x, d, epsilon, report),
        lambda reports: np.asarray(aggregator(reports, epsilon, report)),
        8 * d + 112,
    )  # fmt: skip


@contextmanager
def unclipped(module: Any) -> Iterator[dict[str, float]]:
    """Within the block, ``module``'s MI aggregator returns its unbiased estimate
    f_v = (C_v - n q1 (p2 - q2) - n q2) / (n (p1 - q1)(p2 - q2)) (Arcolezi et al.) instead
    of clipping and renormalizing it; the dict receives the chain's p1, q1, p2 and q2."""
    chain: dict[str, float] = {}
    original = module.MI_long

    def estimate(counts: Any, n: int, p1: float, q1: float, p2: float, q2: float) -> np.ndarray:
        chain.update(p1=float(p1), q1=float(q1), p2=float(p2), q2=float(q2))
        support = np.asarray(counts, dtype=np.float64)
        return (support - n * q1 * (p2 - q2) - n * q2) / (n * (p1 - q1) * (p2 - q2))

    module.MI_long = estimate
    try:
        yield chain
    finally:
        module.MI_long = original


def peer_estimate(
    peer: PeerProtocol, spec: MechanismSpec, reports: list[Any]
) -> tuple[np.ndarray, dict[str, float]]:
    """The peer's unbiased frequencies from ``reports`` and, for ``L_*``, its chain."""
    if spec.mechanism == "dbitflip":
        bits = np.asarray(reports, dtype=np.float64)  # -1 where a bucket was not sampled
        grown = math.exp(spec.epsilon / 2)
        terms = np.where(bits >= 0, (bits * (grown + 1) - 1) / (grown - 1), 0.0)
        d, s = bits.shape[1], int(spec.model_dump()["bits_per_device"])
        return terms.sum(axis=0) * d / (len(reports) * s), {}
    with unclipped(peer.module) as chain:
        frequencies = peer.aggregate(reports)
    return frequencies, chain


def chain_variances(chain: dict[str, float], frequencies: np.ndarray, n: int) -> np.ndarray:
    """Var[f_v] of the peer's chain: the frequency-oracle formula at p = p1 p2 + (1 - p1) q2,
    q = q1 p2 + (1 - q1) q2."""
    p1, q1, p2, q2 = chain["p1"], chain["q1"], chain["p2"], chain["q2"]
    p, q = p1 * p2 + (1 - p1) * q2, q1 * p2 + (1 - q1) * q2
    return (q * (1 - q) / (p - q) ** 2 + frequencies * (1 - p - q) / (p - q)) / n


def peer_support(report: Any, d: int) -> np.ndarray:
    """Which values one peer report supports: an index (L_GRR) one-hot, a bit vector its
    ones (dBitFlipPM marks unsampled buckets -1)."""
    array = np.atleast_1d(np.asarray(report, dtype=np.float64))
    if array.size == 1:
        return np.arange(d) == array[0]
    return array == 1


# ---------------------------------------------------------------------------- parts


@dataclass
class Comparison:
    """One of our memoized mechanisms beside the peer's version of it."""

    mechanism: str
    peer: str = ""
    encode_rate: float = math.nan
    stateless_encode_rate: float = math.nan  # memo=None: a new permanent response each time
    aggregate_rate: float = math.nan
    peer_encode_rate: float = math.nan
    peer_aggregate_rate: float = math.nan
    our_mse_ratio: float = math.nan  # MSE / our variance on the peer's data
    our_mse_se: float = math.nan
    peer_mse_ratio: float = math.nan  # the peer's MSE / our variance, same data
    peer_mse_se: float = math.nan
    variance_ratio: float = math.nan  # the peer's analytical variance / ours
    chain: dict[str, float] = field(default_factory=dict)
    error: str = ""

    @property
    def encode_speedup(self) -> float:
        return self.encode_rate / self.peer_encode_rate

    @property
    def aggregate_speedup(self) -> float:
        return self.aggregate_rate / self.peer_aggregate_rate


def our_rates(spec: MechanismSpec, population: Population, n: int) -> tuple[float, float, float]:
    """Our encode rate (memoized: ``SimulatedMemo`` built inside the timing), stateless
    encode rate (``memo=None``, as the peer) and aggregate rate (with the estimate) over the
    first period's values of n devices, in the population's blocks: best of
    ``SPEED_REPEATS`` each."""
    mech = make_mechanism(spec)
    rng = np.random.default_rng(0)
    sized = replace(population, devices=n, periods=1)
    numeric = spec.mechanism in NUMERIC
    blocks = [(start, next(sized.values(start, numeric))) for start, _ in sized.blocks()]
    best = {"memoized": math.inf, "stateless": math.inf, "aggregate": math.inf}
    for _ in range(SPEED_REPEATS):
        seconds = dict.fromkeys(best, 0.0)
        stats = mech.empty_statistics()
        for start, values in blocks:
            t0 = time.perf_counter()
            memo = SimulatedMemo(np.arange(start, start + values.size), 1)
            reports = encode(mech, values, rng, memo)
            t1 = time.perf_counter()
            stats = stats.merge(mech.aggregate(reports))
            t2 = time.perf_counter()
            encode(mech, values, rng, None)
            seconds["stateless"] += time.perf_counter() - t2
            seconds["memoized"] += t1 - t0
            seconds["aggregate"] += t2 - t1
        t0 = time.perf_counter()
        estimated(mech, stats)
        seconds["aggregate"] += time.perf_counter() - t0
        best = {key: min(value, seconds[key]) for key, value in best.items()}
    return n / best["memoized"], n / best["stateless"], n / best["aggregate"]


def peer_accuracy(
    peer: PeerProtocol, spec: MechanismSpec, population: Population
) -> tuple[float, float, float, dict[str, float]]:
    """(MSE / our variance, its standard error, the peer's analytical variance / ours, the
    chain) of the peer over ``population``'s periods: one report per device and period.

    The peer's periods are independent (it keeps no state), so the ratio's standard error
    is sqrt(2 sum W^2) / sum Var over all periods' estimates, W the peer's own variances:
    its chain's for ``L_*``, ours scaled by the measured ratio for ``dBitFlipPM``.
    """
    mech = as_categorical(make_mechanism(spec))
    assert mech is not None  # the peers' protocols are categorical
    squares, ours, theirs = [], [], []
    chain: dict[str, float] = {}
    for values in population.values(0, numeric=False):
        n = values.size
        truth = np.bincount(values, minlength=mech.domain_size) / n
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            reports = [peer.encode_one(int(v)) for v in values]  # the peer's per-user API
            frequencies, chain = peer_estimate(peer, spec, reports)
        squares.append((frequencies - truth) ** 2)
        ours.append(frequency_variances(mech, truth, n))
        if chain:
            theirs.append(chain_variances(chain, truth, n))
    variances = np.concatenate(ours)
    ratio = float(np.concatenate(squares).sum() / variances.sum())
    own = np.concatenate(theirs) if theirs else ratio * variances
    se = float(math.sqrt(2 * np.sum(own**2)) / variances.sum())
    variance_ratio = float(own.sum() / variances.sum()) if theirs else math.nan
    return ratio, se, variance_ratio, chain


@dataclass
class Leak:
    """Success rates of the adversary after each number of reports (``reidentified``)."""

    mechanism: str
    periods: list[int]
    bound: float
    margin: float
    memoized: list[float] = field(default_factory=list)
    stateless: list[float] = field(default_factory=list)
    peer: list[float] = field(default_factory=list)


def leak(
    spec: MechanismSpec,
    devices: int,
    periods: list[int],
    seed: int,
    peer: PeerProtocol | None,
) -> Leak:
    """The adversary's success memoized, stateless, and against the peer's clients."""
    mech = make_mechanism(spec)
    categories, lifelong = as_categorical(mech), as_memoized(mech)
    assert categories is not None and lifelong is not None  # memoized frequency oracles
    d = categories.domain_size
    bound = guess_bound(lifelong.epsilon_lifetime, d)
    margin = leak_threshold(bound, devices) - bound
    result = Leak(spec.mechanism, list(periods), bound, margin)
    rng = np.random.default_rng([seed, 7])
    values = rng.integers(d, size=devices)
    memo = SimulatedMemo(np.arange(devices), seed)
    result.memoized = reidentified(mech, values, periods, rng, memo)
    result.stateless = reidentified(mech, values, periods, rng, None)
    if peer is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            support = np.array(
                [[peer_support(peer.encode_one(int(v)), d) for v in values]
                 for _ in range(max(periods))]
            )  # fmt: skip
        totals = np.cumsum(support, axis=0)  # (periods, devices, d): what t reports support
        result.peer = [float(np.mean(np.argmax(totals[t - 1], axis=1) == values)) for t in periods]
    return result


# ---------------------------------------------------------------------------- report


def accuracy_lines(rows: list[dict[str, Any]]) -> list[str]:
    header = (
        f"{'mech':<10} {'eps':>4} {'eps_r':>5} {'mse/var':>7} {'se':>5} {'reps':>4} | "
        f"{'mean':>6} {'median':>6} {'p99':>6} {'max':>6} | {'1-shot':>6}"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        lines.append(
            f"{row['mechanism']:<10} {row['epsilon']:>4g} {row['epsilon_report']:>5.3g} "
            f"{row['ratio']:>7.3f} {row['ratio_se']:>5.3f} {row['reps']:>4} | "
            f"{row['lifetime_mean']:>6.3g} "
            f"{row['lifetime_median']:>6.3g} {row['lifetime_p99']:>6.3g} "
            f"{row['lifetime_max']:>6.3g} | {row['one_shot_lifetime']:>6.3g}"
        )
    return lines


def comparison_lines(comparisons: list[Comparison]) -> list[str]:
    """Speed (enc/s memoized; no-memo: ``memo=None``, stateless as the peer; x = memoized /
    peer) and MSE over our analytical variance on the same data."""
    header = (
        f"{'mech':<10} {'peer':<10} {'enc/s':>6} {'no-memo':>7} {'peer':>6} {'x':>5} | "
        f"{'agg/s':>6} {'peer':>6} {'x':>5} | {'ours mse/var':>12} {'peer mse/var':>12} | "
        f"{'peer var/ours':>13}"
    )
    lines = [header, "-" * len(header)]
    for c in comparisons:
        if c.error:
            lines.append(f"{c.mechanism:<10} {c.peer:<10} ERROR {c.error}")
            continue
        compared = bool(c.peer) and math.isfinite(c.peer_mse_ratio)
        ours = f"{c.our_mse_ratio:.3f}+-{c.our_mse_se:.3f}" if compared else "-"
        theirs = f"{c.peer_mse_ratio:.3f}+-{c.peer_mse_se:.3f}" if compared else "-"
        variance = "-" if math.isnan(c.variance_ratio) else f"{c.variance_ratio:.4f}"
        lines.append(
            f"{c.mechanism:<10} {c.peer or '-':<10} {si(c.encode_rate):>6} "
            f"{si(c.stateless_encode_rate):>7} {si(c.peer_encode_rate):>6} "
            f"{times(c.encode_speedup):>5} | {si(c.aggregate_rate):>6} "
            f"{si(c.peer_aggregate_rate):>6} {times(c.aggregate_speedup):>5} | {ours:>12} "
            f"{theirs:>12} | {variance:>13}"
        )
    return lines


def leak_lines(leaks: list[Leak], periods: list[int]) -> list[str]:
    columns = " ".join(f"{f't={t}':>6}" for t in periods)
    header = f"{'mech':<10} {'bound':>6} | {'reports':<16} {columns}"
    lines = [header, "-" * len(header)]
    for item in leaks:
        lines.append(f"{item.mechanism:<10} {item.bound:>6.3f} |")
        for label, rates in (
            ("memoized", item.memoized),
            ("stateless", item.stateless),
            ("peer stateless", item.peer),
        ):
            if rates:
                cells = " ".join(f"{rate:>6.3f}" for rate in rates)
                lines.append(f"{'':<10} {'':>6} | {label:<16} {cells}")
    return lines


def checks(
    rows: list[dict[str, Any]],
    year: list[dict[str, Any]],
    comparisons: list[Comparison],
    leaks: list[Leak],
) -> tuple[list[str], list[str]]:
    """(failed checks, missed targets), one line each (module docstring)."""
    failures, misses = [], []
    low, high = MSE_BAND
    for row in year:
        expected = row["epsilon"] if row["memoized"] else YEAR * row["epsilon_report"]
        if row["lifetime_max"] != expected:
            failures.append(
                f"{row['mechanism']}: a year of one value cost up to {row['lifetime_max']:g}, "
                f"not {expected:g}"
            )
    for row in rows:
        where = f"{row['mechanism']}: mse/var {row['ratio']:.3f} +- {row['ratio_se']:.3f}"
        verdict = mse_verdict(row["ratio"], row["ratio_se"])
        if verdict == "bug":
            failures.append(f"{where} is inconsistent with the analytical variance")
        elif verdict == "noise":
            misses.append(f"{where} outside {low}-{high} (within noise)")
    for c in comparisons:
        if c.error:
            failures.append(f"{c.mechanism} against {c.peer}: {c.error}")
            continue
        for label, speedup in (("encode", c.encode_speedup), ("aggregate", c.aggregate_speedup)):
            if math.isfinite(speedup) and speedup < SPEED_TARGET:
                misses.append(
                    f"{c.mechanism} {label} {speedup:.1f}x {c.peer}'s (target {SPEED_TARGET:g}x)"
                )
        slack = 3 * math.hypot(c.our_mse_se * c.our_mse_ratio, c.peer_mse_se * c.peer_mse_ratio)
        if c.peer_mse_ratio + slack < c.our_mse_ratio:
            misses.append(
                f"{c.mechanism} MSE {c.our_mse_ratio:.3f} against {c.peer}'s "
                f"{c.peer_mse_ratio:.3f} (in units of our variance): worse beyond noise"
            )
    for item in leaks:
        for t, rate in zip(item.periods, item.memoized, strict=True):
            if rate > item.bound + item.margin:
                failures.append(
                    f"{item.mechanism} memoized: {rate:.3f} of guesses right after "
                    f"{counted(t, 'report')}, "
                    f"above the bound {item.bound:.3f} + {item.margin:.3f}"
                )
        for rates, found in ((item.stateless, failures), (item.peer, misses)):
            if rates and not rates[-1] > item.bound + item.margin:
                label = "stateless" if rates is item.stateless else "peer"
                found.append(
                    f"{item.mechanism} {label}: {rates[-1]:.3f} of guesses right after "
                    f"{counted(item.periods[-1], 'report')}, not above the bound "
                    f"{item.bound:.3f} + "
                    f"{item.margin:.3f}: the leak did not show"
                )
    return failures, misses


# ---------------------------------------------------------------------------- main


def number(text: str) -> int:
    """A count, also written as 1e6."""
    return int(float(text))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m simulations.benchmarks.longitudinal_bench",
        description="Memoized mechanisms: accuracy, lifetime epsilon, speed against "
        "multi-freq-ldpy, and the stateless leak.",
    )
    parser.add_argument("--n", type=number, help="devices for the speed runs (1e6)")
    parser.add_argument("--sim-n", type=number, help="devices for the accuracy runs (1e5)")
    parser.add_argument("--periods", type=number, help="periods T of the accuracy runs (30)")
    parser.add_argument("--domain", type=number, help="categories d (32)")
    parser.add_argument("--reps", type=number, help="repetitions of the accuracy runs (16)")
    parser.add_argument(
        "--se-target", type=float, help="more repetitions where the ratio's se is above (0.025)"
    )
    parser.add_argument("--max-reps", type=number, help="at most this many repetitions (128)")
    parser.add_argument("--epsilon", type=float, default=2.0, help="per distinct value")
    parser.add_argument("--epsilon-report", type=float, default=1.0, help="per report")
    parser.add_argument("--change", type=float, default=0.1, help="new-value probability")
    parser.add_argument("--peer-n", type=number, help="devices timed on the peer (1e4)")
    parser.add_argument("--peer-time", type=float, help="seconds per peer measurement (3)")
    parser.add_argument("--peer-n-mse", type=number, help="devices of the peer's MSE (2000)")
    parser.add_argument("--peer-periods", type=number, help="periods of the peer's MSE (10)")
    parser.add_argument("--leak-devices", type=number, help="devices of the leak check (1000)")
    parser.add_argument(
        "--peer-leak-devices", type=number, help="of which the peer's clients report (200)"
    )
    parser.add_argument(
        "--leak-periods",
        type=lambda text: [int(part) for part in text.split(",") if part.strip()],
        help="numbers of reports the adversary averages (1,10,30,100,200)",
    )
    parser.add_argument("--no-peers", action="store_true", help="skip multi-freq-ldpy")
    parser.add_argument("--seed", type=int, default=20240601, help="seed of data and noise")
    parser.add_argument("--output", type=Path, help="write every part's results to this JSON")
    parser.add_argument(
        "--quick", action="store_true", help="small sizes: a smoke run of about a minute"
    )
    args = parser.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    population = Population(
        args.sim_n, args.periods, args.change, args.domain, parse_categorical_shape("zipf:1.1"),
        parse_numeric_shape("uniform"), 0.0, 1.0, args.seed,
    )  # fmt: skip
    specs = make_specs(MEMOIZED + ONE_SHOT, args.epsilon, args.epsilon_report, population)
    memoized = [spec for spec in specs if spec.mechanism in MEMOIZED]
    print(
        f"longitudinal benchmark: epsilon {args.epsilon:g} per distinct value, "
        f"epsilon_report {args.epsilon_report:g} per report, d = {args.domain}, Zipf(1.1) "
        f"categories and uniform numbers on [0, 1], change {args.change:g} per period, "
        f"seed {args.seed}, numpy {np.__version__}"
    )
    status = "skipped (--no-peers)" if args.no_peers else peer_status()
    have_peer = not status.startswith(("unavailable", "skipped"))
    print(f"peer multi-freq-ldpy: {status}")
    if not have_peer and not args.no_peers:
        print("  peer columns skipped: install the bench extra, pip install -e '.[bench]'")

    print(
        f"\n1. accuracy and lifetime epsilon: {counted(args.sim_n, 'device')}, "
        f"{counted(args.periods, 'period')}, {counted(args.reps, 'repetition')} (up to "
        f"{args.max_reps} where se > {args.se_target:g}; mse/var target {MSE_BAND[0]}-"
        f"{MSE_BAND[1]}; lifetime per device against T x epsilon_report one-shot)"
    )
    rows = accurate_rows(population, specs, args.reps, args.se_target, args.max_reps)
    print("\n".join(accuracy_lines(rows)))
    year = replace(population, devices=YEAR_DEVICES, periods=YEAR, change=0.0)
    constant = simulate(year, specs, adversary_devices=0, progress=False).rows
    print(
        f"a year of one unchanging value, {counted(YEAR, 'daily report')} by "
        f"{counted(YEAR_DEVICES, 'device')}: largest lifetime epsilon "
        + ", ".join(f"{row['mechanism']} {row['lifetime_max']:g}" for row in constant)
    )
    sys.stdout.flush()

    print(
        f"\n2-3. speed over {counted(args.n, 'device')} (ours, memo included) against the "
        f"peer on {counted(args.peer_n, 'device')} (x = ours / peer, target "
        f"{SPEED_TARGET:g}); MSE over our variance on the same "
        f"{counted(args.peer_n_mse, 'device')} x {counted(args.peer_periods, 'period')}"
    )
    peer_population = replace(population, devices=args.peer_n_mse, periods=args.peer_periods)
    comparisons = [compare(spec, population, peer_population, args, have_peer) for spec in memoized]
    print("\n".join(comparison_lines(comparisons)))
    sys.stdout.flush()

    print(
        f"\n4. the stateless leak: {counted(args.leak_devices, 'device')} keep one value "
        f"(uniform over d); share of values guessed from the first t reports, against the "
        "bound e^eps / (e^eps + d - 1) that memoization keeps"
    )
    leaks = [
        leak(
            spec,
            args.leak_devices,
            args.leak_periods,
            args.seed,
            make_peer(spec) if have_peer else None,
        )  # fmt: skip
        for spec in memoized
        if spec.mechanism not in NUMERIC
    ]
    print("\n".join(leak_lines(leaks, args.leak_periods)))

    failures, misses = checks(rows, constant, comparisons, leaks)
    print(f"\nfinished in {time.perf_counter() - started:.0f} s")
    for line in failures:
        print(f"  FAIL {line}")
    for line in misses:
        print(f"  MISS {line}")
    if not have_peer:
        print("  NOTE the peer was not run: its speed, MSE and leak targets were not checked")
    if not failures:
        print("  All checks passed" + ("." if misses or not have_peer else "; all targets met."))
    if args.output is not None:
        write_output(args.output, rows, comparisons, leaks)
        print(f"results written to {args.output}")
    return 1 if failures else 0


def accurate_rows(
    population: Population,
    specs: list[MechanismSpec],
    reps: int,
    se_target: float,
    max_reps: int,
) -> list[dict[str, Any]]:
    """``simulate``'s rows at ``reps`` repetitions; a mechanism whose ratio has a standard
    error above ``se_target`` runs again, alone, with the repetitions that should bring it
    there (se falls as 1 / sqrt(reps)), at most ``max_reps``."""
    rows = simulate(population, specs, reps=reps, adversary_devices=0, progress=False).rows
    for index, (spec, row) in enumerate(zip(specs, rows, strict=True)):
        wanted = min(max_reps, math.ceil(reps * (row["ratio_se"] / se_target) ** 2))
        if wanted > reps:
            (rows[index],) = simulate(
                population, [spec], reps=wanted, adversary_devices=0, progress=False
            ).rows
    return rows


def compare(
    spec: MechanismSpec,
    population: Population,
    peer_population: Population,
    args: argparse.Namespace,
    have_peer: bool,
) -> Comparison:
    """Our rates and, when the peer has the mechanism, its rates and both MSEs."""
    result = Comparison(spec.mechanism, PEER_PROTOCOLS.get(spec.mechanism, ""))
    try:
        result.encode_rate, result.stateless_encode_rate, result.aggregate_rate = our_rates(
            spec, population, args.n
        )
        peer = make_peer(spec) if have_peer else None
        if peer is None:
            result.peer = ""
            return result
        values = next(population.values(0, numeric=False))[: args.peer_n]
        timing = peer_lib.time_peer(peer.timing_view(), values, args.peer_time)
        result.peer_encode_rate, result.peer_aggregate_rate = (
            timing.encode_rate,
            timing.aggregate_rate,
        )
        (row,) = simulate(
            peer_population, [spec], reps=max(args.reps, 20), adversary_devices=0,
            progress=False,
        ).rows  # fmt: skip
        result.our_mse_ratio, result.our_mse_se = row["ratio"], row["ratio_se"]
        result.peer_mse_ratio, result.peer_mse_se, result.variance_ratio, result.chain = (
            peer_accuracy(peer, spec, peer_population)
        )
    except Exception as error:  # noqa: BLE001 - report the mechanism and carry on
        result.error = f"{type(error).__name__}: {error}"
    return result


def write_output(
    path: Path, rows: list[dict[str, Any]], comparisons: list[Comparison], leaks: list[Leak]
) -> None:
    """Every part's results as one JSON document (NaN as null)."""

    def clean(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {key: clean(item) for key, item in value.items()}
        if isinstance(value, list):
            return [clean(item) for item in value]
        return value

    document = {
        "accuracy": rows,
        "comparisons": [
            {
                **c.__dict__,
                "encode_speedup": c.encode_speedup,
                "aggregate_speedup": c.aggregate_speedup,
            }
            for c in comparisons
        ],  # fmt: skip
        "leaks": [item.__dict__ for item in leaks],
    }
    path.write_text(json.dumps(clean(document), indent=2) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
