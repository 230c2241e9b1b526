"""The ``ldp-sim`` subcommands, one module each: its options and the glue that runs it.

Every module has ``register(subparsers)``, which adds the subcommand and sets the defaults
``run`` (a function of the parsed arguments and the subcommand's parser, returning the
exit code) and ``command_parser`` (that parser, so that errors name the subcommand). The
simulations themselves live in library modules (``simulations.accuracy``,
``simulations.fleet``, ...), which know nothing of argparse.
"""
