"""``ldp-sim strings``: open-domain strings, heavy hitters found and candidates estimated.

Population. ``n`` users hold strings of a vocabulary (``--strings``): the bundled list
``words`` (``WORDS_FILE``) or a UTF-8 text file, one string per line; the first
``--vocabulary-size`` of them, ranked in file order. A data shape (``zipf:S``, the i-th
string's share proportional to (i + 1)^-S; ``uniform``; ``counts:FILE``) gives the
shares, and the n users are split by largest remainders (``populations.apportion``): the
true counts are exact, the same for every mechanism, path and seed. User u holds the
string at position (a u + c) mod n of the counts laid end to end (string 0's users
first), a the integer nearest n (sqrt(5) - 1) / 2 made coprime to n and c drawn from the
seed: a permutation that spreads every string evenly over the blocks of users
(``DEVICE_BLOCK``), so each block is a representative sample.

The bundled list. ``simulations/data/words.txt`` holds ``WORD_COUNT`` pronounceable
lowercase ASCII words of 3 to 12 letters, made by this module's own
``pronounceable_words(WORD_COUNT)``: the SHA-256 digest of ``WORDS_LABEL || BE64(i)``
picks, byte by byte, a number of syllables, an onset and a vowel for each, and an ending
(a byte modulo the length of each list; the slight modulo bias is harmless for made-up
words); words outside 3..12 letters and repeats are skipped. Nothing is downloaded or
copied from elsewhere, and the file is the generator's output, so it can be rebuilt.

Mechanisms (``MECHANISMS``), each over every epsilon:

* ``cms``, ``hcms``: Apple's Count Mean Sketch and its Hadamard variant, at
  ``--sketch-width`` m and ``--sketch-depth`` k;
* ``pem`` (prefix extension, Wang et al., TDSC 2019) and ``sfp`` (Apple's Sequence Fragment
  Puzzle, with an m x k sketch too): discovery without candidates, at ``--max-length``
  bytes (default: the longest string held);
* ``rappor``: the candidate-list reference, ``--rappor-bits``, ``--rappor-hashes``,
  ``--rappor-cohorts``, with f = 0 and p = 1 - q = 1 / (1 + e^(epsilon / (2 h))), so that
  one report is exactly epsilon-LDP (epsilon_one = h ln(q (1 - p) / (p (1 - q))) =
  epsilon, Erlingsson et al., CCS 2014) like every other mechanism here; f = 0 gives up
  RAPPOR's memoized longitudinal protection, which the others do not have either.

Paths. ``exact`` encodes every user, in work units of up to ``UNIT_BYTES`` of reports
(``unit_users``), through the mechanism's ``encode``
(devices' permanent randomness from ``SimulatedMemo(user ids)``; RAPPOR users a fresh
secret each, from which their cohort derives) and aggregates the reports. ``fast`` draws
the statistics from their exact law (``simulate_statistics(strings, counts, rng)``, which
every string mechanism has), O(V) whatever n (column ``path``).

Measures, per mechanism and epsilon, averaged over ``--reps`` repetitions (fresh noise,
the same population). T is the true top-k (``--top-k``; ties by vocabulary rank) and F
the strings reported: ``heavy_hitters(stats, k)`` for discovery mechanisms, and for the
others the k largest estimates among the candidates, the true top-C (``--candidates``).

* ``precision`` = |F n T| / |F| (NaN when nothing is found), ``recall`` = |F n T| / k;
* ``tv`` = 1/2 sum over s in F u T of |f_F(s) - f_T(s)|, f_F the estimated frequency of a
  reported string (0 for others), f_T the true frequency of a top-k string (0 for others):
  the total variation between the reported and the true top-k histograms;
* ``mse`` = mean over the C candidates of (f_hat - f)^2 from ``estimate(stats,
  candidates)``, ``variance`` the mean of the std^2 the mechanism states (its analytical
  variance, hash-collision term included where it has one), ``ratio`` = mse / variance,
  1 when the stated variance is right; ``ratio_se`` = sqrt(2 sum std^4) / sum std^2 over
  all repetitions' candidates, its standard error for independent normal errors (RAPPOR's
  constrained fit is biased near 0, so its ratio need not be 1);
* time: ``encode_seconds`` (exact path), ``aggregate_seconds`` (aggregate and merge, or
  the fast path's draw), ``estimate_seconds`` (the C candidates), ``discover_seconds``
  (heavy hitters), each per repetition; memory: ``report_bytes`` (mean JSON payload of a
  report), ``statistics_bytes`` (the serialized statistics the server keeps) and
  ``block_peak_mb`` (the peak memory traced while encoding and aggregating
  ``MEMORY_BLOCK`` users, in an untimed pass of its own).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import time
import tracemalloc
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from shared.mechanisms import (
    DeviceContext,
    Mechanism,
    as_candidate_queries,
    as_discovery,
    make_mechanism,
)
from shared.mechanisms.strings import MAX_STRING_BYTES
from shared.memo import SimulatedMemo
from shared.schemas import MechanismSpec
from simulations import report
from simulations.execution import run_units
from simulations.populations import CategoricalShape, apportion
from simulations.text import counted

__all__ = [
    "DISCOVERY",
    "MECHANISMS",
    "RESULT_COLUMNS",
    "WORDS_FILE",
    "Settings",
    "StringPopulation",
    "StringsRun",
    "make_spec",
    "mechanism_for",
    "plot_strings",
    "pronounceable_words",
    "read_strings",
    "simulate",
    "top_k_measures",
]

MECHANISMS = ("cms", "hcms", "pem", "sfp", "rappor")
DISCOVERY = frozenset({"pem", "sfp"})
#: Users per block of the population (``StringPopulation.blocks``).
DEVICE_BLOCK = 1 << 16
#: Bytes of reports a work unit of the exact path holds (its users: as many as fit, from
#: ``MIN_UNIT_USERS`` to ``MAX_UNIT_USERS``): fewer, larger units share out each
#: aggregation's fixed costs (counting the bits of a cms sketch row costs, besides its
#: reports, about what 1,000 reports do).
UNIT_BYTES = 1 << 25
MIN_UNIT_USERS, MAX_UNIT_USERS = 1 << 8, 1 << 18
#: The most users: u * a stays below 2^63 for a, u < n (the population's permutation).
MAX_USERS = 3_000_000_000
#: Generator streams of the run's seed: the population's layout, the noise, the memos.
LAYOUT_STREAM, NOISE_STREAM, MEMO_STREAM = 1, 2, 3
#: Reports whose JSON payloads are measured for ``report_bytes``.
PAYLOAD_SAMPLE = 256
#: Users encoded and aggregated under ``tracemalloc`` for ``block_peak_mb`` (tracing slows
#: every allocation, so it runs on a small block of its own, untimed).
MEMORY_BLOCK = 4096
#: RAPPOR device secrets, as the client's.
SECRET_BYTES = 16

WORDS_FILE = Path(__file__).with_name("data") / "words.txt"
WORD_COUNT = 4096
WORDS_LABEL = b"ldp-sim words v1\x00"
_ONSETS = (
    "b c d f g h k l m n p r s t v w z b d l m n r s t br cr dr fr gr pr tr bl cl fl pl st "
    "sp ch sh th"
).split() + [""]
_VOWELS = "a e i o u a e i o a e ai ea ee io oa ou y".split()
_ENDINGS = [""] * 5 + "n r s t l m nd st rt ng ck x".split()
_SYLLABLES = (1, 2, 2, 2, 3, 3, 4, 2, 3, 1, 2, 3)

RESULT_COLUMNS = (
    "mechanism path epsilon users vocabulary shape top_k candidates reps sketch_width "
    "sketch_depth max_length precision recall tv mse variance ratio ratio_se encode_seconds "
    "aggregate_seconds estimate_seconds discover_seconds report_bytes statistics_bytes "
    "block_peak_mb"
).split()
TABLE_COLUMNS = (
    "mechanism epsilon path precision recall tv mse variance ratio encode_seconds "
    "aggregate_seconds estimate_seconds discover_seconds statistics_bytes block_peak_mb"
).split()
FOUND_COLUMNS = (
    "mechanism epsilon rep position string frequency std true_frequency true_rank in_top_k"
).split()
CANDIDATE_COLUMNS = "mechanism epsilon rep true_rank string true_frequency frequency std".split()


# --- the vocabulary ------------------------------------------------------------------------


def pronounceable_words(count: int) -> list[str]:
    """The first ``count`` distinct words of the bundled list's generator (module docstring)."""
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    words: list[str] = []
    seen: set[str] = set()
    index = 0
    while len(words) < count:
        digest = hashlib.sha256(WORDS_LABEL + index.to_bytes(8, "big")).digest()
        index += 1
        syllables = _SYLLABLES[digest[0] % len(_SYLLABLES)]
        word = (
            "".join(
                _ONSETS[digest[1 + 2 * j] % len(_ONSETS)]
                + _VOWELS[digest[2 + 2 * j] % len(_VOWELS)]
                for j in range(syllables)
            )
            + _ENDINGS[digest[31] % len(_ENDINGS)]
        )
        if 3 <= len(word) <= 12 and word not in seen:
            seen.add(word)
            words.append(word)
    return words


def read_strings(path: Path) -> tuple[str, ...]:
    """The strings of a UTF-8 text file, one per line (blank lines skipped), in order.

    ValueError naming the file and line of a string that repeats or that is longer than
    ``MAX_STRING_BYTES`` UTF-8 bytes, or when fewer than two strings remain.
    """
    if not path.is_file():
        raise ValueError(f"strings file {str(path)!r} does not exist")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 text ({error.reason} at byte {error.start})") from None
    strings: list[str] = []
    seen: dict[str, int] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        if line in seen:
            raise ValueError(f"{path}:{number}: {line!r} repeats line {seen[line]}")
        size = len(line.encode("utf-8"))
        if size > MAX_STRING_BYTES:
            raise ValueError(
                f"{path}:{number}: a string of {size} UTF-8 bytes; at most {MAX_STRING_BYTES}"
            )
        seen[line] = number
        strings.append(line)
    if len(strings) < 2:
        raise ValueError(f"{path}: needs at least two strings")
    return tuple(strings)


def vocabulary(source: str) -> tuple[str, ...]:
    """``words`` (the bundled list) or the strings of the file ``source``."""
    return read_strings(WORDS_FILE if source == "words" else Path(source))


# --- the population ------------------------------------------------------------------------


@dataclass(frozen=True)
class StringPopulation:
    """``users`` users holding ``strings`` with the shares of ``shape`` (module docstring)."""

    strings: tuple[str, ...]
    shape: CategoricalShape
    users: int
    seed: int

    def __post_init__(self) -> None:
        if not 1 <= self.users <= MAX_USERS:
            raise ValueError(f"users must be between 1 and {MAX_USERS:,}, got {self.users}")
        if len(self.strings) < 2 or len(set(self.strings)) != len(self.strings):
            raise ValueError("a population needs at least two distinct strings")
        self.shape.shares(len(self.strings))  # a counts:FILE shape must fit the strings

    @functools.cached_property
    def counts(self) -> np.ndarray:
        """How many users hold each string (exact, largest remainders)."""
        return apportion(self.shape.shares(len(self.strings)), self.users)

    @functools.cached_property
    def frequencies(self) -> np.ndarray:
        return self.counts / self.users

    @functools.cached_property
    def ranking(self) -> np.ndarray:
        """String indices, most held first (ties by vocabulary rank)."""
        return np.argsort(-self.counts, kind="stable")

    @property
    def max_bytes(self) -> int:
        """The longest string held by some user, in UTF-8 bytes."""
        held = np.flatnonzero(self.counts)
        return max(len(self.strings[i].encode("utf-8")) for i in held)

    @functools.cached_property
    def _layout(self) -> tuple[int, int]:
        """(a, c) of the users' permutation u -> (a u + c) mod n."""
        n = self.users
        stride = max(1, round(n * (math.sqrt(5) - 1) / 2))
        while math.gcd(stride, n) != 1:
            stride += 1
        offset = int(np.random.default_rng([self.seed, LAYOUT_STREAM]).integers(n))
        return stride, offset

    def blocks(self, size: int = DEVICE_BLOCK) -> list[tuple[int, int]]:
        """The blocks of ``size`` users ``[start, stop)`` (the last one shorter)."""
        return [(start, min(self.users, start + size)) for start in range(0, self.users, size)]

    def held(self, start: int, stop: int) -> np.ndarray:
        """The string index held by each user in ``[start, stop)``."""
        if not 0 <= start <= stop <= self.users:
            raise ValueError(f"users [{start}, {stop}) are not within [0, {self.users})")
        stride, offset = self._layout
        users = np.arange(start, stop, dtype=np.int64)
        positions = (users * stride + offset) % self.users
        return np.searchsorted(np.cumsum(self.counts), positions, side="right")

    def values(self, start: int, stop: int) -> list[str]:
        """The strings of users ``[start, stop)``."""
        return [self.strings[i] for i in self.held(start, stop)]


# --- specs ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """The mechanisms' parameters besides epsilon."""

    sketch_width: int = 1024
    sketch_depth: int = 256
    max_length: int = 16
    rappor_bits: int = 128
    rappor_hashes: int = 2
    rappor_cohorts: int = 64


def make_spec(name: str, epsilon: float, settings: Settings) -> MechanismSpec:
    """The spec of ``name`` at ``epsilon``; ``pydantic.ValidationError`` names a bad field."""
    fields: dict[str, Any] = {"mechanism": name, "epsilon": epsilon}
    if name in ("cms", "hcms", "sfp"):
        fields.update(sketch_width=settings.sketch_width, sketch_depth=settings.sketch_depth)
    if name in DISCOVERY:
        fields["max_length"] = settings.max_length
    if name == "rappor":
        h = settings.rappor_hashes
        p = 1.0 / (1.0 + math.exp(epsilon / (2 * h)))
        fields.update(
            num_bits=settings.rappor_bits, num_hashes=h, num_cohorts=settings.rappor_cohorts,
            f=0.0, p=p, q=1.0 - p,
        )  # fmt: skip
    return MechanismSpec.model_validate(fields)


@functools.lru_cache(maxsize=64)
def mechanism_for(spec: MechanismSpec) -> Mechanism[Any]:
    """``make_mechanism(spec)``, built once per process."""
    return make_mechanism(spec)


def encode(
    mech: Mechanism[Any],
    values: list[str],
    users: np.ndarray,
    rng: np.random.Generator,
    memo_seed: int,
) -> Any:
    """The reports of ``values`` held by ``users``: each device with its permanent
    randomness from ``SimulatedMemo`` (``pem``'s group) and, for a mechanism that keeps
    one, a fresh secret (RAPPOR's, from which its cohort derives)."""
    secrets = (
        rng.integers(0, 256, (len(values), SECRET_BYTES), dtype=np.uint8) if mech.stateful else None
    )
    return mech.encode(values, rng, DeviceContext(SimulatedMemo(users, memo_seed), secrets))


# --- work units ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Unit:
    """One mechanism in one repetition: over users ``[start, stop)`` (exact path), or its
    whole statistics drawn at once (``simulated``)."""

    population: StringPopulation
    spec: MechanismSpec
    start: int
    stop: int
    simulated: bool
    memo_seed: int
    seed: np.random.SeedSequence


@dataclass
class UnitResult:
    statistics: Any
    encode_seconds: float
    aggregate_seconds: float


def unit_users(spec: MechanismSpec) -> int:
    """Users per work unit of the exact path: ``UNIT_BYTES`` of reports, a report taken as
    24 bytes plus its bit vector (cms and sfp: m bits; rappor: its Bloom bits)."""
    bits = getattr(spec, "sketch_width", 0) + getattr(spec, "num_bits", 0)
    report_bytes = 24 + bits // 8
    return min(MAX_UNIT_USERS, max(MIN_UNIT_USERS, UNIT_BYTES // report_bytes))


def run_unit(unit: Unit) -> UnitResult:
    """Encode and aggregate one block, or draw the statistics (the function workers run)."""
    mech = mechanism_for(unit.spec)
    rng = np.random.default_rng(unit.seed)
    population = unit.population
    if unit.simulated:
        started = time.perf_counter()
        strings = as_candidate_queries(mech)
        assert strings is not None  # every mechanism here estimates strings
        stats = strings.simulate_statistics(list(population.strings), population.counts, rng)
        return UnitResult(stats, math.nan, time.perf_counter() - started)
    values = population.values(unit.start, unit.stop)
    users = np.arange(unit.start, unit.stop)
    started = time.perf_counter()
    reports = encode(mech, values, users, rng, unit.memo_seed)
    encoded = time.perf_counter()
    stats = mech.aggregate(reports)
    return UnitResult(stats, encoded - started, time.perf_counter() - encoded)


def memory_profile(
    spec: MechanismSpec, population: StringPopulation, seed: int
) -> tuple[float, float]:
    """(mean JSON bytes of a report's payload, peak MB traced while encoding and aggregating
    the first ``MEMORY_BLOCK`` users)."""
    mech = mechanism_for(spec)
    stop = min(population.users, MEMORY_BLOCK)
    values = population.values(0, stop)
    rng = np.random.default_rng([seed, NOISE_STREAM])
    tracemalloc.start()
    try:
        reports = encode(mech, values, np.arange(stop), rng, seed)
        mech.aggregate(reports)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    payloads = mech.to_payloads(reports[:PAYLOAD_SAMPLE])
    size = np.mean([len(json.dumps(payload, separators=(",", ":"))) for payload in payloads])
    return float(size), peak / 2**20


# --- measures ------------------------------------------------------------------------------


def top_k_measures(
    found: Sequence[str], estimates: Sequence[float], truth: dict[str, float], k: int
) -> tuple[float, float, float]:
    """(precision, recall, tv) of the ``found`` strings with their ``estimates`` against the
    true top-k ``truth`` (string -> true frequency), as the module docstring defines them."""
    if len(found) != len(estimates):
        raise ValueError("need one estimate per string found")
    if len(truth) != k:
        raise ValueError(f"the true top-k must have k = {k} strings, got {len(truth)}")
    reported = dict(zip(found, (float(e) for e in estimates), strict=True))
    hits = len(reported.keys() & truth.keys())
    precision = hits / len(reported) if reported else math.nan
    tv = 0.5 * sum(
        abs(reported.get(s, 0.0) - truth.get(s, 0.0)) for s in reported.keys() | truth.keys()
    )
    return precision, hits / k, tv


@dataclass
class Evaluation:
    """One repetition's measures and what they were computed from."""

    precision: float
    recall: float
    tv: float
    squared_errors: np.ndarray
    variances: np.ndarray
    estimate_seconds: float
    discover_seconds: float
    found: list[dict[str, Any]] = field(default_factory=list)
    candidates: list[dict[str, Any]] = field(default_factory=list)


def evaluate(mech: Any, stats: Any, population: StringPopulation, k: int, count: int) -> Evaluation:
    """Estimate the true top-``count`` candidates and find the top ``k`` (module docstring)."""
    ranking = population.ranking
    frequencies = population.frequencies
    candidates = [population.strings[i] for i in ranking[:count]]
    started = time.perf_counter()
    estimate = mech.estimate(stats, candidates)
    estimated = time.perf_counter()
    values = np.asarray(estimate.frequencies, dtype=np.float64)
    std = np.asarray(estimate.std, dtype=np.float64)
    if (finder := as_discovery(mech)) is not None:
        hitters = finder.heavy_hitters(stats, k)
        discover_seconds = time.perf_counter() - estimated
        found = list(hitters.strings)
        found_values = np.asarray(hitters.frequencies, dtype=np.float64)
        found_std = np.asarray(hitters.std, dtype=np.float64)
    else:
        discover_seconds = math.nan
        order = np.argsort(-values, kind="stable")[:k]
        found = [candidates[i] for i in order]
        found_values, found_std = values[order], std[order]
    truth = {population.strings[i]: float(frequencies[i]) for i in ranking[:k]}
    precision, recall, tv = top_k_measures(found, found_values.tolist(), truth, k)
    rank_of = {population.strings[i]: rank for rank, i in enumerate(ranking, start=1)}
    share_of = dict(zip(population.strings, frequencies.tolist(), strict=True))
    return Evaluation(
        precision, recall, tv,
        (values - frequencies[ranking[:count]]) ** 2, std**2,
        estimated - started, discover_seconds,
        found=[
            {
                "position": position, "string": string, "frequency": float(value),
                "std": float(error), "true_frequency": share_of.get(string, 0.0),
                "true_rank": rank_of.get(string, 0), "in_top_k": string in truth,
            }
            for position, (string, value, error) in enumerate(
                zip(found, found_values, found_std, strict=True), start=1
            )
        ],
        candidates=[
            {
                "true_rank": rank, "string": string,
                "true_frequency": float(frequencies[ranking[rank - 1]]),
                "frequency": float(value), "std": float(error),
            }
            for rank, (string, value, error) in enumerate(
                zip(candidates, values, std, strict=True), start=1
            )
        ],
    )  # fmt: skip


# --- the run -------------------------------------------------------------------------------


@dataclass
class StringsRun:
    """What ``simulate`` measured: one row per (mechanism, epsilon), the strings each
    repetition reported, and its candidates' estimates."""

    rows: list[dict[str, Any]]
    found: list[dict[str, Any]]
    candidates: list[dict[str, Any]]


def memo_seed(seed: int, index: int, rep: int) -> int:
    """The memo seed of spec ``index`` in repetition ``rep``."""
    state = np.random.SeedSequence([seed, MEMO_STREAM, index, rep]).generate_state(2)
    return int(state[0]) << 32 | int(state[1])


def simulate(
    population: StringPopulation,
    specs: Sequence[MechanismSpec],
    *,
    top_k: int = 10,
    candidates: int = 100,
    reps: int = 1,
    path: str = "exact",
    workers: int = 1,
    scheduler: str | None = None,
    progress: bool = True,
) -> StringsRun:
    """Run every spec over ``population`` ``reps`` times, where the options say
    (``run_units``), and measure each (module docstring)."""
    vocabulary_size = len(population.strings)
    if not 1 <= top_k <= candidates <= vocabulary_size:
        raise ValueError(
            f"need 1 <= top_k ({top_k}) <= candidates ({candidates}) <= the vocabulary size "
            f"({vocabulary_size})"
        )
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    if path not in ("exact", "fast"):
        raise ValueError(f"path must be 'exact' or 'fast', got {path!r}")
    plan: list[tuple[int, int, int, int, bool]] = []
    for index, spec in enumerate(specs):
        simulated = path == "fast"
        spans = [(0, population.users)] if simulated else population.blocks(unit_users(spec))
        plan += [(index, rep, a, b, simulated) for rep in range(reps) for a, b in spans]
    seeds = np.random.SeedSequence([population.seed, NOISE_STREAM]).spawn(len(plan))
    units = [
        Unit(population, specs[index], start, stop, simulated,
             memo_seed(population.seed, index, rep), s)
        for (index, rep, start, stop, simulated), s in zip(plan, seeds, strict=True)
    ]  # fmt: skip
    results = run_units(
        run_unit, units, workers=workers, scheduler=scheduler, progress=progress,
        description="string units",
    )  # fmt: skip
    parts: dict[tuple[int, int], list[UnitResult]] = {}
    for (index, rep, *_), result in zip(plan, results, strict=True):
        parts.setdefault((index, rep), []).append(result)
    run = StringsRun([], [], [])
    for index, spec in enumerate(specs):
        simulated = next(item[4] for item in plan if item[0] == index)
        _summarize(
            run, spec, population, [parts[(index, rep)] for rep in range(reps)],
            top_k, candidates, "fast" if simulated else "exact",
        )  # fmt: skip
    return run


def _summarize(
    run: StringsRun,
    spec: MechanismSpec,
    population: StringPopulation,
    per_rep: list[list[UnitResult]],
    top_k: int,
    candidates: int,
    path: str,
) -> None:
    """Merge each repetition's statistics, evaluate them, and add the rows to ``run``."""
    mech = mechanism_for(spec)
    evaluations, merge_seconds = [], []
    for rep, parts in enumerate(per_rep):
        started = time.perf_counter()
        stats = parts[0].statistics.merge_many(part.statistics for part in parts[1:])
        merge_seconds.append(time.perf_counter() - started)
        evaluation = evaluate(mech, stats, population, top_k, candidates)
        evaluations.append(evaluation)
        where = {"mechanism": spec.mechanism, "epsilon": spec.epsilon, "rep": rep}
        run.found += [{**where, **row} for row in evaluation.found]
        run.candidates += [{**where, **row} for row in evaluation.candidates]
    squares = np.concatenate([e.squared_errors for e in evaluations])
    variances = np.concatenate([e.variances for e in evaluations])
    report_bytes, block_peak_mb = memory_profile(spec, population, population.seed)
    reps = len(per_rep)
    precisions = [e.precision for e in evaluations if not math.isnan(e.precision)]
    run.rows.append(
        {
            "mechanism": spec.mechanism,
            "path": path,
            "epsilon": spec.epsilon,
            "users": population.users,
            "vocabulary": len(population.strings),
            "shape": population.shape.text,
            "top_k": top_k,
            "candidates": candidates,
            "reps": reps,
            "sketch_width": getattr(spec, "sketch_width", None),
            "sketch_depth": getattr(spec, "sketch_depth", None),
            "max_length": getattr(spec, "max_length", None),
            "precision": float(np.mean(precisions)) if precisions else math.nan,
            "recall": float(np.mean([e.recall for e in evaluations])),
            "tv": float(np.mean([e.tv for e in evaluations])),
            "mse": float(squares.mean()),
            "variance": float(variances.mean()),
            "ratio": float(squares.sum() / variances.sum()),
            "ratio_se": float(math.sqrt(2 * np.sum(variances**2)) / variances.sum()),
            "encode_seconds": sum(p.encode_seconds for ps in per_rep for p in ps) / reps,
            "aggregate_seconds": (
                sum(p.aggregate_seconds for ps in per_rep for p in ps) + sum(merge_seconds)
            ) / reps,
            "estimate_seconds": float(np.mean([e.estimate_seconds for e in evaluations])),
            "discover_seconds": float(np.mean([e.discover_seconds for e in evaluations])),
            "report_bytes": report_bytes,
            "statistics_bytes": len(stats.to_bytes()),
            "block_peak_mb": block_peak_mb,
        }
    )  # fmt: skip


# --- plot ----------------------------------------------------------------------------------


def plot_strings(run: StringsRun, path: Path) -> None:
    """Recall, precision and TV of the top-k, and the candidates' MSE beside the stated
    variance (black dashed), against epsilon, one line per mechanism."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(2, 2, figsize=(11, 8))
    panels = (
        ("recall", "recall of the true top-k", "share"),
        ("precision", "precision of the strings reported", "share"),
        ("tv", "TV distance of the top-k frequencies", "linear"),
        ("mse", "candidates' MSE (black dashed: stated variance)", "log"),
    )
    names = list(dict.fromkeys(row["mechanism"] for row in run.rows))
    for axis, (column, title, scale) in zip(axes.flat, panels, strict=True):
        for index, name in enumerate(names):
            mine = sorted(
                (r for r in run.rows if r["mechanism"] == name), key=lambda r: r["epsilon"]
            )
            epsilons = [r["epsilon"] for r in mine]
            style = report.series_style(index)
            axis.plot(epsilons, [r[column] for r in mine], label=name, **style)
            if column == "mse":
                axis.plot(
                    epsilons,
                    [r["variance"] for r in mine],
                    **report.theory_style(index == len(names) - 1),
                )
        axis.set_xlabel("epsilon")
        axis.set_title(title)
        if scale == "log":
            axis.set_yscale("log")
        elif scale == "share":
            axis.set_ylim(-0.03, 1.03)
        else:
            axis.set_ylim(bottom=0.0)
        axis.grid(True, which="both", alpha=0.3)
    axes.flat[0].legend(fontsize="small")
    axes.flat[3].legend(fontsize="small")
    first = run.rows[0]
    figure.suptitle(
        f"{counted(first['users'], 'user')}, {counted(first['vocabulary'], 'string')} "
        f"({first['shape']}), top-{first['top_k']}, {counted(first['candidates'], 'candidate')}"
    )
    report.save_figure(figure, path)
