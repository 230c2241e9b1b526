"""The mechanism library: one module per mechanism, built from a ``MechanismSpec``.

    >>> from shared.schemas import MechanismSpec
    >>> from shared.mechanisms import make_mechanism
    >>> mech = make_mechanism(MechanismSpec(mechanism="oue", epsilon=2.0, domain_size=1024))

``MECHANISMS`` maps every wire name to its class; ``auto`` resolves to the
lowest-variance categorical mechanism for the spec's (epsilon, d). Each class has
a ``kind``: ``"categorical"``, ``"numeric"`` or ``"string"`` (``rappor``, whose
``encode`` also takes cohorts and device secrets, and whose ``estimate`` takes
candidate strings). Memoized mechanisms (``lgrr``, ``lsue``, ``loue``, ``losue``,
``dbitflip``, ``onebitmean``) are ``MemoizedMechanism``s too (``shared.mechanisms.memoized``):
their ``encode`` also takes a ``memo``, the devices' permanent randomness.
"""

from __future__ import annotations

from shared.mechanisms.auto import resolve_auto
from shared.mechanisms.base import Mechanism
from shared.mechanisms.categorical import CategoricalMechanism
from shared.mechanisms.dbitflip import DBitFlip
from shared.mechanisms.duchi import DuchiMean
from shared.mechanisms.grr import GeneralizedRandomizedResponse
from shared.mechanisms.hr import HadamardResponse
from shared.mechanisms.laplace import DiscreteLaplace
from shared.mechanisms.lgrr import LongitudinalGRR
from shared.mechanisms.lue import LongitudinalOSUE, LongitudinalOUE, LongitudinalSUE
from shared.mechanisms.memoized import MemoizedMechanism
from shared.mechanisms.numeric import NumericMechanism
from shared.mechanisms.olh import OptimizedLocalHashing
from shared.mechanisms.onebitmean import OneBitMean
from shared.mechanisms.pem import PrefixExtendingMethod
from shared.mechanisms.piecewise import PiecewiseMechanism
from shared.mechanisms.rappor import Rappor, RapporEstimate
from shared.mechanisms.sfp import SequenceFragmentPuzzle
from shared.mechanisms.sketch import CountMeanSketch, HadamardCountMeanSketch
from shared.mechanisms.unary import OptimizedUnaryEncoding, SymmetricUnaryEncoding
from shared.schemas import MechanismSpec

MECHANISMS: dict[str, type[Mechanism]] = {
    cls.name: cls
    for cls in (
        GeneralizedRandomizedResponse,
        SymmetricUnaryEncoding,
        OptimizedUnaryEncoding,
        OptimizedLocalHashing,
        HadamardResponse,
        DiscreteLaplace,
        DuchiMean,
        PiecewiseMechanism,
        Rappor,
        LongitudinalGRR,
        OneBitMean,
        DBitFlip,
        LongitudinalSUE,
        LongitudinalOUE,
        LongitudinalOSUE,
        CountMeanSketch,
        HadamardCountMeanSketch,
        PrefixExtendingMethod,
        SequenceFragmentPuzzle,
    )
}


def make_mechanism(spec: MechanismSpec) -> Mechanism:
    """Build the mechanism a spec names (``auto`` resolves to a concrete one)."""
    if spec.mechanism == "auto":
        return resolve_auto(spec)
    cls = MECHANISMS.get(spec.mechanism)
    if cls is None:
        raise ValueError(f"the {spec.mechanism!r} mechanism is not available in this version")
    return cls(spec)


__all__ = [
    "MECHANISMS",
    "CategoricalMechanism",
    "Mechanism",
    "MechanismSpec",
    "MemoizedMechanism",
    "NumericMechanism",
    "Rappor",
    "RapporEstimate",
    "make_mechanism",
    "resolve_auto",
]
