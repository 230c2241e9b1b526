"""Demo: synthetic users report through every mechanism; estimates beside the truth.

Run ``python -m simulations.demo [--users N] [--epsilon EPS] [--seed S]``.
Each simulated device perturbs its own value with the mechanism (a seeded
generator here, for a reproducible demo; real devices use the OS CSPRNG), the
server side aggregates the reports into sufficient statistics and publishes
unbiased estimates with 95% confidence intervals.
"""

from __future__ import annotations

import argparse

import numpy as np

from shared.mechanisms import (
    MECHANISMS,
    as_categorical,
    as_distribution,
    as_numeric,
    make_mechanism,
)
from shared.schemas import (
    CATEGORICAL_MECHANISMS,
    MEMOIZED_MECHANISMS,
    NUMERIC_MECHANISMS,
    MechanismSpec,
)
from simulations.text import counted

BROWSERS = ["chrome", "safari", "edge", "firefox", "samsung", "opera", "brave", "other"]
SHARES = np.array([0.42, 0.24, 0.12, 0.08, 0.06, 0.04, 0.03, 0.01])


def categorical_demo(users: int, epsilon: float, rng: np.random.Generator) -> None:
    values = rng.choice(len(BROWSERS), size=users, p=SHARES)
    truth = np.bincount(values, minlength=len(BROWSERS)) / users
    names = sorted(CATEGORICAL_MECHANISMS - MEMOIZED_MECHANISMS - {"auto"}) + ["auto"]
    print(
        f"Favourite browser of {counted(users, 'user')}, epsilon = {epsilon} "
        "(frequency, ±95% CI half-width)"
    )
    header = f"{'category':<10}{'truth':>8}" + "".join(f"{name:>17}" for name in names)
    print(header)
    estimates = {}
    for name in names:
        spec = MechanismSpec.model_validate(
            {"mechanism": name, "epsilon": epsilon, "domain_size": len(BROWSERS)}
        )
        mechanism = make_mechanism(spec)
        categories = as_categorical(mechanism)
        assert categories is not None  # a categorical spec
        estimates[name] = (
            mechanism.name,
            categories.estimate(mechanism.aggregate(mechanism.encode(values, rng))),
        )
    for index, label in enumerate(BROWSERS):
        cells = "".join(
            f"{est.frequencies[index]:>9.4f} ±{1.96 * est.std[index]:.4f}"
            for _, est in estimates.values()
        )
        print(f"{label:<10}{truth[index]:>8.4f}{cells}")
    print(f"(auto chose {estimates['auto'][0]!r} for epsilon = {epsilon}, d = {len(BROWSERS)})")


def numeric_demo(users: int, epsilon: float, rng: np.random.Generator) -> None:
    minutes = rng.lognormal(mean=2.0, sigma=0.8, size=users)
    lower, upper = 0.0, 60.0
    truth = np.clip(minutes, lower, upper).mean()
    print(
        f"\nMean session length (minutes, clipped to [{lower:g}, {upper:g}]) "
        f"of {counted(users, 'user')}"
    )
    print(f"{'mechanism':<11}{'truth':>9}{'estimate':>10}{'95% CI':>22}")
    for name in sorted(NUMERIC_MECHANISMS - MEMOIZED_MECHANISMS):
        spec = MechanismSpec.model_validate(
            {"mechanism": name, "epsilon": epsilon, "lower": lower, "upper": upper}
        )
        mechanism = make_mechanism(spec)
        numbers = as_numeric(mechanism)
        assert numbers is not None  # a numeric spec
        est = numbers.estimate(mechanism.aggregate(mechanism.encode(minutes, rng)))
        low, high = est.ci(0.95)
        print(f"{name:<11}{truth:>9.3f}{est.mean:>10.3f}   [{low:8.3f}, {high:8.3f}]")


def distribution_demo(users: int, epsilon: float, rng: np.random.Generator) -> None:
    latencies = rng.lognormal(mean=5.0, sigma=0.9, size=users)  # page loads, ms
    levels = (0.5, 0.95, 0.99)
    truth = np.quantile(latencies, levels)
    print(
        f"\nPage-load time percentiles (ms, 256 log-scale buckets over [1, 10000]) of "
        f"{counted(users, 'user')}"
    )
    print(
        f"{'mechanism':<11}"
        + "".join(
            f"{f'p{q * 100:g} (truth {t:.0f})':>30}" for q, t in zip(levels, truth, strict=True)
        )
    )
    names = sorted(
        name
        for name, cls in MECHANISMS.items()
        if cls.spec_model.kind == "distribution" and not cls.spec_model.is_memoized
    )
    for name in names:
        spec = MechanismSpec.model_validate(
            {"mechanism": name, "epsilon": epsilon, "lower": 1, "upper": 10_000, "scale": "log"}
        )
        mechanism = make_mechanism(spec)
        distribution = as_distribution(mechanism)
        assert distribution is not None  # a distribution spec
        estimate = distribution.estimate(mechanism.aggregate(mechanism.encode(latencies, rng)))
        cells = "".join(
            f"{f'{q.value:.0f} [{q.ci_low:.0f}, {q.ci_high:.0f}]':>30}"
            for q in estimate.quantiles(levels)
        )
        print(f"{name:<11}{cells}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=200_000, help="simulated devices")
    parser.add_argument("--epsilon", type=float, default=2.0, help="privacy budget per report")
    parser.add_argument("--seed", type=int, default=2026, help="seed of the simulation")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    categorical_demo(args.users, args.epsilon, rng)
    numeric_demo(args.users, args.epsilon, rng)
    distribution_demo(args.users, args.epsilon, rng)


if __name__ == "__main__":
    main()
