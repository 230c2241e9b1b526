"""Benchmark of every mechanism: speed, accuracy against theory, and the peer libraries.

Run from the repository root (a script, not a test)::

    python -m simulations.benchmarks.mechanisms --quick        # smoke run, seconds
    python -m simulations.benchmarks.mechanisms                # full grid, 20-40 minutes
    python -m simulations.benchmarks.mechanisms --mechanisms olh,oue --domains 1024 \
        --epsilons 1,4 --output results.csv

For each mechanism, epsilon and domain size d (numeric mechanisms have no d) it
prints one row:

* ``enc/s`` and ``agg/s``: our encode and aggregate rates in reports per second
  (``time.perf_counter``), over n users in chunks small enough to keep one
  chunk's reports in memory; ``agg`` includes merging the chunks' statistics
  and the final ``estimate``. Each cell runs several times (for the MSE) and
  the best run's rate counts, the least disturbed by other processes; the peers
  are given the same treatment. The users are a fixed sample: categories from a
  Zipf(1.1) law truncated to d (P(v) proportional to (v + 1)^-1.1), numbers from
  Beta(2, 5) on [0, 1].
* ``mse/var``: empirical mean squared error over the analytical variance.
  Categorical: the squared errors (f_hat_v - f_v)^2 over categories and repeated
  runs, divided by the mean over categories of
  Var[f_v] = q (1 - q) / (n (p - q)^2) + f_v (1 - p - q) / (n (p - q)) at the
  users' true frequencies f_v (the mechanism's own p and q). Numeric:
  (mean_hat - mean)^2 / (mean_i report_variance(x_i) / n). Runs repeat until
  ``MIN_TERMS`` effective squared-error terms or the ``--mse-budget`` seconds
  per cell. ``terms`` counts effective terms: (sum_v Var_v)^2 / sum_v Var_v^2
  per run, which is d when all categories have the same variance and less when
  a few head categories dominate (large eps, where the f_v term of the variance
  matters). The ratio should be 1 (target band 0.9-1.1); ``se`` is its standard
  error, conservatively: the theory's sqrt(2 sum_v Var_v^2) / sum_v Var_v per
  run (about sqrt(2 / terms)), or, with at least ``EMPIRICAL_UNITS`` runs, the
  larger of that and the spread of the per-run ratios (which is right even when
  the errors of one run are correlated across categories, as at d = 2); see
  ``ratio_and_error``.
* ``grp/var``: the same ratio per group of users, for precision where one run
  has few terms (small d, numeric): each run's users are split into
  consecutive groups (at least ``MIN_GROUP`` users, about ``GROUP_TERMS``
  squared errors per run), each group's reports are aggregated and estimated
  on their own (untimed) and compared with the group's own truth and
  analytical variance. The variance formula is exact at every n, so this ratio
  should be 1 too; it is blind to a bias much smaller than the std at the group
  size, which the full-n ``mse/var`` still sees.
* peers (``pure-ldp``, ``multi-freq-ldpy``, see ``peers.py``): the fastest
  peer's encode and aggregate rates, measured on ``--peer-n`` users within
  ``--peer-time`` seconds per call, and our rate as a multiple of it. ``auto``
  is compared with the peers' version of the mechanism it resolves to.

The summary lists every cell that misses a target: our throughput at least
``SPEED_TARGET`` times the fastest peer's, for encode and aggregate separately;
OLH aggregation of 10^6 reports at d = 1024 in under ``OLH_TARGET_SECONDS`` on
one core; the MSE ratios in 0.9-1.1 (a ratio more than ``SUSPICIOUS_Z``
standard errors from 1, inside the band or not, is flagged as a likely bug);
``auto`` choosing a mechanism whose planning variance is the least.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from shared.mechanisms import Mechanism, as_categorical, as_numeric, make_mechanism
from shared.mechanisms.auto import CANDIDATES
from shared.schemas import MechanismSpec
from simulations.benchmarks import peers as peer_lib
from simulations.text import counted

CATEGORICAL = ("grr", "sue", "oue", "olh", "hr", "auto")
NUMERIC = ("laplace", "duchi", "piecewise")
#: Mechanisms the peer libraries implement (by our wire names).
PEER_MECHANISMS = frozenset({"grr", "sue", "oue", "olh", "hr"})

ZIPF_EXPONENT = 1.1
BETA_SHAPE = (2.0, 5.0)
SPEED_TARGET = 20.0
OLH_TARGET_SECONDS = 5.0
OLH_TARGET_N = 10**6
OLH_TARGET_D = 1024
MSE_BAND = (0.9, 1.1)
MIN_TERMS = 2000
#: Independent runs (or groups) from which the standard error is estimated empirically.
EMPIRICAL_UNITS = 20
#: Squared-error terms per run wanted from the group ratio, and the least users in a group.
GROUP_TERMS = 4000
MIN_GROUP = 1000
#: |ratio - 1| / se above this is not noise: report it as a likely bug.
SUSPICIOUS_Z = 4.0
#: Memory for one chunk of reports.
CHUNK_BYTES = 128 << 20
MIN_CHUNK = 4096

FULL = {
    "n": 10**6,
    "epsilons": [0.5, 1.0, 2.0, 4.0, 8.0],
    "domains": [2, 16, 1024, 16384],
    "mechanisms": list(CATEGORICAL + NUMERIC),
    "peer_n": 10**4,
    "peer_time": 3.0,
    "mse_budget": 5.0,
}
QUICK = {
    "n": 20_000,
    "epsilons": [1.0],
    "domains": [16, 1024],
    "mechanisms": list(CATEGORICAL + NUMERIC),
    "peer_n": 300,
    "peer_time": 0.3,
    "mse_budget": 0.3,
}


@dataclass
class CellResult:
    """One row of the table."""

    mechanism: str
    epsilon: float
    domain: int | None
    n: int
    resolved: str = ""
    encode_rate: float = math.nan
    aggregate_rate: float = math.nan
    runs: int = 0
    terms: int = 0
    mse_ratio: float = math.nan
    mse_se: float = math.nan
    group_size: int = 0
    group_ratio: float = math.nan
    group_se: float = math.nan
    auto_ok: bool | None = None
    peer_encode_library: str = ""
    peer_encode_rate: float = math.nan
    peer_aggregate_library: str = ""
    peer_aggregate_rate: float = math.nan
    peers: list[dict[str, Any]] = field(default_factory=list)
    error: str = ""

    @property
    def encode_speedup(self) -> float:
        return self.encode_rate / self.peer_encode_rate

    @property
    def aggregate_speedup(self) -> float:
        return self.aggregate_rate / self.peer_aggregate_rate

    def mse_checks(self) -> list[tuple[str, float, float, str]]:
        """(label, ratio, se, what) for the full-n ratio and, if measured, the group ratio."""
        checks = [("mse", self.mse_ratio, self.mse_se, f"{self.terms} terms, {self.runs} runs")]
        if self.group_size:
            groups = f"groups of {counted(self.group_size, 'user')}"
            checks.append(("grp", self.group_ratio, self.group_se, groups))
        return checks

    def flat(self) -> dict[str, Any]:
        """A flat dict for CSV/JSON (peer details as JSON text in CSV)."""
        row = asdict(self)
        row["encode_speedup"] = self.encode_speedup
        row["aggregate_speedup"] = self.aggregate_speedup
        return row


# ---------------------------------------------------------------------------- data


def zipf_probabilities(d: int, exponent: float = ZIPF_EXPONENT) -> np.ndarray:
    """P(v) proportional to (v + 1)^-exponent over v = 0..d-1."""
    weights = np.arange(1, d + 1, dtype=np.float64) ** -exponent
    return weights / weights.sum()


def categorical_users(n: int, d: int, seed: int) -> np.ndarray:
    """n category indices from the truncated Zipf law, fixed by (seed, d)."""
    return np.random.default_rng([seed, d]).choice(d, size=n, p=zipf_probabilities(d))


def numeric_users(n: int, seed: int) -> np.ndarray:
    """n values in [0, 1] from Beta(2, 5), fixed by seed."""
    return np.random.default_rng([seed, 0]).beta(*BETA_SHAPE, size=n)


def make_spec(name: str, epsilon: float, d: int | None) -> MechanismSpec:
    """The spec of a cell: numeric mechanisms clip to [0, 1], categorical ones take d."""
    if name in NUMERIC:
        return MechanismSpec.model_validate(
            {"mechanism": name, "epsilon": epsilon, "lower": 0.0, "upper": 1.0}
        )
    return MechanismSpec.model_validate({"mechanism": name, "epsilon": epsilon, "domain_size": d})


# ---------------------------------------------------------------------------- ours


def chunk_size(mechanism: Mechanism[Any], probe: np.ndarray, n: int, multiple: int) -> int:
    """Users per chunk, a multiple of ``multiple``, so one chunk's reports take ~``CHUNK_BYTES``."""
    reports = mechanism.encode(probe, np.random.default_rng(0))
    per_report = max(1.0, reports.nbytes / probe.size)
    size = int(min(n, max(MIN_CHUNK, CHUNK_BYTES // per_report)))
    return max(multiple, size // multiple * multiple)


@dataclass
class Reference:
    """The users' true frequencies (or mean) and the analytical variance of each estimate.

    Categorical: Var[f_v] = q (1 - q) / (n (p - q)^2) + f_v (1 - p - q) / (n (p - q)).
    Numeric: mean_i report_variance(x_i) / n, as a 1-vector.
    """

    truth: np.ndarray
    variances: np.ndarray

    @classmethod
    def of(cls, mechanism: Mechanism[Any], users: np.ndarray) -> Reference:
        n = users.size
        if (categories := as_categorical(mechanism)) is not None:
            p, q = categories.p, categories.q
            f = np.bincount(users, minlength=categories.domain_size) / n
            return cls(f, q * (1 - q) / (n * (p - q) ** 2) + f * (1 - p - q) / (n * (p - q)))
        numbers = as_numeric(mechanism)
        assert numbers is not None  # the benchmark's mechanisms: categories or numbers
        variance = float(np.mean(numbers.report_variance(users))) / n
        return cls(np.array([float(np.mean(users))]), np.array([variance]))

    def ratio(self, estimate: np.ndarray) -> float:
        """Mean squared error of ``estimate`` over the mean analytical variance."""
        return float(np.mean((estimate - self.truth) ** 2) / np.mean(self.variances))

    @property
    def null_se(self) -> float:
        """Std of ``ratio`` under the theory with independent Gaussian errors.

        sqrt(2 sum var_v^2) / sum var_v, which is sqrt(2 / d) when all variances are
        equal and larger when a few categories dominate (Zipf heads at large eps).
        """
        return float(math.sqrt(2.0 * np.sum(self.variances**2)) / np.sum(self.variances))

    @property
    def effective_terms(self) -> float:
        """(sum var_v)^2 / sum var_v^2: the count of equal-variance terms worth as much."""
        return 2.0 / self.null_se**2


def estimated(mechanism: Mechanism[Any], stats: Any) -> np.ndarray:
    """The estimate of ``stats`` as a vector: frequencies, or the mean as a 1-vector."""
    if (categories := as_categorical(mechanism)) is not None:
        return np.asarray(categories.estimate(stats).frequencies, dtype=np.float64)
    numbers = as_numeric(mechanism)
    assert numbers is not None  # the benchmark's mechanisms: categories or numbers
    return np.array([float(numbers.estimate(stats).mean)])


@dataclass
class Groups:
    """``count`` disjoint groups of ``size`` consecutive users, with their references."""

    size: int
    count: int
    references: list[Reference]

    @classmethod
    def plan(cls, mechanism: Mechanism[Any], users: np.ndarray, outputs: int) -> Groups:
        """Enough groups for ``GROUP_TERMS`` squared errors per run, of at least ``MIN_GROUP``."""
        count = max(1, min(users.size // MIN_GROUP, math.ceil(GROUP_TERMS / outputs)))
        size = users.size // count
        return cls(
            size,
            count,
            [Reference.of(mechanism, users[i * size : (i + 1) * size]) for i in range(count)],
        )


def one_run(
    mechanism: Mechanism[Any],
    users: np.ndarray,
    rng: np.random.Generator,
    chunk: int,
    groups: Groups | None = None,
) -> tuple[Any, float, float, list[tuple[float, float]]]:
    """Encode and aggregate all users in chunks.

    Returns the estimate, the encode and aggregate seconds, and (untimed, when
    ``groups`` is given and has more than one group) each group's ratio of mean
    squared error to mean analytical variance, from aggregating its reports alone,
    with the ratio's null standard error.
    """
    encode_seconds = aggregate_seconds = 0.0
    stats = mechanism.empty_statistics()
    group_ratios: list[tuple[float, float]] = []
    for start in range(0, users.size, chunk):
        part = users[start : start + chunk]
        t0 = time.perf_counter()
        reports = mechanism.encode(part, rng)
        t1 = time.perf_counter()
        stats = stats.merge(mechanism.aggregate(reports))
        t2 = time.perf_counter()
        encode_seconds += t1 - t0
        aggregate_seconds += t2 - t1
        if groups is not None and groups.count > 1:
            first = start // groups.size  # chunks are whole groups
            for g in range(first, min(groups.count, first + part.size // groups.size)):
                offset = g * groups.size - start
                rows = reports[offset : offset + groups.size]
                group_estimate = estimated(mechanism, mechanism.aggregate(rows))
                ref = groups.references[g]
                group_ratios.append((ref.ratio(group_estimate), ref.null_se))
        del reports
    t0 = time.perf_counter()
    estimate = estimated(mechanism, stats)
    aggregate_seconds += time.perf_counter() - t0
    return estimate, encode_seconds, aggregate_seconds, group_ratios


def ratio_and_error(units: list[tuple[float, float]]) -> tuple[float, float]:
    """Mean of per-run (or per-group) MSE ratios and a conservative standard error.

    ``units`` holds (ratio, theory's std error) of independent runs or groups.
    The theory's error of the mean is sqrt(sum se^2) / units; it assumes the
    categories of a unit are independent, which GRR's are not at d = 2 (its two
    errors are exactly opposite). With at least ``EMPIRICAL_UNITS`` units the
    error is the largest of that, the sample std / sqrt(units), and the same
    scaled to a ratio of 1 (sample std / sqrt(units) / ratio): per-unit ratios are
    skewed, chi-square-like, with a std proportional to their mean, so a sample
    whose mean came out low also has a small sample std, which would make a
    chance low ratio look significant.
    """
    ratios = np.array([ratio for ratio, _ in units])
    ratio = float(ratios.mean())
    theory = float(math.sqrt(sum(se * se for _, se in units)) / ratios.size)
    if ratios.size < EMPIRICAL_UNITS:
        return ratio, theory
    empirical = float(ratios.std(ddof=1) / math.sqrt(ratios.size))
    return ratio, max(theory, empirical, empirical / ratio if ratio > 0 else math.inf)


def measure_ours(
    result: CellResult, users: np.ndarray, seed: int, budget: float, index: int
) -> Mechanism[Any]:
    """Fill in our rates, the MSE ratios and the auto check of ``result``."""
    mechanism = make_mechanism(make_spec(result.mechanism, result.epsilon, result.domain))
    result.resolved = mechanism.name
    rng = np.random.default_rng([seed, 1, index])
    categories = as_categorical(mechanism)
    outputs = categories.domain_size if categories is not None else 1
    groups = Groups.plan(mechanism, users, outputs)
    chunk = chunk_size(mechanism, users[:256], users.size, groups.size)
    one_run(mechanism, users[: min(users.size, 4096)], rng, chunk)  # warm-up, untimed

    full = Reference.of(mechanism, users)
    per_run: list[tuple[float, float]] = []
    per_group: list[tuple[float, float]] = []
    encode_times: list[float] = []
    aggregate_times: list[float] = []
    started = time.perf_counter()
    while True:
        pass_start = time.perf_counter()
        estimate, encode_seconds, aggregate_seconds, ratios = one_run(
            mechanism, users, rng, chunk, groups
        )
        encode_times.append(encode_seconds)
        aggregate_times.append(aggregate_seconds)
        per_run.append((full.ratio(estimate), full.null_se))
        per_group.extend(ratios)
        now = time.perf_counter()
        enough = len(per_run) * full.effective_terms >= MIN_TERMS
        if enough or (now - started) + (now - pass_start) > budget:
            break
    runs = len(per_run)
    result.runs, result.terms = runs, round(runs * full.effective_terms)
    result.encode_rate = users.size / min(encode_times)  # best run: least disturbed
    result.aggregate_rate = users.size / min(aggregate_times)
    result.mse_ratio, result.mse_se = ratio_and_error(per_run)
    if per_group:
        result.group_size = groups.size
        result.group_ratio, result.group_se = ratio_and_error(per_group)
    if result.mechanism == "auto":
        assert result.domain is not None
        chosen = mechanism.variance(users.size)
        rivals = [
            make_mechanism(make_spec(cls.name, result.epsilon, result.domain)).variance(users.size)
            for cls in CANDIDATES
        ]
        result.auto_ok = chosen <= min(rivals) * (1 + 1e-12)
    return mechanism


# ---------------------------------------------------------------------------- peers


class PeerCache:
    """Peer timings by (library, mechanism, epsilon, d), so ``auto`` reuses them."""

    def __init__(self, libraries: Sequence[str], peer_n: int, time_cap: float) -> None:
        self.libraries = libraries
        self.peer_n = peer_n
        self.time_cap = time_cap
        self.timings: dict[tuple[str, str, float, int], peer_lib.PeerTiming | None] = {}
        self.failures: list[str] = []

    def measure(
        self, mechanism: str, epsilon: float, d: int, users: np.ndarray
    ) -> list[peer_lib.PeerTiming]:
        found = []
        for library in self.libraries:
            key = (library, mechanism, epsilon, d)
            if key not in self.timings:
                timing = None
                try:
                    peer = peer_lib.make_peer(library, mechanism, epsilon, d)
                    if peer is not None:
                        timing = peer_lib.time_peer(peer, users[: self.peer_n], self.time_cap)
                except Exception as error:  # noqa: BLE001 - a peer's bug must not stop the run
                    self.failures.append(
                        f"{library} {mechanism} eps={epsilon:g} d={d}: "
                        f"{type(error).__name__}: {error}"
                    )
                self.timings[key] = timing
            timing = self.timings[key]
            if timing is not None:
                found.append(timing)
        return found


def attach_peers(result: CellResult, timings: list[peer_lib.PeerTiming]) -> None:
    result.peers = [asdict(t) for t in timings]
    if not timings:
        return
    fastest_encode = max(timings, key=lambda t: t.encode_rate)
    fastest_aggregate = max(timings, key=lambda t: t.aggregate_rate)
    result.peer_encode_library = fastest_encode.library
    result.peer_encode_rate = fastest_encode.encode_rate
    result.peer_aggregate_library = fastest_aggregate.library
    result.peer_aggregate_rate = fastest_aggregate.aggregate_rate


# ---------------------------------------------------------------------------- table

HEADER = (
    f"{'mech':<9} {'eps':>4} {'d':>5} {'enc/s':>6} {'agg/s':>6} {'mse/var':>7} {'se':>5} "
    f"{'terms':>5} {'grp/var':>7} {'se':>5} | {'peer enc/s':>10} {'x':>5} | "
    f"{'peer agg/s':>10} {'x':>5} | notes"
)


def si(value: float) -> str:
    """Compact rate: 9.63M, 162M, 553k."""
    if not math.isfinite(value):
        return "-"
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= scale:
            number = value / scale
            return f"{number:.3g}{suffix}" if number < 1000 else f"{number:.0f}{suffix}"
    return f"{value:.3g}"


def times(value: float) -> str:
    return "-" if not math.isfinite(value) else (f"{value:.1f}" if value < 100 else f"{value:.0f}")


def mse_verdict(ratio: float, se: float) -> str:
    """ "" if the ratio is in the band and consistent with 1; else "noise" or "bug"."""
    if not math.isfinite(ratio):
        return ""
    z = (ratio - 1.0) / se if se > 0 else math.inf
    if abs(z) > SUSPICIOUS_Z:
        return "bug"
    low, high = MSE_BAND
    return "" if low <= ratio <= high else "noise"


def notes(result: CellResult) -> str:
    """Short flags for the last column."""
    if result.error:
        return f"ERROR {result.error}"
    parts = []
    if result.mechanism == "auto":
        parts.append(f"->{result.resolved} " + ("min-var ok" if result.auto_ok else "NOT MIN-VAR"))
    if result.mechanism == "olh" and result.domain == OLH_TARGET_D:
        parts.append(f"agg {OLH_TARGET_N / result.aggregate_rate:.2f}s@1e6")
    for label, ratio, se, _ in result.mse_checks():
        verdict = mse_verdict(ratio, se)
        if verdict:
            parts.append(f"{label}:{'BUG?' if verdict == 'bug' else 'out-of-band'}")
    for label, speedup in (("enc", result.encode_speedup), ("agg", result.aggregate_speedup)):
        if math.isfinite(speedup) and speedup < SPEED_TARGET:
            parts.append(f"{label}<{SPEED_TARGET:.0f}x")
    return " ".join(parts)


def format_row(result: CellResult) -> str:
    d = "-" if result.domain is None else str(result.domain)
    short = peer_lib.SHORT_NAMES
    peer_encode = (
        f"{short.get(result.peer_encode_library, '')} {si(result.peer_encode_rate)}"
        if result.peer_encode_library
        else "-"
    )
    peer_aggregate = (
        f"{short.get(result.peer_aggregate_library, '')} {si(result.peer_aggregate_rate)}"
        if result.peer_aggregate_library
        else "-"
    )
    group = (
        (f"{result.group_ratio:>7.3f}", f"{result.group_se:>5.3f}")
        if result.group_size
        else (f"{'-':>7}", f"{'-':>5}")
    )
    return (
        f"{result.mechanism:<9} {result.epsilon:>4g} {d:>5} {si(result.encode_rate):>6} "
        f"{si(result.aggregate_rate):>6} {result.mse_ratio:>7.3f} {result.mse_se:>5.3f} "
        f"{result.terms:>5} {group[0]} {group[1]} | {peer_encode:>10} "
        f"{times(result.encode_speedup):>5} | {peer_aggregate:>10} "
        f"{times(result.aggregate_speedup):>5} | {notes(result)}"
    )


def summary(results: list[CellResult], peer_failures: list[str], have_peers: bool) -> list[str]:
    """Lines naming every missed target (or saying all were met)."""
    lines = []
    low, high = MSE_BAND
    for r in results:
        where = f"{r.mechanism} eps={r.epsilon:g}" + ("" if r.domain is None else f" d={r.domain}")
        if r.error:
            lines.append(f"ERROR    {where}: {r.error}")
            continue
        for label, speedup, ours, peer, library in (
            ("encode", r.encode_speedup, r.encode_rate, r.peer_encode_rate, r.peer_encode_library),
            (
                "aggregate",
                r.aggregate_speedup,
                r.aggregate_rate,
                r.peer_aggregate_rate,
                r.peer_aggregate_library,
            ),
        ):
            if math.isfinite(speedup) and speedup < SPEED_TARGET:
                lines.append(
                    f"MISS speed {where}: {label} {speedup:.1f}x the fastest peer "
                    f"({library}: {si(peer)}/s, ours {si(ours)}/s; target {SPEED_TARGET:.0f}x)"
                )
        if r.mechanism == "olh" and r.domain == OLH_TARGET_D:
            seconds = OLH_TARGET_N / r.aggregate_rate
            if seconds >= OLH_TARGET_SECONDS:
                lines.append(
                    f"MISS olh aggregate {where}: {seconds:.2f} s for 10^6 reports "
                    f"(target < {OLH_TARGET_SECONDS:g} s)"
                )
        for label, ratio, se, what in r.mse_checks():
            verdict = mse_verdict(ratio, se)
            z = (ratio - 1.0) / se if se > 0 else math.inf
            if verdict == "bug":
                lines.append(
                    f"BUG? {label} {where}: ratio {ratio:.3f} +- {se:.3f} ({what}) is "
                    f"{z:+.1f} standard errors from 1: inconsistent with the analytical variance"
                )
            elif verdict == "noise":
                lines.append(
                    f"MISS {label} {where}: ratio {ratio:.3f} +- {se:.3f} ({what}) is outside "
                    f"{low}-{high} but within noise (z = {z:+.1f})"
                )
        if r.auto_ok is False:
            lines.append(f"MISS auto {where}: chose {r.resolved}, not the least variance")
    lines.extend(f"PEER FAILED {failure}" for failure in peer_failures)
    if not have_peers:
        lines.append("NOTE no peer library available: the speed-ratio target was not checked")
    if not lines:
        lines.append("All targets met.")
    return lines


def write_output(path: Path, results: list[CellResult]) -> None:
    """Rows as JSON (NaN as null) when the suffix is .json, else as CSV."""
    rows = [r.flat() for r in results]
    if path.suffix.lower() == ".json":

        def finite(value: Any) -> Any:
            return None if isinstance(value, float) and not math.isfinite(value) else value

        clean = [{key: finite(value) for key, value in row.items()} for row in rows]
        path.write_text(json.dumps(clean, indent=2))
        return
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]) if rows else [])
        writer.writeheader()
        for row in rows:
            row["peers"] = json.dumps(row["peers"])
            writer.writerow(row)


# ---------------------------------------------------------------------------- main


def parse_list(text: str, kind: Callable[[str], Any]) -> list[Any]:
    return [kind(item) for item in text.split(",") if item.strip()]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m simulations.benchmarks.mechanisms",
        description="Speed and accuracy of every mechanism, against theory and peer libraries.",
    )
    parser.add_argument("--n", type=lambda s: int(float(s)), help="users per cell (1e6)")
    parser.add_argument(
        "--epsilons", type=lambda s: parse_list(s, float), help="comma-separated (0.5,1,2,4,8)"
    )
    parser.add_argument(
        "--domains",
        type=lambda s: parse_list(s, int),
        help="comma-separated domain sizes (2,16,1024,16384)",
    )
    parser.add_argument(
        "--mechanisms",
        type=lambda s: parse_list(s, str.strip),
        help=f"comma-separated, from {','.join(CATEGORICAL + NUMERIC)} (all)",
    )
    parser.add_argument(
        "--peer-n", type=lambda s: int(float(s)), help="users for the peer libraries (1e4)"
    )
    parser.add_argument(
        "--peer-time",
        type=float,
        help="seconds allowed per peer encode or aggregate measurement (3)",
    )
    parser.add_argument("--no-peers", action="store_true", help="skip the peer libraries")
    parser.add_argument(
        "--mse-budget", type=float, help="seconds per cell for repeated runs of the MSE ratio (5)"
    )
    parser.add_argument("--seed", type=int, default=20240601, help="seed of users and noise")
    parser.add_argument("--output", type=Path, help="write rows to this .csv or .json file")
    parser.add_argument(
        "--quick", action="store_true", help="small n and few cells: a smoke run in seconds"
    )
    args = parser.parse_args(argv)
    preset = QUICK if args.quick else FULL
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    unknown = [m for m in args.mechanisms if m not in CATEGORICAL + NUMERIC]
    if unknown:
        parser.error(f"unknown mechanisms {unknown}; choose from {CATEGORICAL + NUMERIC}")
    return args


def cells(args: argparse.Namespace) -> list[tuple[str, float, int | None]]:
    grid: list[tuple[str, float, int | None]] = []
    for name in args.mechanisms:
        for epsilon in args.epsilons:
            if name in NUMERIC:
                grid.append((name, epsilon, None))
            else:
                grid.extend((name, epsilon, d) for d in args.domains)
    return grid


def progress(items: list[Any]) -> tuple[Iterable[Any], Callable[[str], None]]:
    """A tqdm bar over ``items`` when tqdm is installed (on a terminal), else plain print."""
    try:
        from tqdm import tqdm
    except ImportError:
        return items, print
    bar = tqdm(items, unit="cell", disable=None, file=sys.stderr, leave=False)
    return bar, tqdm.write


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    print(
        f"mechanisms benchmark: n={counted(args.n, 'user')} per cell "
        f"(categorical Zipf({ZIPF_EXPONENT}) "
        f"over d, numeric Beta{BETA_SHAPE} on [0, 1]), seed {args.seed}, "
        f"MSE budget {args.mse_budget:g} s/cell, numpy {np.__version__}, single process"
    )
    libraries: list[str] = []
    if args.no_peers:
        print("peers: skipped (--no-peers)")
    else:
        for library, status in peer_lib.available_libraries().items():
            print(f"peer {library}: {status}")
            if not status.startswith("unavailable"):
                libraries.append(library)
        if libraries:
            print(
                f"peers timed on up to {counted(args.peer_n, 'user')}, "
                f"{args.peer_time:g} s per call; "
                f"x = our rate / fastest peer's (pl = pure-ldp, mf = multi-freq-ldpy)"
            )
    cache = PeerCache(libraries, args.peer_n, args.peer_time)
    grid = cells(args)
    print(
        f"load average at start: {', '.join(f'{x:.1f}' for x in os.getloadavg())} "
        f"on {os.cpu_count()} cores"
    )
    print(
        f"rates in reports/s; agg includes merging chunks and the estimate; target x >= "
        f"{SPEED_TARGET:g}, mse/var in {MSE_BAND[0]}-{MSE_BAND[1]}"
    )
    print(HEADER)
    print("-" * len(HEADER))
    sys.stdout.flush()

    users_by_domain: dict[int | None, np.ndarray] = {}
    results: list[CellResult] = []
    iterator, emit = progress(grid)
    for index, (name, epsilon, d) in enumerate(iterator):
        if d not in users_by_domain:
            users_by_domain[d] = (
                numeric_users(args.n, args.seed)
                if d is None
                else categorical_users(args.n, d, args.seed)
            )
        users = users_by_domain[d]
        result = CellResult(name, epsilon, d, args.n)
        try:
            measure_ours(result, users, args.seed, args.mse_budget, index)
        except Exception as error:  # noqa: BLE001 - report the cell and carry on
            result.error = f"{type(error).__name__}: {error}"
        if libraries and d is not None and result.resolved in PEER_MECHANISMS:
            attach_peers(result, cache.measure(result.resolved, epsilon, d, users))
        results.append(result)
        emit(format_row(result))
        sys.stdout.flush()

    print("-" * len(HEADER))
    print(
        f"finished {counted(len(results), 'cell')} in {time.perf_counter() - started:.0f} s; load "
        f"average {', '.join(f'{x:.1f}' for x in os.getloadavg())}"
    )
    print(
        "summary (targets: x >= 20 encode and aggregate vs the fastest peer; olh aggregate "
        f"of 10^6 reports at d={OLH_TARGET_D} < {OLH_TARGET_SECONDS:g} s; mse/var in "
        f"{MSE_BAND[0]}-{MSE_BAND[1]}; auto has the least variance):"
    )
    for line in summary(results, cache.failures, bool(libraries)):
        print(f"  {line}")
    if args.output is not None:
        write_output(args.output, results)
        print(f"rows written to {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
