"""``ldp-sim frequency`` and ``ldp-sim numeric``: accuracy sweeps against theory.

What they run and write is told to users in their ``--help`` (``SWEEP_DETAILS``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from pydantic import ValidationError

from shared.schemas import CATEGORICAL_MECHANISMS, MEMOIZED_MECHANISMS, NUMERIC_MECHANISMS
from simulations import accuracy, report
from simulations.arguments import positive_float, positive_int
from simulations.populations import parse_categorical_shape, parse_numeric_shape
from simulations.text import HelpFormatter, counted

__all__ = ["register"]

T = TypeVar("T")

FREQUENCY_COLUMNS = (
    "mechanism resolved epsilon d n shape path reps mse variance ratio max_error coverage "
    "topk_recall seconds"
).split()
NUMERIC_COLUMNS = (
    "mechanism epsilon n shape path reps mse variance ratio max_error coverage seconds"
).split()

SWEEP_DETAILS = """\
Every cell of the grid is repeated --reps times. The fast path draws each mechanism's
sufficient statistics from their exact law, so its cost does not grow with the number
of users; the exact path encodes every user. Work runs in this process, on a local Dask
cluster (--workers N) or on an existing one (--scheduler ADDRESS); the seed fixes the
results whatever runs them.

With --out DIR: results.csv (one row per cell), results.json (the rows and every
repetition) and PNG plots of the error against epsilon, the theory dashed.
"""
FREQUENCY_DESCRIPTION = (
    "Frequency oracles: the error of each mechanism's frequency estimates against its\n"
    "analytical variance, over a grid of mechanisms, epsilons, domain sizes, user counts\n"
    "and data shapes.\n\n" + SWEEP_DETAILS
)
NUMERIC_DESCRIPTION = (
    "Mean estimation: the error of each numeric mechanism's mean against its analytical\n"
    "variance, over a grid of mechanisms, epsilons, user counts and data shapes.\n\n"
    + SWEEP_DETAILS
)


def _list_of(kind: Callable[[str], T], what: str) -> Callable[[str], list[T]]:
    """An argparse type: a comma-separated list of ``kind``, refused with a message."""

    def parse(text: str) -> list[T]:
        items = [part.strip() for part in text.split(",") if part.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {what}")
        try:
            return [kind(item) for item in items]
        except ValueError as error:
            raise argparse.ArgumentTypeError(f"{what}: {error}") from None

    return parse


def _users(text: str) -> int:
    """An integer, also written as 1e9 or 10**9."""
    cleaned = text.replace("_", "")
    if "**" in cleaned:
        base, _, exponent = cleaned.partition("**")
        return positive_int(str(int(base) ** int(exponent)))
    if "e" in cleaned.lower():
        value = float(cleaned)
        if value != int(value):
            raise ValueError(f"{text!r} is not a whole number of users")
        return positive_int(str(int(value)))
    return positive_int(cleaned)


def _mechanisms(allowed: frozenset[str] | set[str]) -> Callable[[str], str]:
    def check(name: str) -> str:
        if name not in allowed:
            choices = ", ".join(sorted(allowed))
            raise ValueError(f"unknown mechanism {name!r}; choose from {choices}")
        return name

    return check


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--epsilons",
        type=_list_of(positive_float, "epsilons"),
        default=[0.5, 1.0, 2.0, 4.0],
        help="privacy budgets, comma-separated",
    )
    parser.add_argument(
        "--users",
        type=_list_of(_users, "user counts"),
        default=[1_000_000],
        help="numbers of users n, comma-separated, e.g. 1000000,1e9",
    )
    parser.add_argument("--reps", type=positive_int, default=10, help="repetitions per cell")
    parser.add_argument(
        "--path",
        choices=["exact", "fast"],
        default="fast",
        help="fast: statistics drawn from their law; exact: every user encoded",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of every random draw")
    parser.add_argument(
        "--out", type=Path, metavar="DIR", help="directory for results.csv, results.json, plots"
    )
    parser.add_argument(
        "--workers", type=positive_int, default=1, help="local Dask workers (1: in-process)"
    )
    parser.add_argument(
        "--scheduler", help="address of an existing Dask scheduler, tcp://HOST:PORT"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def register(subparsers: Any) -> None:
    """Add the ``frequency`` and ``numeric`` subcommands."""
    frequency = subparsers.add_parser(
        "frequency",
        help="frequency oracles: error against theory over a grid",
        description=FREQUENCY_DESCRIPTION,
        formatter_class=HelpFormatter,
    )
    # Memoized mechanisms have their own command (longitudinal): one report costs less
    # than their epsilon, so a grid over epsilon alone does not describe them.
    categorical = sorted(CATEGORICAL_MECHANISMS - MEMOIZED_MECHANISMS)
    frequency.add_argument(
        "--mechanisms",
        type=_list_of(_mechanisms(set(categorical)), "mechanisms"),
        default=[m for m in categorical if m != "auto"],
        help=f"comma-separated, from {','.join(categorical)}",
    )
    frequency.add_argument(
        "--domain-sizes",
        type=_list_of(positive_int, "domain sizes"),
        default=[16, 1024],
        help="numbers of categories d, comma-separated",
    )
    frequency.add_argument(
        "--shape",
        action="append",
        type=_shape(parse_categorical_shape),
        help="uniform | zipf:S | counts:FILE (repeat for several; default zipf:1.1)",
    )
    _common(frequency)
    frequency.set_defaults(run=_run_frequency, command_parser=frequency)

    numeric = subparsers.add_parser(
        "numeric",
        help="mean estimation: error against theory over a grid",
        description=NUMERIC_DESCRIPTION,
        formatter_class=HelpFormatter,
    )
    numeric_names = sorted(NUMERIC_MECHANISMS - MEMOIZED_MECHANISMS)
    numeric.add_argument(
        "--mechanisms",
        type=_list_of(_mechanisms(set(numeric_names)), "mechanisms"),
        default=numeric_names,
        help=f"comma-separated, from {','.join(numeric_names)}",
    )
    numeric.add_argument("--lower", type=float, default=0.0, help="lowest value (clipped)")
    numeric.add_argument("--upper", type=float, default=1.0, help="highest value (clipped)")
    numeric.add_argument(
        "--shape",
        action="append",
        type=_shape(parse_numeric_shape),
        help="uniform | normal:MEAN,SD | exponential:SCALE (repeat for several; default uniform)",
    )
    _common(numeric)
    numeric.set_defaults(run=_run_numeric, command_parser=numeric)


def _shape(parse: Callable[[str], T]) -> Callable[[str], T]:
    def check(text: str) -> T:
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return check


def _validated(parser: argparse.ArgumentParser, cells: list[Any]) -> None:
    """Build every cell's mechanism once, so a bad combination fails before any work."""
    for cell in cells:
        try:
            cell.make()
            if isinstance(cell, accuracy.FrequencyCell):
                cell.counts()
        except (ValidationError, ValueError) as error:
            message = error.errors()[0]["msg"] if isinstance(error, ValidationError) else str(error)
            parser.error(f"{cell.mechanism} at epsilon={cell.epsilon:g}: {message}")


def _run_frequency(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    shapes = args.shape or [parse_categorical_shape("zipf:1.1")]
    cells = [
        accuracy.FrequencyCell(m, e, d, n, s)
        for m in args.mechanisms
        for e in args.epsilons
        for d in args.domain_sizes
        for n in args.users
        for s in shapes
    ]
    _validated(parser, cells)
    outcomes = accuracy.run_frequency(
        cells,
        args.reps,
        args.path,
        args.seed,
        workers=args.workers,
        scheduler=args.scheduler,
        progress=not args.quiet,
    )
    rows = accuracy.summarize(outcomes)
    return _finish(args, rows, outcomes, FREQUENCY_COLUMNS, "frequency", ["d", "n", "shape"])


def _run_numeric(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
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
    _validated(parser, cells)
    outcomes = accuracy.run_numeric(
        cells,
        args.reps,
        args.path,
        args.seed,
        workers=args.workers,
        scheduler=args.scheduler,
        progress=not args.quiet,
    )
    rows = accuracy.summarize(outcomes)
    for row in rows:
        del row["d"], row["topk_recall"]
    return _finish(args, rows, outcomes, NUMERIC_COLUMNS, "numeric", ["n", "shape"])


def _finish(
    args: argparse.Namespace,
    rows: list[dict[str, Any]],
    outcomes: list[accuracy.Outcome],
    columns: list[str],
    prefix: str,
    group_by: list[str],
) -> int:
    print(report.format_table(rows, columns))
    if args.out is not None:
        report.write_csv(args.out / "results.csv", rows)
        cell_index: dict[int, int] = {}
        for outcome in outcomes:
            cell_index.setdefault(id(outcome.cell), len(cell_index))
        repetitions = [
            {"cell": cell_index[id(o.cell)], "rep": o.rep, "seconds": o.seconds, **o.metrics}
            for o in outcomes
        ]
        report.write_json(args.out / "results.json", {"cells": rows, "repetitions": repetitions})
        plots = report.plot_error_against_epsilon(rows, args.out, prefix, group_by)
        print(f"wrote {args.out / 'results.csv'}, results.json and {counted(len(plots), 'plot')}")
    return 0
