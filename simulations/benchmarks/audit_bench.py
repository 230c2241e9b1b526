"""Benchmark of ``ldp-sim audit metric``: the time to a lower bound within 10% of epsilon,
against auditing with a peer library's per-report client.

Run from the repository root (a script, not a test)::

    python -m simulations.benchmarks.audit_bench --quick    # smoke run, seconds
    python -m simulations.benchmarks.audit_bench            # full run, a few minutes

For each categorical mechanism (``grr``, ``sue``, ``oue``, ``olh``, ``hr``; memoized
``lgrr`` and ``losue``, their one-report view at epsilon_report = epsilon / 2), epsilon
and domain size d: the trials per input are planned
(``simulations.audit_bounds.planned_trials``) so that the bound reaches 0.9 times the
declared epsilon at alpha = 0.05 in at least 19 runs of 20 (each count at its 2.5%
quantile against the auditor), then ``simulations.audit_metric.run_attack`` runs them on
the batch path (the mechanism's own vectorized encode, the OS CSPRNG) in this process,
on one core. Printed: the trials, the seconds (encoding and counting the event), the
bound and its share of the declared epsilon.

The peer is the way LDP-Auditor (Arcolezi and Gambs, PETS 2024) audits: one call of a
library's client per report. Its audit of the same trials takes at least 2 n / r seconds,
r the client's encode rate (``peers.time_peer``: best of several runs, numba compiled
before the clock starts; the peer's event counting is not charged to it). The peers:
multi-freq-ldpy 0.2.5 (``mf``: ``GRR_Client``, ``UE_Client``, ``LH_Client``; for the
memoized ones ``L_GRR_Client`` and ``L_OSUE_Client``, a fresh permanent response per call,
which is what one report of a fresh device is), the library LDP-Auditor audits, and
pure-ldp 1.2.0 (``pl``), whichever is faster. ``x`` is the peer's time over ours. Without
the optional ``bench`` extra the peer columns say so.

Targets (MISS lines, the run exits with status 1): every bound at least 0.9 x epsilon
and every audit under 60 s.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from shared.mechanisms import make_mechanism
from simulations.audit_attacks import attacks_for
from simulations.audit_bounds import planned_trials
from simulations.audit_metric import BatchDevices, run_attack, sweep_spec
from simulations.benchmarks import longitudinal_bench
from simulations.benchmarks import peers as peer_lib
from simulations.benchmarks.mechanisms import si, times

MECHANISMS = ("grr", "sue", "oue", "olh", "hr", "lgrr", "losue")
#: The bound to reach, as a share of the declared epsilon, and the audit's time limit.
TARGET_SHARE = 0.9
TARGET_SECONDS = 60.0
#: Confidence of the bound, and the chance the planned trials fall short of the target.
ALPHA = 0.05
SHORTFALL = 0.05
#: Most trials an audit may plan.
TRIAL_LIMIT = 1 << 27


@dataclass(frozen=True)
class Settings:
    epsilons: tuple[float, ...]
    domains: tuple[int, ...]
    peer_time: float  # seconds of peer encoding per measurement


FULL = Settings((0.5, 1.0, 2.0, 4.0), (64, 1024), 1.0)
QUICK = Settings((1.0, 4.0), (16,), 0.2)

HEADER = (
    f"{'mech':<6} {'eps':>4} {'d':>4} {'trials':>7} {'seconds':>7} {'bound':>6} {'share':>5} | "
    f"{'peer':>4} {'peer enc/s':>10} {'peer s':>7} {'x':>6}"
)


def _memoized_peer_available() -> bool:
    return not longitudinal_bench.peer_status().startswith("unavailable")


def peer_rate(mechanism: str, epsilon: float, d: int, cap: float) -> tuple[str, float]:
    """The faster peer's per-report encode rate for ``mechanism`` (0 if none has it)."""
    candidates = [
        (peer_lib.SHORT_NAMES[library], peer_lib.make_peer(library, mechanism, epsilon, d))
        for library in peer_lib.LIBRARIES
    ]
    if mechanism in longitudinal_bench.PEER_PROTOCOLS and _memoized_peer_available():
        memoized = longitudinal_bench.make_peer(sweep_spec(mechanism, epsilon, d))
        assert memoized is not None
        candidates.append(("mf", memoized.timing_view()))
    best = ("-", 0.0)
    values = np.zeros(1 << 16, dtype=np.int64)
    for name, peer in candidates:
        if peer is not None:
            rate = peer_lib.time_peer(peer, values, cap).encode_rate
            best = max(best, (name, rate), key=lambda pair: pair[1])
    return best


def run(mechanism: str, epsilon: float, d: int, peer_time: float) -> tuple[str, bool]:
    """One row of the table, and whether it meets both targets."""
    mech = make_mechanism(sweep_spec(mechanism, epsilon, d))
    attack = attacks_for(mech)[0]
    goal = TARGET_SHARE * attack.declared
    trials = planned_trials(*attack.probabilities, goal, ALPHA, SHORTFALL, TRIAL_LIMIT)
    if trials is None:
        return f"{mechanism:<6} {epsilon:>4g} {d:>4} cannot reach the target", False
    started = time.perf_counter()
    _, bound = run_attack(attack, BatchDevices(mech), trials, ALPHA)
    seconds = time.perf_counter() - started
    peer, rate = peer_rate(mechanism, epsilon, d, peer_time)
    peer_seconds = 2 * trials / rate if rate > 0 else math.inf
    share = bound / attack.declared
    row = (
        f"{mechanism:<6} {epsilon:>4g} {d:>4} {si(trials):>7} {seconds:>7.2f} {bound:>6.3f} "
        f"{share:>5.2f} | {peer:>4} {si(rate):>10} {times(peer_seconds):>7} "
        f"{times(peer_seconds / seconds):>6}"
    )
    return row, share >= TARGET_SHARE and seconds < TARGET_SECONDS


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: fewer cells")
    parser.add_argument("--mechanisms", default=",".join(MECHANISMS), help="comma-separated")
    parser.add_argument("--epsilons", help="comma-separated (default: 0.5,1,2,4; quick: 1,4)")
    parser.add_argument(
        "--domain-sizes", help="categories d, comma-separated (default: 64,1024; quick: 16)"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    settings = QUICK if args.quick else FULL
    epsilons = [float(e) for e in args.epsilons.split(",")] if args.epsilons else settings.epsilons
    domains = (
        [int(d) for d in args.domain_sizes.split(",")] if args.domain_sizes else settings.domains
    )
    print("peers:", ", ".join(f"{k} {v}" for k, v in peer_lib.available_libraries().items()))
    print(HEADER)
    misses = []
    for d in domains:
        for mechanism in args.mechanisms.split(","):
            for epsilon in epsilons:
                row, met = run(mechanism, epsilon, d, settings.peer_time)
                print(row, flush=True)
                if not met:
                    misses.append(row.split("|")[0].strip())
    for miss in misses:
        print(f"MISS (bound >= {TARGET_SHARE} eps in < {TARGET_SECONDS:g} s): {miss}")
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
