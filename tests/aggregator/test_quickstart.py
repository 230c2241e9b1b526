"""The README's Quickstart, end to end, and the demo data it starts from.

``test_readme_quickstart`` runs the shell blocks of README.md's Quickstart section as a
newcomer would, against a real ``ldp-aggregator serve``, so it breaks when the README
drifts from the code. What it changes, and nothing else:

* lines that ``pip install`` are not run (it runs in the virtual environment the tests
  run in); one of them must install the ``[sim]`` extra the Quickstart uses;
* the commands run in a fresh directory whose ``.venv`` is a link to that environment,
  with ``HOME`` in a temporary directory (so the default database is a new one) and no
  ``LDP_*`` variables inherited;
* the port 8000 is replaced by a free loopback port;
* the ``ldp-aggregator serve`` line runs in the background (the README's first terminal)
  and the rest, in order, in one ``bash -e`` shell once it answers (the second terminal).
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import httpx
import numpy as np
import pytest

from aggregator.demo_data import (
    DEMO_HOURS,
    DEMO_REPORTS_PER_HOUR,
    fill_demo_data,
    simulated_values,
    zipf_shares,
)
from aggregator.registry import DEMO_METRICS
from aggregator.repositories.reports import ReportsRepository
from aggregator.service import Aggregator, Services
from aggregator.settings import Settings
from shared.mechanisms.grr import GeneralizedRandomizedResponse
from shared.schemas import ReportBatch
from tests.support import free_port

ROOT = Path(__file__).resolve().parents[2]
#: Two-sided normal quantile of 10^-7: each statistical check below fails falsely with
#: probability at most 10^-7 (normal approximation of sums of 14,400 bounded terms).
Z = 5.33
NOW = datetime(2026, 11, 24, 15, 30, tzinfo=UTC)
PER_METRIC = DEMO_HOURS * DEMO_REPORTS_PER_HOUR


def quickstart_commands() -> list[str]:
    """The commands of the shell blocks of README.md's Quickstart section, in order
    (continuation lines joined, blank lines dropped)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("\n## Quickstart\n", 1)[1].split("\n## ", 1)[0]
    commands: list[str] = []
    for block in re.findall(r"```sh\n(.*?)```", section, flags=re.DOTALL):
        for command in block.replace("\\\n", " ").splitlines():
            if command.strip() and not command.lstrip().startswith("#"):
                commands.append(command.strip())
    return commands


@pytest.mark.slow
def test_readme_quickstart(tmp_path: Path) -> None:
    """From ``serve`` to a real estimate by the README's commands alone: the curl of the
    demo metric answers a 200 estimate of the 14,400 demo reports, and the fleet's
    reports are estimated the same way."""
    commands = quickstart_commands()
    installs = [c for c in commands if "pip install" in c]
    assert any("pip install -e '.[sim]'" in c for c in installs), installs
    port = str(free_port())
    run = [c.replace("8000", port) for c in commands if "pip install" not in c]
    serve = [c for c in run if "ldp-aggregator serve" in c]
    assert len(serve) == 1 and f"--port {port}" in serve[0], serve
    second = [c for c in run if c != serve[0]]
    assert any(f"127.0.0.1:{port}" in c for c in second), "LDP_ENDPOINT names the port"

    workdir, home = tmp_path / "checkout", tmp_path / "home"
    workdir.mkdir()
    home.mkdir()
    (workdir / ".venv").symlink_to(Path(sys.prefix), target_is_directory=True)
    environment = {k: v for k, v in os.environ.items() if not k.startswith("LDP_")}
    environment.pop("PROMETHEUS_MULTIPROC_DIR", None)
    environment["HOME"] = str(home)
    log = (tmp_path / "serve.log").open("wb")
    server = subprocess.Popen(
        ["bash", "-c", serve[0]], cwd=workdir, env=environment,
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while True:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()
            assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
            try:
                if httpx.get(f"{url}/healthz", timeout=1.0).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        # Each command's output is delimited, so each curl's answer can be read back.
        script = "\n".join(f"{c}\nprintf '\\n@@ step {i} done\\n'" for i, c in enumerate(second))
        script += '\nprintf "%s\\n" "$LDP_ANALYST_KEY"\n'
        done = subprocess.run(
            ["bash", "-e", "-c", script], cwd=workdir, env=environment,
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        outputs = re.split(r"\n@@ step \d+ done\n", done.stdout)
        analyst_key = outputs[-1].strip()
        answers = {
            metric.group(1): output
            for command, output in zip(second, outputs, strict=False)
            if command.startswith("curl")
            and (metric := re.search(r"/v1/metrics/([^/]+)/estimate", command))
        }
        assert list(answers) == ["app.theme", "fleet.grr"], second
        theme = json.loads(answers["app.theme"])
        assert theme["n"] == PER_METRIC and theme["buckets"] == DEMO_HOURS
        assert [row["label"] for row in theme["estimates"]] == ["light", "dark", "system"]
        fleet = json.loads(answers["fleet.grr"])
        assert fleet["n"] == 2000 and len(fleet["estimates"]) > 0
        for metric in answers:  # the same requests, with their status codes
            response = httpx.get(
                f"{url}/v1/metrics/{metric}/estimate",
                headers={"Authorization": f"Bearer {analyst_key}"},
            )
            assert response.status_code == 200, response.text
        served = (tmp_path / "serve.log").read_text()
        assert f"--demo-data: stored {len(DEMO_METRICS) * PER_METRIC:,} perturbed reports" in served
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait(timeout=30)
        log.close()


# --- the demo data ---------------------------------------------------------------------


@pytest.fixture
def services(tmp_path: Path) -> Iterator[Services]:
    opened = Services.open(Settings(database=str(tmp_path / "demo.sqlite3")))
    opened.aggregator.define_missing(DEMO_METRICS)
    yield opened
    opened.close()


@pytest.fixture
def service(services: Services) -> Aggregator:
    return services.aggregator


@pytest.fixture
def reports(services: Services) -> ReportsRepository:
    return services.repositories.reports


@pytest.mark.slow
def test_demo_data_fills_every_demo_metric_with_perturbed_reports(
    service: Aggregator, reports: ReportsRepository
) -> None:
    """14,400 reports per demo metric, 200 in each of the last 72 hours, stored as the
    mechanisms' perturbed reports: the stored GRR counts follow the perturbed law
    ``E C_v = n_v p + (n - n_v) q`` (the raw counts ``n_v`` are far outside it), and the
    debiased estimates find the simulated population. Each check: within Z = 5.33
    standard deviations (false-failure rate 10^-7 each; 9 checks)."""
    stored = fill_demo_data(service, now=NOW, rng=np.random.default_rng(7))
    assert stored == {name: PER_METRIC for name in sorted(DEMO_METRICS)}
    assert reports.report_count() == len(DEMO_METRICS) * PER_METRIC

    theme = service.catalog.get("app.theme")
    assert theme is not None
    grr = service.catalog.mechanism("app.theme", theme.version)
    assert isinstance(grr, GeneralizedRandomizedResponse)
    values = simulated_values(theme, grr, PER_METRIC)
    assert values is not None
    true_counts = np.bincount(values, minlength=3)
    p, q, n = grr.p, grr.q, PER_METRIC
    rows = reports.partial_rows("app.theme", theme.version)
    assert len({row.bucket for row in rows}) == DEMO_HOURS
    counts = grr.empty_statistics().merge_many(grr.statistics_from_bytes(r.stats) for r in rows)
    spread = np.sqrt(true_counts * p * (1 - p) + (n - true_counts) * q * (1 - q))
    expected = true_counts * p + (n - true_counts) * q
    assert np.all(np.abs(counts.counts - expected) <= Z * spread)
    assert np.all(np.abs(counts.counts - true_counts) > Z * spread)  # not the raw values

    estimate = service.estimate("app.theme")
    rows_out: list[dict[str, float]] = estimate["estimates"]  # type: ignore[assignment]
    frequencies = np.array([row["frequency"] for row in rows_out])
    assert np.all(np.abs(frequencies - true_counts / n) <= Z * spread / (n * (p - q)))
    assert np.allclose(true_counts / n, zipf_shares(3), atol=0.02)  # the Zipf population

    minutes = service.catalog.get("app.session_minutes")
    assert minutes is not None
    mean_mech = service.catalog.mechanism(minutes.name, minutes.version)
    assert mean_mech is not None
    truth = simulated_values(minutes, mean_mech, PER_METRIC)
    assert truth is not None and 0.0 <= truth.min() and truth.max() <= 120.0
    published = service.estimate("app.session_minutes")
    assert published["n"] == PER_METRIC
    mean, std = float(published["mean"]), float(published["std"])  # type: ignore[arg-type]
    assert abs(mean - truth.mean()) <= Z * std

    for name in ("app.start_screen", "browser.home_page"):
        assert service.estimate(name)["n"] == PER_METRIC


def test_demo_data_never_mixes_with_reports_already_stored(
    service: Aggregator, reports: ReportsRepository
) -> None:
    """A database that holds statistics gets no demo reports: not after a real report,
    and not at a second start after a first fill."""
    theme = service.catalog.get("app.theme")
    assert theme is not None
    mechanism = service.catalog.mechanism("app.theme", theme.version)
    assert mechanism is not None
    payload = mechanism.to_payloads(mechanism.encode(np.array([1])))[0]
    batch = ReportBatch.model_validate(
        {"reports": [{"report_id": str(uuid.uuid4()), "metric": "app.theme",
                      "version": theme.version, "payload": payload}]}
    )  # fmt: skip
    service.ingest(batch, now=NOW)

    assert fill_demo_data(service, now=NOW) == {}
    assert reports.report_count() == 1


def test_demo_data_is_added_once(service: Aggregator, reports: ReportsRepository) -> None:
    """A second fill (the next ``serve --demo-data`` on the same database) adds nothing."""
    assert fill_demo_data(service, now=NOW)
    assert fill_demo_data(service, now=NOW) == {}
    assert reports.report_count() == len(DEMO_METRICS) * PER_METRIC


@pytest.mark.slow
def test_demo_data_reaches_the_release_threshold(tmp_path: Path) -> None:
    """Each hour holds at least ``min_reports`` reports, whatever the threshold, so
    every demo estimate is released."""
    settings = Settings(database=str(tmp_path / "strict.sqlite3"), min_reports=800)
    services = Services.open(settings)
    service = services.aggregator
    try:
        service.define_missing(DEMO_METRICS)
        stored = fill_demo_data(service, now=NOW)
        assert set(stored.values()) == {DEMO_HOURS * 800}
        estimate = service.estimate("app.theme")
        assert estimate["buckets"] == DEMO_HOURS and estimate["suppressed_buckets"] == 0
    finally:
        services.close()


def test_zipf_shares() -> None:
    """``P(v) ∝ (v + 1)^-1.1``, normalized."""
    shares = zipf_shares(4)
    weights = [1.0, 2**-1.1, 3**-1.1, 4**-1.1]
    assert shares == pytest.approx([w / math.fsum(weights) for w in weights], rel=1e-12)
