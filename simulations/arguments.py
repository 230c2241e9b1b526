"""Argument types shared by the ``ldp-sim`` commands.

Each type raises ``ValueError`` saying what was wrong; ``checked`` turns it into argparse's
usage error (exit status 2, the message after the option's name).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import TypeVar

__all__ = ["checked", "count", "positive_float", "positive_int"]

T = TypeVar("T")


def checked(kind: Callable[[str], T]) -> Callable[[str], T]:
    """``kind`` as an argparse type whose ValueError becomes a usage error."""

    def parse(text: str) -> T:
        try:
            return kind(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return parse


def positive_float(text: str) -> float:
    """A finite number > 0."""
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{text!r} is not a number > 0")
    return value


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
