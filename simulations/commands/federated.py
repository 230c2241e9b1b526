"""``ldp-sim federated``: private federated learning, accuracy against epsilon and clients
(``simulations.federated``)."""

from __future__ import annotations

import argparse
import logging
import math
import tempfile
from pathlib import Path
from typing import Any

from tqdm import tqdm

from simulations import report
from simulations.arguments import (
    checked,
    epsilon_or_inf,
    list_of,
    one_of,
    positive_int,
    run_options,
    user_count,
)
from simulations.federated import (
    DATASETS,
    MODES,
    PARTITIONS,
    Dataset,
    FederatedRun,
    load_dataset,
    plot_accuracy,
    run_task,
    run_task_over_http,
    task_config,
)
from simulations.server import start_server
from simulations.text import HelpFormatter, counted

__all__ = ["COLUMNS", "register"]

COLUMNS = [
    "dataset", "partition", "clients", "mode", "target_epsilon", "epsilon_spent",
    "final_accuracy", "best_accuracy", "noise_multiplier", "clients_per_round",
    "secure_aggregation", "seconds",
]  # fmt: skip


DESCRIPTION = """\
Private federated learning: the test accuracy of the global model against the target
epsilon and the number of clients, for each privacy mode (none: plain FedAvg; local,
central, distributed: user-level differential privacy; silo: each client a silo running
DP-SGD over its records, record-level differential privacy).

Datasets (from scikit-learn, nothing downloaded): digits, the 8x8 handwritten digits
(1,797 images, 10 classes, 20% held out); synthetic, a 4-class task with two training
examples per client, meant for 100,000 clients. Partitions: iid (equal shuffled shares)
or label-skew (sorted by label, then cut, so that a client holds one or two classes).

Every round each client takes part with a fixed probability, trains locally from the
global model, clips and noises its update, and the round is aggregated and its privacy
cost charged. Runs in this process, or with --over-http through a real aggregator.

With --out DIR: results.csv (one row per run), rounds.csv (accuracy per round),
results.json and accuracy.png (final accuracy against epsilon).
"""


def register(subparsers: Any) -> None:
    """Add the ``federated`` subcommand."""
    parser = subparsers.add_parser(
        "federated",
        help="private federated learning: accuracy against epsilon and clients",
        description=DESCRIPTION,
        formatter_class=HelpFormatter,
        parents=[run_options(seed_help="seed of the data and training")],
    )
    parser.add_argument(
        "--datasets", type=list_of(one_of(DATASETS, "dataset"), "datasets"), default=["digits"],
        help=f"comma-separated, from {','.join(DATASETS)}",
    )  # fmt: skip
    parser.add_argument(
        "--clients", type=list_of(user_count, "client counts"), default=[100, 1000],
        help="numbers of clients, comma-separated",
    )  # fmt: skip
    parser.add_argument(
        "--partition", type=list_of(one_of(PARTITIONS, "partition"), "partitions"), default=["iid"],
        help=f"comma-separated, from {','.join(PARTITIONS)}",
    )  # fmt: skip
    parser.add_argument(
        "--modes", type=list_of(one_of(MODES, "mode"), "modes"), default=list(MODES),
        help=f"privacy modes, comma-separated, from {','.join(MODES)}",
    )  # fmt: skip
    parser.add_argument(
        "--epsilons", type=list_of(epsilon_or_inf, "epsilons"), default=[1.0, 3.0, 8.0, math.inf],
        help="target epsilons, comma-separated; inf: clipping without noise",
    )  # fmt: skip
    parser.add_argument(
        "--rounds", type=checked(positive_int), default=100, help="training rounds per run"
    )
    parser.add_argument("--delta", type=float, default=1e-5, help="the delta of (epsilon, delta)")
    parser.add_argument(
        "--model", choices=["logistic", "mlp"], default="logistic", help="the model trained"
    )
    parser.add_argument(
        "--secure-aggregation", action="store_true",
        help="distributed tasks run every round through SecAgg+ (the server sees only the sum)",
    )  # fmt: skip
    parser.add_argument(
        "--dropout", type=float, default=0.0,
        help="with --secure-aggregation (in process): the chance a sampled device drops out "
        "of a round after advertising its keys",
    )  # fmt: skip
    parser.add_argument("--over-http", action="store_true", help="through a real aggregator")
    parser.set_defaults(run=_run, command_parser=parser)


def _plan(args: argparse.Namespace) -> list[tuple[str, int, str, str, float]]:
    plan = []
    for dataset in args.datasets:
        for clients in args.clients:
            for partition in args.partition:
                for mode in args.modes:
                    for epsilon in [math.inf] if mode == "none" else args.epsilons:
                        plan.append((dataset, clients, partition, mode, epsilon))
    return plan


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if not 0 < args.delta < 1:
        parser.error(f"--delta must lie in (0, 1), got {args.delta}")
    if not 0 <= args.dropout < 1:
        parser.error(f"--dropout must lie in [0, 1), got {args.dropout}")
    if args.dropout and not args.secure_aggregation:
        parser.error("--dropout applies to --secure-aggregation runs")
    if args.dropout and args.over_http:
        parser.error("--dropout is simulated in process; over HTTP devices do not drop")
    # dp-accounting logs a warning for every RDP order it cannot evaluate (and excludes);
    # the bound stays valid, and the run's table says what it spent.
    logging.getLogger("absl").setLevel(logging.ERROR)
    plan = _plan(args)
    runs: list[FederatedRun] = []
    server = None
    workdir = tempfile.TemporaryDirectory(prefix="ldp-sim-federated-")
    try:
        if args.over_http:
            server = start_server(
                str(Path(workdir.name) / "aggregator.sqlite3"), Path(workdir.name)
            )
        loaded: dict[tuple[str, int, str], Dataset] = {}
        for dataset, clients, partition, mode, epsilon in tqdm(
            plan, desc="federated tasks", disable=args.quiet, unit="task"
        ):
            key = (dataset, clients, partition)
            if key not in loaded:
                loaded[key] = load_dataset(dataset, clients, partition, args.seed)
            data = loaded[key]
            try:
                config = task_config(
                    data, mode, epsilon, args.rounds, args.delta, args.model, args.seed,
                    args.secure_aggregation,
                )  # fmt: skip
            except ValueError as error:
                parser.error(f"{dataset} over {counted(clients, 'client')}, {mode}: {error}")
            if server is None:
                runs.append(run_task(data, config, epsilon, args.seed, args.dropout))
            else:
                runs.append(
                    run_task_over_http(data, config, epsilon, args.seed, server.url, server.keys)
                )
    finally:
        if server is not None:
            server.stop()
        workdir.cleanup()
    rows = [run.row() for run in runs]
    print(report.format_table(rows, COLUMNS))
    if args.out is not None:
        report.write_csv(args.out / "results.csv", rows)
        per_round = [
            {**{k: run.row()[k] for k in ("dataset", "partition", "clients", "mode",
                                          "target_epsilon")}, "round": i + 1, "accuracy": a}
            for run in runs
            for i, a in enumerate(run.accuracy)
        ]  # fmt: skip
        report.write_csv(args.out / "rounds.csv", per_round)
        report.write_json(args.out / "results.json", {"runs": rows, "rounds": per_round})
        plot_accuracy(rows, args.out / "accuracy.png")
        print(f"wrote {args.out / 'results.csv'}, rounds.csv, results.json and accuracy.png")
    return 0
