"""Benchmark of the distribution mechanisms ``hh`` and ``sw``: against the peer library
ldp-hierarchical-mechanism 0.1.3, against the flat histogram, quantiles, and scale.

Run from the repository root (a script, not a test)::

    python -m simulations.benchmarks.distribution_bench --quick     # smoke run, seconds
    python -m simulations.benchmarks.distribution_bench             # full run, 15-20 minutes

One population kind throughout: latencies from a lognormal law (median ``MEDIAN_MS`` ms,
log-standard deviation ``SIGMA``) on a log-scale domain [``LOWER``, ``UPPER``] ms cut into
D = ``--buckets`` buckets of equal ratios (``DistributionSpec``); ``hh`` uses the branching
B = ``--branching``. Every epsilon below is what one report reveals.

1. Against ldp-hierarchical-mechanism 0.1.3 (``Private_TreeBary``, Kulkarni, Cormode and
   Srivastava's hierarchical mechanism on pure-ldp), at the same (epsilon, D, B, n =
   ``--peer-users``): the peer works on integers, so each user's value is mapped to its
   bucket index 0..D-1 by our spec (``bucket_of``), and the peer's tree over [0, D] has
   exactly the D buckets as leaves. The peer runs with ``on_all_levels=False`` (each user
   reports one level drawn uniformly, the full epsilon on it: epsilon-LDP as ours; with
   ``True`` every user reports every level, (depth - 1) epsilon in all, and its root,
   fixed at 1, is mixed with absolute counts) and its default oracle (``unary_encoding``:
   pure-ldp's OUE for every level up to 10^4 nodes), then ``compute_attributes`` and
   ``post_process`` (Hay et al.'s weighted averaging up the tree and mean consistency
   down). The same users (one draw) run ``--peer-runs`` times through the peer's own
   ``update_tree`` (its per-user Python loop; numpy's and Python's global generators
   seeded per run) and ``--encode-runs`` times through ours (every user encoded and
   aggregated: see 2b for why not the fast path).
   Measures, the same for both: the MSE of ``--ranges`` range shares per run (each
   range [e_i, e_j) from two distinct edges drawn uniformly among the D + 1, the same
   ranges for run r on both sides), ours from the unbiased, consistent CDF (what
   ``range_fraction`` answers), the peer's from its post-processed leaves (its
   ``get_range_query``); the rank error of the q-quantile at bucket resolution (the
   peer answers a bucket): for an answer in bucket b, the distance from q to
   [F_b, F_b+1], F the users' CDF at the edges (0 when b holds the quantile), ours for
   the bucket of our point (the first b whose post-processed CDF reaches q), the
   peer's from ``get_quantile``. Each mean has its standard error over runs; a ratio's
   standard error is the delta method's. Speed by rate (``peers.time_peer``: best of
   several passes within ``--peer-time`` seconds, warm-up first): the peer's encode is
   one call per user (draw a level, ``find_interval_index``, the level's
   ``privatise``), its aggregate one ``aggregate`` per report then
   ``compute_attributes`` and ``post_process``; ours encode and aggregate (with the
   estimate) every one of ``--users`` real values, best of ``SPEED_REPEATS`` passes.
2-3, 5. ``--runs`` runs of ``hh``, ``sw`` and the flat baseline (``auto`` over the same D
   buckets as a categorical metric) over one draw of ``--users`` latencies, every user
   encoded (``--path fast``: the fast path instead, see 2b): range MSE over ``--ranges``
   random ranges per run and over as many wide ranges (covering more than ``WIDE_SHARE``
   of the domain: two edges uniform among the pairs j - i > D / 10); the rank error
   |F(Q^) - q| of the point quantile, F the users' own (empirical) CDF; the Wasserstein
   distance (1/D) sum_k |P_k - F_k| of the post-processed CDF P at the edges (W1 on the
   bucket axis, in units of the domain);
   95% interval widths and coverage (ranges: 2 z std from the mechanism's
   Var[F^_j - F^_i]; quantiles: the hull of the buckets not ruled out, in buckets).
2b. The fast path checked: the MSEs of ``--runs`` fast-path runs against those of
   ``--encode-runs`` runs with every user encoded, over part 1's users. OLH's
   ``simulate_statistics`` draws each item's support count independently, exact per item
   but not jointly (its docstring): one report's supports of several items are dependent
   through the shared hash, so a range, a sum of items, need not have the fast path's
   variance. ``hh``'s OLH levels and the flat baseline (``auto`` resolves to OLH at
   epsilon 1, D = 1024) both sum such items, so parts 2, 3 and 5 encode every user.
4. Scale: ``simulate_statistics`` and ``estimate`` at n = ``--big-users`` (bucket counts
   drawn from the lognormal law, untimed), ``hh`` and ``sw``.

Targets (PASS/FAIL in each table; MISS lines at the end): 1. our range MSE and quantile
rank error at most ``PEER_ACCURACY_TARGET`` times the peer's, encode and aggregate at
least ``SPEED_TARGET`` times its rate; 2. the flat baseline's wide-range MSE at least
``FLAT_TARGET`` times hh's; 3. hh's p50 and p95 within ``RANK_TOLERANCE`` of rank in at
least ``RANK_SHARE`` of runs; 4. simulate and estimate at ``--big-users`` under
``SCALE_TARGET_SECONDS`` each mechanism. A ratio within two standard errors of its target
is marked ``?`` (the verdict is within noise). Checks (FAIL lines, exit status 1): every
mechanism and the peer run without error.

ldp-hierarchical-mechanism is the optional ``bench`` extra; without it part 1 is
skipped with a message. It imports pure-ldp's whole ``frequency_oracles`` package,
whose RAPPOR module imports statsmodels 0.14.4 (pinned by the peer), which fails under
scipy >= 1.16 (``_lazywhere`` was removed); ``load_peer`` then imports it again with an
empty ``statsmodels.api`` module (RAPPOR is never used here), and says so.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import math
import random
import sys
import time
import types
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from statistics import NormalDist
from typing import Any

import numpy as np

from shared.distributions import DistributionEstimate
from shared.estimates import z_value
from shared.mechanisms import (
    MECHANISMS,
    DistributionValues,
    Mechanism,
    as_categorical,
    as_distribution,
    make_mechanism,
)
from shared.mechanisms.spec import DistributionSpec, as_distribution_spec
from shared.schemas import MechanismSpec
from simulations import report
from simulations.arguments import checked, list_of, one_of, user_count
from simulations.benchmarks import peers as peer_lib
from simulations.benchmarks.mechanisms import SPEED_TARGET, si, times
from simulations.text import counted

#: The latency law and its domain (milliseconds, log scale).
MEDIAN_MS, SIGMA = 100.0, 1.0
LOWER, UPPER = 1.0, 1e5
LEVELS = (0.5, 0.9, 0.95, 0.99)
CONFIDENCE = 0.95
#: Wide ranges cover more than this share of the domain.
WIDE_SHARE = 0.1
PEER_ACCURACY_TARGET = 0.7
FLAT_TARGET = 3.0
RANK_TOLERANCE, RANK_SHARE, RANK_LEVELS = 0.02, 0.95, (0.5, 0.95)
SCALE_TARGET_SECONDS = 60.0
#: Passes of our encode and aggregate whose best rate counts.
SPEED_REPEATS = 3
#: Reports whose mean size is shown.
REPORT_SAMPLE = 1000
#: Users encoded per call (memory of one batch of reports).
CHUNK = 1 << 18
#: Our mechanisms, the flat baseline's wire name.
OURS = ("hh", "sw")
FLAT = "auto"
PEER_DISTRIBUTION = "ldp-hierarchical-mechanism"
PARTS = ("peer", "runs", "scale")
#: How parts 2, 3 and 5 make each run's statistics (``--path``).
PATHS = {"encode": "every user encoded", "fast": "fast path"}
#: Error messages are cut to this length.
ERROR_CHARS = 240

FULL = {
    "users": 10**6,
    "peer_users": 10**5,
    "runs": 200,
    "peer_runs": 30,
    "encode_runs": 100,
    "ranges": 200,
    "buckets": 1024,
    "big_users": 10**8,
    "peer_time": 5.0,
}
QUICK = {
    "users": 20_000,
    "peer_users": 2000,
    "runs": 8,
    "peer_runs": 3,
    "encode_runs": 4,
    "ranges": 20,
    "buckets": 64,
    "big_users": 10**6,
    "peer_time": 0.3,
}


# ---------------------------------------------------------------------------- population


@dataclass(frozen=True)
class Population:
    """Users' latencies as counts per bucket; ``values`` (sorted) and their ``buckets``
    when drawn one by one."""

    counts: np.ndarray
    values: np.ndarray | None = None
    buckets: np.ndarray | None = None

    @property
    def n(self) -> int:
        return int(self.counts.sum())

    @property
    def cdf(self) -> np.ndarray:
        """F_k, the share of users below edge k, at the D + 1 edges."""
        return np.concatenate([[0.0], np.cumsum(self.counts)]) / self.n

    def rank(self, value: float) -> float:
        """The users' empirical CDF at ``value``: the share of values at most it."""
        assert self.values is not None, "ranks need the users' values"
        return float(np.searchsorted(self.values, value, side="right")) / self.values.size

    def quantile(self, q: float) -> float:
        """The users' q-quantile: the smallest value whose rank reaches q."""
        assert self.values is not None, "quantiles need the users' values"
        return float(self.values[max(0, math.ceil(q * self.values.size) - 1)])


def latencies(n: int, seed: int) -> np.ndarray:
    """n lognormal latencies (median ``MEDIAN_MS``, log-std ``SIGMA``), sorted."""
    rng = np.random.default_rng([seed, 0])
    return np.sort(rng.lognormal(math.log(MEDIAN_MS), SIGMA, size=n))


def drawn_population(spec: DistributionSpec, n: int, seed: int) -> Population:
    """n users drawn one by one, with their bucket counts under ``spec``."""
    values = latencies(n, seed)
    buckets = spec.bucket_of(values)
    return Population(np.bincount(buckets, minlength=spec.bucket_count), values, buckets)


def law_population(spec: DistributionSpec, n: int, seed: int) -> Population:
    """Bucket counts of n users drawn from the lognormal law at once (multinomial over
    P(bucket b) = Phi((ln e_b+1 - mu) / sigma) - Phi((ln e_b - mu) / sigma), the mass
    outside [lower, upper] in the end buckets, as clipping puts it)."""
    law = NormalDist(math.log(MEDIAN_MS), SIGMA)
    inner = [law.cdf(math.log(edge)) for edge in spec.edges()[1:-1]]
    probabilities = np.diff(np.concatenate([[0.0], inner, [1.0]]))
    counts = np.random.default_rng([seed, 1]).multinomial(n, probabilities)
    return Population(counts.astype(np.int64))


def random_ranges(
    buckets: int, count: int, rng: np.random.Generator, wide: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """``count`` ranges [e_i, e_j) as edge indices i < j: two distinct edges uniform among
    the D + 1; ``wide``: uniform among the pairs with j - i > ``WIDE_SHARE`` D (rejection)."""
    lows: list[np.ndarray] = []
    highs: list[np.ndarray] = []
    found = 0
    while found < count:
        pairs = np.sort(rng.choice(buckets + 1, size=(4 * count, 2), replace=True), axis=1)
        keep = pairs[:, 1] - pairs[:, 0] > (WIDE_SHARE * buckets if wide else 0)
        pairs = pairs[keep][: count - found]
        lows.append(pairs[:, 0])
        highs.append(pairs[:, 1])
        found += pairs.shape[0]
    return np.concatenate(lows), np.concatenate(highs)


# ---------------------------------------------------------------------------- mechanisms


def distribution_spec(name: str, epsilon: float, buckets: int, branching: int) -> DistributionSpec:
    """``hh`` or ``sw`` over [LOWER, UPPER] ms, log scale, ``buckets`` buckets."""
    if name not in MECHANISMS:
        raise ValueError(f"{name!r} is not a registered mechanism (shared.mechanisms.PLUGINS)")
    fields: dict[str, Any] = {
        "mechanism": name,
        "epsilon": epsilon,
        "lower": LOWER,
        "upper": UPPER,
        "buckets": buckets,
        "scale": "log",
    }
    if name == "hh":
        fields["branching"] = branching
    spec = as_distribution_spec(MechanismSpec.model_validate(fields))
    assert spec is not None  # hh and sw are distribution mechanisms
    return spec


def distribution_of(spec: MechanismSpec) -> tuple[Mechanism[Any], DistributionValues]:
    """The mechanism of ``spec`` and its ``DistributionValues`` ability."""
    mechanism = make_mechanism(spec)
    values = as_distribution(mechanism)
    if values is None:
        raise ValueError(f"{spec.mechanism!r} does not estimate a distribution")
    return mechanism, values


def point_bucket(estimate: DistributionEstimate, q: float) -> int:
    """The bucket of the point q-quantile: the first b whose post-processed CDF P_b+1
    reaches q (``DistributionEstimate.quantiles``)."""
    bucket = int(np.searchsorted(estimate.postprocessed_cdf()[1:], q, side="left"))
    return min(bucket, estimate.buckets - 1)


def bucket_rank_error(cdf: np.ndarray, bucket: int, q: float) -> float:
    """Distance from q to [F_b, F_b+1], the ranks bucket b holds (0 when it holds Q_q)."""
    return max(float(cdf[bucket]) - q, q - float(cdf[bucket + 1]), 0.0)


# ---------------------------------------------------------------------------- measures


@dataclass
class Tally:
    """Per-run measures by name, summarized as mean and standard error over runs."""

    values: dict[str, list[float]] = field(default_factory=dict)

    def add(self, name: str, value: float | np.floating[Any] | np.bool_) -> None:
        self.values.setdefault(name, []).append(float(value))

    def mean(self, name: str) -> float:
        found = self.values.get(name)
        return float(np.mean(found)) if found else math.nan

    def se(self, name: str) -> float:
        found = self.values.get(name, [])
        return float(np.std(found, ddof=1) / math.sqrt(len(found))) if len(found) > 1 else math.nan

    def share(self, name: str, bound: float) -> tuple[float, float]:
        """(share of runs with the measure at most ``bound``, its binomial standard error)."""
        found = np.asarray(self.values.get(name, []))
        if not found.size:
            return math.nan, math.nan
        share = float(np.mean(found <= bound))
        return share, math.sqrt(max(share * (1 - share), 1e-12) / found.size)

    def runs(self, name: str) -> int:
        return len(self.values.get(name, []))


def range_errors(
    estimated: np.ndarray, truth: np.ndarray, ranges: tuple[np.ndarray, np.ndarray]
) -> np.ndarray:
    """Errors of the range shares F^_j - F^_i against F_j - F_i."""
    low, high = ranges
    return (estimated[high] - estimated[low]) - (truth[high] - truth[low])


def measure_estimate(
    tally: Tally,
    estimate: DistributionEstimate,
    population: Population,
    ranges: tuple[np.ndarray, np.ndarray],
    wide: tuple[np.ndarray, np.ndarray],
) -> None:
    """Every per-run measure of one of our estimates (module docstring, parts 2-3, 5)."""
    truth = population.cdf
    z = z_value(CONFIDENCE)
    errors = range_errors(estimate.cdf, truth, ranges)
    std = estimate.between_std(*ranges)
    tally.add("range_mse", np.mean(errors**2))
    tally.add(
        "range_post_mse", np.mean(range_errors(estimate.postprocessed_cdf(), truth, ranges) ** 2)
    )
    tally.add("wide_mse", np.mean(range_errors(estimate.cdf, truth, wide) ** 2))
    tally.add("range_width", np.mean(2 * z * std))
    tally.add("range_cover", np.mean(np.abs(errors) <= z * std))
    tally.add("w1", np.sum(np.abs(estimate.postprocessed_cdf() - truth)) / estimate.buckets)
    ranks = []
    for answer in estimate.quantiles(LEVELS, CONFIDENCE):
        q = answer.q
        ranks.append(bucket_rank_error(truth, point_bucket(estimate, q), q))
        tally.add(f"bucket_rank_{q:g}", ranks[-1])
        width = estimate.nearest_edge(answer.ci_high) - estimate.nearest_edge(answer.ci_low)
        tally.add(f"q_width_{q:g}", width)
        if population.values is not None:
            tally.add(f"rank_{q:g}", abs(population.rank(answer.value) - q))
            truth_q = population.quantile(q)
            tally.add(f"q_cover_{q:g}", answer.ci_low <= truth_q <= answer.ci_high)
    tally.add("bucket_rank_mean", np.mean(ranks))


def run_statistics(
    mechanism: Mechanism[Any],
    population: Population,
    rng: np.random.Generator,
    path: str,
) -> Any:
    """One run's statistics: drawn from their law (``path="fast"``, ``simulate_statistics``
    of the bucket counts) or from every user's report (``"encode"``: the values, or their
    buckets for a categorical mechanism, encoded and aggregated in chunks of ``CHUNK``)."""
    distribution = as_distribution(mechanism)
    if path == "fast":
        if distribution is not None:
            return distribution.simulate_statistics(population.counts, rng)
        categories = as_categorical(mechanism)
        assert categories is not None  # the flat baseline is categorical
        return categories.simulate_statistics(population.counts, rng)
    assert population.values is not None, "encoding needs the users' values"
    inputs = population.values if distribution is not None else population.buckets
    assert inputs is not None
    stats = mechanism.empty_statistics()
    for start in range(0, inputs.size, CHUNK):
        stats = stats.merge(
            mechanism.aggregate(mechanism.encode(inputs[start : start + CHUNK], rng))
        )
    return stats


def measure_runs(
    spec: MechanismSpec,
    population: Population,
    runs: int,
    range_count: int,
    seed: int,
    path: str = "fast",
) -> Tally:
    """``runs`` runs of one mechanism over ``population`` (``run_statistics``) and their
    measures; the ranges of run r are the same for every mechanism (seeded by r)."""
    tally = Tally()
    mechanism = make_mechanism(spec)
    values = as_distribution(mechanism)
    buckets = population.counts.size
    for run in range(runs):
        rng = np.random.default_rng([seed, 2, *spec.mechanism.encode(), run, path == "fast"])
        shapes = np.random.default_rng([seed, 3, run])
        ranges = random_ranges(buckets, range_count, shapes)
        wide = random_ranges(buckets, range_count, shapes, wide=True)
        stats = run_statistics(mechanism, population, rng, path)
        if values is None:  # the flat baseline: cumulated unbiased bucket frequencies
            categories = as_categorical(mechanism)
            assert categories is not None
            frequencies = categories.estimate(stats).frequencies
            cdf = np.concatenate([[0.0], np.cumsum(frequencies)])
            tally.add("range_mse", np.mean(range_errors(cdf, population.cdf, ranges) ** 2))
            tally.add("wide_mse", np.mean(range_errors(cdf, population.cdf, wide) ** 2))
            continue
        measure_estimate(tally, values.estimate(stats), population, ranges, wide)
    return tally


def our_rates(name: str, args: argparse.Namespace, values: np.ndarray) -> tuple[float, float]:
    """(encode, aggregate with the estimate) rates of our ``name`` at the run's parameters
    over every one of ``values``, in chunks of ``CHUNK``: best of ``SPEED_REPEATS`` passes
    (the least disturbed)."""
    mechanism = make_mechanism(distribution_spec(name, args.epsilon, args.buckets, args.branching))
    rng = np.random.default_rng([args.seed, 4])
    distribution = as_distribution(mechanism)
    assert distribution is not None
    mechanism.aggregate(mechanism.encode(values[:1024], rng))  # warm-up, untimed
    best_encode = best_aggregate = math.inf
    for _ in range(SPEED_REPEATS):
        encode_seconds = aggregate_seconds = 0.0
        stats = mechanism.empty_statistics()
        for start in range(0, values.size, CHUNK):
            t0 = time.perf_counter()
            reports = mechanism.encode(values[start : start + CHUNK], rng)
            t1 = time.perf_counter()
            stats = stats.merge(mechanism.aggregate(reports))
            aggregate_seconds += time.perf_counter() - t1
            encode_seconds += t1 - t0
            del reports
        t0 = time.perf_counter()
        distribution.estimate(stats)
        aggregate_seconds += time.perf_counter() - t0
        best_encode = min(best_encode, encode_seconds)
        best_aggregate = min(best_aggregate, aggregate_seconds)
    return values.size / best_encode, values.size / best_aggregate


# ---------------------------------------------------------------------------- the peer


def load_peer() -> tuple[Any, str]:
    """(the peer's ``Private_TreeBary``, ``"<version>"``), or (None, ``"unavailable
    (<reason>)"``); imported again over an empty ``statsmodels.api`` when statsmodels
    does not import (module docstring)."""
    try:
        version = importlib.metadata.version(PEER_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None, f"unavailable ({PEER_DISTRIBUTION} is not installed)"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            module = importlib.import_module("hierarchical_mechanism_LDP.mechanism")
        except ImportError as error:
            if "_lazywhere" not in str(error) and "statsmodels" not in str(error):
                return None, f"unavailable ({error_text(error)})"
            sys.modules["statsmodels.api"] = types.ModuleType("statsmodels.api")
            try:
                module = importlib.import_module("hierarchical_mechanism_LDP.mechanism")
            except Exception as again:  # noqa: BLE001 - any failure means "not available"
                return None, f"unavailable ({error_text(again)})"
            finally:
                del sys.modules["statsmodels.api"]
            version += " (statsmodels.api stubbed: it fails to import under this scipy)"
        except Exception as error:  # noqa: BLE001 - any failure means "not available"
            return None, f"unavailable ({error_text(error)})"
    return module.Private_TreeBary, version


def peer_tree(tree_class: Any, epsilon: float, buckets: int, branching: int) -> Any:
    """The peer's tree over [0, D] with the D buckets as leaves, one level per user."""
    tree = tree_class(buckets, branching, epsilon, on_all_levels=False)
    if tree.B != buckets:
        raise ValueError(
            f"the peer's {branching}-ary tree over [0, {buckets}] has {tree.B} leaves, not "
            f"the {counted(buckets, 'bucket')}: choose buckets a power of the branching"
        )
    return tree


def peer_run(
    tree_class: Any, epsilon: float, branching: int, buckets: np.ndarray, size: int, seed: int
) -> Any:
    """The peer's post-processed tree over users in ``buckets`` (its own ``update_tree``)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)  # noqa: NPY002 - the peer draws from numpy's global one
    tree = peer_tree(tree_class, epsilon, size, branching)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tree.update_tree(buckets)
        tree.compute_attributes()
        tree.post_process()
    return tree


def peer_quantile(tree: Any, q: float) -> tuple[int, bool]:
    """(the peer's q-quantile bucket, whether it answered): its ``get_quantile`` fails
    when its CDF never reaches q (its total mass is not held at 1); then the last bucket."""
    try:
        return int(tree.get_quantile(q)), True
    except ValueError:
        return int(len(tree.cdf) - 1), False


def first_crossing(cdf: np.ndarray, q: float) -> int:
    """The first leaf whose cumulative estimate reaches q (the last when none does): the
    peer's post-processed CDF read as ours is (``point_bucket``), for comparison with its
    own ``get_quantile``, which returns the leaf whose estimate is closest above q."""
    reached = np.flatnonzero(np.asarray(cdf) >= q)
    return int(reached[0]) if reached.size else len(cdf) - 1


def peer_accuracy(
    tree_class: Any,
    epsilon: float,
    branching: int,
    population: Population,
    runs: int,
    range_count: int,
    seed: int,
) -> Tally:
    """The peer's measures over ``runs`` runs on the users' buckets (ranges as
    ``measure_runs``'s run r)."""
    assert population.buckets is not None, "the peer needs every user's bucket"
    tally = Tally()
    size = population.counts.size
    truth = population.cdf
    for run in range(runs):
        ranges = random_ranges(size, range_count, np.random.default_rng([seed, 3, run]))
        tree = peer_run(tree_class, epsilon, branching, population.buckets, size, seed * 1000 + run)
        cdf = np.concatenate([[0.0], np.asarray(tree.cdf, dtype=np.float64)])
        tally.add("range_mse", np.mean(range_errors(cdf, truth, ranges) ** 2))
        tally.add("mass_error", abs(cdf[-1] - 1.0))
        errors, first = [], []
        for q in LEVELS:
            bucket, answered = peer_quantile(tree, q)
            errors.append(bucket_rank_error(truth, bucket, q))
            first.append(bucket_rank_error(truth, first_crossing(tree.cdf, q), q))
            tally.add(f"bucket_rank_{q:g}", errors[-1])
            tally.add(f"first_rank_{q:g}", first[-1])
            tally.add(f"unanswered_{q:g}", not answered)
        tally.add("bucket_rank_mean", np.mean(errors))
        tally.add("first_rank_mean", np.mean(first))
    return tally


def peer_timing_view(
    tree_class: Any, epsilon: float, buckets: int, branching: int
) -> peer_lib.PeerMechanism:
    """The peer's per-user encode and whole-batch aggregate, for ``peers.time_peer``.

    encode: a level drawn as its ``update_tree`` draws it, the user's node there
    (``find_interval_index``), the level's client ``privatise``; aggregate: its servers
    reset, one ``aggregate`` per report, then ``compute_attributes`` and ``post_process``.
    """
    tree = peer_tree(tree_class, epsilon, buckets, branching)
    clients, servers = list(tree.clients), list(tree.servers)

    def encode_one(value: int) -> tuple[int, Any]:
        level = int(np.random.randint(1, tree.depth))  # noqa: NPY002 - the peer's own draw
        return level, clients[level - 1].privatise(tree.find_interval_index(value, level))

    def aggregate(reports: list[Any]) -> np.ndarray:
        for server in servers:
            server.reset()
        counts = [0] * (tree.depth - 1)
        for level, report_ in reports:
            servers[level - 1].aggregate(report_)
            counts[level - 1] += 1
        tree.servers, tree.counts, tree.N = servers, counts, len(reports)
        tree.attributes, tree.cdf = None, None
        tree.compute_attributes()
        tree.post_process()
        return np.asarray(tree.cdf, dtype=np.float64)

    return peer_lib.PeerMechanism(
        PEER_DISTRIBUTION, "hh", "Private_TreeBary(on_all_levels=False)", encode_one,
        aggregate, 8 * buckets + 112,
    )  # fmt: skip


# ---------------------------------------------------------------------------- verdicts


@dataclass
class Target:
    """One measured ratio (or value) against its target: ``at_most`` or at least."""

    part: str
    label: str
    value: float
    se: float
    target: float
    at_most: bool

    @property
    def met(self) -> bool:
        return self.value <= self.target if self.at_most else self.value >= self.target

    @property
    def verdict(self) -> str:
        if not math.isfinite(self.value):
            return "-"
        noisy = math.isfinite(self.se) and abs(self.value - self.target) < 2 * self.se
        return ("PASS" if self.met else "FAIL") + ("?" if noisy else "")

    @property
    def wanted(self) -> str:
        return ("<= " if self.at_most else ">= ") + f"{self.target:g}"


def ratio(a: float, se_a: float, b: float, se_b: float) -> tuple[float, float]:
    """a / b and its delta-method standard error."""
    value = a / b
    return value, abs(value) * math.hypot(se_a / a if a else 0.0, se_b / b if b else 0.0)


def estimate_text(mean: float, se: float, digits: int = 3) -> str:
    if not math.isfinite(mean):
        return "-"
    spread = f"{se:.1e}" if math.isfinite(se) else "-"
    return f"{mean:.{digits}e}+-{spread}"


# ---------------------------------------------------------------------------- parts


@dataclass
class PeerPart:
    """Part 1's measures: ours (every user encoded), the peer's, and both rates."""

    ours: Tally
    peer: Tally
    rates: tuple[float, float]
    peer_timing: peer_lib.PeerTiming
    report_bytes: tuple[float, float]  # ours, the peer's: mean bytes of one report


def peer_part(
    args: argparse.Namespace,
    tree_class: Any,
    population: Population,
    ours: Tally,
    rates: tuple[float, float],
    timing_buckets: np.ndarray,
) -> PeerPart:
    """The peer over ``population`` (``ours``: our runs over the same users) and its rates
    over (a prefix of) ``timing_buckets``, shuffled."""
    peer = peer_accuracy(
        tree_class, args.epsilon, args.branching, population, args.peer_runs, args.ranges,
        args.seed,
    )  # fmt: skip
    shuffled = np.random.default_rng([args.seed, 5]).permutation(timing_buckets)
    view = peer_timing_view(tree_class, args.epsilon, args.buckets, args.branching)
    timing = peer_lib.time_peer(view, shuffled, args.peer_time)
    assert population.values is not None
    sample = population.values[:REPORT_SAMPLE]
    mechanism = make_mechanism(distribution_spec("hh", args.epsilon, args.buckets, args.branching))
    ours_bytes = mechanism.encode(sample, np.random.default_rng([args.seed, 8])).nbytes
    peer_bytes = sum(np.asarray(view.encode_one(int(b))[1]).nbytes for b in shuffled[: sample.size])
    sizes = (ours_bytes / sample.size, peer_bytes / sample.size)
    return PeerPart(ours, peer, rates, timing, sizes)


def peer_lines(part: PeerPart) -> tuple[list[str], list[Target]]:
    header = (
        f"{'measure':<26} {'ours':>19} {'peer':>19} {'ours/peer':>14} {'target':>7} {'verdict':>7}"
    )
    lines = [header, "-" * len(header)]
    targets: list[Target] = []
    names = [("range MSE", "range_mse"), ("range MSE, post-processed", "range_post_mse")]
    names += [(f"rank err q={q:g}", f"bucket_rank_{q:g}") for q in LEVELS]
    names += [("rank err, mean of q", "bucket_rank_mean")]
    for label, name in names:
        ours, ours_se = part.ours.mean(name), part.ours.se(name)
        theirs, theirs_se = part.peer.mean(name), part.peer.se(name)
        if name == "range_post_mse":  # the peer's only CDF is its post-processed one
            theirs, theirs_se = part.peer.mean("range_mse"), part.peer.se("range_mse")
        value, se = ratio(ours, ours_se, theirs, theirs_se)
        target = Target("1", label, value, se, PEER_ACCURACY_TARGET, at_most=True)
        targets.append(target)
        lines.append(
            f"{label:<26} {estimate_text(ours, ours_se):>19} "
            f"{estimate_text(theirs, theirs_se):>19} {value:>7.3f}+-{se:<5.3f} "
            f"{target.wanted:>7} {target.verdict:>7}"
        )
    timing = part.peer_timing
    for label, ours_rate, theirs_rate, count in (
        ("encode /s", part.rates[0], timing.encode_rate, timing.encoded),
        ("aggregate /s", part.rates[1], timing.aggregate_rate, timing.aggregated),
    ):
        target = Target("1", label, ours_rate / theirs_rate, math.nan, SPEED_TARGET, at_most=False)
        targets.append(target)
        peer_cell = f"{si(theirs_rate)} ({counted(count, 'user')})"
        lines.append(
            f"{label:<26} {si(ours_rate):>19} {peer_cell:>19} {times(target.value) + 'x':>14} "
            f"{target.wanted:>7} {target.verdict:>7}"
        )
    return lines, targets


def peer_notes(part: PeerPart) -> list[str]:
    """What differs between the two estimators, measured where it can be."""
    unanswered = [
        f"q={q:g} {part.peer.mean(f'unanswered_{q:g}'):.0%}"
        for q in LEVELS
        if part.peer.mean(f"unanswered_{q:g}") > 0
    ]
    first_crossings = []
    for label in [f"{q:g}" for q in LEVELS] + ["mean"]:
        ours, theirs = f"bucket_rank_{label}", f"first_rank_{label}"
        value, se = ratio(
            part.ours.mean(ours), part.ours.se(ours), part.peer.mean(theirs), part.peer.se(theirs)
        )
        first_crossings.append(f"q={label} {part.peer.mean(theirs):.2e} ({value:.2f}+-{se:.2f})")
    return [
        f"  runs: ours {part.ours.runs('range_mse')} (every user encoded), peer "
        f"{part.peer.runs('range_mse')} (its update_tree over every user); +- is the standard "
        "error over runs, a ratio's by the delta method",
        "  ours: 'range MSE' from the unbiased consistent CDF (what range_fraction answers), "
        "'post-processed' from the isotonic fit (the published histogram), both against the "
        "peer's post-processed CDF (its get_range_query)",
        f"  one report: ours {part.report_bytes[0]:.0f} bytes (level, hash a, b, value), the "
        f"peer's {part.report_bytes[1]:.0f} bytes on average (a dense int64 OUE vector of "
        "its level's nodes): its aggregate is one vector add per report, ours decodes "
        "hashes (OLH levels) on the server",
        "  peer: OUE (pure-ldp UEClient use_oue=True) at every level, one level per user, "
        "Hay et al. consistency (weighted averaging up, mean consistency down) with equal "
        "weights per level and the root, exactly 1, averaged as a noisy node; no "
        "non-negativity or monotone fit",
        f"  peer total mass |F^_D - 1|: mean {part.peer.mean('mass_error'):.2e} (ours is 1 "
        "exactly); get_quantile found no leaf reaching q (answered the last bucket): "
        + (", ".join(unanswered) if unanswered else "never"),
        "  peer get_quantile returns the leaf whose CDF is closest above q, anywhere in the "
        "domain (its CDF is not monotone); read as the first leaf reaching q instead, its "
        "rank error and ours / it: " + ", ".join(first_crossings),
    ]


@dataclass
class RunsPart:
    """Parts 2, 3 and 5: hh, sw and the flat baseline over one population on the fast
    path, and (``checks``) the fast path against every user encoded on a smaller one."""

    tallies: dict[str, Tally]
    checks: dict[str, tuple[Tally, Tally]]
    flat_name: str
    rates: dict[str, tuple[float, float]]
    errors: dict[str, str]


def runs_part(
    args: argparse.Namespace,
    population: Population,
    small: Population,
    encoded: dict[str, Tally],
    rates: dict[str, tuple[float, float]],
) -> RunsPart:
    """``--runs`` fast-path runs of every mechanism over ``population``, and the fast path
    checked against every user encoded (``--encode-runs``, reusing ``encoded``) on ``small``."""
    flat = MechanismSpec.model_validate(
        {"mechanism": FLAT, "epsilon": args.epsilon, "domain_size": args.buckets}
    )
    part = RunsPart({}, {}, f"{FLAT} -> {make_mechanism(flat).name}", rates, {})
    for name in (*OURS, FLAT):
        try:
            spec = (
                flat
                if name == FLAT
                else distribution_spec(name, args.epsilon, args.buckets, args.branching)
            )
            part.tallies[name] = measure_runs(
                spec, population, args.runs, args.ranges, args.seed, args.path
            )
            if name not in encoded:
                encoded[name] = measure_runs(
                    spec, small, args.encode_runs, args.ranges, args.seed, "encode"
                )
            fast = measure_runs(spec, small, args.runs, args.ranges, args.seed)
            part.checks[name] = (encoded[name], fast)
        except Exception as error:  # noqa: BLE001 - report the mechanism and carry on
            part.errors[name] = error_text(error)
    return part


def flat_lines(part: RunsPart) -> tuple[list[str], list[Target]]:
    header = f"{'method':<14} {'wide-range MSE':>19} {'flat/hh':>14} {'target':>7} {'verdict':>7}"
    lines = [header, "-" * len(header)]
    if "hh" not in part.tallies or FLAT not in part.tallies:
        return lines + [f"ERROR {part.errors}"], []
    hh, flat = part.tallies["hh"], part.tallies[FLAT]
    value, se = ratio(
        flat.mean("wide_mse"), flat.se("wide_mse"), hh.mean("wide_mse"), hh.se("wide_mse")
    )
    target = Target("2", "flat/hh wide-range MSE", value, se, FLAT_TARGET, at_most=False)
    lines.append(f"{'hh':<14} {estimate_text(hh.mean('wide_mse'), hh.se('wide_mse')):>19}")
    lines.append(
        f"{part.flat_name:<14} {estimate_text(flat.mean('wide_mse'), flat.se('wide_mse')):>19} "
        f"{value:>7.2f}+-{se:<5.2f} {target.wanted:>7} {target.verdict:>7}"
    )
    lines.append(
        f"  all random ranges: hh {estimate_text(hh.mean('range_mse'), hh.se('range_mse'))}, "
        f"flat {estimate_text(flat.mean('range_mse'), flat.se('range_mse'))}"
    )
    return lines, [target]


def check_lines(part: RunsPart) -> list[str]:
    """The fast path's MSEs against every user encoded: ratios encode / fast."""
    header = f"{'method':<6} {'encoded/fast: range MSE':>24} {'wide-range MSE':>15} {'runs':>10}"
    lines = [header, "-" * len(header)]
    for name, (encoded, fast) in part.checks.items():
        cells = []
        for key in ("range_mse", "wide_mse"):
            value, se = ratio(encoded.mean(key), encoded.se(key), fast.mean(key), fast.se(key))
            cells.append(f"{value:.3f}+-{se:.3f}")
        runs = f"{encoded.runs('range_mse')}/{fast.runs('range_mse')}"
        lines.append(f"{name:<6} {cells[0]:>24} {cells[1]:>15} {runs:>10}")
    return lines


def quantile_lines(part: RunsPart) -> tuple[list[str], list[Target]]:
    header = (
        f"{'method':<6} {'q':>5} {'within ' + format(RANK_TOLERANCE, 'g'):>14} "
        f"{'mean |F(Q^)-q|':>15} {'95th pct':>9} {'target':>7} {'verdict':>7}"
    )
    lines = [header, "-" * len(header)]
    targets = []
    for name in OURS:
        tally = part.tallies.get(name)
        if tally is None:
            lines.append(f"{name:<6} ERROR {part.errors.get(name, 'did not run')}")
            continue
        for q in LEVELS:
            key = f"rank_{q:g}"
            share, se = tally.share(key, RANK_TOLERANCE)
            verdict, wanted = "-", "-"
            if name == "hh" and q in RANK_LEVELS:
                target = Target("3", f"hh p{100 * q:g} within {RANK_TOLERANCE:g}", share, se,
                                RANK_SHARE, at_most=False)  # fmt: skip
                targets.append(target)
                verdict, wanted = target.verdict, target.wanted
            high = float(np.quantile(tally.values[key], 0.95))
            lines.append(
                f"{name:<6} {q:>5g} {share:>7.3f}+-{se:<5.3f} {tally.mean(key):>15.4f} "
                f"{high:>9.4f} {wanted:>7} {verdict:>7}"
            )
    return lines, targets


def sw_lines(part: RunsPart) -> list[str]:
    header = (
        f"{'method':<6} {'range MSE':>9} {'post MSE':>9} {'rank p50':>8} {'rank p95':>8} "
        f"{'W1':>8} {'range CI':>8} {'cover':>5} {'p50 CI':>6} {'p95 CI':>6} {'q cover':>7} "
        f"{'enc/s':>6} {'agg/s':>6}"
    )
    lines = [header, "-" * len(header)]
    for name in OURS:
        tally = part.tallies.get(name)
        if tally is None:
            lines.append(f"{name:<6} ERROR {part.errors.get(name, 'did not run')}")
            continue
        cover = np.mean([tally.mean(f"q_cover_{q:g}") for q in LEVELS])
        encode, aggregate = part.rates.get(name, (math.nan, math.nan))
        lines.append(
            f"{name:<6} {tally.mean('range_mse'):>9.2e} {tally.mean('range_post_mse'):>9.2e} "
            f"{tally.mean('rank_0.5'):>8.4f} {tally.mean('rank_0.95'):>8.4f} "
            f"{tally.mean('w1'):>8.2e} {tally.mean('range_width'):>8.4f} "
            f"{tally.mean('range_cover'):>5.2f} {tally.mean('q_width_0.5'):>6.1f} "
            f"{tally.mean('q_width_0.95'):>6.1f} {cover:>7.2f} {si(encode):>6} {si(aggregate):>6}"
        )
    return lines


@dataclass
class ScaleRow:
    mechanism: str
    n: int
    simulate_seconds: float = math.nan
    estimate_seconds: float = math.nan
    rank_p50: float = math.nan  # at bucket resolution, a sanity check
    error: str = ""

    @property
    def seconds(self) -> float:
        return self.simulate_seconds + self.estimate_seconds


def scale_part(args: argparse.Namespace) -> list[ScaleRow]:
    rows = []
    for name in OURS:
        row = ScaleRow(name, args.big_users)
        try:
            spec = distribution_spec(name, args.epsilon, args.buckets, args.branching)
            population = law_population(spec, args.big_users, args.seed)
            _, values = distribution_of(spec)
            rng = np.random.default_rng([args.seed, 6])
            t0 = time.perf_counter()
            stats = values.simulate_statistics(population.counts, rng)
            t1 = time.perf_counter()
            estimate = values.estimate(stats)
            t2 = time.perf_counter()
            row.simulate_seconds, row.estimate_seconds = t1 - t0, t2 - t1
            row.rank_p50 = bucket_rank_error(population.cdf, point_bucket(estimate, 0.5), 0.5)
        except Exception as error:  # noqa: BLE001 - report the mechanism and carry on
            row.error = error_text(error)
        rows.append(row)
    return rows


def scale_lines(rows: list[ScaleRow]) -> tuple[list[str], list[Target]]:
    header = (
        f"{'method':<6} {'n':>6} {'simulate s':>10} {'estimate s':>10} {'total s':>8} "
        f"{'p50 rank err':>12} {'target':>7} {'verdict':>7}"
    )
    lines = [header, "-" * len(header)]
    targets = []
    for row in rows:
        if row.error:
            lines.append(f"{row.mechanism:<6} ERROR {row.error}")
            continue
        target = Target("4", f"{row.mechanism} seconds at n={row.n:.0e}", row.seconds, math.nan,
                        SCALE_TARGET_SECONDS, at_most=True)  # fmt: skip
        targets.append(target)
        lines.append(
            f"{row.mechanism:<6} {si(row.n):>6} {row.simulate_seconds:>10.3f} "
            f"{row.estimate_seconds:>10.3f} {row.seconds:>8.3f} {row.rank_p50:>12.5f} "
            f"{target.wanted:>7} {target.verdict:>7}"
        )
    return lines, targets


# ---------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m simulations.benchmarks.distribution_bench",
        description="Distribution mechanisms hh and sw: against ldp-hierarchical-mechanism, "
        "against the flat histogram, quantiles, scale.",
    )
    parser.add_argument(
        "--users", type=checked(user_count), help="users of parts 2, 3 and 5 and speed (1e6)"
    )
    parser.add_argument(
        "--peer-users", type=checked(user_count), help="users of the peer comparison (1e5)"
    )
    parser.add_argument(
        "--runs", type=checked(user_count), help="fast-path runs per mechanism (200)"
    )
    parser.add_argument("--peer-runs", type=checked(user_count), help="runs of the peer (30)")
    parser.add_argument(
        "--encode-runs", type=checked(user_count), help="runs of ours with every user encoded (100)"
    )
    parser.add_argument("--ranges", type=checked(user_count), help="random ranges per run (200)")
    parser.add_argument("--buckets", type=checked(user_count), help="buckets D (1024)")
    parser.add_argument(
        "--branching", type=checked(user_count), default=4, help="hh's branching B (4)"
    )
    parser.add_argument("--epsilon", type=float, default=1.0, help="privacy budget per report")
    parser.add_argument(
        "--big-users", type=checked(user_count), help="users of the scale part (1e8)"
    )
    parser.add_argument("--peer-time", type=float, help="seconds per peer speed measurement (5)")
    parser.add_argument(
        "--path",
        choices=("encode", "fast"),
        default="encode",
        help="parts 2, 3, 5: every user encoded, or the statistics drawn from their law",
    )
    parser.add_argument("--no-peers", action="store_true", help="skip the peer library")
    parser.add_argument("--seed", type=int, default=20240601, help="seed of data and noise")
    parser.add_argument("--output", type=Path, help="write every part's results to this JSON")
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    parser.add_argument(
        "--parts", type=list_of(one_of(PARTS, "part"), "parts"), default=list(PARTS),
        help=f"parts to run, comma-separated from {','.join(PARTS)} (all)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def error_text(error: Exception) -> str:
    """An exception as one line of at most ``ERROR_CHARS`` characters."""
    text = f"{type(error).__name__}: {' '.join(str(error).split())}"
    return text if len(text) <= ERROR_CHARS else text[: ERROR_CHARS - 3] + "..."


def _section(title: str, lines: list[str]) -> None:
    print(f"\n{title}")
    print("\n".join(lines))
    sys.stdout.flush()


def _guarded(work: Callable[[], Any], failures: list[str], what: str) -> Any:
    """``work()``, or None with a FAIL line when it raises."""
    try:
        return work()
    except Exception as error:  # noqa: BLE001 - report the part and carry on
        failures.append(f"{what}: {error_text(error)}")
        return None


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    tree_class, status = (None, "skipped (--no-peers)") if args.no_peers else load_peer()
    print(
        f"distribution benchmark: epsilon {args.epsilon:g}, D = {args.buckets} log-scale "
        f"buckets on [{LOWER:g}, {UPPER:g}] ms, hh branching {args.branching}, lognormal "
        f"latencies (median {MEDIAN_MS:g} ms, sigma {SIGMA:g}), seed {args.seed}, numpy "
        f"{np.__version__}"
    )
    print(f"peer {PEER_DISTRIBUTION}: {status}")
    if tree_class is None and not args.no_peers:
        print(
            "  part 1 skipped: install the peer in an environment of its own, "
            "pip install -e '.[bench-distribution]'"
        )
    failures: list[str] = []
    targets: list[Target] = []
    document: dict[str, Any] = {}

    hh_spec = distribution_spec("hh", args.epsilon, args.buckets, args.branching)
    population = drawn_population(hh_spec, args.users, args.seed)
    small = drawn_population(hh_spec, args.peer_users, args.seed + 1)
    values, buckets = population.values, population.buckets
    assert values is not None and buckets is not None
    rates: dict[str, tuple[float, float]] = {}
    for name in OURS:
        found = _guarded(partial(our_rates, name, args, values), failures, f"{name} speed")
        if found is not None:
            rates[name] = found
    encoded: dict[str, Tally] = {}
    if {"peer", "runs"} & set(args.parts):
        hh_encoded = _guarded(
            lambda: measure_runs(
                hh_spec, small, args.encode_runs, args.ranges, args.seed, "encode"
            ),
            failures,
            "hh over every user encoded",
        )
        if hh_encoded is not None:
            encoded["hh"] = hh_encoded

    if "peer" in args.parts and tree_class is not None and "hh" in encoded and "hh" in rates:
        part = _guarded(
            lambda: peer_part(args, tree_class, small, encoded["hh"], rates["hh"], buckets),
            failures, "part 1 (peer)",
        )  # fmt: skip
        if part is not None:
            lines, found_targets = peer_lines(part)
            targets += found_targets
            _section(
                f"1. against {PEER_DISTRIBUTION}: epsilon {args.epsilon:g}, D {args.buckets}, "
                f"B {args.branching}, {counted(args.peer_users, 'user')}, the same users on "
                f"both sides; {counted(args.ranges, 'random range')} per run; quantile rank "
                f"error at bucket resolution; speed over {counted(args.users, 'user')} (ours, "
                f"best of {SPEED_REPEATS}) and by rate within {args.peer_time:g} s (peer)",
                lines + peer_notes(part),
            )
            document["peer"] = {
                "ours": part.ours.values, "peer": part.peer.values, "rates": part.rates,
                "peer_timing": asdict(part.peer_timing),
            }  # fmt: skip

    if "runs" in args.parts:
        runs = _guarded(
            lambda: runs_part(args, population, small, encoded, rates), failures, "parts 2, 3, 5"
        )
        if runs is not None:
            failures += [f"{name}: {error}" for name, error in runs.errors.items()]
            lines, found_targets = flat_lines(runs)
            targets += found_targets
            _section(
                f"2. hh against the flat histogram ({runs.flat_name} over the {args.buckets} "
                f"buckets): {counted(args.users, 'user')}, {counted(args.runs, 'run')} "
                f"({PATHS[args.path]}), {counted(args.ranges, 'range')} per run covering more than "
                f"{WIDE_SHARE:.0%} of the domain",
                lines,
            )
            _section(
                f"2b. the fast path against every user encoded, "
                f"{counted(args.peer_users, 'user')}: MSE ratios encoded / fast (1 if the fast "
                "path has the mechanism's law for these measures)",
                check_lines(runs),
            )
            lines, found_targets = quantile_lines(runs)
            targets += found_targets
            _section(
                f"3. quantiles: share of {counted(args.runs, 'run')} ({PATHS[args.path]}) with "
                f"|F(Q^) - q| <= {RANK_TOLERANCE:g} (F the users' own CDF, +- binomial se), target "
                f"{RANK_SHARE:g} for hh at q = {', '.join(format(q, 'g') for q in RANK_LEVELS)}",
                lines,
            )
            _section(
                f"5. sw and hh side by side ({counted(args.users, 'user')}, "
                f"{counted(args.runs, 'run')}, {PATHS[args.path]}): range MSE from the unbiased "
                "CDF and from the post-processed one, mean rank error, W1 = (1/D) sum "
                "|P_k - F_k|, mean 95% range interval width (share) and coverage, quantile "
                "interval widths (buckets) and coverage (mean over q), encode and aggregate rates",
                sw_lines(runs),
            )
            document["runs"] = {name: tally.values for name, tally in runs.tallies.items()}
            document["checks"] = {
                name: {"encoded": pair[0].values, "fast": pair[1].values}
                for name, pair in runs.checks.items()
            }  # fmt: skip

    if "scale" in args.parts:
        rows = scale_part(args)
        failures += [f"{row.mechanism} at scale: {row.error}" for row in rows if row.error]
        lines, found_targets = scale_lines(rows)
        targets += found_targets
        _section(
            f"4. scale: simulate_statistics + estimate at n = {args.big_users:.0e} (counts "
            f"drawn from the law, untimed), target < {SCALE_TARGET_SECONDS:g} s",
            lines,
        )
        document["scale"] = [asdict(row) for row in rows]

    print(f"\nfinished in {time.perf_counter() - started:.0f} s")
    for line in failures:
        print(f"  FAIL {line}")
    misses = [t for t in targets if math.isfinite(t.value) and not t.met]
    for t in misses:
        print(f"  MISS part {t.part}: {t.label} {t.value:.3g} (target {t.wanted})")
    if args.quick:
        print("  NOTE --quick: sizes far below the targets' (a smoke run)")
    if tree_class is None:
        print("  NOTE the peer was not run: part 1's targets were not checked")
    if not failures:
        print(
            "  All checks passed" + ("." if misses or tree_class is None else "; all targets met.")
        )
    if args.output is not None:
        document["targets"] = [{**asdict(t), "met": t.met, "verdict": t.verdict} for t in targets]
        document["failures"] = failures
        report.write_json(args.output, document)
        print(f"results written to {args.output}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
