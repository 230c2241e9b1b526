"""The registry of mechanisms: wire name -> how to build the mechanism a spec names.

A mechanism module registers its class with ``@register``; the class names its spec
model (``spec_model``), whose ``mechanism`` literal is the wire name. ``auto``, which
builds another mechanism, registers a builder instead (``register_builder``). The
package ``shared.mechanisms`` imports every plug-in module once (``PLUGINS``), so that
importing it fills this registry.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from shared.mechanisms.base import Mechanism
from shared.mechanisms.spec import MechanismSpec, register_spec_model, wire_name

M = TypeVar("M", bound=type[Mechanism[Any]])
Builder = Callable[[MechanismSpec], Mechanism[Any]]

#: Every registered mechanism class by wire name.
MECHANISMS: dict[str, type[Mechanism[Any]]] = {}
_BUILDERS: dict[str, Builder] = {}


def register(cls: M) -> M:
    """Class decorator: register a mechanism and its ``spec_model`` under its ``name``, the
    wire name the spec model's ``mechanism`` literal gives."""
    if wire_name(cls.spec_model) != cls.name:
        raise TypeError(f"{cls.__name__}.spec_model does not take mechanism={cls.name!r}")
    register_builder(cls.spec_model, cls)
    MECHANISMS[cls.name] = cls
    return cls


def register_builder(spec_model: type[MechanismSpec], builder: Builder) -> None:
    """Register a spec model and how to build the mechanism of its specs."""
    name = register_spec_model(spec_model)
    if name in _BUILDERS:
        raise TypeError(f"the mechanism name {name!r} is registered twice")
    _BUILDERS[name] = builder


def make_mechanism(spec: MechanismSpec) -> Mechanism[Any]:
    """Build the mechanism a spec names (``auto`` resolves to a concrete one)."""
    builder = _BUILDERS.get(spec.mechanism)
    if builder is None:
        raise ValueError(f"the {spec.mechanism!r} mechanism is not available in this version")
    return builder(spec)
