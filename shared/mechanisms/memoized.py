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

``encode(values, rng=None, memo=None)``: ``memo`` holds the devices' permanent
randomness, one row per value (``KeyedMemo`` on a device, ``SimulatedMemo`` in a
simulation); ``None`` draws a fresh permanent response from ``rng`` for every value,
which gives one report the same law (one-period simulations, estimator tests) and is
what a stateless implementation does across periods.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import ClassVar

import numpy as np

from shared.memo import FreshMemo, Memo
from shared.randomness import Rng, as_source


class MemoizedMechanism:
    """Mixin for the memoized mechanisms (see the module docstring)."""

    memoized: ClassVar[bool] = True

    @property
    def epsilon_report(self) -> float:
        """What one report reveals (the spec's ``epsilon_report``)."""
        value = self.spec.epsilon_report  # type: ignore[attr-defined]
        assert value is not None  # filled in or required by MechanismSpec
        return float(value)

    @property
    def epsilon_lifetime(self) -> float:
        """What any number of reports of one memo key reveal: the spec's ``epsilon``."""
        return float(self.spec.epsilon)  # type: ignore[attr-defined]

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
    def encode(self, values: np.ndarray, rng: Rng = None, memo: Memo | None = None) -> np.ndarray:
        """Reports of ``values``: each value's permanent response from ``memo`` (one row
        per value; None: fresh), re-randomized by a fresh instantaneous response from
        ``rng`` where the mechanism has one."""

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
