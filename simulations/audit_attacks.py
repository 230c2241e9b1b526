"""Distinguishing tests for every registered mechanism: two inputs and an event per view.

An ``Attack`` names two inputs v0, v1 (as a device records them), the event S that one
trial's outputs may fall in, and ``probabilities`` = (P[S | v0], P[S | v1]), the exact law
of S by the mechanism's own parameters (its realized thresholds, hash family, window).
S is the set of outputs whose likelihood ratio P(o | v0) / P(o | v1) is the mechanism's
largest, so ``event_epsilon`` = ln(P[S | v0] / P[S | v1]) is what the event shows with
unlimited trials, and for the report views it is the declared epsilon itself (up to the
realized thresholds, which never exceed it). An attack is *tight* when its event can
show at least ``TIGHT_SHARE`` (90%) of the declared epsilon: enough trials then bring the
bound within 10% of the promise, and how many is ``simulations.audit_bounds.
planned_trials``'s answer from the two probabilities. No event is fitted to the trials it
is counted on.

Views. ``report``: a trial is one report of a fresh device, against what one report
promises (``epsilon``; memoized mechanisms ``epsilon_report``; RAPPOR epsilon_one).
``lifetime`` (memoized mechanisms and RAPPOR): a trial is R reports of one device holding
one value, decoded into the permanent response they share (a count over the R reports
against the midpoint of the instantaneous response's two rates), against the lifetime
epsilon (``epsilon``; RAPPOR epsilon_infinity). Decoding is post-processing of the R
reports, so the bound is valid at any R. Its ``probabilities`` are the exact law of the
decoded event: the permanent response's law mixed with the binomial chance that R reports
decode each permanent bit right; as R grows they tend to the permanent response's, whose
event ratio is the lifetime epsilon. A device that drew its permanent response afresh for
every report (no memo) shows the lifetime bound exceeded: its R reports average the
noise away.

The events, for v0 = category 0, v1 = category 1; numbers: the range's ends; strings:
two short strings the mechanism hashes apart (p, q realized; tight: yes throughout):

* ``grr``, ``lgrr``: the report is v0. P = p, q.
* ``sue``, ``oue``, ``lsue``, ``loue``, ``losue``: bit v0 set and bit v1 clear.
  P = p (1 - q), q (1 - p).
* ``olh``: H(v0) != H(v1) and y = H(v0). P = (1 - c) p, (1 - c) o; c the hash family's
  collision probability, o the chance of each other bucket.
* ``hr``: y in S_v0 and not in S_v1. P = p / 2, (1 - p) / 2.
* ``dbitflip``: one bucket per device, (v0 sampled with bit 1) or (v1 sampled with bit
  0): P = 2 p / d, 2 q / d; s >= 2 buckets, both sampled with bits 1 and 0: P = r p^2,
  r q^2 with r = s (s - 1) / (d (d - 1)), small for large d.
* ``laplace``, lower against upper: the report is <= 0. P = 1 / (1 + a), a^K / (1 + a),
  a = e^(-eps / K), K the grid steps.
* ``duchi``, ``onebitmean``, upper against lower: the sign +1 (the bit 1). P = p', q'.
* ``piecewise``, lower against upper: a cell of the lower end's window. P = p_in,
  (1 - p_in) w / K, w the window.
* ``hh``, lower against upper (buckets 0 and D - 1, whose tree nodes differ at every
  level: node 0 against node B^l - 1): at the report's level l, that level's oracle event
  (GRR: the report is node 0; OLH: H(0) != H(B^l - 1) and y = H(0)). A level is drawn
  with probability 1/h whatever the value, so P = the mean over the h levels of the
  oracle's two probabilities (p, q; or (1 - c) p, (1 - c) o), whose ratio is the declared
  e^eps when every level's is.
* ``sw``, lower against upper (buckets 0 and D - 1, windows [0, w) and [D - 1, D + w - 1)
  of the M = D + w - 1 cells): the cell is below min(w, D - 1), in the first window and
  not in the last. P = min(w, D - 1) H, min(w, D - 1) L, H / L = e^eps (realized).
* ``rappor``: in cohorts where the two strings' Bloom bits differ most (disjoint h bits
  each when k >= 2h), v0's bits all 1 and v1's all 0. P = (q* (1 - p*))^h,
  (p* (1 - q*))^h, times the share of such cohorts; tight when k >= 2h.
* ``cms``, ``sfp``: the report's row (``sfp``: and slot) puts v0 and v1 in columns
  c0 != c1, bit c0 set and bit c1 clear. P = r p^2, r q^2, r the share of such rows.
* ``hcms``: c0 != c1, the Hadamard signs of c0 and c1 at the reported coefficient differ,
  and the bit is v0's sign. P = r p / 2, r q / 2.
* ``pem``: H_s(prefix_j(v0)) != H_s(prefix_j(v1)) and y = H_s(prefix_j(v0)). P = (1 - c) p,
  (1 - c) o, c the exact share of (group, seed) pairs that hash the two together.
* ``spl``, ``smp``, ``rsfd`` (several attributes; ``shared.mechanisms.multidim``): records
  that differ in every attribute, x0 = category 0 and x1 = category 1 of every categorical
  attribute (a pair's cells 0 and d2 + 1), a number at the end its view's event favours
  (``duchi``: x0 the upper end; ``piecewise``: x0 the lower end). Each view v has its own
  event E_v on its bytes, with P_v = (P[E_v | x0], P[E_v | x1]) and F_v its chance under a
  fake report (``rsfd``): GRR the value is x0's, P = p, q, F = 1 / D; OUE bit x0 set and bit
  x1 clear, P = p (1 - q), q (1 - p), F = q (1 - q); ``duchi`` the sign +1, P = the two ends'
  realized probabilities, F their mean (a fake is an end drawn uniformly); ``piecewise`` a
  cell below w, P = H w, L w, F = the mean over the grid indices i of
  H min(w, w - i)^+ + L (w - min(w, w - i)^+). ``spl``: every view's event, P = prod_v P_v
  (the views are independent; the ratio prod_v e^(eps / k) = e^eps). ``smp``: the view
  index v and E_v, P = mean_v P_v (ratio e^eps). ``rsfd``: every view's event, P =
  (1 / k) sum_s P_s prod_(v != s) F_v (the sampled view s is hidden); its ratio is e^eps
  (each term's is), the bound that an inner epsilon above eps (the paper's amplified
  ln(k (e^eps - 1) + 1)) breaks.

Tightness, from the math (the event attains the worst-case ratio, with a probability
that does not vanish as epsilon grows):

====================================  ================================  ====================
mechanisms                            report view                       lifetime view
====================================  ================================  ====================
grr, sue, oue, olh, hr, laplace,      tight                             (one-shot)
duchi, piecewise, cms, hcms, pem,
sfp, hh, sw, spl, smp, rsfd
lgrr, lsue, loue, losue, onebitmean   tight                             tight as R grows
dbitflip                              tight; P[S] ~ (s / d)^2, s >= 2    tight (R equal reports)
rappor                                tight if k >= 2h; P[S] ~ p0^h     tight as R grows
====================================  ================================  ====================

``auto`` is audited as the mechanism it resolves to. Lifetime decoding: ``lgrr`` counts
v0 in the R reports; the unary ones count bits v0 and v1; ``onebitmean`` counts ones;
``dbitflip`` (no instantaneous response: every report is the permanent one) takes the
majority of the R reports' events; RAPPOR counts every Bloom bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from scipy import stats

from shared.hashing import SketchHash
from shared.mechanisms import multidim
from shared.mechanisms.dbitflip import DBitFlip
from shared.mechanisms.duchi import DuchiMean
from shared.mechanisms.grr import GeneralizedRandomizedResponse
from shared.mechanisms.hh import HierarchicalHistogram
from shared.mechanisms.hr import HadamardResponse
from shared.mechanisms.laplace import DiscreteLaplace
from shared.mechanisms.lgrr import LongitudinalGRR
from shared.mechanisms.lhh import LongitudinalHierarchicalHistogram
from shared.mechanisms.lue import LongitudinalUnaryEncoding
from shared.mechanisms.multidim import MultiAttributeMechanism
from shared.mechanisms.olh import OptimizedLocalHashing
from shared.mechanisms.onebitmean import OneBitMean
from shared.mechanisms.pem import PrefixExtendingMethod, fingerprints, hash_buckets
from shared.mechanisms.piecewise import PiecewiseMechanism
from shared.mechanisms.rappor import Rappor
from shared.mechanisms.sfp import SequenceFragmentPuzzle, fragment_fingerprints
from shared.mechanisms.sketch import CountMeanSketch, HadamardCountMeanSketch
from shared.mechanisms.strings import padded_matrix, utf8_values
from shared.mechanisms.sw import SquareWave
from shared.mechanisms.unary import UnaryEncoding
from shared.randomness import BITS53, realized_probability
from simulations.text import counted

__all__ = ["DEFAULT_LIFETIME_REPORTS", "Attack", "View", "attacks_for"]

View = Literal["report", "lifetime"]
#: Reports of one device decoded into its permanent response (lifetime view).
DEFAULT_LIFETIME_REPORTS = 32
#: An attack is tight when its event can show at least this share of the declared epsilon.
TIGHT_SHARE = 0.9
#: Candidate strings searched for a pair the string mechanisms hash apart.
STRING_CANDIDATES = 64

#: Maps a batch of trials' reports to one boolean per trial.
ReportEvent = Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True)
class Attack:
    """Two inputs and an event on one trial's outputs (module docstring)."""

    view: View
    declared: float
    inputs: tuple[Any, Any]
    event: ReportEvent
    probabilities: tuple[float, float]
    description: str
    reports_per_trial: int = 1

    @property
    def event_epsilon(self) -> float:
        """ln(P[S | v0] / P[S | v1]): what the event shows with unlimited trials."""
        p0, p1 = self.probabilities
        return math.log(p0 / p1) if p1 > 0 else math.inf

    @property
    def tight(self) -> bool:
        """The event can show at least ``TIGHT_SHARE`` of the declared epsilon: enough trials
        bring the bound within 10% of the promise (module docstring)."""
        return self.event_epsilon >= TIGHT_SHARE * self.declared


#: Builds a mechanism's attacks, given the reports the lifetime view decodes.
Builder = Callable[[Any, int], list[Attack]]
_BUILDERS: dict[type, Builder] = {}


def _builds(cls: type) -> Callable[[Builder], Builder]:
    """Register the decorated builder for ``cls`` and its subclasses."""

    def register(builder: Builder) -> Builder:
        _BUILDERS[cls] = builder
        return builder

    return register


def attacks_for(mechanism: Any, lifetime_reports: int = DEFAULT_LIFETIME_REPORTS) -> list[Attack]:
    """The attacks on ``mechanism`` (its report view, and its lifetime view if it memoizes),
    chosen by the nearest registered class in its method resolution order, so that a
    subclass (a variant, or a deliberately broken one) is audited as its family."""
    if lifetime_reports < 1:
        raise ValueError(f"lifetime_reports must be >= 1, got {lifetime_reports}")
    for cls in type(mechanism).__mro__:
        builder = _BUILDERS.get(cls)
        if builder is not None:
            return builder(mechanism, lifetime_reports)
    raise ValueError(f"no distinguishing test is defined for {type(mechanism).__name__}")


def _per_device(reports: np.ndarray, count: int) -> np.ndarray:
    """Reports in device-major order, grouped as (devices, count, ...)."""
    return reports.reshape(-1, count, *reports.shape[1:])


def _majority(event: ReportEvent, count: int) -> ReportEvent:
    """The event on a device's ``count`` reports: more than half of them in ``event``."""
    return lambda reports: _per_device(event(reports), count).sum(axis=1) * 2 > count


def _midpoint(rates: tuple[float, float], count: int) -> float:
    """The count of ``count`` reports halfway between the two rates of an instantaneous
    response (a report's rate given the permanent bit 1, and given 0)."""
    return count * (rates[0] + rates[1]) / 2


def _above(cut: float, count: int, rates: tuple[float, float]) -> tuple[float, float]:
    """P(Binomial(count, rate) > cut) for each of the two rates: how often a device's count
    decodes to 1 when its permanent bit is 1 (first rate) and when it is 0 (second)."""
    high, low = stats.binom.sf(math.floor(cut), count, rates)
    return float(high), float(low)


def _mixed(share_one: float, decoded: tuple[float, float]) -> float:
    """P(decoded 1) for a permanent bit that is 1 with probability ``share_one``."""
    return share_one * decoded[0] + (1 - share_one) * decoded[1]


# --- categories ---------------------------------------------------------------------------


def _report_is(value: int) -> ReportEvent:
    return lambda reports: np.asarray(reports) == value


@_builds(GeneralizedRandomizedResponse)
def _grr(mech: GeneralizedRandomizedResponse, reports: int) -> list[Attack]:
    return [Attack("report", mech.epsilon, (0, 1), _report_is(0), (mech.p, mech.q), "report = 0")]


@_builds(LongitudinalGRR)
def _lgrr(mech: LongitudinalGRR, reports: int) -> list[Attack]:
    rates = mech.instantaneous_probabilities
    cut = _midpoint(rates, reports)
    decoded = _above(cut, reports, rates)
    kept, moved = mech.permanent_probabilities

    def event(batch: np.ndarray) -> np.ndarray:
        return (_per_device(np.asarray(batch), reports) == 0).sum(axis=1) > cut

    return [
        Attack(
            "report", mech.epsilon_report, (0, 1), _report_is(0), (mech.p, mech.q),
            "report = 0",
        ),
        Attack(
            "lifetime", mech.epsilon_lifetime, (0, 1), event,
            (_mixed(kept, decoded), _mixed(moved, decoded)),
            f"more than {cut:.3g} of {counted(reports, 'report')} = 0", reports,
        ),
    ]  # fmt: skip


def _packed_bit(rows: np.ndarray, index: int) -> np.ndarray:
    """Bit ``index`` of packed rows (``np.packbits`` big bit order), over the last axis."""
    return (rows[..., index >> 3] >> (7 - (index & 7))) & 1


def _unary_event(batch: np.ndarray) -> np.ndarray:
    return (_packed_bit(batch, 0) == 1) & (_packed_bit(batch, 1) == 0)


@_builds(UnaryEncoding)
def _unary(mech: UnaryEncoding, reports: int) -> list[Attack]:
    p, q = mech.p, mech.q
    return [
        Attack(
            "report", mech.epsilon, (0, 1), _unary_event, (p * (1 - q), q * (1 - p)),
            "bit 0 set, bit 1 clear",
        )
    ]  # fmt: skip


@_builds(LongitudinalUnaryEncoding)
def _unary_memoized(mech: LongitudinalUnaryEncoding, reports: int) -> list[Attack]:
    p, q = mech.p, mech.q
    high, low = (realized_probability(t) for t in mech.instantaneous_thresholds)
    cut = _midpoint((high, low), reports)
    decoded = _above(cut, reports, (high, low))
    own, other = (_mixed(realized_probability(t), decoded) for t in mech.thresholds)

    def event(batch: np.ndarray) -> np.ndarray:
        rows = _per_device(batch, reports)
        ones = _packed_bit(rows, 0).sum(axis=1) > cut
        zeros = _packed_bit(rows, 1).sum(axis=1) <= cut
        return ones & zeros

    return [
        Attack(
            "report", mech.epsilon_report, (0, 1), _unary_event, (p * (1 - q), q * (1 - p)),
            "bit 0 set, bit 1 clear",
        ),
        Attack(
            "lifetime", mech.epsilon_lifetime, (0, 1), event,
            (own * (1 - other), other * (1 - own)),
            f"bit 0 set in more than {cut:.3g} of {counted(reports, 'report')}, bit 1 in fewer",
            reports,
        ),
    ]  # fmt: skip


@_builds(OptimizedLocalHashing)
def _olh(mech: OptimizedLocalHashing, reports: int) -> list[Attack]:
    def event(batch: np.ndarray) -> np.ndarray:
        a, b, y = np.asarray(batch).T
        own, other = mech.hash(a, b, np.zeros_like(a)), mech.hash(a, b, np.ones_like(a))
        return (own != other) & (y == own)

    own, other = mech.bucket_probabilities
    apart = 1 - mech.collision
    return [
        Attack(
            "report", mech.epsilon, (0, 1), event, (apart * own, apart * other),
            "H(0) != H(1) and y = H(0)",
        )
    ]  # fmt: skip


def _hadamard_parity(rows: int | np.ndarray, outputs: np.ndarray) -> np.ndarray:
    """popcount(rows & outputs) mod 2: 0 where H[rows, outputs] = +1."""
    return np.bitwise_count(np.asarray(rows) & np.asarray(outputs)) & 1


@_builds(HadamardResponse)
def _hr(mech: HadamardResponse, reports: int) -> list[Attack]:
    def event(batch: np.ndarray) -> np.ndarray:
        y = np.asarray(batch)
        return (_hadamard_parity(1, y) == 0) & (_hadamard_parity(2, y) == 1)

    p = mech.p
    return [
        Attack("report", mech.epsilon, (0, 1), event, (p / 2, (1 - p) / 2), "y in S_0, not S_1")
    ]


@_builds(DBitFlip)
def _dbitflip(mech: DBitFlip, reports: int) -> list[Attack]:
    s, d = mech.bits_per_device, mech.domain_size
    p, q = mech.bit_p, mech.bit_q
    if s == 1:

        def event(batch: np.ndarray) -> np.ndarray:
            bucket, bit = batch["buckets"][:, 0], batch["bits"][:, 0]
            return ((bucket == 0) & bit) | ((bucket == 1) & ~bit)

        probabilities, text = (2 * p / d, 2 * q / d), "bucket 0 with bit 1 or bucket 1 with bit 0"
    else:

        def event(batch: np.ndarray) -> np.ndarray:
            buckets, bits = batch["buckets"], batch["bits"]
            first, second = buckets == 0, buckets == 1
            both = first.any(axis=1) & second.any(axis=1)
            return both & (first & bits).any(axis=1) & ~(second & bits).any(axis=1)

        share = s * (s - 1) / (d * (d - 1))
        probabilities, text = (share * p * p, share * q * q), "buckets 0, 1 with bits 1, 0"
    return [
        Attack("report", mech.epsilon_report, (0, 1), event, probabilities, text),
        Attack(
            "lifetime", mech.epsilon_lifetime, (0, 1), _majority(event, reports), probabilities,
            f"{text}, in most of {counted(reports, 'report')}", reports,
        ),
    ]  # fmt: skip


# --- numbers ------------------------------------------------------------------------------


@_builds(DuchiMean)
def _duchi(mech: DuchiMean, reports: int) -> list[Attack]:
    high, low = mech.plus_probability(np.array([mech.upper, mech.lower]))
    return [
        Attack(
            "report", mech.epsilon, (mech.upper, mech.lower), _report_is(1),
            (float(high), float(low)), "sign +1",
        )
    ]  # fmt: skip


@_builds(OneBitMean)
def _onebitmean(mech: OneBitMean, reports: int) -> list[Attack]:
    low = float(mech.lowest_report)
    flip = realized_probability(mech.flip_threshold)
    decoded = _above(reports / 2, reports, (1 - flip, flip))
    high_bit, low_bit = (float(t) / BITS53 for t in mech.bit_thresholds[[-1, 0]])
    inputs = (mech.upper, mech.lower)

    def event(batch: np.ndarray) -> np.ndarray:
        return _per_device(np.asarray(batch), reports).sum(axis=1) * 2 > reports

    return [
        Attack("report", mech.epsilon_report, inputs, _report_is(1), (1 - low, low), "bit 1"),
        Attack(
            "lifetime", mech.epsilon_lifetime, inputs, event,
            (_mixed(high_bit, decoded), _mixed(low_bit, decoded)),
            f"bit 1 in most of {counted(reports, 'report')}", reports,
        ),
    ]  # fmt: skip


@_builds(DiscreteLaplace)
def _laplace(mech: DiscreteLaplace, reports: int) -> list[Attack]:
    a = math.exp(-mech.noise_s / mech.noise_t)
    far = math.exp(-mech.effective_epsilon)  # a^K: the two ends' grid indices are K apart
    return [
        Attack(
            "report", mech.epsilon, (mech.lower, mech.upper),
            lambda batch: np.asarray(batch) <= 0, (1 / (1 + a), far / (1 + a)), "report <= 0",
        )
    ]  # fmt: skip


@_builds(PiecewiseMechanism)
def _piecewise(mech: PiecewiseMechanism, reports: int) -> list[Attack]:
    w = mech.window
    return [
        Attack(
            "report", mech.epsilon, (mech.lower, mech.upper),
            lambda batch: np.asarray(batch) < w, (mech.high * w, mech.low * w),
            f"cell < {w} (the lower end's window)",
        )
    ]  # fmt: skip


# --- distributions ------------------------------------------------------------------------


@_builds(HierarchicalHistogram)
def _hh(mech: HierarchicalHistogram, reports: int) -> list[Attack]:
    last = [mech.branching**level - 1 for level in range(1, mech.height + 1)]

    def event(batch: np.ndarray) -> np.ndarray:
        rows = np.asarray(batch)
        level, a, b, y = rows.T
        hit = np.zeros(rows.shape[0], dtype=bool)
        for index, other in enumerate(last):
            hashed = mech.hashed_oracle(index + 1)
            if hashed is not None:
                own = hashed.hash(a, b, np.zeros_like(a))
                wins = (own != hashed.hash(a, b, np.full_like(a, other))) & (y == own)
            else:
                wins = y == 0
            hit |= (level == index + 1) & wins
        return hit

    laws = []
    for index in range(mech.height):
        oracle, hashed = mech.oracle(index + 1), mech.hashed_oracle(index + 1)
        if hashed is not None:
            own, other = hashed.bucket_probabilities
            laws.append(((1 - hashed.collision) * own, (1 - hashed.collision) * other))
        else:
            laws.append((oracle.p, oracle.q))
    p0, p1 = np.mean(laws, axis=0)
    return [
        Attack(
            "report", mech.epsilon, (mech.lower, mech.upper), event, (float(p0), float(p1)),
            "at the report's level, its oracle's event for node 0 against the last node",
        )
    ]  # fmt: skip


@_builds(LongitudinalHierarchicalHistogram)
def _lhh(mech: LongitudinalHierarchicalHistogram, reports: int) -> list[Attack]:
    """One report: at its level, lgrr's "report = node 0" or losue's "bit 0 set, the last
    node's bit clear" (x = lower against upper: node 0 against the last node at every
    level); every level's event has ratio e^epsilon_report, so their average does too."""

    def event(batch: np.ndarray) -> np.ndarray:
        level, hit = batch["level"], np.zeros(batch.size, dtype=bool)
        for at in range(1, mech.height + 1):
            if mech.is_unary(at):
                bits = batch["bits"]
                last = _packed_bit(bits, mech.branching**at - 1)
                wins = (_packed_bit(bits, 0) == 1) & (last == 0)
            else:
                wins = batch["value"] == 0
            hit |= (level == at) & wins
        return hit

    laws = [
        (o.p * (1 - o.q), o.q * (1 - o.p)) if mech.is_unary(at) else (o.p, o.q)
        for at, o in enumerate(mech.oracles, 1)
    ]
    p0, p1 = np.mean(laws, axis=0)
    return [
        Attack(
            "report", mech.epsilon_report, (mech.lower, mech.upper), event,
            (float(p0), float(p1)),
            "at the report's level, its oracle's event for node 0 against the last node",
        )
    ]  # fmt: skip


@_builds(SquareWave)
def _sw(mech: SquareWave, reports: int) -> list[Attack]:
    apart = min(mech.window, mech.buckets - 1)  # the first bucket's window, outside the last's
    channel = mech.channel
    return [
        Attack(
            "report", mech.epsilon, (mech.lower, mech.upper),
            lambda batch: np.asarray(batch) < apart, (apart * channel.high, apart * channel.low),
            f"cell < {apart} (the first bucket's window, outside the last's)",
        )
    ]  # fmt: skip


# --- strings ------------------------------------------------------------------------------


def _candidates(count: int = STRING_CANDIDATES, max_length: int = 2) -> list[str]:
    """Short distinct ASCII strings: the 36 digits and letters, then pairs of them, the
    first ``count`` of those at most ``max_length`` bytes long."""
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    pairs = [first + second for first in digits for second in digits]
    return [*digits, *(pairs if max_length >= 2 else [])][:count]


@_builds(Rappor)
def _rappor(mech: Rappor, reports: int) -> list[Attack]:
    m, k = mech.num_cohorts, mech.num_bits
    first, *others = _candidates(8)
    cohorts = np.arange(m)

    def bloom_masks(text: str) -> np.ndarray:
        return np.unpackbits(
            mech.bloom_packed([text] * m, cohorts), axis=1, count=k, bitorder="little"
        ).astype(bool)

    own = bloom_masks(first)
    best: tuple[int, str, np.ndarray] | None = None
    for text in others:  # the partner whose Bloom bits differ from the first's the most
        other = bloom_masks(text)
        score = int(((own & ~other).sum(axis=1) + (other & ~own).sum(axis=1)).max())
        if best is None or score > best[0]:
            best = (score, text, other)
    assert best is not None
    _, second, other = best
    ones, zeros = own & ~other, other & ~own  # per cohort: bits set in v0 only, in v1 only
    sizes = ones.sum(axis=1) + zeros.sum(axis=1)
    used = sizes == sizes.max()
    ones_packed = np.packbits(ones, axis=1, bitorder="little")
    zeros_packed = np.packbits(zeros, axis=1, bitorder="little")

    def on_bits(cohort: np.ndarray, bits: np.ndarray) -> np.ndarray:
        want, avoid = ones_packed[cohort], zeros_packed[cohort]
        return (
            used[cohort] & np.all((bits & want) == want, axis=1) & np.all(bits & avoid == 0, axis=1)
        )

    def event(batch: np.ndarray) -> np.ndarray:
        return on_bits(batch["cohort"], batch["bits"])

    flip, p, q = mech.realized_probabilities
    p_star, q_star = mech.p_star, mech.q_star
    count_ones, count_zeros = ones.sum(axis=1)[used], zeros.sum(axis=1)[used]
    share = used.mean()

    def law(set_one: float, set_zero: float) -> float:
        return float(share * np.mean(set_one**count_ones * set_zero**count_zeros))

    text = f"v0 = {first!r} Bloom bits all 1, v1 = {second!r} bits all 0"
    attacks = [
        Attack(
            "report", mech.epsilon, (first, second), event,
            (law(q_star, 1 - p_star), law(p_star, 1 - q_star)), text,
        )
    ]  # fmt: skip
    if math.isfinite(mech.epsilon_infinity):
        cut = _midpoint((q, p), reports)
        decoded_rates = _above(cut, reports, (q, p))
        # P(a decoded bit is 1) where the Bloom bit is 1, and where it is 0.
        set_one, clear_one = _mixed(1 - flip, decoded_rates), _mixed(flip, decoded_rates)

        def decoded(batch: np.ndarray) -> np.ndarray:
            rows = _per_device(batch, reports)
            bits = np.unpackbits(rows["bits"], axis=2, count=k, bitorder="little")
            permanent = np.packbits(bits.sum(axis=1) > cut, axis=1, bitorder="little")
            return on_bits(rows["cohort"][:, 0], permanent)

        attacks.append(
            Attack(
                "lifetime", mech.epsilon_infinity, (first, second), decoded,
                (law(set_one, 1 - clear_one), law(clear_one, 1 - set_one)),
                f"{text}, decoded from {counted(reports, 'report')}", reports,
            )
        )  # fmt: skip
    return attacks


def _sketch_pair(
    hashes: SketchHash, prints: Callable[[list[str]], list[np.ndarray]], max_length: int = 2
) -> tuple[tuple[str, str], np.ndarray]:
    """The first candidate and the partner whose columns differ from it in the most rows:
    (the two strings, their columns (slots, k, 2))."""
    first, *others = _candidates(max_length=max_length)
    best: tuple[float, str, np.ndarray] | None = None
    for text in others:
        columns = np.stack([hashes.columns(part) for part in prints([first, text])])
        share = float(np.mean(columns[..., 0] != columns[..., 1]))
        if best is None or share > best[0]:
            best = (share, text, columns)
        if share == 1.0:
            break
    assert best is not None
    return (first, best[1]), best[2]


def _bit_at(bits: np.ndarray, columns: np.ndarray) -> np.ndarray:
    """Bit ``columns[i]`` of packed row i."""
    return (bits[np.arange(bits.shape[0]), columns >> 3] >> (7 - (columns & 7))) & 1


@_builds(CountMeanSketch)
def _cms(mech: CountMeanSketch, reports: int) -> list[Attack]:
    strings, columns = _sketch_pair(
        mech.hash, lambda pair: [mech.hash.fingerprints(utf8_values(pair))]
    )
    own, other = columns[0, :, 0], columns[0, :, 1]

    def event(batch: np.ndarray) -> np.ndarray:
        rows = batch["row"]
        first, second = own[rows], other[rows]
        bits = batch["bits"]
        return (first != second) & (_bit_at(bits, first) == 1) & (_bit_at(bits, second) == 0)

    share = float(np.mean(own != other))
    p, q = mech.p, mech.q
    return [
        Attack(
            "report", mech.epsilon, strings, event, (share * p * p, share * q * q),
            "row's column of v0 set, of v1 clear",
        )
    ]  # fmt: skip


@_builds(HadamardCountMeanSketch)
def _hcms(mech: HadamardCountMeanSketch, reports: int) -> list[Attack]:
    strings, columns = _sketch_pair(
        mech.hash, lambda pair: [mech.hash.fingerprints(utf8_values(pair))]
    )
    own, other = columns[0, :, 0], columns[0, :, 1]

    def event(batch: np.ndarray) -> np.ndarray:
        rows, coefficients, bits = np.asarray(batch).T
        first, second = own[rows], other[rows]
        signs_differ = _hadamard_parity(coefficients, first ^ second) == 1
        first_bit = _hadamard_parity(coefficients, first) == 0
        return (first != second) & signs_differ & (bits == first_bit)

    share = float(np.mean(own != other))
    return [
        Attack(
            "report", mech.epsilon, strings, event, (share * mech.p / 2, share * mech.q / 2),
            "signs of v0 and v1 differ, bit is v0's",
        )
    ]  # fmt: skip


@_builds(PrefixExtendingMethod)
def _pem(mech: PrefixExtendingMethod, reports: int) -> list[Attack]:
    strings = ("a", "b")  # different first bytes: their prefixes differ in every group
    padded = padded_matrix(utf8_values(strings, mech.max_length), mech.max_length)
    prints = np.stack([fingerprints(padded[:, : group + 1]) for group in range(mech.groups)])

    def buckets(column: int, groups: np.ndarray, seeds: np.ndarray) -> np.ndarray:
        return hash_buckets(prints[groups, column], seeds, mech.buckets)

    def event(batch: np.ndarray) -> np.ndarray:
        groups, seeds, y = np.asarray(batch).T
        own = buckets(0, groups, seeds)
        return (own != buckets(1, groups, seeds)) & (y == own)

    every_group, every_seed = np.divmod(np.arange(mech.groups * mech.seeds), mech.seeds)
    apart = float(
        np.mean(buckets(0, every_group, every_seed) != buckets(1, every_group, every_seed))
    )
    own, other = mech.bucket_probabilities
    return [
        Attack(
            "report", mech.epsilon, strings, event, (apart * own, apart * other),
            "H_s(prefix of v0) != H_s(prefix of v1) and y = H_s(prefix of v0)",
        )
    ]  # fmt: skip


@_builds(SequenceFragmentPuzzle)
def _sfp(mech: SequenceFragmentPuzzle, reports: int) -> list[Attack]:
    hashes = mech.sketch.hash

    def prints(pair: Sequence[str]) -> list[np.ndarray]:
        raw = utf8_values(pair, mech.max_length)
        keys = mech.fragment_keys(raw)
        fragments = [fragment_fingerprints(keys[:, position]) for position in range(mech.positions)]
        return [hashes.fingerprints(raw), *fragments]

    strings, columns = _sketch_pair(hashes, prints, mech.max_length)  # (slots, k, 2)

    def event(batch: np.ndarray) -> np.ndarray:
        slots = np.where(batch["kind"] == 0, 0, batch["position"] + 1)
        first, second = columns[slots, batch["row"], 0], columns[slots, batch["row"], 1]
        bits = batch["bits"]
        return (first != second) & (_bit_at(bits, first) == 1) & (_bit_at(bits, second) == 0)

    share = float(np.mean(columns[..., 0] != columns[..., 1]))
    p, q = mech.sketch.p, mech.sketch.q
    return [
        Attack(
            "report", mech.epsilon, strings, event, (share * p * p, share * q * q),
            "slot's row column of v0 set, of v1 clear",
        )
    ]  # fmt: skip


# --- several attributes -------------------------------------------------------------------


@dataclass(frozen=True)
class ViewEvent:
    """One view's event on its bytes (module docstring): its chances under x0 and x1, and
    under a fake report."""

    event: ReportEvent
    probabilities: tuple[float, float]
    fake: float
    description: str


def _view_event(view: multidim.View, first: int | float, second: int | float) -> ViewEvent:
    """The event of ``view`` telling its value ``first`` (x0's) from ``second`` (x1's)."""
    inner: Any = view.inner
    name = view.describe()
    if view.oracle == "grr":
        own = int(first)

        def grr(block: np.ndarray) -> np.ndarray:
            return ((block[:, 0].astype(np.int64) << 8) | block[:, 1]) == own

        return ViewEvent(grr, (inner.p, inner.q), 1 / view.plan.cells, f"{name} = {own}")
    if view.oracle == "oue":
        one, zero = int(first), int(second)

        def oue(block: np.ndarray) -> np.ndarray:
            return (_packed_bit(block, one) == 1) & (_packed_bit(block, zero) == 0)

        p, q = inner.p, inner.q
        return ViewEvent(
            oue, (p * (1 - q), q * (1 - p)), q * (1 - q), f"{name} bit {one} set, {zero} clear"
        )
    if view.oracle == "duchi":
        high, low = (float(v) for v in inner.plus_probability(np.array([first, second])))
        return ViewEvent(
            lambda block: block[:, 0] == 1, (high, low), (high + low) / 2, f"{name} sign +1"
        )
    w = inner.window
    inside = np.clip(w - np.arange(inner.grid_steps + 1), 0, w)  # window cells below w
    fake = float(np.mean(inner.high * inside + inner.low * (w - inside)))

    def piecewise(block: np.ndarray) -> np.ndarray:
        return ((block[:, 0].astype(np.int64) << 8) | block[:, 1]) < w

    return ViewEvent(piecewise, (inner.high * w, inner.low * w), fake, f"{name} cell < {w}")


def _records(mech: MultiAttributeMechanism) -> tuple[dict[str, Any], dict[str, Any]]:
    """x0 and x1 (module docstring): categories 0 and 1; numbers at the two ends, x0 at the
    end its view's event favours."""
    first: dict[str, Any] = {}
    second: dict[str, Any] = {}
    numeric = {view.plan.columns[0]: view.inner for view in mech.views if view.plan.is_numeric}
    for column, attribute in enumerate(mech.spec.attributes):
        if column in numeric:
            inner: Any = numeric[column]
            ends = (
                (inner.upper, inner.lower) if inner.name == "duchi" else (inner.lower, inner.upper)
            )
            first[attribute.name], second[attribute.name] = ends
        else:
            first[attribute.name], second[attribute.name] = 0, 1
    return first, second


@_builds(MultiAttributeMechanism)
def _multidim(mech: MultiAttributeMechanism, reports: int) -> list[Attack]:
    first, second = _records(mech)
    rows = mech.rows([first, second])
    events = [
        _view_event(view, *(float(v) if view.plan.is_numeric else int(v)
                            for v in view.inputs(rows)))
        for view in mech.views
    ]  # fmt: skip
    low, high = mech.offsets[:-1], mech.offsets[1:]
    p0 = np.array([e.probabilities[0] for e in events])
    p1 = np.array([e.probabilities[1] for e in events])
    if mech.name == "smp":

        def sampled(batch: np.ndarray) -> np.ndarray:
            array = np.asarray(batch)
            hit = np.zeros(array.shape[0], dtype=bool)
            for index, (view, item) in enumerate(zip(mech.views, events, strict=True)):
                hit |= (array[:, 0] == index) & item.event(array[:, 1 : 1 + view.width])
            return hit

        probabilities = (float(p0.mean()), float(p1.mean()))
        return [
            Attack(
                "report", mech.epsilon, (first, second), sampled, probabilities,
                "the sampled view's event: " + "; ".join(e.description for e in events),
            )
        ]  # fmt: skip

    def every(batch: np.ndarray) -> np.ndarray:
        array = np.asarray(batch)
        hit = np.ones(array.shape[0], dtype=bool)
        for start, end, item in zip(low, high, events, strict=True):
            hit &= item.event(array[:, start:end])
        return hit

    if mech.name == "spl":
        probabilities = (float(np.prod(p0)), float(np.prod(p1)))
    else:  # rsfd: the sampled view s true, the others fake
        fakes = np.array([e.fake for e in events])
        others = np.array([np.prod(np.delete(fakes, s)) for s in range(fakes.size)])
        probabilities = (float(np.mean(p0 * others)), float(np.mean(p1 * others)))
    return [
        Attack(
            "report", mech.epsilon, (first, second), every, probabilities,
            "every view's event: " + "; ".join(e.description for e in events),
        )
    ]  # fmt: skip
