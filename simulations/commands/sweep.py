"""What ``ldp-sim frequency`` and ``ldp-sim numeric`` share: the grid's options, the check
of every cell before any work, and the table, CSV, JSON and plots of the results."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from simulations import accuracy, report
from simulations.arguments import list_of, positive_float, run_options, user_count
from simulations.text import counted

__all__ = ["SWEEP_DETAILS", "add_grid_options", "finish", "grid_options", "validated"]

SWEEP_DETAILS = """\
Every cell of the grid is repeated --reps times. The fast path draws each mechanism's
sufficient statistics from their exact law, so its cost does not grow with the number
of users; the exact path encodes every user. Work runs in this process, on a local Dask
cluster (--workers N) or on an existing one (--scheduler ADDRESS); the seed fixes the
results whatever runs them.

With --out DIR: results.csv (one row per cell), results.json (the rows and every
repetition) and PNG plots of the error against epsilon, the theory black and dashed.
"""


def grid_options() -> argparse.ArgumentParser:
    """The parent parser of the run options (``--reps`` 10 per cell, Dask)."""
    return run_options(
        reps=(10, "repetitions per cell"),
        out_help="directory for results.csv, results.json, plots",
        dask=True,
    )


def add_grid_options(parser: argparse.ArgumentParser) -> None:
    """``--epsilons``, ``--users`` and ``--path``."""
    parser.add_argument(
        "--epsilons",
        type=list_of(positive_float, "epsilons"),
        default=[0.5, 1.0, 2.0, 4.0],
        help="privacy budgets, comma-separated",
    )
    parser.add_argument(
        "--users",
        type=list_of(user_count, "user counts"),
        default=[1_000_000],
        help="numbers of users n, comma-separated, e.g. 1000000,1e9",
    )
    parser.add_argument(
        "--path",
        choices=["exact", "fast"],
        default="fast",
        help="fast: statistics drawn from their law; exact: every user encoded",
    )


def validated(parser: argparse.ArgumentParser, cells: Sequence[accuracy.Cell]) -> None:
    """Build every cell's mechanism once, so a bad combination fails before any work."""
    for cell in cells:
        try:
            cell.make()
            if isinstance(cell, accuracy.FrequencyCell):
                cell.counts()
        except (ValidationError, ValueError) as error:
            message = error.errors()[0]["msg"] if isinstance(error, ValidationError) else str(error)
            parser.error(f"{cell.mechanism} at epsilon={cell.epsilon:g}: {message}")


def finish(
    args: argparse.Namespace,
    rows: list[dict[str, Any]],
    outcomes: list[accuracy.Outcome],
    columns: list[str],
    prefix: str,
    group_by: list[str],
) -> int:
    """Print the table; with ``--out``, write results.csv, results.json and the plots."""
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
