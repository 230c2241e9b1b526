"""Benchmark of a PostgreSQL partition: how soon ingest works again after the network heals.

Run from the repository root (a script, not a test), with PostgreSQL at
``--postgres`` (default ``postgresql+psycopg://postgres@127.0.0.1:5432/test``)::

    python -m simulations.benchmarks.partition                       # this checkout
    python -m simulations.benchmarks.partition --baseline OLD  # and another, side by side
    python -m simulations.benchmarks.partition --blackhole 10 --repeats 3 --cap 60

For each checkout (this one, then ``--baseline`` if given) and each repeat it creates a
fresh schema, puts a ``TcpProxy`` (``simulations/tcp_proxy.py``) in front of
PostgreSQL, and starts that checkout's ``ldp-aggregator serve`` on the proxied URL
(its own code: ``PYTHONPATH`` and working directory are the checkout; defaults but
``--min-reports 1``, no compaction, no rate limit). One device thread uploads batches of
``BATCH`` reports, each sent again with the same ids until acknowledged (every attempt
waits at most ``REQUEST_TIMEOUT`` s), and one probe asks ``/healthz`` every 0.5 s.
After ``WARMUP`` s the proxy black-holes every connection for ``--blackhole`` seconds
(bytes dropped, connections that lost bytes dead for good: a partition through a
firewall that forgot its connections), then recovers.

Printed per run: the time from recovery to the first acknowledged batch (the target:
under ``TARGET_SECONDS``; ``> cap`` when none came within ``--cap`` s), what the
uploads got while the database was away (503 with ``Retry-After``, other statuses,
attempts that got no answer within ``REQUEST_TIMEOUT``, and the slowest answer), what
``/healthz`` said meanwhile and between recovery and the first acknowledged batch (as
``200/503/no answer``), and whether the estimate counts every acknowledged report
exactly once (checked when the run recovered). The machine's load is shared with
whatever else runs on it; the figures are the time the service takes to notice and
reconnect, dominated by its database timeout, not by CPU.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import create_engine, text
from sqlalchemy.engine import URL, make_url

from simulations.server import Server, start_server
from simulations.tcp_proxy import TcpProxy

REPO_ROOT = Path(__file__).resolve().parents[2]
METRIC, VERSION, DOMAIN = "app.theme", 1, 3  # a demo metric: GRR over three categories
BATCH = 20
WARMUP = 3.0
REQUEST_TIMEOUT = 30.0
HEALTH_TIMEOUT = 10.0
TARGET_SECONDS = 5.0


@dataclass
class Attempt:
    sent: float
    answered: float
    status: int | None  # None: no answer within the request timeout (or a transport error)
    retry_after: str | None = None


@dataclass
class Run:
    """What one partition did to one checkout's service."""

    checkout: str
    down: float = 0.0  # when the black hole began (monotonic)
    up: float = 0.0  # when it ended
    attempts: list[Attempt] = field(default_factory=list)
    health: list[Attempt] = field(default_factory=list)
    acknowledged: set[str] = field(default_factory=set)
    accepted: int = 0
    counted: int | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def recovery(self) -> float | None:
        """Seconds from the end of the black hole to the first acknowledgement after it."""
        after = [a.answered for a in self.attempts if a.status == 200 and a.answered > self.up]
        return min(after) - self.up if after else None

    def during(self, probes: list[Attempt]) -> list[Attempt]:
        """The attempts sent while the database was away."""
        return [a for a in probes if self.down <= a.sent < self.up]

    def stranded(self, probes: list[Attempt], cap: float) -> list[Attempt]:
        """The attempts sent after the database came back, before ingest worked again."""
        recovery = self.recovery()
        end = self.up + (cap if recovery is None else recovery)
        return [a for a in probes if self.up <= a.sent < end]


@contextmanager
def fresh_schema(postgres: URL) -> Iterator[str]:
    admin = create_engine(postgres, connect_args={"connect_timeout": 3})
    schema = f"bench_{secrets.token_hex(6)}"
    with admin.begin() as conn:
        conn.execute(text(f"CREATE SCHEMA {schema}"))
    try:
        yield schema
    finally:
        with admin.begin() as conn:
            conn.execute(text(f"DROP SCHEMA {schema} CASCADE"))
        admin.dispose()


@contextmanager
def serve(checkout: Path, database: str, workdir: Path) -> Iterator[Server]:
    """``checkout``'s ``ldp-aggregator serve`` on a free port, until the block ends."""
    server = start_server(database, workdir, root=checkout, extra=("--compaction-interval", "0"))
    try:
        yield server
    finally:
        if server.process.poll() is None:
            # A hung server would not stop gracefully.
            os.killpg(server.process.pid, signal.SIGKILL)
            server.process.wait(timeout=30)


def upload(server: Server, run: Run, stop: threading.Event) -> None:
    """Batches of fresh ids, each sent again (same ids) until acknowledged, until ``stop``."""
    url = server.url
    with httpx.Client(headers=server.headers("device"), timeout=REQUEST_TIMEOUT) as client:
        while not stop.is_set():
            reports: list[dict[str, Any]] = [
                {
                    "report_id": str(uuid.uuid4()),
                    "metric": METRIC,
                    "version": VERSION,
                    "payload": {"value": index % DOMAIN},
                }
                for index in range(BATCH)
            ]
            while not stop.is_set():
                sent = time.monotonic()
                try:
                    response = client.post(f"{url}/v1/reports", json={"reports": reports})
                    status, retry = response.status_code, response.headers.get("retry-after")
                except httpx.TransportError:
                    response, status, retry = None, None, None
                with run.lock:
                    run.attempts.append(Attempt(sent, time.monotonic(), status, retry))
                    if response is not None and status == 200:
                        run.acknowledged.update(r["report_id"] for r in reports)
                        run.accepted += int(response.json()["accepted"])
                if status == 200:
                    break
                time.sleep(0.1)
            time.sleep(0.1)


def probe(server: Server, run: Run, stop: threading.Event) -> None:
    """``/healthz`` every 0.5 s."""
    while not stop.is_set():
        sent = time.monotonic()
        try:
            health = httpx.get(f"{server.url}/healthz", timeout=HEALTH_TIMEOUT)
            status: int | None = health.status_code
        except httpx.TransportError:
            status = None
        with run.lock:
            run.health.append(Attempt(sent, time.monotonic(), status))
        stop.wait(max(0.0, 0.5 - (time.monotonic() - sent)))


def partition(checkout: Path, postgres: URL, blackhole: float, cap: float, workdir: Path) -> Run:
    """One run: warm up, black-hole for ``blackhole`` s, recover, wait for ingest (``cap``)."""
    run = Run(str(checkout))
    with fresh_schema(postgres) as schema, TcpProxy(postgres.port or 5432) as proxy:
        through = postgres.set(port=proxy.port).update_query_dict(
            {"options": f"-csearch_path={schema}"}
        )
        with serve(checkout, through.render_as_string(hide_password=False), workdir) as server:
            stop = threading.Event()
            threads = [
                threading.Thread(target=work, args=(server, run, stop), daemon=True)
                for work in (upload, probe)
            ]
            for thread in threads:
                thread.start()
            time.sleep(WARMUP)
            run.down = time.monotonic()
            proxy.blackhole()
            time.sleep(blackhole)
            proxy.recover()
            run.up = time.monotonic()
            while time.monotonic() < run.up + cap and run.recovery() is None:
                time.sleep(0.1)
            if run.recovery() is not None:
                time.sleep(2.0)  # a few batches after recovery
            stop.set()
            for thread in threads:
                thread.join(timeout=REQUEST_TIMEOUT + 5)
            if run.recovery() is not None and not any(t.is_alive() for t in threads):
                run.counted = counted(server)
    return run


def counted(server: Server) -> int:
    response = httpx.get(
        f"{server.url}/v1/metrics/{METRIC}/estimate",
        params={"version": VERSION},
        headers=server.headers("analyst"),
        timeout=60.0,
    )
    response.raise_for_status()
    return int(response.json()["n"])


def describe(run: Run, cap: float) -> list[str]:
    recovery = run.recovery()
    uploads = run.during(run.attempts)
    unavailable = [a for a in uploads if a.status == 503]
    answered = [a for a in uploads if a.status is not None]
    slowest = max((a.answered - a.sent for a in answered), default=float("nan"))
    statuses = [_statuses(run.during(run.health)), _statuses(run.stranded(run.health, cap))]
    if run.counted is None:
        once = "not checked (no recovery)"
    else:
        exact = run.counted == len(run.acknowledged) == run.accepted
        once = f"{'yes' if exact else 'NO'} ({run.counted} counted, {len(run.acknowledged)} acked)"
    return [
        f"{recovery:.1f} s" if recovery is not None else f"> {cap:.0f} s",
        "OK" if recovery is not None and recovery < TARGET_SECONDS else "MISSED",
        f"{len(unavailable)}/{len(uploads)}",
        str(sum(1 for a in uploads if a.status is not None and a.status != 503)),
        str(sum(1 for a in uploads if a.status is None)),
        f"{slowest:.1f} s",
        *statuses,
        once,
    ]


def _statuses(probes: list[Attempt]) -> str:
    """How many probes got 200, 503, and no answer: ``200/503/none``."""
    counts = {label: 0 for label in ("200", "503", "none")}
    for attempt in probes:
        counts["none" if attempt.status is None else str(attempt.status)] += 1
    return "/".join(str(count) for count in counts.values())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, help="another checkout to run side by side")
    parser.add_argument(
        "--postgres",
        default=os.environ.get(
            "LDP_TEST_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
        ),
    )
    parser.add_argument("--blackhole", type=float, default=10.0, help="seconds (default 10)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per checkout (default 3)")
    parser.add_argument(
        "--cap", type=float, default=60.0, help="seconds to wait for recovery (default 60)"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    postgres = make_url(args.postgres)
    checkouts = [REPO_ROOT] + ([args.baseline.resolve()] if args.baseline else [])
    header = [
        "checkout", "run", "ingest after recovery", "target", "503 while down", "other",
        "no answer", "slowest answer", "healthz while down", "healthz after, ingest failing",
        "counted once",
    ]  # fmt: skip
    rows: list[list[str]] = []
    with tempfile.TemporaryDirectory(prefix="partition-") as workdir:
        for checkout in checkouts:
            for repeat in range(args.repeats):
                run = partition(checkout, postgres, args.blackhole, args.cap, Path(workdir))
                rows.append([str(checkout), str(repeat + 1), *describe(run, args.cap)])
                print(" | ".join(rows[-1]), flush=True)
    print(f"\nPostgreSQL black-holed for {args.blackhole:g} s behind a loopback proxy")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
