"""``ldp-sim attack``: fake devices against every estimate, with and without each defence
(``simulations.attack``; federated model poisoning: ``simulations.federated_attack``)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from simulations import report
from simulations.arguments import (
    checked,
    list_of,
    one_of,
    positive_float,
    positive_int,
    probability,
    run_options,
    user_count,
)
from simulations.attack import (
    DEFENCES,
    NUMERIC_DEFENCES,
    AttackConfig,
    run_attacks,
    run_numeric_attacks,
)
from simulations.attacks import ATTACKS, FORGEABLE, NUMERIC_ATTACKS
from simulations.federated_attack import (
    FEDERATED_ATTACK_MODES,
    MODEL_ATTACKS,
    run_federated_attack,
)
from simulations.text import HelpFormatter

__all__ = ["COLUMNS", "NUMERIC_COLUMNS", "register"]

COLUMNS = (
    "mechanism d n beta attack defence gain gain_se theory z gain_ratio honest_mse_ratio"
).split()
NUMERIC_COLUMNS = "mechanism n beta attack defence shift shift_se theory z honest_mse_ratio".split()
FEDERATED_COLUMNS = (
    "mode secure server fraction malicious attack clean_accuracy attacked_accuracy accuracy_loss"
).split()
NUMERIC_MECHANISMS = ("laplace", "duchi", "piecewise")

DESCRIPTION = """\
Poisoning: a fraction beta of fake devices promotes r target categories (random-value,
random-item or maximal-gain reports, Cao, Jia and Gong 2021) or moves a mean (mean-max,
mean-min, variance); the table gives the frequency gain of the targets (or the shift of
the mean) against the attack's theory (z), with each defence: normalization (Norm-Sub),
refusal (the mechanism's refusal rules), detection (fake users by frequent itemsets, for
the unary encodings and olh), robust (laplace's winsorized mean). gain_ratio: the gain
with the defence over the gain without; honest_mse_ratio: what the defence costs an
honest estimate (MSE with it over MSE without, no attack). The memoized lgrr, lsue, loue
and losue are attacked one report per device, at --epsilon per report. With --federated,
model-poisoning clients (updates scaled to the clipping norm) and the accuracy each mode
loses."""


def register(subparsers: Any) -> None:
    """Add the ``attack`` subcommand."""
    parser = subparsers.add_parser(
        "attack",
        help="poisoning: fake devices against the estimates, with and without defences",
        description=DESCRIPTION,
        formatter_class=HelpFormatter,
        parents=[
            run_options(
                reps=(5, "runs per cell (a standard error needs 2)"),
                out_help="directory for frequency.csv, numeric.csv, federated.csv, results.json",
            )
        ],
    )
    parser.add_argument(
        "--mechanisms",
        type=_or_none(list_of(one_of(FORGEABLE, "mechanism"), "mechanisms")),
        default=["grr", "oue", "olh"],
        help=f"categorical, comma-separated, from {','.join(FORGEABLE)}; none: skip them",
    )
    parser.add_argument(
        "--attacks",
        type=list_of(one_of(ATTACKS, "attack"), "attacks"),
        default=["mga"],
        help=f"comma-separated, from {','.join(ATTACKS)}",
    )
    parser.add_argument(
        "--defences",
        type=list_of(one_of(DEFENCES, "defence"), "defences"),
        default=list(DEFENCES),
        help=f"comma-separated, from {','.join(DEFENCES)}",
    )
    parser.add_argument(
        "--betas",
        type=list_of(probability(zero=False, one=False), "betas"),
        default=[0.01, 0.05],
        help="fractions of fake devices among all (0.001 to 0.1)",
    )
    parser.add_argument(
        "--epsilon",
        type=checked(positive_float),
        default=1.0,
        help="what one report reveals (lgrr, lsue, loue, losue: their epsilon_report)",
    )
    parser.add_argument(
        "--epsilon-lifetime",
        type=checked(positive_float),
        default=None,
        help="lgrr, lsue, loue, losue: the bound per distinct value (default 2 x --epsilon)",
    )
    parser.add_argument("--domain", type=checked(positive_int), default=1024, help="d")
    parser.add_argument("--users", type=checked(user_count), default=100_000, help="honest devices")
    parser.add_argument("--targets", type=checked(positive_int), default=10, help="r")
    parser.add_argument(
        "--zipf", type=float, default=1.1, help="honest values ~ Zipf(S) (0: uniform)"
    )
    parser.add_argument(
        "--numeric",
        type=list_of(one_of(NUMERIC_MECHANISMS, "mechanism"), "mechanisms"),
        default=[],
        help=f"numeric mechanisms too, from {','.join(NUMERIC_MECHANISMS)}",
    )
    parser.add_argument(
        "--numeric-attacks",
        type=list_of(one_of(NUMERIC_ATTACKS, "attack"), "attacks"),
        default=["mean-max"],
        help=f"comma-separated, from {','.join(NUMERIC_ATTACKS)}",
    )
    parser.add_argument(
        "--numeric-defences",
        type=list_of(one_of(NUMERIC_DEFENCES, "defence"), "defences"),
        default=list(NUMERIC_DEFENCES),
        help=f"comma-separated, from {','.join(NUMERIC_DEFENCES)}",
    )
    parser.add_argument(
        "--federated",
        action="store_true",
        help="model-poisoning clients against the --federated-modes (digits)",
    )
    parser.add_argument(
        "--federated-fractions",
        type=list_of(probability(one=False), "fractions"),
        default=[0.0, 0.1, 0.2],
        help="shares of malicious clients (0: the clean run)",
    )
    parser.add_argument(
        "--federated-modes",
        type=list_of(one_of(FEDERATED_ATTACK_MODES, "mode"), "modes"),
        default=list(FEDERATED_ATTACK_MODES),
        help=f"comma-separated, from {','.join(FEDERATED_ATTACK_MODES)}",
    )
    parser.add_argument(
        "--federated-rounds", type=checked(positive_int), default=20, help="training rounds"
    )
    parser.add_argument(
        "--federated-clients", type=checked(positive_int), default=100, help="clients W"
    )
    parser.add_argument(
        "--federated-epsilon",
        type=checked(positive_float),
        default=4.0,
        help="the federated tasks' target epsilon",
    )
    parser.add_argument(
        "--model-attack",
        choices=MODEL_ATTACKS,
        default="sign-flip",
        help="what malicious clients send (simulations.federated_attack: its docstring)",
    )
    parser.add_argument(
        "--secure-aggregation",
        action="store_true",
        help="the distributed mode through secure aggregation",
    )
    parser.set_defaults(run=_run, command_parser=parser)


def _or_none(parse: Callable[[str], list[str]]) -> Callable[[str], list[str]]:
    """``parse``, or the empty list for ``none``."""

    def parse_or_none(text: str) -> list[str]:
        return [] if text == "none" else parse(text)

    return parse_or_none


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run the grids, print the tables; under ``--out`` write one CSV per table
    (frequency.csv, numeric.csv, federated.csv) and results.json."""
    try:
        config = AttackConfig(
            mechanisms=args.mechanisms, attacks=args.attacks, betas=args.betas,
            defences=args.defences, epsilon=args.epsilon,
            epsilon_lifetime=args.epsilon_lifetime, domain=args.domain,
            users=args.users, targets=args.targets, zipf=args.zipf, reps=args.reps,
            seed=args.seed, numeric=args.numeric, numeric_attacks=args.numeric_attacks,
            numeric_defences=args.numeric_defences,
        )  # fmt: skip
    except ValueError as error:
        parser.error(str(error))
    progress = None if args.quiet else (lambda text: print(f"  {text}", flush=True))
    results: dict[str, list[dict[str, Any]]] = {}
    if config.mechanisms:
        results["frequency"] = run_attacks(config, progress)
        print(report.format_table(results["frequency"], COLUMNS))
    if config.numeric:
        results["numeric"] = run_numeric_attacks(config, progress)
        print(report.format_table(results["numeric"], NUMERIC_COLUMNS))
    if args.federated:
        results["federated"] = run_federated_attack(
            modes=args.federated_modes, fractions=args.federated_fractions,
            attack=args.model_attack, epsilon=args.federated_epsilon,
            rounds=args.federated_rounds, clients=args.federated_clients, seed=args.seed,
            secure=args.secure_aggregation,
        )  # fmt: skip
        print(report.format_table(results["federated"], FEDERATED_COLUMNS))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        for kind, rows in results.items():
            report.write_csv(args.out / f"{kind}.csv", rows)
        report.write_json(args.out / "results.json", results)
        print(f"wrote {', '.join(f'{kind}.csv' for kind in results)} and results.json")
    return 0
