"""``ldp-sim audit metric|training``: empirical lower bounds on epsilon beside the promised ones.

``metric`` audits metric specs (from a TOML file, from a running aggregator, or a sweep of
mechanisms and epsilons) through the device's encoding (``simulations.audit_metric``);
``training`` audits one round of a federated task per privacy mode with canaries
(``simulations.audit_training``). Both print a table and, with ``--out DIR``, write CSV,
JSON and a PNG of the lower bound against the declared (or accounted) epsilon
(``simulations.audit.audit_figure``), and exit with status 1 when some bound exceeds its
promise.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import ValidationError
from tqdm import tqdm

from shared.federated.privacy import PRIVACY_MODES
from shared.mechanisms import MECHANISMS, make_mechanism
from shared.schemas import MetricSpec
from simulations import report
from simulations.arguments import (
    checked,
    list_of,
    one_of,
    positive_float,
    positive_int,
    probability,
    run_options,
)
from simulations.audit import (
    audit_figure,
    chosen_metrics,
    metrics_from_config,
    metrics_from_endpoint,
)
from simulations.audit_attacks import DEFAULT_LIFETIME_REPORTS, attacks_for
from simulations.audit_metric import audit_metric, metric_for, sweep_spec
from simulations.audit_training import audit_many_runs, audit_one_run, dataset_round
from simulations.federated import DATASETS, load_dataset
from simulations.text import HelpFormatter, counted

__all__ = ["SWEEP_MECHANISMS", "TRAINING_MODES", "register"]

#: Every mechanism the registry builds, and ``auto`` (audited as what it resolves to).
SWEEP_MECHANISMS = (*MECHANISMS, "auto")
#: Every privacy mode of a federated task; by default the private ones are audited.
TRAINING_MODES = PRIVACY_MODES
DEFAULT_TRAINING_MODES = [mode for mode in TRAINING_MODES if mode != "none"]
METRIC_COLUMNS = (
    "metric mechanism view declared_epsilon lower_bound ratio tight violation trials seconds"
).split()
TRAINING_COLUMNS = (
    "mode method accounted_epsilon lower_bound ratio violation noise_multiplier trials seconds"
).split()

WHAT_A_BOUND_MEANS = """\
A lower bound L at confidence 1 - alpha means: if the code kept its promise, a bound
this high would come out at most alpha of the time. L above the promised epsilon is a
violation: the code that runs does not keep the promise. L below it does not prove the
promise: it is what this test, at this many trials, could show. --alpha holds for the
whole run: each of its k audits is at alpha / k (Bonferroni), so a run over honest code
reports a violation at most alpha of the time, however many audits it makes.
"""
METRIC_DESCRIPTION = (
    """\
Audit metrics black-box: run the device's encoding many times on two chosen inputs,
count the outputs in the event that best tells them apart (the outputs whose likelihood
ratio is the mechanism's largest), and turn the counts into a lower bound on epsilon
with Clopper-Pearson confidence (LDP-Auditor, Arcolezi and Gambs, PETS 2024), beside the
declared epsilon. Memoized metrics (and RAPPOR) are audited twice: one report of a fresh
device against epsilon_report, and --lifetime-reports reports of one device, decoded
into the permanent response they share, against the lifetime epsilon.

Metrics come from --config (a metrics TOML file), from --endpoint (a running
aggregator's public GET /v1/metrics), or else from a sweep of --mechanisms at
--epsilons with fixed other parameters. --path batch calls the mechanism's own
vectorized encode, the one the SDK calls; --path sdk records every trial through a real
TelemetryClient (fresh state directories, reports captured before they leave: nothing
reaches the aggregator), slower. Without --trials each view is sized from its own event
probabilities to reach --target times its epsilon at the median.

"""
    + WHAT_A_BOUND_MEANS
    + """
With --out DIR: metric_audit.csv, metric_audit.json and metric_audit.png (lower bound
against declared epsilon per mechanism and view). Exit status 1 on a violation.
"""
)
TRAINING_DESCRIPTION = (
    """\
Audit one round of a federated task per privacy mode with canaries: users whose update is
a fixed vector on a coordinate the other clients barely move, run through the code the
devices and the service run (clipping, the mode's noise, the server's aggregation), the
adversary scoring the projection of what it sees on the canary. In the silo mode
(record-level DP-SGD in each silo) a canary is a record of one silo, on a feature column
its other records leave at zero, and the adversary scores that silo's upload. Many runs:
rounds with and without the canary, a threshold chosen on --calibration of them, the
bound from --trials more of each (Jagielski et al. 2020). One run: --canaries canaries in
one round, each present with probability 1/2, --guesses guesses at each end of the
scores (Steinke, Nasr and Jagielski 2023). The bound is set beside the task accountant's
epsilon for the round, at --delta. The other clients are --clients shares of --dataset,
trained locally from the task's initial model; in the silo mode they are the silos, and
the audited one holds the first share.

"""
    + WHAT_A_BOUND_MEANS
    + """
With --out DIR: training_audit.csv, training_audit.json and training_audit.png. Exit
status 1 on a violation.
"""
)


def register(subparsers: Any) -> None:
    """Add the ``audit`` command and its ``metric`` and ``training`` subcommands."""
    parser = subparsers.add_parser(
        "audit",
        help="empirical lower bounds on epsilon: metrics and federated training",
        description="Privacy auditing: 'ldp-sim audit metric' and 'ldp-sim audit training'.",
        formatter_class=HelpFormatter,
    )
    commands = parser.add_subparsers(
        title="commands", dest="audit_command", required=True, metavar="COMMAND"
    )
    _register_metric(commands)
    _register_training(commands)


#: Alpha, delta and the target share lie in (0, 1); a sampling rate in (0, 1].
OPEN_PROBABILITY = checked(probability(zero=False, one=False))


def _audit_options() -> argparse.ArgumentParser:
    """The run options of both audits: ``--seed`` (default: the OS CSPRNG), ``--out``,
    ``--quiet``."""
    return run_options(
        seed_help="seed of the audit's randomness (default: the OS CSPRNG)", seed_default=None
    )


def _add_alpha(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--alpha", type=OPEN_PROBABILITY, default=0.05,
        help="a run over code that keeps its promises reports a violation with probability "
        "at most this (each of k audits at alpha / k)",
    )  # fmt: skip


def _register_metric(commands: Any) -> None:
    parser = commands.add_parser(
        "metric",
        help="audit metric specs through the device's encoding",
        description=METRIC_DESCRIPTION,
        formatter_class=HelpFormatter,
        parents=[_audit_options()],
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--config", type=Path, metavar="FILE", help="a metrics TOML file")
    source.add_argument("--endpoint", metavar="URL", help="a running aggregator")
    parser.add_argument(
        "--metric", dest="metrics", type=list_of(str, "metric names"), metavar="NAMES",
        help="with --config or --endpoint: audit only these (comma-separated)",
    )  # fmt: skip
    parser.add_argument(
        "--mechanisms", type=list_of(one_of(sorted(SWEEP_MECHANISMS), "mechanism"), "mechanisms"),
        help="sweep: comma-separated mechanisms (default: every one the registry builds, and "
        "auto)",
    )  # fmt: skip
    parser.add_argument(
        "--epsilons", type=list_of(positive_float, "epsilons"), default=[0.5, 1.0, 2.0, 4.0],
        help="sweep: epsilons, comma-separated",
    )  # fmt: skip
    parser.add_argument(
        "--domain-size", type=checked(positive_int), default=8, help="sweep: categories d"
    )
    parser.add_argument(
        "--trials", type=checked(positive_int),
        help="trials per input (default: sized for --target)",
    )  # fmt: skip
    parser.add_argument(
        "--target", type=OPEN_PROBABILITY, default=0.9,
        help="without --trials: the share of each event's epsilon to reach at the median",
    )  # fmt: skip
    parser.add_argument(
        "--max-trials", type=checked(positive_int), default=1_000_000,
        help="without --trials: at most this many per input",
    )  # fmt: skip
    parser.add_argument(
        "--lifetime-reports", type=checked(positive_int), default=DEFAULT_LIFETIME_REPORTS,
        help="reports of one device decoded in the lifetime audit",
    )  # fmt: skip
    parser.add_argument(
        "--path", choices=["batch", "sdk"], default="batch",
        help="batch: the mechanism's vectorized encode; sdk: a TelemetryClient per device",
    )  # fmt: skip
    _add_alpha(parser)
    parser.set_defaults(run=_run_metric, command_parser=parser)


def _register_training(commands: Any) -> None:
    parser = commands.add_parser(
        "training",
        help="audit a federated round per privacy mode with canaries",
        description=TRAINING_DESCRIPTION,
        formatter_class=HelpFormatter,
        parents=[_audit_options()],
    )
    parser.add_argument(
        "--modes", type=list_of(one_of(TRAINING_MODES, "mode"), "modes"),
        default=DEFAULT_TRAINING_MODES,
        help=f"comma-separated, from {','.join(TRAINING_MODES)}",
    )  # fmt: skip
    parser.add_argument(
        "--epsilons", type=list_of(positive_float, "epsilons"), default=[1.0, 2.0, 4.0],
        help="the task's target epsilon for its one round, comma-separated",
    )  # fmt: skip
    parser.add_argument(
        "--method", choices=["many-runs", "one-run", "both"], default="both",
        help="the classic audit over many rounds, the one-run audit, or both",
    )  # fmt: skip
    parser.add_argument(
        "--trials", type=checked(positive_int), default=4000,
        help="many runs: audited rounds with the canary, and as many without",
    )  # fmt: skip
    parser.add_argument(
        "--calibration", type=checked(positive_int), default=2000,
        help="many runs: further rounds of each that choose the threshold",
    )  # fmt: skip
    parser.add_argument(
        "--canaries", type=checked(positive_int), default=500,
        help="one run: canaries (at most the model's parameters)",
    )  # fmt: skip
    parser.add_argument(
        "--guesses", type=checked(positive_int), default=50,
        help="one run: guesses at each end of the scores",
    )  # fmt: skip
    parser.add_argument("--dataset", choices=DATASETS, default="digits", help="the clients' data")
    parser.add_argument(
        "--clients", type=checked(positive_int), default=10,
        help="the round's other clients (silo: the silos, the audited one holding the first "
        "share)",
    )  # fmt: skip
    parser.add_argument(
        "--participation", type=checked(probability(zero=False)), default=1.0,
        help="the task's sampling rate q (silo: of each DP-SGD step's records)",
    )  # fmt: skip
    parser.add_argument(
        "--steps", type=checked(positive_int), default=1,
        help="silo: the audited silo's DP-SGD steps in the round",
    )  # fmt: skip
    parser.add_argument(
        "--clip-norm", type=checked(positive_float), default=1.0,
        help="the task's clip norm C (silo: of each record's gradient)",
    )  # fmt: skip
    parser.add_argument("--delta", type=OPEN_PROBABILITY, default=1e-5, help="the task's delta")
    _add_alpha(parser)
    parser.set_defaults(run=_run_training, command_parser=parser)


# --- metric -------------------------------------------------------------------------------


def _metrics(args: argparse.Namespace) -> list[MetricSpec]:
    if args.config is not None:
        return chosen_metrics(metrics_from_config(args.config), args.metrics)
    if args.endpoint is not None:
        return chosen_metrics(metrics_from_endpoint(args.endpoint), args.metrics)
    if args.metrics is not None:
        raise ValueError("--metric needs --config or --endpoint")
    return [
        metric_for(sweep_spec(name, epsilon, args.domain_size))
        for name in args.mechanisms or SWEEP_MECHANISMS
        for epsilon in args.epsilons
    ]


def _rng(seed: int | None) -> np.random.Generator | None:
    return None if seed is None else np.random.default_rng(seed)


def _run_metric(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        metrics = _metrics(args)
    except (ValueError, ValidationError) as error:
        parser.error(str(error))
    if not metrics:
        parser.error("there are no metrics to audit")
    rng = _rng(args.seed)
    views = sum(
        len(attacks_for(make_mechanism(metric.mechanism), args.lifetime_reports))
        for metric in metrics
    )
    rows = []
    for metric in tqdm(metrics, desc="metrics", unit="metric", disable=args.quiet):
        results = audit_metric(
            metric, alpha=args.alpha / views, trials=args.trials, target=args.target,
            max_trials=args.max_trials, lifetime_reports=args.lifetime_reports,
            path=args.path, rng=rng,
        )  # fmt: skip
        rows += [result.row() for result in results]
    return _finish(
        rows, METRIC_COLUMNS, args.out, "metric_audit", "declared_epsilon",
        ("mechanism", "view"), "metric audit",
    )  # fmt: skip


# --- training -----------------------------------------------------------------------------


def _run_training(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    methods = ["many-runs", "one-run"] if args.method == "both" else [args.method]
    seed = 0 if args.seed is None else args.seed
    data = load_dataset(args.dataset, args.clients, "iid", seed)
    parameters = (data.num_features + 1) * data.num_classes
    if "one-run" in methods and not 2 * args.guesses <= args.canaries <= parameters:
        parser.error(
            f"--canaries must lie in 2 x --guesses ({2 * args.guesses}) .. the model's "
            f"{parameters} parameters, got {args.canaries}"
        )
    rng = _rng(args.seed)
    plan = [(m, mode, e) for m in methods for mode in args.modes for e in args.epsilons]
    try:  # every task checked before the first audit runs
        rounds = [
            dataset_round(
                data, mode, epsilon, canaries=args.canaries if method == "one-run" else 1,
                participation=args.participation, clip_norm=args.clip_norm, delta=args.delta,
                steps=args.steps, seed=seed,
            )  # fmt: skip
            for method, mode, epsilon in plan
        ]  # fmt: skip
    except ValueError as error:
        parser.error(f"the audited task is not valid: {error}")
    alpha = args.alpha / len(plan)
    rows = []
    audits = tqdm(
        list(zip(plan, rounds, strict=True)), desc="audits", unit="audit", disable=args.quiet
    )
    for (method, mode, epsilon), round_ in audits:
        if method == "many-runs":
            result = audit_many_runs(round_, args.trials, args.calibration, alpha, rng)
        else:
            result = audit_one_run(round_, args.canaries, args.guesses, alpha, rng)
        rows.append({"target_epsilon": epsilon if mode != "none" else math.inf, **result.row()})
    return _finish(
        rows, TRAINING_COLUMNS, args.out, "training_audit", "accounted_epsilon",
        ("mode", "method"), "training audit",
    )  # fmt: skip


# --- output -------------------------------------------------------------------------------


def _finish(
    rows: list[dict[str, Any]],
    columns: Sequence[str],
    out: Path | None,
    stem: str,
    promised: str,
    series: tuple[str, str],
    title: str,
) -> int:
    """Print the table; write CSV, JSON and PNG under ``out``; 1 if a bound exceeds its promise."""
    print(report.format_table(rows, columns))
    if out is not None:
        report.write_csv(out / f"{stem}.csv", rows)
        report.write_json(out / f"{stem}.json", rows)
        report.save_figure(audit_figure(rows, promised, series, title), out / f"{stem}.png")
        print(f"wrote {out / (stem + '.csv')}, {stem}.json and {stem}.png")
    violations = [row for row in rows if row["violation"]]
    if violations:
        print(
            f"{counted(len(violations), 'audit')} found a lower bound above the promised "
            "epsilon: the code does not keep its privacy promise",
            file=sys.stderr,
        )
        return 1
    return 0
