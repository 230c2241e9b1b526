"""The ``ldp-sim`` command: simulations that plan a deployment and check it against theory.

Each subcommand lives in its own module of ``simulations.commands`` and adds itself with
``register(subparsers)``, setting the defaults ``run`` (a function of the parsed arguments
and the subcommand's parser, returning the exit code) and ``command_parser`` (that
parser, so that errors name the subcommand). What ``ldp-sim --help`` shows is
``DESCRIPTION``, in plain text.
"""

from __future__ import annotations

import argparse
import sys

from simulations.text import HelpFormatter

__all__ = ["DESCRIPTION", "build_parser", "main"]

#: What the ``sim`` extra adds and the simulations import.
SIMULATION_EXTRAS = ("tqdm", "matplotlib", "dask", "distributed", "sklearn")
#: How to install the extra from a checkout (the package is not published on an index).
INSTALL_EXTRAS = "pip install -e '.[sim]' (run in the repository root)"

DESCRIPTION = """\
Simulations that plan a deployment of local differential privacy and check it against
the theory. Every subcommand prints a table; with --out DIR it also writes CSV and JSON
results and PNG plots. Run 'ldp-sim COMMAND --help' for the options of each.
"""


def build_parser() -> argparse.ArgumentParser:
    from simulations.commands import (
        attack,
        audit,
        distribution,
        dpsgd,
        federated,
        fleet,
        frequency,
        longitudinal,
        multidim,
        numeric,
        strings,
    )

    parser = argparse.ArgumentParser(
        prog="ldp-sim",
        description=DESCRIPTION,
        formatter_class=HelpFormatter,
    )
    subparsers = parser.add_subparsers(
        title="commands", dest="command", required=True, metavar="COMMAND"
    )
    for command in (
        frequency,
        numeric,
        distribution,
        multidim,
        attack,
        audit,
        dpsgd,
        federated,
        fleet,
        longitudinal,
        strings,
    ):
        command.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()
    except ModuleNotFoundError as error:
        if error.name not in SIMULATION_EXTRAS:
            raise
        print(
            f"ldp-sim needs the simulation extras (missing {error.name!r}); "
            f"install them with: {INSTALL_EXTRAS}",
            file=sys.stderr,
        )
        return 2
    args = parser.parse_args(argv)
    try:
        return int(args.run(args, args.command_parser))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
