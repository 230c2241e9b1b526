"""``ldp-aggregator``: run the service and its maintenance tasks.

    ldp-aggregator serve [--database URL] [--config metrics.toml] [--host H] [--port P]
                         [--workers N] [--min-reports N]
    ldp-aggregator compact [--database URL]
    ldp-aggregator create-key --role device|analyst|admin [--label TEXT] [--database URL]

``serve`` with no arguments runs on the embedded SQLite database (``LDP_DATA_DIR``,
default ``~/.local/share/ldp-telemetry``) with a built-in demo metric set. Before the
workers start it creates the schema, defines the metrics (``--config``: those of the
file, a new version where a spec changed; otherwise the demo set, where missing), and
makes the keys from the environment follow ``LDP_ADMIN_KEYS`` / ``LDP_ANALYST_KEYS`` /
``LDP_DEVICE_KEYS`` (new ones added, unlisted ones revoked: ``aggregator/auth.py``); on a
database with no key it creates an admin key and prints it once.
"""

from __future__ import annotations

import argparse
import contextlib
import logging.config
import os
import sys
import tempfile
from pathlib import Path

from aggregator.auth import ROLES, KeyRing, bootstrap_keys
from aggregator.observability import uvicorn_log_config
from aggregator.registry import DEMO_METRICS, load_definitions
from aggregator.service import Aggregator
from aggregator.settings import Settings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ldp-aggregator", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the HTTP service")
    _database_option(serve)
    serve.add_argument("--config", type=Path, help="metric definitions (TOML)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--workers", type=int, default=1, help="worker processes")
    serve.add_argument("--min-reports", type=int, help="reports needed before an estimate")
    serve.add_argument("--max-batch-reports", type=int, help="most reports per batch")
    serve.add_argument("--compaction-interval", type=float, help="seconds; 0 turns it off")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])

    compact = commands.add_parser("compact", help="merge partial statistics now")
    _database_option(compact)

    key = commands.add_parser("create-key", help="create an API key and print it once")
    _database_option(key)
    key.add_argument("--role", required=True, choices=ROLES)
    key.add_argument("--label", default="created by ldp-aggregator create-key")

    args = parser.parse_args(argv)
    try:
        settings = Settings.from_environment(
            database=args.database,
            min_reports=getattr(args, "min_reports", None),
            max_batch_reports=getattr(args, "max_batch_reports", None),
            compaction_interval=getattr(args, "compaction_interval", None),
        )
        if args.command == "serve":
            return _serve(args, settings)
        service = Aggregator(settings)
    except ValueError as error:
        parser.exit(2, f"ldp-aggregator: error: {error}\n")
    try:
        if args.command == "compact":
            result = service.compact()
            print(f"merged {result.rows_merged} partial rows in {result.groups} groups")
        else:
            key_id, secret = KeyRing(service.storage).create(args.role, args.label)
            print(f"{args.role} key {key_id}: {secret}")
    except ValueError as error:
        parser.exit(2, f"ldp-aggregator: error: {error}\n")
    finally:
        service.close()
    return 0


def _database_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--database", help="SQLite file path or postgresql+psycopg://user@host/db URL"
    )


def _serve(args: argparse.Namespace, settings: Settings) -> int:
    if args.workers < 1:
        raise ValueError("--workers must be at least 1")
    definitions = load_definitions(args.config) if args.config else None
    logging.config.dictConfig(uvicorn_log_config(args.log_level))  # the start's own messages
    service = Aggregator(settings)
    if args.workers > 1 and service.storage.dialect == "sqlite":
        print(
            "note: SQLite has one writer at a time; several workers share the validation "
            "work but take turns to commit. PostgreSQL is the path past that.",
            file=sys.stderr,
        )
    try:
        if definitions is not None:
            for name, definition in definitions.items():
                service.define(name, definition)
        else:
            service.define_missing(DEMO_METRICS)
        created = bootstrap_keys(KeyRing(service.storage), service.storage, os.environ)
    finally:
        service.close()
    if created is not None:
        print(
            f"Created an admin API key (shown only now; the server keeps its hash):\n  {created}",
            file=sys.stderr,
            flush=True,
        )
    _export(settings)
    with contextlib.ExitStack() as cleanup:
        if args.workers > 1 and not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            # Each worker writes its samples here; /metrics sums them. Removed at exit.
            directory = cleanup.enter_context(tempfile.TemporaryDirectory(prefix="ldp-prom-"))
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory
        _run_uvicorn(args)
    return 0


def _run_uvicorn(args: argparse.Namespace) -> None:
    import uvicorn

    uvicorn.run(
        "aggregator.app:app_from_environment",
        factory=True,
        host=args.host,
        port=args.port,
        workers=args.workers,
        access_log=False,  # access logs would carry client addresses
        log_level=args.log_level,
        log_config=uvicorn_log_config(args.log_level),
        timeout_graceful_shutdown=30,
    )


def _export(settings: Settings) -> None:
    """Hand the settings to the worker processes through the environment."""
    for name, value in vars(settings).items():
        os.environ[f"LDP_{name.upper()}"] = str(value)


if __name__ == "__main__":
    sys.exit(main())
