"""End to end: simulated devices record through ``TelemetryClient`` into a real aggregator.

The aggregator is a real ``aggregator.cli serve`` process on a loopback port (fixture
``aggregator`` in ``conftest.py``); the devices reach it over HTTP, exactly as an app
would. Also runs the README's client example, verbatim.
"""

from __future__ import annotations

import math
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shared.mechanisms import make_mechanism
from shared.mechanisms.grr import GeneralizedRandomizedResponse
from shared.mechanisms.piecewise import PiecewiseMechanism
from shared.schemas import MechanismSpec
from tests.support import fleet_client

#: The repository root (for the README).
ROOT = Path(__file__).resolve().parents[2]

DEVICES = 20_000
GROUPS = 40  # client objects, each with its own state directory (see the test's docstring)
THEME, MINUTES = "app.theme", "app.session_minutes"
#: Total false-failure probability of the accuracy checks below (union bound over the
#: four estimates checked: three frequencies and one mean, DELTA / 4 each).
DELTA = 1e-6


def bernstein_deviation(variance: float, bound: float, delta: float) -> float:
    """The t with P(|S - E S| >= t) <= delta, for S a sum of independent terms X_i with
    |X_i - E X_i| <= bound and sum_i Var X_i = variance (Bernstein's inequality:
    P(|S - E S| >= t) <= 2 exp(-t^2 / (2 (variance + bound t / 3))), solved for t).
    Unlike a normal quantile it needs no approximation at any n."""
    log_term = math.log(2.0 / delta)
    linear = bound * log_term / 3.0
    return linear + math.sqrt(linear * linear + 2.0 * variance * log_term)


def record_group(
    url: str,
    key: str,
    state_dir: Path,
    themes: list[str],
    minutes: list[float],
) -> dict[str, float]:
    """One client object (one state directory) records the values of its devices, then
    flushes; returns its budget figures and delivery outcome."""
    with fleet_client(url, key, state_dir, batch_size=64) as client:
        for theme, length in zip(themes, minutes, strict=True):
            client.record(THEME, theme)
            client.record(MINUTES, length)
        delivered = client.flush(timeout=60.0)
        status = client.budget()
        return {
            "delivered": float(delivered),
            "queued": float(client.queued),
            "dropped": float(client.dropped),
            "theme_spent": status.spent_per_metric[THEME],
            "minutes_spent": status.spent_per_metric[MINUTES],
            "reserved": status.reserved,
        }


@pytest.mark.slow
def test_twenty_thousand_devices_estimate_matches_truth(aggregator: Any, tmp_path: Path) -> None:
    """20,000 simulated devices report a theme (GRR, d = 3, eps = 2) and a session length
    (piecewise, eps = 1, [0, 120]) through the SDK; the aggregator's estimates match the
    population's truth.

    Layout: 40 client objects, each with its own state directory (ledger, outbox, spec
    cache, uploader thread), each recording for 500 devices, four at a time in threads.
    Every report still takes the real path: spec fetched from the aggregator and cached,
    durable ledger debit, perturbation by the mechanism with the OS CSPRNG, outbox,
    background and flushed uploads over HTTP; each ``record`` draws fresh randomness, so
    the aggregator sees 40,000 independent reports, as it would from 20,000 devices.
    What a shared state directory changes is the budget: one ledger pays for 500 devices,
    so its caps are set high here (the caps themselves are tested in the crash test and
    the budget tests). 20,000 state directories would spend the test's time creating
    files, not exercising anything more: a client object's set-up costs far more than a
    record, so a few dozen of them keep the test to seconds.

    Tolerance: the truth is the fixed simulated population; the randomness is the
    mechanisms' (secure, unseeded: a device never seeds). Each count or sum is a sum of
    independent bounded terms, so Bernstein's inequality bounds its deviation with
    probability 1 - DELTA / 4 (``bernstein_deviation``), using the mechanisms' exact p, q
    and per-report variances at the true values. False-failure rate <= DELTA = 1e-6.
    """
    rng = np.random.default_rng(20261122)
    labels = ["light", "dark", "system"]
    theme_index = rng.choice(3, size=DEVICES, p=[0.55, 0.30, 0.15])
    minutes = np.round(np.minimum(rng.gamma(2.0, 9.0, size=DEVICES), 120.0), 1)
    themes = [labels[i] for i in theme_index]

    size = DEVICES // GROUPS
    key = aggregator.keys["device"]
    with ThreadPoolExecutor(max_workers=4) as pool:
        outcomes = list(
            pool.map(
                lambda g: record_group(
                    aggregator.url,
                    key,
                    tmp_path / f"device-group-{g:03d}",
                    themes[g * size : (g + 1) * size],
                    [float(x) for x in minutes[g * size : (g + 1) * size]],
                ),
                range(GROUPS),
            )
        )

    # Every group delivered everything and spent exactly its reports' epsilon (what is
    # reserved but unused is counted as spent until close, and shown as reserved).
    for outcome in outcomes:
        assert outcome["delivered"] == 1.0 and outcome["queued"] == 0 and outcome["dropped"] == 0
        used = outcome["theme_spent"] + outcome["minutes_spent"] - outcome["reserved"]
        assert used == pytest.approx(size * (2.0 + 1.0), rel=1e-9)

    specs = {item["name"]: item for item in aggregator.metrics()}
    theme_mech = make_mechanism(MechanismSpec.model_validate(specs[THEME]["mechanism"]))
    minutes_mech = make_mechanism(MechanismSpec.model_validate(specs[MINUTES]["mechanism"]))
    assert isinstance(theme_mech, GeneralizedRandomizedResponse)
    assert isinstance(minutes_mech, PiecewiseMechanism)

    # Categorical: f_hat_v = (C_v / n - q) / (p - q), C_v a sum of n Bernoulli(p or q).
    response = aggregator.estimate(THEME)
    assert response.status_code == 200, response.text
    published = response.json()
    assert published["n"] == DEVICES
    assert [item["label"] for item in published["estimates"]] == labels
    p, q = theme_mech.p, theme_mech.q
    truth = np.bincount(theme_index, minlength=3) / DEVICES
    for v, item in enumerate(published["estimates"]):
        n_v = truth[v] * DEVICES
        variance = n_v * p * (1 - p) + (DEVICES - n_v) * q * (1 - q)
        bound = bernstein_deviation(variance, max(p, 1 - p, q, 1 - q), DELTA / 4)
        tolerance = bound / (DEVICES * (p - q))
        assert abs(item["frequency"] - truth[v]) <= tolerance, (item, truth[v], tolerance)
        # The published std is the analytical one (at the estimate, not the truth).
        exact_std = math.sqrt(variance) / (DEVICES * (p - q))
        assert item["std"] == pytest.approx(exact_std, rel=0.02)

    # Numeric: the mean of debiased reports lower + (Y_i + 1) h, Y_i in [-C, C], E Y_i = t_i.
    response = aggregator.estimate(MINUTES)
    assert response.status_code == 200, response.text
    published = response.json()
    assert published["n"] == DEVICES
    # Nothing failed, so nothing was sent twice (a retry would show as a duplicate).
    exposition = aggregator.prometheus()
    assert re.search(r"^ldp_reports_accepted_total 40000\.0$", exposition, re.MULTILINE)
    assert re.search(r"^ldp_reports_duplicate_total 0\.0$", exposition, re.MULTILINE)
    true_mean = float(np.clip(minutes, minutes_mech.lower, minutes_mech.upper).mean())
    variance = float(minutes_mech.report_variance(minutes).sum())
    term_bound = (minutes_mech.bound + 1.0) * minutes_mech.half_range
    tolerance = bernstein_deviation(variance, term_bound, DELTA / 4) / DEVICES
    assert abs(published["mean"] - true_mean) <= tolerance, (published, true_mean, tolerance)


# --- the README example -------------------------------------------------------------------

#: The client example of README.md, verbatim: ``test_readme_example`` runs exactly this.
README_EXAMPLE = '''\
import os

from client import BudgetLimits, TelemetryClient


def report_session(theme: str, minutes: float) -> None:
    """Report how a session went: its colour theme and its length in minutes."""
    with TelemetryClient(
        endpoint=os.environ.get("LDP_ENDPOINT", "http://127.0.0.1:8000"),
        api_key=os.environ["LDP_DEVICE_KEY"],  # a device key from the aggregator's admin
        state_dir=os.path.expanduser("~/.local/state/my-app/ldp"),  # ledger, outbox, specs
        limits=BudgetLimits(per_metric_per_period=4.0, total_per_period=8.0),  # per day
    ) as telemetry:
        telemetry.record("app.theme", theme)  # a category, by its label
        telemetry.record("app.session_minutes", minutes)  # a number
        print(f"epsilon left today: {telemetry.budget().left_this_period:g}")
    # Leaving the block uploads what is queued (within 5 s; the rest waits on disk).
'''


@pytest.mark.slow
def test_readme_example(
    aggregator: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The README's example reports one theme and one session length to a running
    aggregator: both arrive, the budget it prints is right, and its state directory is
    where the example says."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("LDP_ENDPOINT", aggregator.url)
    monkeypatch.setenv("LDP_DEVICE_KEY", aggregator.keys["device"])
    namespace: dict[str, Any] = {}
    exec(compile(README_EXAMPLE, "README example", "exec"), namespace)  # noqa: S102

    namespace["report_session"]("dark", 12.5)

    assert capsys.readouterr().out == "epsilon left today: 5\n"  # 8 - 2 (theme) - 1 (minutes)
    assert aggregator.count(THEME) == 1
    assert aggregator.count(MINUTES) == 1
    state = tmp_path / ".local" / "state" / "my-app" / "ldp"
    assert (state / "ledger.json").exists() and (state / "outbox.sqlite3").exists()

    # A second session the same day: the theme's per-day cap (4 = two reports) still holds.
    namespace["report_session"]("light", 30.0)
    assert capsys.readouterr().out == "epsilon left today: 2\n"
    assert aggregator.count(THEME) == 2


def test_readme_shows_the_example() -> None:
    """README.md's client example is the code ``test_readme_example`` runs."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.DOTALL)
    shown = [block for block in blocks if "TelemetryClient(" in block]
    if not shown:
        pytest.skip("README.md has no client example yet")
    assert README_EXAMPLE in shown, "README.md's client example differs from README_EXAMPLE"
