"""Argument types and options shared by the ``ldp-sim`` commands.

Each type raises ``ValueError`` saying what was wrong; ``checked`` turns it into argparse's
usage error (exit status 2, the message after the option's name). ``list_of`` and
``one_of`` build the types of comma-separated lists and of names from a fixed set.
``run_options`` is the parent parser (argparse ``parents=[...]``) of the options that
every command running a simulation shares: ``--reps``, ``--seed``, ``--out``,
``--workers``, ``--scheduler`` and ``--quiet``. ``check_cells`` builds every cell of a
grid once, so that a spec the grid cannot run is a usage error naming the cell.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

from pydantic import ValidationError

__all__ = [
    "check_cells",
    "checked",
    "count",
    "epsilon_or_inf",
    "list_of",
    "one_of",
    "positive_float",
    "positive_int",
    "probability",
    "run_options",
    "user_count",
]

T = TypeVar("T")


class GridCell(Protocol):
    """A cell of a simulation grid: it builds its mechanism, or raises ValueError (a
    pydantic ``ValidationError`` for a spec the mechanism refuses) saying why not."""

    def make(self) -> Any: ...


C = TypeVar("C", bound=GridCell)


def check_cells(
    cells: Sequence[C], parser: argparse.ArgumentParser, describe: Callable[[C], str]
) -> None:
    """Build every cell's mechanism once, before any work starts: the first cell that
    cannot be built is argparse's usage error, ``describe(cell)`` then why (a refused spec
    says its first problem)."""
    for cell in cells:
        try:
            cell.make()
        except ValidationError as error:
            message = error.errors()[0]["msg"].removeprefix("Value error, ")
            parser.error(f"{describe(cell)}: {message}")
        except ValueError as error:
            parser.error(f"{describe(cell)}: {error}")


def checked(kind: Callable[[str], T]) -> Callable[[str], T]:
    """``kind`` as an argparse type whose ValueError becomes a usage error."""

    def parse(text: str) -> T:
        try:
            return kind(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return parse


def list_of(kind: Callable[[str], T], what: str) -> Callable[[str], list[T]]:
    """An argparse type: a comma-separated list of ``kind``, refused with a message that
    starts with ``what`` (the list's name, e.g. "epsilons")."""

    def parse(text: str) -> list[T]:
        items = [part.strip() for part in text.split(",") if part.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {what}")
        try:
            return [kind(item) for item in items]
        except ValueError as error:
            raise argparse.ArgumentTypeError(f"{what}: {error}") from None

    return parse


def one_of(allowed: Iterable[str], what: str) -> Callable[[str], str]:
    """A type: one of the names ``allowed`` (a ``what``: "mechanism", "mode"), or a
    ValueError listing them in the order given."""
    names = tuple(allowed)

    def check(text: str) -> str:
        if text not in names:
            raise ValueError(f"unknown {what} {text!r}; choose from {', '.join(names)}")
        return text

    return check


def positive_float(text: str) -> float:
    """A finite number > 0."""
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{text!r} is not a number > 0")
    return value


def epsilon_or_inf(text: str) -> float:
    """A privacy budget: a number > 0, or ``inf`` (no noise)."""
    value = float(text)
    if not value > 0 or math.isnan(value):
        raise ValueError(f"epsilon {text!r} must be a number > 0 or inf")
    return value


def probability(*, zero: bool = True, one: bool = True) -> Callable[[str], float]:
    """A type: a probability, in [0, 1], with 0 left out unless ``zero`` and 1 unless
    ``one`` (an alpha or a delta lies in (0, 1), a sampling rate in (0, 1])."""
    interval = f"{'[' if zero else '('}0, 1{']' if one else ')'}"

    def parse(text: str) -> float:
        value = float(text)
        above = value >= 0.0 if zero else value > 0.0
        below = value <= 1.0 if one else value < 1.0
        if not (above and below):  # NaN is neither
            raise ValueError(f"{text!r} is not a probability in {interval}")
        return value

    return parse


def positive_int(text: str) -> int:
    """An integer >= 1 (``1_000`` allowed)."""
    value = int(text.replace("_", ""))
    if value < 1:
        raise ValueError(f"{text!r} is not an integer >= 1")
    return value


def count(text: str) -> int:
    """An integer >= 0 (``1_000`` allowed)."""
    value = int(text.replace("_", ""))
    if value < 0:
        raise ValueError(f"{text!r} is not an integer >= 0")
    return value


def user_count(text: str) -> int:
    """An integer >= 1 (of users, devices, clients), also written as 1e9 or 10**9."""
    cleaned = text.replace("_", "")
    if "**" in cleaned:
        base, _, exponent = cleaned.partition("**")
        return positive_int(str(int(base) ** int(exponent)))
    if "e" in cleaned.lower():
        value = float(cleaned)
        if value != int(value):
            raise ValueError(f"{text!r} is not a whole number")
        return positive_int(str(int(value)))
    return positive_int(cleaned)


#: The title of the shared options' group in ``--help``.
RUN_OPTIONS = "run options"


def run_options(
    *,
    seed_help: str = "seed of every random draw",
    seed_default: int | None = 0,
    out_help: str = "directory for the CSV, JSON and plot",
    reps: tuple[int | None, str] | None = None,
    dask: bool = False,
) -> argparse.ArgumentParser:
    """A parent parser of the options shared by the commands that run a simulation.

    Always ``--seed`` (``seed_default``, ``seed_help``), ``--out DIR`` (``out_help``: what
    the command writes there) and ``--quiet`` (no progress bar; the results still print).
    With ``reps`` = (default, help): ``--reps`` (a None default: the command chooses).
    With ``dask``: ``--workers`` (local Dask workers, 1 runs in this process) and
    ``--scheduler`` (an existing cluster). The options sit in a group of their own
    ("run options"), listed after the command's own.
    """
    parent = argparse.ArgumentParser(add_help=False)
    group = parent.add_argument_group(RUN_OPTIONS)
    if reps is not None:
        default, text = reps
        group.add_argument("--reps", type=checked(positive_int), default=default, help=text)
    group.add_argument("--seed", type=int, default=seed_default, help=seed_help)
    group.add_argument("--out", type=Path, metavar="DIR", help=out_help)
    if dask:
        group.add_argument(
            "--workers", type=checked(positive_int), default=1,
            help="local Dask workers (1: in-process)",
        )  # fmt: skip
        group.add_argument(
            "--scheduler", help="address of an existing Dask scheduler, tcp://HOST:PORT"
        )
    group.add_argument("--quiet", action="store_true", help="no progress bar")
    return parent
