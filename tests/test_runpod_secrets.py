"""The Hub token reaches workers through a RunPod account secret: localpod's `/v2/account/secrets`
(modelled on RunPod's API v2 reference), its resolution when a worker boots, and loraflow's side."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from localpod import LocalpodConfig, create_app
from localpod.routes_secrets import resolve_secret_references
from localpod.workers import WorkerSupervisor
from tasks.runpod.client import RunpodClient
from tasks.runpod.secrets import ensure_secret, find_secret, hub_token_env, secret_reference
from tests.test_localpod import API_KEY, AUTH, create_endpoint

TOKEN = "hf_secretvalue123"


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


def test_ensure_secret_creates_it_once_and_leaves_an_unchanged_token_alone(runpod):
    first = ensure_secret(runpod, "loraflow-hf-token-ns1", TOKEN)
    again = ensure_secret(runpod, "loraflow-hf-token-ns1", TOKEN)
    assert again.id == first.id and again.description == first.description
    assert TOKEN not in (first.description or "")


def test_ensure_secret_rotates_the_value_when_the_token_changed(runpod, localpod):
    first = ensure_secret(runpod, "loraflow-hf-token-ns1", TOKEN)
    rotated = ensure_secret(runpod, "loraflow-hf-token-ns1", "hf_newtoken456")
    assert rotated.id == first.id and rotated.description != first.description
    assert localpod.app.state.localpod.secrets[first.id].value == "hf_newtoken456"


def test_without_a_token_here_an_existing_secret_is_used_and_none_is_made(runpod):
    assert hub_token_env(runpod, "made-in-console", None) == {}
    assert find_secret(runpod, "made-in-console") is None
    ensure_secret(runpod, "made-in-console", TOKEN)
    assert hub_token_env(runpod, "made-in-console", None) == {"HF_TOKEN": "{{ RUNPOD_SECRET_made-in-console }}"}


def test_the_worker_env_refers_to_the_token_and_never_holds_it(runpod, localpod):
    env = hub_token_env(runpod, "loraflow-hf-token-ns1", TOKEN)
    assert env == {"HF_TOKEN": "{{ RUNPOD_SECRET_loraflow-hf-token-ns1 }}"}
    endpoint = create_endpoint(localpod, env=env)
    assert TOKEN not in localpod.get("/v2/serverless", headers=AUTH).text
    state = localpod.app.state.localpod
    assert WorkerSupervisor(state).runpod_env(state.endpoints[endpoint["id"]], "w", "k")["HF_TOKEN"] == TOKEN


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
