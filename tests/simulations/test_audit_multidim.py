"""``ldp-sim audit metric`` on the multi-attribute protocols ``spl``, ``smp`` and ``rsfd``.

What is checked:

* each protocol keeps its promise and the audit comes close to it: one report of records
  that differ in every attribute, the bound below epsilon and, at the planned trials,
  above 0.8 x epsilon (the events attain epsilon exactly, ``simulations.audit_attacks``);
* the events' probabilities are the exact law of the code that runs, views of every kind
  (a pair, categories through GRR and OUE, numbers through duchi and piecewise), including
  the fake reports of ``rsfd``;
* RS+FD as the paper and multi-freq-ldpy run it (the amplified inner epsilon
  ln(k (e^eps - 1) + 1) under a declared eps) is caught: its bound exceeds eps;
* the sweep command audits the three protocols.

False alarms: every bound is at ALPHA = 1e-6 (Clopper-Pearson), every tightness check
falls short with probability at most BETA = 1e-6, the probability checks are two-sided
z-tests at 1e-6 over all their counts (Bonferroni).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from shared.mechanisms import make_mechanism
from shared.mechanisms.multidim import RsfdMechanism
from shared.schemas import MechanismSpec
from simulations.audit_attacks import Attack, attacks_for
from simulations.audit_bounds import planned_trials
from simulations.audit_metric import BatchDevices, audit_metric, metric_for, run_attack, sweep_spec
from simulations.cli import main
from tests.distribution_checks import normal_bound

ALPHA = 1e-6
BETA = 1e-6
PROTOCOLS = ("spl", "smp", "rsfd")
EPSILONS = (0.5, 1.0, 2.0, 4.0)
LIMIT = 10**7


def planned(attack: Attack, share: float = 0.8) -> int:
    trials = planned_trials(*attack.probabilities, share * attack.declared, ALPHA, BETA, LIMIT)
    assert trials is not None, attack
    return trials


@pytest.mark.slow
@pytest.mark.parametrize("epsilon", EPSILONS)
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_each_protocol_keeps_its_promise_and_the_audit_comes_close(
    protocol: str, epsilon: float
) -> None:
    """The sweep's spec (three attributes of 4 categories, the first two a pair: two views)."""
    mech = make_mechanism(sweep_spec(protocol, epsilon, domain_size=4))
    (attack,) = attacks_for(mech)
    assert attack.tight and attack.event_epsilon == pytest.approx(epsilon, rel=1e-9)
    seed = [PROTOCOLS.index(protocol), EPSILONS.index(epsilon)]
    _, bound = run_attack(attack, BatchDevices(mech, np.random.default_rng(seed)),
                          planned(attack), ALPHA)  # fmt: skip
    assert 0.8 * epsilon < bound < epsilon, (protocol, epsilon, bound)


def mixed_spec(protocol: str, epsilon: float) -> MechanismSpec:
    """A pair (3 x 5), a number on [0, 10] and a two-valued attribute: three views."""
    return MechanismSpec.model_validate(
        {
            "mechanism": protocol, "epsilon": epsilon,
            "attributes": [
                {"name": "a", "domain_size": 3}, {"name": "x", "lower": 0, "upper": 10},
                {"name": "b", "domain_size": 5}, {"name": "c", "domain_size": 2},
            ],
            "pairs": [["a", "b"]],
        }
    )  # fmt: skip


#: (protocol, epsilon) covering every kind of view: at 0.5 the pair is OUE and the number
#: duchi; at 3 (smp, rsfd: the whole epsilon per view) GRR and piecewise.
MIXED = [(p, e) for p in PROTOCOLS for e in (0.5, 3.0)] + [("spl", 9.0)]


@pytest.mark.slow
def test_the_events_have_the_probabilities_the_attack_states() -> None:
    """200,000 trials of each input per case: every count within ``normal_bound`` standard
    errors of its stated probability (two-sided, Bonferroni over the 2 x 7 counts)."""
    trials, z = 200_000, normal_bound(2 * len(MIXED))
    oracles = set()
    for index, (protocol, epsilon) in enumerate(MIXED):
        mech: Any = make_mechanism(mixed_spec(protocol, epsilon))
        oracles |= {view.oracle for view in mech.views}
        (attack,) = attacks_for(mech)
        devices = BatchDevices(mech, np.random.default_rng([7, index]))
        for value, p in zip(attack.inputs, attack.probabilities, strict=True):
            hits = int(np.count_nonzero(attack.event(devices.reports(value, trials, 1))))
            assert abs(hits - trials * p) <= z * math.sqrt(trials * p * (1 - p)), (
                protocol, epsilon, value, hits / trials, p,
            )  # fmt: skip
    assert oracles == {"grr", "oue", "duchi", "piecewise"}


def test_every_view_kind_makes_a_tight_attack() -> None:
    for protocol, epsilon in MIXED:
        (attack,) = attacks_for(make_mechanism(mixed_spec(protocol, epsilon)))
        assert attack.event_epsilon == pytest.approx(epsilon, rel=1e-4), (protocol, epsilon)
        assert attack.inputs[0]["a"] == 0 and attack.inputs[1]["a"] == 1


class AmplifiedRsfd(RsfdMechanism):
    """RS+FD with the paper's inner epsilon ln(k (e^eps - 1) + 1) while the spec declares
    eps (as multi-freq-ldpy runs it): one report is not eps-LDP."""

    def __init__(self, spec: MechanismSpec) -> None:
        views = len(make_mechanism(spec).views)  # type: ignore[attr-defined]
        inner = math.log(views * math.expm1(spec.epsilon) + 1)
        super().__init__(spec.model_copy(update={"epsilon": inner}))  # type: ignore[arg-type]
        self.declared = spec.epsilon

    @property
    def epsilon(self) -> float:
        return self.declared


@pytest.mark.parametrize("epsilon", [0.5, 1.0, 2.0])
def test_rsfd_with_the_amplified_inner_epsilon_is_caught(epsilon: float) -> None:
    """Records that differ in every attribute: the event shows the inner epsilon, above the
    declared one; at trials planned to show the midpoint of the two the bound exceeds eps."""
    broken = AmplifiedRsfd(sweep_spec("rsfd", epsilon, domain_size=4))
    (attack,) = attacks_for(broken)
    inner = math.log(2 * math.expm1(epsilon) + 1)  # two views
    assert attack.declared == epsilon and attack.event_epsilon == pytest.approx(inner, rel=1e-4)
    goal = (epsilon + inner) / 2
    trials = planned_trials(*attack.probabilities, goal, ALPHA, BETA, LIMIT)
    assert trials is not None
    _, bound = run_attack(attack, BatchDevices(broken, np.random.default_rng(11)), trials, ALPHA)
    assert bound > epsilon


def test_a_sweep_audits_the_multi_attribute_protocols(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["audit", "metric", "--mechanisms", "spl,smp,rsfd", "--epsilons", "1,2",
            "--domain-size", "3", "--trials", "3000", "--seed", "3", "--quiet"]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert all(f"audit.{name}.eps{e}" in printed for name in PROTOCOLS for e in (1, 2))


def test_an_sdk_audit_records_attribute_values_through_devices() -> None:
    """Real TelemetryClient devices record the records {attribute: value} as an app does."""
    (result,) = audit_metric(metric_for(sweep_spec("smp", 2.0, 3)), trials=30, path="sdk")
    assert result.path == "sdk" and result.trials == 30 and result.attack.inputs[0]["a"] == 0
