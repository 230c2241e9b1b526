"""A real aggregator process for simulations and benchmarks: ``ldp-aggregator serve``.

``start_server(database, workdir)`` starts the service on a free loopback port with
fresh random admin, analyst and device keys (given through ``LDP_*_KEYS``, stored
hashed by the service like any other key), the per-key rate limit lifted (simulated
fleets share one device key), ``--min-reports 1``, and waits until ``/healthz``
answers. ``Server.stop()`` shuts it down gracefully. Its log goes to ``workdir``.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

__all__ = ["Server", "free_port", "start_server"]

REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Server:
    """A running ``ldp-aggregator serve`` process group."""

    process: subprocess.Popen[bytes]
    url: str
    log_path: Path
    keys: dict[str, str]

    def headers(self, role: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[role]}"}

    def stop(self) -> None:
        """SIGTERM the process group (graceful shutdown), SIGKILL after 30 s."""
        if self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (at the time of asking)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(
    database: str,
    workdir: Path,
    *,
    workers: int = 1,
    extra: Sequence[str] = (),
    timeout: float = 90.0,
    root: Path = REPO_ROOT,
) -> Server:
    """Start ``ldp-aggregator serve`` on a free port and wait until ``/healthz`` answers.

    ``database`` is a SQLite path or a SQLAlchemy URL; ``extra`` more ``serve`` options
    (e.g. ``("--config", "metrics.toml")``); ``root`` the checkout whose code serves (first
    on the path: benchmarks compare an older checkout with this one).
    """
    keys = {role: f"sim-{role}-{secrets.token_hex(16)}" for role in ("admin", "analyst", "device")}
    port = free_port()
    environment = {
        **{k: v for k, v in os.environ.items() if not k.startswith("LDP_")},
        "LDP_ADMIN_KEYS": keys["admin"],
        "LDP_ANALYST_KEYS": keys["analyst"],
        "LDP_DEVICE_KEYS": keys["device"],
        "LDP_RATE_LIMIT_PER_SECOND": "1000000",
        "LDP_RATE_LIMIT_BURST": "1000000",
    }
    environment.pop("PROMETHEUS_MULTIPROC_DIR", None)
    if root != REPO_ROOT:
        environment["PYTHONPATH"] = str(root)
    if workers > 1:
        metrics_dir = Path(tempfile.mkdtemp(prefix="prometheus-", dir=workdir))
        environment["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
    log_path = workdir / f"server-{port}.log"
    command = [
        sys.executable, "-m", "aggregator.cli", "serve", "--database", database,
        "--port", str(port), "--workers", str(workers), "--min-reports", "1",
        "--log-level", "warning", *extra,
    ]  # fmt: skip
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=environment,
            cwd=root,
            start_new_session=True,
        )
    server = Server(process, f"http://127.0.0.1:{port}", log_path, keys)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}:\n{server.log_tail()}")
        try:
            if httpx.get(f"{server.url}/healthz", timeout=1.0).status_code == 200:
                if workers > 1:
                    time.sleep(1.0)  # let every worker finish starting, not only the first
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    server.stop()
    raise RuntimeError(f"the server did not answer within {timeout} s:\n{server.log_tail()}")
