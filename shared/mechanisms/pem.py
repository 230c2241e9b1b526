"""Prefix extending method (PEM): the most frequent open-domain strings, found without candidates.

Wang, Li, Jha, "Locally Differentially Private Heavy Hitter Identification", IEEE TDSC
2019 (arXiv:1708.06674), on optimized local hashing (OLH; Wang, Blocki, Li, Jha, USENIX
Security 2017, Section 4.4).

Encoding. A value is its UTF-8 bytes padded with 0xFF to ``max_length`` bytes
(``shared.mechanisms.strings``, "Padded values"): L = 8 max_length bits, bit 0 the most
significant bit of byte 0.

Parameters, from (max_length, epsilon):

* groups and levels: G = max_length; the first prefix has s = 8 bits and each level adds
  step = 8 bits, so group j (0..G-1) reports the first s + j step = 8 (j + 1) bits, its
  first j + 1 bytes, and the last group the whole padded string;
* buckets: g = min(round(e^eps) + 1, floor(2^22 / (64 G))), OLH's choice, capped so that
  at least 64 seeds fit the statistics at every epsilon;
* seeds: S = min(2^13, floor(2^16 / G), floor(2^22 / (G g))), so the statistics hold at
  most 2^22 counts and a query's work is bounded whatever max_length is (below).

Why these. Wang et al. split the users into groups reporting prefixes that grow by a
fixed number of bits per group. Each level is estimated from n / G users, so its
variance grows linearly with G: fewer, longer steps are better, while each level tests
(kept prefixes) * 2^step candidates against S seeds. A byte per step is the largest step
whose work stays in seconds, and it lets the server keep only prefixes that are
well-formed UTF-8 (Unicode Standard, Table 3-7): at most 180 of the 256 extensions of a
prefix are, so a level has at most 2k * 180 candidates. Epsilon sets the buckets, and
through them the seeds: more seeds shrink the hash-collision error below.

Device, for a value v. Its group j is drawn once for life from its memo
(``shared.memo``; purpose ``b"pem group"``, key 0; ``memo=None`` draws it fresh), its
seed s uniformly on 0..S-1 afresh for each report, and its report (j, s, y) is OLH's:
y is H_s(prefix_j(v)) put through randomized response over the g buckets
(``shared.mechanisms.grr.k_ary_response``):

    P(y = H_s(prefix)) = p,  P(y = b) = o for each other bucket b,

p = e^eps / (e^eps + g - 1) and o = 1 / (e^eps + g - 1) as realized by a certified 53-bit
keep threshold (p / o <= e^eps proven in exact arithmetic). Each device reports once, in
its group: no budget is split across levels.

Privacy. The group and the seed are drawn independently of the value; given them, y is
randomized response over g buckets, whose likelihood ratio between any two values is 1 or
(p / o)^(+-1). So every report is eps-LDP, and tightly so: a seed that hashes two prefixes
apart reaches p / o. ``report_probabilities`` and ``transition_matrix`` enumerate the exact
law for the tests.

Hash family, specified byte for byte so that any client can match it:

    F(P)   = first 8 bytes, little-endian, of SHA-256("LDP PEM v1" 0x00 || BE16(8 |P|) || P)
    H_s(P) = ((mix(F(P) + (s + 1) * 0x9E3779B97F4A7C15 mod 2^64) >> 32) * g) >> 32

for a prefix P of |P| bytes, where mix is SplitMix64's finalizer (z ^= z >> 30;
z *= 0xBF58476D1CE4E5B9; z ^= z >> 27; z *= 0x94D049BB133111EB; z ^= z >> 31, mod 2^64):
H_s(P) is the (s + 1)-th output of SplitMix64 seeded with F(P), mapped to a bucket by
multiply-shift on its top 32 bits. Modelling (s, P) -> the 64-bit output as a random
function, two distinct prefixes of one length land in the same bucket under a uniform
seed with probability exactly

    c = sum_b pi_b^2,  pi_b = (ceil((b + 1) 2^32 / g) - ceil(b 2^32 / g)) / 2^32,

(pi_b the share of 32-bit words in bucket b; with 2^32 = m g + r, c - 1/g =
r (g - r) / (g 2^64) <= g / 2^66), and so a report supports (hashes y to) a prefix other
than its own with probability

    q = c p + (1 - c) o.

No finite set of seeds makes this exact for every pair of prefixes of the whole domain:
an estimator linear in counts over G S g cells is unbiased for every population only if
the report law has rank >= the number of possible prefixes, up to 2^2048. The collision
term below accounts for the difference.

Server. The sufficient statistics are a ``CountStatistics`` of G S g counts, cell
(j S + s) g + y, so they are bounded whatever n is (held sparse for few reports). Group
j's n_j reports estimate the frequency of a prefix v among the users as

    C_v = sum_s N_j[s, H_s(v)],  f_v = (C_v / n_j - q) / (p - q),

unbiased over the reports, the users' groups and the hash (as a random function). Its
variance about the users' own frequency has three terms:

    Var = (q (1 - q) / (p - q)^2 + f (1 - p - q) / (p - q)) / n_j    OLH at n_j reports
        + f (1 - f) (n - n_j) / (n_j (n - 1))                           which users are in j
        + c (F2 - f^2) / ((1 - c) S)                                    hash collisions

the last being the variance over the hash of (1 / (1 - c)) sum_{u != v} f_u (c_uv - c),
c_uv the share of seeds on which u and v collide (a binomial over S seeds), with F2 =
sum_u f_u^2 over group j's prefixes. F2 is estimated from the same counts: two reports of
one group and seed carry the same y with probability a0 + (p - o)^2 (c + (1 - c) Pi),
a0 = 2 p o + (g - 2) o^2 and Pi the chance that two of the group's users share the
prefix, so with Z = sum_{s,y} C(N_j[s, y], 2) and A = sum_s C(n_{j,s}, 2),

    Pi = (Z / A - a0 - (p - o)^2 c) / ((p - o)^2 (1 - c)),  F2 = Pi (n_j - 1) / n_j + 1 / n_j.

``std`` evaluates Var at the estimates (f clipped to [0, 1], F2 - f^2 to >= 0). Given the
one public hash, the collision term is a fixed offset (the same in every window), which
the std covers as a random effect.

``estimate(stats, candidates)`` answers full strings from the last group.
``heavy_hitters(stats, k)`` extends prefixes level by level: level 0 estimates every
well-formed first byte from group 0; level j estimates the 2k prefixes kept at level
j - 1, each extended by every byte that keeps it well-formed and completable within
max_length, from group j; it keeps the 2k largest estimates (the k largest at the last
level, whose prefixes are whole padded strings).

Work. Estimating m candidates from all S seeds takes m S hash evaluations (2k * 180 * G * S
<= k * 2.4e7 over a query: 34 s of CPU at k = 100). So a level of more than
``MAX_LEVEL_CANDIDATES`` = M candidates screens them first: each is estimated from the
reports of the first S / ``SCREEN_SHARE`` seeds alone (seeds are uniform and independent of
the values, so these reports are a uniform subsample and the screening estimate is
unbiased, with about ``SCREEN_SHARE`` times the variance), and only the M largest
screening estimates are completed with the other seeds' counts, into the estimates from
all S seeds that the level ranks. A level then costs at most m S / 4 + M (3 / 4) S hash
evaluations instead of m S, so a query at most G S (2k * 180 / 4 + 3 M / 4) <= 2^16 (90 k
+ 3072) (8.0e8 at k = 100, a third of 2.4e9); levels of at most M candidates (every level
while k <= 11) are estimated from all seeds at once, as without screening. A prefix far
above the noise survives the screen (with SCREEN_SHARE = 4 its screening std is about
twice the full one, and M candidates pass); one near the cut may be screened out where
the full estimate would have kept it. Screening is post-processing of the same
statistics: it changes nothing of the privacy. Selection and estimation share reports:
the returned frequencies come from the last group, the same reports that chose the final
k among the last level's candidates, so a string chosen near the cut tends to be
overestimated (the winner's curse); groups 0..G-2 only decide which prefixes are
extended, and do not bias the final estimates. ``std`` is that of a fixed string's
estimate, as above, not conditional on its being chosen; for strings far above the noise
the two agree.

Simulation fast path: ``simulate_statistics(strings, counts, rng)`` draws the statistics
of a population directly with the law of ``aggregate(encode(...))`` (see its docstring).

Report: int64 rows (group, seed, y). Payload: ``{"group": int, "seed": int, "value": int}``.

Refusal rules: none (``shared.integrity``). The group and the seed do not depend on the
value, and given them every bucket has probability at least o = 1 / (e^eps + g - 1) > 2^-31
under every input, so the only sets below 2^-40 for every input are a few particular
(seed, bucket) pairs, which say nothing about forgery: a forger's useful reports (a seed
that hashes its target prefixes together) are as likely as honest ones.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from fractions import Fraction
from functools import cached_property
from itertools import pairwise
from typing import Any, ClassVar, Literal

import numpy as np

from shared.estimates import Estimate, HeavyHitters
from shared.mechanisms.abilities import FRESH, DeviceContext, Discovery
from shared.mechanisms.base import (
    INTEGER,
    Mechanism,
    check_integer_field,
    check_integer_rows,
    payload_shape,
)
from shared.mechanisms.categorical import require_enumerable
from shared.mechanisms.grr import k_ary_keep_threshold, k_ary_probabilities, k_ary_response
from shared.mechanisms.memoized import MemoizedMechanism
from shared.mechanisms.registry import register
from shared.mechanisms.strings import (
    PAD,
    UTF8_START,
    MaxLength,
    OpenStringMechanism,
    StringSpec,
    factorize_utf8,
    padded_matrix,
    require_candidates,
    string_population,
    utf8_extensions,
    utf8_values,
)
from shared.memo import splitmix64
from shared.randomness import BITS53, Rng, as_source
from shared.statistics import CountStatistics

#: The memo purpose of a device's group.
GROUP_PURPOSE = b"pem group"
#: Domain separation of the prefix fingerprints.
FINGERPRINT_LABEL = b"LDP PEM v1\x00"
#: SplitMix64's increment: seed s is the generator's (s + 1)-th step from F(P).
GOLDEN = 0x9E3779B97F4A7C15
#: Bits of a prefix added per level, and of the first prefix.
STEP_BITS = 8
#: Most counts the statistics hold (G S g).
MAX_CELLS = 1 << 22
#: Most seeds: the server's work per candidate prefix and level is S hash evaluations.
MAX_SEEDS = 1 << 13
#: Most (group, seed) pairs, G S: the work per candidate prefix over all levels.
MAX_GROUP_SEEDS = 1 << 16
#: Fewest seeds the bucket cap leaves room for.
MIN_SEEDS = 1 << 6
#: Most strings ``heavy_hitters`` returns.
MAX_HEAVY_HITTERS = 100
#: Most candidates a level of ``heavy_hitters`` estimates from all seeds; more are screened
#: on a share of the seeds first (module docstring, "Work").
MAX_LEVEL_CANDIDATES = 4096
#: A screen uses the first S / SCREEN_SHARE seeds.
SCREEN_SHARE = 4
#: (candidate, seed) hash evaluations held in memory at once (256 KiB a buffer: they stay
#: in cache).
_CHUNK = 1 << 15


def fingerprints(prefixes: np.ndarray) -> np.ndarray:
    """F(P) of each row of a (n, bytes) uint8 matrix of prefixes: the first 8 bytes
    (little-endian) of SHA-256(label || BE16(8 bytes) || P), as uint64."""
    width = prefixes.shape[1]
    header = FINGERPRINT_LABEL + (8 * width).to_bytes(2, "big")
    data = np.ascontiguousarray(prefixes, dtype=np.uint8).tobytes()
    digests = b"".join(
        hashlib.sha256(header + data[start : start + width]).digest()[:8]
        for start in range(0, len(data), width)
    )
    return np.frombuffer(digests, dtype="<u8").astype(np.uint64)


def hash_buckets(fingerprint: np.ndarray, seeds: np.ndarray, buckets: int) -> np.ndarray:
    """H_s(P) = ((mix(F + (s + 1) GOLDEN) >> 32) g) >> 32 for broadcast ``fingerprint``
    (F, uint64) and ``seeds`` (s), as int64 (a fresh array, computed in place)."""
    with np.errstate(over="ignore"):
        offsets = (np.asarray(seeds).astype(np.uint64) + np.uint64(1)) * np.uint64(GOLDEN)
        words = splitmix64(np.asarray(fingerprint, dtype=np.uint64) + offsets)
    words >>= np.uint64(32)
    words *= np.uint64(buckets)
    words >>= np.uint64(32)
    return words.view(np.int64)  # every bucket is below 2^32: the same bits as int64


def _support(table: np.ndarray, prints: np.ndarray, first: int, stop: int) -> np.ndarray:
    """C_v = sum_{first <= s < stop} N[s, H_s(v)] for each fingerprint of ``prints``, from
    an (S, g) count table: hash_buckets evaluated chunk by chunk in cache-sized buffers,
    the counts gathered as int32 when they fit (half the memory traffic)."""
    seeds = np.arange(first, stop)
    g = table.shape[1]
    rows = table[first:stop].reshape(-1)
    if rows.size and int(rows.max()) < 2**31:
        rows = rows.astype(np.int32)
    base = (seeds - first) * g
    support = np.zeros(prints.size, dtype=np.int64)
    step = max(1, _CHUNK // max(1, seeds.size))
    for start in range(0, prints.size, step):
        cells = hash_buckets(prints[start : start + step, None], seeds, g)
        cells += base
        support[start : start + step] = rows.take(cells).sum(axis=1, dtype=np.int64)
    return support


def collision_probability(buckets: int) -> Fraction:
    """c = sum_b pi_b^2 with pi_b the share of 32-bit words t with floor(t g / 2^32) = b."""
    word = 1 << 32
    edges = [-(-(b * word) // buckets) for b in range(buckets + 1)]  # ceil(b 2^32 / g)
    return Fraction(sum((high - low) ** 2 for low, high in pairwise(edges)), word * word)


def _uniform_counts(total: int, cells: int, rng: np.random.Generator) -> np.ndarray:
    """Multinomial(total, uniform over ``cells``): a histogram of ``total`` uniform draws
    when they are fewer than the cells, else one binomial per cell (O(min(total, cells)))."""
    if total < cells:
        return np.bincount(rng.integers(cells, size=total), minlength=cells)
    return rng.multinomial(total, np.full(cells, 1.0 / cells))


class PemSpec(StringSpec):
    """``{"mechanism": "pem", "epsilon": 4.0, "max_length": 16}``."""

    mechanism: Literal["pem"]
    max_length: MaxLength


@register
class PrefixExtendingMethod(OpenStringMechanism, Mechanism[CountStatistics]):
    """PEM over OLH: groups report growing prefixes; the server extends the best level by level."""

    name = "pem"
    spec_model = PemSpec
    provides: ClassVar[tuple[type, ...]] = (Discovery,)
    stateful: ClassVar[bool] = True  # a device's group is kept for life
    payload_schema = payload_shape(
        "PrefixPayload",
        "pem: the device's group, the seed hashing its group's prefix, and the bucket "
        "response over the hashed buckets.",
        group=INTEGER,
        seed=INTEGER,
        value=INTEGER,
    )

    def __init__(self, spec: PemSpec) -> None:
        super().__init__(spec)
        self.max_length: int = spec.max_length
        self.groups: int = spec.max_length
        self.start_bits: int = STEP_BITS
        self.step_bits: int = STEP_BITS
        self.buckets: int = min(
            round(math.exp(self.epsilon)) + 1, MAX_CELLS // (MIN_SEEDS * self.groups)
        )
        self.seeds: int = min(
            MAX_SEEDS, MAX_GROUP_SEEDS // self.groups, MAX_CELLS // (self.groups * self.buckets)
        )
        self.collision: float = float(collision_probability(self.buckets))

    @property
    def cells(self) -> int:
        """Length of the statistics: G S g counts."""
        return self.groups * self.seeds * self.buckets

    def prefix_bits(self, group: int) -> int:
        """Bits group j reports: s + j step."""
        return self.start_bits + group * self.step_bits

    @cached_property
    def keep_threshold(self) -> int:
        """T: the bucket response keeps H_s(prefix) with probability T / 2^53 (certified)."""
        return k_ary_keep_threshold(self.epsilon, self.buckets)

    @property
    def bucket_probabilities(self) -> tuple[float, float]:
        """Realized (p, o): P(y = H_s(prefix)) and P(y = each other bucket)."""
        return k_ary_probabilities(self.keep_threshold, self.buckets)

    @property
    def p(self) -> float:
        return self.bucket_probabilities[0]

    @property
    def q(self) -> float:
        """P(a report supports a prefix other than its own) = c p + (1 - c) o."""
        p, other = self.bucket_probabilities
        return self.collision * p + (1 - self.collision) * other

    # -- device side -------------------------------------------------------------------

    def encode(
        self, values: Sequence[str] | np.ndarray, rng: Rng = None, context: DeviceContext = FRESH
    ) -> np.ndarray:
        """Reports of ``values``: each device's group from ``context.memo`` (for life; no
        memo: drawn fresh), a fresh seed and a bucket response of its group's prefix."""
        distinct, codes = factorize_utf8(values, self.max_length)
        source = as_source(rng)
        memo = MemoizedMechanism.memo_for(codes, rng, context.memo)
        groups = memo.draws(GROUP_PURPOSE).integers(self.groups)
        seeds = source.integers(self.seeds, codes.size)
        padded = padded_matrix(distinct, self.max_length)
        pairs, inverse = np.unique(codes * self.groups + groups, return_inverse=True)
        pair_prints = self._pair_fingerprints(padded, *np.divmod(pairs, self.groups))
        hashed = hash_buckets(pair_prints[inverse.reshape(-1)], seeds, self.buckets)
        y = k_ary_response(hashed, self.buckets, self.keep_threshold, source)
        return np.stack([groups, seeds, y], axis=1)

    def _pair_fingerprints(
        self, padded: np.ndarray, rows: np.ndarray, groups: np.ndarray
    ) -> np.ndarray:
        """F of the prefix group ``groups[i]`` reports of padded value ``rows[i]``."""
        out = np.empty(rows.size, dtype=np.uint64)
        for group in np.unique(groups).tolist():
            chosen = groups == group
            out[chosen] = fingerprints(padded[rows[chosen], : group + 1])
        return out

    # -- reports and statistics --------------------------------------------------------

    def check_reports(self, reports: np.ndarray) -> np.ndarray:
        return check_integer_rows(
            reports,
            "PEM",
            ("group", "seed", "value"),
            [0, 0, 0],
            [self.groups - 1, self.seeds - 1, self.buckets - 1],
        )

    def empty_statistics(self) -> CountStatistics:
        return CountStatistics.empty(self.cells)

    def aggregate(self, reports: np.ndarray) -> CountStatistics:
        """Counts of reports per cell (j S + s) g + y; sparse when reports are few."""
        group, seed, y = self.check_reports(reports).T
        cells = (group * self.seeds + seed) * self.buckets + y
        if 8 * cells.size < self.cells:
            indices, counts = np.unique(cells, return_counts=True)
            return CountStatistics.sparse(cells.size, self.cells, indices, counts)
        return CountStatistics(cells.size, np.bincount(cells, minlength=self.cells))

    def simulate_statistics(
        self, strings: Sequence[str], counts: Sequence[int] | np.ndarray, rng: np.random.Generator
    ) -> CountStatistics:
        """The statistics of ``counts[i]`` users holding ``strings[i]``, each reporting once
        with a fresh group, drawn directly with the law of ``aggregate(encode(...))``.

        In ``k_ary_response``'s two-step form a report keeps H_s(prefix) with probability
        lam = T / 2^53 and is otherwise uniform over all g buckets, and its seed is
        uniform, so: users of a string split over the groups multinomially; K ~ Bin(m,
        lam) of a (string, group) pair's m users keep their hash; the others are uniform
        over the group's S g cells (one multinomial per group); a keeping user's cell is
        (j, s, H_s(prefix)) with s uniform, drawn one by one for pairs with fewer than S
        keepers and as a multinomial over the S seeds otherwise. Exact (group and seed
        shares are the doubles 1/G and 1/S); time O(d G S + G S g) at most for d distinct
        strings, whatever n is. Simulation only: it takes a seeded numpy Generator.
        """
        raw, totals = string_population(strings, counts, rng, self.max_length)
        groups, seeds, g = self.groups, self.seeds, self.buckets
        padded = padded_matrix(raw, self.max_length)
        per_group = rng.multinomial(totals, np.full(groups, 1.0 / groups))
        kept = rng.binomial(per_group, self.keep_threshold / BITS53)
        table = np.zeros((groups, seeds * g), dtype=np.int64)
        for group, uniform in enumerate((per_group - kept).sum(axis=0).tolist()):
            table[group] = _uniform_counts(uniform, seeds * g, rng)
        rows, pair_groups = np.nonzero(kept)
        keepers = kept[rows, pair_groups]
        prints = self._pair_fingerprints(padded, rows, pair_groups)
        many = keepers >= seeds
        if many.any():  # every seed's share of the pair's keepers at once
            per_seed = rng.multinomial(keepers[many], np.full(seeds, 1.0 / seeds))
            cells = np.arange(seeds) * g + hash_buckets(prints[many, None], np.arange(seeds), g)
            np.add.at(table, (pair_groups[many, None], cells), per_seed)
        few = ~many
        owner = np.repeat(np.flatnonzero(few), keepers[few])
        seed = rng.integers(seeds, size=owner.size)
        cells = seed * g + hash_buckets(prints[owner], seed, g)
        table += np.bincount(
            pair_groups[owner] * seeds * g + cells, minlength=groups * seeds * g
        ).reshape(groups, seeds * g)
        return CountStatistics(int(totals.sum()), table.reshape(-1))

    # -- estimation --------------------------------------------------------------------

    def _group_table(self, stats: CountStatistics, group: int) -> np.ndarray:
        """Group j's counts N_j[s, y], an (S, g) int64 array; ValueError if it has none."""
        if not isinstance(stats, CountStatistics) or stats.length != self.cells:
            raise ValueError(f"PEM statistics must be a CountStatistics of {self.cells} counts")
        if stats.n <= 0:
            raise ValueError("cannot estimate from zero reports")
        table = stats.counts.reshape(self.groups, self.seeds, self.buckets)[group]
        if not table.any():
            raise ValueError(
                f"group {group} has no reports yet; PEM needs reports in every group (each "
                f"device reports in one of {self.groups})"
            )
        return table

    def _level_frequencies(self, table: np.ndarray, prefixes: np.ndarray) -> np.ndarray:
        """f_v = (C_v / n_j - q) / (p - q) for each row v of ``prefixes`` (its group's length)."""
        support = _support(table, fingerprints(prefixes), 0, self.seeds)
        return self._frequencies(support, int(table.sum()))

    def _frequencies(self, support: np.ndarray, reports: int) -> np.ndarray:
        """(C / n - q) / (p - q): the estimates of supports C among ``reports`` reports."""
        p, q = self.p, self.q
        return (support / reports - q) / (p - q)

    def _screened_level(
        self, table: np.ndarray, prefixes: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """(candidates, their estimates from all seeds) of a level: every row of ``prefixes``
        when they are at most ``MAX_LEVEL_CANDIDATES``, else the ``MAX_LEVEL_CANDIDATES``
        with the largest estimates from the first S / ``SCREEN_SHARE`` seeds' reports
        (module docstring, "Work"); candidates as row indices into ``prefixes``."""
        prints = fingerprints(prefixes)
        everyone = np.arange(prints.size)
        screen = self.seeds // SCREEN_SHARE
        screened = int(table[:screen].sum())
        if prints.size <= MAX_LEVEL_CANDIDATES or screened == 0:
            support = _support(table, prints, 0, self.seeds)
            return everyone, self._frequencies(support, int(table.sum()))
        partial = _support(table, prints, 0, screen)
        chosen = np.argsort(-self._frequencies(partial, screened), kind="stable")
        chosen = chosen[:MAX_LEVEL_CANDIDATES]
        support = partial[chosen] + _support(table, prints[chosen], screen, self.seeds)
        return chosen, self._frequencies(support, int(table.sum()))

    def second_moment(self, table: np.ndarray) -> float:
        """F2 = sum_u f_u^2 over a group's prefixes, estimated from its same-seed pairs of
        reports (module docstring); 1, its largest value, when no seed has two reports."""
        n_group = int(table.sum())
        per_seed = table.sum(axis=1)
        pairs = float((per_seed * (per_seed - 1)).sum()) / 2
        if pairs == 0:
            return 1.0
        equal = float((table * (table - 1)).sum()) / 2
        p, other = self.bucket_probabilities
        c, lift = self.collision, (p - other) ** 2
        base = 2 * p * other + (self.buckets - 2) * other**2
        shared = (equal / pairs - base - lift * c) / (lift * (1 - c))
        return float(np.clip(shared * (n_group - 1) / n_group + 1 / n_group, 0.0, 1.0))

    def _std(self, frequencies: np.ndarray, table: np.ndarray, n: int) -> np.ndarray:
        """The three variance terms of the module docstring, at the estimates."""
        n_group = int(table.sum())
        p, q, c = self.p, self.q, self.collision
        f = np.clip(frequencies, 0.0, 1.0)
        oracle = (q * (1 - q) / (p - q) ** 2 + f * (1 - p - q) / (p - q)) / n_group
        outside = (n - n_group) / (n_group * (n - 1)) if n > 1 else 0.0
        sampling = f * (1 - f) * outside
        others = np.maximum(self.second_moment(table) - f**2, 0.0)
        collisions = c * others / ((1 - c) * self.seeds)
        return np.sqrt(oracle + sampling + collisions)

    def estimate(self, stats: CountStatistics, candidates: Sequence[str] | None = None) -> Estimate:
        """Unbiased frequencies of whole strings, from the last group, with their std."""
        raw = utf8_values(require_candidates(self.name, candidates), self.max_length)
        table = self._group_table(stats, self.groups - 1)
        frequencies = self._level_frequencies(table, padded_matrix(raw, self.max_length))
        return Estimate(frequencies, self._std(frequencies, table, stats.n), stats.n)

    def heavy_hitters(self, stats: CountStatistics, k: int) -> HeavyHitters:
        """The k strings with the largest estimates, found level by level (module docstring)."""
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_HEAVY_HITTERS:
            raise ValueError(f"k must be an integer in 1..{MAX_HEAVY_HITTERS}, got {k!r}")
        tables = [self._group_table(stats, group) for group in range(self.groups)]
        prefixes = np.zeros((1, 0), dtype=np.uint8)
        states = np.array([UTF8_START])
        frequencies = np.zeros(0)
        for group, table in enumerate(tables):
            parent, byte, states = utf8_extensions(states, group + 1, self.max_length)
            prefixes = np.concatenate([prefixes[parent], byte[:, None].astype(np.uint8)], axis=1)
            candidates, frequencies = self._screened_level(table, prefixes)
            keep = k if group == self.groups - 1 else 2 * k
            best = np.argsort(-frequencies, kind="stable")[:keep]
            order = candidates[best]
            prefixes, states, frequencies = prefixes[order], states[order], frequencies[best]
        strings = tuple(row.tobytes().rstrip(bytes([PAD])).decode("utf-8") for row in prefixes)
        std = self._std(frequencies, tables[-1], stats.n)
        return HeavyHitters(frequencies, std, stats.n, strings=strings)

    def variance(self, n: int) -> float:
        """G q (1 - q) / (n (p - q)^2): a string of frequency 0 estimated from the n / G
        reports of the last group, without the collision term (it depends on the data)."""
        return self.groups * self.q * (1 - self.q) / (n * (self.p - self.q) ** 2)

    # -- exact law, for the privacy tests ----------------------------------------------

    def report_probabilities(self, values: Sequence[str]) -> np.ndarray:
        """Exact P[(j, s, y) | value] as a (len(values), G S g) matrix, columns in cell
        order (j S + s) g + y: (1 / G) (1 / S) (p if y = H_s(prefix_j(value)) else o)."""
        require_enumerable(self.cells)
        padded = padded_matrix(utf8_values(values, self.max_length), self.max_length)
        p, other = self.bucket_probabilities
        scale = 1.0 / (self.groups * self.seeds)
        matrix = np.full((len(padded), self.groups, self.seeds, self.buckets), other * scale)
        rows = np.arange(len(padded))[:, None]
        seeds = np.arange(self.seeds)[None, :]
        for group in range(self.groups):
            hashed = hash_buckets(
                fingerprints(padded[:, : group + 1])[:, None], seeds, self.buckets
            )
            matrix[rows, group, seeds, hashed] = p * scale
        return matrix.reshape(len(padded), self.cells)

    def transition_matrix(self) -> np.ndarray:
        """``report_probabilities`` of every value, for max_length 1: the empty string and
        the 128 one-byte characters, in code point order."""
        if self.max_length != 1:
            raise ValueError(
                "transition_matrix enumerates every value only for max_length 1; use "
                "report_probabilities for chosen values"
            )
        return self.report_probabilities(["", *map(chr, range(128))])

    # -- wire form -----------------------------------------------------------------------

    def to_payloads(self, reports: np.ndarray) -> list[dict[str, Any]]:
        return [
            {"group": int(j), "seed": int(s), "value": int(y)}
            for j, s, y in self.check_reports(reports)
        ]

    def from_payloads(self, payloads: list[dict[str, Any]]) -> np.ndarray:
        columns = [check_integer_field(payloads, field) for field in ("group", "seed", "value")]
        return self.check_reports(np.stack(columns, axis=1).reshape(len(payloads), 3))
