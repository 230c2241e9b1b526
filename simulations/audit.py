"""Privacy audits' inputs and picture: the metrics audited, and the lower bounds drawn.

``ldp-sim audit metric`` audits metric specs from a TOML file as ``ldp-aggregator serve
--config`` reads (:func:`metrics_from_config`), from a running aggregator's public
``GET /v1/metrics`` (:func:`metrics_from_endpoint`), or a sweep of mechanisms and epsilons,
through the device's encoding (``simulations.audit_metric``); ``ldp-sim audit training``
audits one round of a federated task per privacy mode with canaries
(``simulations.audit_training``). Both draw the lower bound against the declared (or
accounted) epsilon with :func:`audit_figure`; the commands are in
``simulations.commands.audit``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
from pydantic import ValidationError

from shared.schemas import MetricSpec
from simulations import report

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["audit_figure", "chosen_metrics", "metrics_from_config", "metrics_from_endpoint"]


def metrics_from_config(path: Path) -> list[MetricSpec]:
    """The metrics of a TOML file (``[metrics.NAME]`` tables, as the aggregator reads them),
    each as version 1; ValueError naming the file, metric and field."""
    from aggregator.registry import load_definitions

    return [
        MetricSpec(
            name=name,
            version=1,
            description=definition.description,
            mechanism=definition.mechanism,
            labels=definition.labels,
        )
        for name, definition in load_definitions(path).items()
    ]


def metrics_from_endpoint(url: str, timeout: float = 30.0) -> list[MetricSpec]:
    """The metrics a running aggregator publishes (``GET /v1/metrics``, no key needed);
    ValueError saying what went wrong."""
    address = url.rstrip("/") + "/v1/metrics"
    try:
        response = httpx.get(address, timeout=timeout)
        response.raise_for_status()
        items = response.json()
    except (httpx.HTTPError, ValueError) as error:
        raise ValueError(f"could not read the metrics from {address}: {error}") from None
    if not isinstance(items, list):
        raise ValueError(f"{address} did not return a list of metrics")
    try:
        return [MetricSpec.model_validate(item) for item in items]
    except ValidationError as error:
        raise ValueError(f"{address} returned a metric that is not valid: {error}") from None


def chosen_metrics(metrics: list[MetricSpec], names: Sequence[str] | None) -> list[MetricSpec]:
    if names is None:
        return metrics
    known = {metric.name: metric for metric in metrics}
    missing = [name for name in names if name not in known]
    if missing:
        raise ValueError(f"no metric named {', '.join(missing)}; there are {', '.join(known)}")
    return [known[name] for name in names]


def audit_figure(
    rows: Sequence[dict[str, Any]], promised: str, series: tuple[str, str], title: str
) -> Figure:
    """Left: the lower bound against the promised epsilon (column ``promised``), one line per
    value of the ``series`` pair of columns, the diagonal being the promise itself (a point
    above it is a violation). Right: the bound as a share of the promise, where the
    violations lie above 1 and a tight audit near it. Rows whose promise is infinite (no
    noise) are left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    finite = [row for row in rows if math.isfinite(row[promised])]
    keys = list(dict.fromkeys(tuple(row[column] for column in series) for row in finite))
    height = max(4.8, 0.2 * (len(keys) + 2))  # room for one legend line per series
    figure, (bounds, shares) = plt.subplots(1, 2, figsize=(11.5, height))
    for index, key in enumerate(keys):
        mine = sorted(
            (row for row in finite if tuple(row[column] for column in series) == key),
            key=lambda row: row[promised],
        )
        x = [row[promised] for row in mine]
        style = report.series_style(index)
        label = " ".join(str(part) for part in key)
        bounds.plot(x, [row["lower_bound"] for row in mine], label=label, **style)
        shares.plot(x, [row["lower_bound"] / row[promised] for row in mine], **style)
    top = max([row[promised] for row in finite] + [row["lower_bound"] for row in finite] + [1.0])
    bounds.plot([0, top], [0, top], report.THEORY_STYLE, color="grey", label="promised epsilon")
    shares.axhline(1.0, color="grey", linestyle=report.THEORY_STYLE)
    bounds.set_ylabel("empirical lower bound on epsilon")
    shares.set_ylabel("lower bound / promised epsilon (above 1: violation)")
    for axes in (bounds, shares):
        axes.set_xlabel(promised.replace("_", " "))
        axes.grid(True, alpha=0.3)
    shares.set_ylim(0.0, max([1.1] + [row["lower_bound"] / row[promised] for row in finite]))
    figure.suptitle(title)
    handles, labels = bounds.get_legend_handles_labels()
    shares.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize="x-small")
    return figure
