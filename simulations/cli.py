"""``ldp-sim``: simulations that plan a deployment and check it against the theory.

Subcommands (``ldp-sim COMMAND --help`` for each):

* ``frequency``: frequency oracles over a grid of mechanisms, epsilons, domain sizes,
  user counts and data shapes, error against theory (``simulations/accuracy_commands.py``);
* ``numeric``: the same for mean estimation;
* ``federated``: private federated learning, accuracy against epsilon and the number of
  clients, in-process or over HTTP (``simulations/federated.py``);
* ``fleet``: simulated devices through the client SDK against a real aggregator
  (``simulations/fleet.py``).

Each module adds its own subcommand with ``register(subparsers)`` and sets the defaults
``run``, a function of the parsed arguments and the subcommand's parser returning the
exit code, and ``command_parser``, that parser (for errors that name the subcommand).
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["build_parser", "main"]

#: What ``pip install 'ldp-telemetry[sim]'`` adds and the simulations import.
SIMULATION_EXTRAS = ("tqdm", "matplotlib", "dask", "distributed", "sklearn")


def build_parser() -> argparse.ArgumentParser:
    from simulations import accuracy_commands, federated, fleet

    parser = argparse.ArgumentParser(
        prog="ldp-sim",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    accuracy_commands.register(subparsers)
    federated.register(subparsers)
    fleet.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()
    except ModuleNotFoundError as error:
        if error.name not in SIMULATION_EXTRAS:
            raise
        print(
            f"ldp-sim needs the simulation extras (missing {error.name!r}): "
            "pip install 'ldp-telemetry[sim]'",
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
