"""What the tests share: a free loopback port, a real aggregator process, the PostgreSQL probe.

Test modules and ``conftest.py`` files import it as ``tests.support`` (the repository
root is on the path: ``pythonpath`` in ``pyproject.toml``).

- ``free_port()``: a TCP port on 127.0.0.1 that nothing listens on (the library's, from
  ``simulations.server``).
- ``AggregatorProcess``: one ``python -m aggregator.cli serve`` on a fixed port and
  database, with known admin, analyst and device keys, started, killed (SIGKILL, nothing
  flushed) and started again at will: what the crash, restart and fault tests need.
- ``fleet_client(url, key, state_dir, batch_size)``: a ``TelemetryClient`` that stands
  for many devices (no lifetime cap), uploading a batch when ``batch_size`` reports wait
  and at flush, retrying quickly.
- ``postgres_problem()``: None when PostgreSQL answers at ``POSTGRES_URL``
  (``LDP_TEST_POSTGRES``, default ``postgresql+psycopg://postgres@127.0.0.1:5432/test``),
  else why not, so that the PostgreSQL cases skip and say why.
"""

from __future__ import annotations

import functools
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Self

import httpx

from client import BudgetLimits, RetryPolicy, TelemetryClient
from simulations.server import free_port

__all__ = ["POSTGRES_URL", "ROOT", "AggregatorProcess", "free_port", "postgres_problem"]

#: The repository root: servers started here run the checked-out code.
ROOT = Path(__file__).resolve().parents[1]
POSTGRES_URL = os.environ.get(
    "LDP_TEST_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)


@functools.cache
def postgres_problem() -> str | None:
    """None when PostgreSQL answers at POSTGRES_URL, else why not (asked once a process)."""
    try:
        from sqlalchemy import create_engine, text

        engine = create_engine(POSTGRES_URL, connect_args={"connect_timeout": 3})
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        engine.dispose()
    except Exception as error:  # noqa: BLE001 - any failure means "no server"
        return f"no PostgreSQL at {POSTGRES_URL}: {type(error).__name__}: {error}"
    return None


class AggregatorProcess:
    """One ``aggregator.cli serve`` on a fixed port and database, started and killed at will.

    The server gets ``keys`` (role -> key) through ``LDP_ADMIN_KEYS`` /
    ``LDP_ANALYST_KEYS`` / ``LDP_DEVICE_KEYS`` (``None``: no key, so that a first start
    makes an admin key and prints it), ``env`` on top, and none of the ``LDP_*`` variables
    of the test process; ``args`` are more ``serve`` options. It runs in its own process
    group; its output goes to ``log_path`` (appended across starts), its stderr to
    ``error_path`` instead where one is given.
    """

    def __init__(
        self,
        database: str | Path,
        log_path: Path,
        keys: Mapping[str, str] | None,
        args: Sequence[str] = (),
        *,
        port: int | None = None,
        env: Mapping[str, str] | None = None,
        error_path: Path | None = None,
    ) -> None:
        self.database = database
        self.log_path = log_path
        self.error_path = error_path
        self.keys = dict(keys or {})
        self.args = list(args)
        self.env = dict(env or {})
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self, timeout: float = 60.0) -> Self:
        """Start the server (same port, same database) and wait until ``/healthz`` is 200."""
        if self.running:
            raise RuntimeError("the aggregator is already running")
        environment = {k: v for k, v in os.environ.items() if not k.startswith("LDP_")}
        for role, key in self.keys.items():
            environment[f"LDP_{role.upper()}_KEYS"] = key
        environment.update(self.env)
        if "PROMETHEUS_MULTIPROC_DIR" not in self.env:
            environment.pop("PROMETHEUS_MULTIPROC_DIR", None)
        command = [
            sys.executable, "-m", "aggregator.cli", "serve",
            "--database", str(self.database), "--port", str(self.port), *self.args,
        ]  # fmt: skip
        errors = self.error_path or os.devnull
        with self.log_path.open("ab") as log, open(errors, "ab") as error:
            log.write(f"--- start {self.starts} ---\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT if self.error_path is None else error,
                env=environment,
                cwd=ROOT,
                start_new_session=True,
            )
        self.starts += 1
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"the aggregator exited with {self.process.returncode}:\n{self.log()}"
                )
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"the aggregator did not answer within {timeout} s:\n{self.log()}")

    def kill(self) -> None:
        """SIGKILL the server's process group: no graceful shutdown, nothing flushed."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)

    def stop(self) -> None:
        """SIGTERM (graceful shutdown), SIGKILL after 30 s."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()

    def restart(self) -> Self:
        """Kill -9 and start again on the same port and database."""
        self.kill()
        return self.start()

    def log(self) -> str:
        """What the server wrote so far (its stderr after its output, when kept apart)."""
        paths = (self.log_path, self.error_path)
        return "".join(p.read_text(errors="replace") for p in paths if p and p.exists())

    def headers(self, role: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[role]}"}


def fleet_client(url: str, key: str, state_dir: Path, batch_size: int) -> TelemetryClient:
    """One client object standing for many devices: no lifetime cap (the default is finite),
    batches of ``batch_size`` (an hour's interval: they go when full, and at flush)."""
    limits = BudgetLimits(per_metric_per_period=1e6, total_per_period=1e6, lifetime=math.inf)
    return TelemetryClient(
        url,
        key,
        state_dir,
        limits=limits,
        batch_size=batch_size,
        upload_interval=3600.0,
        retry=RetryPolicy(base=0.05, cap=1.0),
    )
