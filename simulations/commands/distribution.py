"""``ldp-sim distribution``: distribution mechanisms (``hh``, ``sw``), range, quantile and
Wasserstein errors against theory over a grid (``simulations.distribution``)."""

from __future__ import annotations

import argparse
from typing import Any

from simulations import distribution, report
from simulations.arguments import (
    check_cells,
    checked,
    list_of,
    one_of,
    positive_float,
    positive_int,
    run_options,
    user_count,
)
from simulations.text import HelpFormatter, counted

__all__ = ["QUICK", "register"]

#: The grid's defaults, and the smaller one ``--quick`` gives (an option given wins).
DEFAULTS: dict[str, Any] = {
    "shapes": list(distribution.SHAPES),
    "users": [10_000, 1_000_000, 100_000_000],
    "epsilons": [0.5, 1.0, 2.0, 4.0],
    "reps": 20,
}
QUICK: dict[str, Any] = {
    "shapes": ["normal", "lognormal"],
    "users": [10_000, 1_000_000],
    "epsilons": [1.0, 4.0],
    "reps": 5,
}
SHAPE_LINES = "\n".join(
    f"  {shape.name:<10} {shape.description}" for shape in distribution.SHAPES.values()
)

DESCRIPTION = f"""\
Distributions: each distribution mechanism (hh: hierarchical histogram; sw: square wave
with EMS) estimates the histogram, CDF, ranges and quantiles of a population of values,
over a grid of shapes, user counts and epsilons, every cell repeated --reps times.

Shapes (each truncated to its own domain and bucketed on its own scale; --scale
overrides the scale):
{SHAPE_LINES}

Measured per cell, against the users' own CDF: the MSE of --ranges random ranges of whole
buckets (uniform pairs of edges) and as many wide ones (more than a tenth of the buckets)
beside the variance the mechanism states (their ratio is 1 when it is right, with its
standard error over the runs); the quantiles' error at q = 0.5, 0.9, 0.95, 0.99 in value
units (against the shape's quantile) and in rank, |G(Q^) - q| with G the shape's CDF; the
Wasserstein-1 distance of the post-processed distribution (value units); and the share
of 95% intervals that hold the truth, for the quantiles (whole buckets: at least 0.95)
and for the CDF at every edge (0.95 when the stated variance is right).

The fast path draws the users' bucket counts (one multinomial) and the mechanism's
statistics from their law, in time independent of n (10^8 users cost what 10^4 do);
--path exact draws every user's value and encodes it with the mechanism's own encode.
--quick gives a smaller grid (shapes normal,lognormal, users 1e4,1e6, epsilons 1,4,
5 runs) where those options are not given. Work runs in this process, on a local Dask
cluster (--workers N) or on an existing one (--scheduler ADDRESS); the seed fixes the
results whatever runs them.

With --out DIR: results.csv (one row per cell), results.json (the rows and every run) and
distribution_SHAPE.png per shape (range MSE with the stated variance black and dashed,
the mean rank error and W1 against n, one panel per epsilon, one line per mechanism).
"""


def register(subparsers: Any) -> None:
    """Add the ``distribution`` subcommand."""
    parser = subparsers.add_parser(
        "distribution",
        help="distributions (hh, sw): ranges, quantiles, W1 against theory over a grid",
        description=DESCRIPTION,
        formatter_class=HelpFormatter,
        parents=[
            run_options(
                out_help="directory for results.csv, results.json, plots",
                reps=(
                    None,
                    f"runs per cell (default: {DEFAULTS['reps']}; --quick: {QUICK['reps']})",
                ),
                dask=True,
            )
        ],
    )
    names = distribution.distribution_mechanisms()
    parser.add_argument(
        "--mechanisms", type=list_of(one_of(names, "mechanism"), "mechanisms"), default=names,
        help=f"comma-separated, from {','.join(names)}",
    )  # fmt: skip
    shapes = list(distribution.SHAPES)
    parser.add_argument(
        "--shapes", type=list_of(one_of(shapes, "shape"), "shapes"),
        help=f"comma-separated, from {','.join(shapes)} (default: all; --quick: "
        f"{','.join(QUICK['shapes'])})",
    )  # fmt: skip
    parser.add_argument(
        "--users", type=list_of(user_count, "user counts"),
        help="numbers of users n, comma-separated (default: 1e4,1e6,1e8; --quick: 1e4,1e6)",
    )  # fmt: skip
    parser.add_argument(
        "--epsilons", type=list_of(positive_float, "epsilons"),
        help="privacy budgets, comma-separated (default: 0.5,1,2,4; --quick: 1,4)",
    )  # fmt: skip
    parser.add_argument(
        "--buckets", type=checked(positive_int), default=256,
        help="buckets D of the histogram (hh: a power of --branching)",
    )  # fmt: skip
    parser.add_argument(
        "--branching", type=checked(positive_int), default=4, help="hh: children per tree node"
    )
    parser.add_argument(
        "--scale", choices=["shape", "linear", "log"], default="shape",
        help="bucket edges: each shape's own scale, or equal widths, or equal ratios",
    )  # fmt: skip
    parser.add_argument(
        "--ranges", type=checked(positive_int), default=200,
        help="random ranges per run (and as many wide ones)",
    )  # fmt: skip
    parser.add_argument(
        "--path", choices=["exact", "fast"], default="fast",
        help="fast: counts and statistics drawn from their law; exact: every user encoded",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="a small grid (see above)")
    parser.set_defaults(run=_run, command_parser=parser)


def _grid(args: argparse.Namespace) -> dict[str, Any]:
    """Each grid option as given, else ``--quick``'s or the default."""
    preset = QUICK if args.quick else DEFAULTS
    return {name: getattr(args, name) or preset[name] for name in DEFAULTS}


def cells_of(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[Any]:
    """Every cell of the grid, each spec built once so that a bad one fails before work."""
    grid = _grid(args)
    scale = None if args.scale == "shape" else args.scale
    cells = [
        distribution.DistributionCell(
            mechanism, shape, epsilon, n, args.buckets, args.branching, scale
        )
        for mechanism in args.mechanisms
        for shape in grid["shapes"]
        for n in grid["users"]
        for epsilon in grid["epsilons"]
    ]
    check_cells(
        cells, parser, lambda cell: f"{cell.mechanism} on {cell.shape} at epsilon={cell.epsilon:g}"
    )
    return cells


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run the grid, print the table, write the results under ``--out``."""
    cells = cells_of(args, parser)
    run = distribution.simulate(
        cells, _grid(args)["reps"], args.path, args.seed, ranges=args.ranges,
        workers=args.workers, scheduler=args.scheduler, progress=not args.quiet,
    )  # fmt: skip
    print(report.format_table(run.rows, distribution.TABLE_COLUMNS))
    if args.out is not None:
        report.write_csv(args.out / "results.csv", run.rows)
        report.write_json(args.out / "results.json", {"cells": run.rows, "runs": run.runs})
        plots = distribution.plot_distribution(run.rows, args.out)
        print(f"wrote {args.out / 'results.csv'}, results.json and {counted(len(plots), 'plot')}")
    return 0
