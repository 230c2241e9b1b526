"""``ldp-sim fleet``: simulated devices report through the client SDK to a real aggregator
(``simulations.fleet``)."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from shared.schemas import (
    CATEGORICAL_MECHANISMS,
    MEMOIZED_MECHANISMS,
    NUMERIC_MECHANISMS,
    MechanismSpec,
)
from simulations import report
from simulations.arguments import run_options
from simulations.fleet import (
    FleetSetup,
    comparison_rows,
    estimate_figure,
    fleet_labels,
    fleet_values,
    run_fleet,
)
from simulations.server import start_server
from simulations.text import HelpFormatter, counted

__all__ = ["COMPARISON_COLUMNS", "register"]

#: The estimate beside the truth, printed under the summary (and in fleet_estimates.csv).
COMPARISON_COLUMNS = "index label truth estimate std ci_low ci_high error covers".split()
#: Categories printed; a larger domain prints the most frequent (all are in the CSV).
PRINTED_CATEGORIES = 64

DESCRIPTION = """\
Simulated devices report through the client SDK to a real aggregator: the check before
(or beside) a real deployment. Each device records one value drawn from --shape with the
SDK (spec fetched from the aggregator, privacy budget debited, value perturbed with the
operating system's secure randomness, uploaded over HTTP), and the aggregator's
published estimate is compared with the truth.

Without --endpoint it starts 'ldp-aggregator serve' on a free local port with a
temporary SQLite database and stops it afterwards; with --endpoint it uses that
aggregator and the keys given. A categorical metric is defined with its category names
(labels): the first column of a counts:FILE shape, else 'category 0', 'category 1', ...

Devices are simulated by --groups client objects, each with its own state directory,
--threads of them recording at once. Every record draws fresh randomness, so the
aggregator sees one independent report per device.

Printed: throughput (records per second while recording, reports per second end to end)
and the error of the estimate against its theory, then the estimate beside the truth
for each category (numeric: the mean) with its 95% interval. With --out DIR: fleet.csv,
fleet.json, fleet_estimates.csv (the estimate beside the truth) and fleet.png (the
estimate with 95% intervals beside the truth).
"""


def register(subparsers: Any) -> None:
    """Add the ``fleet`` subcommand."""
    parser = subparsers.add_parser(
        "fleet",
        help="simulated devices through the SDK against a real aggregator",
        description=DESCRIPTION,
        formatter_class=HelpFormatter,
        parents=[
            run_options(
                seed_help="seed of the population",
                out_help="directory for fleet.csv, fleet.json, fleet_estimates.csv, fleet.png",
            )
        ],
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


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.devices < 1 or args.groups < 1 or args.threads < 1:
        parser.error("--devices, --groups and --threads must be >= 1")
    if args.endpoint and not (args.admin_key and args.device_key and args.analyst_key):
        parser.error("--endpoint needs --admin-key, --device-key and --analyst-key")
    spec = _spec(args, parser)
    try:
        values = fleet_values(spec, args.shape, args.devices, args.seed)
        labels = fleet_labels(spec, args.shape)
    except ValueError as error:
        parser.error(str(error))
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
        setup = FleetSetup(url, keys, workdir, args.groups, args.threads, not args.quiet)
        try:
            row, estimate = run_fleet(spec, values, labels, metric, setup)
        finally:
            if server is not None:
                server.stop()
    print(report.format_table([row], [c for c in row if c != "metric"]))
    comparison = comparison_rows(spec, values, estimate)
    print()
    print(_comparison_table(metric, comparison))
    if args.out is not None:
        report.write_csv(args.out / "fleet.csv", [row])
        report.write_json(args.out / "fleet.json", row)
        report.write_csv(args.out / "fleet_estimates.csv", comparison)
        report.save_figure(estimate_figure(spec, values, estimate), args.out / "fleet.png")
        print(f"wrote {args.out / 'fleet.csv'}, fleet.json, fleet_estimates.csv and fleet.png")
    return 0


def _comparison_table(metric: str, rows: list[dict[str, Any]]) -> str:
    """The estimate beside the truth, every category (or the most frequent ones)."""
    heading = f"{metric}: the estimate beside the truth"
    shown = rows
    if len(rows) > PRINTED_CATEGORIES:
        shown = sorted(rows, key=lambda row: -row["truth"])[:PRINTED_CATEGORIES]
        total = counted(len(rows), "category", "categories")
        heading += (
            f" (the {PRINTED_CATEGORIES} most frequent of {total}; every one with --out, "
            "in fleet_estimates.csv)"
        )
    return heading + "\n" + report.format_table(shown, COMPARISON_COLUMNS)
