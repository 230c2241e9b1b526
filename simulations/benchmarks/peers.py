"""Adapters over the peer LDP libraries, for side-by-side speed benchmarks.

Two research libraries implement some of our frequency oracles, one report
at a time in Python:

* ``pure-ldp`` 1.2.0: client/server objects (``privatise`` per item,
  ``aggregate`` per report, then the estimate). Items are 1-based by default;
  the adapters pass an identity ``index_mapper`` so that items are our 0-based
  indices. Its servers estimate *counts*; the adapters divide by n.
  Mechanisms: GRR ("DE", direct encoding), SUE and OUE (``UEClient``), OLH
  (``LHClient(use_olh=True)``), HR (``HadamardResponseClient``: our Hadamard
  response for eps <= 1; for eps > 1 the library switches to its blocked
  "general" variant, a different mechanism with the same name).
* ``multi-freq-ldpy`` 0.2.5: per-item client functions (``GRR_Client`` and
  ``UE_Client`` compiled by numba, ``LH_Client`` in Python) and aggregators over
  a list of reports. Mechanisms: GRR, SUE, OUE, OLH; no HR. Its ``*_Aggregator_MI``
  clip negative estimates to 0 and renormalize (biased); the adapters time the
  library's own aggregator, so their frequencies are *not* unbiased and are
  not used for accuracy comparisons.

Neither library has a numeric (mean) mechanism. Both hash Python ``str`` with
xxhash and need ``xxhash<4``; pure-ldp also imports scikit-learn and
statsmodels without declaring them. Everything here is optional: when a library
does not import, ``available_libraries`` says why and ``make_peer`` returns None.

Timing (``time_peer``) is by rate, on as many reports as fit in a time cap:
encoding runs over growing batches of users until the cap or the requested
number of users is reached; aggregation (including the estimate) runs on
growing prefixes of those reports up to the largest that fits. Time left in the
cap repeats the measurement (up to ``BEST_OF`` times) and the best rate counts,
which favours the peers on a busy machine. Library warm-up (numba compilation)
is done before the clock starts.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

#: Import name and distribution name of each peer library.
LIBRARIES: dict[str, tuple[str, str]] = {
    "pure-ldp": ("pure_ldp.frequency_oracles", "pure-ldp"),
    "multi-freq-ldpy": ("multi_freq_ldpy.pure_frequency_oracles", "multi-freq-ldpy"),
}

#: Short labels for tables.
SHORT_NAMES: dict[str, str] = {"pure-ldp": "pl", "multi-freq-ldpy": "mf"}

#: Repetitions of a measurement whose best rate counts.
BEST_OF = 5

#: Memory allowed for one batch of peer reports (pure-ldp's unary reports are int64 per bit).
PEER_MEMORY_BYTES = 256 << 20

_modules: dict[str, Any] = {}
_import_errors: dict[str, str] = {}


def _load(library: str) -> Any | None:
    """Import a peer library once; remember why it failed if it did."""
    if library in _modules:
        return _modules[library]
    if library in _import_errors:
        return None
    module_name, _ = LIBRARIES[library]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module = importlib.import_module(module_name)
            if library == "multi-freq-ldpy":
                for sub in ("GRR", "UE", "LH"):
                    importlib.import_module(f"{module_name}.{sub}")
    except Exception as error:  # noqa: BLE001 - any failure means "not available"
        _import_errors[library] = f"{type(error).__name__}: {error}"
        return None
    _modules[library] = module
    return module


def available_libraries() -> dict[str, str]:
    """Each peer library mapped to ``"<version>"`` or ``"unavailable (<reason>)"``."""
    status = {}
    for library, (_, distribution) in LIBRARIES.items():
        if _load(library) is None:
            status[library] = f"unavailable ({_import_errors[library]})"
        else:
            try:
                status[library] = importlib.metadata.version(distribution)
            except importlib.metadata.PackageNotFoundError:
                status[library] = "unknown version"
    return status


@dataclass
class PeerMechanism:
    """One peer implementation: per-user encode and a whole-batch aggregate."""

    library: str
    mechanism: str  # our wire name
    variant: str  # the library's own class or function names
    encode_one: Callable[[int], Any]
    aggregate: Callable[[list[Any]], np.ndarray]  # reports -> frequency estimates
    report_bytes: int  # rough memory of one report, to bound batches


def _identity(x: int) -> int:
    return x


def _pure_ldp(mechanism: str, epsilon: float, d: int) -> PeerMechanism | None:
    fo = _load("pure-ldp")
    if fo is None:
        return None
    client: Any
    server: Any
    report_bytes = 64
    if mechanism == "grr":
        client = fo.DEClient(epsilon, d, index_mapper=_identity)
        server = fo.DEServer(epsilon, d, index_mapper=_identity)
        variant = "DEClient/DEServer"
    elif mechanism in ("sue", "oue"):
        use_oue = mechanism == "oue"
        client = fo.UEClient(epsilon, d, use_oue=use_oue, index_mapper=_identity)
        server = fo.UEServer(epsilon, d, use_oue=use_oue, index_mapper=_identity)
        variant = f"UEClient/UEServer(use_oue={use_oue})"
        report_bytes = 8 * d + 112
    elif mechanism == "olh":
        client = fo.LHClient(epsilon, d, use_olh=True, index_mapper=_identity)
        server = fo.LHServer(epsilon, d, use_olh=True, index_mapper=_identity)
        variant = "LHClient/LHServer(use_olh=True)"
    elif mechanism == "hr":
        server = fo.HadamardResponseServer(epsilon, d, index_mapper=_identity)
        client = fo.HadamardResponseClient(
            epsilon, d, server.get_hash_funcs(), index_mapper=_identity
        )
        variant = "HadamardResponse" + (" (general variant, eps > 1)" if epsilon > 1 else "")
    else:
        return None

    def aggregate(reports: list[Any]) -> np.ndarray:
        server.reset()
        for report in reports:
            server.aggregate(report)
        server.check_and_update_estimates()
        return np.asarray(server.get_estimates, dtype=np.float64) / max(server.n, 1)

    return PeerMechanism("pure-ldp", mechanism, variant, client.privatise, aggregate, report_bytes)


def _multi_freq_ldpy(mechanism: str, epsilon: float, d: int) -> PeerMechanism | None:
    package = _load("multi-freq-ldpy")
    if package is None:
        return None
    grr, ue, lh = package.GRR, package.UE, package.LH
    report_bytes = 64
    encode_one: Callable[[int], Any]
    aggregate: Callable[[list[Any]], np.ndarray]
    if mechanism == "grr":
        variant = "GRR_Client/GRR_Aggregator_MI"

        def encode_one(x: int) -> Any:
            return grr.GRR_Client(x, d, epsilon)

        def aggregate(reports: list[Any]) -> np.ndarray:
            return np.asarray(grr.GRR_Aggregator_MI(reports, d, epsilon))

    elif mechanism in ("sue", "oue"):
        optimal = mechanism == "oue"
        variant = f"UE_Client/UE_Aggregator_MI(optimal={optimal})"
        report_bytes = 8 * d + 112

        def encode_one(x: int) -> Any:
            return ue.UE_Client(x, d, epsilon, optimal)

        def aggregate(reports: list[Any]) -> np.ndarray:
            return np.asarray(ue.UE_Aggregator_MI(reports, epsilon, optimal))

    elif mechanism == "olh":
        variant = "LH_Client/LH_Aggregator_MI(optimal=True)"

        def encode_one(x: int) -> Any:
            return lh.LH_Client(x, d, epsilon, True)

        def aggregate(reports: list[Any]) -> np.ndarray:
            return np.asarray(lh.LH_Aggregator_MI(reports, d, epsilon, True))

    else:
        return None
    return PeerMechanism("multi-freq-ldpy", mechanism, variant, encode_one, aggregate, report_bytes)


def make_peer(library: str, mechanism: str, epsilon: float, d: int) -> PeerMechanism | None:
    """The library's implementation of our ``mechanism``, or None if it has none or is missing."""
    if library == "pure-ldp":
        return _pure_ldp(mechanism, epsilon, d)
    if library == "multi-freq-ldpy":
        return _multi_freq_ldpy(mechanism, epsilon, d)
    raise ValueError(f"unknown peer library {library!r}")


@dataclass
class PeerTiming:
    """Rates (reports per second) of one peer mechanism, and on how many reports."""

    library: str
    mechanism: str
    variant: str
    encode_rate: float
    encoded: int
    aggregate_rate: float
    aggregated: int


def time_peer(peer: PeerMechanism, values: np.ndarray, time_cap: float) -> PeerTiming:
    """Encode and aggregate rates of ``peer`` on (a prefix of) ``values``, each within ``time_cap``.

    The per-user loop below is the peer's own API (it has no batch path); our
    mechanisms never run per user.
    """
    items = [int(v) for v in values[: max(1, PEER_MEMORY_BYTES // peer.report_bytes)]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        warm = [peer.encode_one(x) for x in items[:4]]  # numba compiles on first call
        peer.aggregate(warm)

        reports: list[Any] = []
        encode_seconds = 0.0
        batch = 8
        while len(reports) < len(items) and encode_seconds < time_cap:
            chunk = items[len(reports) : len(reports) + batch]
            start = time.perf_counter()
            reports.extend([peer.encode_one(x) for x in chunk])
            encode_seconds += time.perf_counter() - start
            batch *= 2
        encode_rate = len(reports) / max(encode_seconds, 1e-12)
        # Time left: encode the same users again and keep the best rate (less disturbed
        # by other processes), as the benchmark does for our mechanisms.
        spent, repeats = encode_seconds, 1
        while spent < time_cap / 2 and repeats < BEST_OF:
            start = time.perf_counter()
            _ = [peer.encode_one(x) for x in items[: len(reports)]]
            seconds = time.perf_counter() - start
            spent += seconds
            repeats += 1
            encode_rate = max(encode_rate, len(reports) / max(seconds, 1e-12))

        size, spent = min(8, len(reports)), 0.0
        while True:  # grow the batch until the cap, then repeat the largest and keep the best
            start = time.perf_counter()
            peer.aggregate(reports[:size])
            best_seconds = time.perf_counter() - start
            spent += best_seconds
            if size >= len(reports) or best_seconds >= time_cap / 4 or spent >= time_cap:
                break
            size = min(2 * size, len(reports))
        repeats = 1
        while spent + best_seconds < time_cap and repeats < BEST_OF:
            start = time.perf_counter()
            peer.aggregate(reports[:size])
            seconds = time.perf_counter() - start
            spent += seconds
            repeats += 1
            best_seconds = min(best_seconds, seconds)
    return PeerTiming(
        peer.library,
        peer.mechanism,
        peer.variant,
        encode_rate,
        len(reports),
        size / max(best_seconds, 1e-12),
        size,
    )
