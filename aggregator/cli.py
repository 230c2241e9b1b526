"""``ldp-aggregator``: run the service and its maintenance tasks.

    ldp-aggregator serve [--database URL] [--config metrics.toml] [--host H] [--port P]
                         [--workers N] [--min-reports N] [--demo-data]
                         [--max-body-bytes N] [--header-timeout S] [--body-timeout S]
    ldp-aggregator compact [--database URL]
    ldp-aggregator create-key --role device|analyst|admin [--label TEXT] [--database URL]

``serve`` with no arguments runs on the embedded SQLite database (``LDP_DATA_DIR``,
default ``~/.local/share/ldp-telemetry``) with a built-in demo metric set. Before the
workers start it creates the schema, defines the metrics (``--config``: those of the
file, a new version where a spec changed; otherwise the demo set, where missing), and
makes the keys from the environment follow ``LDP_ADMIN_KEYS`` / ``LDP_ANALYST_KEYS`` /
``LDP_DEVICE_KEYS`` (new ones added, unlisted ones revoked: ``aggregator/auth.py``); on a
database with no key it creates an admin key and prints it once. Every start then prints,
once, to stderr: the address it listens on, the database (SQLite: the absolute path;
a URL with its password hidden), the metrics it serves, and how to make a new admin key
if the printed one is lost.

``--demo-data`` fills a database that holds no statistics yet with simulated devices'
perturbed reports for every metric served (``aggregator/demo_data.py``), so that a first
start has estimates to show; on a database with statistics it adds nothing.

``create-key`` and ``compact`` work on the database a server uses: each names it on stderr
(the key itself goes alone to stdout, for scripts), and refuses, with exit status 2 and
nothing created, where no aggregator database exists yet, since a key stored in a new,
empty database would be refused by the running server. Start the server once with that
data directory, or pass the server's ``--database``.

``--database`` is a SQLite file path, a ``sqlite:///`` URL or a PostgreSQL URL. As in
SQLAlchemy, ``sqlite:///x.db`` is relative to the working directory and
``sqlite:////var/x.db`` (four slashes) is absolute; either is resolved to an absolute
path before the service starts. A SQLite file's directory must exist, except for the
default location, which is created. Every command refuses what it cannot use with one
line, ``ldp-aggregator: error: ...``, and exit status 2: a missing directory, a database
that cannot be reached or logged into, an address that is in use.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging.config
import os
import shlex
import socket
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError

from aggregator.auth import ROLES, bootstrap_keys
from aggregator.demo_data import fill_demo_data
from aggregator.observability import uvicorn_log_config
from aggregator.registry import DEMO_METRICS, load_definitions
from aggregator.repositories.database import DatabaseNotFoundError, SchemaMismatchError
from aggregator.service import Services
from aggregator.settings import Settings, default_database
from shared.schemas import MetricSpec

#: Most metrics the start lists by name (the rest are counted).
LISTED_METRICS = 20

DESCRIPTION = "Run the LDP telemetry aggregator service and its maintenance tasks."
EPILOG = """\
The database is --database (a SQLite file path, or a sqlite:/// or PostgreSQL URL),
else LDP_DATABASE, else aggregator.sqlite3 in LDP_DATA_DIR (by default
~/.local/share/ldp-telemetry). "serve" creates it on its first start; "create-key" and
"compact" need the database a server already uses, and refuse where there is none.

Run "ldp-aggregator COMMAND --help" for a command's options.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ldp-aggregator",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
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
    serve.add_argument("--max-body-bytes", type=int, help="largest request body (413 past it)")
    serve.add_argument(
        "--header-timeout", type=float, help="seconds a request's headers may take to arrive"
    )
    serve.add_argument(
        "--body-timeout", type=float, help="seconds a request's body may take to arrive"
    )
    serve.add_argument(
        "--reports-per-key-per-hour",
        type=int,
        help="each device key's quota of reports per metric per hour (429 past it; 0: none)",
    )
    serve.add_argument(
        "--demo-data",
        action="store_true",
        help="on a database without statistics, add simulated devices' perturbed reports "
        "for every metric served",
    )
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
            max_body_bytes=getattr(args, "max_body_bytes", None),
            header_timeout=getattr(args, "header_timeout", None),
            body_timeout=getattr(args, "body_timeout", None),
            reports_per_key_per_hour=getattr(args, "reports_per_key_per_hour", None),
        )
        settings = replace(settings, database=absolute_database(settings.database))
        if args.command == "serve":
            return _serve(args, settings)
        services = open_services(settings, create=False)
        print(f"database: {describe_database(settings.database)}", file=sys.stderr, flush=True)
    except DatabaseNotFoundError as error:
        parser.exit(2, f"ldp-aggregator: error: {no_database(args, settings, error)}\n")
    except ValueError as error:
        parser.exit(2, f"ldp-aggregator: error: {error}\n")
    try:
        if args.command == "compact":
            result = services.aggregator.compact()
            rows = "row" if result.rows_merged == 1 else "rows"
            groups = "group" if result.groups == 1 else "groups"
            print(f"merged {result.rows_merged} partial {rows} in {result.groups} {groups}")
        else:
            key_id, secret = services.keys.create(args.role, args.label)
            print(f"{args.role} key {key_id}: {secret}")
    except ValueError as error:
        parser.exit(2, f"ldp-aggregator: error: {error}\n")
    finally:
        services.close()
    return 0


def no_database(args: argparse.Namespace, settings: Settings, error: DatabaseNotFoundError) -> str:
    """The refusal of a command that needs an existing database where there is none: which
    database, where that setting came from, and what to do."""
    if args.database is not None or os.environ.get("LDP_DATABASE"):
        source = "--database" if args.database is not None else "LDP_DATABASE"
        fix = "this database"
    else:
        data_dir = os.environ.get("LDP_DATA_DIR")
        source = f"LDP_DATA_DIR={data_dir}" if data_dir else "the default location"
        fix = "this data directory"
    return (
        f"no aggregator database at {describe_database(settings.database)} (from {source}): "
        f"{error}; start the server once with {fix} (ldp-aggregator serve), or pass the "
        "server's database with --database"
    )


def _database_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--database", help="SQLite file path or postgresql+psycopg://user@host/db URL"
    )


def absolute_database(database: str) -> str:
    """``database`` with a SQLite file's path made absolute (a URL stays a URL).

    Raises ValueError when the file's directory does not exist, unless the file is the
    default one (``settings.default_database``), whose directory the first start creates:
    a mistyped path should not silently become a new, empty database.
    """
    hint = ""
    if "://" not in database:
        path = Path(database).expanduser().absolute()
        resolved = str(path)
    else:
        try:
            url = make_url(database)
        except ArgumentError:
            raise ValueError(f"--database: {database!r} is neither a path nor a URL") from None
        file = url.database
        if url.get_backend_name() != "sqlite" or not file or file == ":memory:":
            return database  # other databases, and what Storage refuses with its own message
        given = Path(file).expanduser()
        path = given.absolute()
        resolved = url.set(database=str(path)).render_as_string(hide_password=False)
        if not given.is_absolute():
            hint = (
                f" (sqlite:///{file} is relative to the working directory; an "
                f"absolute path takes four slashes: sqlite:////{file})"
            )
    if not path.parent.is_dir() and path != Path(default_database()).expanduser().absolute():
        raise ValueError(
            f"the database directory {path.parent} does not exist; create it first{hint}"
        )
    return resolved


def describe_database(database: str) -> str:
    """The database for people: a SQLite file's path, or the URL with its password hidden."""
    if "://" not in database:
        return f"SQLite file {database}"
    url = make_url(database)
    if url.get_backend_name() == "sqlite":
        return f"SQLite file {url.database}"
    return _redacted(database)


def _redacted(database: str) -> str:
    return make_url(database).render_as_string(hide_password=True)


def open_services(settings: Settings, create: bool = True) -> Services:
    """The services over the settings' database; ValueError, in one line, when the
    database cannot be opened (no server, refused login, a schema of another version).
    With ``create=False``, ``DatabaseNotFoundError`` where no aggregator database exists
    yet (``no_database`` words it)."""
    try:
        return Services.open(settings, create=create)
    except (SQLAlchemyError, SchemaMismatchError) as error:
        cause = getattr(error, "orig", None) or error
        reason = " ".join(str(cause).split()) or type(cause).__name__
        password = make_url(settings.database).password if "://" in settings.database else None
        if password:  # drivers do not echo it, but a message must never carry it
            reason = reason.replace(str(password), "***")
        raise ValueError(
            f"cannot open the database {describe_database(settings.database)}: {reason}"
        ) from None


def check_address(host: str, port: int) -> None:
    """Raise ValueError unless the service could listen on ``host:port`` now.

    Binds (with ``SO_REUSEADDR``, as uvicorn does) every address ``host`` resolves to, and
    lets go at once: a port in use is reported before anything else is done, rather than
    in the server's log after its start. Another process could still take the port in
    between; uvicorn then reports it and exits.
    """
    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be 0..65535, got {port}")
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as error:
        raise ValueError(f"--host {host!r}: {error.strerror}") from None
    for family, kind, protocol, _, address in dict.fromkeys(addresses):
        with socket.socket(family, kind, protocol) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as error:
                hint = (
                    "; another process is listening there: stop it or choose another --port"
                    if error.errno == errno.EADDRINUSE
                    else ""
                )
                raise ValueError(
                    f"cannot listen on {_url_host(host)}:{port}: {error.strerror}{hint}"
                ) from None


def startup_summary(args: argparse.Namespace, settings: Settings, metrics: list[MetricSpec]) -> str:
    """What a start tells its operator, once: address, database, metrics, key recovery."""
    workers = f"{args.workers} worker{'s' * (args.workers != 1)}"
    names = [f"{m.name} v{m.version} ({m.mechanism.mechanism})" for m in metrics]
    listed = ", ".join(names[:LISTED_METRICS])
    if len(names) > LISTED_METRICS:
        listed += f", and {len(names) - LISTED_METRICS} more"
    shown = describe_database(settings.database)
    secret = "://" in settings.database and make_url(settings.database).password is not None
    target = _redacted(settings.database) if secret else settings.database
    recover = f"ldp-aggregator create-key --role admin --database {shlex.quote(target)}"
    if secret:
        recover += "  (with the password in place of ***)"
    return (
        f"ldp-aggregator serving http://{_url_host(args.host)}:{args.port} ({workers})\n"
        f"  database: {shown}\n"
        f"  metrics:  {len(metrics)}: {listed or 'none'}\n"
        f"  admin key lost? make another against the same database:\n"
        f"    {recover}\n"
    )


def demo_data_summary(filled: dict[str, int]) -> str:
    """What ``--demo-data`` did, in one line."""
    if not filled:
        return "--demo-data: the database already holds statistics; no demo reports added"
    total = sum(filled.values())
    return f"--demo-data: stored {total:,} perturbed reports from simulated devices: " + ", ".join(
        f"{n:,} for {m}" for m, n in filled.items()
    )


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _serve(args: argparse.Namespace, settings: Settings) -> int:
    if args.workers < 1:
        raise ValueError("--workers must be at least 1")
    definitions = load_definitions(args.config) if args.config else None
    check_address(args.host, args.port)
    logging.config.dictConfig(uvicorn_log_config(args.log_level))  # the start's own messages
    services = open_services(settings)
    service = services.aggregator
    if args.workers > 1 and services.repositories.database.dialect == "sqlite":
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
        created = bootstrap_keys(services.keys, services.repositories.keys, os.environ)
        metrics = service.catalog.latest()
        filled = fill_demo_data(service) if args.demo_data else None
    finally:
        services.close()
    if created is not None:
        print(
            f"Created an admin API key (shown only now; the server keeps its hash):\n  {created}",
            file=sys.stderr,
            flush=True,
        )
    if filled is not None:
        print(demo_data_summary(filled), file=sys.stderr, flush=True)
    print(startup_summary(args, settings, metrics), end="", file=sys.stderr, flush=True)
    _export(settings)
    with contextlib.ExitStack() as cleanup:
        if args.workers > 1 and not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            # Each worker writes its samples here; /metrics sums them. Removed at exit.
            directory = cleanup.enter_context(tempfile.TemporaryDirectory(prefix="ldp-prom-"))
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory
        _run_uvicorn(args, settings)
    return 0


def _run_uvicorn(args: argparse.Namespace, settings: Settings) -> None:
    import uvicorn

    _allow_connections(settings.max_connections)
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
        # Deadlines for a request's headers and body (slow clients are cut), and a bound
        # on open connections and requests in progress (503 past it).
        http="aggregator.http_protocol:DeadlineHttpProtocol",
        limit_concurrency=settings.max_connections,
    )


def _allow_connections(connections: int) -> None:
    """Raise the soft limit on open files to let ``connections`` sockets be open (and some
    files besides), as far as the hard limit allows."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = connections + 256
    if soft != resource.RLIM_INFINITY and soft < wanted:
        ceiling = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, ceiling), hard))


def _export(settings: Settings) -> None:
    """Hand the settings to the worker processes through the environment."""
    for name, value in vars(settings).items():
        os.environ[f"LDP_{name.upper()}"] = str(value)


if __name__ == "__main__":
    sys.exit(main())
