"""``ldp-aggregator``: what a start tells its operator, and how it refuses what it cannot use.

Each refusal runs the real command in a subprocess and must be one line on stderr,
``ldp-aggregator: error: ...``, with exit status 2, no traceback, and nothing created: a
SQLite directory that does not exist (except the default location), a PostgreSQL server
that refuses the login or the connection (on loopback only), and a port already in use.
A start that succeeds prints, once, its address, its database (the absolute path; a URL
with its password hidden), its metrics and how to make a new admin key.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import make_url

from aggregator.cli import absolute_database, startup_summary
from aggregator.registry import DEMO_METRICS
from aggregator.settings import Settings
from shared.schemas import MechanismSpec, MetricSpec

#: Every test here starts a real server process or CLI: the slow lane.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
PREFIX = "ldp-aggregator: error: "


def run_cli(*args: str, cwd: Path, data_dir: Path) -> subprocess.CompletedProcess[str]:
    """``python -m aggregator.cli ARGS`` with the default location under ``data_dir``."""
    environment = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith("LDP_") or name == "LDP_TEST_POSTGRES"
    }
    environment["LDP_DATA_DIR"] = str(data_dir)
    environment["PYTHONPATH"] = str(REPO)
    return subprocess.run(
        [sys.executable, "-m", "aggregator.cli", *args],
        cwd=cwd,
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )


def assert_one_line_error(result: subprocess.CompletedProcess[str], *fragments: str) -> str:
    """The command failed with status 2 and one ``ldp-aggregator: error:`` line."""
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert result.stdout == ""
    assert result.stderr.endswith("\n") and result.stderr.count("\n") == 1, result.stderr
    line = result.stderr.strip()
    assert line.startswith(PREFIX), line
    for fragment in fragments:
        assert fragment in line, (fragment, line)
    return line


@pytest.fixture
def cli(tmp_path: Path) -> Callable[..., subprocess.CompletedProcess[str]]:
    """``cli(*args)``: the command run in ``tmp_path/work``, defaults under ``tmp_path``."""
    work = tmp_path / "work"
    work.mkdir()

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return run_cli(*args, cwd=work, data_dir=tmp_path / "default-data")

    return run


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A loopback port another socket is listening on."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        yield int(busy.getsockname()[1])


# --- refusals ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "command",
    [["serve", "--port", "0"], ["create-key", "--role", "admin"], ["compact"]],
    ids=["serve", "create-key", "compact"],
)
def test_a_missing_directory_is_refused_not_created(
    cli: Callable[..., subprocess.CompletedProcess[str]], tmp_path: Path, command: list[str]
) -> None:
    missing = tmp_path / "no-such-dir"
    result = cli(*command, "--database", str(missing / "agg.sqlite3"))
    assert_one_line_error(result, f"the database directory {missing} does not exist")
    assert not missing.exists()


def test_a_relative_sqlite_url_is_explained(
    cli: Callable[..., subprocess.CompletedProcess[str]], tmp_path: Path
) -> None:
    result = cli("serve", "--port", "0", "--database", "sqlite:///data/agg.sqlite3")
    assert_one_line_error(
        result,
        f"the database directory {tmp_path / 'work' / 'data'} does not exist",
        "relative to the working directory",
        "sqlite:////data/agg.sqlite3",
    )
    assert not (tmp_path / "work" / "data").exists()


def test_the_default_location_is_not_created_by_create_key(
    cli: Callable[..., subprocess.CompletedProcess[str]], tmp_path: Path
) -> None:
    result = cli("create-key", "--role", "admin")
    assert result.returncode == 2, result.stderr
    assert "start the server once with this data directory" in result.stderr
    assert not (tmp_path / "default-data").exists()


@pytest.mark.parametrize(
    "url",
    [
        "postgresql+psycopg://ldp_no_such_role:pw-not-shown@127.0.0.1:5432/test",
        "postgresql+psycopg://postgres:pw-not-shown@127.0.0.1:1/test",
    ],
    ids=["wrong user", "nothing listening"],
)
def test_a_database_that_refuses_is_one_line(
    cli: Callable[..., subprocess.CompletedProcess[str]], url: str
) -> None:
    shown = make_url(url).render_as_string(hide_password=True)
    result = cli("serve", "--port", "0", "--database", url)
    line = assert_one_line_error(result, f"cannot open the database {shown}: ")
    assert "pw-not-shown" not in line


def test_a_port_in_use_is_refused_before_anything_is_done(
    cli: Callable[..., subprocess.CompletedProcess[str]], tmp_path: Path, busy_port: int
) -> None:
    database = tmp_path / "agg.sqlite3"
    result = cli("serve", "--port", str(busy_port), "--database", str(database))
    assert_one_line_error(result, f"cannot listen on 127.0.0.1:{busy_port}", "in use")
    assert not database.exists()


@pytest.mark.parametrize("port", ["-1", "65536"])
def test_a_port_out_of_range_is_refused(
    cli: Callable[..., subprocess.CompletedProcess[str]], tmp_path: Path, port: str
) -> None:
    result = cli("serve", "--port", port, "--database", str(tmp_path / "agg.sqlite3"))
    assert_one_line_error(result, "--port must be 0..65535")


# --- what a start prints ----------------------------------------------------------------


def test_every_start_says_where_it_listens_what_it_serves_and_how_to_recover_a_key(
    start_server: Callable[..., Any], tmp_path: Path
) -> None:
    database = tmp_path / "agg.sqlite3"
    for _ in range(2):  # the second start, on the same database, says as much
        server = start_server(str(database))
        server.stop()
        port = server.port
        log = server.log()
        assert log.count("ldp-aggregator serving ") == 1, log
        assert f"ldp-aggregator serving http://127.0.0.1:{port} (1 worker)" in log
        assert f"database: SQLite file {database}\n" in log
        for name, definition in DEMO_METRICS.items():
            assert f"{name} v1 ({definition.mechanism.mechanism})" in log
        assert f"ldp-aggregator create-key --role admin --database {database}\n" in log
        assert "Created an admin API key" not in log  # the keys come from the environment


def test_a_relative_sqlite_url_is_made_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    absolute = f"sqlite:///{tmp_path}/data/agg.sqlite3"
    assert absolute_database("sqlite:///data/agg.sqlite3") == absolute
    assert absolute_database(absolute) == absolute
    assert absolute_database("data/agg.sqlite3") == f"{tmp_path}/data/agg.sqlite3"
    postgres = "postgresql+psycopg://u:secret@127.0.0.1/test"
    assert absolute_database(postgres) == postgres


def test_the_summary_hides_a_password() -> None:
    url = "postgresql+psycopg://ldp:s3cret@127.0.0.1:5432/telemetry"
    metric = MetricSpec(
        name="m",
        version=3,
        mechanism=MechanismSpec.model_validate(
            {"mechanism": "grr", "epsilon": 1.0, "domain_size": 2}
        ),
    )
    args = argparse.Namespace(host="::1", port=8000, workers=2)
    summary = startup_summary(args, Settings(database=url), [metric])
    assert "s3cret" not in summary
    assert summary.splitlines() == [
        "ldp-aggregator serving http://[::1]:8000 (2 workers)",
        "  database: postgresql+psycopg://ldp:***@127.0.0.1:5432/telemetry",
        "  metrics:  1: m v3 (grr)",
        "  admin key lost? make another against the same database:",
        "    ldp-aggregator create-key --role admin --database "
        "'postgresql+psycopg://ldp:***@127.0.0.1:5432/telemetry'"
        "  (with the password in place of ***)",
    ]
