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

Reported: the throughput (records per second while recording, reports per second end to
end including the final flush), and the estimate against the truth: for a categorical
metric the MSE beside its analytical value ``mean_v Var[f_v]``, the largest error and
the share of 95% intervals that cover the truth; for a numeric one the error, the std
and whether the interval covers. ``fleet.png`` draws the estimate with its 95% intervals
beside the truth (:func:`estimate_figure`).
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import numpy as np
from pydantic import ValidationError
from tqdm import tqdm

from client import BudgetLimits, RetryPolicy, TelemetryClient
from shared.mechanisms import CategoricalMechanism, NumericMechanism, make_mechanism
from shared.schemas import (
    CATEGORICAL_MECHANISMS,
    MEMOIZED_MECHANISMS,
    NUMERIC_MECHANISMS,
    MechanismSpec,
)
from simulations import report
from simulations.populations import parse_categorical_shape, parse_numeric_shape
from simulations.server import start_server
from simulations.text import HelpFormatter, counted

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["estimate_figure", "register"]

#: The two-sided 95% normal quantile, as the aggregator's intervals use.
Z95 = 1.959964

DESCRIPTION = """\
Simulated devices report through the client SDK to a real aggregator: the check before
(or beside) a real deployment. Each device records one value drawn from --shape with the
SDK (spec fetched from the aggregator, privacy budget debited, value perturbed with the
operating system's secure randomness, uploaded over HTTP), and the aggregator's
published estimate is compared with the truth.

Without --endpoint it starts 'ldp-aggregator serve' on a free local port with a
temporary SQLite database and stops it afterwards; with --endpoint it uses that
aggregator and the keys given.

Devices are simulated by --groups client objects, each with its own state directory,
--threads of them recording at once. Every record draws fresh randomness, so the
aggregator sees one independent report per device.

Printed: throughput (records per second while recording, reports per second end to end)
and the error of the estimate against the truth, beside its theory. With --out DIR:
fleet.csv, fleet.json and fleet.png (the estimate with 95% intervals beside the truth).
"""


def register(subparsers: Any) -> None:
    """Add the ``fleet`` subcommand."""
    parser = subparsers.add_parser(
        "fleet",
        help="simulated devices through the SDK against a real aggregator",
        description=DESCRIPTION,
        formatter_class=HelpFormatter,
    )
    # A group's devices share one state directory, so a memoized mechanism would give the
    # devices of a group with one value one permanent response: those have their own
    # command (longitudinal), where every simulated device keeps its own memo.
    mechanisms = sorted(
        (CATEGORICAL_MECHANISMS | NUMERIC_MECHANISMS) - MEMOIZED_MECHANISMS - {"auto"}
    )
    parser.add_argument("--devices", type=int, default=10_000, help="simulated devices")
    parser.add_argument(
        "--mechanism", choices=mechanisms, default="grr", help="the metric's mechanism"
    )
    parser.add_argument("--epsilon", type=float, default=1.0, help="the metric's epsilon")
    parser.add_argument("--domain-size", type=int, default=16, help="categorical metrics")
    parser.add_argument("--lower", type=float, default=0.0, help="numeric metrics")
    parser.add_argument("--upper", type=float, default=1.0, help="numeric metrics")
    parser.add_argument(
        "--shape", help="categorical: uniform | zipf:S | counts:FILE (default zipf:1.1); "
        "numeric: uniform | normal:MEAN,SD | exponential:SCALE (default uniform)",
    )  # fmt: skip
    parser.add_argument("--groups", type=int, default=100, help="client objects (state dirs)")
    parser.add_argument("--threads", type=int, default=4, help="groups recording at once")
    parser.add_argument("--endpoint", help="an existing aggregator (default: start one)")
    parser.add_argument("--admin-key", help="with --endpoint: defines the metric")
    parser.add_argument("--device-key", help="with --endpoint: uploads the reports")
    parser.add_argument("--analyst-key", help="with --endpoint: reads the estimate")
    parser.add_argument("--seed", type=int, default=0, help="seed of the population")
    parser.add_argument(
        "--out", type=Path, metavar="DIR", help="directory for fleet.csv, fleet.json, fleet.png"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(run=_run, command_parser=parser)


def _spec(args: argparse.Namespace, parser: argparse.ArgumentParser) -> MechanismSpec:
    fields: dict[str, Any] = {"mechanism": args.mechanism, "epsilon": args.epsilon}
    if args.mechanism in NUMERIC_MECHANISMS:
        fields.update(lower=args.lower, upper=args.upper)
    else:
        fields["domain_size"] = args.domain_size
    try:
        return MechanismSpec.model_validate(fields)
    except ValidationError as error:
        parser.error(f"--mechanism {args.mechanism}: {error.errors()[0]['msg']}")


def _population(
    args: argparse.Namespace, parser: argparse.ArgumentParser, spec: MechanismSpec
) -> np.ndarray:
    """Every device's value, shuffled by the seed."""
    try:
        if spec.mechanism in NUMERIC_MECHANISMS:
            shape = parse_numeric_shape(args.shape or "uniform")
            population = shape.population(args.lower, args.upper, args.devices)
            values = np.repeat(population.levels, population.counts)
        else:
            categorical = parse_categorical_shape(args.shape or "zipf:1.1")
            counts = categorical.counts(args.domain_size, args.devices)
            values = np.repeat(np.arange(args.domain_size), counts)
    except ValueError as error:
        parser.error(str(error))
    np.random.default_rng(args.seed).shuffle(values)
    return values


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


def _compare(spec: MechanismSpec, values: np.ndarray, estimate: dict[str, Any]) -> dict[str, float]:
    mech = make_mechanism(spec)
    n = int(estimate["n"])
    if isinstance(mech, CategoricalMechanism):
        truth = _true_frequencies(values, mech.domain_size)
        rows = sorted(estimate["estimates"], key=lambda row: row["index"])
        frequencies = np.array([row["frequency"] for row in rows])
        std = np.array([row["std"] for row in rows])
        error = frequencies - truth
        p, q = mech.p, mech.q
        theory = np.mean(q * (1 - q) / (p - q) ** 2 + truth * (1 - p - q) / (p - q)) / n
        return {
            "mse": float(np.mean(error**2)),
            "variance": float(theory),
            "max_error": float(np.max(np.abs(error))),
            "coverage": float(np.mean(np.abs(error) <= Z95 * std)),
        }
    assert isinstance(mech, NumericMechanism)
    truth_mean = float(np.mean(values))
    mean_error = float(estimate["mean"]) - truth_mean
    return {
        "truth": truth_mean,
        "mean": float(estimate["mean"]),
        "error": mean_error,
        "std": float(estimate["std"]),
        "variance": float(np.mean(mech.report_variance(values))) / n,
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
        axes.set_xlabel("category index")
        axes.set_ylabel("frequency")
    axes.set_title(
        f"{spec.mechanism}, epsilon={spec.epsilon:g}, {counted(int(estimate['n']), 'report')}"
    )
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize="small")
    return figure


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.devices < 1 or args.groups < 1 or args.threads < 1:
        parser.error("--devices, --groups and --threads must be >= 1")
    if args.endpoint and not (args.admin_key and args.device_key and args.analyst_key):
        parser.error("--endpoint needs --admin-key, --device-key and --analyst-key")
    spec = _spec(args, parser)
    values = _population(args, parser, spec)
    metric = f"fleet.{args.mechanism}"
    with tempfile.TemporaryDirectory(prefix="ldp-fleet-") as tmp:
        workdir = Path(tmp)
        server = None
        if args.endpoint:
            url = args.endpoint.rstrip("/")
            keys = {"admin": args.admin_key, "device": args.device_key, "analyst": args.analyst_key}
        else:
            server = start_server(str(workdir / "aggregator.sqlite3"), workdir)
            url, keys = server.url, server.keys
        try:
            row, estimate = _drive(args, spec, values, metric, url, keys, workdir)
        finally:
            if server is not None:
                server.stop()
    columns = [c for c in row if c not in ("metric",)]
    print(report.format_table([row], columns))
    if args.out is not None:
        report.write_csv(args.out / "fleet.csv", [row])
        report.write_json(args.out / "fleet.json", row)
        report.save_figure(estimate_figure(spec, values, estimate), args.out / "fleet.png")
        print(f"wrote {args.out / 'fleet.csv'}, fleet.json and fleet.png")
    return 0


def _drive(
    args: argparse.Namespace,
    spec: MechanismSpec,
    values: np.ndarray,
    metric: str,
    url: str,
    keys: dict[str, str],
    workdir: Path,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Define the metric, run the fleet, fetch the estimate: (the result row, the estimate)."""
    definition = {
        "description": f"ldp-sim fleet: {counted(args.devices, 'simulated device')}",
        "mechanism": spec.model_dump(mode="json"),
    }
    with httpx.Client(base_url=url, timeout=60.0) as http:
        defined = http.put(
            f"/v1/metrics/{metric}",
            json=definition,
            headers={"Authorization": f"Bearer {keys['admin']}"},
        )
        if defined.status_code not in (200, 201):
            raise RuntimeError(f"defining {metric} failed: {defined.status_code} {defined.text}")
        version = int(defined.json()["version"])
        groups = np.array_split(values, min(args.groups, values.size))
        bar = tqdm(total=values.size, desc="devices", disable=args.quiet, unit="device")
        started = time.perf_counter()

        def run(index: int) -> tuple[float, bool]:
            outcome = _record_group(
                url, keys["device"], workdir / f"group-{index:05d}", metric, groups[index]
            )
            bar.update(groups[index].size)
            return outcome

        with ThreadPoolExecutor(max_workers=args.threads) as pool:
            outcomes = list(pool.map(run, range(len(groups))))
        elapsed = time.perf_counter() - started
        bar.close()
        response = http.get(
            f"/v1/metrics/{metric}/estimate",
            params={"version": version},
            headers={"Authorization": f"Bearer {keys['analyst']}"},
        )
        if response.status_code != 200:
            raise RuntimeError(f"the estimate failed: {response.status_code} {response.text}")
        estimate = response.json()
    recording = sum(seconds for seconds, _ in outcomes) / min(args.threads, len(groups))
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
