"""``create-key`` and ``compact`` work on an existing database, and say which one.

``ldp-aggregator create-key`` run in a terminal whose ``LDP_DATA_DIR`` differed from the
server's made a new, empty database and printed a key the running server refused. Now a
command that only makes sense against the server's database refuses, with exit status 2
and nothing created, where no aggregator database exists yet, saying what to do; where
one exists it names it on stderr, and the key alone goes to stdout. The help says so,
in plain text.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from aggregator.cli import main
from aggregator.service import Services
from aggregator.settings import Settings

COMMANDS = [["create-key", "--role", "admin"], ["compact"]]


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one-line error of a command that exits with status 2, stdout empty."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("ldp-aggregator: error: ")
    return err


@pytest.mark.parametrize("command", COMMANDS, ids=["create-key", "compact"])
def test_a_data_directory_without_a_database_is_refused_not_filled(
    command: list[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    data = tmp_path / "other-terminal"
    data.mkdir()
    monkeypatch.delenv("LDP_DATABASE", raising=False)
    monkeypatch.setenv("LDP_DATA_DIR", str(data))
    error = refused(command, capsys)
    assert f"no aggregator database at SQLite file {data / 'aggregator.sqlite3'}" in error
    assert f"(from LDP_DATA_DIR={data})" in error
    assert "start the server once with this data directory" in error
    assert "--database" in error
    assert list(data.iterdir()) == []  # nothing created


@pytest.mark.parametrize("command", COMMANDS, ids=["create-key", "compact"])
def test_a_database_option_without_a_database_is_refused(
    command: list[str], database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    error = refused([*command, "--database", database_url], capsys)
    assert "no aggregator database at " in error and "(from --database)" in error
    assert "start the server once with this database" in error
    if "://" not in database_url:
        assert not Path(database_url).exists()
    # Still nothing there: a server's first start creates it as it would have.
    Services.open(Settings(database=database_url)).close()


def test_the_key_goes_to_stdout_and_the_database_to_stderr(
    database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    Services.open(Settings(database=database_url)).close()  # a server started here once
    assert main(["create-key", "--role", "analyst", "--database", database_url]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("analyst key ") and out.count("\n") == 1
    secret = out.split(": ", 1)[1].strip()
    assert err.startswith("database: ") and err.count("\n") == 1
    shown = database_url if "://" in database_url else f"SQLite file {database_url}"
    assert shown.split("?")[0] in err
    services = Services.open(Settings(database=database_url), create=False)
    try:
        principal = services.keys.authenticate(secret)
        assert principal is not None and principal.role == "analyst"
    finally:
        services.close()


def test_the_help_is_plain_text_and_says_where_the_database_is(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    assert "``" not in text and "**" not in text
    assert "LDP_DATA_DIR" in text and "create-key" in text
    assert "refuse where there is none" in " ".join(text.split())
