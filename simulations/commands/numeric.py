"""``ldp-sim numeric``: mean estimation, error against theory over a grid
(``simulations.accuracy``)."""

from __future__ import annotations

import argparse
from typing import Any

from shared.schemas import MEMOIZED_MECHANISMS, NUMERIC_MECHANISMS
from simulations import accuracy
from simulations.arguments import checked, list_of, one_of
from simulations.commands.sweep import (
    SWEEP_DETAILS,
    add_grid_options,
    finish,
    grid_options,
    validated,
)
from simulations.populations import parse_numeric_shape
from simulations.text import HelpFormatter

__all__ = ["COLUMNS", "register"]

#: ``ratio_se``: the ratio's standard error, ratio * sqrt(2 / reps) (see
#: ``simulations.accuracy.summarize``).
COLUMNS = (
    "mechanism epsilon n shape path reps mse variance ratio ratio_se max_error coverage seconds"
).split()

DESCRIPTION = (
    "Mean estimation: the error of each numeric mechanism's mean against its analytical\n"
    "variance, over a grid of mechanisms, epsilons, user counts and data shapes. The ratio\n"
    "of the two is printed with its standard error, ratio x sqrt(2 / reps).\n\n" + SWEEP_DETAILS
)


def register(subparsers: Any) -> None:
    """Add the ``numeric`` subcommand."""
    parser = subparsers.add_parser(
        "numeric",
        help="mean estimation: error against theory over a grid",
        description=DESCRIPTION,
        formatter_class=HelpFormatter,
        parents=[grid_options()],
    )
    names = sorted(NUMERIC_MECHANISMS - MEMOIZED_MECHANISMS)
    parser.add_argument(
        "--mechanisms",
        type=list_of(one_of(names, "mechanism"), "mechanisms"),
        default=names,
        help=f"comma-separated, from {','.join(names)}",
    )
    parser.add_argument("--lower", type=float, default=0.0, help="lowest value (clipped)")
    parser.add_argument("--upper", type=float, default=1.0, help="highest value (clipped)")
    parser.add_argument(
        "--shape",
        action="append",
        type=checked(parse_numeric_shape),
        help="uniform | normal:MEAN,SD | exponential:SCALE (repeat for several; default uniform)",
    )
    add_grid_options(parser)
    parser.set_defaults(run=_run, command_parser=parser)


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run the grid, print the table, write the results under ``--out``."""
    if not args.lower < args.upper:
        parser.error(f"--lower ({args.lower}) must be below --upper ({args.upper})")
    shapes = args.shape or [parse_numeric_shape("uniform")]
    cells = [
        accuracy.NumericCell(m, e, n, s, args.lower, args.upper)
        for m in args.mechanisms
        for e in args.epsilons
        for n in args.users
        for s in shapes
    ]
    validated(parser, cells)
    outcomes = accuracy.run_numeric(
        cells, args.reps, args.path, args.seed, workers=args.workers,
        scheduler=args.scheduler, progress=not args.quiet,
    )  # fmt: skip
    rows = accuracy.summarize(outcomes)
    for row in rows:
        del row["d"], row["topk_recall"]
    return finish(args, rows, outcomes, COLUMNS, "numeric", ["n", "shape"])
