"""``auto``: the categorical mechanism with the least variance for (epsilon, d).

The choice minimizes the planning variance ``variance(n)`` (the variance of a
frequency whose truth is 0, Wang et al. 2017) over GRR, SUE, OUE, OLH and HR.
It depends only on the public (epsilon, d), so the device and the server
resolve the same mechanism; ties keep the earlier, cheaper name in
``CANDIDATES`` (GRR's reports are the smallest). Roughly: GRR when
d < 3 e^eps + 2, otherwise OUE (or OLH, whose variance is within a hair of
OUE's with reports of three integers instead of d bits).

Refusal rules and profiles: those of the mechanism chosen (``resolve_auto`` returns it):
``oue``'s and ``sue``'s ones-count rule and ones-count profile; none for ``grr``, ``olh``
and ``hr`` (their modules say why).
"""

from __future__ import annotations

from typing import Literal

from shared.mechanisms.categorical import CategoricalMechanism
from shared.mechanisms.grr import GeneralizedRandomizedResponse
from shared.mechanisms.hr import HadamardResponse
from shared.mechanisms.olh import OptimizedLocalHashing
from shared.mechanisms.registry import register_builder
from shared.mechanisms.spec import CategoricalSpec, MechanismSpec
from shared.mechanisms.unary import OptimizedUnaryEncoding, SymmetricUnaryEncoding

CANDIDATES: tuple[type[CategoricalMechanism], ...] = (
    GeneralizedRandomizedResponse,
    OptimizedLocalHashing,
    OptimizedUnaryEncoding,
    HadamardResponse,
    SymmetricUnaryEncoding,
)


class AutoSpec(CategoricalSpec):
    """``{"mechanism": "auto", "epsilon": 1.0, "domain_size": 64}``: the device and the
    server build the same concrete mechanism from it (``resolve_auto``)."""

    mechanism: Literal["auto"]


def resolve_auto(spec: MechanismSpec) -> CategoricalMechanism:
    """The lowest-variance concrete mechanism for an ``auto`` spec's (epsilon, d)."""
    if not isinstance(spec, AutoSpec):
        raise ValueError(f"resolve_auto needs an 'auto' spec, got {spec.mechanism!r}")
    options = []
    for cls in CANDIDATES:
        concrete = spec.with_changes(mechanism=cls.name)
        assert isinstance(concrete, CategoricalSpec)  # every candidate's spec model is one
        options.append(cls(concrete))
    return min(options, key=lambda mechanism: mechanism.variance(1))


register_builder(AutoSpec, resolve_auto)
