"""``auto``: the categorical mechanism with the least variance for (epsilon, d).

The choice minimizes the planning variance ``variance(n)`` (the variance of a
frequency whose truth is 0, Wang et al. 2017) over GRR, SUE, OUE, OLH and HR.
It depends only on the public (epsilon, d), so the device and the server
resolve the same mechanism; ties keep the earlier, cheaper name in
``CANDIDATES`` (GRR's reports are the smallest). Roughly: GRR when
d < 3 e^eps + 2, otherwise OUE (or OLH, whose variance is within a hair of
OUE's with reports of three integers instead of d bits).
"""

from __future__ import annotations

from shared.mechanisms.categorical import CategoricalMechanism
from shared.mechanisms.grr import GeneralizedRandomizedResponse
from shared.mechanisms.hr import HadamardResponse
from shared.mechanisms.olh import OptimizedLocalHashing
from shared.mechanisms.unary import OptimizedUnaryEncoding, SymmetricUnaryEncoding
from shared.schemas import MechanismSpec

CANDIDATES: tuple[type[CategoricalMechanism], ...] = (
    GeneralizedRandomizedResponse,
    OptimizedLocalHashing,
    OptimizedUnaryEncoding,
    HadamardResponse,
    SymmetricUnaryEncoding,
)


def resolve_auto(spec: MechanismSpec) -> CategoricalMechanism:
    """The lowest-variance concrete mechanism for an ``auto`` spec's (epsilon, d)."""
    if spec.mechanism != "auto":
        raise ValueError(f"resolve_auto needs an 'auto' spec, got {spec.mechanism!r}")
    options = [cls(spec.model_copy(update={"mechanism": cls.name})) for cls in CANDIDATES]
    return min(options, key=lambda mechanism: mechanism.variance(1))
