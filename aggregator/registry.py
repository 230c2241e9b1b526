"""Metric definitions: what a metric is, how it is versioned, and the built-in demo set.

A metric is a name, a description, a ``MechanismSpec`` (the public privacy promise) and
either ``labels`` (categorical metrics: the category names in index order; RAPPOR: the
candidate strings the estimate decodes against) or nothing (numeric metrics, whose
bounds are in the spec), and optionally public ``dimensions`` (name -> allowed values,
sent in the clear with each report; ``shared.dimensions``). Definitions come from a TOML
file (``--config``) and from ``PUT /v1/metrics/{name}``.

Versions. Reports are made under one spec and can only be debiased under that spec, so
a metric's spec is immutable once reports may exist: changing the mechanism, epsilon or
any other spec field, the labels (which give the indices their meaning) or the
dimensions (whose order numbers the cells the statistics are kept by), creates
version v + 1. Reports carry the version they were made for and aggregate under it for
ever. A change of description alone updates the current version in place.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from shared.schemas import NAME_PATTERN, MechanismSpec, MetricDefinition, error_location

#: Metric names: lower-case letters, digits, '.', '_' and '-', starting with a letter or digit.
METRIC_NAME = NAME_PATTERN


def check_metric_name(name: str) -> str:
    if not METRIC_NAME.match(name):
        raise ValueError(
            f"metric name {name!r} must be 1..64 characters of a-z, 0-9, '.', '_' and '-', "
            "starting with a letter or digit"
        )
    return name


def load_definitions(path: Path) -> dict[str, MetricDefinition]:
    """Metric definitions from a TOML file: one table per metric, ``[metrics.NAME]``.

    ``[metrics.NAME]`` holds ``description`` and ``labels``, ``[metrics.NAME.mechanism]``
    the ``MechanismSpec`` fields. Raises ValueError naming the file, metric and field.
    """
    try:
        document = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as error:
        raise ValueError(f"cannot read metric config {path}: {error}") from None
    tables = document.get("metrics")
    if not isinstance(tables, dict) or not tables:
        raise ValueError(f"{path}: expected one or more [metrics.NAME] tables")
    return {name: parse_definition(name, body, str(path)) for name, body in tables.items()}


def parse_definition(name: str, body: Any, source: str) -> MetricDefinition:
    check_metric_name(name)
    try:
        return MetricDefinition.model_validate(body)
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(error_location(item['loc'])) or 'metric'}: {item['msg']}"
            for item in error.errors()
        )
        raise ValueError(f"{source}: metric {name!r}: {problems}") from None


def _spec(**fields: Any) -> MechanismSpec:
    return MechanismSpec.model_validate(fields)


#: What ``ldp-aggregator serve`` defines when given no ``--config``: one metric per kind.
DEMO_METRICS: dict[str, MetricDefinition] = {
    "app.theme": MetricDefinition(
        description="Colour theme the user chose (demo, categorical, GRR).",
        mechanism=_spec(mechanism="grr", epsilon=2.0, domain_size=3),
        labels=("light", "dark", "system"),
    ),
    "app.start_screen": MetricDefinition(
        description="Screen the app opened on (demo, categorical, chosen by variance).",
        mechanism=_spec(mechanism="auto", epsilon=1.0, domain_size=8),
        labels=("home", "search", "feed", "inbox", "profile", "settings", "camera", "map"),
    ),
    "app.night_mode": MetricDefinition(
        description="Whether night mode was on, by platform and app version (demo, "
        "categorical, GRR, with public dimensions: try estimate?by=platform).",
        mechanism=_spec(mechanism="grr", epsilon=1.0, domain_size=2),
        labels=("off", "on"),
        dimensions={"platform": ("android", "ios"), "version": ("1.0", "2.0")},
    ),
    "app.session_minutes": MetricDefinition(
        description="Session length in minutes, clipped to 0..120 (demo, numeric).",
        mechanism=_spec(mechanism="piecewise", epsilon=1.0, lower=0.0, upper=120.0),
    ),
    "page.load_ms": MetricDefinition(
        description="Page load time in ms, 1..10,000 on a log scale (demo, distribution, hh).",
        unit="ms",
        mechanism=_spec(
            mechanism="hh",
            epsilon=2.0,
            lower=1.0,
            upper=10_000.0,
            buckets=256,
            branching=4,
            scale="log",
        ),
    ),
    "app.display": MetricDefinition(
        description="Theme, text size and brightness in one report, with the joint of theme "
        "and text size (demo, multi-attribute, smp: one sampled view per report).",
        mechanism=_spec(
            mechanism="smp",
            epsilon=2.0,
            attributes=[
                {"name": "theme", "domain_size": 3, "labels": ["light", "dark", "system"]},
                {
                    "name": "text_size",
                    "domain_size": 4,
                    "labels": ["small", "medium", "large", "huge"],
                },
                {"name": "brightness", "lower": 0.0, "upper": 100.0},
            ],
            pairs=[["theme", "text_size"]],
        ),
    ),
    "browser.home_page": MetricDefinition(
        description="Home page host (demo, RAPPOR strings decoded against candidates).",
        mechanism=_spec(
            mechanism="rappor", num_bits=32, num_hashes=1, num_cohorts=64, f=0.5, p=0.25, q=0.75
        ),
        labels=("example.com", "example.org", "example.net", "news.example", "mail.example"),
    ),
}
