"""Benchmark of the federated noise: its cost per coordinate, and what it is charged.

Run from the repository root (a script, not a test)::

    python -m simulations.benchmarks.federated_noise

Times, best of ``--repeats`` runs from a seeded generator and once from the operating
system's CSPRNG: a device's local-mode upload (:func:`shared.federated.privacy.privatize`,
clip, lattice rounding and discrete Gaussian noise) of ``P`` parameters; the server's
central-mode aggregation of 100 uploads (:class:`~shared.federated.privacy.
PrivateAggregation`); one DP-SGD step's noisy gradient over a batch of 64 records. The
same calls run on a checkout without the lattice (floating-point Gaussian noise) for a
before/after figure. Then the epsilon at delta 1e-5 of a few schedules: the continuous
Gaussian by PLD and by RDP, and the discrete Gaussian as it is charged (when the
accountant has it).
"""

from __future__ import annotations

import argparse
import inspect
import time
from collections.abc import Callable

import numpy as np

from shared.accounting import gaussian_epsilon
from shared.federated.dpsgd import DPSGD, noisy_gradient
from shared.federated.fedavg import FedAvg
from shared.federated.models import LogisticRegression
from shared.federated.privacy import DPConfig, PrivateAggregation, privatize


def best_seconds(run: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` runs."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def timings(repeats: int) -> None:
    local = DPConfig("local", 1.0, 1.0, 10.0)
    print("| what | P | seeded s | us / coordinate | CSPRNG s |")
    print("|---|---:|---:|---:|---:|")
    rng = np.random.default_rng(2)
    for size in (10_000, 100_000, 500_000):
        update = np.random.default_rng(1).normal(size=size)

        def upload(update: np.ndarray = update, rng: np.random.Generator | None = rng) -> object:
            return privatize(update, local, 1.0, rng)

        def secure_upload(update: np.ndarray = update) -> object:
            return privatize(update, local, 1.0, None)

        seeded = best_seconds(upload, repeats)
        secure = best_seconds(secure_upload, 1)
        print(
            f"| local upload | {size} | {seeded:.3f} | {1e6 * seeded / size:.2f} | {secure:.3f} |"
        )
    central = DPConfig("central", 1.0, 1.0, 100.0, 0.1)
    aggregation = PrivateAggregation(FedAvg(), central)
    rows = np.random.default_rng(3).normal(size=(100, 10_000))
    rng = np.random.default_rng(4)
    seconds = best_seconds(
        lambda: aggregation.aggregate(rows, np.ones(100), np.ones(100), 1.0, rng), repeats
    )
    print(f"| central round, 100 uploads | 10000 | {seconds:.3f} | {1e6 * seconds / 1e6:.2f} | |")
    model = LogisticRegression(200, 10)
    data = np.random.default_rng(5)
    x, y = data.normal(size=(1000, 200)), data.integers(0, 10, 1000)
    params = np.zeros(model.num_params)
    config = DPSGD(1.1, 1.0, 0.064, 0.1)
    batch = np.arange(64)
    seconds = best_seconds(lambda: noisy_gradient(model, params, x, y, batch, config, rng), repeats)
    per = 1e6 * seconds / model.num_params
    print(f"| DP-SGD step, batch 64 | {model.num_params} | {seconds:.4f} | {per:.2f} | |")


def epsilons() -> None:
    discrete = "mechanism" in inspect.signature(gaussian_epsilon).parameters
    print("\n| z | q | T | continuous PLD | continuous RDP | discrete (charged) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for z, q, steps in [(1.1, 0.01, 1000), (0.8, 0.1, 100), (2.0, 1.0, 10), (1.0, 0.001, 10_000)]:
        pld = gaussian_epsilon(z, q, steps, 1e-5, "pld", value_discretization_interval=1e-3)
        rdp = gaussian_epsilon(z, q, steps, 1e-5, "rdp")
        charged = (
            f"{gaussian_epsilon(z, q, steps, 1e-5, mechanism='discrete_gaussian'):.3f}"  # type: ignore[call-arg]
            if discrete
            else "n/a"
        )
        print(f"| {z} | {q} | {steps} | {pld:.3f} | {rdp:.3f} | {charged} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    timings(args.repeats)
    epsilons()


if __name__ == "__main__":
    main()
