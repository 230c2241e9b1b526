"""``ldp-sim dpsgd``: DP-SGD on one dataset, test accuracy against record-level epsilon
(``simulations.dpsgd``)."""

from __future__ import annotations

import argparse
import logging
import math
from typing import Any

from tqdm import tqdm

from simulations import report
from simulations.arguments import (
    checked,
    epsilon_or_inf,
    list_of,
    one_of,
    positive_float,
    positive_int,
    run_options,
)
from simulations.dpsgd import (
    DATASETS,
    MODELS,
    SYNTHETIC_RECORDS,
    DPSGDRun,
    Records,
    load_records,
    plot_accuracy,
    run_dpsgd,
    settings_for,
)
from simulations.text import HelpFormatter

__all__ = ["COLUMNS", "register"]


DESCRIPTION = """\
DP-SGD (Abadi et al. 2016) on one dataset: the test accuracy of a model trained with
record-level differential privacy, against the target epsilon, beside the non-private
baseline (epsilon inf: the same training, clipped, without noise).

Every step samples each record with probability q = 1 / ceil(N / B) (Poisson sampling),
clips each record's gradient to the clip norm, adds Gaussian noise to the sum and divides
by the expected batch size; the noise multiplier is calibrated so that all the steps of
all the epochs spend the target epsilon at the given delta.

Datasets (from scikit-learn, nothing downloaded): digits, the 8x8 handwritten digits
(1,797 images, 10 classes, 20% held out); synthetic, a 4-class task of --records
training records (10^5 by default) and 5,000 held out. Defaults per dataset: digits
batch 64, 20 epochs, learning rate 1, clip norm 1; synthetic batch 256, 5 epochs,
learning rate 1, clip norm 1.

With --out DIR: results.csv (one row per run), epochs.csv (accuracy per epoch),
results.json and accuracy.png (final accuracy against epsilon).
"""


def register(subparsers: Any) -> None:
    """Add the ``dpsgd`` subcommand."""
    parser = subparsers.add_parser(
        "dpsgd",
        help="DP-SGD on one dataset: accuracy against record-level epsilon",
        description=DESCRIPTION,
        formatter_class=HelpFormatter,
        parents=[run_options(seed_help="seed of the data and training")],
    )
    parser.add_argument(
        "--datasets", type=list_of(one_of(DATASETS, "dataset"), "datasets"), default=["digits"],
        help=f"comma-separated, from {','.join(DATASETS)}",
    )  # fmt: skip
    parser.add_argument(
        "--models", type=list_of(one_of(MODELS, "model"), "models"), default=list(MODELS),
        help=f"comma-separated, from {','.join(MODELS)}",
    )  # fmt: skip
    parser.add_argument(
        "--epsilons", type=list_of(epsilon_or_inf, "epsilons"), default=[1.0, 3.0, 8.0, math.inf],
        help="target epsilons, comma-separated; inf: clipping without noise",
    )  # fmt: skip
    parser.add_argument("--delta", type=float, default=1e-5, help="the delta of (epsilon, delta)")
    parser.add_argument(
        "--epochs", type=checked(positive_int), help="epochs (default: per dataset)"
    )
    parser.add_argument(
        "--batch-size",
        type=checked(positive_int),
        help="expected batch size B (default: per dataset)",
    )
    parser.add_argument(
        "--learning-rate", type=checked(positive_float), help="step size (default: per dataset)"
    )
    parser.add_argument(
        "--clip-norm",
        type=checked(positive_float),
        help="per-record clip norm C (default: per dataset)",
    )
    parser.add_argument(
        "--records", type=checked(positive_int), default=SYNTHETIC_RECORDS,
        help="training records of the synthetic dataset",
    )  # fmt: skip
    parser.add_argument(
        "--accounting", choices=["pld", "rdp"], default="pld",
        help="the accountant that calibrates the noise and reports epsilon",
    )  # fmt: skip
    parser.set_defaults(run=_run, command_parser=parser)


COLUMNS = [
    "dataset", "model", "target_epsilon", "epsilon_spent", "noise_multiplier",
    "final_accuracy", "epochs", "batch_size", "seconds_per_epoch",
]  # fmt: skip


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if not 0 < args.delta < 1:
        parser.error(f"--delta must lie in (0, 1), got {args.delta}")
    # dp-accounting logs a warning for every RDP order it cannot evaluate (and excludes);
    # the bound stays valid, and the run's table says what it spent.
    logging.getLogger("absl").setLevel(logging.ERROR)
    overrides = {
        "batch_size": args.batch_size, "epochs": args.epochs,
        "learning_rate": args.learning_rate, "clip_norm": args.clip_norm,
    }  # fmt: skip
    plan = [(d, m, e) for d in args.datasets for m in args.models for e in args.epsilons]
    loaded: dict[str, Records] = {}
    runs: list[DPSGDRun] = []
    for dataset, model, epsilon in tqdm(plan, desc="DP-SGD runs", disable=args.quiet):
        if dataset not in loaded:
            loaded[dataset] = load_records(dataset, args.seed, args.records)
        settings = settings_for(dataset, **overrides)
        try:
            run = run_dpsgd(
                loaded[dataset], model, epsilon, settings, args.delta, args.accounting, args.seed
            )
        except (ValueError, ArithmeticError) as error:
            parser.error(f"{dataset}, {model}, epsilon {epsilon:g}: {error}")
        runs.append(run)
    rows = [run.row() for run in runs]
    print(report.format_table(rows, COLUMNS))
    if args.out is not None:
        report.write_csv(args.out / "results.csv", rows)
        per_epoch = [
            {"dataset": r.dataset, "model": r.model, "target_epsilon": r.target_epsilon,
             "epoch": i + 1, "accuracy": a}
            for r in runs
            for i, a in enumerate(r.accuracy)
        ]  # fmt: skip
        report.write_csv(args.out / "epochs.csv", per_epoch)
        report.write_json(args.out / "results.json", {"runs": rows, "epochs": per_epoch})
        plot_accuracy(rows, args.out / "accuracy.png")
        print(f"wrote {args.out / 'results.csv'}, epochs.csv, results.json and accuracy.png")
    return 0
