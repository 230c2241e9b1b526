"""``ldp-sim fleet``: simulated devices report through the client SDK to a real aggregator.

The deployment check before (or beside) a real one: N devices hold values drawn from a
shape, each records its value with :class:`client.TelemetryClient` (spec fetched from
the aggregator, durable ledger debit, perturbation with the OS CSPRNG, outbox, upload
over HTTP), and the aggregator's published estimate is compared with the truth.

Without ``--endpoint`` it starts ``ldp-aggregator serve`` on a free loopback port with
a temporary SQLite database and stops it afterwards; with ``--endpoint`` it uses that
aggregator and the keys given (``--admin-key`` to define the metric, ``--device-key``,
``--analyst-key``).

Devices are simulated by ``--groups`` client objects, each with its own state
directory, recording for their share of the devices in ``--threads`` threads. A group
shares one ledger, so its caps are set to fit all of its devices' reports; every
``record`` still draws fresh randomness, so the aggregator sees N independent reports.

A categorical metric is defined with ``labels``, its category names (the first column of
a ``counts:FILE`` shape, else ``category 0`` .. ``category d-1``), so that the aggregator's
estimate and the dashboard name each category.

Reported (:func:`run_fleet`): the throughput (records per second while recording, reports
per second end to end including the final flush), and the estimate against the truth: for
a categorical metric the MSE beside its analytical value ``mean_v Var[f_v]``, the largest
error and the share of 95% intervals that cover the truth; for a numeric one the error,
the std and whether the interval covers. :func:`comparison_rows` sets the estimate beside
the truth category by category (numeric: the mean), and :func:`estimate_figure` draws
them with the 95% intervals.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import numpy as np
from tqdm import tqdm

from client import BudgetLimits, RetryPolicy, TelemetryClient
from shared.mechanisms import as_categorical, as_numeric, make_mechanism
from shared.schemas import (
    NUMERIC_MECHANISMS,
    MechanismSpec,
)
from simulations.populations import parse_categorical_shape, parse_numeric_shape
from simulations.text import counted

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "FleetSetup",
    "comparison_rows",
    "estimate_figure",
    "fleet_labels",
    "fleet_values",
    "run_fleet",
]

#: The two-sided 95% normal quantile, as the aggregator's intervals use.
Z95 = 1.959964
#: Categories named on the x axis of :func:`estimate_figure` (more: indices only).
NAMED_TICKS = 32


def fleet_values(spec: MechanismSpec, shape: str | None, devices: int, seed: int) -> np.ndarray:
    """Every device's value, drawn from ``shape`` (categorical default ``zipf:1.1``, numeric
    ``uniform``) and shuffled by ``seed``; ValueError naming a shape that does not fit."""
    mech = make_mechanism(spec)
    if (numbers := as_numeric(mech)) is not None:
        population = parse_numeric_shape(shape or "uniform").population(
            numbers.lower, numbers.upper, devices
        )
        values = np.repeat(population.levels, population.counts)
    else:
        d = _domain_size(spec)
        counts = parse_categorical_shape(shape or "zipf:1.1").counts(d, devices)
        values = np.repeat(np.arange(d), counts)
    np.random.default_rng(seed).shuffle(values)
    return values


def fleet_labels(spec: MechanismSpec, shape: str | None) -> tuple[str, ...] | None:
    """The metric's category names (``CategoricalShape.labels``); None for a numeric one."""
    if spec.mechanism in NUMERIC_MECHANISMS:
        return None
    return parse_categorical_shape(shape or "zipf:1.1").labels(_domain_size(spec))


def _domain_size(spec: MechanismSpec) -> int:
    """The categories of a categorical fleet metric's spec."""
    categories = as_categorical(make_mechanism(spec))
    assert categories is not None  # a fleet metric is categorical or numeric
    return categories.domain_size


def _record_group(
    url: str, key: str, state_dir: Path, metric: str, values: np.ndarray
) -> tuple[float, bool]:
    """One client object records its devices' values and flushes; (record seconds, delivered)."""
    per_metric = math.ceil(len(values) * 16)  # every device's report fits one shared ledger
    limits = BudgetLimits(
        per_metric_per_period=float(per_metric),
        total_per_period=float(per_metric) * 2,
        lifetime=math.inf,  # one client object stands for many devices
    )
    with TelemetryClient(
        url,
        key,
        state_dir,
        limits=limits,
        batch_size=256,
        upload_interval=3600.0,  # batches leave when 256 wait, and at flush
        retry=RetryPolicy(base=0.05, cap=1.0),
    ) as client:
        started = time.perf_counter()
        for value in values.tolist():
            client.record(metric, value)
        recording = time.perf_counter() - started
        delivered = client.flush(timeout=120.0)
    return recording, delivered


def _true_frequencies(values: np.ndarray, domain_size: int) -> np.ndarray:
    """The share of devices holding each category 0..d-1."""
    return np.bincount(values.astype(np.int64), minlength=domain_size) / values.size


def comparison_rows(
    spec: MechanismSpec, values: np.ndarray, estimate: dict[str, Any]
) -> list[dict[str, Any]]:
    """The published ``estimate`` beside the truth of the simulated ``values``: one row per
    category (``index``, ``label``), or one row ``mean`` for a numeric metric, with the
    ``truth``, the ``estimate``, its ``std``, the 95% interval [``ci_low``, ``ci_high``],
    the ``error`` (estimate - truth) and whether the interval ``covers`` the truth."""
    if spec.mechanism in NUMERIC_MECHANISMS:
        items = [{**estimate, "index": "", "label": "mean", "truth": float(np.mean(values))}]
        key = "mean"
    else:
        ordered = sorted(estimate["estimates"], key=lambda row: row["index"])
        truth = _true_frequencies(values, len(ordered))
        items = [{**row, "truth": float(truth[row["index"]])} for row in ordered]
        key = "frequency"
    rows = []
    for item in items:
        error = float(item[key]) - item["truth"]
        rows.append(
            {
                "index": item["index"],
                "label": item.get("label") or str(item["index"]),
                "truth": item["truth"],
                "estimate": float(item[key]),
                "std": float(item["std"]),
                "ci_low": float(item["ci_low"]),
                "ci_high": float(item["ci_high"]),
                "error": error,
                "covers": float(item["ci_low"]) <= item["truth"] <= float(item["ci_high"]),
            }
        )
    return rows


def _compare(spec: MechanismSpec, values: np.ndarray, estimate: dict[str, Any]) -> dict[str, float]:
    mech = make_mechanism(spec)
    n = int(estimate["n"])
    if (categories := as_categorical(mech)) is not None:
        truth = _true_frequencies(values, categories.domain_size)
        rows = sorted(estimate["estimates"], key=lambda row: row["index"])
        frequencies = np.array([row["frequency"] for row in rows])
        std = np.array([row["std"] for row in rows])
        error = frequencies - truth
        p, q = categories.p, categories.q
        theory = np.mean(q * (1 - q) / (p - q) ** 2 + truth * (1 - p - q) / (p - q)) / n
        return {
            "mse": float(np.mean(error**2)),
            "variance": float(theory),
            "max_error": float(np.max(np.abs(error))),
            "coverage": float(np.mean(np.abs(error) <= Z95 * std)),
        }
    numbers = as_numeric(mech)
    assert numbers is not None  # a fleet metric is categorical or numeric
    truth_mean = float(np.mean(values))
    mean_error = float(estimate["mean"]) - truth_mean
    return {
        "truth": truth_mean,
        "mean": float(estimate["mean"]),
        "error": mean_error,
        "std": float(estimate["std"]),
        "variance": float(np.mean(numbers.report_variance(values))) / n,
        "coverage": float(abs(mean_error) <= Z95 * float(estimate["std"])),
    }


def estimate_figure(spec: MechanismSpec, values: np.ndarray, estimate: dict[str, Any]) -> Figure:
    """The aggregator's published ``estimate`` beside the truth of the simulated ``values``.

    Categorical: the true frequency of each category as a bar, the unbiased estimate as a
    point and its 95% interval [``ci_low``, ``ci_high``] (f +- 1.96 std) as a vertical line.
    Numeric: the true mean as a horizontal line, the estimated mean and its 95% interval.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.4))
    if spec.mechanism in NUMERIC_MECHANISMS:
        axes.axhline(float(np.mean(values)), color="C0", label="true mean")
        axes.vlines([0], [estimate["ci_low"]], [estimate["ci_high"]], color="C1")
        axes.plot([0], [estimate["mean"]], "o", color="C1", label="estimate, 95% interval")
        axes.set_xticks([])
        axes.set_ylabel("mean")
    else:
        rows = sorted(estimate["estimates"], key=lambda row: row["index"])
        index = np.array([row["index"] for row in rows])
        truth = _true_frequencies(values, len(rows))
        axes.bar(index, truth, color="C0", alpha=0.4, label="truth")
        axes.vlines(
            index, [row["ci_low"] for row in rows], [row["ci_high"] for row in rows], color="C1"
        )
        axes.plot(
            index, [row["frequency"] for row in rows], "o", ms=3, color="C1",
            label="estimate, 95% interval",
        )  # fmt: skip
        axes.axhline(0.0, color="grey", linewidth=0.6)
        names = [row.get("label") for row in rows]
        if all(names) and len(rows) <= NAMED_TICKS:
            axes.set_xticks(index, names, rotation=45, ha="right", fontsize="small")
            axes.set_xlabel("category")
        else:
            axes.set_xlabel("category index")
        axes.set_ylabel("frequency")
    axes.set_title(
        f"{spec.mechanism}, epsilon={spec.epsilon:g}, {counted(int(estimate['n']), 'report')}"
    )
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize="small")
    return figure


@dataclass(frozen=True)
class FleetSetup:
    """Where and how the fleet reports: the aggregator's ``url`` and its ``keys`` (``admin``
    defines the metric, ``device`` uploads, ``analyst`` reads the estimate), ``groups``
    client objects with their state directories under ``workdir``, ``threads`` of them
    recording at once."""

    url: str
    keys: dict[str, str]
    workdir: Path
    groups: int
    threads: int
    progress: bool = True


def run_fleet(
    spec: MechanismSpec,
    values: np.ndarray,
    labels: tuple[str, ...] | None,
    metric: str,
    setup: FleetSetup,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Define ``metric`` (``spec`` and ``labels``), let every device record its value, fetch
    the estimate: (the result row, the published estimate)."""
    definition: dict[str, Any] = {
        "description": f"ldp-sim fleet: {counted(values.size, 'simulated device')}",
        "mechanism": spec.model_dump(mode="json"),
    }
    if labels is not None:
        definition["labels"] = list(labels)
    with httpx.Client(base_url=setup.url, timeout=60.0) as http:
        defined = http.put(
            f"/v1/metrics/{metric}",
            json=definition,
            headers={"Authorization": f"Bearer {setup.keys['admin']}"},
        )
        if defined.status_code not in (200, 201):
            raise RuntimeError(f"defining {metric} failed: {defined.status_code} {defined.text}")
        version = int(defined.json()["version"])
        groups = np.array_split(values, min(setup.groups, values.size))
        bar = tqdm(total=values.size, desc="devices", disable=not setup.progress, unit="device")
        started = time.perf_counter()

        def run(index: int) -> tuple[float, bool]:
            outcome = _record_group(
                setup.url, setup.keys["device"], setup.workdir / f"group-{index:05d}", metric,
                groups[index],
            )  # fmt: skip
            bar.update(groups[index].size)
            return outcome

        with ThreadPoolExecutor(max_workers=setup.threads) as pool:
            outcomes = list(pool.map(run, range(len(groups))))
        elapsed = time.perf_counter() - started
        bar.close()
        response = http.get(
            f"/v1/metrics/{metric}/estimate",
            params={"version": version},
            headers={"Authorization": f"Bearer {setup.keys['analyst']}"},
        )
        if response.status_code != 200:
            raise RuntimeError(f"the estimate failed: {response.status_code} {response.text}")
        estimate = response.json()
    recording = sum(seconds for seconds, _ in outcomes) / min(setup.threads, len(groups))
    row = {
        "metric": metric,
        "mechanism": spec.mechanism,
        "epsilon": spec.epsilon,
        "devices": int(values.size),
        "counted": int(estimate["n"]),
        "delivered": all(delivered for _, delivered in outcomes),
        "records_per_s": values.size / recording if recording > 0 else math.inf,
        "reports_per_s": values.size / elapsed,
        "seconds": elapsed,
        **_compare(spec, values, estimate),
    }
    return row, estimate
