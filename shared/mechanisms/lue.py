"""Longitudinal unary encodings: L-SUE, L-OUE and L-OSUE, for values reported again and again.

A value v in 0..d-1 is one-hot encoded as d bits and randomized twice (Arcolezi, Couchot,
Al Bouna and Xiao, "Improving the utility of locally differentially private protocols for
longitudinal and multidimensional frequency estimates", Digital Communications and
Networks, 2023; L-OSUE in Arcolezi et al., "Longitudinal collection and analysis of mobile
phone data with local differential privacy", 2021; the chain of RAPPOR, Erlingsson, Pihur
and Korolova, CCS 2014):

1. the *permanent* response, a unary encoding at ``epsilon`` (epsilon_infinity): bit v is
   1 with probability p1, every other bit with q1, memoized per (device, metric version,
   value), so any number of reports of one value reveal at most ``epsilon``
   (p1 (1 - q1) / (q1 (1 - p1)) = e^epsilon, ``permanent_matrix``);
2. a fresh *instantaneous* response per report: a permanent 1 is sent as 1 with
   probability p2, a permanent 0 with probability q2.

So a report's bit v is 1 with p* = p1 p2 + (1 - p1) q2 and every other bit with
q* = q1 p2 + (1 - q1) q2, independently; the bits of two inputs differ in law at two
places, so one report is epsilon_report-LDP exactly when

    p* (1 - q*) / (q* (1 - p*)) = e^epsilon_report.

The three mechanisms differ only in the permanent encoding and in the family (p2, q2)
is taken from, as in the papers (e = e^epsilon, r = e^epsilon_report):

* ``lsue`` (basic RAPPOR): SUE then SUE. p1 = e^(eps/2) / (e^(eps/2) + 1) = 1 - q1, and
  p2 + q2 = 1. Then p* + q* = 1, so a report is distributed as SUE at epsilon_report
  (p* = r^(1/2) / (r^(1/2) + 1)), and with a = e^(eps/2), b = r^(1/2):
  p2 = (a b - 1) / ((a - 1)(b + 1)).
* ``loue``: OUE then OUE. p1 = 1/2, q1 = 1 / (e + 1), p2 = 1/2, and q2 the root in
  [0, 1/2] of e (r - 1) y^2 + (e + 1 + r - 3 e r) y + (2 e + 1 - 3 r) = 0 in y = 2 q2:
  q2 = C / (-B + sqrt(B^2 - 4 A C)) with A = e (r - 1), B = e + 1 + r - 3 e r,
  C = 2 e + 1 - 3 r. It exists only while C >= 0, i.e. epsilon_report <=
  ln((2 e + 1) / 3) (at q2 = 0 a report reveals exactly that); beyond it the mechanism
  refuses the spec (``losue`` has no such limit).
* ``losue``: OUE then SUE. p1 = 1/2, q1 = 1 / (e + 1), p2 + q2 = 1, so p* = 1/2 and a
  report is distributed as OUE at epsilon_report (q* = 1 / (r + 1)):
  p2 = (e r - 1) / ((e - 1)(r + 1)).

Variance (the categorical estimator f_v = (C_v / n - q*) / (p* - q*) of
``shared.mechanisms.categorical``, with p* - q* = (p1 - q1)(p2 - q2) and
q* = q1 (p2 - q2) + q2 as in the papers): q* (1 - q*) / (n (p* - q*)^2) at f_v = 0. A
report of ``losue`` is one of OUE at epsilon_report, and OUE has the least variance of
every unary encoding at a given epsilon (Wang et al., USENIX Security 2017), so
``losue`` has the least variance of the three for every (epsilon, epsilon_report):
4 r / (n (r - 1)^2), the one-shot optimum, while the memoized response still bounds the
lifetime at epsilon per value. ``lsue`` has SUE's r^(1/2) / (n (r^(1/2) - 1)^2); ``loue``
is worse than ``losue`` (e.g. epsilon 2, epsilon_report 1: 4.47 / n against 3.68 / n,
``lsue`` 3.92 / n).

Realized probabilities. Every coin is a uniform integer compared with an integer
threshold. The permanent thresholds (T_p1, T_q1) are those of ``sue`` or ``oue`` at
epsilon (``UnaryEncoding.thresholds``: certified p1 (1 - q1) / (q1 (1 - p1)) <=
e^epsilon). The instantaneous ones lie on the family's line, with N = 2^53:
(T_p2, T_q2) = (N/2 + k, N/2 - k) (p2 + q2 = 1) or (N/2, N/2 - k) (p2 = 1/2), along
which the composite ratio grows with k; k is the largest integer whose exact composite
ratio (a ``Fraction`` of the four thresholds) is proven at most e^epsilon_report
(``shared.randomness.ratio_within_epsilon``), found by bisection, so one report's realized
ratio is at most e^epsilon_report and one threshold step short of it. ``p`` and ``q``
are the realized p* = (T_p1 T_p2 + (N - T_p1) T_q2) / N^2 and q* likewise: the
estimator, ``transition_matrix`` and ``simulate_statistics`` use them.

Sampling: bit-sliced comparisons. Each of a row's d bits is [U < T] for its own uniform
U and its lane's threshold T. The U's are built most significant bit first from G =
ceil(d / 64) words per round: round j gives bit (B - 1 - j) of every U (B the threshold
width), namely bit i of the round's G words written as 8 G little-endian bytes and read
most significant bit first (``numpy.unpackbits`` order: bit 7 - i % 8 of byte i // 8).
A bit is decided at the first round where its U and T differ, so a row stops drawing
once all its bits are decided: about G (log2(d) + 1.3) words instead of one word per
bit (for d = 1024, about 190 words instead of 1024).

Memo draws (what a client in another language reproduces): the permanent bits of value
v are drawn from ``memo.draws(purpose, keys=[v])`` (``shared.memo``: the stream of
(device secret, metric scope, purpose, key = v)) with purpose ``b"lsue prr"``,
``b"loue prr"`` or ``b"losue prr"`` (the mechanism's name and " prr", ASCII): round j
(j = 0 .. 52) reads words j G .. j G + G - 1 of that stream, which give bit 52 - j of
every U_i as above; bit v is [U_v < T_p1] and every other bit i is [U_i < T_q1]. A
client may read all 53 G words and compare whole U's: the result is the same. The
instantaneous response is fresh from ``rng`` every report (never memoized): bit i is
[U_i < T_p2] if permanent bit i is 1, else [U_i < T_q2].

``memo=None`` (a fresh permanent response per report, as a stateless implementation):
the permanent response is never observed on its own, so a report is drawn in one
bit-sliced pass with the composite thresholds T_p* = T_p1 T_p2 + (N - T_p1) T_q2 and
T_q* over N^2 (106-bit U's): exactly the law of the two-step chain, in one pass
instead of two.

Rows are encoded in chunks of at most ``CHUNK_WORDS`` words each, so memory stays
bounded whatever the batch. Reports, payloads (``{"bits": base64}``, ``np.packbits``
layout), bit-sum statistics and the estimator are those of ``UnaryEncoding``.

Refusal rule ``"<name>.ones_count"`` (``shared.integrity``). A device's reports share its
permanent response B, so the rule must hold for every B, not only on average. Given B with
m ones, a report's count of ones is Binomial(m, p2) + Binomial(d - m, q2) whatever the
input; p2 > q2, so it grows stochastically with m, from Binomial(d, q2) (B all zeros) to
Binomial(d, p2) (B all ones), and both ends are permanent responses of positive
probability (memo=None draws lie between them too: q2 <= q* and p* <= p2). The rule
refuses more than U ones, U the least count with P(Binomial(d, p2) > U) <= 2^-41, or fewer
than L, L the largest with P(Binomial(d, q2) < L) <= 2^-41 (each side exact at its worst
state; ``false_refusal`` is their sum, at least the largest probability over states of
breaking either side). E.g. ``losue`` at epsilon 2, epsilon_report 1, d = 1024: U = 908,
L = 116, false refusal 6.1e-13. It catches forged vectors with most bits set, not the
maximal gain attack's (which pads to the honest mean count).

No profile (``Profiled``): one report's count is Bernoulli(p*) + Binomial(d - 1, q*) only
averaged over the permanent response; a window holds several reports per device with one
B, so its counts are not independent draws of that law and a chi-square test would fire
on honest windows.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from fractions import Fraction
from functools import cached_property
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import model_validator

from shared.mechanisms.abilities import FRESH, DeviceContext
from shared.mechanisms.base import as_index_array
from shared.mechanisms.memoized import ChainedSpec, MemoizedMechanism
from shared.mechanisms.registry import register
from shared.mechanisms.spec import CategoricalSpec
from shared.mechanisms.unary import (
    BinomialSum,
    OptimizedUnaryEncoding,
    SymmetricUnaryEncoding,
    UnaryEncoding,
)
from shared.memo import Memo, MemoDraws
from shared.randomness import (
    BITS53,
    RandomSource,
    Rng,
    as_source,
    ratio_within_epsilon,
    realized_probability,
)

__all__ = [
    "CHUNK_WORDS",
    "LongitudinalOSUE",
    "LongitudinalOUE",
    "LongitudinalSUE",
    "LongitudinalUnaryEncoding",
    "chained_ratio",
]

#: Words (64 bit lanes each) of one chunk of rows: bounds the working memory of ``encode``
#: at a few such arrays (512 KiB each), whatever the batch size.
CHUNK_WORDS = 1 << 16
#: Bits of a single threshold (T / 2^53); composite thresholds have twice as many.
_WIDTH = 53
_HALF = BITS53 // 2
_LANES = 64
_WORD = np.dtype("<u8")

#: Words for a set of rows: ``draw(rows)`` is (len(rows), G) uint64, G words per row.
RowWords = Callable[[np.ndarray], np.ndarray]


def chained_ratio(permanent: tuple[int, int], instantaneous: tuple[int, int]) -> Fraction:
    """Exact p* (1 - q*) / (q* (1 - p*)) of a permanent (T_p1, T_q1) and an instantaneous
    (T_p2, T_q2) response, all over 2^53: p* = (T_p1 T_p2 + (2^53 - T_p1) T_q2) / 2^106,
    q* = (T_q1 T_p2 + (2^53 - T_q1) T_q2) / 2^106."""
    p_star, q_star = _composite(permanent, instantaneous)
    scale = BITS53 * BITS53
    return Fraction(p_star * (scale - q_star), q_star * (scale - p_star))


def _composite(permanent: tuple[int, int], instantaneous: tuple[int, int]) -> tuple[int, int]:
    """(T_p*, T_q*) over 2^106: the composite thresholds of a permanent and an instantaneous
    response (see ``chained_ratio``)."""
    (p1, q1), (p2, q2) = permanent, instantaneous
    return p1 * p2 + (BITS53 - p1) * q2, q1 * p2 + (BITS53 - q1) * q2


def _lane_masks(values: np.ndarray, groups: int) -> np.ndarray:
    """(rows, G) words with only bit ``values[i]`` set in row i, in the lane layout of
    packed rows viewed as little-endian words (bit v: bit 7 - v % 8 of byte v // 8)."""
    masks = np.zeros((values.size, groups), dtype=_WORD)
    within = values & (_LANES - 1)
    shifts = (8 * (within >> 3) + 7 - (within & 7)).astype(np.uint64)
    masks[np.arange(values.size), values >> 6] = np.uint64(1) << shifts
    return masks


def _sliced_bernoulli(
    chosen: np.ndarray,
    thresholds: tuple[int, int],
    width: int,
    draw: RowWords,
    live: np.ndarray,
) -> np.ndarray:
    """Bits [U < T] for independent uniform ``width``-bit U's, compared bit-sliced.

    ``chosen`` (rows, G) marks the lanes that use ``thresholds[0]``; the other lanes of
    ``live`` (G,) use ``thresholds[1]``, and lanes outside ``live`` stay 0. Round j draws
    one word per group (``draw``) whose bit b is bit (width - 1 - j) of lane b's U; a lane
    is decided at its first round where U's bit differs from T's (1 if T's is the 1), a
    lane that never differs has U = T (0), and a row stops drawing once it is decided.
    P(bit = 1) = T / 2^width exactly.
    """
    rows, groups = chosen.shape
    result = np.zeros((rows, groups), dtype=_WORD)
    ones = np.zeros_like(result)  # the 1s decided so far, of the pending rows
    undecided = np.repeat(live[None, :], rows, axis=0)
    unchosen = ~chosen
    pending = np.arange(rows)
    scratch = np.empty_like(result)
    # Rows of 64 G lanes are rarely decided in fewer rounds than log2(64 G) (after r rounds
    # a row still draws with probability 1 - (1 - 2^-r)^(64 G)): until then no row is
    # checked or dropped.
    dense_rounds = (_LANES * groups).bit_length()
    first, second = thresholds
    for round_index in range(width):
        position = width - 1 - round_index
        bits = ((first >> position) & 1, (second >> position) & 1)
        words = draw(pending)
        if bits == (0, 0):  # where U's bit is 1, U > T: those lanes are decided 0
            np.bitwise_and(undecided, words, out=scratch)
            undecided ^= scratch
        elif bits == (1, 1):  # where U's bit is 0, U < T: those lanes are decided 1
            np.bitwise_and(undecided, words, out=scratch)
            undecided ^= scratch
            ones |= undecided
            undecided, scratch = scratch, undecided
        else:  # T's bit is 1 on the ``chosen`` lanes (or on the others): U's bit differs
            plane = chosen if bits == (1, 0) else unchosen
            np.bitwise_xor(words, plane, out=scratch)
            scratch &= undecided  # the lanes decided now: 1 where T's bit is the 1
            undecided ^= scratch
            scratch &= plane
            ones |= scratch
        if round_index + 1 >= dense_rounds:
            open_rows = undecided.any(axis=1)
            if not open_rows.all():
                done = ~open_rows
                result[pending[done]] = ones[done]
                pending, ones, undecided = pending[open_rows], ones[open_rows], undecided[open_rows]
                chosen, unchosen = chosen[open_rows], unchosen[open_rows]
                scratch = scratch[: pending.size]
                if not pending.size:
                    return result
    result[pending] = ones
    return result


class LongitudinalUnaryEncoding(MemoizedMechanism, UnaryEncoding):
    """A memoized unary encoding at epsilon chained with a fresh one (module docstring).

    Subclasses set the permanent encoding (``sue`` or ``oue``) and whether the
    instantaneous response is symmetric (p2 + q2 = 1) or optimized (p2 = 1/2).
    ``thresholds`` (inherited) are the permanent (T_p1, T_q1); ``p`` and ``q`` are one
    report's realized p* and q*.
    """

    spec: ChainedSpec
    permanent_class: ClassVar[type[UnaryEncoding]]
    symmetric_instantaneous: ClassVar[bool]

    def __init__(self, spec: ChainedSpec) -> None:
        super().__init__(spec)
        self.instantaneous_thresholds  # noqa: B018 - an infeasible epsilon_report fails here

    @property
    def purpose(self) -> bytes:
        """The memo purpose of the permanent bits: the name and " prr" in ASCII."""
        return self.name.encode("ascii") + b" prr"

    @cached_property
    def permanent_encoding(self) -> UnaryEncoding:
        """The permanent response on its own: ``sue`` or ``oue`` at epsilon."""
        spec = self.permanent_class.spec_model.model_validate(
            {
                "mechanism": self.permanent_class.name,
                "epsilon": self.epsilon,
                "domain_size": self.domain_size,
            }
        )
        assert isinstance(spec, CategoricalSpec)
        return self.permanent_class(spec)

    def nominal_probabilities(self) -> tuple[float, float]:
        """The permanent encoding's (p1, q1), from which ``thresholds`` are certified."""
        return self.permanent_encoding.nominal_probabilities()

    @cached_property
    def instantaneous_thresholds(self) -> tuple[int, int]:
        """(T_p2, T_q2) on the family's line at the largest k whose exact composite ratio is
        at most e^epsilon_report (module docstring); ValueError if even the end of the line
        (q2 = 0) keeps one report below epsilon_report."""
        end = chained_ratio(self.thresholds, self._instantaneous_at(_HALF))
        if ratio_within_epsilon(end, self.epsilon_report):
            raise ValueError(
                f"epsilon_report = {self.epsilon_report} is more than one {self.name!r} report "
                f"can reveal at epsilon = {self.epsilon}: at most {math.log(end):.9g}; lower "
                "epsilon_report or use 'losue'"
            )
        low, high = 0, _HALF  # within at k = 0 (p2 = q2: ratio 1), not within at k = N / 2
        while high - low > 1:
            middle = (low + high) // 2
            ratio = chained_ratio(self.thresholds, self._instantaneous_at(middle))
            if ratio_within_epsilon(ratio, self.epsilon_report):
                low = middle
            else:
                high = middle
        return self._instantaneous_at(low)

    def ones_count_laws(self) -> tuple[BinomialSum, BinomialSum]:
        """(Binomial(d, p2), Binomial(d, q2)): the counts of ones when every permanent bit is
        1, and when none is (module docstring)."""
        p2, q2 = (realized_probability(t) for t in self.instantaneous_thresholds)
        return ((self.domain_size, p2),), ((self.domain_size, q2),)

    def _instantaneous_at(self, k: int) -> tuple[int, int]:
        """(T_p2, T_q2) at step k of the family: (N/2 + k, N/2 - k) or (N/2, N/2 - k)."""
        return (_HALF + k if self.symmetric_instantaneous else _HALF), _HALF - k

    @cached_property
    def composite_thresholds(self) -> tuple[int, int]:
        """(T_p*, T_q*): one report's bit v is 1 with T_p* / 2^106, other bits T_q* / 2^106."""
        return _composite(self.thresholds, self.instantaneous_thresholds)

    @cached_property
    def p(self) -> float:
        """Realized p* = p1 p2 + (1 - p1) q2 (correctly rounded)."""
        return float(Fraction(self.composite_thresholds[0], BITS53 * BITS53))

    @cached_property
    def q(self) -> float:
        """Realized q* = q1 p2 + (1 - q1) q2 (correctly rounded)."""
        return float(Fraction(self.composite_thresholds[1], BITS53 * BITS53))

    @property
    def groups(self) -> int:
        """G = ceil(d / 64): words per row in each round of a bit-sliced comparison."""
        return -(-self.domain_size // _LANES)

    @cached_property
    def _live(self) -> np.ndarray:
        """(G,) words with the d real lanes set (padding lanes clear)."""
        packed = np.zeros(8 * self.groups, dtype=np.uint8)
        packed[: self.row_bytes] = np.packbits(np.ones(self.domain_size, dtype=bool))
        return packed.view(_WORD)

    def memo_keys(self, values: np.ndarray, memo: Memo | None = None) -> np.ndarray:
        """The value itself: the permanent response is memoized per category."""
        return as_index_array(values, self.domain_size)

    def permanent_matrix(self) -> np.ndarray:
        """Exact P[permanent response | value]: ``sue``'s or ``oue``'s matrix at epsilon."""
        return self.permanent_encoding.transition_matrix()

    def permanent(self, values: np.ndarray, memo: Memo | None = None) -> np.ndarray:
        """Packed permanent bits (rows of ``row_bytes``), from ``memo`` (None: fresh from the
        OS CSPRNG)."""
        values = as_index_array(values, self.domain_size)
        draws = self.memo_for(values, None, memo).draws(self.purpose, values)
        return self._by_chunks(values, lambda rows: self._permanent_words(values, rows, draws))

    def encode(self, values: Any, rng: Rng = None, context: DeviceContext = FRESH) -> np.ndarray:
        """Reports of ``values``: permanent bits from ``context.memo`` (row i is value i's
        device), instantaneous bits fresh from ``rng``; no memo draws both fresh, in one
        pass with the composite thresholds (module docstring)."""
        values = as_index_array(values, self.domain_size)
        source = as_source(rng)
        memo = context.memo
        if memo is None:
            return self._by_chunks(values, lambda rows: self._fresh_words(values, rows, source))
        draws = self.memo_for(values, rng, memo).draws(self.purpose, values)

        def chained(rows: np.ndarray) -> np.ndarray:
            permanent = self._permanent_words(values, rows, draws)
            return _sliced_bernoulli(
                permanent,
                self.instantaneous_thresholds,
                _WIDTH,
                self._source_draw(source),
                self._live,
            )

        return self._by_chunks(values, chained)

    def _by_chunks(self, values: np.ndarray, rows_to_words: RowWords) -> np.ndarray:
        """Packed rows of ``rows_to_words(rows)`` (the rows' bits as words), chunk by chunk."""
        out = np.empty((values.size, self.row_bytes), dtype=np.uint8)
        step = max(1, CHUNK_WORDS // self.groups)
        for start in range(0, values.size, step):
            stop = min(start + step, values.size)
            words = rows_to_words(np.arange(start, stop))
            out[start:stop] = words.view(np.uint8)[:, : self.row_bytes]
        return out

    def _permanent_words(
        self, values: np.ndarray, rows: np.ndarray, draws: MemoDraws
    ) -> np.ndarray:
        """The permanent bits of ``rows`` as words, each row reading its own memo stream."""
        return _sliced_bernoulli(
            _lane_masks(values[rows], self.groups),
            self.thresholds,
            _WIDTH,
            lambda pending: draws.words(self.groups, rows[pending]),
            self._live,
        )

    def _fresh_words(
        self, values: np.ndarray, rows: np.ndarray, source: RandomSource
    ) -> np.ndarray:
        """Reports of ``rows`` in one pass at the composite (106-bit) thresholds."""
        return _sliced_bernoulli(
            _lane_masks(values[rows], self.groups),
            self.composite_thresholds,
            2 * _WIDTH,
            self._source_draw(source),
            self._live,
        )

    def _source_draw(self, source: RandomSource) -> RowWords:
        """Fresh words, G per pending row."""
        return lambda pending: source.words(pending.size * self.groups).reshape(-1, self.groups)


class LsueSpec(ChainedSpec):
    """``{"mechanism": "lsue", "epsilon": 2.0, "epsilon_report": 1.0, "domain_size": 64}``."""

    mechanism: Literal["lsue"]


@register
class LongitudinalSUE(LongitudinalUnaryEncoding):
    """L-SUE (basic RAPPOR): SUE at epsilon, then SUE; a report is SUE at epsilon_report."""

    name = "lsue"
    spec_model = LsueSpec
    permanent_class = SymmetricUnaryEncoding
    symmetric_instantaneous = True


class LoueSpec(ChainedSpec):
    """``{"mechanism": "loue", "epsilon": 2.0, "epsilon_report": 1.0, "domain_size": 64}``:
    an OUE instantaneous response reveals at most ln((2 e^epsilon + 1) / 3)."""

    mechanism: Literal["loue"]

    @model_validator(mode="after")
    def _report_fits_oue(self) -> LoueSpec:
        limit = math.log((2 * math.exp(self.epsilon) + 1) / 3)
        assert self.epsilon_report is not None  # required by ChainedSpec
        if self.epsilon_report > limit:
            raise ValueError(
                f"epsilon_report = {self.epsilon_report} is more than one 'loue' report "
                f"can reveal at epsilon = {self.epsilon} (at most ln((2 e^epsilon + 1) "
                f"/ 3) = {limit:.6g}); lower epsilon_report or use 'losue'"
            )
        return self


@register
class LongitudinalOUE(LongitudinalUnaryEncoding):
    """L-OUE: OUE at epsilon, then OUE (p2 = 1/2); needs epsilon_report <= ln((2e^eps+1)/3)."""

    name = "loue"
    spec_model = LoueSpec
    permanent_class = OptimizedUnaryEncoding
    symmetric_instantaneous = False


class LosueSpec(ChainedSpec):
    """``{"mechanism": "losue", "epsilon": 2.0, "epsilon_report": 1.0, "domain_size": 64}``."""

    mechanism: Literal["losue"]


@register
class LongitudinalOSUE(LongitudinalUnaryEncoding):
    """L-OSUE: OUE at epsilon, then SUE; a report is OUE at epsilon_report (least variance)."""

    name = "losue"
    spec_model = LosueSpec
    permanent_class = OptimizedUnaryEncoding
    symmetric_instantaneous = True
