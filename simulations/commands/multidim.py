"""``ldp-sim multidim``: several private attributes per report (``spl``, ``smp``, ``rsfd``),
per-attribute and per-marginal errors against the stated variance over a grid
(``simulations.multidim``)."""

from __future__ import annotations

import argparse
from typing import Any

from simulations import multidim, report
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
from simulations.populations import parse_categorical_shape
from simulations.text import HelpFormatter, counted

__all__ = ["QUICK", "register"]

#: The grid's defaults, and the smaller one ``--quick`` gives (an option given wins).
DEFAULTS: dict[str, Any] = {
    "users": [100_000, 1_000_000],
    "epsilons": [0.5, 1.0, 2.0, 4.0],
    "reps": 20,
}
QUICK: dict[str, Any] = {"users": [100_000], "epsilons": [1.0, 4.0], "reps": 5}

DESCRIPTION = """\
Several private attributes in one report: each protocol (spl: the budget split over the
views; smp: each device reports one view, sampled, with the whole budget; rsfd: one
sampled view reported truly and the others with fake data; auto: the one with the lowest
summed planning variance) estimates every attribute and the joint cells of the declared
pairs, over a grid of epsilons and user counts, every cell repeated --reps times.

The users: --attributes attributes (a0, a1, ...), of --domains categories each (one size
for all, or one per attribute; num for a number on [0, 1]), categorical marginals from
--shape, joined by an equicorrelated Gaussian copula: Z_j = sqrt(rho) S + sqrt(1 - rho)
E_j with S and E_j independent standard normals (a latent S shared by all attributes),
so that corr(Z_i, Z_j) = rho = --correlation; each attribute is its marginal's quantile
at Phi(Z_j). Views: the declared --pairs, then every attribute in no pair.

Measured per cell and target (an attribute, or a pair's joint cells), against the users'
own shares: the MSE per value (per cell of a pair; of the mean for a number), the
variance the estimate states (at the observed counts) and their ratio with its 95%
interval over the runs (1 when the stated variance is right), the mean absolute error,
and the share of 95% intervals that hold the truth. Method: direct (the attribute's own
reports) or consistent (the projection of the pairs that hold it).

The fast path draws each chunk's statistics from their law given the users' rows (the
mechanism's simulate_statistics); --path exact encodes and aggregates every user.
--quick gives a smaller grid (users 1e5, epsilons 1,4, 5 runs) where those options are
not given. Work runs in this process, on a local Dask cluster (--workers N) or on an
existing one (--scheduler ADDRESS); the seed fixes the results whatever runs them.

With --out DIR: results.csv (one row per cell and target), results.json (the rows and
every run's sums) and multidim_n-N.png per n (MSE per value, per joint cell and of the
means against epsilon, one line per protocol, the stated variance black and dashed).
"""


def domain_size(text: str) -> int | None:
    """A categorical domain size >= 2, or ``num`` (a number on [0, 1]: None)."""
    if text == "num":
        return None
    size = positive_int(text)
    if size < 2:
        raise ValueError(f"{text!r}: a categorical attribute needs at least 2 categories")
    return size


def register(subparsers: Any) -> None:
    """Add the ``multidim`` subcommand."""
    parser = subparsers.add_parser(
        "multidim",
        help="several attributes per report (spl, smp, rsfd): attributes and pairs against theory",
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
    parser.add_argument(
        "--protocols", type=list_of(one_of(multidim.PROTOCOLS, "protocol"), "protocols"),
        default=list(multidim.PROTOCOLS),
        help=f"comma-separated, from {','.join(multidim.PROTOCOLS)}",
    )  # fmt: skip
    parser.add_argument(
        "--oracle", type=checked(one_of(multidim.ORACLES, "oracle")), default="auto",
        help="frequency oracle of the categorical views (auto: the lower variance per view)",
    )  # fmt: skip
    parser.add_argument(
        "--attributes", type=checked(positive_int), default=5, help="attributes per report"
    )
    parser.add_argument(
        "--domains", type=list_of(domain_size, "domains"), default=[8],
        help="categories per attribute: one size for all or one per attribute, comma-"
        "separated; num for a number on [0, 1]",
    )  # fmt: skip
    parser.add_argument(
        "--shape", type=checked(parse_categorical_shape), default="zipf:1.1",
        help="the categorical marginals: uniform or zipf:S (share of v proportional to "
        "(v + 1)^-S)",
    )  # fmt: skip
    parser.add_argument(
        "--correlation", type=float, default=0.5,
        help="rho of the Gaussian copula, in [0, 1)",
    )  # fmt: skip
    parser.add_argument(
        "--pairs", default="0:1",
        help="declared pairs: none, all (every pair of categorical attributes), or I:J,... "
        "(attribute indices)",
    )  # fmt: skip
    parser.add_argument(
        "--users", type=list_of(user_count, "user counts"),
        help="numbers of users n, comma-separated (default: 1e5,1e6; --quick: 1e5)",
    )  # fmt: skip
    parser.add_argument(
        "--epsilons", type=list_of(positive_float, "epsilons"),
        help="privacy budgets of the whole report, comma-separated (default: 0.5,1,2,4; "
        "--quick: 1,4)",
    )  # fmt: skip
    parser.add_argument(
        "--path", choices=["exact", "fast"], default="fast",
        help="fast: statistics drawn from their law; exact: every user encoded",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="a small grid (see above)")
    parser.set_defaults(run=_run, command_parser=parser)


def _grid(args: argparse.Namespace) -> dict[str, Any]:
    """Each grid option as given, else ``--quick``'s or the default."""
    preset = QUICK if args.quick else DEFAULTS
    return {name: getattr(args, name) or preset[name] for name in DEFAULTS}


def population_of(args: argparse.Namespace, parser: argparse.ArgumentParser) -> multidim.Population:
    """The population the options describe; a usage error says what is wrong."""
    domains = list(args.domains)
    if len(domains) == 1:
        domains *= args.attributes
    elif len(domains) != args.attributes:
        parser.error(
            f"--domains lists {counted(len(domains), 'size')} for "
            f"{counted(args.attributes, 'attribute')}: give one size, or one per attribute"
        )
    try:
        population = multidim.Population(tuple(domains), args.shape, args.correlation)
        for size in domains:
            if size is not None:
                args.shape.shares(size)
    except ValueError as error:
        parser.error(str(error))
    return population


def cells_of(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[Any]:
    """Every cell of the grid, each mechanism built once so that a bad spec fails before work."""
    grid = _grid(args)
    population = population_of(args, parser)
    try:
        pairs = multidim.parse_pairs(args.pairs, population)
    except ValueError as error:
        parser.error(f"--pairs: {error}")
    cells = [
        multidim.MultidimCell(protocol, epsilon, n, population, pairs, args.oracle)
        for protocol in args.protocols
        for n in grid["users"]
        for epsilon in grid["epsilons"]
    ]
    check_cells(cells, parser, lambda cell: f"{cell.protocol} at epsilon={cell.epsilon:g}")
    return cells


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run the grid, print the table, write the results under ``--out``."""
    cells = cells_of(args, parser)
    run = multidim.simulate(
        cells, _grid(args)["reps"], args.path, args.seed, workers=args.workers,
        scheduler=args.scheduler, progress=not args.quiet,
    )  # fmt: skip
    print(report.format_table(run.rows, multidim.TABLE_COLUMNS))
    if args.out is not None:
        report.write_csv(args.out / "results.csv", run.rows)
        report.write_json(args.out / "results.json", {"rows": run.rows, "runs": run.runs})
        plots = multidim.plot_multidim(run.rows, args.out)
        print(f"wrote {args.out / 'results.csv'}, results.json and {counted(len(plots), 'plot')}")
    return 0
