"""``ldp-sim audit metric``: lower bounds on epsilon from the device's own encoding.

What is checked:

* every mechanism the registry builds (and ``auto``), at epsilon 0.5, 1, 2 and 4, in
  every view (one report; memoized ones and RAPPOR also the lifetime; the distribution
  mechanisms ``hh`` and ``sw``, numbers at the two ends of the range, also in the fast
  lane, and through the sweep command): the bound is below the declared epsilon (no
  false alarm) and, where the attack is tight, above 0.8 x the declared epsilon, at a
  sample size planned from the Clopper-Pearson math
  (``planned_trials`` with alpha = beta = 1e-6 from the event's exact probabilities);
* deliberately broken mechanisms are caught, their bound above the declared epsilon: a
  unary encoding with the wrong q, Laplace noise in floating point (Mironov 2012), and a
  memoized mechanism that re-draws its permanent response for every report;
* the SDK path (real ``TelemetryClient`` devices) and the batch path (the mechanism's
  vectorized ``encode``) give the same output distribution;
* the bounds themselves: Clopper-Pearson coverage, the planned sample size, the one-run
  conversion against its closed form;
* the command: config file, a running aggregator's ``/v1/metrics``, a sweep; CSV, JSON,
  PNG; exit status 1 on a violation; errors named.

False alarms. Each audit's bound exceeds a kept promise with probability at most
ALPHA = 1e-6 (the Clopper-Pearson guarantee), about 110 audits here: at most 1.1e-4 in
all; each tightness check falls short with probability at most BETA = 1e-6; the
two-sample checks of the paths are at 1e-6 each.
"""

from __future__ import annotations

import argparse
import json
import math
import threading
from collections.abc import Iterator
from functools import cached_property
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from scipy import stats

from shared.mechanisms import MECHANISMS, DeviceContext, make_mechanism
from shared.mechanisms.laplace import DiscreteLaplace
from shared.mechanisms.lgrr import LongitudinalGRR
from shared.mechanisms.unary import OptimizedUnaryEncoding
from shared.memo import Memo
from shared.randomness import BITS53, Rng, as_source, threshold53
from shared.schemas import MechanismSpec
from simulations import audit
from simulations.audit_attacks import Attack, attacks_for
from simulations.audit_bounds import (
    best_threshold,
    clopper_pearson_high,
    clopper_pearson_low,
    epsilon_lower_bound,
    guaranteed_bound,
    one_run_lower_bound,
    one_run_p_value,
    planned_trials,
)
from simulations.audit_metric import (
    AuditResult,
    BatchDevices,
    audit_metric,
    metric_for,
    run_attack,
    sdk_devices,
    sweep_spec,
)
from simulations.cli import build_parser, main
from simulations.commands import audit as audit_command
from simulations.text import shown

ALPHA = 1e-6
BETA = 1e-6
#: Two-sided normal quantile of a 1e-6 false failure.
Z = 4.8916
EPSILONS = (0.5, 1.0, 2.0, 4.0)
EVERY = sorted(MECHANISMS) + ["auto"]
#: Memoized mechanisms report at 0.7 x epsilon; their lifetime view decodes this many reports.
REPORT_SHARE = 0.7
LIFETIME_REPORTS = 10
LIMIT = 10**7


def spec(name: str, epsilon: float) -> MechanismSpec:
    return sweep_spec(name, epsilon, domain_size=4, report_share=REPORT_SHARE)


def planned(attack: Attack) -> int:
    """Trials at which the bound exceeds 0.8 x the declared epsilon (or, for an attack
    that cannot show that much, 0.8 x its own) with probability 1 - BETA."""
    goal = 0.8 * min(attack.declared, attack.event_epsilon)
    trials = planned_trials(*attack.probabilities, goal, ALPHA, BETA, LIMIT)
    assert trials is not None, attack
    return trials


# --- every mechanism keeps its promise, and the audit comes close to it -------------------


@pytest.mark.parametrize("epsilon", EPSILONS)
@pytest.mark.parametrize("name", EVERY)
@pytest.mark.slow
def test_every_mechanism_keeps_its_promise_and_tight_audits_come_close(
    name: str, epsilon: float
) -> None:
    mech = make_mechanism(spec(name, epsilon))
    attacks = attacks_for(mech, LIFETIME_REPORTS)
    assert [a.view for a in attacks][0] == "report"
    for index, attack in enumerate(attacks):
        seed = [EVERY.index(name), EPSILONS.index(epsilon), index]
        devices = BatchDevices(mech, np.random.default_rng(seed))
        _, bound = run_attack(attack, devices, planned(attack), ALPHA)
        assert bound < attack.declared, (name, epsilon, attack.view, bound)
        if attack.tight:
            assert bound > 0.8 * attack.declared, (name, epsilon, attack.view, bound)


def test_every_report_view_is_tight_by_the_math() -> None:
    """The report events attain the declared epsilon (to the realized thresholds), and
    the lifetime events at least 90% of it at the decoded reports used above."""
    for name in EVERY:
        for epsilon in EPSILONS:
            for attack in attacks_for(make_mechanism(spec(name, epsilon)), LIFETIME_REPORTS):
                share = attack.event_epsilon / attack.declared
                low = 1 - 1e-4 if attack.view == "report" else 0.9
                assert low <= share <= 1 + 1e-9, (name, epsilon, attack.view, share)


#: The distribution mechanisms (values are numbers, estimated as a histogram).
DISTRIBUTIONS = sorted(
    name for name, cls in MECHANISMS.items() if cls.spec_model.kind == "distribution"
)


@pytest.mark.parametrize("epsilon", EPSILONS)
@pytest.mark.parametrize("name", DISTRIBUTIONS)
def test_distribution_mechanisms_keep_their_promise_and_the_audit_comes_close(
    name: str, epsilon: float
) -> None:
    """Inputs at the two ends of the range (the first and the last bucket), one report each:
    the bound is below epsilon and, at the planned trials, above 0.8 x epsilon (the event
    attains epsilon exactly, so the audit is tight)."""
    mech = make_mechanism(spec(name, epsilon))
    (attack,) = attacks_for(mech, LIFETIME_REPORTS)
    assert attack.inputs == (0.0, 1.0) and attack.tight
    report = mech.spec.report_epsilon
    assert attack.event_epsilon == pytest.approx(report, rel=1e-4)
    rng = np.random.default_rng([DISTRIBUTIONS.index(name), EPSILONS.index(epsilon), 40])
    _, bound = run_attack(attack, BatchDevices(mech, rng), planned(attack), ALPHA)
    assert 0.8 * report < bound < report, (name, epsilon, bound)


def test_the_distribution_mechanisms_are_audited() -> None:
    assert {"hh", "sw"} <= set(DISTRIBUTIONS)


@pytest.mark.slow
@pytest.mark.parametrize("name", DISTRIBUTIONS)
def test_a_distribution_metric_is_audited_through_sdk_devices(name: str) -> None:
    """record(metric, number) on a real client; the event is hit as often as its law says
    (two-sided, 1e-6) for each input."""
    trials = 400
    (result,) = audit_metric(metric_for(spec(name, 2.0)), trials=trials, path="sdk")
    assert result.path == "sdk" and result.lower_bound < 2.0
    for hits, p in zip(result.hits, result.attack.probabilities, strict=True):
        assert abs(hits - trials * p) <= Z * math.sqrt(trials * p * (1 - p)), (name, hits, p)


@pytest.mark.slow
@pytest.mark.parametrize(
    "fields",
    [
        {"mechanism": "hh", "epsilon": 3.0, "lower": 1.0, "upper": 1000.0, "buckets": 27,
         "branching": 3, "scale": "log"},
        {"mechanism": "dbitflip", "epsilon": 1.0, "domain_size": 3, "bits_per_device": 2},
        {"mechanism": "rappor", "num_bits": 32, "num_hashes": 2, "num_cohorts": 8, "f": 0.25,
         "p": 0.3, "q": 0.7},
        {"mechanism": "cms", "epsilon": 2.0, "sketch_width": 20, "sketch_depth": 3},
        {"mechanism": "olh", "epsilon": 3.0, "domain_size": 37},
    ],
)  # fmt: skip
def test_each_event_is_hit_as_often_as_its_probabilities_say(fields: dict[str, Any]) -> None:
    """Parameters the sweep does not reach: a three-level tree on a log scale, two buckets
    per device, two Bloom hashes over several cohorts, a sketch width that is not a power
    of two, a prime-sized domain."""
    mech = make_mechanism(MechanismSpec.model_validate(fields))
    trials = 20_000
    for attack in attacks_for(mech, 4):
        hits, _ = run_attack(attack, BatchDevices(mech, np.random.default_rng(11)), trials, 0.05)
        for count, p in zip(hits, attack.probabilities, strict=True):
            assert abs(count - trials * p) <= Z * math.sqrt(trials * p * (1 - p)), attack.view


# --- broken mechanisms are caught ---------------------------------------------------------


class OUEWithWrongQ(OptimizedUnaryEncoding):
    """OUE whose q is the one for twice the budget, 1 / (e^(2 eps) + 1): its reports are
    2 eps-LDP while its spec promises eps (the certified thresholds bypassed)."""

    @cached_property
    def thresholds(self) -> tuple[int, int]:
        wrong_q = 1.0 / (math.exp(2 * self.epsilon) + 1)
        return int(threshold53(0.5, "down")), int(threshold53(wrong_q, "up"))


class FloatingPointLaplace(DiscreteLaplace):
    """Laplace noise added in floating point by the inverse CDF, the textbook way:
    y = clip(x) - b sign(u) ln(1 - 2 |u|), u = k / 2^53 - 1/2, b = (upper - lower) / eps.
    As real numbers eps-LDP; as doubles, the set of outputs depends on x (Mironov 2012)."""

    @property
    def scale(self) -> float:
        return (self.upper - self.lower) / self.epsilon

    def noise(self, k: np.ndarray) -> np.ndarray:
        u = k / BITS53 - 0.5
        return -self.scale * np.sign(u) * np.log1p(-2 * np.abs(u))

    def encode(self, values: np.ndarray, rng: Rng = None) -> np.ndarray:
        x = np.clip(np.asarray(values, dtype=np.float64), self.lower, self.upper)
        k = (as_source(rng).words(x.size) >> np.uint64(11)).astype(np.float64)
        return x + self.noise(k)

    def reachable(self, y: np.ndarray, x: float, window: int = 4) -> np.ndarray:
        """Whether each output y is x + noise(k) for some k: k from the inverse CDF, then
        its neighbours checked exactly (the attacker knows the sampler)."""
        offset = y - x
        u = np.sign(offset) * -np.expm1(-np.abs(offset) / self.scale) / 2
        k = np.rint((u + 0.5) * BITS53)
        hit = np.zeros(y.shape, dtype=bool)
        for step in range(-window, window + 1):
            hit |= x + self.noise(np.clip(k + step, 0, BITS53 - 1)) == y
        return hit


class StatelessLGRR(LongitudinalGRR):
    """L-GRR that draws its permanent response afresh for every report (the memo ignored):
    one report is still epsilon_report-LDP, repeated reports average the noise away."""

    def encode(self, values: np.ndarray, rng: Rng = None, memo: Memo | None = None) -> np.ndarray:
        return super().encode(values, rng, context=DeviceContext(memo=None))


@pytest.mark.parametrize("epsilon", EPSILONS)
def test_a_unary_encoding_with_the_wrong_q_is_caught(epsilon: float) -> None:
    mech = OUEWithWrongQ(MechanismSpec(mechanism="oue", epsilon=epsilon, domain_size=4))
    (attack,) = attacks_for(mech)
    assert attack.event_epsilon == pytest.approx(2 * epsilon, rel=1e-6)
    trials = planned_trials(*attack.probabilities, 1.2 * epsilon, ALPHA, BETA, LIMIT)
    assert trials is not None
    _, bound = run_attack(attack, BatchDevices(mech, np.random.default_rng(3)), trials, ALPHA)
    assert bound > epsilon


@pytest.mark.parametrize("epsilon", [0.5, 1.0, 4.0])
def test_floating_point_laplace_is_caught_by_its_output_sets(epsilon: float) -> None:
    """Mironov's attack: outputs of x0 = 0 that no noise draw gives from x1 = 1. It never
    happens under x1 and about 80% of the time under x0: an infinite likelihood ratio,
    bounded here only by the number of trials."""
    mech = FloatingPointLaplace(
        MechanismSpec(mechanism="laplace", epsilon=epsilon, lower=0.0, upper=1.0)
    )

    def event(reports: np.ndarray) -> np.ndarray:
        return mech.reachable(reports, 0.0) & ~mech.reachable(reports, 1.0)

    # What the attacker expects: about 0.8 of x0's outputs in S, none of x1's.
    attack = Attack("report", epsilon, (0.0, 1.0), event, (0.8, 0.0), "reachable from 0 only")
    (hits0, hits1), bound = run_attack(
        attack, BatchDevices(mech, np.random.default_rng(4)), 20_000, ALPHA
    )
    assert hits1 == 0 and hits0 > 10_000
    assert bound > epsilon


def test_a_memoized_mechanism_without_its_memo_is_caught_by_the_lifetime_audit() -> None:
    spec_ = MechanismSpec(mechanism="lgrr", epsilon=1.0, epsilon_report=0.5, domain_size=4)
    honest, broken = LongitudinalGRR(spec_), StatelessLGRR(spec_)
    report, lifetime = attacks_for(broken, 32)
    rng = np.random.default_rng(5)
    _, report_bound = run_attack(report, BatchDevices(broken, rng), planned(report), ALPHA)
    assert report_bound < report.declared  # one report is as private as promised
    _, bound = run_attack(lifetime, BatchDevices(broken, rng), 4000, ALPHA)
    assert bound > lifetime.declared
    _, kept = run_attack(attacks_for(honest, 32)[1], BatchDevices(honest, rng), 4000, ALPHA)
    assert kept < lifetime.declared


# --- the SDK path and the batch path --------------------------------------------------------


def _feature(mechanism: str, reports: np.ndarray) -> np.ndarray:
    """A report as a small integer: the index, or the 4 unary bits."""
    if mechanism in ("oue", "sue"):
        return reports[:, 0].astype(np.int64) >> 4
    return np.asarray(reports, dtype=np.int64)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "devices"), [("grr", 3000), ("oue", 3000), ("lgrr", 200)])
def test_the_sdk_and_the_batch_path_give_one_output_distribution(name: str, devices: int) -> None:
    """grr and oue draw one report by their own scalar code on a device; lgrr's memo is the
    device's HMAC stream there. Chi-square two-sample test of the reports, 1e-6."""
    metric = metric_for(spec(name, 1.0))
    mech = make_mechanism(metric.mechanism)
    with sdk_devices(metric) as sdk:
        device_reports = _feature(name, sdk.reports(0, devices, 1))
    batch_reports = _feature(
        name, BatchDevices(mech, np.random.default_rng(6)).reports(0, 50_000, 1)
    )
    values = np.union1d(device_reports, batch_reports)
    table = np.array(
        [[np.count_nonzero(r == v) for v in values] for r in (device_reports, batch_reports)]
    )
    _, p_value, _, _ = stats.chi2_contingency(table)
    assert p_value > 1e-6, (name, table)


@pytest.mark.slow
def test_rappor_through_the_sdk_hits_the_event_as_often_as_the_batch() -> None:
    """record_string: each device's secret, cohort and permanent response its own."""
    metric = metric_for(spec("rappor", 2.0))
    mech = make_mechanism(metric.mechanism)
    (attack, _) = attacks_for(mech)
    with sdk_devices(metric) as sdk:
        hits = int(np.count_nonzero(attack.event(sdk.reports(attack.inputs[0], 150, 1))))
    p0 = attack.probabilities[0]
    assert abs(hits - 150 * p0) <= Z * math.sqrt(150 * p0 * (1 - p0))


@pytest.mark.slow
def test_an_sdk_audit_runs_every_view_through_devices() -> None:
    results = audit_metric(
        metric_for(spec("onebitmean", 2.0)), trials=40, lifetime_reports=3, path="sdk"
    )
    assert [r.attack.view for r in results] == ["report", "lifetime"]
    assert all(r.path == "sdk" and r.trials == 40 for r in results)


# --- the statistics -----------------------------------------------------------------------


def test_clopper_pearson_ends_and_coverage() -> None:
    n = 50
    assert clopper_pearson_low(0, n, 0.05) == 0.0
    assert clopper_pearson_high(n, n, 0.05) == 1.0
    assert clopper_pearson_high(0, n, 0.05) == pytest.approx(1 - 0.05 ** (1 / n))
    assert clopper_pearson_low(n, n, 0.05) == pytest.approx(0.05 ** (1 / n))
    # One-sided coverage at 0.1, over every count, exactly from the binomial law.
    for p in (0.03, 0.3, 0.77):
        k = np.arange(n + 1)
        law = stats.binom.pmf(k, n, p)
        assert law[clopper_pearson_low(k, n, 0.1) > p].sum() <= 0.1
        assert law[clopper_pearson_high(k, n, 0.1) < p].sum() <= 0.1


def test_the_bound_exceeds_a_kept_promise_at_most_alpha_of_the_time() -> None:
    """200,000 audits of an exact eps = 1 pair of probabilities, drawn as binomial counts:
    the share of bounds above 1 is at most alpha = 0.05 (plus 4.9 standard errors)."""
    rng = np.random.default_rng(7)
    p0 = 0.3
    p1 = p0 / math.e
    runs, n = 200_000, 2000
    bounds = epsilon_lower_bound(rng.binomial(n, p0, runs), n, rng.binomial(n, p1, runs), n, 0.05)
    share = float(np.mean(bounds > 1.0))
    assert share <= 0.05 + Z * math.sqrt(0.05 * 0.95 / runs)
    assert np.median(bounds) > 0.8


def test_planned_trials_reach_their_target() -> None:
    p0, p1 = 0.4, 0.4 / math.exp(2.0)
    n = planned_trials(p0, p1, 1.6, 0.05, 0.1, LIMIT)
    assert n is not None
    assert (
        guaranteed_bound(n, p0, p1, 0.05, 0.1) >= 1.6 > guaranteed_bound(n // 2, p0, p1, 0.05, 0.1)
    )
    rng = np.random.default_rng(8)
    bounds = epsilon_lower_bound(
        rng.binomial(n, p0, 20_000), n, rng.binomial(n, p1, 20_000), n, 0.05
    )
    assert np.mean(bounds < 1.6) <= 0.1
    assert planned_trials(p0, p1, 2.5, 0.05, 0.1, 10**5) is None  # beyond ln(p0 / p1)


def test_the_threshold_chosen_on_calibration_scores_holds_on_fresh_ones() -> None:
    """Scores N(3, 1) against N(0, 1): a high threshold (the ratio of the tails grows with
    it), whose bound on fresh scores is the calibration's up to sampling."""
    rng = np.random.default_rng(9)
    high, low = rng.normal(3.0, 1.0, 5000), rng.normal(0.0, 1.0, 5000)
    event = best_threshold(high, low, 0.05)
    assert 2.0 < event.threshold < 5.0 and event.bound > 2.0
    fresh_high, fresh_low = rng.normal(3.0, 1.0, 5000), rng.normal(0.0, 1.0, 5000)
    fresh = epsilon_lower_bound(
        np.count_nonzero(fresh_high >= event.threshold), 5000,
        np.count_nonzero(fresh_low >= event.threshold), 5000, 0.05,
    )  # fmt: skip
    assert fresh > 2.0


def test_one_run_bound_matches_its_closed_form_without_delta() -> None:
    """delta = 0 and every guess right: P[Bin(r, s) >= r] = s^r = alpha, so the bound is
    ln(s / (1 - s)) with s = alpha^(1/r)."""
    r, alpha = 200, 0.05
    s = alpha ** (1 / r)
    assert one_run_lower_bound(1000, r, r, 0.0, alpha) == pytest.approx(
        math.log(s / (1 - s)), abs=1e-5
    )
    assert one_run_p_value(1000, r, 150, 1.0, 1e-5) > one_run_p_value(1000, r, 150, 1.0, 0.0)
    assert one_run_lower_bound(1000, r, 150, 1e-5, alpha) < one_run_lower_bound(
        1000, r, 150, 0.0, alpha
    )
    assert one_run_lower_bound(1000, r, 100, 0.0, alpha) == 0.0  # chance level proves nothing


# --- the command --------------------------------------------------------------------------


@pytest.mark.slow
def test_a_sweep_writes_a_table_csv_json_and_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "audit"
    code = main(
        [
            "audit", "metric", "--mechanisms", "grr,lgrr", "--epsilons", "1,2", "--domain-size",
            "4", "--trials", "3000", "--lifetime-reports", "8", "--seed", "1", "--out", str(out),
            "--quiet",
        ]
    )  # fmt: skip
    assert code == 0
    assert "lower_bound" in capsys.readouterr().out
    rows = json.loads((out / "metric_audit.json").read_text())
    assert [(r["mechanism"], r["view"], r["declared_epsilon"]) for r in rows] == [
        ("grr", "report", 1.0), ("grr", "report", 2.0), ("lgrr", "report", 0.5),
        ("lgrr", "lifetime", 1.0), ("lgrr", "report", 1.0), ("lgrr", "lifetime", 2.0),
    ]  # fmt: skip
    assert all(0 < r["lower_bound"] < r["declared_epsilon"] and r["trials"] == 3000 for r in rows)
    assert (out / "metric_audit.csv").read_text().startswith("metric,mechanism,view,")
    assert (out / "metric_audit.png").stat().st_size > 10_000


def test_a_sweep_audits_the_distribution_mechanisms(capsys: pytest.CaptureFixture[str]) -> None:
    names = ",".join(DISTRIBUTIONS)
    assert main(["audit", "metric", "--mechanisms", names, "--epsilons", "1,2", "--trials",
                 "3000", "--seed", "2", "--quiet"]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert all(f"audit.{name}.eps2" in printed for name in DISTRIBUTIONS)


def test_a_config_file_is_audited_metric_by_metric(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "metrics.toml"
    config.write_text(
        '[metrics."app.theme"]\nlabels = ["light", "dark", "system"]\n'
        '[metrics."app.theme".mechanism]\nmechanism = "grr"\nepsilon = 2.0\ndomain_size = 3\n'
        '[metrics."app.minutes".mechanism]\nmechanism = "piecewise"\nepsilon = 1.0\n'
        "lower = 0.0\nupper = 120.0\n"
    )
    assert main(["audit", "metric", "--config", str(config), "--metric", "app.minutes",
                 "--trials", "2000", "--quiet"]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert "app.minutes" in printed and "app.theme" not in printed
    assert main(["audit", "metric", "--config", str(config), "--trials", "1000", "--quiet"]) == 0
    assert "app.theme" in capsys.readouterr().out


class _Metrics(BaseHTTPRequestHandler):
    body = b"[]"

    def do_GET(self) -> None:  # noqa: N802 - the name http.server calls
        self.send_response(200 if self.path == "/v1/metrics" else 404)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def published() -> Iterator[str]:
    """An aggregator's public metric list, served on a loopback port."""
    items = [metric_for(spec("oue", 1.0), "sizes").model_dump(mode="json")]
    handler = type("Handler", (_Metrics,), {"body": json.dumps(items).encode()})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_running_aggregators_metrics_are_audited(
    published: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["audit", "metric", "--endpoint", published, "--trials", "2000", "--quiet"]) == 0
    assert "sizes" in capsys.readouterr().out
    assert audit.metrics_from_endpoint(published)[0].mechanism.mechanism == "oue"


def test_a_violation_exits_with_status_one(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = OUEWithWrongQ(MechanismSpec(mechanism="oue", epsilon=1.0, domain_size=4))
    (attack,) = attacks_for(broken)
    hits, bound = run_attack(attack, BatchDevices(broken, np.random.default_rng(10)), 5000, 0.05)

    def audit_broken(metric: Any, **options: Any) -> list[AuditResult]:
        return [AuditResult(metric.name, "oue", attack, 5000, hits, 0.05, bound, "batch", 0.1)]

    monkeypatch.setattr(audit_command, "audit_metric", audit_broken)
    assert main(["audit", "metric", "--mechanisms", "oue", "--epsilons", "1", "--quiet"]) == 1
    assert "does not keep its privacy promise" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--metric", "x"], "--metric needs --config or --endpoint"),
        (["--config", "/nonexistent/metrics.toml"], "cannot read metric config"),
        (["--mechanisms", "nope"], "unknown mechanism 'nope'"),
        (["--alpha", "2"], "not a probability in (0, 1)"),
        (["--endpoint", "http://127.0.0.1:9"], "could not read the metrics"),
    ],
)
def test_bad_arguments_are_named(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["audit", "metric", *argv, "--quiet"])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


@pytest.mark.parametrize("command", ["metric", "training"])
def test_help_is_plain_text_and_shows_defaults(command: str) -> None:
    parser = _subcommands(_subcommands(build_parser())["audit"])[command]
    text = parser.format_help()
    assert "`" not in text
    flat = " ".join(text.split())
    for action in parser._actions:
        if action.option_strings and action.default not in (None, False, argparse.SUPPRESS):
            assert f"(default: {shown(action.default)})" in flat, action.option_strings
