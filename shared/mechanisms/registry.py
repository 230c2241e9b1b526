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
from shared.mechanisms.spec import MechanismSpec, spec_models

M = TypeVar("M", bound=type[Mechanism[Any]])
Builder = Callable[[MechanismSpec], Mechanism[Any]]

#: Every registered mechanism class by wire name.
MECHANISMS: dict[str, type[Mechanism[Any]]] = {}
_BUILDERS: dict[str, Builder] = {}


def register(cls: M) -> M:
    """Class decorator: register a mechanism under its ``name``, the wire name of its
    ``spec_model``."""
    literal = cls.spec_model.model_fields["mechanism"].annotation
    if getattr(literal, "__args__", None) != (cls.name,):
        raise TypeError(f"{cls.__name__}.spec_model does not take mechanism={cls.name!r}")
    register_builder(cls.name, cls)
    MECHANISMS[cls.name] = cls
    return cls


def register_builder(name: str, builder: Builder) -> None:
    """Register how to build the mechanism of specs named ``name``."""
    if name in _BUILDERS:
        raise TypeError(f"the mechanism name {name!r} is registered twice")
    _BUILDERS[name] = builder


def make_mechanism(spec: MechanismSpec) -> Mechanism[Any]:
    """Build the mechanism a spec names (``auto`` resolves to a concrete one)."""
    spec_models()  # the plug-ins, imported
    builder = _BUILDERS.get(spec.mechanism)
    if builder is None:
        raise ValueError(f"the {spec.mechanism!r} mechanism is not available in this version")
    return builder(spec)
