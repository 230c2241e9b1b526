"""Keys from ``LDP_*_KEYS`` follow the environment (``aggregator/auth.py``).

A key removed from its variable is revoked at the next start (it used to stay active);
listed again, a key the start revoked is active again; a key revoked through the API
stays revoked; keys from the API or ``create-key`` are never touched by a start; a badly
formed list stops the start and changes nothing. The first test restarts a real
``ldp-aggregator serve``; the others call the start's key step directly.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient

from aggregator.app import create_app
from aggregator.auth import (
    ENVIRONMENT_LABELS,
    UNLISTED,
    KeyRing,
    bootstrap_keys,
    hash_key,
    sync_environment_keys,
)
from aggregator.registry import DEMO_METRICS
from aggregator.repositories.keys import KeysRepository
from aggregator.settings import Settings
from aggregator.storage import Repositories
from shared.mechanisms import make_mechanism

KEY_A = "device-key-a-0123456789abcdef"
KEY_B = "device-key-b-0123456789abcdef"
ANALYST = "analyst-key-0123456789abcdef"
DEVICE_LABEL = ENVIRONMENT_LABELS["device"]
REPO = Path(__file__).resolve().parents[2]


def post_report(url: str, key: str) -> httpx.Response:
    """One report of the demo metric ``app.theme`` (GRR over 3 themes), sent with ``key``."""
    mechanism = make_mechanism(DEMO_METRICS["app.theme"].mechanism)
    payload = mechanism.to_payloads(mechanism.encode(np.array([1]), rng=None))[0]
    report = {"report_id": str(uuid.uuid4()), "metric": "app.theme", "version": 1}
    return httpx.post(
        f"{url}/v1/reports",
        json={"reports": [{**report, "payload": payload}]},
        headers={"Authorization": f"Bearer {key}"},
    )


@pytest.mark.slow
def test_a_key_removed_from_the_environment_is_revoked_at_restart(
    tmp_path: Path, start_server: Callable[..., Any]
) -> None:
    database = str(tmp_path / "keys.sqlite3")
    first = start_server(database, env={"LDP_DEVICE_KEYS": f"{KEY_A},{KEY_B}"})
    assert post_report(first.url, KEY_A).status_code == 200
    assert post_report(first.url, KEY_B).status_code == 200
    first.stop()

    second = start_server(database, env={"LDP_DEVICE_KEYS": KEY_B})
    refused = post_report(second.url, KEY_A)
    assert refused.status_code == 401, refused.text
    assert post_report(second.url, KEY_B).status_code == 200
    listed = httpx.get(f"{second.url}/v1/keys", headers=second.headers("admin"))
    by_label = {row["label"]: row for row in listed.json() if row["role"] == "device"}
    assert set(by_label) == {DEVICE_LABEL, DEVICE_LABEL + UNLISTED}
    assert by_label[DEVICE_LABEL + UNLISTED]["revoked_at"] is not None  # A
    assert by_label[DEVICE_LABEL]["revoked_at"] is None  # B
    second.stop()

    # Listed again, A is active again: the revocation was the start's own.
    third = start_server(database, env={"LDP_DEVICE_KEYS": f"{KEY_A},{KEY_B}"})
    assert post_report(third.url, KEY_A).status_code == 200
    rows = httpx.get(f"{third.url}/v1/keys", headers=third.headers("admin")).json()
    assert sorted(r["label"] for r in rows if r["role"] == "device") == [DEVICE_LABEL] * 2
    assert all(r["revoked_at"] is None for r in rows)


@pytest.fixture
def keys(tmp_path: Path) -> Iterator[tuple[KeyRing, KeysRepository]]:
    repositories = Repositories.open(str(tmp_path / "ring.sqlite3"))
    yield KeyRing(repositories.keys), repositories.keys
    repositories.close()


def rows_by_hash(storage: KeysRepository) -> dict[str, dict[str, Any]]:
    return {row["key_hash"]: row for row in storage.keys()}


def test_the_start_adds_revokes_and_restores_environment_keys(
    keys: tuple[KeyRing, KeysRepository],
) -> None:
    ring, storage = keys
    added = sync_environment_keys(ring, storage, {"LDP_DEVICE_KEYS": f" {KEY_A} ,{KEY_B},"})
    assert len(added.added) == 2 and not added.revoked and not added.refused
    assert ring.authenticate(KEY_A) is not None

    # The variable unset: every device key from it is revoked, the analyst one added.
    changes = sync_environment_keys(ring, storage, {"LDP_ANALYST_KEYS": ANALYST})
    assert sorted(changes.revoked) == sorted(added.added) and len(changes.added) == 1
    assert ring.authenticate(KEY_A) is None and ring.authenticate(KEY_B) is None
    assert rows_by_hash(storage)[hash_key(KEY_A)]["label"] == DEVICE_LABEL + UNLISTED

    # Listed again: the same rows, active under their first label.
    environment = {"LDP_DEVICE_KEYS": f"{KEY_A},{KEY_B}", "LDP_ANALYST_KEYS": ANALYST}
    restored = sync_environment_keys(ring, storage, environment)
    assert sorted(restored.restored) == sorted(added.added) and not restored.added
    assert ring.authenticate(KEY_A) is not None
    assert rows_by_hash(storage)[hash_key(KEY_A)]["label"] == DEVICE_LABEL
    assert len(storage.keys()) == 3

    # The same environment again changes nothing.
    before = storage.keys()
    assert sync_environment_keys(ring, storage, environment) == type(restored)()
    assert storage.keys() == before


def test_keys_from_the_api_and_revocations_by_an_admin_are_left_alone(
    keys: tuple[KeyRing, KeysRepository],
) -> None:
    ring, storage = keys
    created_id, created = ring.create("device", "phone")
    sync_environment_keys(ring, storage, {"LDP_DEVICE_KEYS": KEY_A})
    a_id = rows_by_hash(storage)[hash_key(KEY_A)]["key_id"]
    assert ring.revoke(a_id)  # an admin revokes A through the API

    # A still listed: it stays revoked, and the start says so (with its id, not the key).
    changes = sync_environment_keys(ring, storage, {"LDP_DEVICE_KEYS": KEY_A})
    assert not changes.restored and not changes.revoked
    assert len(changes.refused) == 1 and a_id in changes.refused[0]
    assert "LDP_DEVICE_KEYS" in changes.refused[0] and KEY_A not in changes.refused[0]
    assert ring.authenticate(KEY_A) is None

    # The API key, unlisted, is untouched; listed for another role it keeps its role.
    moved = sync_environment_keys(ring, storage, {"LDP_ADMIN_KEYS": created})
    assert not moved.revoked and len(moved.refused) == 1 and created_id in moved.refused[0]
    principal = ring.authenticate(created)
    assert principal is not None and principal.role == "device"


def test_a_key_listed_for_another_role_is_named_with_its_role(
    keys: tuple[KeyRing, KeysRepository],
) -> None:
    ring, storage = keys
    analyst_id, analyst = ring.create("analyst", "dashboard")
    changes = sync_environment_keys(ring, storage, {"LDP_DEVICE_KEYS": analyst})
    assert changes.refused == [
        f"a key listed in LDP_DEVICE_KEYS is stored as an analyst key (id {analyst_id}); "
        "a key keeps its role: list a new key"
    ]


@pytest.mark.parametrize(
    "environment, message",
    [
        ({"LDP_DEVICE_KEYS": "short"}, "LDP_DEVICE_KEYS: keys must have at least 16"),
        (
            {"LDP_DEVICE_KEYS": KEY_A, "LDP_ADMIN_KEYS": f"{KEY_B},{KEY_A}"},
            "listed in both LDP_DEVICE_KEYS and LDP_ADMIN_KEYS",
        ),
    ],
)
def test_a_bad_list_changes_nothing(
    keys: tuple[KeyRing, KeysRepository], environment: dict[str, str], message: str
) -> None:
    ring, storage = keys
    sync_environment_keys(ring, storage, {"LDP_DEVICE_KEYS": KEY_B})
    before = storage.keys()
    with pytest.raises(ValueError, match=message):
        sync_environment_keys(ring, storage, environment)
    assert storage.keys() == before  # B not revoked, nothing added


@pytest.mark.slow
def test_environment_labels_are_reserved(tmp_path: Path) -> None:
    app = create_app(Settings(database=str(tmp_path / "api.sqlite3"), compaction_interval=0))
    storage: KeysRepository = app.state.services.repositories.keys
    admin = "admin-key-0123456789abcdef"
    bootstrap_keys(app.state.keys, storage, {"LDP_ADMIN_KEYS": admin})
    before = storage.keys()
    with TestClient(app) as client:
        for label in (DEVICE_LABEL, ENVIRONMENT_LABELS["admin"] + UNLISTED):
            refused = client.post(
                "/v1/keys",
                json={"role": "device", "label": label},
                headers={"Authorization": f"Bearer {admin}"},
            )
            assert refused.status_code == 422
            assert refused.json()["errors"][0]["field"] == "label"
    assert storage.keys() == before
    command = [sys.executable, "-m", "aggregator.cli", "create-key", "--role", "device"]
    cli = subprocess.run(
        [*command, "--label", DEVICE_LABEL, "--database", str(tmp_path / "api.sqlite3")],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert cli.returncode == 2 and "reserved for keys from the environment" in cli.stderr
    assert storage.keys() == before
