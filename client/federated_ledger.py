"""The device's own ledger of its federated uploads, charged before each upload is sent.

In the ``local`` mode of federated learning every upload is ``clip(Delta, C) + N(0,
(z C)^2 I)``: two clipped updates differ by at most ``2 C`` in L2 norm, so one upload is
the Gaussian mechanism with noise multiplier ``z / 2`` (Dwork and Roth 2014, Theorem
A.1; see :mod:`shared.federated.privacy`). In the ``silo`` mode an upload is the outcome
of ``s`` DP-SGD steps over the silo's records, ``s`` Poisson-subsampled Gaussian releases
at ``(z, q_r)`` per record (Abadi et al. 2016). The device's epsilon for a task is that of
**every** upload it made, composed: one per round, and one more for each re-attempt of a
round the server restarted, whatever the server reports. The server sees who uploads, so
the device's own sampling of rounds buys no amplification: each upload is composed as if
the device took part for sure (the silo's sampling of its records does amplify, record
by record, and is accounted).

Accounting (:func:`device_releases_epsilon`) uses the project's accountant
(:func:`shared.accounting.releases_epsilon`, on Google's ``dp-accounting``): the
Renyi-DP bound (Mironov 2017), cheap for any multiplier, and, where that bound is small
enough for a PLD grid to stay small (at most ``PLD_CEILING``), also the privacy loss
distribution bound (Koskela et al. 2020; Doroshenko et al. 2022) at the federated
discretization the server uses. Both are valid upper bounds on epsilon, so their minimum
is one too; PLD is tighter and agrees with the server's calibration, RDP never blows up
(a PLD grid for a hostile multiplier such as ``1e-9`` would not fit in memory).

Durability. With a state directory the ledger of task ``T`` at endpoint ``E`` is one JSON
file (``federated-<sha256(E, T)>.json``) with a SHA-256 checksum of its content (format 2:
releases by multiplier and sampling rate, and the number of uploads; a format 1 file, of
unsampled releases one per upload, is read as such). A charge
holds an exclusive lock (``fcntl.flock`` on a sibling ``.lock`` file, so another process
waits), reads the file, checks the cap, writes the new state to a temporary file, fsyncs
it, renames it over the ledger and fsyncs the directory: only then may the caller train,
noise and upload. A crash after the charge loses that budget; none can spend it twice.
A file that does not parse or does not match its checksum fails closed
(:class:`client.ledger.LedgerCorruptError`): nothing more is uploaded. Without a state
directory the ledger lives in memory for the client's lifetime.

The cap is per task and endpoint; an app that joins several tasks caps their sum itself.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import math
import os
import threading
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from client.ledger import LedgerCorruptError
from shared.accounting import releases_epsilon
from shared.caps import within_cap
from shared.federated.task import FEDERATED_DISCRETIZATION, NOISE

__all__ = ["Charge", "FederatedLedger", "PLD_CEILING", "device_epsilon", "device_releases_epsilon"]

#: The PLD bound is computed only where the RDP bound is at most this: the PLD grid grows
#: with the privacy loss (about 1 s for epsilon in the hundreds, out of memory for
#: multipliers near 1e-4), while no useful cap lies above it.
PLD_CEILING = 64.0
FORMAT = 2

#: Releases by ``(noise multiplier, sampling rate)``.
Releases = dict[tuple[float, float], int]


def device_epsilon(releases: Mapping[float, int], sample_rate: float, delta: float) -> float:
    """Epsilon at ``delta`` of Gaussian releases, ``releases[z]`` of them at multiplier ``z``,
    each Poisson-subsampled at ``sample_rate`` (1: no sampling): :func:`device_releases_epsilon`
    of ``{(z, sample_rate): count}``."""
    rate = float(sample_rate)
    return device_releases_epsilon({(z, rate): n for z, n in releases.items()}, delta)


def device_releases_epsilon(releases: Mapping[tuple[float, float], int], delta: float) -> float:
    """Epsilon at ``delta`` of Gaussian releases, ``releases[(z, q)]`` of them at multiplier
    ``z``, each Poisson-subsampled at rate ``q``, with the noise the server's accountant
    charges (``NOISE``: the discrete Gaussian, by its zCDP bound whatever the method).

    ``min(eps_RDP, eps_PLD)`` where ``eps_PLD`` is computed only when ``eps_RDP <=
    PLD_CEILING`` (see the module docstring); ``inf`` if any multiplier is 0 (no noise);
    0 with no releases.
    """
    key = tuple(sorted((float(z), float(q), int(n)) for (z, q), n in releases.items()))
    return _epsilon(key, float(delta))


@functools.lru_cache(maxsize=512)
def _epsilon(releases: tuple[tuple[float, float, int], ...], delta: float) -> float:
    if not releases:
        return 0.0
    if any(not z > 0 for z, _, _ in releases):
        return math.inf
    merged: Releases = {}
    for z, q, n in releases:
        merged[(z, q)] = merged.get((z, q), 0) + n
    with warnings.catch_warnings():
        # dp-accounting divides by z^2: a multiplier near 1e-300 overflows to inf, which
        # is the right answer (no privacy) and needs no warning.
        warnings.simplefilter("ignore", RuntimeWarning)
        rdp = releases_epsilon(merged, delta, "rdp", mechanism=NOISE)
    if not rdp <= PLD_CEILING:
        return rdp
    pld = releases_epsilon(
        merged, delta, "pld", value_discretization_interval=FEDERATED_DISCRETIZATION,
        mechanism=NOISE,
    )  # fmt: skip
    return min(rdp, pld)


@dataclass(frozen=True)
class Charge:
    """The outcome of :meth:`FederatedLedger.charge`: whether the upload was charged and
    the epsilon (at ``delta``) that it brings (or would have brought) the task to; None
    when there was no cap to check (nothing computed: accounting imports SciPy)."""

    charged: bool
    epsilon: float | None
    delta: float


class FederatedLedger:
    """The uploads of one device to one task: its Gaussian releases ``{(z, q): count}``
    (``z / 2`` at rate 1 for a local-mode upload; ``s`` releases at ``(z, q_r)`` for a
    silo's), how many uploads made them, and the accounting delta.

    ``delta`` is the smallest delta the ledger was ever charged at (a smaller delta gives
    a larger epsilon, so the ledger's epsilon never shrinks when a server changes delta).
    """

    def __init__(self, endpoint: str, task: str, state_dir: str | Path | None = None) -> None:
        self.endpoint, self.task = endpoint.rstrip("/"), task
        self._memory: dict[str, Any] = _empty()
        self._lock = threading.Lock()
        self._path: Path | None = None
        if state_dir is not None:
            directory = Path(state_dir)
            directory.mkdir(parents=True, exist_ok=True)
            key = hashlib.sha256(f"{self.endpoint}\n{task}".encode()).hexdigest()[:32]
            self._path = directory / f"federated-{key}.json"

    # --- reading -------------------------------------------------------------------------

    def releases(self) -> Releases:
        """How many releases were charged at each (multiplier, sampling rate)."""
        with self._locked():
            return dict(self._read()["releases"])

    def uploads(self) -> int:
        """How many uploads were charged."""
        with self._locked():
            return int(self._read()["uploads"])

    def epsilon(self, delta: float | None = None) -> float:
        """Epsilon of the uploads charged so far, at the smaller of ``delta`` and the
        ledger's own delta (0 before the first upload)."""
        with self._locked():
            state = self._read()
        used = _smaller(state["delta"], delta)
        return 0.0 if used is None else device_releases_epsilon(state["releases"], used)

    # --- charging ------------------------------------------------------------------------

    def charge(
        self,
        multiplier: float,
        delta: float,
        cap: float | None,
        *,
        sample_rate: float = 1.0,
        releases: int = 1,
    ) -> Charge:
        """Charge one upload, ``releases`` Gaussian releases at ``multiplier`` each
        Poisson-subsampled at ``sample_rate``, unless the task's epsilon (at the smaller of
        ``delta`` and the ledger's delta) would then exceed ``cap`` (with the budget's
        relative slack of 1e-12); a refused charge changes nothing. Durable before it
        returns when the ledger has a state directory."""
        with self._locked():
            state = self._read()
            used = _smaller(state["delta"], delta)
            assert used is not None
            charged = dict(state["releases"])
            key = (float(multiplier), float(sample_rate))
            charged[key] = charged.get(key, 0) + releases
            after: float | None = None
            if cap is not None:
                after = device_releases_epsilon(charged, used)
                if not within_cap(after, cap):
                    return Charge(False, after, used)
            self._write({"releases": charged, "uploads": state["uploads"] + 1, "delta": used})
            return Charge(True, after, used)

    # --- storage -------------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._lock:
            if self._path is None:
                yield
                return
            with self._path.with_suffix(".lock").open("a") as handle:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
                try:
                    yield
                finally:
                    fcntl.flock(handle.fileno(), fcntl.LOCK_UN)

    def _read(self) -> dict[str, Any]:
        if self._path is None:
            return self._memory
        try:
            text = self._path.read_text()
        except FileNotFoundError:
            return _empty()
        try:
            data = json.loads(text)
            body = data["body"]
            if data["checksum"] != _checksum(body) or body["format"] not in (1, FORMAT):
                raise ValueError("checksum or format mismatch")
            if (body["endpoint"], body["task"]) != (self.endpoint, self.task):
                raise ValueError(f"the file belongs to task {body['task']!r}")
            releases: Releases = {}
            if body["format"] == 1:  # one unsampled release per upload
                for z, n in body["releases"]:
                    releases[(float(z), 1.0)] = int(n)
                uploads = sum(releases.values())
            else:
                for z, q, n in body["releases"]:
                    releases[(float(z), float(q))] = int(n)
                uploads = int(body["uploads"])
            delta = None if body["delta"] is None else float(body["delta"])
        except (ValueError, KeyError, TypeError) as error:
            raise LedgerCorruptError(
                f"the federated ledger {self._path} is unreadable or was altered ({error}); "
                "no update is uploaded"
            ) from None
        return {"releases": releases, "uploads": uploads, "delta": delta}

    def _write(self, state: dict[str, Any]) -> None:
        if self._path is None:
            self._memory = state
            return
        body = {
            "format": FORMAT,
            "endpoint": self.endpoint,
            "task": self.task,
            "delta": state["delta"],
            "uploads": state["uploads"],
            "releases": [[z, q, n] for (z, q), n in sorted(state["releases"].items())],
        }
        temporary = self._path.with_suffix(".tmp")
        with temporary.open("w") as handle:
            json.dump({"body": body, "checksum": _checksum(body)}, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, self._path)
        descriptor = os.open(self._path.parent, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


def _empty() -> dict[str, Any]:
    return {"releases": {}, "uploads": 0, "delta": None}


def _smaller(first: float | None, second: float | None) -> float | None:
    values = [value for value in (first, second) if value is not None]
    return min(values) if values else None


def _checksum(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
