"""Metric versions: ``metric_versions``, and the change stamp the catalog polls.

A metric's spec is immutable once reports may exist (``aggregator/registry.py``): a
definition whose spec or labels differ from the current version's is stored as a new
version; one that differs in its description alone rewrites the current version. Every
change writes a new random token to the ``METRICS_CHANGE`` row of ``schema_info``, so
that ``metrics_stamp`` (one indexed read) tells a reader whether to parse the
definitions again.
"""

from __future__ import annotations

import json
import secrets
import time

from sqlalchemy import func, insert, select, update
from sqlalchemy.engine import Connection

from aggregator.repositories.database import Repository
from aggregator.repositories.schema import METRICS_CHANGE, metric_versions, schema_info
from shared.schemas import MetricDefinition, MetricSpec

__all__ = ["MetricsRepository"]


class MetricsRepository(Repository):
    """Every version of every metric."""

    def metrics(self) -> list[MetricSpec]:
        """Every version of every metric, by name then version."""
        with self.database.read() as conn:
            rows = conn.execute(
                select(
                    metric_versions.c.name, metric_versions.c.version, metric_versions.c.definition
                ).order_by(metric_versions.c.name, metric_versions.c.version)
            ).all()
        return [_metric(row.name, row.version, row.definition) for row in rows]

    def metrics_stamp(self) -> tuple[str, int]:
        """A cheap token that differs after any change to the metric versions.

        ``(change token, number of versions)``: ``define_metric`` writes a new random
        token whenever it adds a version or changes a definition; the count also catches
        versions added by a writer that does not (an older aggregator). One indexed read,
        where ``metrics()`` parses every definition.
        """
        token = select(schema_info.c.value).where(schema_info.c.key == METRICS_CHANGE)
        count = select(func.count()).select_from(metric_versions)
        with self.database.read() as conn:
            row = conn.execute(select(token.scalar_subquery(), count.scalar_subquery())).one()
        return str(row[0]), int(row[1])

    def define_metric(self, name: str, definition: MetricDefinition) -> tuple[MetricSpec, bool]:
        """Store ``definition`` as ``name``'s current version; ``(metric, created)``.

        A new version when the spec or labels differ from the current version's (or
        there is none); otherwise the description is updated in place.
        """
        document = definition.model_dump_json(exclude_none=True)
        with self.database.write() as conn:
            if self.database.dialect == "postgresql":  # serialize definers of one name
                conn.exec_driver_sql(
                    "SELECT pg_advisory_xact_lock(hashtext(%(name)s))", {"name": name}
                )
            row = conn.execute(
                select(metric_versions.c.version, metric_versions.c.definition)
                .where(metric_versions.c.name == name)
                .order_by(metric_versions.c.version.desc())
                .limit(1)
            ).first()
            if row is not None and _metric(name, row.version, row.definition).same_spec(definition):
                if document != row.definition:
                    conn.execute(
                        update(metric_versions)
                        .where(metric_versions.c.name == name)
                        .where(metric_versions.c.version == row.version)
                        .values(definition=document)
                    )
                    _changed(conn)
                return _metric(name, row.version, document), False
            version = 1 if row is None else row.version + 1
            conn.execute(
                insert(metric_versions).values(
                    name=name, version=version, definition=document, created_at=time.time()
                )
            )
            _changed(conn)
            return _metric(name, version, document), True


def _changed(conn: Connection) -> None:
    """A new change token: every reader of ``metrics_stamp`` sees the metrics changed."""
    conn.execute(
        update(schema_info)
        .where(schema_info.c.key == METRICS_CHANGE)
        .values(value=secrets.token_hex(8))
    )


def _metric(name: str, version: int, document: str) -> MetricSpec:
    return MetricSpec.model_validate({**json.loads(document), "name": name, "version": version})
