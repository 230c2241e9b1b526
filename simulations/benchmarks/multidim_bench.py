"""Benchmark of the multi-attribute protocols ``spl``, ``smp`` and ``rsfd``: against
multi-freq-ldpy 0.2.5, and 2-way marginals against split-budget pair reports.

Run from the repository root (a script, not a test)::

    python -m simulations.benchmarks.multidim_bench --quick     # smoke run, about a minute
    python -m simulations.benchmarks.multidim_bench             # full run, 5-10 minutes

The users (``simulations.multidim.Population``): k attributes of ``--domains``
categories, Zipf(1.1) marginals, joined by a Gaussian copula of correlation
``--correlation`` (a latent shared by all attributes).

1. Against multi-freq-ldpy 0.2.5 (``multi_freq_ldpy.mdim_freq_est``), at the same
   (epsilon, domains, n), no declared pairs, our oracle fixed to the peer's:
   ``SPL_GRR``/``SPL_UE`` (optimal: OUE), ``SMP_GRR``/``SMP_UE``, ``RSpFD_GRR`` and
   ``RSpFD_UE_zero`` (RS+FD[OUE-z]: the fake views are OUE reports of no value).

   * Accuracy: one draw of ``--mse-n`` users, reported ``--peer-runs`` times through the
     peer's own per-user clients (its Python loop; numpy's global generator and numba's
     seeded per run) and ``--our-runs`` times through our ``encode`` and ``aggregate`` (every
     user encoded). The MSE of a run is the mean over every attribute's values of
     (f^ - f)^2, f the users' own shares; its mean over runs has the standard error of the
     runs' spread, and the ratio ours / theirs the delta method's. The peer's
     aggregators clip negative estimates to 0 and renormalize (biased), so its MSE is
     measured on its **unbiased** estimate, captured before that step: for SPL and SMP its
     oracles' ``MI`` (in ``pure_frequency_oracles.GRR`` and ``.UE``) is swapped, for the
     call, for the unclipped f = (C - n q) / (n (p - q)); RS+FD clips inline, so its
     estimate is the peer's own formula applied to its reports' counts: GRR
     f = (C k_a k - n (k_a - 1 + q k)) / (n k (p - q)), OUE-z f = k_a (C - n q) / (n (p - q))
     (k_a attributes, k values, (p, q) at its amplified epsilon). Either way the first
     run checks that clipping and renormalizing the captured estimate gives exactly the
     peer's own output.
   * RS+FD at the same nominal epsilon: the peer reports the sampled attribute with the
     amplified eps' = ln(k_a (e^eps - 1) + 1) (Arcolezi et al., CIKM 2021), which bounds
     the likelihood ratio only between inputs that differ in one attribute; for inputs
     that differ in every attribute one report reaches e^eps' (``shared.mechanisms.
     multidim``), so the peer's reports are eps'-LDP, not eps-LDP, and its error is lower
     for that reason. Ours keeps eps inside (eps-LDP for the whole report). The row
     ``rsfd@inner`` runs ours at epsilon = eps': the same report law as the peer's, where
     the MSEs must match.
   * Speed: our encode and aggregate (with the estimate) rates over ``--n`` users, best of
     ``SPEED_REPEATS`` passes; the peer's by ``peers.time_peer`` on up to ``--peer-n``
     users within ``--peer-time`` seconds (best of several passes; numba compiled first):
     one client call per user, its aggregator over the list of reports.

2. Marginals: n = ``--marginal-n`` users, epsilon ``--marginal-epsilon``,
   ``--marginal-attributes`` attributes of ``--marginal-domain`` values, every pair
   declared (10 pairs for 5 attributes). Ours: ``smp`` (and ``auto``, resolved) over the
   pair views with the oracle ``auto``, its joint estimates consistent with the one-way
   ones (CALM); against ``spl`` over the same pair views (each pair through its share
   eps / 10 of the budget: each pair its own split-budget report), and, beside it, each
   pair as a separate categorical metric (``auto`` at eps / 10 over the d^2 joint cells,
   no consistency). The measure is the mean absolute error of the joint cells (all pairs,
   their unbiased frequencies against the users' joint shares) over ``--marginal-runs``
   runs, by the **fast path** (every run's statistics drawn from their law given the users'
   rows, ``simulate_statistics``; the same users every run); and the MSE of the joint cells
   over their stated variance.

Targets (PASS/FAIL in each table, MISS lines at the end; ``?`` where the verdict is within
two standard errors): MSE ours / theirs at most ``MSE_TARGET`` (at the same nominal epsilon
for SPL and SMP, at the same inner epsilon for RS+FD); encode and aggregate at least
``SPEED_TARGET`` times the peer's rate; the marginals' MAE ratio smp / spl at most
``MARGINAL_TARGET``. Checks (FAIL lines, exit status 1): every protocol runs; the captured
peer estimates reproduce the peer's outputs.

multi-freq-ldpy is the optional ``bench`` extra; without it part 1's peer columns are
skipped with a message.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.metadata
import json
import math
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shared.mechanisms import as_categorical, make_mechanism
from shared.mechanisms.abilities import AttributeValues, as_attributes
from shared.schemas import MechanismSpec
from simulations.arguments import list_of, positive_float, user_count
from simulations.benchmarks import peers as peer_lib
from simulations.benchmarks.distribution_bench import Target, ratio
from simulations.benchmarks.mechanisms import SPEED_TARGET, si, times
from simulations.multidim import Population, Truth, all_pairs, resolved
from simulations.populations import parse_categorical_shape
from simulations.text import counted

PEER_DISTRIBUTION = "multi-freq-ldpy"
PEER_PACKAGE = "multi_freq_ldpy.mdim_freq_est"
ORACLE_PACKAGE = "multi_freq_ldpy.pure_frequency_oracles"
#: Targets: our MSE at most this times the peer's; the marginals' MAE ratio at most this.
MSE_TARGET = 1.05
MARGINAL_TARGET = 0.7
#: Passes of our encode and aggregate whose best rate counts.
SPEED_REPEATS = 3
SHAPE = "zipf:1.1"
#: Error messages are cut to this length.
ERROR_CHARS = 240

FULL: dict[str, Any] = {
    "n": 10**6,
    "mse_n": 50_000,
    "peer_runs": 64,
    "our_runs": 256,
    "peer_n": 20_000,
    "peer_time": 3.0,
    "epsilons": [1.0, 4.0],
    "marginal_n": 10**6,
    "marginal_runs": 20,
}
QUICK: dict[str, Any] = {
    "n": 100_000,
    "mse_n": 5_000,
    "peer_runs": 6,
    "our_runs": 24,
    "peer_n": 2_000,
    "peer_time": 0.3,
    "epsilons": [2.0],
    "marginal_n": 100_000,
    "marginal_runs": 4,
}


def view_epsilon(protocol: str, epsilon: float, attributes: int) -> float:
    """The epsilon of our local randomizer of one view: eps / k under spl, else eps."""
    return epsilon / attributes if protocol == "spl" else epsilon


def amplified(epsilon: float, attributes: int) -> float:
    """RS+FD's inner epsilon in the peer (and the paper): ln(k (e^eps - 1) + 1)."""
    return math.log(attributes * math.expm1(epsilon) + 1)


# ---------------------------------------------------------------------------- comparisons


@dataclass(frozen=True)
class Variant:
    """One of our protocols with a fixed oracle beside the peer's version of it; ``inner``:
    ours run at the peer's amplified epsilon (RS+FD)."""

    protocol: str
    oracle: str
    peer: str
    inner: bool = False

    @property
    def label(self) -> str:
        return f"{self.protocol}@inner" if self.inner else self.protocol


VARIANTS = (
    Variant("spl", "grr", "SPL_GRR"),
    Variant("spl", "oue", "SPL_UE"),
    Variant("smp", "grr", "SMP_GRR"),
    Variant("smp", "oue", "SMP_UE"),
    Variant("rsfd", "grr", "RSpFD_GRR"),
    Variant("rsfd", "grr", "RSpFD_GRR", inner=True),
    Variant("rsfd", "oue", "RSpFD_UE_zero"),
    Variant("rsfd", "oue", "RSpFD_UE_zero", inner=True),
)


def peer_status() -> str:
    """``"<version>"`` of multi-freq-ldpy, or ``"unavailable (<reason>)"``."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for name in ("SPL_solution", "SMP_solution", "RSpFD_solution"):
                importlib.import_module(f"{PEER_PACKAGE}.{name}")
        return importlib.metadata.version(PEER_DISTRIBUTION)
    except Exception as error:  # noqa: BLE001 - any failure means "not available"
        return f"unavailable ({type(error).__name__}: {error})"


@dataclass
class PeerProtocol:
    """The peer's client and aggregator of one variant, at our (epsilon, domains)."""

    name: str
    domains: tuple[int, ...]
    epsilon: float
    encode_one: Callable[[tuple[int, ...]], Any]
    aggregate: Callable[[list[Any]], Any]
    report_bytes: int

    @property
    def attributes(self) -> int:
        return len(self.domains)


def make_peer(variant: Variant, domains: tuple[int, ...], epsilon: float) -> PeerProtocol:
    """multi-freq-ldpy's ``variant.peer`` client and ``_Aggregator_MI`` (OUE: ``optimal``)."""
    ks, count = list(domains), len(domains)
    unary_bytes = 8 * sum(domains) + 112 * count
    if variant.protocol in ("spl", "smp"):
        module = importlib.import_module(f"{PEER_PACKAGE}.{variant.protocol.upper()}_solution")
        client = getattr(module, f"{variant.peer}_Client")
        aggregator = getattr(module, f"{variant.peer}_Aggregator_MI")
        if variant.oracle == "grr":
            return PeerProtocol(
                variant.peer, domains, epsilon, lambda x: client(x, ks, count, epsilon),
                lambda reports: aggregator(reports, ks, count, epsilon), 64 * count,
            )  # fmt: skip
        return PeerProtocol(
            variant.peer, domains, epsilon, lambda x: client(x, ks, count, epsilon, True),
            lambda reports: aggregator(reports, count, epsilon, True), unary_bytes,
        )  # fmt: skip
    module = importlib.import_module(f"{PEER_PACKAGE}.RSpFD_solution")
    client = getattr(module, f"{variant.peer}_Client")
    aggregator = getattr(module, f"{variant.peer}_Aggregator_MI")
    if variant.oracle == "grr":
        return PeerProtocol(
            variant.peer, domains, epsilon, lambda x: client(x, ks, count, epsilon),
            lambda reports: aggregator(reports, ks, count, epsilon), 64 * count,
        )  # fmt: skip
    return PeerProtocol(
        variant.peer, domains, epsilon, lambda x: client(x, ks, count, epsilon, True),
        lambda reports: aggregator(reports, ks, count, epsilon, True), unary_bytes,
    )  # fmt: skip


@contextmanager
def unclipped_oracles() -> Iterator[None]:
    """Within the block, the peer's GRR and UE aggregators return the unbiased
    f = (C - n q) / (n (p - q)) instead of clipping and renormalizing it (their ``MI``)."""
    modules = [importlib.import_module(f"{ORACLE_PACKAGE}.{name}") for name in ("GRR", "UE")]
    originals = [getattr(module, "MI") for module in modules]  # noqa: B009 - untyped module

    def estimate(counts: Any, n: int, p: float, q: float) -> np.ndarray:
        return (np.asarray(counts, dtype=np.float64) - n * q) / (n * (p - q))

    for module in modules:
        setattr(module, "MI", estimate)  # noqa: B010 - untyped module
    try:
        yield
    finally:
        for module, original in zip(modules, originals, strict=True):
            setattr(module, "MI", original)  # noqa: B010


def rsfd_unbiased(peer: PeerProtocol, oracle: str, reports: list[Any]) -> list[np.ndarray]:
    """The peer's RS+FD estimate before its clip: its own formulas (module docstring) on
    its reports' counts, (p, q) at its amplified epsilon."""
    n, count = len(reports), peer.attributes
    inner = amplified(peer.epsilon, count)
    estimates = []
    if oracle == "grr":
        columns = np.asarray(reports, dtype=np.int64)
        for index, k in enumerate(peer.domains):
            p = math.exp(inner) / (math.exp(inner) + k - 1)
            q = (1 - p) / (k - 1)
            counts = np.bincount(columns[:, index], minlength=k)
            estimates.append((counts * count * k - n * (count - 1 + q * k)) / (n * k * (p - q)))
        return estimates
    p, q = 0.5, 1 / (math.exp(inner) + 1)
    for index in range(count):
        counts = np.sum([report[index] for report in reports], axis=0)
        estimates.append(count * (counts - n * q) / (n * (p - q)))
    return estimates


def peer_unbiased(peer: PeerProtocol, variant: Variant, reports: list[Any]) -> list[np.ndarray]:
    """The peer's unbiased estimate of every attribute (module docstring)."""
    if variant.protocol == "rsfd":
        return rsfd_unbiased(peer, variant.oracle, reports)
    with unclipped_oracles():
        return [np.asarray(item, dtype=np.float64) for item in peer.aggregate(reports)]


def clipped(estimates: list[np.ndarray]) -> list[np.ndarray]:
    """What the peer publishes from an unbiased estimate: negatives to 0, renormalized."""
    positive = [np.clip(item, 0, None) for item in estimates]
    return [item / item.sum() for item in positive]


@functools.cache
def _numba_seeder() -> Callable[[int], None]:
    """A compiled ``np.random.seed``: numba's generator is seeded only from compiled code."""
    import numba

    def seed(value: int) -> None:
        np.random.seed(value)  # noqa: NPY002 - numba's own global generator

    return numba.njit(seed)  # type: ignore[no-any-return]


def seed_peer(seed: int) -> None:
    """Seed the peer's generators: numpy's global one (its Python code) and numba's (its
    compiled clients draw from numba's own state)."""
    np.random.seed(seed % 2**32)  # noqa: NPY002 - the peer draws from numpy's global one
    _numba_seeder()(seed % 2**32)


# ---------------------------------------------------------------------------- ours


def spec_json(
    protocol: str,
    oracle: str,
    domains: Sequence[int],
    epsilon: float,
    pairs: Sequence[tuple[int, int]] = (),
) -> dict[str, Any]:
    """Our metric's spec: attributes ``a0``.. of ``domains`` values (``auto`` resolved)."""
    spec: dict[str, Any] = {
        "mechanism": protocol,
        "epsilon": epsilon,
        "attributes": [{"name": f"a{i}", "domain_size": int(d)} for i, d in enumerate(domains)],
        "oracle": oracle,
    }
    if pairs:
        spec["pairs"] = [[f"a{i}", f"a{j}"] for i, j in pairs]
    return resolved(spec)


def our_mechanism(spec: dict[str, Any]) -> AttributeValues:
    attributes = as_attributes(make_mechanism(MechanismSpec.model_validate(spec)))
    if attributes is None:
        raise ValueError(f"{spec['mechanism']!r} does not estimate attributes")
    return attributes


def our_rates(mechanism: AttributeValues, rows: np.ndarray, seed: int) -> tuple[float, float]:
    """(encode rate, aggregate rate with the estimate) over ``rows``, best of
    ``SPEED_REPEATS`` passes each."""
    mech: Any = mechanism
    rng = np.random.default_rng(seed)
    mechanism.estimate(mech.aggregate(mech.encode(rows[:1024], rng)))  # warm-up, untimed
    encode = aggregate = math.inf
    for _ in range(SPEED_REPEATS):
        t0 = time.perf_counter()
        reports = mech.encode(rows, rng)
        t1 = time.perf_counter()
        mechanism.estimate(mech.aggregate(reports))
        t2 = time.perf_counter()
        encode, aggregate = min(encode, t1 - t0), min(aggregate, t2 - t1)
        del reports
    return rows.shape[0] / encode, rows.shape[0] / aggregate


def squared_error(estimates: Sequence[np.ndarray], truth: Sequence[np.ndarray]) -> float:
    """The mean over every attribute's values of (f^ - f)^2."""
    errors = np.concatenate([np.ravel(e) - t for e, t in zip(estimates, truth, strict=True)])
    return float(np.mean(errors**2))


def mean_and_se(values: Sequence[float]) -> tuple[float, float]:
    array = np.asarray(values, dtype=np.float64)
    spread = float(np.std(array, ddof=1)) / math.sqrt(array.size) if array.size > 1 else math.nan
    return float(array.mean()), spread


@dataclass
class Comparison:
    """One variant: our rates and MSE beside the peer's."""

    label: str
    oracle: str
    peer: str
    epsilon: float  # the nominal epsilon of the row
    our_epsilon: float  # the epsilon of our spec
    our_view: float  # the epsilon of our local randomizer of a reported view
    peer_view: float  # the same in the peer
    encode_rate: float = math.nan
    aggregate_rate: float = math.nan
    peer_encode_rate: float = math.nan
    peer_aggregate_rate: float = math.nan
    our_mse: float = math.nan
    our_mse_se: float = math.nan
    peer_mse: float = math.nan
    peer_mse_se: float = math.nan
    stated: float = math.nan  # our stated variance, mean over the values
    capture_checked: bool = False
    error: str = ""

    @property
    def encode_speedup(self) -> float:
        return self.encode_rate / self.peer_encode_rate

    @property
    def aggregate_speedup(self) -> float:
        return self.aggregate_rate / self.peer_aggregate_rate

    @property
    def mse_ratio(self) -> tuple[float, float]:
        return ratio(self.our_mse, self.our_mse_se, self.peer_mse, self.peer_mse_se)

    @property
    def comparable(self) -> bool:
        """Ours and the peer's reports have one law (one epsilon per view): the MSE target
        applies."""
        return math.isclose(self.our_view, self.peer_view)


def our_accuracy(
    mechanism: AttributeValues, rows: np.ndarray, truth: list[np.ndarray], runs: int, seed: int
) -> tuple[float, float, float]:
    """(mean MSE, its standard error, mean stated variance) of ``runs`` runs, every user
    encoded."""
    mech: Any = mechanism
    rng = np.random.default_rng(seed)
    errors, stated = [], []
    for _ in range(runs):
        estimate = mechanism.estimate(mech.aggregate(mech.encode(rows, rng)))
        frequencies = [np.asarray(a.frequencies) for a in estimate.attributes]  # type: ignore[union-attr]
        errors.append(squared_error(frequencies, truth))
        stated.append(
            float(np.mean(np.concatenate([np.asarray(a.std) ** 2 for a in estimate.attributes])))  # type: ignore[union-attr]
        )
    mse, se = mean_and_se(errors)
    return mse, se, float(np.mean(stated))


def peer_accuracy(
    peer: PeerProtocol,
    variant: Variant,
    rows: np.ndarray,
    truth: list[np.ndarray],
    runs: int,
    seed: int,
) -> tuple[float, float, bool]:
    """(mean MSE of the peer's unbiased estimate, its standard error, whether the first
    run's captured estimate reproduced the peer's own output)."""
    users = [tuple(int(v) for v in row) for row in rows]
    errors = []
    checked = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for run in range(runs):
            seed_peer(seed + run)
            reports = [peer.encode_one(x) for x in users]  # the peer's per-user API
            estimates = peer_unbiased(peer, variant, reports)
            if run == 0:
                published = [np.asarray(item, dtype=np.float64) for item in peer.aggregate(reports)]
                checked = all(
                    np.allclose(mine, theirs, rtol=1e-9, atol=1e-12)
                    for mine, theirs in zip(clipped(estimates), published, strict=True)
                )
            errors.append(squared_error(estimates, truth))
    mse, se = mean_and_se(errors)
    return mse, se, checked


@dataclass(frozen=True)
class PeerMeasures:
    """The peer's rates and the MSE of its unbiased estimate, for one protocol and epsilon."""

    encode_rate: float
    aggregate_rate: float
    mse: float
    mse_se: float
    capture_checked: bool


def compare(
    variant: Variant,
    epsilon: float,
    population: Population,
    rows: np.ndarray,
    speed_rows: np.ndarray,
    args: argparse.Namespace,
    measured: dict[tuple[str, float], PeerMeasures] | None,
) -> Comparison:
    """One variant at one epsilon: rates and MSEs (module docstring, part 1). ``measured``
    holds the peer's measures by (its protocol, epsilon), filled on first use (the
    ``@inner`` rows compare ours with the same peer runs); None: no peer."""
    domains = tuple(int(d) for d in population.domains if d is not None)
    count = len(domains)
    ours_at = amplified(epsilon, count) if variant.inner else epsilon
    peer_view = (
        amplified(epsilon, count)
        if variant.protocol == "rsfd"
        else view_epsilon(variant.protocol, epsilon, count)
    )
    result = Comparison(
        variant.label, variant.oracle, variant.peer, epsilon, ours_at,
        view_epsilon(variant.protocol, ours_at, count), peer_view,
    )  # fmt: skip
    try:
        mechanism = our_mechanism(spec_json(variant.protocol, variant.oracle, domains, ours_at))
        result.encode_rate, result.aggregate_rate = our_rates(mechanism, speed_rows, args.seed)
        truth = [
            np.bincount(rows[:, j].astype(np.int64), minlength=d) / rows.shape[0]
            for j, d in enumerate(domains)
        ]
        result.our_mse, result.our_mse_se, result.stated = our_accuracy(
            mechanism, rows, truth, args.our_runs, args.seed + 1
        )
        if measured is None:
            return result
        key = (variant.peer, epsilon)
        if key not in measured:
            peer = make_peer(variant, domains, epsilon)
            encode, aggregate = peer_rates(peer, speed_rows[: args.peer_n], args.peer_time)
            mse, se, checked = peer_accuracy(
                peer, variant, rows, truth, args.peer_runs, args.seed + 2
            )
            measured[key] = PeerMeasures(encode, aggregate, mse, se, checked)
        peer_measures = measured[key]
        result.peer_encode_rate = peer_measures.encode_rate
        result.peer_aggregate_rate = peer_measures.aggregate_rate
        result.peer_mse, result.peer_mse_se = peer_measures.mse, peer_measures.mse_se
        result.capture_checked = peer_measures.capture_checked
    except Exception as error:  # noqa: BLE001 - report the variant and carry on
        result.error = f"{type(error).__name__}: {error}"[:ERROR_CHARS]
    return result


def peer_rates(peer: PeerProtocol, rows: np.ndarray, time_cap: float) -> tuple[float, float]:
    """The peer's (encode rate, aggregate rate) over ``rows``: one client call per user, its
    aggregator over the list of their reports, each the best of up to ``peers.BEST_OF``
    passes within ``time_cap`` seconds (the first pass always runs; numba compiled first).
    Whole batches only: its SMP aggregators refuse a batch in which an attribute has no
    report, so ``peers.time_peer``'s growing batches from 8 reports cannot be used."""
    users = [tuple(int(v) for v in row) for row in rows]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peer.encode_one(users[0])  # compile the clients
        rates = []
        for step in ("encode", "aggregate"):
            best, spent, passes = math.inf, 0.0, 0
            while passes == 0 or (spent + best < time_cap and passes < peer_lib.BEST_OF):
                start = time.perf_counter()
                if step == "encode":
                    reports = [peer.encode_one(x) for x in users]  # the peer's per-user API
                else:
                    peer.aggregate(reports)
                seconds = time.perf_counter() - start
                best, spent, passes = min(best, seconds), spent + seconds, passes + 1
            rates.append(len(users) / best)
    return rates[0], rates[1]


# ---------------------------------------------------------------------------- marginals


@dataclass
class MarginalRow:
    """One way of answering every declared pair: its joint cells' MAE and MSE / stated."""

    method: str
    detail: str
    mae: float = math.nan
    mae_se: float = math.nan
    mse: float = math.nan
    stated: float = math.nan
    error: str = ""

    @property
    def mse_ratio(self) -> float:
        return self.mse / self.stated


def marginal_rows(
    population: Population, epsilon: float, n: int, runs: int, seed: int
) -> list[MarginalRow]:
    """Part 2 (module docstring): smp, auto and spl over every pair view, and each pair as a
    separate categorical report at eps / (pairs), by the fast path over one draw of users."""
    pairs = all_pairs(population)
    domains = tuple(int(d) for d in population.domains if d is not None)
    rng = np.random.default_rng([seed, 10])
    rows = population.sample(n, rng)
    truth = Truth(population, pairs)
    truth.add(rows)
    shares = [truth.pair(index) for index in range(len(pairs))]
    results = []
    for protocol in ("smp", "auto", "spl"):
        spec = spec_json(protocol, "auto", domains, epsilon, pairs)
        label = protocol if protocol != "auto" else f"auto ({spec['mechanism']})"
        row = MarginalRow(label, f"{len(pairs)} pair views, oracle auto, consistent")
        try:
            mechanism = our_mechanism(spec)
            errors, squares, stated = [], [], []
            for _ in range(runs):
                estimate = mechanism.estimate(mechanism.simulate_statistics(rows, rng))
                cells = np.concatenate([np.ravel(m.frequencies) for m in estimate.marginals])
                spread = np.concatenate([np.ravel(m.std) for m in estimate.marginals])
                error = cells - np.concatenate(shares)
                errors.append(float(np.mean(np.abs(error))))
                squares.append(float(np.mean(error**2)))
                stated.append(float(np.mean(spread**2)))
            row.mae, row.mae_se = mean_and_se(errors)
            row.mse, row.stated = float(np.mean(squares)), float(np.mean(stated))
        except Exception as error:  # noqa: BLE001 - report the protocol and carry on
            row.error = f"{type(error).__name__}: {error}"[:ERROR_CHARS]
        results.append(row)
    results.append(separate_pairs(population, pairs, rows, shares, epsilon, runs, rng))
    return results


def separate_pairs(
    population: Population,
    pairs: Sequence[tuple[int, int]],
    rows: np.ndarray,
    shares: list[np.ndarray],
    epsilon: float,
    runs: int,
    rng: np.random.Generator,
) -> MarginalRow:
    """Each pair its own categorical metric (``auto`` at eps / pairs over its d1 d2 joint
    cells): the split budget without consistency."""
    share = epsilon / len(pairs)
    row = MarginalRow("separate", f"{len(pairs)} categorical reports (auto) at eps/{len(pairs)}")
    try:
        mechanisms, counts = [], []
        for (i, j), joint in zip(pairs, shares, strict=True):
            size = int(population.domains[i] or 0) * int(population.domains[j] or 0)
            spec = MechanismSpec.model_validate(
                {"mechanism": "auto", "epsilon": share, "domain_size": size}
            )
            categories = as_categorical(make_mechanism(spec))
            assert categories is not None  # auto is categorical
            mechanisms.append(categories)
            counts.append(np.rint(joint * rows.shape[0]).astype(np.int64))
        errors, squares, stated = [], [], []
        for _ in range(runs):
            error_parts, spread_parts = [], []
            for categories, joint, count in zip(mechanisms, shares, counts, strict=True):
                estimate = categories.estimate(categories.simulate_statistics(count, rng))
                error_parts.append(np.asarray(estimate.frequencies) - joint)
                spread_parts.append(np.asarray(estimate.std))
            error, spread = np.concatenate(error_parts), np.concatenate(spread_parts)
            errors.append(float(np.mean(np.abs(error))))
            squares.append(float(np.mean(error**2)))
            stated.append(float(np.mean(spread**2)))
        row.mae, row.mae_se = mean_and_se(errors)
        row.mse, row.stated = float(np.mean(squares)), float(np.mean(stated))
    except Exception as error:  # noqa: BLE001 - report and carry on
        row.error = f"{type(error).__name__}: {error}"[:ERROR_CHARS]
    return row


# ---------------------------------------------------------------------------- tables


def comparison_lines(comparisons: list[Comparison]) -> list[str]:
    """Speed (x = ours / peer) and MSE (ours, the peer's unbiased), ratio ours / theirs."""
    header = (
        f"{'protocol':<11} {'oracle':<6} {'eps':>4} {'ours@':>5} {'peer@':>5} | "
        f"{'enc/s':>6} {'peer':>6} {'x':>5} | {'agg/s':>6} {'peer':>6} {'x':>5} | "
        f"{'ours mse':>9} {'peer mse':>9} {'ours/peer':>13} {'verdict':>7} | "
        f"{'ours/var':>8} {'peer/var':>8}"
    )
    lines = [header, "-" * len(header)]
    for c in comparisons:
        if c.error:
            lines.append(f"{c.label:<11} {c.oracle:<6} {c.epsilon:>4g} ERROR {c.error}")
            continue
        value, se = c.mse_ratio
        verdict = mse_target(c).verdict if c.comparable else "n/a"
        text = f"{value:.3f}+-{se:.3f}" if math.isfinite(value) else "-"
        lines.append(
            f"{c.label:<11} {c.oracle:<6} {c.epsilon:>4g} {c.our_view:>5.3g} "
            f"{c.peer_view:>5.3g} | {si(c.encode_rate):>6} {si(c.peer_encode_rate):>6} "
            f"{times(c.encode_speedup):>5} | {si(c.aggregate_rate):>6} "
            f"{si(c.peer_aggregate_rate):>6} {times(c.aggregate_speedup):>5} | "
            f"{c.our_mse:>9.3e} {c.peer_mse:>9.3e} {text:>13} {verdict:>7} | "
            f"{c.our_mse / c.stated:>8.3f} {c.peer_mse / c.stated:>8.3f}"
        )
    return lines


def mse_target(c: Comparison) -> Target:
    value, se = c.mse_ratio
    return Target("1", f"{c.label}/{c.oracle} eps {c.epsilon:g} MSE ours/peer", value, se,
                  MSE_TARGET, at_most=True)  # fmt: skip


def marginal_lines(rows: list[MarginalRow], target: Target) -> list[str]:
    header = f"{'method':<12} {'mae':>20} {'mse/stated':>10}  detail"
    lines = [header, "-" * len(header)]
    for row in rows:
        if row.error:
            lines.append(f"{row.method:<12} ERROR {row.error}")
            continue
        lines.append(
            f"{row.method:<12} {row.mae:>10.4e}+-{row.mae_se:.1e} {row.mse_ratio:>10.3f}  "
            f"{row.detail}"
        )
    lines.append(
        f"MAE smp / spl = {target.value:.3f} +- {target.se:.3f} (target {target.wanted}): "
        f"{target.verdict}"
    )
    return lines


def targets_of(comparisons: list[Comparison], marginal: Target | None) -> list[Target]:
    """Every target of the run (module docstring)."""
    found = []
    for c in comparisons:
        if c.error or not math.isfinite(c.peer_mse):
            continue
        if c.comparable:
            found.append(mse_target(c))
        if not c.label.endswith("@inner"):
            for label, speedup in (
                ("encode", c.encode_speedup),
                ("aggregate", c.aggregate_speedup),
            ):
                found.append(
                    Target("1", f"{c.label}/{c.oracle} eps {c.epsilon:g} {label} x", speedup,
                           math.nan, SPEED_TARGET, at_most=False)
                )  # fmt: skip
    if marginal is not None:
        found.append(marginal)
    return found


def marginal_target(rows: list[MarginalRow]) -> Target | None:
    by_method = {row.method: row for row in rows if not row.error}
    if "smp" not in by_method or "spl" not in by_method:
        return None
    ours, theirs = by_method["smp"], by_method["spl"]
    value, se = ratio(ours.mae, ours.mae_se, theirs.mae, theirs.mae_se)
    return Target("2", "marginal MAE smp/spl", value, se, MARGINAL_TARGET, at_most=True)


# ---------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m simulations.benchmarks.multidim_bench",
        description="Multi-attribute protocols (spl, smp, rsfd) against multi-freq-ldpy, "
        "and 2-way marginals against split-budget pair reports.",
    )
    parser.add_argument("--n", type=user_count, help="users of our speed runs (1e6)")
    parser.add_argument("--mse-n", type=user_count, help="users of the MSE runs (5e4)")
    parser.add_argument("--peer-runs", type=user_count, help="the peer's MSE runs (64)")
    parser.add_argument("--our-runs", type=user_count, help="our MSE runs (256)")
    parser.add_argument("--peer-n", type=user_count, help="users timed on the peer (2e4)")
    parser.add_argument("--peer-time", type=float, help="seconds per peer measurement (3)")
    parser.add_argument(
        "--epsilons", type=list_of(positive_float, "epsilons"), help="part 1's epsilons (1,4)"
    )
    parser.add_argument(
        "--domains", type=list_of(user_count, "domains"), default=[4, 8, 16, 32, 64],
        help="part 1's attributes' domain sizes (4,8,16,32,64)",
    )  # fmt: skip
    parser.add_argument("--correlation", type=float, default=0.5, help="copula rho (0.5)")
    parser.add_argument("--marginal-n", type=user_count, help="users of part 2 (1e6)")
    parser.add_argument("--marginal-runs", type=user_count, help="runs of part 2 (20)")
    parser.add_argument("--marginal-epsilon", type=float, default=2.0, help="part 2's epsilon")
    parser.add_argument("--marginal-attributes", type=user_count, default=5, help="part 2 (5)")
    parser.add_argument("--marginal-domain", type=user_count, default=8, help="part 2 (8)")
    parser.add_argument("--no-peers", action="store_true", help="skip multi-freq-ldpy")
    parser.add_argument("--seed", type=int, default=20240601, help="seed of data and noise")
    parser.add_argument("--output", type=Path, help="write every part's results to this JSON")
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    args = parser.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    shape = parse_categorical_shape(SHAPE)
    population = Population(tuple(args.domains), shape, args.correlation)
    status = "skipped (--no-peers)" if args.no_peers else peer_status()
    have_peer = not status.startswith(("unavailable", "skipped"))
    print(
        f"multi-attribute benchmark: domains {population.describe()}, {SHAPE} marginals, "
        f"Gaussian copula rho {args.correlation:g}, seed {args.seed}, numpy {np.__version__}"
    )
    print(f"peer multi-freq-ldpy: {status}")
    if not have_peer and not args.no_peers:
        print("  peer columns skipped: install the bench extra, pip install -e '.[bench]'")

    rng = np.random.default_rng([args.seed, 1])
    rows = population.sample(args.mse_n, rng)
    speed_rows = population.sample(args.n, rng)
    print(
        f"\n1. against multi-freq-ldpy: speed over {counted(args.n, 'user')} (ours) and up to "
        f"{counted(args.peer_n, 'user')} (peer), x = ours / peer (target >= "
        f"{SPEED_TARGET:g}); MSE per value over one draw of {counted(args.mse_n, 'user')}, "
        f"{counted(args.our_runs, 'run')} ours (every user encoded), "
        f"{counted(args.peer_runs, 'run')} the peer (its unbiased estimate); ours/peer target "
        f"<= {MSE_TARGET:g}; ours/var and peer/var: MSE over our stated variance"
    )
    measured: dict[tuple[str, float], PeerMeasures] | None = {} if have_peer else None
    comparisons = []
    print("\n".join(comparison_lines([])))  # the header; then each row as it is measured
    for epsilon in args.epsilons:
        for variant in VARIANTS:
            comparisons.append(
                compare(variant, epsilon, population, rows, speed_rows, args, measured)
            )
            print(comparison_lines(comparisons[-1:])[-1], flush=True)
    count = len(args.domains)
    print(
        "  ours@, peer@: the epsilon of the local randomizer of a reported view (spl: "
        f"eps / {count} per attribute, both). RS+FD: the peer's inner epsilon is the amplified "
        f"ln({count} (e^eps - 1) + 1), which holds only between inputs differing in one "
        "attribute: its reports are NOT eps-LDP for the whole report (one report of inputs "
        "differing in every attribute reaches e^eps'), so at the same nominal eps its MSE "
        "is lower and the target does not apply (n/a); rsfd@inner runs ours at the peer's "
        "eps' (the same report law, the same privacy), where the MSEs must match."
    )
    checks = [c for c in comparisons if have_peer and not c.error]
    if checks:
        print(
            "  peer estimates captured before its clip; clipping them reproduces the peer's "
            "output: " + ("yes" if all(c.capture_checked for c in checks) else "NO")
        )
    sys.stdout.flush()

    marginal_population = Population(
        (args.marginal_domain,) * args.marginal_attributes, shape, args.correlation
    )
    pairs = len(all_pairs(marginal_population))
    print(
        f"\n2. 2-way marginals: {counted(args.marginal_n, 'user')}, epsilon "
        f"{args.marginal_epsilon:g}, {args.marginal_attributes} attributes of "
        f"{args.marginal_domain} values, all {pairs} pairs declared; MAE of the "
        f"{pairs * args.marginal_domain**2} joint cells over {counted(args.marginal_runs, 'run')} "
        "(fast path: statistics drawn from their law given the users' rows)"
    )
    marginals = marginal_rows(
        marginal_population, args.marginal_epsilon, args.marginal_n, args.marginal_runs, args.seed
    )
    marginal = marginal_target(marginals)
    if marginal is not None:
        print("\n".join(marginal_lines(marginals, marginal)))
    else:
        print("\n".join(f"{row.method}: ERROR {row.error}" for row in marginals if row.error))

    failures = [
        f"{c.label}/{c.oracle} eps {c.epsilon:g}: {c.error}" for c in comparisons if c.error
    ]
    failures += [f"marginals {row.method}: {row.error}" for row in marginals if row.error]
    failures += [
        f"{c.label}/{c.oracle} eps {c.epsilon:g}: the captured peer estimate does not "
        "reproduce the peer's output"
        for c in checks
        if not c.capture_checked
    ]
    targets = targets_of(comparisons, marginal)
    misses = [
        f"{t.label} = {t.value:.3g} (target {t.wanted})"
        for t in targets
        if t.verdict.startswith("FAIL")
    ]
    print(f"\nfinished in {time.perf_counter() - started:.0f} s")
    for line in failures:
        print(f"  FAIL {line}")
    for line in misses:
        print(f"  MISS {line}")
    if not have_peer:
        print("  NOTE the peer was not run: its speed and MSE targets were not checked")
    if not failures:
        print("  All checks passed" + ("." if misses or not have_peer else "; all targets met."))
    if args.output is not None:
        write_output(args.output, comparisons, marginals, targets, failures)
        print(f"results written to {args.output}")
    return 1 if failures else 0


def write_output(
    path: Path,
    comparisons: list[Comparison],
    marginals: list[MarginalRow],
    targets: list[Target],
    failures: list[str],
) -> None:
    """Every part's results as one JSON document (NaN as null)."""

    def clean(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {key: clean(item) for key, item in value.items()}
        if isinstance(value, list | tuple):
            return [clean(item) for item in value]
        return value

    document = {
        "comparisons": [
            {
                **asdict(c),
                "encode_speedup": c.encode_speedup,
                "aggregate_speedup": c.aggregate_speedup,
                "mse_ratio": c.mse_ratio[0],
                "mse_ratio_se": c.mse_ratio[1],
            }
            for c in comparisons
        ],
        "marginals": [asdict(row) for row in marginals],
        "targets": [{**asdict(t), "verdict": t.verdict} for t in targets],
        "failures": failures,
    }
    path.write_text(json.dumps(clean(document), indent=2) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
