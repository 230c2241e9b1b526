"""``TelemetryClient``: what an app embeds to report values with local differential privacy.

    with TelemetryClient("https://telemetry.example", api_key, "/var/lib/app/ldp") as client:
        client.record("app.theme", "dark")          # a category, by label or index
        client.record("app.session_minutes", 12.5)  # a number
        client.record_string("browser.home_page", "example.com")  # a string

``record`` checks the value against the metric's spec, debits the privacy ledger
(durably, before anything else), perturbs the value with the metric's mechanism and
the operating system's CSPRNG, and queues only the perturbed report in the outbox; the
raw value goes no further than this call. A background thread uploads the outbox.

An upload that fails leaves its reason in ``last_error`` (``UploadError``: the HTTP status,
the server's problem ``detail``, whether it is permanent, when) until one succeeds. A
refused key (401 unknown or revoked, 403 of another role) or endpoint is permanent: the
reports stay queued for a corrected key or endpoint to deliver, are sent again only every
``RetryPolicy.refused_delay``, the refusal is logged once at WARNING on ``ldp.client``,
and ``flush`` returns False at once.

``record_string`` does the same for string metrics: RAPPOR (memoized, below) and the
open-domain mechanisms ``cms``, ``hcms``, ``pem`` and ``sfp``. A string is checked to be a
``str`` whose UTF-8 bytes fit the metric's ``max_length`` (``pem``, ``sfp``). The
open-domain mechanisms are one-shot: each report is charged the metric's ``epsilon``,
as ``record`` charges a categorical report. What ``pem`` assigns a device for life (its
group of prefix lengths) comes from the device's memo for the spec (below), so a device
always reports in the same group.

Before a metric's spec is first used, the device checks it against its own limits
(``BudgetLimits``: the epsilon of one report, the lifetime epsilon of one memoized value,
the lifetime total), refusing it with ``SpecError``, and pins it in the ledger under its
name and version (``PrivacyLedger.pin``): a different spec served later under the same
name and version is ``SpecChangedError``. Nothing is spent or queued by a refused spec.

Memoized metrics (``lgrr``, ``lsue``, ``loue``, ``losue``, ``dbitflip``, ``onebitmean``,
and ``rappor`` through ``record_string``) answer from a permanent response that is the
same for every report of one value, so that repeated reports do not average the noise
away. It is recomputed on every report from the device secret kept in the privacy ledger
(``shared.memo.KeyedMemo(secret, spec_scope(spec_hash))``, RAPPOR from
``rappor_secret(secret, spec_hash)``), never stored: it survives restarts, and is lost
with the secret. Both are bound to the exact spec (``shared.spec_hash.spec_hash``, the
SHA-256 of its canonical JSON), never to the metric's name and version alone, so two
specs never share randomness, and both are domain-separated from the ledger's own use of
the secret. The ledger charges (``client/ledger.py``) the metric's ``epsilon`` once per
distinct memo key of the spec for life (RAPPOR: epsilon_infinity), and
``epsilon_report`` (epsilon_one) to the period for a key's first report in it, topping
up to ``epsilon`` on a second; the charge is durable before the report is made.

Report times are the coarse hour of the aggregator's clock as the device estimates it
(``ServerClock``: the device's clock plus the offset read from the last response's
``Date`` header, kept in the outbox across restarts), so that a device whose clock is
wrong is not refused for reporting from the future.

One client owns a state directory: it holds an exclusive lock on ``client.lock`` there
(``fcntl.flock``, released by ``close`` or when the process ends), and a second client
on the same directory, in this process or another, fails at once with
``StateDirectoryInUseError``.
"""

from __future__ import annotations

import fcntl
import functools
import math
import os
import ssl
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import httpx
import numpy as np

from client.ledger import BudgetLimits, BudgetStatus, MemoizedCost, PrivacyLedger
from client.outbox import Outbox
from client.specs import SpecCache, SpecError
from client.transport import RetryPolicy, ServerClock, Uploader, UploadError
from shared.dimensions import DimensionError
from shared.hashing import keyed_digest
from shared.mechanisms import (
    DeviceContext,
    Mechanism,
    as_attributes,
    as_categorical,
    as_distribution,
    as_memoized,
    as_numeric,
    make_mechanism,
)
from shared.mechanisms.strings import utf8_values
from shared.memo import KeyedMemo, spec_scope
from shared.schemas import MetricSpec

DIRECTORY_LOCK_FILE = "client.lock"
#: Domain separation of a spec's RAPPOR secret from every other use of the device secret.
RAPPOR_SECRET_LABEL = b"ldp rappor secret v2\x00"
#: The outbox counter keeping the aggregator's clock offset (whole seconds, rounded down).
_OFFSET_COUNTER = "clock_offset_seconds"


class StateDirectoryInUseError(RuntimeError):
    """Another client (in this process or another) holds the state directory."""


class TelemetryClient:
    """Record values privately; see the module docstring. Thread-safe."""

    def __init__(
        self,
        endpoint: str,
        api_key: str,
        state_dir: Path | str,
        *,
        limits: BudgetLimits | None = None,
        batch_size: int = 512,
        upload_interval: float = 5.0,
        max_queued_reports: int = 100_000,
        max_queued_bytes: int = 64 << 20,
        spec_refresh_seconds: float = 3600.0,
        timeout: float = 10.0,
        retry: RetryPolicy | None = None,
        transport: httpx.BaseTransport | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``clock``: the device's wall clock (seconds since the epoch), for the ledger's
        periods and, corrected by the aggregator's ``Date``, for the reports' hours."""
        state = Path(state_dir)
        self._directory_lock = _lock_directory(state)
        self.limits = limits or BudgetLimits()
        try:
            self._ledger = PrivacyLedger(state, self.limits, clock)
            self._outbox = Outbox(state, max_queued_reports, max_queued_bytes)
        except BaseException:
            self._directory_lock.close()
            raise
        self._saved_offset = self._outbox.counter(_OFFSET_COUNTER)
        self._server_clock = ServerClock(float(self._saved_offset or 0), clock)
        self._http = httpx.Client(
            base_url=endpoint.rstrip("/"),
            headers={"Authorization": f"Bearer {api_key}"},
            timeout=timeout,
            verify=tls_context() if transport is None else True,
            transport=transport,
            event_hooks={"response": [self._server_clock.observe]},
        )
        self._specs = SpecCache(state, self._fetch_specs, spec_refresh_seconds)
        #: Mechanisms and device contexts by spec hash: specs checked against the limits
        #: and pinned.
        self._mechanisms: dict[bytes, Mechanism[Any]] = {}
        self._contexts: dict[bytes, DeviceContext] = {}
        self._uploader = Uploader(
            self._outbox,
            self._post_batch,
            batch_size,
            upload_interval,
            retry,
            on_tick=self._tick,
            clock=clock,
        )
        self._closed = False

    # --- recording -------------------------------------------------------------------

    def record(
        self,
        metric: str,
        value: str | int | float | np.integer | np.floating | dict[str, Any],
        dimensions: dict[str, str] | None = None,
    ) -> None:
        """Report a category (its label, or its index) or a number for ``metric``: a number
        for a numeric metric (a mean) or a distribution metric (``hh``, ``sw``: histogram,
        quantiles), clipped to the spec's [lower, upper] by the mechanism; for a metric of
        several attributes (kind ``attributes``) a dict, attribute name -> a label or index
        of a categorical attribute or a number of a numeric one. Each report is charged
        ``epsilon`` to the ledger like any other.

        ``dimensions``: the report's values of the metric's public dimensions (every one
        the metric declares, e.g. ``{"platform": "ios"}``), sent in the clear beside the
        perturbed value: they are NOT protected by local privacy. Checked before anything
        is spent (``ValueError`` naming the dimension)."""
        spec, digest, mechanism = self._lookup(metric)
        checked_dimensions(spec, dimensions)
        if (categories := as_categorical(mechanism)) is not None:
            values = category_index(spec, categories.domain_size, value)
        elif as_numeric(mechanism) is not None or as_distribution(mechanism) is not None:
            values = numeric_value(metric, value)
        elif (attributes := as_attributes(mechanism)) is not None:
            if not isinstance(value, dict):
                raise TypeError(
                    f"{metric}: a value of several attributes is a dict, attribute -> value; "
                    f"got {value!r}"
                )
            try:
                values = attributes.rows([value])
            except ValueError as error:
                raise ValueError(f"{metric}: {error}") from None
        else:
            raise SpecError(
                f"{metric} collects strings ({spec.mechanism.mechanism}): use record_string"
            )
        self._report(spec, digest, mechanism, values, dimensions)

    def record_string(
        self, metric: str, value: str, dimensions: dict[str, str] | None = None
    ) -> None:
        """Report a string for a string metric: RAPPOR (memoized per device and spec), or
        ``cms``, ``hcms``, ``pem``, ``sfp`` (one report, charged ``epsilon``); ``dimensions``
        as for ``record`` (in the clear, checked before anything is spent)."""
        spec, digest, mechanism = self._lookup(metric)
        if mechanism.kind != "string":
            raise SpecError(f"{metric} is a {mechanism.kind} metric: use record")
        checked_dimensions(spec, dimensions)
        checked_string(metric, value)
        self._report(spec, digest, mechanism, [value], dimensions)

    def _report(
        self,
        spec: MetricSpec,
        digest: bytes,
        mechanism: Mechanism[Any],
        values: Any,
        dimensions: dict[str, str] | None,
    ) -> None:
        """Encode one value with the device's context for the spec, charge the ledger what
        the report costs (``epsilon_report``, and a memoized mechanism's lifetime epsilon on
        a value's first report), then queue it with its ``dimensions`` (checked already). A
        value the mechanism refuses raises ``ValueError`` naming the metric, before anything
        is spent or queued."""
        context = self._context(digest)
        try:
            reports = mechanism.encode(values, context=context)
        except ValueError as error:
            raise ValueError(f"{spec.name}: {error}") from None
        lifelong = as_memoized(mechanism)
        if lifelong is None:
            self._ledger.debit(spec.name, spec.mechanism.report_epsilon)
        else:
            key = lifelong.ledger_keys(values, context)[0]
            self._ledger.debit_memoized(spec.name, digest, key, memoized_cost(mechanism))
        self._enqueue(spec, mechanism.to_payloads(reports)[0], dimensions)

    def budget(self) -> BudgetStatus:
        """Epsilon spent and left: this period, per metric, and for life."""
        return self._ledger.status()

    @property
    def queued(self) -> int:
        """Reports waiting in the outbox."""
        return len(self._outbox)

    @property
    def dropped(self) -> int:
        """Reports dropped because the outbox was full (over the device's life)."""
        return self._outbox.dropped

    # --- delivery ----------------------------------------------------------------------

    @property
    def last_error(self) -> UploadError | None:
        """Why the last upload failed (status, the server's ``detail``, ``permanent``,
        time); None before any upload failed and again once one succeeds."""
        return self._uploader.last_error

    def flush(self, timeout: float = 10.0) -> bool:
        """Upload what is queued; True when the outbox is empty within ``timeout`` seconds.
        False at once when the aggregator refuses this device's key or endpoint (the
        reports stay queued): ``last_error`` says why."""
        return self._uploader.flush(timeout)

    def close(self, timeout: float = 5.0) -> bool:
        """Deliver what can be delivered within ``timeout``, give back unused reserved budget,
        and release every resource. True when nothing was left queued."""
        if self._closed:
            return True
        self._closed = True
        try:
            delivered = self._uploader.stop(timeout)
            self._ledger.release()
            self._save_offset()
        finally:
            self._outbox.close()
            self._http.close()
            self._directory_lock.close()
        return delivered

    def __enter__(self) -> TelemetryClient:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    # --- internals ---------------------------------------------------------------------

    def _lookup(self, metric: str) -> tuple[MetricSpec, bytes, Mechanism[Any]]:
        """The metric's current spec, its spec hash and its mechanism; on the first use of
        a spec, checked against the device's limits and pinned in the ledger (or
        ``SpecError``, ``SpecChangedError``: nothing spent or queued)."""
        if self._closed:
            raise RuntimeError("the telemetry client is closed")
        spec, digest = self._specs.get_hashed(metric)
        mechanism = self._mechanisms.get(digest)
        if mechanism is None:
            mechanism = make_mechanism(spec.mechanism)
            check_limits(spec, mechanism, self.limits)
            self._ledger.pin(spec, digest)
            self._mechanisms[digest] = mechanism
        return spec, digest, mechanism

    def _context(self, digest: bytes) -> DeviceContext:
        """What this device keeps for the spec of hash ``digest``: its memo (permanent
        randomness) and its RAPPOR secret, both derived from the device secret and the spec
        hash (kept while the client lives, so that the memo's streams are hashed once)."""
        context = self._contexts.get(digest)
        if context is None:
            secret = self._ledger.device_secret
            context = self._contexts[digest] = DeviceContext(
                memo=KeyedMemo(secret, spec_scope(digest)), secrets=rappor_secret(secret, digest)
            )
        return context

    def _enqueue(
        self, spec: MetricSpec, payload: dict[str, Any], dimensions: dict[str, str] | None
    ) -> None:
        """Queue the wire report (with its dimensions, when the metric has any: they are
        kept in the outbox with it and survive restarts)."""
        report: dict[str, Any] = {
            "report_id": random_uuid4(),
            "metric": spec.name,
            "version": spec.version,
            "payload": payload,
            "time": _hour_stamp(self._server_clock.now()),
        }
        if dimensions:
            report["dimensions"] = dict(dimensions)
        self._outbox.add([report])
        self._uploader.notify()

    def _fetch_specs(self) -> list[dict[str, Any]]:
        response = self._http.get("/v1/metrics")
        response.raise_for_status()
        items = response.json()
        if not isinstance(items, list):
            raise ValueError("GET /v1/metrics did not return a list")
        return items

    def _post_batch(self, body: bytes) -> httpx.Response:
        return self._http.post(
            "/v1/reports", content=body, headers={"Content-Type": "application/json"}
        )

    def _tick(self) -> None:
        self._specs.refresh()
        self._save_offset()

    def _save_offset(self) -> None:
        """Keep the aggregator's clock offset for the next start (when it changed)."""
        if self._server_clock.observed:
            offset = math.floor(self._server_clock.offset)
            if offset != self._saved_offset:
                self._outbox.set_counter(_OFFSET_COUNTER, offset)
                self._saved_offset = offset


def memoized_cost(mechanism: Mechanism[Any]) -> MemoizedCost:
    """What a report of a memoized mechanism costs the ledger: the lifetime epsilon of one
    ledger key and the epsilon of one report (``epsilon`` and ``epsilon_report``; RAPPOR:
    epsilon_infinity and epsilon_one). A mechanism whose lifetime epsilon is unbounded
    (RAPPOR with f = 0: the permanent response is the Bloom filter itself) is refused, and
    so is a mechanism that does not memoize."""
    lifelong = as_memoized(mechanism)
    if lifelong is None:
        raise SpecError(f"{mechanism.name} is not a memoized mechanism")
    per_value = lifelong.epsilon_lifetime
    if not math.isfinite(per_value):
        raise SpecError(
            f"{mechanism.name}: repeated reports of one value have no privacy bound (the "
            "lifetime epsilon is infinite); refused"
        )
    return MemoizedCost(per_value, lifelong.epsilon_report)


def check_limits(spec: MetricSpec, mechanism: Mechanism[Any], limits: BudgetLimits) -> None:
    """Refuse (``SpecError``) a spec whose one report, or one memoized value for life,
    would cost more than the device's limit of that kind, or than its lifetime total."""
    name = f"{spec.name} version {spec.version}"
    per_report = spec.mechanism.report_epsilon
    if per_report > limits.max_epsilon_per_report:
        raise SpecError(
            f"{name} asks for epsilon {per_report:g} per report, above this device's limit "
            f"of {limits.max_epsilon_per_report:g}: refused"
        )
    most = per_report
    if as_memoized(mechanism) is not None:
        most = memoized_cost(mechanism).per_value
        if most > limits.max_value_lifetime_epsilon:
            raise SpecError(
                f"{name} charges epsilon {most:g} for life per value it memoizes, above this "
                f"device's limit of {limits.max_value_lifetime_epsilon:g} per value "
                "(BudgetLimits.max_value_lifetime_epsilon): refused"
            )
    if most > limits.lifetime:
        raise SpecError(
            f"{name} charges epsilon {most:g} at once, above this device's lifetime total of "
            f"{limits.lifetime:g}: refused"
        )


def rappor_secret(device_secret: bytes, spec_hash: bytes) -> bytes:
    """HMAC-SHA256(device secret, ``RAPPOR_SECRET_LABEL`` || spec hash): the secret of the
    device's RAPPOR cohort and permanent responses for one spec (never for a metric name
    alone: two versions, or two specs under one version, get independent ones)."""
    return keyed_digest(device_secret, RAPPOR_SECRET_LABEL + spec_hash)


@functools.cache
def tls_context() -> ssl.SSLContext:
    """httpx's default TLS context (certificates verified against its trust store, which
    ``SSL_CERT_FILE`` / ``SSL_CERT_DIR`` may name), built once per process and shared by
    every client: loading the certificate bundle takes tens of milliseconds, too long to
    repeat for each ``TelemetryClient`` an app opens."""
    return httpx.create_ssl_context()


def _lock_directory(directory: Path) -> IO[bytes]:
    """Hold an exclusive lock on ``directory``'s client lock file, or raise
    ``StateDirectoryInUseError`` at once; closing the returned file releases it."""
    directory.mkdir(parents=True, exist_ok=True)
    handle = open(directory / DIRECTORY_LOCK_FILE, "a+b")  # noqa: SIM115 - held until close
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise StateDirectoryInUseError(
            f"another telemetry client holds the state directory {directory} (in this process "
            "or another); use one client per state directory, or give each its own"
        ) from None
    return handle


def random_uuid4() -> str:
    """A random (version 4, RFC 9562) UUID as text, from the OS CSPRNG: ``uuid.uuid4()``
    without building the object (version bits 0100, variant bits 10)."""
    h = f"{int.from_bytes(os.urandom(16)) & _UUID_CLEAR | _UUID_SET:032x}"
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


#: The version (bits 48-51, counted from the most significant bit 0) and variant (bits
#: 64-65) fields of a UUID: cleared by the mask, then set to 0100 and 10.
_UUID_CLEAR = ~((0xF << 76) | (0x3 << 62)) & ((1 << 128) - 1)
_UUID_SET = (0x4 << 76) | (0x2 << 62)


_hour_cache: tuple[int, str] = (-1, "")


def _hour_stamp(seconds: float) -> str:
    """The UTC hour of ``seconds`` as ISO-8601 (``2026-11-22T10:00:00Z``), formatted once
    an hour (the hour is never later than ``seconds``)."""
    global _hour_cache
    hour = int(seconds // 3600)
    if hour != _hour_cache[0]:
        stamp = datetime.fromtimestamp(hour * 3600, UTC).strftime("%Y-%m-%dT%H:00:00Z")
        _hour_cache = (hour, stamp)
    return _hour_cache[1]


def category_index(spec: MetricSpec, size: int, value: object) -> np.ndarray:
    """The category index of ``value`` (a label, or an index 0..size-1), as the one-element
    array ``encode`` takes; ``ValueError`` or ``TypeError`` saying what is wrong."""
    if isinstance(value, str):
        labels = spec.labels or ()
        if value not in labels:
            raise ValueError(
                f"{spec.name}: {value!r} is not one of its labels {list(labels)[:10]}"
                + (" ..." if len(labels) > 10 else "")
            )
        return np.array([labels.index(value)])
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{spec.name}: a category is a label or an index, got {value!r}")
    if not 0 <= int(value) < size:
        raise ValueError(f"{spec.name}: category index {value} is outside 0..{size - 1}")
    return np.array([int(value)])


def checked_dimensions(spec: MetricSpec, dimensions: dict[str, str] | None) -> None:
    """``ValueError`` naming the metric and the dimension unless ``dimensions`` are the
    report's values of exactly the metric's dimensions (``Dimensions.cell_of``)."""
    try:
        spec.dimension_set.cell_of(dimensions)
    except DimensionError as error:
        raise ValueError(f"{spec.name}: {error}") from None


def checked_string(metric: str, value: str) -> bytes:
    """``value``'s UTF-8 bytes, once it is a ``str`` without lone surrogates
    (``utf8_values``); ``TypeError`` or ``ValueError`` naming the metric and what is wrong."""
    try:
        return utf8_values([value])[0]
    except (TypeError, ValueError) as error:
        raise type(error)(f"{metric}: record_string: {error}") from None


def numeric_value(metric: str, value: object) -> np.ndarray:
    """``value`` as the one-element float array ``encode`` takes; ``TypeError`` unless it
    is a real number (not a bool), ``ValueError`` unless it is finite."""
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise TypeError(f"{metric}: expected a number, got {value!r}")
    if not math.isfinite(float(value)):
        raise ValueError(f"{metric}: the value must be finite, got {value!r}")
    return np.array([float(value)])
