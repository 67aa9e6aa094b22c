"""Values reach workers through RunPod account secrets, one per distinct value: localpod's
`/v2/account/secrets` (modelled on RunPod's API v2 reference), its resolution when a worker boots, and
loraflow's side (`tasks/runpod/secrets.py`): per-value secrets that are never rotated, named by an HMAC of the value
keyed per namespace (`tasks/lifecycle/secret_key.py`), and the pruning of a namespace's unused ones."""

from __future__ import annotations

import hashlib
import secrets
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from localpod import LocalpodConfig, create_app
from localpod.routes.secrets import resolve_secret_references
from localpod.workers.supervisor import WorkerSupervisor
from tasks.runpod.client import RunpodClient
from tasks.runpod.secrets import (
    LONGEST_RUN,
    MAX_SECRET_NAME,
    fingerprint,
    parse_secret_name,
    prune_unused_secrets,
    referenced_secrets,
    secret_reference,
    value_secret_env,
    value_secret_name,
)
from tests.test_localpod import API_KEY, AUTH, create_endpoint

TOKEN = "hf_secretvalue123"
ALICE, BOB = "hf_alice_token_000111", "hf_bob_token_222333"
KEY = b"0123456789abcdef0123456789abcdef"
"""The namespace `ns1`'s key, in the tests that do not read it from its Prefect block."""


@pytest.fixture
def localpod(tmp_path: Path) -> Iterator[TestClient]:
    config = LocalpodConfig(api_key=API_KEY, worker_quota=10, log_dir=tmp_path / "logs", long_poll_s=0.2,
                            worker_command=[sys.executable, "-c", "raise SystemExit('no workers here')"])
    with TestClient(create_app(config)) as c:
        yield c


@pytest.fixture
def runpod(localpod: TestClient) -> RunpodClient:
    """loraflow's client, talking to the in-process localpod."""

    def forward(request: httpx.Request) -> httpx.Response:
        answer = localpod.request(request.method, request.url.path, content=request.content, headers=request.headers)
        return httpx.Response(answer.status_code, headers=answer.headers, content=answer.content)

    return RunpodClient(API_KEY, api_url="http://localpod/v2", transport=httpx.MockTransport(forward))


def create(localpod: TestClient, **body) -> httpx.Response:
    return localpod.post("/v2/account/secrets", json=body, headers=AUTH)


def test_a_created_secret_is_answered_without_its_value(localpod):
    answer = create(localpod, name="hf-token", value=TOKEN, description="Hugging Face read token")
    assert answer.status_code == 201
    assert set(answer.json()) == {"id", "name", "description", "createdAt", "valueLastUpdatedAt"}
    listed = localpod.get("/v2/account/secrets", headers=AUTH)
    assert TOKEN not in listed.text and [s["name"] for s in listed.json()["secrets"]] == ["hf-token"]
    assert TOKEN not in localpod.get(f"/v2/account/secrets/{answer.json()['id']}", headers=AUTH).text


@pytest.mark.parametrize(("body", "field"), [
    ({"name": "RUNPOD_TOKEN", "value": "x"}, "$.name"),
    ({"name": "9lives", "value": "x"}, "$.name"),
    ({"name": "has space", "value": "x"}, "$.name"),
    ({"name": "ok", "value": ""}, "$.value"),
    ({"name": "ok", "value": "x", "owner": "me"}, "$.owner"),
])
def test_secrets_runpod_would_refuse_are_refused_naming_the_field(localpod, body, field):
    answer = create(localpod, **body)
    assert answer.status_code == 400
    assert any(error.startswith(field) for error in answer.json()["errors"]), answer.json()


def test_a_second_secret_of_the_same_name_is_a_conflict(localpod):
    assert create(localpod, name="hf-token", value="a").status_code == 201
    assert create(localpod, name="hf-token", value="b").status_code == 409


def test_a_secret_can_be_rotated_and_deleted(localpod):
    secret = create(localpod, name="hf-token", value="a").json()
    rotated = localpod.patch(f"/v2/account/secrets/{secret['id']}", json={"value": "b"}, headers=AUTH)
    assert rotated.status_code == 200 and rotated.json()["valueLastUpdatedAt"] >= secret["valueLastUpdatedAt"]
    assert localpod.delete(f"/v2/account/secrets/{secret['id']}", headers=AUTH).status_code == 204
    assert localpod.get(f"/v2/account/secrets/{secret['id']}", headers=AUTH).status_code == 404


def test_secret_references_are_replaced_and_unknown_names_reported():
    env, missing = resolve_secret_references(
        {"HF_TOKEN": "{{ RUNPOD_SECRET_hf-token }}", "BOTH": "{{RUNPOD_SECRET_a}}:{{ RUNPOD_SECRET_gone }}", "PLAIN": "x"},
        {"hf-token": TOKEN, "a": "1"})
    assert env == {"HF_TOKEN": TOKEN, "BOTH": "1:", "PLAIN": "x"}
    assert missing == ["gone"]


def test_a_booting_worker_gets_the_value_the_endpoint_only_refers_to(localpod):
    create(localpod, name="hf-token", value=TOKEN)
    endpoint = create_endpoint(localpod, env={"HF_TOKEN": secret_reference("hf-token")})
    assert TOKEN not in localpod.get(f"/v2/serverless/{endpoint['id']}", headers=AUTH).text
    state = localpod.app.state.localpod
    env = WorkerSupervisor(state).runpod_env(state.endpoints[endpoint["id"]], "worker1", "worker-key")
    assert env["HF_TOKEN"] == TOKEN


def booted_env(localpod: TestClient, endpoint: dict) -> dict[str, str]:
    """The env a worker of `endpoint` boots with, secrets filled in as RunPod fills them."""
    state = localpod.app.state.localpod
    return WorkerSupervisor(state).runpod_env(state.endpoints[endpoint["id"]], "w", "k")


def hub_env(runpod: RunpodClient, token: str, namespace: str = "ns1", key: bytes = KEY) -> dict[str, str]:
    return value_secret_env(runpod, "HF_TOKEN", token, purpose="hf-token", namespace=namespace, key=key)


def stored_values(localpod: TestClient) -> dict[str, str]:
    return {s.name: s.value for s in localpod.app.state.localpod.secrets.values()}


def test_two_values_are_two_secrets_and_neither_is_rotated(runpod, localpod):
    alice, bob = hub_env(runpod, ALICE), hub_env(runpod, BOB)
    assert alice != bob
    # Alice's endpoint booting after Bob stored his token still gets hers.
    alice_endpoint = create_endpoint(localpod, name="loraflow-alice", env=alice)
    hub_env(runpod, BOB)
    assert booted_env(localpod, alice_endpoint)["HF_TOKEN"] == ALICE
    assert booted_env(localpod, create_endpoint(localpod, name="loraflow-bob", env=bob))["HF_TOKEN"] == BOB
    assert sorted(stored_values(localpod).values()) == [ALICE, BOB]
    assert all(s.value_updated_at == s.created_at for s in localpod.app.state.localpod.secrets.values())


def test_the_same_value_reuses_its_secret(runpod, localpod):
    first, again = hub_env(runpod, TOKEN), hub_env(runpod, TOKEN)
    assert first == again and list(stored_values(localpod).values()) == [TOKEN]


def test_a_secret_created_meanwhile_by_another_run_is_reused(runpod, localpod):
    name = value_secret_name("hf-token", "ns1", TOKEN, key=KEY)
    create(localpod, name=name, value=TOKEN)  # another process won the race
    assert hub_env(runpod, TOKEN) == {"HF_TOKEN": secret_reference(name)}
    assert list(stored_values(localpod)) == [name]


def test_the_env_refers_to_the_value_and_never_holds_it(runpod, localpod):
    env = hub_env(runpod, TOKEN)
    create_endpoint(localpod, name="loraflow-t", env=env)
    assert TOKEN not in localpod.get("/v2/serverless", headers=AUTH).text
    assert TOKEN not in localpod.get("/v2/account/secrets", headers=AUTH).text


@pytest.mark.parametrize("purpose", ["hf-token", "env-judge-key", "x"])
def test_secret_names_are_ones_runpod_accepts_and_say_whose_they_are(localpod, purpose):
    name = value_secret_name(purpose, "ab12cd34", "some value", key=KEY)
    assert create(localpod, name=name, value="some value").status_code == 201
    parsed = parse_secret_name(name)
    assert parsed is not None and (parsed.purpose, parsed.namespace) == (purpose, "ab12cd34")
    assert parsed.fingerprint is not None and parsed.fingerprint in name and "some value" not in name


@pytest.mark.parametrize(("purpose", "namespace"), [("HF_TOKEN", "ns1"), ("a" * MAX_SECRET_NAME, "ns1"),
                                                    ("hf-token", "NS1")])
def test_a_name_runpod_would_refuse_is_never_asked_for(purpose, namespace):
    with pytest.raises(ValueError, match="purpose|namespace"):
        value_secret_name(purpose, namespace, TOKEN, key=KEY)


def test_names_loraflow_did_not_make_are_not_its_secrets():
    assert parse_secret_name("hf-token") is None
    assert parse_secret_name("loraflow-hf-token-ns1-notafingerprint") is None
    # The single rotated secret of before is still recognised, so that pruning can remove it.
    assert parse_secret_name("loraflow-hf-token-ns1") == ("hf-token", "ns1", None)


def test_the_fingerprint_is_not_the_values_plain_sha256():
    name = value_secret_name("hf-token", "ns1", TOKEN, key=KEY)
    assert hashlib.sha256(TOKEN.encode()).hexdigest()[:16] not in name
    assert parse_secret_name(name).fingerprint == fingerprint(TOKEN, KEY)


def test_the_same_value_under_two_keys_has_two_fingerprints():
    assert fingerprint(TOKEN, KEY) != fingerprint(TOKEN, KEY[::-1])


def test_the_secrets_an_env_refers_to_are_read_back():
    assert referenced_secrets({"A": "{{ RUNPOD_SECRET_x-1 }}", "B": "{{RUNPOD_SECRET_y}}:{{ RUNPOD_SECRET_z }}",
                               "C": "plain"}) == {"x-1", "y", "z"}


# Pruning. `now` is set past a secret's creation instead of ageing the secret.

def later(days: float) -> datetime:
    return datetime.now(UTC) + timedelta(days=days)


def prune(runpod: RunpodClient, *, now: datetime, retain_days: float = 14, last_used=None, **kwargs):
    verdicts = prune_unused_secrets(runpod, "ns1", retain_days=retain_days, now=now, last_used=last_used or {},
                                    **kwargs)
    return {v.name: v.action for v in verdicts}


def test_an_unused_secret_older_than_the_retention_is_deleted(runpod, localpod):
    name = referenced_secrets(hub_env(runpod, TOKEN)).pop()
    assert prune(runpod, now=later(15)) == {name: "deleted"}
    assert stored_values(localpod) == {}


def test_a_secret_used_within_the_retention_is_kept(runpod):
    name = referenced_secrets(hub_env(runpod, TOKEN)).pop()
    assert prune(runpod, now=later(30), last_used={name: later(20)}) == {name: "kept"}
    assert prune(runpod, now=later(10)) == {name: "kept"}


def test_a_secret_an_endpoint_refers_to_is_never_pruned(runpod, localpod):
    env = hub_env(runpod, TOKEN)
    create_endpoint(localpod, name="someone-elses-endpoint", env={"OTHER": "x", **env})
    assert prune(runpod, now=later(365), retain_days=0) == {referenced_secrets(env).pop(): "kept"}
    assert list(stored_values(localpod).values()) == [TOKEN]


def test_another_namespaces_secrets_and_other_names_are_never_pruned(runpod, localpod):
    hub_env(runpod, TOKEN, namespace="other")
    create(localpod, name="made-in-console", value="x")
    assert prune(runpod, now=later(365), retain_days=0) == {}
    assert len(stored_values(localpod)) == 2


def test_a_retention_shorter_than_a_run_still_keeps_a_secret_a_live_run_may_refer_to_again(runpod):
    name = referenced_secrets(hub_env(runpod, TOKEN)).pop()
    assert LONGEST_RUN >= timedelta(days=7)
    assert prune(runpod, now=later(3), retain_days=0) == {name: "kept"}
    assert prune(runpod, now=later(8), retain_days=0) == {name: "deleted"}


def test_a_dry_run_deletes_nothing(runpod, localpod):
    name = referenced_secrets(hub_env(runpod, TOKEN)).pop()
    assert prune(runpod, now=later(15), dry_run=True) == {name: "would delete"}
    assert name in stored_values(localpod)


def test_the_rotated_secret_of_before_is_pruned_once_unused(runpod, localpod):
    create(localpod, name="loraflow-hf-token-ns1", value=TOKEN)
    assert prune(runpod, now=later(15)) == {"loraflow-hf-token-ns1": "deleted"}


def test_a_secret_named_before_the_keyed_fingerprint_is_recognised_and_pruned_once_unused(runpod, localpod):
    before = f"loraflow-hf-token-ns1-{hashlib.sha256(TOKEN.encode()).hexdigest()[:16]}"
    create(localpod, name=before, value=TOKEN)
    now_named = referenced_secrets(hub_env(runpod, TOKEN)).pop()  # the same value, named anew
    assert parse_secret_name(before) == ("hf-token", "ns1", hashlib.sha256(TOKEN.encode()).hexdigest()[:16])
    assert now_named != before
    assert prune(runpod, now=later(15), last_used={now_named: later(14)}) == {before: "deleted", now_named: "kept"}


# The key of a namespace's names: a Prefect Secret block, made once.

def fresh_namespace() -> str:
    """A namespace no other test (nor an earlier session on the same server) has used."""
    return "k" + secrets.token_hex(3)


def test_the_same_value_in_two_namespaces_has_two_fingerprints(local_stack):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from tasks.lifecycle.secret_key import secret_name_key

    first, second = fresh_namespace(), fresh_namespace()
    with temporary_settings({PREFECT_API_URL: local_stack.prefect_api_url}):
        names = [value_secret_name("hf-token", ns, TOKEN, key=secret_name_key(ns)) for ns in (first, second)]
    assert parse_secret_name(names[0]).fingerprint != parse_secret_name(names[1]).fingerprint


def test_a_namespaces_key_block_is_made_once_and_then_reused(local_stack):
    from prefect.blocks.system import Secret
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from tasks.lifecycle.secret_key import key_block_name, secret_name_key

    namespace = fresh_namespace()
    with temporary_settings({PREFECT_API_URL: local_stack.prefect_api_url}):
        key = secret_name_key(namespace)
        assert secret_name_key(namespace) == key
        assert Secret.load(key_block_name(namespace)).get().encode() == key
    assert len(key) == 64 and bytes.fromhex(key.decode())


def test_a_runs_checkpoint_key_is_its_own_and_the_same_for_every_attempt():
    # The worker resumes only from checkpoints signed with it: a teammate who can write the store cannot make one.
    from tasks.lifecycle.secret_key import run_checkpoint_key

    namespace_key = secrets.token_hex(32).encode()
    key = run_checkpoint_key(namespace_key, "run-a")
    assert run_checkpoint_key(namespace_key, "run-a") == key and len(key) == 64 and bytes.fromhex(key)
    assert run_checkpoint_key(namespace_key, "run-b") != key
    assert run_checkpoint_key(secrets.token_hex(32).encode(), "run-a") != key


def test_a_key_block_that_exists_is_never_replaced(local_stack):
    from prefect.blocks.system import Secret
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from tasks.lifecycle.secret_key import key_block_name, secret_name_key

    namespace, chosen = fresh_namespace(), "an-operators-own-key-of-40-characters-00"
    with temporary_settings({PREFECT_API_URL: local_stack.prefect_api_url}):
        Secret(value=chosen).save(key_block_name(namespace))
        assert secret_name_key(namespace) == chosen.encode()


def test_callers_racing_to_make_the_key_all_read_back_the_same_one(local_stack):
    from concurrent.futures import ThreadPoolExecutor

    from prefect.settings import PREFECT_API_URL, temporary_settings

    from tasks.lifecycle.secret_key import secret_name_key

    namespace = fresh_namespace()

    def read_key(_: int) -> bytes:
        # Prefect's settings are a context variable, which a pool's thread does not inherit: each sets its own.
        with temporary_settings({PREFECT_API_URL: local_stack.prefect_api_url}):
            return secret_name_key(namespace)

    with ThreadPoolExecutor(4) as pool:
        keys = set(pool.map(read_key, range(4)))
    assert len(keys) == 1


def test_a_key_block_too_short_to_be_a_key_is_refused_naming_it(local_stack):
    from prefect.blocks.system import Secret
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from tasks.lifecycle.secret_key import key_block_name, secret_name_key

    namespace = fresh_namespace()
    with temporary_settings({PREFECT_API_URL: local_stack.prefect_api_url}):
        Secret(value="short").save(key_block_name(namespace))
        with pytest.raises(RuntimeError, match=rf"the Prefect Secret block 'loraflow-secret-key-{namespace}' must hold "
                                               r"a key of at least 32 characters \(it holds 5 characters\): delete"):
            secret_name_key(namespace)


def test_a_run_named_token_block_wins_and_a_missing_one_is_refused_naming_the_field(local_stack, monkeypatch):
    from prefect.blocks.system import Secret
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from tasks.settings import HubTokenError, Settings

    monkeypatch.setenv("HF_TOKEN", BOB)
    with temporary_settings({PREFECT_API_URL: local_stack.prefect_api_url}):
        Secret(value=ALICE).save("test-alice-hub-token", overwrite=True)
        assert Settings().hub_token("test-alice-hub-token") == ALICE
        assert Settings().hub_token() == BOB
        with pytest.raises(HubTokenError, match=r"hub_token_secret: the Prefect Secret block 'test-nobody' cannot be read"):
            Settings().hub_token("test-nobody")


def test_the_hub_token_can_come_from_a_prefect_secret_block(local_stack, monkeypatch):
    from prefect.blocks.system import Secret
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from tasks.settings import Settings

    monkeypatch.delenv("HF_TOKEN", raising=False)
    with temporary_settings({PREFECT_API_URL: local_stack.prefect_api_url}):
        assert Settings(hf_token_block="test-hub-token-missing").hub_token() is None
        Secret(value=TOKEN).save("test-hub-token", overwrite=True)
        settings = Settings(hf_token_block="test-hub-token")
        assert settings.hub_token() == TOKEN
        assert settings.with_hub_token().hf_token.get_secret_value() == TOKEN


def test_a_runs_concurrent_reads_of_a_block_ask_once_and_another_run_asks_again(monkeypatch):
    from tasks.settings import read_once_per_run

    asked: list[str] = []

    def read() -> str:
        asked.append("read")
        time.sleep(0.1)  # the run's other checks ask meanwhile
        return f"token {len(asked)}"

    monkeypatch.setenv("PREFECT__FLOW_RUN_ID", str(uuid.uuid4()))  # what prefect.runtime reads in a run's process
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: read_once_per_run("block test-run-reads", read), range(4)))
    assert answers == ["token 1"] * 4 and asked == ["read"]
    monkeypatch.setenv("PREFECT__FLOW_RUN_ID", str(uuid.uuid4()))
    assert read_once_per_run("block test-run-reads", read) == "token 2"


def test_a_failed_read_is_asked_again_and_outside_a_run_every_read_asks(monkeypatch):
    from tasks.settings import read_once_per_run

    answers = iter([RuntimeError("the server is down"), "token"])

    def read() -> str:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setenv("PREFECT__FLOW_RUN_ID", str(uuid.uuid4()))
    with pytest.raises(RuntimeError, match="the server is down"):
        read_once_per_run("block test-failed-read", read)
    assert read_once_per_run("block test-failed-read", read) == "token"
    monkeypatch.delenv("PREFECT__FLOW_RUN_ID")
    outside: list[str] = []
    for _ in range(2):
        read_once_per_run("block test-no-run", lambda: outside.append("read"))
    assert outside == ["read", "read"]
