"""Auditing a metric: the device's encoding run many times, counted into a lower bound on epsilon.

For each view of a metric (``simulations.audit_attacks``: two inputs v0, v1 and an event
S), the device path is run for ``trials`` fresh devices holding v0 and as many holding
v1, the hits of S are counted, and ``simulations.audit_bounds.epsilon_lower_bound`` turns
the counts into a bound that exceeds the true epsilon with probability at most ``alpha``.
A bound above the declared epsilon is a *violation*: with confidence 1 - alpha, the code
that runs does not keep the promise the metric publishes.

What runs. Two device paths, one law:

* ``sdk``: real ``client.TelemetryClient`` objects, each with its own state directory
  (ledger, outbox, device secret), serving the metric's spec from a transport stub that
  also captures the uploaded batches; every trial is ``record`` (or ``record_string``)
  as an app calls it, the mechanism's ``encode`` of one value with the operating
  system's CSPRNG, memoized metrics (and RAPPOR, and PEM's group) from the device's own
  ``KeyedMemo`` secret. The payloads captured are decoded by the mechanism's
  ``from_payloads``, as the aggregator does. A stateful mechanism needs a fresh device per
  trial (about 7 ms each); others share one client (about 50 us a report). Nothing
  reaches a real aggregator.
* ``batch`` (the default, for the statistically strong bound): the same mechanism
  object's vectorized ``encode`` that the SDK calls, on many devices per call, with the
  OS CSPRNG (or a seeded generator, for reproducible runs). Device state is the same
  function of a per-device memo, here ``shared.memo.SimulatedMemo`` (a vectorized hash,
  one device id per trial) instead of the device's HMAC streams, and RAPPOR's secrets
  are 32 random bytes per device with a uniform cohort, the law of ``assign_cohort``.
  Single values take their own code paths in some mechanisms (``grr``, ``sue``, ``oue``
  draw one report from one word or one buffer); the tests check that the two paths give
  the same output distribution.

Trials are encoded and counted in chunks of about ``CHUNK_REPORTS`` reports, so memory
stays bounded whatever ``trials`` is. Without ``trials``, each view is sized from its
event's own probabilities (``planned_trials``) to reach ``target`` times the event's
epsilon at the median, capped at ``max_trials``.
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import httpx
import numpy as np

from client import BudgetLimits, TelemetryClient
from shared.mechanisms import DeviceContext, Mechanism, as_attributes, make_mechanism
from shared.mechanisms.spec import spec_models
from shared.memo import SimulatedMemo
from shared.randomness import Rng, as_source
from shared.schemas import MechanismSpec, MetricSpec
from simulations.audit_attacks import DEFAULT_LIFETIME_REPORTS, Attack, attacks_for
from simulations.audit_bounds import epsilon_lower_bound, planned_trials

__all__ = [
    "CHUNK_REPORTS",
    "AuditResult",
    "BatchDevices",
    "Devices",
    "SdkDevices",
    "audit_metric",
    "mechanism_label",
    "metric_for",
    "run_attack",
    "sdk_devices",
    "sweep_spec",
]

DevicePath = Literal["batch", "sdk"]
#: Reports encoded and counted at once.
CHUNK_REPORTS = 1 << 17
#: A sweep's numeric metrics take values in [0, 1].
SWEEP_RANGE = (0.0, 1.0)
#: A sweep's multi-attribute metrics: three categorical attributes, the first two a declared
#: pair (two views: the pair's d^2 cells, and the third attribute).
SWEEP_ATTRIBUTES = ("a", "b", "c")
#: A sweep's distribution metrics cut that range into this many buckets (hh: 4^2, two
#: levels of its default branching).
SWEEP_BUCKETS = 16


class Devices(Protocol):
    """Where trials come from: ``reports(value, devices, per_device)`` is the reports of
    ``devices`` fresh devices holding ``value``, ``per_device`` each, device by device."""

    def reports(self, value: Any, devices: int, per_device: int) -> np.ndarray: ...


def _values(mechanism: Mechanism[Any], value: Any, count: int) -> np.ndarray:
    """``count`` copies of ``value`` in the form the mechanism's ``encode`` takes: an index,
    a number, a string, or (several attributes) the row of a record ``{attribute: value}``."""
    kind = mechanism.spec.kind
    if kind == "categorical":
        return np.full(count, int(value), dtype=np.int64)
    if kind in ("numeric", "distribution"):
        return np.full(count, float(value), dtype=np.float64)
    if (attributes := as_attributes(mechanism)) is not None:
        return np.repeat(attributes.rows([value]), count, axis=0)
    return np.full(count, value, dtype=object)


class BatchDevices:
    """The mechanism's vectorized ``encode``, many devices per call (module docstring)."""

    def __init__(self, mechanism: Mechanism[Any], rng: Rng = None) -> None:
        self.mechanism = mechanism
        self.rng = rng
        self._source = as_source(rng)
        self._seed = int(self._source.words(1)[0] >> np.uint64(1))
        self._next_device = 0

    def reports(self, value: Any, devices: int, per_device: int) -> np.ndarray:
        mechanism, count = self.mechanism, devices * per_device
        values = _values(mechanism, value, count)
        if not mechanism.stateful:
            return mechanism.encode(values, self.rng)
        ids = np.arange(self._next_device, self._next_device + devices)
        self._next_device += devices
        secrets = self._source.octets(32 * devices).reshape(devices, 32)
        context = DeviceContext(  # each device's memo and secret, for each of its reports
            memo=SimulatedMemo(np.repeat(ids, per_device), self._seed),
            secrets=np.repeat(secrets, per_device, axis=0),
        )
        return mechanism.encode(values, self.rng, context)


class SdkDevices:
    """Real ``TelemetryClient`` devices in ``directory``, reports captured by a transport
    stub that serves ``metric`` (module docstring)."""

    def __init__(self, metric: MetricSpec, directory: Path) -> None:
        self.metric = metric
        self.mechanism = make_mechanism(metric.mechanism)
        self._directory = directory
        self._captured: list[dict[str, Any]] = []
        self._transport = httpx.MockTransport(self._handle)
        self._opened = 0
        self._shared: TelemetryClient | None = None
        #: Whether a device keeps state that one report depends on (memo, secret, group).
        self.stateful = self.mechanism.stateful

    def _handle(self, request: httpx.Request) -> httpx.Response:
        if request.method == "GET" and request.url.path == "/v1/metrics":
            return httpx.Response(200, json=[self.metric.model_dump(mode="json")])
        if request.method == "POST" and request.url.path == "/v1/reports":
            batch = json.loads(request.content)["reports"]
            self._captured.extend(batch)
            return httpx.Response(200, json={"accepted": len(batch), "duplicates": 0})
        return httpx.Response(404)

    def _open(self) -> TelemetryClient:
        self._opened += 1
        per_report = self.metric.mechanism.report_epsilon
        limits = BudgetLimits(
            per_metric_per_period=math.inf,
            total_per_period=math.inf,
            lifetime=math.inf,  # the audit measures the metric, not the device's caps
            max_epsilon_per_report=max(4.0, per_report),
            max_value_lifetime_epsilon=math.inf,
        )
        return TelemetryClient(
            "http://audit.invalid",
            "audit-device",
            self._directory / f"device-{self._opened:07d}",
            limits=limits,
            transport=self._transport,
            upload_interval=3600.0,
            batch_size=1 << 20,  # nothing leaves before flush
        )

    def _record(self, client: TelemetryClient, value: Any, times: int) -> None:
        name = self.metric.name
        for _ in range(times):
            if self.metric.mechanism.kind == "string":
                client.record_string(name, value)
            else:
                client.record(name, value)
        if not client.flush(timeout=60.0):
            raise RuntimeError("the audit's transport stub did not receive every report")

    def reports(self, value: Any, devices: int, per_device: int) -> np.ndarray:
        start = len(self._captured)
        recorded = int(value) if self.metric.mechanism.kind == "categorical" else value
        if self.stateful:
            for _ in range(devices):
                with self._open() as client:
                    self._record(client, recorded, per_device)
        else:
            if self._shared is None:
                self._shared = self._open()
            self._record(self._shared, recorded, devices * per_device)
        payloads = [report["payload"] for report in self._captured[start:]]
        del self._captured[start:]
        return self.mechanism.from_payloads(payloads)

    def close(self) -> None:
        if self._shared is not None:
            self._shared.close(timeout=1.0)
            self._shared = None


@contextmanager
def sdk_devices(metric: MetricSpec) -> Iterator[SdkDevices]:
    """``SdkDevices`` in a temporary directory (in memory, ``/dev/shm``, where the system
    has it: the ledger's fsyncs then cost microseconds), removed afterwards."""
    memory = Path("/dev/shm")
    root = str(memory) if memory.is_dir() else None
    with tempfile.TemporaryDirectory(prefix="ldp-audit-", dir=root) as directory:
        devices = SdkDevices(metric, Path(directory))
        try:
            yield devices
        finally:
            devices.close()


@dataclass(frozen=True)
class AuditResult:
    """One view of one metric, audited."""

    metric: str
    mechanism: str
    attack: Attack
    trials: int
    hits: tuple[int, int]
    alpha: float
    lower_bound: float
    path: str
    seconds: float

    @property
    def violation(self) -> bool:
        """The bound exceeds the declared epsilon: the promise is broken (confidence 1 - alpha)."""
        return self.lower_bound > self.attack.declared

    def row(self) -> dict[str, Any]:
        attack = self.attack
        p0, p1 = attack.probabilities
        return {
            "metric": self.metric,
            "mechanism": self.mechanism,
            "view": attack.view,
            "declared_epsilon": attack.declared,
            "lower_bound": self.lower_bound,
            "ratio": self.lower_bound / attack.declared,
            "event_epsilon": attack.event_epsilon,
            "tight": attack.tight,
            "violation": self.violation,
            "trials": self.trials,
            "reports_per_trial": attack.reports_per_trial,
            "hits_v0": self.hits[0],
            "hits_v1": self.hits[1],
            "expected_v0": p0,
            "expected_v1": p1,
            "alpha": self.alpha,
            "inputs": f"{attack.inputs[0]!r} vs {attack.inputs[1]!r}",
            "event": attack.description,
            "path": self.path,
            "seconds": self.seconds,
        }


def run_attack(
    attack: Attack, devices: Devices, trials: int, alpha: float
) -> tuple[tuple[int, int], float]:
    """((hits of v0, hits of v1), the lower bound) from ``trials`` trials of each input."""
    if trials < 1:
        raise ValueError(f"an audit needs at least one trial per input, got {trials}")
    per_chunk = max(1, CHUNK_REPORTS // attack.reports_per_trial)
    hits = []
    for value in attack.inputs:
        count = done = 0
        while done < trials:
            size = min(per_chunk, trials - done)
            reports = devices.reports(value, size, attack.reports_per_trial)
            count += int(np.count_nonzero(attack.event(reports)))
            done += size
        hits.append(count)
    bound = float(epsilon_lower_bound(hits[0], trials, hits[1], trials, alpha))
    return (hits[0], hits[1]), bound


def mechanism_label(spec: MechanismSpec, mechanism: Any) -> str:
    """The spec's mechanism name; ``auto`` says what it resolved to."""
    return spec.mechanism if spec.mechanism != "auto" else f"auto ({mechanism.name})"


def audit_metric(
    metric: MetricSpec,
    *,
    alpha: float = 0.05,
    trials: int | None = None,
    target: float = 0.9,
    max_trials: int = 1_000_000,
    lifetime_reports: int = DEFAULT_LIFETIME_REPORTS,
    path: DevicePath = "batch",
    rng: Rng = None,
) -> list[AuditResult]:
    """Audit every view of ``metric`` (module docstring): ``trials`` per input, or as many as
    reach ``target`` times each event's epsilon at the median (at most ``max_trials``)."""
    if not 0.0 < target < 1.0:
        raise ValueError(f"target must lie in (0, 1), got {target!r}")
    mechanism = make_mechanism(metric.mechanism)
    label = mechanism_label(metric.mechanism, mechanism)
    results = []
    with _devices(metric, mechanism, path, rng) as devices:
        for attack in attacks_for(mechanism, lifetime_reports):
            count = trials
            if count is None:
                goal = target * min(attack.event_epsilon, attack.declared)
                planned = planned_trials(*attack.probabilities, goal, alpha, 0.5, max_trials)
                count = max_trials if planned is None else planned
            started = time.perf_counter()
            hits, bound = run_attack(attack, devices, count, alpha)
            seconds = time.perf_counter() - started
            results.append(
                AuditResult(metric.name, label, attack, count, hits, alpha, bound, path, seconds)
            )
    return results


@contextmanager
def _devices(metric: MetricSpec, mechanism: Any, path: DevicePath, rng: Rng) -> Iterator[Devices]:
    if path == "batch":
        yield BatchDevices(mechanism, rng)
    elif path == "sdk":
        with sdk_devices(metric) as devices:
            yield devices
    else:
        raise ValueError(f"path must be 'batch' or 'sdk', got {path!r}")


def metric_for(spec: MechanismSpec, name: str | None = None) -> MetricSpec:
    """A metric (version 1) around a bare spec, named after it unless ``name`` is given."""
    if name is None:
        name = f"audit.{spec.mechanism}.eps{spec.epsilon:g}"
    return MetricSpec(name=name, version=1, mechanism=spec)


def sweep_spec(
    mechanism: str, epsilon: float, domain_size: int = 8, report_share: float = 0.5
) -> MechanismSpec:
    """The spec a sweep audits ``mechanism`` at ``epsilon`` with, every other parameter fixed:
    categories 0..d-1; numbers in [0, 1]; ``lgrr``, ``lsue``, ``loue``, ``losue``:
    ``epsilon_report`` = ``report_share`` x epsilon (``onebitmean``: output perturbation
    0.1; ``dbitflip``: one bucket per device); RAPPOR
    16 Bloom bits, one hash, 4 cohorts, f = 2 / (1 + e^(3 eps / 4)) (so epsilon_infinity =
    1.5 eps) and p = 1 - q with q* = 1 / (1 + e^(-eps / 2)), which makes epsilon_one = eps;
    sketches 4 x 32; ``pem`` and ``sfp`` strings of up to 2 and 4 bytes; distributions
    (``hh``, ``sw``) numbers in [0, 1] in ``SWEEP_BUCKETS`` buckets (memoized ones:
    ``epsilon_report`` = ``report_share`` x epsilon); several attributes (``spl``, ``smp``,
    ``rsfd``): ``SWEEP_ATTRIBUTES`` of d categories each, the first two declared as a pair,
    the oracle ``auto``."""
    fields: dict[str, Any] = {"mechanism": mechanism, "epsilon": epsilon}
    model = spec_models().get(mechanism)
    if model is not None and model.kind == "attributes":
        fields.update(
            attributes=[{"name": name, "domain_size": domain_size} for name in SWEEP_ATTRIBUTES],
            pairs=[list(SWEEP_ATTRIBUTES[:2])],
            oracle="auto",
        )
    elif model is not None and model.kind == "distribution":
        fields.update(lower=SWEEP_RANGE[0], upper=SWEEP_RANGE[1], buckets=SWEEP_BUCKETS)
        if model.is_memoized:
            fields["epsilon_report"] = report_share * epsilon
    elif mechanism in ("laplace", "duchi", "piecewise", "onebitmean"):
        fields.update(lower=SWEEP_RANGE[0], upper=SWEEP_RANGE[1])
        if mechanism == "onebitmean":
            fields["flip_probability"] = 0.1
    elif mechanism == "rappor":
        flip = 2.0 / (1.0 + math.exp(0.75 * epsilon))
        q_star = 1.0 / (1.0 + math.exp(-epsilon / 2))
        q = (q_star - flip / 2) / (1 - flip)
        fields = {
            "mechanism": "rappor", "num_bits": 16, "num_hashes": 1, "num_cohorts": 4,
            "f": flip, "p": 1.0 - q, "q": q,
        }  # fmt: skip
    elif mechanism in ("cms", "hcms"):
        fields.update(sketch_width=32, sketch_depth=4)
    elif mechanism == "pem":
        fields["max_length"] = 2
    elif mechanism == "sfp":
        fields.update(max_length=4, sketch_width=32, sketch_depth=4)
    else:
        fields["domain_size"] = domain_size
        if mechanism in ("lgrr", "lsue", "loue", "losue"):
            fields["epsilon_report"] = report_share * epsilon
    return MechanismSpec.model_validate(fields)
