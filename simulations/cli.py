"""``ldp-sim``: simulations that plan a deployment and check it against the theory.

Subcommands (``ldp-sim COMMAND --help`` for each):

* ``frequency``: frequency oracles over a grid of mechanisms, epsilons, domain sizes,
  user counts and data shapes, error against theory (``simulations/accuracy_commands.py``);
* ``numeric``: the same for mean estimation;
* ``fleet``: simulated devices through the client SDK against a real aggregator
  (``simulations/fleet.py``).

Each module adds its own subcommand with ``register(subparsers)`` and sets the defaults
``run``, a function of the parsed arguments and the subcommand's parser returning the
exit code, and ``command_parser``, that parser (for errors that name the subcommand).
"""

from __future__ import annotations

import argparse
import sys

from simulations import accuracy_commands, fleet

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ldp-sim",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    accuracy_commands.register(subparsers)
    fleet.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args, args.command_parser))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
