"""``ldp-sim frequency``: frequency oracles, error against theory over a grid
(``simulations.accuracy``)."""

from __future__ import annotations

import argparse
from typing import Any

from shared.schemas import CATEGORICAL_MECHANISMS, MEMOIZED_MECHANISMS
from simulations import accuracy
from simulations.arguments import checked, list_of, one_of, positive_int
from simulations.commands.sweep import (
    SWEEP_DETAILS,
    add_grid_options,
    finish,
    grid_options,
    validated,
)
from simulations.populations import parse_categorical_shape
from simulations.text import HelpFormatter

__all__ = ["COLUMNS", "register"]

COLUMNS = (
    "mechanism resolved epsilon d n shape path reps mse variance ratio max_error coverage "
    "topk_recall seconds"
).split()

DESCRIPTION = (
    "Frequency oracles: the error of each mechanism's frequency estimates against its\n"
    "analytical variance, over a grid of mechanisms, epsilons, domain sizes, user counts\n"
    "and data shapes.\n\n" + SWEEP_DETAILS
)


def register(subparsers: Any) -> None:
    """Add the ``frequency`` subcommand."""
    parser = subparsers.add_parser(
        "frequency",
        help="frequency oracles: error against theory over a grid",
        description=DESCRIPTION,
        formatter_class=HelpFormatter,
        parents=[grid_options()],
    )
    # Memoized mechanisms have their own command (longitudinal): one report costs less
    # than their epsilon, so a grid over epsilon alone does not describe them.
    categorical = sorted(CATEGORICAL_MECHANISMS - MEMOIZED_MECHANISMS)
    parser.add_argument(
        "--mechanisms",
        type=list_of(one_of(categorical, "mechanism"), "mechanisms"),
        default=[m for m in categorical if m != "auto"],
        help=f"comma-separated, from {','.join(categorical)}",
    )
    parser.add_argument(
        "--domain-sizes",
        type=list_of(positive_int, "domain sizes"),
        default=[16, 1024],
        help="numbers of categories d, comma-separated",
    )
    parser.add_argument(
        "--shape",
        action="append",
        type=checked(parse_categorical_shape),
        help="uniform | zipf:S | counts:FILE (repeat for several; default zipf:1.1)",
    )
    add_grid_options(parser)
    parser.set_defaults(run=_run, command_parser=parser)


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run the grid, print the table, write the results under ``--out``."""
    shapes = args.shape or [parse_categorical_shape("zipf:1.1")]
    cells = [
        accuracy.FrequencyCell(m, e, d, n, s)
        for m in args.mechanisms
        for e in args.epsilons
        for d in args.domain_sizes
        for n in args.users
        for s in shapes
    ]
    validated(parser, cells)
    outcomes = accuracy.run_frequency(
        cells, args.reps, args.path, args.seed, workers=args.workers,
        scheduler=args.scheduler, progress=not args.quiet,
    )  # fmt: skip
    rows = accuracy.summarize(outcomes)
    return finish(args, rows, outcomes, COLUMNS, "frequency", ["d", "n", "shape"])
