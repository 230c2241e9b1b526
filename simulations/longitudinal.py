"""``ldp-sim longitudinal``: repeated collection, memoized mechanisms against one-shot ones.

Population. ``n`` devices (ids 0..n-1) hold one value per period t = 0..T-1: a category
in 0..d-1 drawn from a shape (``zipf:S``, ``uniform``, ``counts:FILE``) and a number in
[lower, upper] drawn from a numeric shape (the midpoints of its 1024-bin histogram, as
in ``ldp-sim numeric``). At t = 0 every device draws both; at every later period each
device, with probability c (``--change``), draws a new category from the same law, and
independently, with probability c, a new number (a new draw may equal the old value).
The population depends on the seed alone (devices in blocks of ``DEVICE_BLOCK``, each
block from its own generator): every mechanism and every repetition sees the same data.

Mechanisms. The memoized ones (``lgrr``, ``lsue``, ``loue``, ``losue``, ``dbitflip``,
``onebitmean``; ``shared.mechanisms.memoized``) at ``epsilon`` per distinct value and
``epsilon_report`` per report, each device's permanent randomness from
``SimulatedMemo(device ids, seed)``: the same ids every period, so a device that keeps
its value keeps its permanent response. The one-shot references (``grr``, ``sue``,
``oue``, numeric ``duchi``) spend ``epsilon_report`` on every report.

Accuracy per period. Each period's reports give that period's estimate, whose error
against the period's truth is set beside the analytical variance:

* categorical: Var[f_v] = q (1 - q) / (n (p - q)^2) + f_v (1 - p - q) / (n (p - q))
  (Wang, Blocki, Li and Jha, USENIX Security 2017), with p and q the probabilities that
  one report supports v given the value v or another one; for a chained mechanism those
  of the whole chain, p = p1 p2 + (1 - p1) q2 and q = q1 p2 + (1 - q1) q2 (Arcolezi,
  Couchot, Al Bouna and Xiao, "Improving the utility of locally differentially private
  protocols for longitudinal and multidimensional frequency estimates", 2022); where a
  mechanism's estimator is not this one (``dbitflip`` divides by the devices that sampled
  each bucket, Ding, Kulkarni and Yekhanin, NeurIPS 2017), its own ``frequency_variance``;
* numeric: Var[mean] = (1 / n^2) sum_i Var[y | x_i] (``report_variance``).

Over the devices' independent memos, one period's reports are independent and follow
the one-report law, so each period's estimate is unbiased with that variance: ``ratio``
= sum over periods and outputs of the squared errors / the same sum of variances, 1 in
expectation. The errors of different periods share the permanent responses and are
correlated, so the ratio's standard error comes from independent repetitions
(``--reps``: fresh memos and noise over the same population), for the whole run
(``ratio_se``) and per period (``periods.csv``). One repetition's ratio of one period
is a single draw: for a numeric mechanism one squared error over its variance, about
chi-square with 1 degree of freedom (mean 1, standard deviation 1.4, above 5 one time
in 40); and since a device that keeps its value keeps its memoized response, the
errors of neighbouring periods move together (``onebitmean`` without output
perturbation, change c: correlation about 1 - c period to period), so one run's ratios
wander over periods like a random walk without any drift in the mean.

Lifetime epsilon per device. Memoized: ``epsilon`` times the number of distinct memo
keys (``memo_keys``) the device used in the T periods, what the device ledger charges
(any number of reports of one key are post-processing of one epsilon-LDP permanent
response; k keys compose to k epsilon). One-shot: T ``epsilon_report`` (sequential
composition). Over the devices: mean, median, 99th percentile and maximum.

Adversary. ``--adversary-devices`` further devices hold one value for all T periods,
uniform over the d categories (numeric: over {lower, upper}, k = 2 values; otherwise
k = d), and an adversary who sees one device's T reports guesses its value: the argmax
of the frequencies estimated from those reports alone (numeric: the end of the range
nearer their mean). When the reports are post-processing of one epsilon-LDP response
(memoized, unchanged value), no guess succeeds with probability above

    e^eps / (e^eps + k - 1):

for every output y, max_v P(y | v) <= e^eps min_v P(y | v), so sum_v P(y | v) >=
max_v P(y | v) (1 + (k - 1) e^-eps), and P(success) <= (1 / k) sum_y max_v P(y | v)
<= e^eps / (e^eps + k - 1). A stateless implementation (``memo=None``: a permanent
response drawn anew every period, as without device state) composes T reports, and its
success tends to 1 as T grows: the leak memoization closes. ``adversary_memoized`` and
``adversary_stateless`` are the two success rates, ``adversary_bound`` the bound at what
one unchanging value may reveal (memoized: ``epsilon``; one-shot: T ``epsilon_report``).

The bound can be met exactly: ``onebitmean`` without output perturbation sends the
memoized bit of grid point 0 or s, 1 with probability 1 / (e^eps + 1) or e^eps /
(e^eps + 1), and the adversary's guess by the sign is right with probability
e^eps / (e^eps + 1), the bound itself; a run then lands above the bound about half the
time. So a rate is a leak (``leak_memoized``, ``leak_stateless``) only by a one-sided
exact binomial test: with N = ``--adversary-devices`` guesses, each right with
probability at most the bound b, the number right is at most Binomial(N, b), and a leak
is more than c right, c the least count with P(Binomial(N, b) > c) <= ``LEAK_ALPHA``
= 10^-6 (``leak_threshold``; ``adversary_threshold`` = c / N). A mechanism that keeps
the bound is called a leak at most once in 10^6 runs, whatever N and b (the normal
approximation b + z sqrt(b (1 - b) / N) is not, for small b and N, where the binomial's
upper tail is heavier than the normal's: 1.6 10^-4 at N = 50, b = 0.05).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats

from shared.estimates import z_value
from shared.mechanisms import (
    CategoricalValues,
    DeviceContext,
    Mechanism,
    as_categorical,
    as_memoized,
    as_numeric,
    make_mechanism,
)
from shared.memo import Memo, SimulatedMemo
from shared.randomness import Rng
from shared.schemas import MechanismSpec
from simulations import report
from simulations.execution import run_units
from simulations.populations import CategoricalShape, NumericShape
from simulations.text import counted

__all__ = [
    "LEAK_ALPHA",
    "LEAK_Z",
    "MEMOIZED",
    "NUMERIC",
    "ONE_SHOT",
    "RESULT_COLUMNS",
    "LongitudinalRun",
    "Population",
    "distinct_per_device",
    "encode",
    "frequency_variances",
    "guess_bound",
    "leak_threshold",
    "make_specs",
    "plot_longitudinal",
    "reidentified",
    "simulate",
]

MEMOIZED = ("lgrr", "lsue", "loue", "losue", "dbitflip", "onebitmean")
ONE_SHOT = ("grr", "sue", "oue", "duchi")
NUMERIC = frozenset({"onebitmean", "duchi"})
#: Devices per work unit; also the population's blocks (each from its own generator).
DEVICE_BLOCK = 1 << 16
#: The numeric law's bin shares, apportioned exactly to this many (2^-40 resolution).
LAW_RESOLUTION = 1 << 40
#: The adversary's check calls a mechanism that keeps the bound a leak at most this often.
LEAK_ALPHA = 1e-6
#: The normal quantile of the same one-sided level (``leak_threshold`` is the exact test).
LEAK_Z = z_value(1 - 2 * LEAK_ALPHA)
#: Generator streams of the run's seed: the population's values and the memos' seeds.
POPULATION_STREAM, MEMO_STREAM = 1, 2

RESULT_COLUMNS = (
    "mechanism memoized epsilon epsilon_report devices periods change reps mse variance "
    "ratio ratio_se lifetime_mean lifetime_median lifetime_p99 lifetime_max "
    "one_shot_lifetime adversary_memoized adversary_stateless adversary_bound "
    "adversary_threshold leak_memoized leak_stateless seconds"
).split()
TABLE_COLUMNS = (
    "mechanism epsilon epsilon_report ratio ratio_se lifetime_mean lifetime_median "
    "lifetime_p99 lifetime_max one_shot_lifetime adversary_memoized adversary_stateless "
    "adversary_bound adversary_threshold"
).split()


@dataclass(frozen=True)
class Population:
    """The drifting values of ``devices`` devices over ``periods`` periods (module docstring)."""

    devices: int
    periods: int
    change: float
    domain_size: int
    shape: CategoricalShape
    numeric_shape: NumericShape
    lower: float
    upper: float
    seed: int

    def __post_init__(self) -> None:
        if self.devices < 1 or self.periods < 1:
            raise ValueError(
                f"a population needs devices >= 1 and periods >= 1, got {self.devices} and "
                f"{self.periods}"
            )
        if not 0.0 <= self.change <= 1.0:
            raise ValueError(f"change must be a probability in [0, 1], got {self.change}")
        if self.domain_size < 2:
            raise ValueError(f"domain_size must be >= 2, got {self.domain_size}")
        if not self.lower < self.upper:
            raise ValueError(f"lower ({self.lower}) must be below upper ({self.upper})")

    def blocks(self) -> list[tuple[int, int]]:
        """The device blocks ``[start, stop)``."""
        return [
            (start, min(self.devices, start + DEVICE_BLOCK))
            for start in range(0, self.devices, DEVICE_BLOCK)
        ]

    def law(self, numeric: bool) -> tuple[np.ndarray, np.ndarray]:
        """(values, probabilities) of a fresh draw: categories and their shares, or the
        numeric histogram's midpoints and their shares."""
        return _law(
            self.shape, self.numeric_shape, self.domain_size, self.lower, self.upper, numeric
        )

    def values(self, start: int, numeric: bool) -> Iterator[np.ndarray]:
        """The values of the block of devices from ``start``, one array per period."""
        if start % DEVICE_BLOCK or not 0 <= start < self.devices:
            raise ValueError(f"start {start} is not the first device of a block")
        size = min(self.devices, start + DEVICE_BLOCK) - start
        rng = np.random.default_rng(
            [self.seed, POPULATION_STREAM, int(numeric), start // DEVICE_BLOCK]
        )
        support, probabilities = self.law(numeric)
        current = support[rng.choice(support.size, size=size, p=probabilities)]
        for period in range(self.periods):
            if period:
                current = current.copy()
                changed = np.flatnonzero(rng.random(size) < self.change)
                current[changed] = support[
                    rng.choice(support.size, size=changed.size, p=probabilities)
                ]
            yield current


@functools.lru_cache(maxsize=16)
def _law(
    shape: CategoricalShape,
    numeric_shape: NumericShape,
    domain_size: int,
    lower: float,
    upper: float,
    numeric: bool,
) -> tuple[np.ndarray, np.ndarray]:
    """``Population.law``, computed once per process and population."""
    if numeric:
        histogram = numeric_shape.population(lower, upper, LAW_RESOLUTION)
        return histogram.levels, histogram.counts / LAW_RESOLUTION
    shares = shape.shares(domain_size)
    return np.arange(domain_size), shares / shares.sum()


@functools.lru_cache(maxsize=64)
def _mechanism(spec: MechanismSpec) -> Mechanism[Any]:
    """``make_mechanism(spec)``, built once per process: a worker runs many units of one
    spec, and a mechanism keeps nothing between calls but its derived parameters."""
    return make_mechanism(spec)


def make_specs(
    names: Sequence[str],
    epsilon: float,
    epsilon_report: float,
    population: Population,
    bits_per_device: int = 1,
    flip_probability: float = 0.0,
) -> list[MechanismSpec]:
    """The specs of ``names``: memoized ones at (``epsilon``, ``epsilon_report``; dbitflip and
    onebitmean derive theirs), one-shot ones at ``epsilon_report`` per report.

    Raises ``pydantic.ValidationError`` naming the field a spec refuses.
    """
    specs = []
    for name in names:
        fields: dict[str, Any] = {"mechanism": name}
        if name in NUMERIC:
            fields.update(lower=population.lower, upper=population.upper)
        else:
            fields["domain_size"] = population.domain_size
        if name not in MEMOIZED:
            fields["epsilon"] = epsilon_report
        elif name == "dbitflip":
            fields.update(epsilon=epsilon, bits_per_device=bits_per_device)
        elif name == "onebitmean":
            fields.update(epsilon=epsilon, flip_probability=flip_probability)
        else:
            fields.update(epsilon=epsilon, epsilon_report=epsilon_report)
        specs.append(MechanismSpec.model_validate(fields))
    return specs


def encode(mech: Mechanism[Any], values: np.ndarray, rng: Rng, memo: Memo | None) -> Any:
    """``mech``'s reports of ``values``: memoized mechanisms draw their permanent responses
    from ``memo`` (``None``: anew), the others take no memo."""
    if memo is not None and as_memoized(mech) is None:
        raise ValueError(f"{mech.name!r} is not memoized: it takes no memo")
    return mech.encode(values, rng, DeviceContext(memo=memo))


def guess_bound(epsilon: float, values: int) -> float:
    """e^eps / (e^eps + k - 1): the most often any guess of a value uniform over ``values``
    = k values can be right from one eps-LDP output (module docstring)."""
    return 1.0 / (1.0 + (values - 1) * math.exp(-epsilon))


def leak_threshold(bound: float, trials: int, alpha: float = LEAK_ALPHA) -> float:
    """c / N for the least c with P(Binomial(N, b) > c) <= ``alpha``, N = ``trials``, b =
    ``bound``: a success rate above it is a leak at false-alarm rate ``alpha`` (module
    docstring). Exact: scipy's quantile, then moved by whole counts until it is the least."""
    if trials < 1:
        raise ValueError(f"the adversary's check needs trials >= 1, got {trials}")
    if not 0.0 <= bound <= 1.0 or not 0.0 < alpha < 1.0:
        raise ValueError(f"need a bound in [0, 1] and alpha in (0, 1), got {bound}, {alpha}")
    cut = int(stats.binom.isf(alpha, trials, bound))
    while cut < trials and stats.binom.sf(cut, trials, bound) > alpha:
        cut += 1
    while cut > 0 and stats.binom.sf(cut - 1, trials, bound) <= alpha:
        cut -= 1
    return cut / trials


def reidentified(
    mech: Mechanism[Any],
    values: np.ndarray,
    periods: Sequence[int],
    rng: np.random.Generator,
    memo: Memo | None,
) -> list[float]:
    """The adversary's success rate after each number of reports in ``periods``.

    Every device reports its unchanging value ``max(periods)`` times (with ``memo``, or
    stateless for ``None``); after t reports the adversary guesses each device's value from
    its first t reports alone: the argmax of the frequencies they estimate (numeric: the end
    of the range nearer their debiased mean). Categorical guesses aggregate each device's
    reports on their own, one ``aggregate`` per device: a sample of devices, not a fleet.
    """
    horizon = max(periods)
    reports = np.stack([encode(mech, values, rng, memo) for _ in range(horizon)])
    rates = []
    for t in periods:
        if (numbers := as_numeric(mech)) is not None:
            flat = reports[:t].reshape(t * values.size, *reports.shape[2:])
            means = numbers.debias(mech.check_reports(flat)).reshape(t, values.size).mean(axis=0)
            centre = (numbers.lower + numbers.upper) / 2
            guesses = np.where(means > centre, numbers.upper, numbers.lower)
        else:
            categories = as_categorical(mech)
            assert categories is not None  # the longitudinal mechanisms: categories or numbers
            guesses = np.array(
                [
                    int(np.argmax(categories.estimate(mech.aggregate(reports[:t, i])).frequencies))
                    for i in range(values.size)
                ]
            )
        rates.append(float(np.mean(guesses == values)))
    return rates


# --- work units ----------------------------------------------------------------------------


@dataclass(frozen=True)
class BlockUnit:
    """One mechanism over one block of devices for all T periods, in one repetition."""

    population: Population
    spec: MechanismSpec
    start: int
    memo_seed: int
    seed: np.random.SeedSequence


@dataclass
class BlockResult:
    """A block's statistics and truth per period, and its devices' distinct memo keys.

    ``truth`` (T, k) sums the block's values per output (category counts, or the sum of the
    numbers: k = 1) and ``noise`` (T, k) the block's part of n^2 Var of each estimate
    (categorical: m^2 Var[f_v] at the block's m devices and frequencies; numeric:
    sum_i Var[y | x_i]); both add over blocks. ``distinct[j]``
    counts the devices that used j distinct memo keys (None: not memoized).
    """

    statistics: list[Any]
    truth: np.ndarray
    noise: np.ndarray
    distinct: np.ndarray | None
    seconds: float


@dataclass(frozen=True)
class AdversaryUnit:
    """The adversary's experiment on one mechanism (module docstring)."""

    population: Population
    spec: MechanismSpec
    devices: int
    memo_seed: int
    seed: np.random.SeedSequence


def frequency_variances(mech: CategoricalValues, frequencies: np.ndarray, n: int) -> np.ndarray:
    """Var[f_v] of each frequency estimate from n reports at the true ``frequencies``: the
    mechanism's own ``frequency_variance`` where its estimator has one (``dbitflip``'s
    counts the devices that sampled each bucket), else the frequency oracles'
    q (1 - q) / (n (p - q)^2) + f_v (1 - p - q) / (n (p - q))."""
    own = getattr(mech, "frequency_variance", None)
    if own is not None:
        return np.asarray(own(frequencies, n), dtype=np.float64)
    p, q = mech.p, mech.q
    return (q * (1 - q) / (p - q) ** 2 + frequencies * (1 - p - q) / (p - q)) / n


def _truth_and_noise(mech: Mechanism[Any], values: np.ndarray) -> tuple[Any, Any]:
    """A block's sums of values per output and its part of n^2 Var (``BlockResult``): both
    variances are (a + b f) / n, so m^2 Var at the block's own m and f adds over blocks."""
    m = values.size
    if (categories := as_categorical(mech)) is not None:
        counts = np.bincount(values, minlength=categories.domain_size).astype(np.float64)
        return counts, m * m * frequency_variances(categories, counts / m, m)
    numbers = as_numeric(mech)
    assert numbers is not None  # the longitudinal mechanisms: categories or numbers
    return [float(values.sum())], [float(numbers.report_variance(values).sum())]


def distinct_per_device(keys: np.ndarray) -> np.ndarray:
    """The number of distinct entries in each column of a (periods, devices) key matrix."""
    ordered = np.sort(keys, axis=0)
    return 1 + np.count_nonzero(np.diff(ordered, axis=0), axis=0)


def run_block(unit: BlockUnit) -> BlockResult:
    """Encode, aggregate and record one block over all periods (the function workers run)."""
    started = time.perf_counter()
    mech = _mechanism(unit.spec)
    rng = np.random.default_rng(unit.seed)
    population = unit.population
    stop = min(population.devices, unit.start + DEVICE_BLOCK)
    lifelong = as_memoized(mech)
    memo = SimulatedMemo(np.arange(unit.start, stop), unit.memo_seed) if lifelong else None
    keys = []
    statistics, truth, noise = [], [], []
    numeric = unit.spec.mechanism in NUMERIC
    for values in population.values(unit.start, numeric):
        statistics.append(mech.aggregate(encode(mech, values, rng, memo)))
        if lifelong is not None:
            keys.append(lifelong.memo_keys(values, memo))
        sums, variances = _truth_and_noise(mech, values)
        truth.append(sums)
        noise.append(variances)
    distinct = (
        np.bincount(distinct_per_device(np.stack(keys)), minlength=population.periods + 1)
        if lifelong is not None
        else None
    )
    return BlockResult(
        statistics,
        np.array(truth, dtype=np.float64),
        np.array(noise, dtype=np.float64),
        distinct,
        time.perf_counter() - started,
    )


def run_adversary(unit: AdversaryUnit) -> tuple[float, float]:
    """(memoized, stateless) success rates after T reports (memoized: NaN for one-shot)."""
    mech = _mechanism(unit.spec)
    rng = np.random.default_rng(unit.seed)
    population = unit.population
    if unit.spec.mechanism in NUMERIC:
        values = rng.choice(np.array([population.lower, population.upper]), size=unit.devices)
    else:
        values = rng.integers(population.domain_size, size=unit.devices)
    periods = [population.periods]
    stateless = reidentified(mech, values, periods, rng, None)[0]
    if as_memoized(mech) is None:
        return math.nan, stateless
    memo = SimulatedMemo(np.arange(unit.devices), unit.memo_seed)
    return reidentified(mech, values, periods, rng, memo)[0], stateless


def _run_unit(unit: BlockUnit | AdversaryUnit) -> BlockResult | tuple[float, float]:
    return run_block(unit) if isinstance(unit, BlockUnit) else run_adversary(unit)


# --- the run -------------------------------------------------------------------------------


@dataclass
class LongitudinalRun:
    """What ``simulate`` measured: one row per mechanism, one per (mechanism, period), and
    the distribution of lifetime epsilon over devices (pooled over repetitions)."""

    rows: list[dict[str, Any]]
    periods: list[dict[str, Any]]
    lifetime: list[dict[str, Any]]


def memo_seed(seed: int, index: int, rep: int) -> int:
    """The memo seed of mechanism ``index`` in repetition ``rep`` (rep -1: the adversary's)."""
    state = np.random.SeedSequence([seed, MEMO_STREAM, index, rep + 1]).generate_state(2)
    return int(state[0]) << 32 | int(state[1])


def simulate(
    population: Population,
    specs: Sequence[MechanismSpec],
    *,
    reps: int = 1,
    adversary_devices: int = 1000,
    workers: int = 1,
    scheduler: str | None = None,
    progress: bool = True,
) -> LongitudinalRun:
    """Run every spec over ``population`` ``reps`` times, and the adversary's experiment on
    ``adversary_devices`` devices (0: skipped), where the options say (``run_units``)."""
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    if adversary_devices < 0:
        raise ValueError(f"adversary_devices must be >= 0, got {adversary_devices}")
    plan: list[tuple[str, int, int, int]] = [
        ("block", index, rep, start)
        for index in range(len(specs))
        for rep in range(reps)
        for start, _ in population.blocks()
    ]
    if adversary_devices:
        plan += [("adversary", index, -1, 0) for index in range(len(specs))]
    seeds = np.random.SeedSequence(population.seed).spawn(len(plan))
    units: list[BlockUnit | AdversaryUnit] = [
        BlockUnit(population, specs[index], start, memo_seed(population.seed, index, rep), s)
        if kind == "block"
        else AdversaryUnit(
            population, specs[index], adversary_devices, memo_seed(population.seed, index, -1), s
        )
        for (kind, index, rep, start), s in zip(plan, seeds, strict=True)
    ]
    results = run_units(
        _run_unit,
        units,
        workers=workers,
        scheduler=scheduler,
        progress=progress,
        description="longitudinal units",
    )
    blocks: dict[tuple[int, int], list[BlockResult]] = {}
    adversary: dict[int, tuple[float, float]] = {}
    for (kind, index, rep, _), result in zip(plan, results, strict=True):
        if kind == "block":
            assert isinstance(result, BlockResult)
            blocks.setdefault((index, rep), []).append(result)
        else:
            assert isinstance(result, tuple)
            adversary[index] = result
    run = LongitudinalRun([], [], [])
    for index, spec in enumerate(specs):
        per_rep = [blocks[(index, rep)] for rep in range(reps)]
        _summarize(run, spec, population, per_rep, adversary.get(index), adversary_devices)
    return run


def _period_errors(
    mech: Mechanism[Any], parts: list[BlockResult], devices: int
) -> tuple[np.ndarray, np.ndarray]:
    """(squared errors, variances), each (T, k), of one repetition's per-period estimates."""
    truth = np.sum([part.truth for part in parts], axis=0) / devices
    variance = np.sum([part.noise for part in parts], axis=0) / devices**2
    errors = np.empty_like(truth)
    for period in range(truth.shape[0]):
        stats = (
            parts[0].statistics[period].merge_many(part.statistics[period] for part in parts[1:])
        )
        if (categories := as_categorical(mech)) is not None:
            vector = categories.estimate(stats).frequencies
        else:
            numbers = as_numeric(mech)
            assert numbers is not None  # the longitudinal mechanisms: categories or numbers
            vector = np.array([numbers.estimate(stats).mean])
        errors[period] = np.asarray(vector, dtype=np.float64) - truth[period]
    return errors**2, variance


def _quantile(counts: np.ndarray, level: float) -> int:
    """The least j with at least a ``level`` share of ``counts``' mass at or below j."""
    total = int(counts.sum())
    return int(np.searchsorted(np.cumsum(counts), max(1, math.ceil(level * total))))


def _lifetime(
    mech: Mechanism[Any], per_rep: list[list[BlockResult]], periods: int
) -> tuple[dict[str, float], list[tuple[float, float, float]]]:
    """The lifetime epsilon's summary over devices, and its distribution as (distinct keys,
    lifetime epsilon, share of devices) over every repetition's devices."""
    lifelong = as_memoized(mech)
    if lifelong is None:
        spent = periods * mech.epsilon
        names = ("lifetime_mean", "lifetime_median", "lifetime_p99", "lifetime_max")
        return dict.fromkeys(names, spent), [(math.nan, spent, 1.0)]
    histogram = np.zeros(periods + 1, dtype=np.int64)
    for parts in per_rep:
        for part in parts:
            assert part.distinct is not None
            histogram += part.distinct
    per_key = lifelong.epsilon_lifetime
    total = int(histogram.sum())
    summary = {
        "lifetime_mean": per_key * float(np.arange(periods + 1) @ histogram) / total,
        "lifetime_median": per_key * _quantile(histogram, 0.5),
        "lifetime_p99": per_key * _quantile(histogram, 0.99),
        "lifetime_max": per_key * int(np.flatnonzero(histogram)[-1]),
    }
    used = np.flatnonzero(histogram).tolist()
    return summary, [(keys, per_key * keys, int(histogram[keys]) / total) for keys in used]


def _summarize(
    run: LongitudinalRun,
    spec: MechanismSpec,
    population: Population,
    per_rep: list[list[BlockResult]],
    adversary: tuple[float, float] | None,
    adversary_devices: int,
) -> None:
    """Add ``spec``'s row, its rows per period and its lifetime distribution to ``run``."""
    mech = _mechanism(spec)
    name = spec.mechanism
    periods = population.periods
    errors = [_period_errors(mech, parts, population.devices) for parts in per_rep]
    rep_ratios = np.array([squares.sum() / variance.sum() for squares, variance in errors])
    # (reps, T): each repetition's ratio per period; the variance is the same in every one.
    period_ratios = np.array(
        [squares.sum(axis=1) / variance.sum(axis=1) for squares, variance in errors]
    )
    mse_by_period = np.mean([squares.mean(axis=1) for squares, _ in errors], axis=0)
    variance_by_period = errors[0][1].mean(axis=1)  # one population for every repetition
    lifelong = as_memoized(mech)
    memoized = lifelong is not None
    epsilon_report = lifelong.epsilon_report if lifelong is not None else spec.epsilon
    lifetime, distribution = _lifetime(mech, per_rep, periods)
    run.lifetime += [
        {"mechanism": name, "distinct_keys": keys, "lifetime_epsilon": spent, "share": share}
        for keys, spent, share in distribution
    ]
    # What one unchanging value may reveal: epsilon if memoized, T reports' worth if not.
    unchanged = lifelong.epsilon_lifetime if lifelong is not None else periods * spec.epsilon
    bound = guess_bound(unchanged, 2 if name in NUMERIC else population.domain_size)
    threshold = leak_threshold(bound, adversary_devices) if adversary_devices else math.nan
    memo_rate, stateless_rate = adversary if adversary is not None else (math.nan, math.nan)
    reps = len(per_rep)
    run.rows.append(
        {
            "mechanism": name,
            "memoized": memoized,
            "epsilon": spec.epsilon,
            "epsilon_report": epsilon_report,
            "devices": population.devices,
            "periods": periods,
            "change": population.change,
            "reps": reps,
            "mse": float(mse_by_period.mean()),
            "variance": float(variance_by_period.mean()),
            "ratio": float(np.mean(rep_ratios)),
            "ratio_se": float(_standard_error(rep_ratios[:, None])[0]),
            **lifetime,
            "one_shot_lifetime": periods * epsilon_report,
            "adversary_memoized": memo_rate,
            "adversary_stateless": stateless_rate,
            "adversary_bound": bound,
            "adversary_threshold": threshold,
            "leak_memoized": bool(memo_rate > threshold),
            "leak_stateless": bool(stateless_rate > threshold),
            "seconds": sum(part.seconds for parts in per_rep for part in parts),
        }
    )
    run.periods += [
        {
            "mechanism": name,
            "period": period,
            "mse": float(mse_by_period[period]),
            "variance": float(variance_by_period[period]),
            "ratio": float(ratio),
            "ratio_se": float(se),
        }
        for period, (ratio, se) in enumerate(
            zip(period_ratios.mean(axis=0), _standard_error(period_ratios), strict=True)
        )
    ]


def _standard_error(samples: np.ndarray) -> np.ndarray:
    """The standard error of the mean of each column of (reps, m) ``samples`` over the
    independent repetitions (NaN for one repetition)."""
    reps = samples.shape[0]
    if reps < 2:
        return np.full(samples.shape[1], math.nan)
    return np.std(samples, axis=0, ddof=1) / math.sqrt(reps)


# --- plot ----------------------------------------------------------------------------------


def plot_longitudinal(run: LongitudinalRun, path: Path) -> None:
    """Left: MSE / analytical variance per period and mechanism, with two standard errors
    over the repetitions (none for one), the 0.9-1.1 band shaded.
    Right: lifetime epsilon over devices per mechanism (range, median, mean, p99) beside
    what one-shot reporting at the same per-report epsilon spends."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6))
    names = [row["mechanism"] for row in run.rows]
    for index, name in enumerate(names):
        mine = [r for r in run.periods if r["mechanism"] == name]
        left.errorbar(
            [r["period"] for r in mine], [r["ratio"] for r in mine],
            yerr=[2 * r["ratio_se"] for r in mine], capsize=2, label=name,
            **report.series_style(index),
        )  # fmt: skip
    left.axhspan(0.9, 1.1, color="0.85", zorder=0, label="0.9-1.1")
    left.axhline(1.0, color="0.4", linewidth=0.8, linestyle=report.THEORY_STYLE)
    left.set_xlabel("period")
    left.set_ylabel("MSE / analytical variance (bars: 2 SE)")
    left.set_title("accuracy per period")
    left.grid(True, alpha=0.3)
    left.legend(fontsize="x-small", ncol=2)

    for index, row in enumerate(run.rows):
        spent = [r["lifetime_epsilon"] for r in run.lifetime if r["mechanism"] == row["mechanism"]]
        color = f"C{index % 10}"
        right.vlines(index, min(spent), max(spent), color=color, linewidth=2)
        right.plot(index, row["lifetime_median"], "o", color=color, markerfacecolor="none")
        right.plot(index, row["lifetime_mean"], "^", color=color)
        right.plot(index, row["lifetime_p99"], "s", color=color, markerfacecolor="none")
        right.plot(index, row["one_shot_lifetime"], "x", color="black")
    for marker, label, face in (
        ("o", "median", "none"), ("^", "mean", "0.3"), ("s", "99th percentile", "none"),
        ("x", "one-shot: T x epsilon_report", "black"),
    ):  # fmt: skip
        right.plot([], [], marker, color="0.3" if marker != "x" else "black",
                   markerfacecolor=face, label=label)  # fmt: skip
    right.set_xticks(range(len(names)), names, rotation=30)
    right.set_yscale("log")
    plain = matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}")
    right.yaxis.set_major_formatter(plain)
    right.yaxis.set_minor_formatter(plain)
    right.set_ylabel("lifetime epsilon per device (line: range)")
    right.set_title(f"lifetime epsilon over {counted(run.rows[0]['periods'], 'period')}")
    right.grid(True, which="both", alpha=0.3)
    right.legend(fontsize="x-small")
    report.save_figure(figure, path)
