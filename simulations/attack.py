"""``ldp-sim attack``: what a fraction beta of fake devices does to an estimate, against
the theory of the attack, with and without each defence (``simulations.attacks``).

Frequencies. n honest devices with values from a Zipf(s) law over d categories (s = 0:
uniform) report through the mechanism's own encode; m = round(beta n / (1 - beta)) fake
devices send ``fake_reports`` promoting r targets drawn uniformly (seeded, fixed for the
run). The gain of a run is sum_{t in T} f~_t - f_T, f_T the honest devices' true share of
the targets; over ``reps`` runs its mean is compared with ``expected_gain`` (z = (mean -
theory) / standard error). Defences, each alone:

* ``none``: the unbiased estimate of all reports;
* ``normalization``: the estimate's Norm-Sub post-processing (``Estimate.postprocessed``);
* ``refusal``: the reports the mechanism's refusal rules accept (``Mechanism.refusals``);
  an attack whose reports look honest (MGA pads its bits) is untouched, by design;
* ``detection``: the reports ``shared.fake_detection.detect_fake_reports`` does not flag
  (unary encodings and olh; other mechanisms' reports support one item: not applicable).

The memoized mechanisms (``lgrr``, ``lsue``, ``loue``, ``losue``) take ``epsilon`` as what
one report reveals (their ``epsilon_report``) and ``epsilon_lifetime`` (default 2 epsilon)
as the bound per distinct value: the simulation sees one report per device.

Means. n honest devices with values uniform on [lower, upper] and m fake devices sending
``numeric_fake_reports``; the shift of a run is the estimate minus the honest devices' true
mean, against ``expected_shift``. Defences: ``none`` (refusal off: the structural bound),
``refusal`` (the refusal rule's bound), ``robust`` (refusal and the bounded-influence mean,
where the mechanism has one).

Every run's honest reports are also estimated alone under each defence, so each row gives
the defence's cost to an honest estimate: ``honest_mse_ratio`` = MSE with the defence /
MSE without, over the reps (frequencies: over all d categories; means: the mean).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shared.fake_detection import detect_fake_reports
from shared.integrity import as_bounded_influence, as_profiled
from shared.mechanisms import (
    MECHANISMS,
    Mechanism,
    Memoized,
    as_categorical,
    as_numeric,
    make_mechanism,
)
from shared.schemas import MechanismSpec
from simulations.attacks import (
    expected_gain,
    expected_shift,
    fake_reports,
    family,
    numeric_fake_reports,
)

__all__ = ["AttackConfig", "categorical_mechanism", "run_attacks", "run_numeric_attacks"]

DEFENCES = ("none", "normalization", "refusal", "detection")
NUMERIC_DEFENCES = ("none", "refusal", "robust")
#: Report families (``simulations.attacks.family``) supporting several items: detection applies.
DETECTABLE = ("unary", "olh")


@dataclass(frozen=True)
class AttackConfig:
    """One attack simulation's grid."""

    mechanisms: Sequence[str] = ("grr", "oue", "olh")
    attacks: Sequence[str] = ("mga",)
    betas: Sequence[float] = (0.05,)
    defences: Sequence[str] = DEFENCES
    epsilon: float = 1.0
    epsilon_lifetime: float | None = None
    domain: int = 1024
    users: int = 100_000
    targets: int = 10
    zipf: float = 1.1
    reps: int = 5
    seed: int = 0
    numeric: Sequence[str] = ()
    numeric_attacks: Sequence[str] = ("mean-max",)
    numeric_defences: Sequence[str] = NUMERIC_DEFENCES
    lower: float = 0.0
    upper: float = 100.0
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not all(0.0 <= beta < 1.0 for beta in self.betas):
            raise ValueError(f"betas must lie in [0, 1), got {list(self.betas)}")
        if self.reps < 2:
            raise ValueError(f"reps must be at least 2 (a standard error), got {self.reps}")
        if self.epsilon_lifetime is not None and self.epsilon_lifetime < self.epsilon:
            raise ValueError(
                f"epsilon_lifetime must be at least epsilon ({self.epsilon}), "
                f"got {self.epsilon_lifetime}"
            )
        if not 1 <= self.targets <= self.domain:
            raise ValueError(f"targets must lie in 1..{self.domain}, got {self.targets}")
        for defence in self.defences:
            if defence not in DEFENCES:
                raise ValueError(f"unknown defence {defence!r}; expected {', '.join(DEFENCES)}")
        for defence in self.numeric_defences:
            if defence not in NUMERIC_DEFENCES:
                raise ValueError(
                    f"unknown numeric defence {defence!r}; expected {', '.join(NUMERIC_DEFENCES)}"
                )


def _frequencies(domain: int, zipf: float) -> np.ndarray:
    weights = 1.0 / np.arange(1, domain + 1) ** zipf
    return weights / weights.sum()


def categorical_mechanism(name: str, config: AttackConfig) -> Mechanism[Any]:
    """``name`` at the config's epsilon and domain (memoized mechanisms: epsilon per report,
    ``epsilon_lifetime`` or 2 epsilon per value)."""
    spec: dict[str, Any] = {
        "mechanism": name,
        "epsilon": config.epsilon,
        "domain_size": config.domain,
    }
    if name in MECHANISMS and Memoized in MECHANISMS[name].abilities:
        lifetime = config.epsilon_lifetime or 2.0 * config.epsilon
        spec |= {"epsilon": lifetime, "epsilon_report": config.epsilon}
    return make_mechanism(MechanismSpec.model_validate(spec))


def _fakes(beta: float, n: int) -> int:
    return round(beta * n / (1.0 - beta))


def _defended(mechanism: Mechanism[Any], reports: np.ndarray, defence: str) -> np.ndarray | None:
    """The frequency estimate of ``reports`` under ``defence`` (None: not applicable)."""
    categorical = as_categorical(mechanism)
    assert categorical is not None
    if defence == "detection":
        if family(mechanism) not in DETECTABLE:
            return None
        reports = reports[~detect_fake_reports(mechanism, reports).flagged]
    elif defence == "refusal":
        reports = reports[mechanism.refusals(reports) < 0]
    estimate = categorical.estimate(mechanism.aggregate(reports))
    if defence == "normalization":
        return np.asarray(estimate.postprocessed().frequencies)
    return np.asarray(estimate.frequencies)


def _summary(values: list[float]) -> tuple[float, float]:
    """Mean and standard error."""
    array = np.asarray(values, dtype=np.float64)
    return float(array.mean()), float(array.std(ddof=1) / math.sqrt(array.size))


def run_attacks(
    config: AttackConfig, progress: Callable[[str], None] | None = None
) -> list[dict[str, Any]]:
    """One row per (mechanism, attack, beta, defence) of the categorical grid."""
    rng = np.random.default_rng(config.seed)
    law = _frequencies(config.domain, config.zipf)
    targets = np.sort(rng.choice(config.domain, config.targets, replace=False))
    rows = []
    for name in config.mechanisms:
        mechanism = categorical_mechanism(name, config)
        for attack in config.attacks:
            for beta in config.betas:
                if progress is not None:
                    progress(f"{name} {attack} beta={beta}")
                rows += _cell(config, mechanism, attack, beta, law, targets, rng)
    return rows


def _cell(
    config: AttackConfig,
    mechanism: Mechanism[Any],
    attack: str,
    beta: float,
    law: np.ndarray,
    targets: np.ndarray,
    rng: np.random.Generator,
) -> list[dict[str, Any]]:
    n, m = config.users, _fakes(beta, config.users)
    gains: dict[str, list[float]] = {defence: [] for defence in config.defences}
    honest_errors: dict[str, list[float]] = {defence: [] for defence in config.defences}
    theories = []
    for _ in range(config.reps):
        values = rng.choice(config.domain, n, p=law)
        truth = np.bincount(values, minlength=config.domain) / n
        honest = mechanism.encode(values, rng=rng)
        forged = fake_reports(mechanism, attack, targets, m, rng)
        reports = np.concatenate([honest, forged])
        theories.append(expected_gain(mechanism, attack, targets, m / (n + m), truth))
        for defence in config.defences:
            attacked = _defended(mechanism, reports, defence)
            alone = _defended(mechanism, honest, defence)
            if attacked is None or alone is None:
                continue
            gains[defence].append(float(attacked[targets].sum() - truth[targets].sum()))
            honest_errors[defence].append(float(np.sum((alone - truth) ** 2)))
    theory = float(np.mean(theories))
    undefended = _summary(gains["none"])[0] if gains.get("none") else math.nan
    baseline = np.mean(honest_errors["none"]) if honest_errors.get("none") else math.nan
    rows = []
    for defence in config.defences:
        if not gains[defence]:
            continue
        gain, se = _summary(gains[defence])
        rows.append(
            {
                "mechanism": mechanism.name,
                "epsilon": config.epsilon,
                "d": config.domain,
                "n": n,
                "fakes": m,
                "beta": m / (n + m),
                "attack": attack,
                "defence": defence,
                "gain": gain,
                "gain_se": se,
                "theory": theory,
                "z": (gain - theory) / se if defence == "none" and se > 0 else math.nan,
                "gain_ratio": gain / undefended if undefended else math.nan,
                "honest_mse_ratio": float(np.mean(honest_errors[defence]) / baseline),
            }
        )
    return rows


def _numeric_estimate(mechanism: Mechanism[Any], reports: np.ndarray, defence: str) -> float | None:
    numeric = as_numeric(mechanism)
    assert numeric is not None
    if defence == "refusal" or defence == "robust":
        reports = reports[mechanism.refusals(reports) < 0]
    stats = mechanism.aggregate(reports)
    if defence == "robust":
        bounded, profiled = as_bounded_influence(mechanism), as_profiled(mechanism)
        if bounded is None or profiled is None:
            return None
        return bounded.robust_mean(stats, profiled.profile(reports)).mean
    return float(numeric.estimate(stats).mean)


def run_numeric_attacks(
    config: AttackConfig, progress: Callable[[str], None] | None = None
) -> list[dict[str, Any]]:
    """One row per (mechanism, attack, beta, defence) of the numeric grid."""
    rng = np.random.default_rng(config.seed + 1)
    rows = []
    for name in config.numeric:
        spec = {
            "mechanism": name,
            "epsilon": config.epsilon,
            "lower": config.lower,
            "upper": config.upper,
        }
        mechanism = make_mechanism(MechanismSpec.model_validate(spec))
        for attack in config.numeric_attacks:
            for beta in config.betas:
                if progress is not None:
                    progress(f"{name} {attack} beta={beta}")
                rows += _numeric_cell(config, mechanism, attack, beta, rng)
    return rows


def _numeric_cell(
    config: AttackConfig,
    mechanism: Mechanism[Any],
    attack: str,
    beta: float,
    rng: np.random.Generator,
) -> list[dict[str, Any]]:
    n, m = config.users, _fakes(beta, config.users)
    shifts: dict[str, list[float]] = {defence: [] for defence in config.numeric_defences}
    honest_errors: dict[str, list[float]] = {defence: [] for defence in config.numeric_defences}
    theories: dict[str, list[float]] = {defence: [] for defence in config.numeric_defences}
    for _ in range(config.reps):
        values = rng.uniform(config.lower, config.upper, n)
        true_mean = float(values.mean())
        honest = mechanism.encode(values, rng=rng)
        for defence in config.numeric_defences:
            refusal = defence != "none"
            forged = numeric_fake_reports(mechanism, attack, m, refusal=refusal)
            attacked = _numeric_estimate(mechanism, np.concatenate([honest, forged]), defence)
            alone = _numeric_estimate(mechanism, honest, defence)
            if attacked is None or alone is None:
                continue
            shifts[defence].append(attacked - true_mean)
            honest_errors[defence].append((alone - true_mean) ** 2)
            theories[defence].append(
                expected_shift(mechanism, attack, m / (n + m), true_mean, refusal=refusal)
            )
    baseline = np.mean(honest_errors["none"]) if honest_errors.get("none") else math.nan
    rows = []
    for defence in config.numeric_defences:
        if not shifts[defence]:
            continue
        shift, se = _summary(shifts[defence])
        theory = float(np.mean(theories[defence]))
        rows.append(
            {
                "mechanism": mechanism.name,
                "epsilon": config.epsilon,
                "n": n,
                "fakes": m,
                "beta": m / (n + m),
                "attack": attack,
                "defence": defence,
                "shift": shift,
                "shift_se": se,
                "theory": theory,
                "z": (shift - theory) / se if defence != "robust" and se > 0 else math.nan,
                "honest_mse_ratio": float(np.mean(honest_errors[defence]) / baseline),
            }
        )
    return rows
