"""Benchmark of the aggregator service over loopback HTTP: ingest rate, batch latency, estimates.

Run from the repository root (a script, not a test)::

    python -m simulations.benchmarks.ingest --quick        # smoke run, about a minute
    python -m simulations.benchmarks.ingest                # full run, about 3 minutes
    python -m simulations.benchmarks.ingest --senders 4 --duration 20 --output ingest.csv
    python -m simulations.benchmarks.ingest --profile      # also cProfile one server's ingest

What it measures, on this machine, with everything (server, senders, PostgreSQL) sharing
its cores:

* **Ingest.** For each configuration (SQLite in a temporary file, PostgreSQL in a fresh
  schema of ``--postgres``, each served by ``--workers 1`` and ``--workers 2``) it starts a
  real ``ldp-aggregator serve`` process on a free loopback port (durable: a batch is
  acknowledged after its commit, ``synchronous=FULL`` for SQLite) with one GRR metric,
  and ``--senders`` sender processes post batches of 1,000 reports to it, each over one
  keep-alive ``httpx.Client``, one batch at a time, for ``--duration`` seconds (every
  ``--reconnect``-th batch closes its connection: worker processes share the listening
  socket, and a few connections kept for ever may all land on one of them). The
  bodies are built before the clock starts (``json.dumps`` of the payloads, a fresh
  random UUID per report, so none is a duplicate), so a sender's cost is mostly the HTTP
  exchange. The first ``--warmup`` seconds are not counted. ``reports/s`` is the sum of
  the server's ``accepted`` counts over the batches acknowledged inside the measured
  window, divided by its length; ``p50``/``p99``/``max`` are the latencies (post to
  reply) of the batches started in it. With s senders each waiting for its reply, the
  latency is about s * 1000 / rate (Little's law): latency and rate trade through s.
  ``cpu srv/snd/oth`` is the average number of cores used during the run by the server
  processes, the senders, and everything else (PostgreSQL, unrelated work on the
  machine), from ``/proc``; ``per worker`` splits the server's share between its worker
  processes; ``srv ms/b`` is the server's CPU time per batch. ``err``
  counts batches not acknowledged with 200, ``dup`` duplicates reported (both should
  be 0). Each configuration waits (up to ``--patience`` seconds) for unrelated work to
  drop under ``QUIET_CORES`` cores before it starts. ``n check`` compares the estimate's
  n after the run with the reports posted (every batch, warm-up included): ``OK`` when
  they are equal and every batch was acknowledged, else ``MISMATCH``.
* **Estimate latency.** A metric with 10^7 reports and one with 10^5, their statistics
  inserted directly with ``ReportsRepository.add_partial_rows`` (24 hourly buckets x 4 partial
  rows each, every row the ``aggregate`` of a simulated batch of GRR reports), served by
  one worker; the median over ``--estimate-requests`` requests of ``GET
  /v1/metrics/{name}/estimate`` (after two unmeasured ones; the two metrics alternate),
  and the ratio of the two medians. The estimate reads sufficient statistics only, so
  the ratio should be near 1.
* **Where a batch's time goes.** On one SQLite file with the served settings: the
  stages of ``Aggregator.ingest`` for 1,000-report batches, in process: JSON validation
  (``ReportBatch.model_validate_json``), ``prepare`` (envelopes, buckets, payloads, and
  the fold of every report: the ``aggregate`` of each metric version and time bucket),
  then inside ``ReportsRepository.ingest``: the report-id insert (from its start, on the request's
  thread, to the fold on the writer thread), the fold (handing over the rows folded in
  advance when every id is new), the statistics insert, and the commit (from
  SQLAlchemy's commit event to the return: writing the WAL and its fsync). The same
  batches are then posted, one at a time, to a server (one worker) on a copy of the file
  taken before them: the round trip, and the server's own time in its request handler
  (its ``ldp_ingest_seconds`` histogram at ``/metrics``: reading the body, validation
  and ``Aggregator.ingest``); the difference of their means is the cost outside the
  handler (HTTP, routing, middleware, authentication, the reply, the client). All of it
  twice: from an empty ``report_ids`` table, and after ``--prefill`` more ids were added
  (in large transactions, no statistics), since every accepted id stays in that table
  for the dedupe retention, and inserting random 16-byte keys into its B-tree costs more
  as it grows. A run of the ingest table above also starts from an empty table and ends
  with up to ~10^6 ids. ``--profile`` adds a cProfile listing of in-process ingest at
  the second state, by own time.

Targets (from the service's specification): at least ``TARGET_RATE`` reports/s
sustained on 2 cores with SQLite, durable, with p99 batch latency under ``TARGET_P99_MS``
ms; estimate latency independent of n (here: the 10^7 / 10^5 ratio at most
``ESTIMATE_RATIO_LIMIT``, a margin for timing noise). Each target missed is marked
``MISSED``. The targets are checked on the best SQLite configuration.
"""

from __future__ import annotations

import argparse
import cProfile
import csv
import io
import json
import math
import multiprocessing
import os
import pstats
import secrets
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import httpx
import numpy as np

from shared.mechanisms import make_mechanism
from shared.schemas import MechanismSpec
from simulations import server
from simulations.server import Server, free_port  # noqa: F401  (re-exported for the client benchmark)
from simulations.text import counted

if TYPE_CHECKING:
    from aggregator.repositories.reports import ReportsRepository
    from aggregator.service import Aggregator

BATCH = 1000
TARGET_RATE = 100_000.0
TARGET_P99_MS = 100.0
ESTIMATE_RATIO_LIMIT = 1.5
#: Background load (cores) below which a measurement starts (see ``wait_for_quiet``).
QUIET_CORES = 0.25
DEFAULT_POSTGRES = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
#: The benchmark metric: GRR over 16 categories (payload ``{"value": int}``).
DOMAIN_SIZE = 16
SPEC: dict[str, Any] = {"mechanism": "grr", "epsilon": 2.0, "domain_size": DOMAIN_SIZE}
INGEST_METRIC = "bench.ingest"
LARGE_METRIC = "bench.estimate-large"
SMALL_METRIC = "bench.estimate-small"
#: Statistics layout of the estimate metrics: hourly buckets x partial rows per bucket.
ESTIMATE_BUCKETS = 24
ROWS_PER_BUCKET = 4
REPO_ROOT = Path(__file__).resolve().parents[2]

FULL = {
    "duration": 12.0,
    "warmup": 2.0,
    "large_n": 10**7,
    "small_n": 10**5,
    "estimate_requests": 20,
    "profile_batches": 150,
    "prefill": 10**6,
}
QUICK = {
    "duration": 4.0,
    "warmup": 1.0,
    "large_n": 10**6,
    "small_n": 10**4,
    "estimate_requests": 10,
    "profile_batches": 40,
    "prefill": 2 * 10**5,
}


# ---------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------


@dataclass
class IngestRow:
    """One configuration's ingest run."""

    backend: str
    workers: int
    senders: int
    seconds: float = math.nan  # the measured window
    batches: int = 0  # acknowledged inside the window
    rate: float = math.nan  # accepted reports per second inside the window
    p50_ms: float = math.nan
    p99_ms: float = math.nan
    max_ms: float = math.nan
    errors: int = 0  # batches not acknowledged with 200 (whole run)
    duplicates: int = 0
    posted: int = 0  # reports in every batch posted (whole run)
    acknowledged: int = 0  # accepted reports in acknowledged batches (whole run)
    estimate_n: int = -1
    server_cpu: float = math.nan
    server_ms_per_batch: float = math.nan  # server CPU per batch posted
    worker_cpu: str = ""  # cores used by each of the ``workers`` busiest server processes
    sender_cpu: float = math.nan
    other_cpu: float = math.nan
    exhausted: bool = False  # a sender ran out of prebuilt bodies before the end
    background: float = math.nan  # cores busy just before the run (server idle)
    error: str = ""

    @property
    def n_ok(self) -> bool:
        return (
            self.errors == 0 and self.estimate_n == self.posted and self.acknowledged == self.posted
        )

    def missed(self) -> list[str]:
        """The targets this row misses (they apply to SQLite)."""
        if self.backend != "sqlite":
            return []
        found = []
        if not self.rate >= TARGET_RATE:
            found.append("rate")
        if not self.p99_ms < TARGET_P99_MS:
            found.append("p99")
        return found


@dataclass
class EstimateRow:
    """Estimate latency of one metric."""

    backend: str
    n: int
    partial_rows: int
    median_ms: float = math.nan
    min_ms: float = math.nan
    max_ms: float = math.nan
    estimate_n: int = -1
    error: str = ""


@dataclass
class StageRow:
    """Milliseconds per 1,000-report batch spent in one stage, in one state of the database."""

    stage: str
    state: str
    median_ms: float
    mean_ms: float


# ---------------------------------------------------------------------------------------
# Server processes and databases
# ---------------------------------------------------------------------------------------


def write_config(path: Path) -> Path:
    """A metrics TOML with the ingest metric and the two estimate metrics (same spec)."""
    # The spec's values are strings and numbers, written the same in TOML as in JSON.
    spec = "\n".join(f"{key} = {json.dumps(value)}" for key, value in SPEC.items())
    tables = []
    for name in (INGEST_METRIC, LARGE_METRIC, SMALL_METRIC):
        tables.append(
            f'[metrics."{name}"]\ndescription = "benchmark metric"\n\n'
            f'[metrics."{name}".mechanism]\n{spec}\n'
        )
    path.write_text("\n".join(tables), encoding="utf-8")
    return path


def start_server(
    database: str, workdir: Path, workers: int, *extra: str, timeout: float = 90.0
) -> Server:
    """The aggregator with the benchmark's metrics (``write_config``), on a free port."""
    config = str(write_config(workdir / "metrics.toml"))
    return server.start_server(
        database, workdir, workers=workers, extra=("--config", config, *extra), timeout=timeout
    )


def postgres_problem(url: str) -> str | None:
    """None when PostgreSQL answers at ``url``, else why not."""
    try:
        from sqlalchemy import create_engine, text

        engine = create_engine(url, connect_args={"connect_timeout": 3})
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        engine.dispose()
    except Exception as error:  # noqa: BLE001 - any failure means "not reachable"
        return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    return None


@contextmanager
def fresh_database(backend: str, workdir: Path, postgres: str) -> Iterator[str]:
    """A database URL with no tables yet: a new SQLite file, or a new PostgreSQL schema."""
    if backend == "sqlite":
        path = Path(tempfile.mkdtemp(prefix="sqlite-", dir=workdir)) / "aggregator.sqlite3"
        yield str(path)
        return
    from sqlalchemy import create_engine, text

    schema = f"bench_{secrets.token_hex(6)}"
    admin = create_engine(postgres)
    with admin.begin() as conn:
        conn.execute(text(f"CREATE SCHEMA {schema}"))
    separator = "&" if "?" in postgres else "?"
    try:
        yield f"{postgres}{separator}options={quote(f'-csearch_path={schema}')}"
    finally:
        with admin.begin() as conn:
            conn.execute(text(f"DROP SCHEMA {schema} CASCADE"))
        admin.dispose()


# ---------------------------------------------------------------------------------------
# CPU accounting from /proc
# ---------------------------------------------------------------------------------------

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def group_cpu_seconds(pgid: int) -> dict[int, float]:
    """User + system CPU seconds of each live process of a process group, by pid."""
    found: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as handle:
                fields = handle.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        # After "pid (comm)": state ppid pgrp ...; utime and stime are fields 14 and 15.
        if int(fields[2]) == pgid:
            found[int(entry)] = (int(fields[11]) + int(fields[12])) / _TICKS
    return found


def machine_busy_seconds() -> float:
    """CPU seconds all cores spent busy since boot (``/proc/stat``: user, nice, system, irq,
    softirq; not idle, iowait, or steal, the time the hypervisor gave to other machines)."""
    try:
        with open("/proc/stat", encoding="ascii") as handle:
            values = [int(v) for v in handle.readline().split()[1:]]
    except OSError:
        return math.nan
    busy = values[0] + values[1] + values[2] + values[5] + values[6]
    return busy / _TICKS


def wait_for_quiet(limit: float, patience: float, sample: float = 1.0) -> float:
    """Wait (up to ``patience`` s) until other work uses under ``limit`` cores; the last load.

    This machine's cores may be shared with unrelated work, which would slow the server
    down and be counted against it; a configuration starts only once that load is low, or
    once ``patience`` runs out (the ``cpu oth`` column then shows the disturbance).
    """
    deadline = time.monotonic() + patience
    while True:
        before = machine_busy_seconds()
        time.sleep(sample)
        load = (machine_busy_seconds() - before) / sample
        if not load >= limit or time.monotonic() >= deadline:
            return load


# ---------------------------------------------------------------------------------------
# Senders
# ---------------------------------------------------------------------------------------


def build_bodies(count: int, metric: str, version: int, seed: int) -> list[bytes]:
    """``count`` request bodies of ``BATCH`` GRR reports each, every report a fresh UUID."""
    mechanism = make_mechanism(MechanismSpec.model_validate(SPEC))
    rng = np.random.default_rng(seed)
    bodies = []
    for _ in range(count):
        payloads = mechanism.to_payloads(mechanism.encode(rng.integers(0, DOMAIN_SIZE, BATCH), rng))
        reports = [
            {"report_id": str(uuid.uuid4()), "metric": metric, "version": version, "payload": p}
            for p in payloads
        ]
        bodies.append(json.dumps({"reports": reports}, separators=(",", ":")).encode())
    return bodies


CLOSE = {"Connection": "close"}


@dataclass
class SendCommand:
    url: str
    device_key: str
    start_at: float  # time.monotonic() (system-wide on Linux)
    stop_at: float
    reconnect: int  # ask for a new connection every this many batches (0: never)


def sender_main(index: int, batches: int, seed: int, commands: Any, results: Any) -> None:
    """A sender process: build its bodies, then run each command it is sent (None: exit).

    Each run posts a new body per batch, one at a time, from ``start_at`` until
    ``stop_at`` (or until its bodies run out), and replies with one record per batch:
    ``(started, finished, status, accepted, duplicates)`` and its CPU seconds.

    Every ``reconnect``-th batch carries ``Connection: close``, so the next one opens a new
    connection: the server's worker processes share one listening socket, and a few
    connections kept for ever could all land on one worker.
    """
    bodies = build_bodies(batches, INGEST_METRIC, 1, seed)
    results.put(("ready", index, len(bodies)))
    while True:
        command: SendCommand | None = commands.get()
        if command is None:
            return
        records: list[tuple[float, float, int, int, int]] = []
        headers = {
            "Authorization": f"Bearer {command.device_key}",
            "Content-Type": "application/json",
        }
        with httpx.Client(base_url=command.url, headers=headers, timeout=120.0) as client:
            client.get("/healthz")  # open the keep-alive connection before the clock starts
            time.sleep(max(0.0, command.start_at - time.monotonic()))
            cpu_start = time.process_time()
            for count, body in enumerate(bodies, start=1):
                started = time.monotonic()
                if started >= command.stop_at:
                    break
                last = command.reconnect > 0 and count % command.reconnect == 0
                try:
                    response = client.post(
                        "/v1/reports", content=body, headers=CLOSE if last else None
                    )
                    status = response.status_code
                    reply = response.json() if status == 200 else {}
                except httpx.HTTPError:
                    status, reply = 0, {}
                records.append(
                    (
                        started,
                        time.monotonic(),
                        status,
                        int(reply.get("accepted", 0)),
                        int(reply.get("duplicates", 0)),
                    )
                )
            exhausted = len(records) == len(bodies) and time.monotonic() < command.stop_at
            cpu = time.process_time() - cpu_start
        results.put(("done", index, records, cpu, exhausted))


class SenderPool:
    """``count`` sender processes, each holding ``batches`` prebuilt bodies for every run.

    Every configuration runs on a fresh database, so reusing the bodies across runs never
    makes a report a duplicate; within a run no body is posted twice.
    """

    def __init__(self, count: int, batches: int, seed: int) -> None:
        context = multiprocessing.get_context("spawn")
        self.results = context.Queue()
        self.commands = [context.Queue() for _ in range(count)]
        self.processes = [
            context.Process(
                target=sender_main,
                args=(i, batches, seed + i, self.commands[i], self.results),
                daemon=True,
            )
            for i in range(count)
        ]
        for process in self.processes:
            process.start()
        for _ in range(count):
            message = self.results.get(timeout=600)
            assert message[0] == "ready"

    def start(self, command: SendCommand) -> None:
        """Hand ``command`` to every sender."""
        for queue in self.commands:
            queue.put(command)

    def collect(self) -> tuple[list[tuple[float, float, int, int, int]], float, bool]:
        """Wait for every sender's run: (all batch records, sender CPU seconds, exhausted)."""
        records: list[tuple[float, float, int, int, int]] = []
        cpu, exhausted = 0.0, False
        for _ in self.commands:
            kind, _index, found, seconds, ran_out = self.results.get(timeout=600)
            assert kind == "done"
            records += found
            cpu += seconds
            exhausted |= ran_out
        return records, cpu, exhausted

    def close(self) -> None:
        for queue in self.commands:
            queue.put(None)
        for process in self.processes:
            process.join(timeout=30)
            if process.is_alive():
                process.terminate()


# ---------------------------------------------------------------------------------------
# Ingest throughput
# ---------------------------------------------------------------------------------------


def fetch_n(server: Server, metric: str) -> int:
    response = httpx.get(
        f"{server.url}/v1/metrics/{metric}/estimate", headers=server.headers("analyst"), timeout=60
    )
    response.raise_for_status()
    return int(response.json()["n"])


def run_ingest(
    backend: str, workers: int, pool: SenderPool, plan: Plan, workdir: Path
) -> IngestRow:
    """Serve one configuration and drive it with the sender pool for ``plan.duration`` s."""
    row = IngestRow(backend, workers, plan.senders)
    with fresh_database(backend, workdir, plan.postgres) as database:
        server = start_server(database, workdir, workers)
        try:
            row.background = wait_for_quiet(QUIET_CORES, plan.patience)
            start_at = time.monotonic() + 1.0
            stop_at = start_at + plan.duration
            pool.start(
                SendCommand(server.url, server.keys["device"], start_at, stop_at, plan.reconnect)
            )
            time.sleep(max(0.0, start_at - time.monotonic()))
            cpu0, busy0, wall0 = (
                group_cpu_seconds(server.process.pid),
                machine_busy_seconds(),
                time.monotonic(),
            )
            records, sender_cpu, row.exhausted = pool.collect()
            cpu1, busy1, wall1 = (
                group_cpu_seconds(server.process.pid),
                machine_busy_seconds(),
                time.monotonic(),
            )
            elapsed = wall1 - wall0
            used = {pid: cpu1[pid] - cpu0.get(pid, 0.0) for pid in cpu1}
            row.server_cpu = sum(used.values()) / elapsed
            busiest = sorted(used.values(), reverse=True)[:workers]
            row.worker_cpu = "+".join(f"{seconds / elapsed:.2f}" for seconds in busiest)
            row.server_ms_per_batch = 1000.0 * sum(used.values()) / max(1, len(records))
            row.sender_cpu = sender_cpu / elapsed
            row.other_cpu = max(0.0, (busy1 - busy0) / elapsed - row.server_cpu - row.sender_cpu)
            summarize_records(row, records, start_at + plan.warmup, stop_at)
            row.estimate_n = fetch_n(server, INGEST_METRIC)
        finally:
            server.stop()
    return row


def summarize_records(
    row: IngestRow, records: list[tuple[float, float, int, int, int]], first: float, last: float
) -> None:
    """Fill ``row`` from the batch records: rate and latency inside ``[first, last]``."""
    data = np.array(records, dtype=np.float64).reshape(-1, 5)
    started, finished, status, accepted, duplicates = data.T
    ok = status == 200
    row.posted = BATCH * len(records)
    row.errors = int(np.sum(~ok))
    row.acknowledged = int(accepted[ok].sum())
    row.duplicates = int(duplicates.sum())
    done_inside = ok & (finished >= first) & (finished <= last)
    row.seconds = last - first
    row.batches = int(done_inside.sum())
    row.rate = float(accepted[done_inside].sum()) / row.seconds
    started_inside = ok & (started >= first) & (started < last)
    if started_inside.any():
        latency = (finished - started)[started_inside] * 1000.0
        row.p50_ms, row.p99_ms = (float(x) for x in np.percentile(latency, [50, 99]))
        row.max_ms = float(latency.max())


# ---------------------------------------------------------------------------------------
# Estimate latency
# ---------------------------------------------------------------------------------------


def partial_rows_for(metric: str, n: int, seed: int) -> list[Any]:
    """``ESTIMATE_BUCKETS`` x ``ROWS_PER_BUCKET`` partial rows holding ``n`` reports in all."""
    from aggregator.storage import PartialRow

    mechanism = make_mechanism(MechanismSpec.model_validate(SPEC))
    rng = np.random.default_rng(seed)
    hour = int(time.time()) // 3600 * 3600
    count = ESTIMATE_BUCKETS * ROWS_PER_BUCKET
    sizes = np.full(count, n // count)
    sizes[: n % count] += 1
    rows = []
    for i, size in enumerate(sizes):
        bucket = hour - (i // ROWS_PER_BUCKET) * 3600
        stats = mechanism.aggregate(mechanism.encode(rng.integers(0, DOMAIN_SIZE, int(size)), rng))
        rows.append(PartialRow(metric, 1, bucket, stats.n, stats.to_bytes()))
    return rows


def run_estimates(
    backend: str,
    sizes: tuple[int, int],
    requests: int,
    workdir: Path,
    postgres: str,
    seed: int,
    patience: float,
) -> list[EstimateRow]:
    """Estimate latency for a metric of ``sizes[0]`` reports and one of ``sizes[1]``."""
    from aggregator.storage import Repositories

    out = []
    with fresh_database(backend, workdir, postgres) as database:
        server = start_server(database, workdir, 1, "--compaction-interval", "0")
        try:
            repositories = Repositories.open(database)
            try:
                for metric, n in zip((LARGE_METRIC, SMALL_METRIC), sizes, strict=True):
                    repositories.reports.add_partial_rows(partial_rows_for(metric, n, seed))
            finally:
                repositories.close()
            wait_for_quiet(QUIET_CORES, patience)
            with httpx.Client(
                base_url=server.url, headers=server.headers("analyst"), timeout=60
            ) as client:
                # Alternate the two metrics, so that both see the same conditions.
                paths = [f"/v1/metrics/{m}/estimate" for m in (LARGE_METRIC, SMALL_METRIC)]
                times: list[list[float]] = [[], []]
                last: list[dict[str, Any]] = [{}, {}]
                for attempt in range(requests + 2):
                    for which, path in enumerate(paths):
                        started = time.perf_counter()
                        response = client.get(path)
                        elapsed = (time.perf_counter() - started) * 1000.0
                        response.raise_for_status()
                        last[which] = response.json()
                        if attempt >= 2:
                            times[which].append(elapsed)
                for which, n in enumerate(sizes):
                    row = EstimateRow(backend, n, ESTIMATE_BUCKETS * ROWS_PER_BUCKET)
                    row.estimate_n = int(last[which]["n"])
                    row.median_ms = float(np.median(times[which]))
                    row.min_ms, row.max_ms = float(min(times[which])), float(max(times[which]))
                    out.append(row)
        finally:
            server.stop()
    return out


# ---------------------------------------------------------------------------------------
# Where a batch's time goes
# ---------------------------------------------------------------------------------------


STAGES = (
    "JSON validation (model_validate_json)",
    "prepare (envelopes, buckets, payloads, fold)",
    "report-id insert (sort, queue, BEGIN, INSERT .. SELECT)",
    "fold (the new reports' rows)",
    "statistics insert",
    "commit (WAL write and fsync; reply model)",
    "in-process total",
)
ROUND_TRIP = "HTTP round trip, 1 sender in sequence"
#: The server's own time per batch: ``ldp_ingest_seconds`` (Prometheus), sum / count.
HANDLER = "served: request handler (mean)"


def stage_breakdown(
    batches: int, prefill: int, workdir: Path, seed: int, profile: bool, patience: float
) -> tuple[list[StageRow], str]:
    """Per-stage milliseconds of in-process ingest on SQLite, and the served round trip.

    Measured twice on one database file: from an empty ``report_ids`` table, and again
    after ``prefill`` more ids were added (directly, in large transactions). Each time,
    ``batches`` batches in process, and the same batches posted one at a time to a server
    (one worker) on a copy of the file taken just before (the same state; two processes
    writing one SQLite file would flush each other's page caches). Returns the rows and,
    with ``profile``, a cProfile listing of in-process ingest at the second state (else "").
    """
    from sqlalchemy import event

    from aggregator.service import Services
    from aggregator.settings import Settings
    from shared.schemas import MetricDefinition

    directory = Path(tempfile.mkdtemp(prefix="stages-", dir=workdir))
    database = str(directory / "aggregator.sqlite3")
    settings = Settings(database=database, min_reports=1, compaction_interval=0)
    services = Services.open(settings)
    service, reports = services.aggregator, services.repositories.reports
    marks: dict[str, float] = {}

    @event.listens_for(services.repositories.database.engine, "commit")
    def _on_commit(_conn: Any) -> None:
        marks["commit"] = time.perf_counter()

    rows: list[StageRow] = []
    listing = ""
    try:
        service.define(
            INGEST_METRIC, MetricDefinition(mechanism=MechanismSpec.model_validate(SPEC))
        )
        for phase in range(2):
            if phase == 1:
                prefill_ids(reports, prefill, seed)
            first = reports.report_count()
            copy = str(directory / f"served-{phase}.sqlite3")
            copy_sqlite(database, copy)
            bodies = build_bodies(batches + 5, INGEST_METRIC, 1, seed + 10 * phase)
            wait_for_quiet(QUIET_CORES, patience)
            spans = time_stages(service, reports, bodies, marks)
            spans[ROUND_TRIP], spans[HANDLER] = round_trip(copy, bodies, workdir, patience)
            state = f"ids {first:,}-{reports.report_count():,}"
            rows += [
                StageRow(name, state, float(np.median(v)), float(np.mean(v)))
                for name, v in spans.items()
            ]
        if profile:
            bodies = build_bodies(batches, INGEST_METRIC, 1, seed + 100)
            listing = profile_ingest(service, bodies)
    finally:
        services.close()
    return rows, listing


def prefill_ids(reports: ReportsRepository, count: int, seed: int) -> None:
    """Add ``count`` random report ids (no statistics), 50,000 per transaction."""
    rng = np.random.default_rng([seed, count])
    for start in range(0, count, 50_000):
        size = min(50_000, count - start)
        block = rng.bytes(16 * size)
        ids = [block[i : i + 16] for i in range(0, len(block), 16)]
        reports.ingest(ids, lambda _new: [])


def time_stages(
    service: Aggregator,
    reports: ReportsRepository,
    bodies: list[bytes],
    marks: dict[str, float],
    warmup: int = 5,
) -> dict[str, list[float]]:
    """Milliseconds of each stage of ``Aggregator.ingest`` per batch, after ``warmup`` batches.

    ``service.ingest`` runs as served; ``ReportsRepository.ingest`` of ``reports`` (the
    service's) and the fold it is handed are wrapped (on this instance, for the duration)
    to stamp their start and end, and the commit starts at SQLAlchemy's commit event
    (``marks["commit"]``). "prepare" is from the validated batch to
    ``ReportsRepository.ingest``.
    """
    from shared.schemas import ReportBatch

    original = reports.ingest

    def ingest(ids: Any, fold: Callable[[list[bool]], Any]) -> Any:
        marks["store"] = time.perf_counter()

        def timed_fold(new: list[bool]) -> Any:
            marks["fold"] = time.perf_counter()
            rows = fold(new)
            marks["folded"] = time.perf_counter()
            return rows

        return original(ids, timed_fold)

    spans: dict[str, list[float]] = {name: [] for name in STAGES}
    reports.ingest = ingest  # type: ignore[method-assign]
    try:
        for i, body in enumerate(bodies):
            t0 = time.perf_counter()
            batch = ReportBatch.model_validate_json(body)
            t1 = time.perf_counter()
            result = service.ingest(batch)
            t2 = time.perf_counter()
            if result.accepted != BATCH:
                raise RuntimeError(
                    f"batch {i}: {result.accepted} of {counted(BATCH, 'report')} accepted"
                )
            if i < warmup:
                continue
            values = (
                t1 - t0,
                marks["store"] - t1,
                marks["fold"] - marks["store"],
                marks["folded"] - marks["fold"],
                marks["commit"] - marks["folded"],
                t2 - marks["commit"],
                t2 - t0,
            )
            for name, value in zip(STAGES, values, strict=True):
                spans[name].append(value * 1000.0)
    finally:
        reports.ingest = original  # type: ignore[method-assign]
    return spans


def copy_sqlite(source: str, target: str) -> None:
    """A consistent copy of a SQLite database (the backup API), WAL contents included."""
    import sqlite3

    with closing(sqlite3.connect(source)) as origin, closing(sqlite3.connect(target)) as copy:
        origin.backup(copy)


def round_trip(
    database: str, bodies: list[bytes], workdir: Path, patience: float, warmup: int = 5
) -> tuple[list[float], list[float]]:
    """Milliseconds per batch posted one at a time to ``database`` served by one worker.

    Returns the round trips (after ``warmup`` batches, as in ``time_stages``) and, as a
    one-element list, the server's mean time in its request handler for the same
    batches: the growth of ``ldp_ingest_seconds`` sum over its count at ``/metrics``
    (timed from the handler's start, after authentication, to its return: reading the
    body, validation and ``Aggregator.ingest``).
    """
    server = start_server(database, workdir, 1, "--compaction-interval", "0")
    times: list[float] = []
    try:
        headers = {**server.headers("device"), "Content-Type": "application/json"}
        with httpx.Client(base_url=server.url, headers=headers, timeout=60) as client:
            for body in bodies[:warmup]:
                client.post("/v1/reports", content=body).raise_for_status()
            wait_for_quiet(QUIET_CORES, patience)
            before = handler_seconds(client)
            for body in bodies[warmup:]:
                started = time.perf_counter()
                response = client.post("/v1/reports", content=body)
                times.append((time.perf_counter() - started) * 1000.0)
                response.raise_for_status()
            after = handler_seconds(client)
    finally:
        server.stop()
    count = after[1] - before[1]
    if count != len(times):
        raise RuntimeError(
            f"the server counted {counted(count, 'batch', 'batches')}, {len(times)} were posted"
        )
    return times, [1000.0 * (after[0] - before[0]) / count]


def handler_seconds(client: httpx.Client) -> tuple[float, int]:
    """``(sum, count)`` of the server's ``ldp_ingest_seconds`` histogram."""
    response = client.get("/metrics")
    response.raise_for_status()
    values: dict[str, float] = {}
    for line in response.text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("ldp_ingest_seconds_sum", "ldp_ingest_seconds_count"):
            values[name] = float(value)
    return values["ldp_ingest_seconds_sum"], int(values["ldp_ingest_seconds_count"])


def profile_ingest(service: Aggregator, bodies: list[bytes]) -> str:
    """cProfile of validation + ``Aggregator.ingest`` over ``bodies``: top functions by own time."""
    from shared.schemas import ReportBatch

    profiler = cProfile.Profile()
    profiler.enable()
    for body in bodies:
        service.ingest(ReportBatch.model_validate_json(body))
    profiler.disable()
    buffer = io.StringIO()
    stats = pstats.Stats(profiler, stream=buffer)
    stats.sort_stats("tottime").print_stats(22)
    text = buffer.getvalue()
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if "function calls" in line), 0)
    return "\n".join(line.replace(str(REPO_ROOT) + "/", "") for line in lines[start:]).rstrip()


# ---------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------


def print_ingest(rows: list[IngestRow]) -> None:
    print(
        f"{'backend':<11}{'workers':>7}{'senders':>8}{'batches':>8}{'reports/s':>11}"
        f"{'p50 ms':>8}{'p99 ms':>8}{'max ms':>8}{'err':>5}{'dup':>5}"
        f"{'cpu srv/snd/oth':>17}{'per worker':>11}{'srv ms/b':>9}  {'n check':<26}targets"
    )
    for row in rows:
        if row.error:
            print(f"{row.backend:<11}{row.workers:>7}{row.senders:>8}  FAILED: {row.error}")
            continue
        check = f"{'OK' if row.n_ok else 'MISMATCH'} ({row.estimate_n:,}/{row.posted:,})"
        missed = row.missed()
        targets = (
            "-" if row.backend != "sqlite" else ("MISSED " + ",".join(missed) if missed else "met")
        )
        cpu = f"{row.server_cpu:.2f}/{row.sender_cpu:.2f}/{row.other_cpu:.2f}"
        print(
            f"{row.backend:<11}{row.workers:>7}{row.senders:>8}{row.batches:>8}{row.rate:>11,.0f}"
            f"{row.p50_ms:>8.1f}{row.p99_ms:>8.1f}{row.max_ms:>8.1f}{row.errors:>5}"
            f"{row.duplicates:>5}{cpu:>17}{row.worker_cpu:>11}{row.server_ms_per_batch:>9.1f}"
            f"  {check:<26}{targets}"
            + ("  (senders ran out of bodies: raise --max-rate)" if row.exhausted else "")
            + (
                f"  (started under {row.background:.2f} cores of other load)"
                if row.background >= QUIET_CORES
                else ""
            )
        )


def print_estimates(rows: list[EstimateRow]) -> list[str]:
    """Print the estimate table; return notes on missed targets."""
    print(
        f"{'backend':<11}{'n':>12}{'rows':>6}{'median ms':>11}{'min ms':>8}{'max ms':>8}"
        f"{'estimate n':>12}  check"
    )
    for row in rows:
        if row.error:
            print(f"{row.backend:<11}{row.n:>12,}  FAILED: {row.error}")
            continue
        check = "OK" if row.estimate_n == row.n else "MISMATCH"
        print(
            f"{row.backend:<11}{row.n:>12,}{row.partial_rows:>6}{row.median_ms:>11.2f}"
            f"{row.min_ms:>8.2f}{row.max_ms:>8.2f}{row.estimate_n:>12,}  {check}"
        )
    notes = []
    by_backend: dict[str, list[EstimateRow]] = {}
    for row in rows:
        if not row.error:
            by_backend.setdefault(row.backend, []).append(row)
    for backend, pair in by_backend.items():
        if len(pair) != 2:
            continue
        large, small = sorted(pair, key=lambda r: -r.n)
        ratio = large.median_ms / small.median_ms
        verdict = "met" if ratio <= ESTIMATE_RATIO_LIMIT else "MISSED"
        notes.append(
            f"{backend}: estimate latency n={large.n:,} / n={small.n:,} = {ratio:.2f} "
            f"(independent of n: ratio <= {ESTIMATE_RATIO_LIMIT}) {verdict}"
        )
    return notes


def print_stages(rows: list[StageRow]) -> None:
    """Medians per stage, one column per database state, with each stage's share of the trip."""
    states = list(dict.fromkeys(row.state for row in rows))
    cell = {(row.stage, row.state): row.median_ms for row in rows}
    print(
        f"{'median ms per batch (share of the round trip)':<48}"
        + "".join(f"{s:>26}" for s in states)
    )

    def line(label: str, values: list[float]) -> None:
        cells = [
            f"{v:>8.2f} ({100 * v / cell[(ROUND_TRIP, s)]:>3.0f}%)"
            for v, s in zip(values, states, strict=True)
        ]
        print(f"{label:<48}" + "".join(f"{c:>26}" for c in cells))

    for stage in (*STAGES, ROUND_TRIP):
        line(stage, [cell[(stage, s)] for s in states])
    means = {(row.stage, row.state): row.mean_ms for row in rows}
    for state in states:
        trip, handler = means[(ROUND_TRIP, state)], means[(HANDLER, state)]
        print(
            f"{state}: mean round trip {trip:.2f} ms = the server's request handler "
            f"{handler:.2f} ms (body, validation, ingest)\n    + {trip - handler:.2f} ms "
            f"({100 * (trip - handler) / trip:.0f}%) outside it (HTTP, routing, middleware, "
            "authentication, reply, client)"
        )
    print(
        "reports/s of one sequential sender: "
        + ", ".join(f"{s}: {1000 * BATCH / cell[(ROUND_TRIP, s)]:,.0f}" for s in states)
    )


def write_csv(
    path: Path, ingest: list[IngestRow], estimates: list[EstimateRow], stages: list[StageRow]
) -> None:
    rows: list[dict[str, Any]] = []
    rows += [{"kind": "ingest", **asdict(r), "n_ok": r.n_ok} for r in ingest]
    rows += [{"kind": "estimate", **asdict(r)} for r in estimates]
    rows += [{"kind": "stage", **asdict(r)} for r in stages]
    names: list[str] = []
    for row in rows:
        names += [k for k in row if k not in names]
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=names, restval="")
        writer.writeheader()
        writer.writerows(rows)


# ---------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------


@dataclass
class Plan:
    backends: list[str]
    workers: list[int]
    senders: int
    duration: float
    warmup: float
    max_rate: float
    sizes: tuple[int, int]
    estimate_requests: int
    profile_batches: int
    prefill: int
    profile: bool
    postgres: str
    seed: int
    patience: float
    reconnect: int
    skipped: dict[str, str] = field(default_factory=dict)


def parse_args(argv: list[str] | None) -> tuple[Plan, Path | None]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short runs, 10^6 vs 10^4 estimate")
    parser.add_argument("--backends", default="sqlite,postgresql", help="comma-separated")
    parser.add_argument("--workers", default="1,2", help="server worker counts, comma-separated")
    parser.add_argument("--senders", type=int, default=3, help="concurrent sender processes")
    parser.add_argument("--duration", type=float, help="seconds each configuration is driven")
    parser.add_argument("--warmup", type=float, help="first seconds not counted")
    parser.add_argument(
        "--max-rate",
        type=float,
        default=200_000.0,
        help="reports/s the prebuilt bodies must last for (memory: ~117 bytes per report)",
    )
    parser.add_argument("--large-n", type=int, help="reports in the large estimate metric")
    parser.add_argument("--small-n", type=int, help="reports in the small estimate metric")
    parser.add_argument("--estimate-requests", type=int, help="timed estimate requests")
    parser.add_argument(
        "--profile-batches", type=int, help="batches per stage-breakdown cell (0: skip it)"
    )
    parser.add_argument(
        "--prefill", type=int, help="report ids added before the second stage breakdown"
    )
    parser.add_argument("--profile", action="store_true", help="print a cProfile of ingest")
    parser.add_argument("--postgres", default=os.environ.get("LDP_TEST_POSTGRES", DEFAULT_POSTGRES))
    parser.add_argument("--seed", type=int, default=2024)
    parser.add_argument(
        "--reconnect",
        type=int,
        default=10,
        help="each sender opens a new connection every this many batches (0: never)",
    )
    parser.add_argument(
        "--patience",
        type=float,
        default=60.0,
        help=f"seconds to wait for other work to drop under {QUIET_CORES} cores before each "
        "measurement (0: do not wait)",
    )
    parser.add_argument("--output", type=Path, help="write all rows as CSV")
    args = parser.parse_args(argv)
    base = QUICK if args.quick else FULL
    if args.senders < 1:
        parser.error("--senders must be at least 1")

    def pick(name: str) -> Any:
        value = getattr(args, name)
        return base[name] if value is None else value

    plan = Plan(
        backends=[b.strip() for b in args.backends.split(",") if b.strip()],
        workers=[int(w) for w in args.workers.split(",") if w.strip()],
        senders=args.senders,
        duration=pick("duration"),
        warmup=pick("warmup"),
        max_rate=args.max_rate,
        sizes=(pick("large_n"), pick("small_n")),
        estimate_requests=pick("estimate_requests"),
        profile_batches=pick("profile_batches"),
        prefill=pick("prefill"),
        profile=args.profile,
        postgres=args.postgres,
        seed=args.seed,
        patience=args.patience,
        reconnect=args.reconnect,
    )
    unknown = set(plan.backends) - {"sqlite", "postgresql"}
    if unknown:
        parser.error(f"unknown backends {sorted(unknown)}: use sqlite and postgresql")
    if plan.warmup >= plan.duration:
        parser.error("--warmup must be shorter than --duration")
    return plan, args.output


def main(argv: list[str] | None = None) -> int:
    plan, output = parse_args(argv)
    if "postgresql" in plan.backends:
        problem = postgres_problem(plan.postgres)
        if problem is not None:
            plan.skipped["postgresql"] = problem
            plan.backends.remove("postgresql")
    for backend, reason in plan.skipped.items():
        print(f"skipping {backend}: not reachable at {plan.postgres}: {reason}")
    print(
        f"{os.cpu_count()} cores shared by the server, {counted(plan.senders, 'sender')} and "
        "the database; "
        f"batches of {BATCH:,} GRR reports (d={SPEC['domain_size']}), "
        f"{plan.duration:g} s per configuration ({plan.warmup:g} s warm-up not counted)"
    )
    ingest_rows: list[IngestRow] = []
    estimate_rows: list[EstimateRow] = []
    stage_rows: list[StageRow] = []
    with tempfile.TemporaryDirectory(prefix="ldp-ingest-bench-") as tmp:
        workdir = Path(tmp)
        per_sender = math.ceil(plan.max_rate * plan.duration / BATCH / plan.senders) + 5
        started = time.perf_counter()
        pool = SenderPool(plan.senders, per_sender, plan.seed)
        print(
            f"built {per_sender * plan.senders:,} bodies of {counted(BATCH, 'report')} in "
            f"{time.perf_counter() - started:.1f} s\n"
        )
        try:
            for backend in plan.backends:
                for workers in plan.workers:
                    try:
                        row = run_ingest(backend, workers, pool, plan, workdir)
                    except Exception as error:  # noqa: BLE001 - report and go on
                        row = IngestRow(backend, workers, plan.senders, error=repr(error)[:300])
                    ingest_rows.append(row)
        finally:
            pool.close()
        print("Ingest over loopback HTTP (sustained, durable: acknowledged after commit)")
        print_ingest(ingest_rows)

        for backend in plan.backends:
            try:
                estimate_rows += run_estimates(
                    backend,
                    plan.sizes,
                    plan.estimate_requests,
                    workdir,
                    plan.postgres,
                    plan.seed,
                    plan.patience,
                )
            except Exception as error:  # noqa: BLE001 - report and go on
                estimate_rows.append(
                    EstimateRow(backend, plan.sizes[0], 0, error=repr(error)[:300])
                )
        print(
            f"\nEstimate latency over HTTP (one worker; median of {plan.estimate_requests} "
            f"requests; {ESTIMATE_BUCKETS} hourly buckets x {ROWS_PER_BUCKET} partial rows)"
        )
        notes = print_estimates(estimate_rows)

        if plan.profile_batches > 0:
            stage_rows, listing = stage_breakdown(
                plan.profile_batches,
                plan.prefill,
                workdir,
                plan.seed + 100,
                plan.profile,
                plan.patience,
            )
            print(
                "\nWhere a batch's time goes (SQLite, durable; "
                f"{counted(plan.profile_batches, 'batch', 'batches')} "
                "per cell in process, as many again served)"
            )
            print_stages(stage_rows)
            if listing:
                print(
                    "\ncProfile of in-process ingest (validation + Aggregator.ingest) right "
                    "after the last column, by own time"
                )
                print(listing)

    print("\nTargets")
    sqlite_rows = [r for r in ingest_rows if r.backend == "sqlite" and not r.error]
    if sqlite_rows:
        best = max(sqlite_rows, key=lambda r: r.rate)
        rate_verdict = "met" if best.rate >= TARGET_RATE else "MISSED"
        print(
            f"sqlite: >= {TARGET_RATE:,.0f} reports/s sustained on {os.cpu_count()} cores: best "
            f"{best.rate:,.0f} ({counted(best.workers, 'worker')}, "
            f"{counted(best.senders, 'sender')}) {rate_verdict}"
        )
        p99_verdict = "met" if best.p99_ms < TARGET_P99_MS else "MISSED"
        print(
            f"sqlite: p99 batch latency < {TARGET_P99_MS:.0f} ms at that rate: "
            f"{best.p99_ms:.1f} ms {p99_verdict}"
        )
        print(
            f"sqlite: in that run the senders used {best.sender_cpu:.2f} of "
            f"{os.cpu_count()} cores, the server {best.server_cpu:.2f}, other work "
            f"{best.other_cpu:.2f}"
        )
    for note in notes:
        print(note)
    for row in ingest_rows:
        if not row.error and not row.n_ok:
            print(
                f"MISMATCH: {row.backend}, {counted(row.workers, 'worker')}: "
                f"estimate n {row.estimate_n:,}, "
                f"posted {row.posted:,}, acknowledged {row.acknowledged:,}, errors {row.errors}"
            )
    if output is not None:
        write_csv(output, ingest_rows, estimate_rows, stage_rows)
        print(f"\nwrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
