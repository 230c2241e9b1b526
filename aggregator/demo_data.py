"""Demo data: perturbed reports from simulated devices, so a fresh service has estimates.

``ldp-aggregator serve --demo-data`` calls :func:`fill_demo_data` before the workers
start. On a database that holds no statistics yet, every metric the service serves (its
current version) receives ``DEMO_REPORTS_PER_HOUR`` reports in each of the last
``DEMO_HOURS`` hours. Each report is made as a device makes it: the simulated device's
value is perturbed by the metric's own mechanism (``Mechanism.encode``; RAPPOR with a
fresh 32-byte device secret and the cohort derived from it; ``pem`` with a fresh group
per device, its permanent randomness drawn anew as each simulated device reports once),
and only the perturbed reports are ingested, through the same validation and exactly-once
path as ``POST /v1/reports``. No raw value is stored anywhere.

A metric with dimensions gets its reports spread over its cells (``demo_cells``): each
hour's reports go in equal shares to as many cells as keep every share at the release
threshold (at least one), the cells taken in turn from hour to hour, so that every cell
has released hours and ``estimate?by=`` shows every group over a long enough window. The
values do not depend on the cell.

The simulated populations (the truth the estimates approach; ``simulated_values``),
drawn from a fixed seed per metric:

* categorical metrics with ``d`` categories, and string metrics (``rappor``, ``cms``,
  ``hcms``, ``pem``, ``sfp``) over their candidate strings (``labels``, those within
  ``max_length`` UTF-8 bytes; a string metric without such candidates is left empty):
  Zipf shares,
  ``P(v) = (v + 1)^-s / sum_u (u + 1)^-s`` with ``s = ZIPF_EXPONENT``;
* numeric metrics on ``[lower, upper]``: ``lower + (upper - lower) B``,
  ``B ~ Beta(2, 5)``, whose mean is ``lower + 2 (upper - lower) / 7``;
* distribution metrics (``hh``, ``sw``) the same on a linear scale, and on a log scale
  ``lower (upper / lower)^B`` with ``B ~ Beta(2, 5)``: skewed in the log of the value, as
  latencies are, so that the histogram spreads over the buckets of equal ratios;
* multi-attribute metrics (``spl``, ``smp``, ``rsfd``): each attribute as above (Zipf
  shares, or Beta(2, 5) on its range), and each categorical attribute after the first
  correlated with the one before it: with probability 1/2 it takes the previous
  attribute's value (modulo its own size) instead of its own draw, so the joint of a
  declared pair is far from the product of its margins.
"""

from __future__ import annotations

import os
import uuid
import zlib
from datetime import datetime, timedelta
from typing import Any, cast

import numpy as np

from aggregator.ingest import utc_now
from aggregator.service import Aggregator
from shared.mechanisms import (
    DeviceContext,
    Mechanism,
    as_attributes,
    as_categorical,
    as_numeric,
)
from shared.mechanisms.multidim_spec import MultiAttributeSpec
from shared.mechanisms.spec import as_distribution_spec
from shared.schemas import MetricSpec, Report, ReportBatch

#: Hours back from the current one that receive reports (fewer if the service keeps
#: report ids for less time).
DEMO_HOURS = 72
#: Reports per metric and hour (at least the release threshold ``min_reports``).
DEMO_REPORTS_PER_HOUR = 200
#: Exponent of the categorical populations' Zipf shares.
ZIPF_EXPONENT = 1.1
#: Seed of the simulated populations (the values, not their perturbation), with the
#: CRC-32 of the metric's name.
POPULATION_SEED = 2026
#: Bytes of a simulated device's RAPPOR secret (as ``Rappor.new_secret``).
SECRET_BYTES = 32


def zipf_shares(size: int, exponent: float = ZIPF_EXPONENT) -> np.ndarray:
    """``P(v) = (v + 1)^-s / sum_u (u + 1)^-s`` for ``v = 0..size-1``."""
    weights = np.arange(1, size + 1, dtype=np.float64) ** -exponent
    return weights / weights.sum()


def fill_demo_data(
    service: Aggregator, now: datetime | None = None, rng: np.random.Generator | None = None
) -> dict[str, int]:
    """Fill every served metric with simulated devices' perturbed reports; see the module
    docstring. Returns the reports stored per metric name: empty when the database
    already holds statistics (nothing is added then, so real data is never mixed with
    simulated data, and a second start adds nothing).

    ``rng`` perturbs the reports (and draws the RAPPOR secrets); ``None`` is the OS
    CSPRNG, as on a device. A seeded generator makes a reproducible demo.
    """
    if service.holds_statistics():
        return {}
    settings = service.settings
    hours = min(DEMO_HOURS, settings.dedupe_retention_hours)
    per_hour = max(DEMO_REPORTS_PER_HOUR, settings.min_reports)
    now = now or utc_now()
    current = now.replace(minute=0, second=0, microsecond=0)
    times = [current - timedelta(hours=h) for h in np.repeat(np.arange(hours), per_hour).tolist()]
    stored: dict[str, int] = {}
    for metric in service.catalog.latest():
        mechanism = service.catalog.mechanism(metric.name, metric.version)
        assert mechanism is not None
        payloads = _perturbed_payloads(metric, mechanism, len(times), rng)
        if payloads is None:
            continue
        dimensions = metric.dimension_set
        cells = demo_cells(dimensions.cell_count, hours, per_hour, settings.min_reports)
        reports = [
            Report(
                report_id=uuid.UUID(bytes=_random_bytes(16, rng), version=4),
                metric=metric.name,
                version=metric.version,
                payload=payload,
                time=time,
                dimensions=dimensions.values_of(cell) if dimensions else None,
            )
            for payload, time, cell in zip(payloads, times, cells.tolist(), strict=True)
        ]
        step = settings.max_batch_reports
        for start in range(0, len(reports), step):
            service.ingest(ReportBatch(reports=reports[start : start + step]), now)
        stored[metric.name] = len(reports)
    return stored


def demo_cells(cell_count: int, hours: int, per_hour: int, min_reports: int) -> np.ndarray:
    """The cell of each of ``hours * per_hour`` demo reports (hour by hour): hour h's
    reports in k = min(cells, max(1, per_hour // min_reports)) equal runs (the last one
    taking the remainder), run j in cell (h k + j) mod cells."""
    shares = min(cell_count, max(1, per_hour // min_reports))
    run = np.minimum(np.arange(per_hour) * shares // per_hour, shares - 1)
    hour = np.arange(hours)[:, None]
    return ((hour * shares + run[None, :]) % cell_count).ravel()


def simulated_values(metric: MetricSpec, mechanism: Mechanism[Any], n: int) -> np.ndarray | None:
    """The ``n`` simulated devices' true values for ``metric`` (the module docstring's
    populations), from a generator seeded by ``POPULATION_SEED`` and the metric's name;
    None for a metric the demo cannot simulate (a string metric without candidate strings)."""
    population = np.random.default_rng([POPULATION_SEED, zlib.crc32(metric.name.encode())])
    if mechanism.kind == "string":
        limit = getattr(metric.mechanism, "max_length", None)  # pem, sfp: the longest string
        fitting = [s for s in metric.labels or () if limit is None or len(s.encode()) <= limit]
        if not fitting:
            return None
        labels = np.array(fitting, dtype=object)
        return labels[population.choice(labels.size, size=n, p=zipf_shares(labels.size))]
    if (categories := as_categorical(mechanism)) is not None:
        d = categories.domain_size
        return population.choice(d, size=n, p=zipf_shares(d))
    if (numbers := as_numeric(mechanism)) is not None:
        span = numbers.upper - numbers.lower
        return numbers.lower + span * population.beta(2.0, 5.0, size=n)
    if as_attributes(mechanism) is not None:
        # the spec of an attributes mechanism is a MultiAttributeSpec
        return _attribute_rows(cast(MultiAttributeSpec, metric.mechanism), n, population)
    if (spec := as_distribution_spec(metric.mechanism)) is not None:
        share = population.beta(2.0, 5.0, size=n)
        if spec.scale == "log":
            return np.asarray(spec.lower * (spec.upper / spec.lower) ** share)
        return spec.lower + (spec.upper - spec.lower) * share
    return None


def _attribute_rows(
    spec: MultiAttributeSpec, n: int, population: np.random.Generator
) -> np.ndarray:
    """``n`` rows of a multi-attribute metric's values (the module docstring's population)."""
    columns: list[np.ndarray] = []
    previous: np.ndarray | None = None
    for attribute in spec.attributes:
        if attribute.domain_size is None:
            assert attribute.lower is not None and attribute.upper is not None
            span = attribute.upper - attribute.lower
            columns.append(attribute.lower + span * population.beta(2.0, 5.0, size=n))
            continue
        d = attribute.domain_size
        own = population.choice(d, size=n, p=zipf_shares(d))
        if previous is not None:
            own = np.where(population.random(n) < 0.5, previous % d, own)
        previous = own
        columns.append(own.astype(np.float64))
    return np.column_stack(columns)


def _perturbed_payloads(
    metric: MetricSpec, mechanism: Mechanism[Any], n: int, rng: np.random.Generator | None
) -> list[dict[str, Any]] | None:
    """The wire payloads of ``n`` simulated devices' reports, each device's value encoded
    by the metric's mechanism; None where ``simulated_values`` has no population."""
    values = simulated_values(metric, mechanism, n)
    if values is None:
        return None
    secrets = np.frombuffer(_random_bytes(SECRET_BYTES * n, rng), dtype=np.uint8)
    context = DeviceContext(secrets=secrets.reshape(n, SECRET_BYTES))  # fresh devices
    return mechanism.to_payloads(mechanism.encode(values.tolist(), rng, context))


def _random_bytes(size: int, rng: np.random.Generator | None) -> bytes:
    return os.urandom(size) if rng is None else rng.bytes(size)
