"""What every memoized (longitudinal) mechanism adds to the mechanism interface.

A memoized mechanism answers a value with a *permanent* response, drawn once per
(device, metric version, memo key) from the device's memo (``shared.memo``) and the
same for every later report of that value, and (for ``lgrr`` and the unary ones) a
fresh *instantaneous* response on top of it for each report. So, for a spec with
``epsilon`` and ``epsilon_report``:

* one report is ``epsilon_report``-LDP (``transition_matrix`` is one report's exact
  law, the permanent and the instantaneous response composed);
* any number of reports of one value are post-processing of one permanent response,
  which is ``epsilon``-LDP (``permanent_matrix``, its exact law): the lifetime bound
  per distinct value;
* reports of k distinct memo keys compose to at most k ``epsilon``. The device ledger
  charges exactly that: ``epsilon`` on a key's first report, ``epsilon_report`` per
  report to the period (``client.ledger.PrivacyLedger.debit_memoized``).

What memoization does not hide: two reports of one device either come from the same
permanent response or not, so their joint law depends on whether the value changed;
the per-key bound holds for histories with the same pattern of equal and changed
values (an instantaneous response, or ``onebitmean``'s output perturbation, blurs the
pattern without removing it).

``encode(values, rng=None, context=FRESH)``: ``context.memo`` holds the devices'
permanent randomness, one row per value (``KeyedMemo`` on a device, ``SimulatedMemo``
in a simulation); ``None`` draws a fresh permanent response from ``rng`` for every
value, which gives one report the same law (one-period simulations, estimator tests)
and is what a stateless implementation does across periods.

Spec fields: ``epsilon`` (the lifetime bound per distinct value) and ``epsilon_report``
(what one report reveals). ``lgrr`` and the unary ones chain a memoized and a fresh
response and require ``epsilon_report`` < ``epsilon`` (``ChainedSpec``); ``dbitflip``
and ``onebitmean`` derive ``epsilon_report`` and fill it in.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from typing import Any, ClassVar

import numpy as np
from pydantic import Field, model_validator

from shared.mechanisms.abilities import FRESH, DeviceContext, Memoized
from shared.mechanisms.spec import MAX_EPSILON, MIN_EPSILON, CategoricalSpec, MechanismSpec
from shared.memo import FreshMemo, Memo
from shared.randomness import Rng, as_source


def memo_key_bytes(key: int) -> bytes:
    """A memo key as the device ledger identifies it: 8 bytes, big-endian, two's complement."""
    return key.to_bytes(8, "big", signed=True)


class MemoizedSpec(MechanismSpec):
    """A memoized mechanism's spec: ``epsilon`` per distinct value for life, and
    ``epsilon_report`` per report (required, or derived and filled in: see the subclass)."""

    is_memoized: ClassVar[bool] = True

    epsilon_report: float | None = Field(
        default=None,
        ge=MIN_EPSILON,
        le=MAX_EPSILON,
        allow_inf_nan=False,
        description=(
            "What one report reveals. Required, and below epsilon, for lgrr, lsue, loue and "
            "losue (epsilon is then the lifetime bound per distinct value); derived for "
            "dbitflip (= epsilon) and onebitmean (from flip_probability)."
        ),
    )

    @property
    def report_epsilon(self) -> float:
        """What one report reveals: ``epsilon_report`` (required or filled in)."""
        assert self.epsilon_report is not None  # required or filled in by the subclass
        return self.epsilon_report

    def check_derived_report_epsilon(self, derived: float) -> None:
        """Fill in ``epsilon_report`` = ``derived``, or check a given one agrees."""
        if self.epsilon_report is None:
            object.__setattr__(self, "epsilon_report", derived)
        elif not math.isclose(self.epsilon_report, derived, rel_tol=1e-9, abs_tol=0.0):
            raise ValueError(
                f"epsilon_report = {self.epsilon_report} disagrees with {derived!r}, what one "
                f"{self.mechanism!r} report reveals with these parameters; omit it or give "
                "that value"
            )


class ChainedReport(MemoizedSpec):
    """A memoized response chained with a fresh one per report: requires
    ``epsilon_report`` < ``epsilon`` (``ChainedSpec``; ``lhh``'s spec)."""

    @model_validator(mode="after")
    def _report_reveals_less(self) -> ChainedReport:
        if self.epsilon_report is None:
            raise ValueError(
                f"epsilon_report is required for the {self.mechanism!r} mechanism (what one "
                "report reveals; epsilon is the lifetime bound per distinct value)"
            )
        if not self.epsilon_report < self.epsilon:
            raise ValueError(
                f"epsilon_report must be < epsilon (one report reveals less than the "
                f"memoized response), got epsilon_report={self.epsilon_report}, "
                f"epsilon={self.epsilon}"
            )
        return self


class ChainedSpec(ChainedReport, CategoricalSpec):
    """A memoized categorical response chained with a fresh one per report, e.g.
    ``{"mechanism": "lgrr", "epsilon": 2.0, "epsilon_report": 1.0, "domain_size": 8}``."""


class MemoizedMechanism:
    """Mixin for the memoized mechanisms (see the module docstring)."""

    provides: ClassVar[tuple[type, ...]] = (Memoized,)
    stateful: ClassVar[bool] = True
    spec: MemoizedSpec

    @property
    def epsilon_report(self) -> float:
        """What one report reveals (the spec's ``epsilon_report``)."""
        value = self.spec.epsilon_report
        assert value is not None  # filled in or required by the spec model
        return float(value)

    @property
    def epsilon_lifetime(self) -> float:
        """What any number of reports of one memo key reveal: the spec's ``epsilon``."""
        return float(self.spec.epsilon)

    def ledger_keys(self, values: Any, context: DeviceContext) -> list[bytes]:
        """``memo_key_bytes`` of each value's memo key (``memo_keys``)."""
        return [memo_key_bytes(int(key)) for key in self.memo_keys(values, context.memo)]

    @staticmethod
    def memo_for(values: np.ndarray, rng: Rng, memo: Memo | None) -> Memo:
        """``memo``, checked to have one row per value; or, for ``None``, fresh words."""
        size = len(values)
        if memo is None:
            return FreshMemo(as_source(rng), size)
        if memo.size != size:
            raise ValueError(f"the memo has {memo.size} rows for {size} values; give one per value")
        return memo

    @abstractmethod
    def encode(self, values: Any, rng: Rng = None, context: DeviceContext = FRESH) -> np.ndarray:
        """Reports of ``values``: each value's permanent response from ``context.memo``
        (one row per value; None: fresh), re-randomized by a fresh instantaneous response
        from ``rng`` where the mechanism has one."""

    @abstractmethod
    def memo_keys(self, values: np.ndarray, memo: Memo | None = None) -> np.ndarray:
        """The memo key of each value (int64): the permanent response depends on the value
        only through it, so the ledger charges ``epsilon`` once per distinct key (a keyed
        hash of it, never the value). Category mechanisms: the category; ``onebitmean``:
        the grid point the device's permanent rounding offset rounds the value to."""

    @abstractmethod
    def permanent(self, values: np.ndarray, memo: Memo | None = None) -> np.ndarray:
        """The permanent responses of ``values`` (one row of ``memo`` each)."""

    @abstractmethod
    def permanent_matrix(self) -> np.ndarray:
        """Exact ``P[permanent response | value]`` as a (values, responses) matrix: its
        largest likelihood ratio is e^``epsilon``, the lifetime bound per memo key."""
