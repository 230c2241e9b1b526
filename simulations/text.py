"""Text for people: ``ldp-sim``'s help formatter and counted nouns ("1 report", "2 reports")."""

from __future__ import annotations

import argparse
import math
from typing import Any

__all__ = ["HelpFormatter", "counted", "shown"]


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and ``noun``, plural unless ``n`` is exactly one, with thousands separators.

    ``plural`` defaults to ``noun + "s"``; give it for irregular nouns ("batch", "batches").
    """
    return f"{n:,} {noun if n == 1 else (plural or noun + 's')}"


def shown(value: Any) -> str:
    """A default as a user would type it: lists comma-separated, floats short, inf as inf."""
    if isinstance(value, list | tuple):
        return ",".join(shown(item) for item in value)
    if isinstance(value, float):
        return "inf" if math.isinf(value) else f"{value:g}"
    return str(value)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions keep their paragraphs; every option with a default says what it is.

    Like ``argparse.ArgumentDefaultsHelpFormatter``, but the default is written as it would
    be typed on the command line (``0.5,1,2,4``, not ``[0.5, 1.0, 2.0, 4.0]``), and flags
    (default False) and options without a default (None) add nothing. Help starts in
    column 32, so that subcommand names such as ``federated`` fit beside their help.
    """

    def __init__(
        self,
        prog: str,
        indent_increment: int = 2,
        max_help_position: int = 32,
        width: int | None = None,
    ) -> None:
        super().__init__(prog, indent_increment, max_help_position, width)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            not action.option_strings
            or "%(default)" in text
            or default is None
            or default is False
            or default is argparse.SUPPRESS
        ):
            return text
        return f"{text} (default: {shown(default).replace('%', '%%')})"
