"""The mechanism library: one plug-in module per mechanism, built from its spec.

    >>> from shared.schemas import MechanismSpec
    >>> from shared.mechanisms import make_mechanism
    >>> mech = make_mechanism(MechanismSpec(mechanism="oue", epsilon=2.0, domain_size=1024))

Each module in ``PLUGINS`` defines a spec model (its fields, ``shared.mechanisms.spec``)
and a mechanism class, registered with ``@register`` (``shared.mechanisms.registry``);
``MECHANISMS`` maps every wire name to its class, and ``auto`` resolves to the
lowest-variance categorical mechanism for the spec's (epsilon, d). What a caller may do
with a mechanism beyond encoding and aggregating is asked of it as an ability
(``shared.mechanisms.abilities``: ``attributes``, ``categorical``, ``numeric``,
``candidate_queries``, ``discovery``, ``distribution``, ``memoized``), and per-device state
reaches ``encode`` as one ``DeviceContext``. A new mechanism is a new module and one line
in ``PLUGINS``.
"""

from __future__ import annotations

import importlib

from shared.mechanisms.abilities import (
    FRESH,
    AttributeValues,
    CandidateQueries,
    CategoricalValues,
    DeviceContext,
    Discovery,
    DistributionValues,
    Memoized,
    NumericValues,
    as_attributes,
    as_candidate_queries,
    as_categorical,
    as_discovery,
    as_distribution,
    as_memoized,
    as_numeric,
)
from shared.mechanisms.base import Mechanism
from shared.mechanisms.registry import MECHANISMS, make_mechanism, register
from shared.mechanisms.spec import MechanismSpec

#: The plug-in modules, imported once: each registers its mechanism and spec model.
PLUGINS = (
    "grr", "unary", "olh", "hr", "auto", "laplace", "duchi", "piecewise", "rappor",
    "lgrr", "lue", "dbitflip", "onebitmean", "sketch", "pem", "sfp", "hh", "sw", "lhh",
    "multidim",
)  # fmt: skip
for _plugin in PLUGINS:
    importlib.import_module(f"shared.mechanisms.{_plugin}")

__all__ = [
    "FRESH",
    "MECHANISMS",
    "AttributeValues",
    "CandidateQueries",
    "CategoricalValues",
    "DeviceContext",
    "Discovery",
    "DistributionValues",
    "Mechanism",
    "MechanismSpec",
    "Memoized",
    "NumericValues",
    "as_attributes",
    "as_candidate_queries",
    "as_categorical",
    "as_discovery",
    "as_distribution",
    "make_mechanism",
    "as_memoized",
    "as_numeric",
    "register",
]
