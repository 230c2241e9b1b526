"""Report integrity over the HTTP API: refusal rules at ingest, profiles, the ``integrity``
object and the robust mean of estimates, compaction of profiles, the schema upgrade.

The service must refuse (422, naming the rule, nothing stored) a report that breaks its
mechanism's refusal rule, count it in the window's ``refused``, test the window's profile
against the honest law (``integrity.fit``) and raise ``integrity.alert`` when forged reports
distort it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sqlalchemy import delete, func, select, update

from aggregator.repositories.database import Database
from aggregator.repositories.reports import PROFILE
from aggregator.repositories.schema import (
    INTEGRITY_TABLES,
    SCHEMA_VERSION,
    report_profiles,
    schema_info,
)
from shared.integrity import ALERT_P_VALUE
from shared.mechanisms import make_mechanism
from shared.schemas import MechanismSpec
from tests.aggregator.test_api import Api, assert_problem, hour, iso, reports, running

OUE = {"mechanism": "oue", "epsilon": 1.0, "domain_size": 64}
LAPLACE = {"mechanism": "laplace", "epsilon": 1.0, "lower": 0.0, "upper": 100.0}
LAST_HOUR = iso(hour(-1))


@pytest.fixture
def api(tmp_path: Path) -> Iterator[Api]:
    """The service on a fresh SQLite file."""
    with running(str(tmp_path / "integrity.sqlite3")) as service:
        yield service


@pytest.fixture
def db_api(database_url: str) -> Iterator[Api]:
    """The service on a fresh SQLite file, then on a fresh PostgreSQL schema."""
    with running(database_url) as service:
        yield service


def post_all(api: Api, metric: str, payloads: list[dict[str, Any]], size: int = 500) -> None:
    for start in range(0, len(payloads), size):
        chunk = reports(metric, 1, payloads[start : start + size], LAST_HOUR)
        response = api.post(chunk)
        assert response.status_code == 200, response.text


def honest_oue(n: int, seed: int) -> tuple[Any, np.ndarray]:
    mech = make_mechanism(MechanismSpec.model_validate(OUE))
    rng = np.random.default_rng(seed)
    return mech, mech.encode(rng.integers(0, 64, n), rng=rng)


def mga_oue(mech: Any, m: int, targets: np.ndarray, seed: int) -> np.ndarray:
    """Cao et al.'s maximal gain reports: the target bits and enough other random bits for
    the expected count of ones, round(p + (d - 1) q)."""
    rng = np.random.default_rng(seed)
    d = mech.domain_size
    ones = round(mech.p + (d - 1) * mech.q)
    bits = np.zeros((m, d), dtype=np.uint8)
    bits[:, targets] = 1
    others = np.setdiff1d(np.arange(d), targets)
    for row in bits:  # a test's handful of forged reports
        row[rng.choice(others, ones - targets.size, replace=False)] = 1
    return np.packbits(bits, axis=1)


def test_a_forged_unary_report_is_refused_naming_its_rule(db_api: Api) -> None:
    assert db_api.define("colour", OUE).status_code == 201
    mech, honest = honest_oue(60, seed=1)
    forged = np.packbits(np.ones((1, 64), dtype=np.uint8), axis=1)
    payloads = mech.to_payloads(np.concatenate([honest[:30], forged, honest[30:]]))
    body = assert_problem(db_api.post(reports("colour", 1, payloads, LAST_HOUR)), 422)
    refused = [error for error in body["errors"] if error.get("rule")]
    assert [error["report"] for error in refused] == [30]
    assert refused[0]["rule"] == "oue.ones_count" and "oue.ones_count" in body["detail"]
    assert refused[0]["field"] == "payload"
    assert db_api.n("colour") == 0  # nothing of the batch was stored
    post_all(db_api, "colour", mech.to_payloads(honest))
    integrity = db_api.estimate("colour").json()["integrity"]
    assert integrity["refused"] == {"oue.ones_count": 1}
    assert integrity["refused_share"] == pytest.approx(1 / 61, rel=1e-12)


def test_honest_reports_fit_and_forged_ones_raise_the_alert(api: Api) -> None:
    """2,000 honest reports: the fit's p-value is uniform under the honest law, so it falls
    below ALERT_P_VALUE with probability 1e-3 (the test's false-failure rate, seed fixed).
    200 more maximal-gain reports, all with the same count of ones, push the count's
    histogram far off the honest law (their bin alone expects about 0.11 of the reports)."""
    assert api.define("colour", OUE).status_code == 201
    mech, honest = honest_oue(2000, seed=2)
    post_all(api, "colour", mech.to_payloads(honest))
    integrity = api.estimate("colour").json()["integrity"]
    assert integrity["fit"]["reports"] == 2000 and integrity["fit"]["degrees_of_freedom"] >= 5
    assert integrity["fit"]["p_value"] >= ALERT_P_VALUE
    assert integrity["alert"] is False and integrity["message"] is None
    assert integrity["refused"] == {} and integrity["refused_share"] == 0.0
    forged = mga_oue(mech, 200, np.arange(5), seed=3)
    post_all(api, "colour", mech.to_payloads(forged))
    integrity = api.estimate("colour").json()["integrity"]
    assert integrity["alert"] is True and integrity["fit"]["p_value"] < ALERT_P_VALUE
    assert "forged reports" in integrity["message"]


def test_a_laplace_report_past_the_tail_is_refused_and_the_robust_mean_published(
    api: Api,
) -> None:
    assert api.define("latency", LAPLACE).status_code == 201
    mech = make_mechanism(MechanismSpec.model_validate(LAPLACE))
    (rule,) = mech.refusal_rules()
    rng = np.random.default_rng(4)
    honest = mech.encode(rng.uniform(0, 100, 200), rng=rng)
    codes = mech.refusals(honest)
    assert (codes == -1).all()
    index = int(mech.grid_steps) + 1
    while mech.refusals(np.array([index]))[0] < 0:  # the first index past the rule's tail
        index *= 2
    body = assert_problem(api.post(reports("latency", 1, [{"value": index}], LAST_HOUR)), 422)
    assert body["errors"][0]["rule"] == rule.name == "laplace.noise_tail"
    post_all(api, "latency", mech.to_payloads(honest))
    estimate = api.estimate("latency").json()
    robust = estimate["robust"]
    assert robust["bias_bound"] >= 0 and robust["low"] < 0 < 100 < robust["high"]
    assert robust["ci_low"] <= robust["mean"] <= robust["ci_high"]
    if robust["winsorized"] == 0:  # no honest report reached the winsorizing bounds
        assert math.isclose(robust["mean"], estimate["mean"], rel_tol=1e-12)
    assert estimate["integrity"]["refused"] == {"laplace.noise_tail": 1}


def test_compaction_merges_profiles_and_keeps_the_fit(api: Api) -> None:
    assert api.define("colour", OUE).status_code == 201
    mech, honest = honest_oue(900, seed=5)
    post_all(api, "colour", mech.to_payloads(honest), size=300)
    before = api.estimate("colour").json()["integrity"]
    reports_repository = api.repositories.reports
    assert len(reports_repository.partial_rows("colour", 1, kind=PROFILE)) == 3
    response = api.client.post("/v1/admin/compact", headers=api.auth("admin"))
    assert response.status_code == 200, response.text
    assert len(reports_repository.partial_rows("colour", 1, kind=PROFILE)) == 1
    assert api.estimate("colour").json()["integrity"] == before


def test_reports_without_profiles_publish_no_robust_mean(api: Api) -> None:
    """Reports stored before profiles were kept: the window's profile does not cover them,
    so the robust mean (which needs every report's tail) is left out."""
    assert api.define("latency", LAPLACE).status_code == 201
    mech = make_mechanism(MechanismSpec.model_validate(LAPLACE))
    rng = np.random.default_rng(6)
    post_all(api, "latency", mech.to_payloads(mech.encode(rng.uniform(0, 100, 100), rng=rng)))
    assert "robust" in api.estimate("latency").json()
    with api.repositories.database.write() as conn:
        conn.execute(delete(report_profiles))
    estimate = api.estimate("latency").json()
    assert "robust" not in estimate and estimate["integrity"]["fit"] is None


def test_a_version_4_database_is_upgraded(database_url: str) -> None:
    """Version 4 had no integrity tables: the upgrade adds them."""
    database = Database(database_url)
    try:
        with database.write() as conn:
            for table in INTEGRITY_TABLES:
                conn.exec_driver_sql(f"DROP TABLE {table.name}")
            conn.execute(
                update(schema_info).where(schema_info.c.key == "schema_version").values(value="4")
            )
    finally:
        database.close()
    upgraded = Database(database_url)
    try:
        with upgraded.read() as conn:
            version = conn.execute(
                select(schema_info.c.value).where(schema_info.c.key == "schema_version")
            ).scalar_one()
            counts = [
                conn.execute(select(func.count()).select_from(table)).scalar_one()
                for table in INTEGRITY_TABLES
            ]
        assert version == str(SCHEMA_VERSION) == "5" and counts == [0] * len(INTEGRITY_TABLES)
    finally:
        upgraded.close()
