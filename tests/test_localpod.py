"""localpod speaks RunPod's control plane, job API and worker protocol, and runs real workers.

In-process tests drive the app through `TestClient` (their endpoints have `workers.max = 0`, so no
process is started; where a worker is needed, the test plays one over the real worker routes).
The live tests start `python -m localpod` on a free port with a handler script that runs the real
`runpod.serverless` worker loop.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from fastapi.testclient import TestClient

from deployments.local_stack import require_worker_python
from localpod import LocalpodConfig, create_app
from localpod.models import DEFAULT_OPENAPI_PATH, DEFAULT_QUOTA_REFUSAL_TEXT, Account
from localpod.schema import OpenApiSchemas

API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
WORKER_AUTH = {"Authorization": API_KEY}  # what runpod's worker sends: the raw key
FORM = {"Content-Type": "application/x-www-form-urlencoded"}  # runpod posts JSON results as this
SCHEMAS = OpenApiSchemas.load(DEFAULT_OPENAPI_PATH)
REPO_ROOT = Path(__file__).resolve().parents[1]
QUOTA_TEXT = "Max workers across all endpoints must not exceed your workers quota (10)"

T = TypeVar("T")


def endpoint_body(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "name": "loraflow-test",
        "type": "QUEUE",
        "scaling": {"type": "QUEUE_DELAY", "queueDelay": 4},
        "image": "localpod/unused:latest",
        "gpu": {"pools": ["ADA_24"]},
        "workers": {"max": 0},
    }
    body.update(overrides)
    return body


def wait_for(condition: Callable[[], T], what: str, timeout: float = 60) -> T:
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)
    return value


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    config = LocalpodConfig(
        api_key=API_KEY,
        worker_quota=10,
        log_dir=tmp_path / "logs",
        long_poll_s=0.2,
        worker_command=[sys.executable, "-c", "raise SystemExit('in-process tests start no workers')"],
    )
    with TestClient(create_app(config)) as c:
        yield c


def create_endpoint(client: TestClient, **overrides: Any) -> dict[str, Any]:
    response = client.post("/v2/serverless", json=endpoint_body(**overrides), headers=AUTH)
    assert response.status_code == 201, response.text
    return response.json()


def run_job(client: TestClient, endpoint_id: str, body: dict[str, Any] | None = None) -> str:
    response = client.post(f"/v2/{endpoint_id}/run", json=body or {"input": {"x": 1}}, headers=AUTH)
    assert response.status_code == 200, response.text
    assert response.json()["status"] == "IN_QUEUE"
    return response.json()["id"]


def job_status(client: TestClient, endpoint_id: str, job_id: str) -> dict[str, Any]:
    response = client.get(f"/v2/{endpoint_id}/status/{job_id}", headers=AUTH)
    assert response.status_code == 200, response.text
    return response.json()


def take_job(client: TestClient, endpoint_id: str, worker_id: str = "handworker0001") -> dict[str, Any]:
    response = client.get(f"/v2/{endpoint_id}/job-take/{worker_id}?gpu=cpu&job_in_progress=0", headers=WORKER_AUTH)
    assert response.status_code == 200, response.text
    return response.json()


def post_done(
    client: TestClient, endpoint_id: str, job_id: str, payload: dict[str, Any], worker_id: str = "handworker0001"
) -> None:
    url = f"/v2/{endpoint_id}/job-done/{worker_id}/{job_id}?gpu=cpu&isStream=false"
    response = client.post(url, content=json.dumps(payload), headers={**WORKER_AUTH, **FORM})
    assert response.status_code == 200, response.text


def assert_problem(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    body = response.json()
    assert SCHEMAS.errors("ErrorResponse", body) == []
    assert body["status"] == status
    return body


# --- control plane ---------------------------------------------------------------------------------


def test_created_endpoint_is_an_endpoint_document_and_can_be_read_back(client: TestClient) -> None:
    created = create_endpoint(client, name="loraflow-abc")
    assert SCHEMAS.errors("Endpoint", created) == []
    assert created["name"] == "loraflow-abc"
    assert len(created["id"]) == 14 and created["id"].isalnum() and created["id"].islower()
    assert client.get(f"/v2/serverless/{created['id']}", headers=AUTH).json() == created


def test_list_holds_live_endpoints(client: TestClient) -> None:
    first, second = create_endpoint(client, name="one"), create_endpoint(client, name="two")
    listed = client.get("/v2/serverless", headers=AUTH).json()
    assert SCHEMAS.errors("ListEndpointsResponse", listed) == []
    assert {e["id"] for e in listed["endpoints"]} == {first["id"], second["id"]}


def test_defaults_are_runpods(client: TestClient) -> None:
    created = create_endpoint(client, workers={})
    assert created["workers"] == {"min": 0, "max": 3, "idleTimeout": 10}
    assert created["timeout"] == 300_000
    assert created["flashboot"] == "OFF"


def test_deleted_endpoint_is_absent(client: TestClient) -> None:
    endpoint_id = create_endpoint(client)["id"]
    assert client.delete(f"/v2/serverless/{endpoint_id}", headers=AUTH).status_code == 204
    assert_problem(client.get(f"/v2/serverless/{endpoint_id}", headers=AUTH), 404)
    assert client.get("/v2/serverless", headers=AUTH).json() == {"endpoints": []}


def test_deleting_twice_answers_404(client: TestClient) -> None:
    endpoint_id = create_endpoint(client)["id"]
    client.delete(f"/v2/serverless/{endpoint_id}", headers=AUTH)
    assert_problem(client.delete(f"/v2/serverless/{endpoint_id}", headers=AUTH), 404)


def test_unknown_field_is_rejected_by_name(client: TestClient) -> None:
    body = assert_problem(client.post("/v2/serverless", json=endpoint_body(bogus=1), headers=AUTH), 400)
    assert any("'bogus' was unexpected" in e and e.startswith("$") for e in body["errors"])


def test_missing_scaling_is_rejected(client: TestClient) -> None:
    body = endpoint_body()
    del body["scaling"]
    problem = assert_problem(client.post("/v2/serverless", json=body, headers=AUTH), 400)
    assert "$: 'scaling' is a required property" in problem["errors"]


def test_endpoint_needs_exactly_one_of_gpu_or_cpu(client: TestClient) -> None:
    both = endpoint_body(cpu=[{"id": "cpu5c", "vcpuCount": 4}])
    assert assert_problem(client.post("/v2/serverless", json=both, headers=AUTH), 400)["detail"] == (
        "specify exactly one of `gpu` or `cpu`"
    )


def test_quota_exceeded_on_create_gets_runpods_text(client: TestClient) -> None:
    create_endpoint(client, workers={"max": 8})
    problem = assert_problem(client.post("/v2/serverless", json=endpoint_body(workers={"max": 3}), headers=AUTH), 400)
    assert problem["detail"] == QUOTA_TEXT


def test_quota_refusal_can_come_as_rest_v1_did_a_500_with_its_error_body(tmp_path: Path) -> None:
    config = LocalpodConfig(api_key=API_KEY, worker_quota=1, quota_refusal_status=500, log_dir=tmp_path / "logs",
                            worker_command=[sys.executable, "-c", "raise SystemExit('no workers')"])
    with TestClient(create_app(config)) as pod:
        create_endpoint(pod, workers={"max": 1})
        response = pod.post("/v2/serverless", json=endpoint_body(workers={"max": 1}), headers=AUTH)
    assert response.status_code == 500
    assert response.json() == {"error": "create endpoint: graphql: Max workers across all endpoints must not exceed "
                                        "your workers quota (1)"}


def paged_localpod(tmp_path: Path, page_size: int) -> TestClient:
    config = LocalpodConfig(api_key=API_KEY, worker_quota=10, page_size=page_size, log_dir=tmp_path / "logs",
                            worker_command=[sys.executable, "-c", "raise SystemExit('no workers')"])
    return TestClient(create_app(config))


def test_lists_come_in_pages_that_follow_the_next_cursor(tmp_path: Path) -> None:
    with paged_localpod(tmp_path, page_size=2) as pod:
        ids = [create_endpoint(pod, name=f"e{n}")["id"] for n in range(5)]
        pages, cursor = [], None
        while True:
            answer = pod.get("/v2/serverless", params={"cursor": cursor} if cursor else None, headers=AUTH).json()
            assert SCHEMAS.errors("ListEndpointsResponse", answer) == []  # the schema allows `pagination`
            pages.append([e["id"] for e in answer["endpoints"]])
            cursor = answer.get("pagination", {}).get("nextCursor")
            if cursor is None:
                break
        assert pages == [ids[0:2], ids[2:4], ids[4:]]
        assert [e["id"] for e in pod.get("/v2/serverless", params={"limit": 1}, headers=AUTH).json()["endpoints"]] \
            == ids[:1]
        assert_problem(pod.get("/v2/serverless", params={"cursor": "soon"}, headers=AUTH), 400)


def test_volumes_and_secrets_are_paged_as_endpoints_are(tmp_path: Path) -> None:
    with paged_localpod(tmp_path, page_size=1) as pod:
        for n in range(2):
            assert pod.post("/v2/network-volumes", json={"name": f"v{n}", "size": 10, "dataCenter": "EU-RO-1"},
                            headers=AUTH).status_code == 201
            assert pod.post("/v2/account/secrets", json={"name": f"s{n}", "value": "x"}, headers=AUTH).status_code == 201
        volumes = pod.get("/v2/network-volumes", headers=AUTH).json()
        secrets = pod.get("/v2/account/secrets", headers=AUTH).json()
        assert SCHEMAS.errors("ListNetworkVolumesResponse", volumes) == []
        assert len(volumes["networkVolumes"]) == 1 and volumes["pagination"] == {"nextCursor": "1"}
        assert len(secrets["secrets"]) == 1 and secrets["pagination"] == {"nextCursor": "1"}
        last = pod.get("/v2/account/secrets", params={"cursor": "1"}, headers=AUTH).json()
        assert [s["name"] for s in last["secrets"]] == ["s1"] and "pagination" not in last


def test_answer_shapes_change_while_the_server_runs(client: TestClient) -> None:
    assert client.get("/_localpod/answer-shapes").json() == {
        "quota_refusal_status": 400, "quota_refusal_text": DEFAULT_QUOTA_REFUSAL_TEXT, "page_size": 1000}
    changed = client.post("/_localpod/answer-shapes", json={"quota_refusal_status": 500, "page_size": 1})
    assert changed.json() == {"quota_refusal_status": 500, "quota_refusal_text": DEFAULT_QUOTA_REFUSAL_TEXT,
                              "page_size": 1}
    create_endpoint(client, name="one", workers={"max": 10})
    create_endpoint(client, name="two")
    assert len(client.get("/v2/serverless", headers=AUTH).json()["endpoints"]) == 1
    refused = client.post("/v2/serverless", json=endpoint_body(workers={"max": 1}), headers=AUTH)
    assert refused.status_code == 500 and QUOTA_TEXT in refused.json()["error"]
    assert client.post("/_localpod/answer-shapes", json={"page_size": 0}).status_code == 400


def test_the_quota_refusal_can_come_in_runpods_other_wording(client: TestClient) -> None:
    other = "Max workers across all endpoints will exceed your worker quota of {quota}"
    assert client.post("/_localpod/answer-shapes", json={"quota_refusal_text": other}).status_code == 200
    create_endpoint(client, workers={"max": 10})
    problem = assert_problem(client.post("/v2/serverless", json=endpoint_body(workers={"max": 1}), headers=AUTH), 400)
    assert problem["detail"] == "Max workers across all endpoints will exceed your worker quota of 10"


def test_quota_exceeded_on_update_gets_runpods_text(client: TestClient) -> None:
    create_endpoint(client, workers={"max": 8})
    endpoint_id = create_endpoint(client, workers={"max": 1})["id"]
    response = client.patch(f"/v2/serverless/{endpoint_id}", json={"workers": {"max": 3}}, headers=AUTH)
    assert assert_problem(response, 400)["detail"] == QUOTA_TEXT


def test_deleting_frees_quota(client: TestClient) -> None:
    endpoint_id = create_endpoint(client, workers={"max": 10})["id"]
    client.delete(f"/v2/serverless/{endpoint_id}", headers=AUTH)
    create_endpoint(client, workers={"max": 10})


def test_update_changes_only_the_fields_sent(client: TestClient) -> None:
    created = create_endpoint(client, workers={"max": 1, "idleTimeout": 7})
    patch = {"name": "renamed", "workers": {"max": 2}}
    response = client.patch(f"/v2/serverless/{created['id']}", json=patch, headers=AUTH)
    assert response.status_code == 200, response.text
    updated = response.json()
    assert SCHEMAS.errors("Endpoint", updated) == []
    assert updated["name"] == "renamed"
    assert updated["workers"] == {"min": 0, "max": 2, "idleTimeout": 7}
    assert {k: v for k, v in updated.items() if k not in ("name", "workers")} == {
        k: v for k, v in created.items() if k not in ("name", "workers")
    }


def test_update_with_unknown_field_is_rejected(client: TestClient) -> None:
    endpoint_id = create_endpoint(client)["id"]
    problem = assert_problem(client.patch(f"/v2/serverless/{endpoint_id}", json={"bogus": 1}, headers=AUTH), 400)
    assert any("'bogus' was unexpected" in e for e in problem["errors"])


def test_missing_bearer_token_is_401(client: TestClient) -> None:
    response = client.get("/v2/serverless")
    assert_problem(response, 401)
    assert response.json() == {"title": "Unauthorized", "status": 401, "detail": "missing bearer token"}


def test_wrong_key_is_401(client: TestClient) -> None:
    assert_problem(client.get("/v2/serverless", headers={"Authorization": "Bearer nope"}), 401)
    endpoint_id = create_endpoint(client)["id"]
    wrong = {"Authorization": "Bearer nope"}
    assert_problem(client.post(f"/v2/{endpoint_id}/run", json={"input": {}}, headers=wrong), 401)


def test_serverless_routes_win_over_endpoint_routes(client: TestClient) -> None:
    # `/v2/serverless/health` is the endpoint named "health", not the health of an endpoint "serverless".
    problem = assert_problem(client.get("/v2/serverless/health", headers=AUTH), 404)
    assert problem["detail"] == "endpoint health not found"


# --- job API ---------------------------------------------------------------------------------------


def test_submitted_job_waits_in_queue(client: TestClient) -> None:
    endpoint_id = create_endpoint(client)["id"]
    job_id = run_job(client, endpoint_id)
    status = job_status(client, endpoint_id, job_id)
    assert status["id"] == job_id and status["status"] == "IN_QUEUE"
    assert status["executionTime"] == 0 and status["delayTime"] >= 0


def test_cancelling_a_queued_job(client: TestClient) -> None:
    endpoint_id = create_endpoint(client)["id"]
    job_id = run_job(client, endpoint_id)
    response = client.post(f"/v2/{endpoint_id}/cancel/{job_id}", headers=AUTH)
    assert response.json() == {"id": job_id, "status": "CANCELLED"}
    assert job_status(client, endpoint_id, job_id)["status"] == "CANCELLED"


def test_cancelling_a_finished_job_reports_its_final_status(client: TestClient) -> None:
    endpoint_id = create_endpoint(client)["id"]
    job_id = run_job(client, endpoint_id)
    take_job(client, endpoint_id)
    post_done(client, endpoint_id, job_id, {"output": {"ok": True}})
    assert client.post(f"/v2/{endpoint_id}/cancel/{job_id}", headers=AUTH).json()["status"] == "COMPLETED"


def test_health_counts_jobs_by_status(client: TestClient) -> None:
    endpoint_id = create_endpoint(client)["id"]
    done, running, _queued = (run_job(client, endpoint_id) for _ in range(3))
    take_job(client, endpoint_id, "handworker0001")
    post_done(client, endpoint_id, done, {"output": 1}, "handworker0001")
    assert take_job(client, endpoint_id, "handworker0002")["id"] == running
    health = client.get(f"/v2/{endpoint_id}/health", headers=AUTH).json()
    assert health["jobs"] == {"completed": 1, "failed": 0, "inProgress": 1, "inQueue": 1, "retried": 0}
    assert health["workers"]["running"] == 1 and health["workers"]["idle"] == 1


def test_purge_queue_cancels_only_queued_jobs(client: TestClient) -> None:
    endpoint_id = create_endpoint(client)["id"]
    running, queued = run_job(client, endpoint_id), run_job(client, endpoint_id)
    take_job(client, endpoint_id)
    assert client.post(f"/v2/{endpoint_id}/purge-queue", headers=AUTH).json() == {"removed": 1, "status": "completed"}
    assert job_status(client, endpoint_id, queued)["status"] == "CANCELLED"
    assert job_status(client, endpoint_id, running)["status"] == "IN_PROGRESS"


def test_retried_job_is_queued_again_and_counted(client: TestClient) -> None:
    endpoint_id = create_endpoint(client)["id"]
    job_id = run_job(client, endpoint_id)
    take_job(client, endpoint_id)
    post_done(client, endpoint_id, job_id, {"error": "flaky"})
    assert client.post(f"/v2/{endpoint_id}/retry/{job_id}", headers=AUTH).json() == {"id": job_id, "status": "IN_QUEUE"}
    assert take_job(client, endpoint_id)["id"] == job_id
    post_done(client, endpoint_id, job_id, {"output": "fine"})
    assert job_status(client, endpoint_id, job_id)["status"] == "COMPLETED"
    assert client.get(f"/v2/{endpoint_id}/health", headers=AUTH).json()["jobs"]["retried"] == 1


def test_only_failed_jobs_can_be_retried(client: TestClient) -> None:
    endpoint_id = create_endpoint(client)["id"]
    job_id = run_job(client, endpoint_id)
    assert_problem(client.post(f"/v2/{endpoint_id}/retry/{job_id}", headers=AUTH), 400)


def test_runsync_answers_the_unfinished_status_when_its_wait_ends(client: TestClient) -> None:
    endpoint_id = create_endpoint(client)["id"]
    response = client.post(f"/v2/{endpoint_id}/runsync?wait=1000", json={"input": {}}, headers=AUTH)
    assert response.status_code == 200 and response.json()["status"] == "IN_QUEUE"


def test_unknown_endpoint_and_job_are_404(client: TestClient) -> None:
    assert_problem(client.post("/v2/nosuchendpoint/run", json={"input": {}}, headers=AUTH), 404)
    assert_problem(client.get("/v2/nosuchendpoint/health", headers=AUTH), 404)
    endpoint_id = create_endpoint(client)["id"]
    assert_problem(client.get(f"/v2/{endpoint_id}/status/no-such-job", headers=AUTH), 404)


def test_run_without_input_is_400(client: TestClient) -> None:
    endpoint_id = create_endpoint(client)["id"]
    assert_problem(client.post(f"/v2/{endpoint_id}/run", json={"inputs": {}}, headers=AUTH), 400)


def test_job_past_its_execution_timeout_is_timed_out(client: TestClient) -> None:
    endpoint_id = create_endpoint(client)["id"]
    job_id = run_job(client, endpoint_id, {"input": {}, "policy": {"executionTimeout": 200}})
    take_job(client, endpoint_id)
    wait_for(lambda: job_status(client, endpoint_id, job_id)["status"] == "TIMED_OUT", "TIMED_OUT", timeout=10)


def test_endpoint_timeout_applies_without_a_policy(client: TestClient) -> None:
    endpoint_id = create_endpoint(client, timeout=200)["id"]
    job_id = run_job(client, endpoint_id)
    take_job(client, endpoint_id)
    wait_for(lambda: job_status(client, endpoint_id, job_id)["status"] == "TIMED_OUT", "TIMED_OUT", timeout=10)


def test_job_past_its_ttl_is_deleted(client: TestClient) -> None:
    endpoint_id = create_endpoint(client)["id"]
    job_id = run_job(client, endpoint_id, {"input": {}, "policy": {"ttl": 200}})
    url = f"/v2/{endpoint_id}/status/{job_id}"
    wait_for(lambda: client.get(url, headers=AUTH).status_code == 404, "the job to be deleted", timeout=10)
    [row] = Account.model_validate(client.get("/_localpod/account").json()).jobs
    assert row.expired and row.status == "FAILED"


# --- worker protocol (the test plays the worker) ---------------------------------------------------


def test_worker_takes_a_job_and_its_output_completes_it(client: TestClient) -> None:
    endpoint_id = create_endpoint(client)["id"]
    job_id = run_job(client, endpoint_id, {"input": {"prompt": "hi"}})
    assert take_job(client, endpoint_id) == {"id": job_id, "input": {"prompt": "hi"}}
    assert job_status(client, endpoint_id, job_id)["status"] == "IN_PROGRESS"
    post_done(client, endpoint_id, job_id, {"output": {"answer": 42}})
    status = job_status(client, endpoint_id, job_id)
    assert status["status"] == "COMPLETED" and status["output"] == {"answer": 42}
    assert status["workerId"] == "handworker0001"


def test_job_take_answers_204_when_nothing_is_queued(client: TestClient) -> None:
    endpoint_id = create_endpoint(client)["id"]
    response = client.get(f"/v2/{endpoint_id}/job-take/handworker0001?gpu=cpu&job_in_progress=0", headers=WORKER_AUTH)
    assert response.status_code == 204


def test_error_result_fails_the_job(client: TestClient) -> None:
    endpoint_id = create_endpoint(client)["id"]
    job_id = run_job(client, endpoint_id)
    take_job(client, endpoint_id)
    post_done(client, endpoint_id, job_id, {"error": "out of memory"})
    status = job_status(client, endpoint_id, job_id)
    assert status["status"] == "FAILED" and status["error"] == "out of memory"


def test_progress_shows_while_running_and_is_ignored_after_the_result(client: TestClient) -> None:
    endpoint_id = create_endpoint(client)["id"]
    job_id = run_job(client, endpoint_id)
    take_job(client, endpoint_id)
    post_done(client, endpoint_id, job_id, {"status": "IN_PROGRESS", "output": {"step": 3}})
    assert job_status(client, endpoint_id, job_id) | {"delayTime": 0, "executionTime": 0} == {
        "id": job_id, "status": "IN_PROGRESS", "output": {"step": 3}, "workerId": "handworker0001",
        "delayTime": 0, "executionTime": 0,
    }
    post_done(client, endpoint_id, job_id, {"output": {"final": True}})
    post_done(client, endpoint_id, job_id, {"status": "IN_PROGRESS", "output": {"step": 4}})
    status = job_status(client, endpoint_id, job_id)
    assert status["status"] == "COMPLETED" and status["output"] == {"final": True}


def test_cancelling_a_running_job_signals_its_worker(client: TestClient) -> None:
    endpoint_id = create_endpoint(client)["id"]
    job_id = run_job(client, endpoint_id)
    take_job(client, endpoint_id)
    client.post(f"/v2/{endpoint_id}/cancel/{job_id}", headers=AUTH)
    response = client.get(f"/v2/{endpoint_id}/job-stop/handworker0001?gpu=cpu", headers=WORKER_AUTH)
    assert response.status_code == 200 and response.json() == {"jobsToStop": [job_id]}


def test_a_stop_is_resent_until_the_worker_is_free(client: TestClient) -> None:
    # runpod 1.12 drops a stop that arrives before the job's task exists, so one delivery is not enough.
    endpoint_id = create_endpoint(client)["id"]
    job_id = run_job(client, endpoint_id)
    take_job(client, endpoint_id)
    client.post(f"/v2/{endpoint_id}/cancel/{job_id}", headers=AUTH)
    stop_url = f"/v2/{endpoint_id}/job-stop/handworker0001?gpu=cpu"
    assert client.get(stop_url, headers=WORKER_AUTH).json() == {"jobsToStop": [job_id]}
    wait_for(lambda: client.get(stop_url, headers=WORKER_AUTH).status_code == 200, "the stop to be re-sent", timeout=10)
    response = client.get(f"/v2/{endpoint_id}/job-take/handworker0001?gpu=cpu&job_in_progress=0", headers=WORKER_AUTH)
    assert response.status_code == 204
    assert client.get(stop_url, headers=WORKER_AUTH).status_code == 204


def test_streamed_chunks_are_read_once(client: TestClient) -> None:
    endpoint_id = create_endpoint(client)["id"]
    job_id = run_job(client, endpoint_id)
    take_job(client, endpoint_id)
    for chunk in ("a", "b"):
        url = f"/v2/{endpoint_id}/job-stream/handworker0001/{job_id}?gpu=cpu&isStream=true"
        response = client.post(url, content=json.dumps({"output": chunk}), headers={**WORKER_AUTH, **FORM})
        assert response.status_code == 200
    stream_url = f"/v2/{endpoint_id}/stream/{job_id}"
    assert client.get(stream_url, headers=AUTH).json()["stream"] == [{"output": "a"}, {"output": "b"}]
    assert client.get(stream_url, headers=AUTH).json()["stream"] == []


def test_result_with_stop_pod_retires_the_worker(client: TestClient) -> None:
    endpoint_id = create_endpoint(client)["id"]
    job_id = run_job(client, endpoint_id)
    take_job(client, endpoint_id)
    post_done(client, endpoint_id, job_id, {"output": 1, "stopPod": True})
    [worker] = Account.model_validate(client.get("/_localpod/account").json()).workers
    assert worker.ended_at is not None


def test_worker_with_a_wrong_key_is_401(client: TestClient) -> None:
    endpoint_id = create_endpoint(client)["id"]
    response = client.get(f"/v2/{endpoint_id}/job-take/someworker?gpu=cpu", headers={"Authorization": "nope"})
    assert_problem(response, 401)


def test_webhook_receives_the_final_status(client: TestClient) -> None:
    received: list[dict[str, Any]] = []

    class Recorder(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
            received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    with HTTPServer(("127.0.0.1", 0), Recorder) as hook:
        thread = threading.Thread(target=hook.serve_forever, daemon=True)
        thread.start()
        try:
            endpoint_id = create_endpoint(client)["id"]
            webhook = f"http://127.0.0.1:{hook.server_address[1]}/done"
            job_id = run_job(client, endpoint_id, {"input": {}, "webhook": webhook})
            take_job(client, endpoint_id)
            post_done(client, endpoint_id, job_id, {"output": {"adapter": "ok"}})
            wait_for(lambda: received, "the webhook call", timeout=10)
        finally:
            hook.shutdown()
    assert received[0]["id"] == job_id and received[0]["status"] == "COMPLETED"
    assert received[0]["output"] == {"adapter": "ok"}


def failed_job_error(config: LocalpodConfig) -> str:
    """The error of a job queued on a new one-worker endpoint of a server with `config`, once it has FAILED."""
    with TestClient(create_app(config)) as client:
        endpoint_id = create_endpoint(client, workers={"max": 1})["id"]
        job_id = run_job(client, endpoint_id)
        status = wait_for(
            lambda: (s := job_status(client, endpoint_id, job_id))["status"] == "FAILED" and s, "FAILED", timeout=10
        )
    return status["error"]


def test_a_worker_command_that_cannot_start_fails_the_queued_jobs(tmp_path: Path) -> None:
    config = LocalpodConfig(api_key=API_KEY, log_dir=tmp_path, worker_command=[str(tmp_path / "no-such-program")])
    error = failed_job_error(config)
    assert "could not start worker" in error and "no-such-program" in error


# --- account ---------------------------------------------------------------------------------------


def test_account_keeps_peaks_and_deleted_endpoints(client: TestClient) -> None:
    first = create_endpoint(client, workers={"max": 2})["id"]
    create_endpoint(client, workers={"max": 3})
    client.delete(f"/v2/serverless/{first}", headers=AUTH)
    create_endpoint(client, workers={"max": 1})
    account = Account.model_validate(client.get("/_localpod/account").json())
    assert account.peak_live_endpoints == 2 and account.peak_workers_max == 5
    assert len(account.live_endpoints) == 2 and len(account.endpoints) == 3
    assert [e.id for e in account.endpoints if e.deleted_at is not None] == [first]
    assert account.workers_spawned == 0 and account.billed_worker_seconds == 0


# --- a live server running real runpod workers -----------------------------------------------------

HANDLER = '''
import asyncio, os, pathlib, time
import runpod

async def handler(job):
    job_input = job["input"]
    mode = job_input.get("mode", "echo")
    if mode == "raise":
        raise ValueError("handler exploded on purpose")
    if mode == "progress":
        runpod.serverless.progress_update(job, {"step": 1})
        flag = pathlib.Path(job_input["flag"])
        while not flag.exists():
            await asyncio.sleep(0.05)
        return {"done": True}
    if mode == "sleep":  # cancellable: the worker stops it through job-stop
        await asyncio.sleep(job_input["seconds"])
        return {"slept": True}
    if mode == "block":  # like a training step: blocks the worker loop, only a kill ends it
        time.sleep(job_input["seconds"])
        return {"blocked": True}
    if mode == "exit":  # with `once` (a file that does not exist yet): only the first worker to take the job exits
        once = job_input.get("once")
        if once is None or not pathlib.Path(once).exists():
            if once is not None:
                pathlib.Path(once).touch()
            print("last words before exit", flush=True)
            os._exit(7)
        return {"survived": True, "worker": os.environ["RUNPOD_POD_ID"]}
    return {"echo": job_input}

runpod.serverless.start({"handler": handler})
'''


@dataclass
class LiveServer:
    http: httpx.Client
    process: subprocess.Popen[bytes]
    tmp: Path
    stdout: Path

    def endpoint(self, **workers: int) -> str:
        body = endpoint_body(workers={"max": 1, "idleTimeout": 1, **workers})
        response = self.http.post("/v2/serverless", json=body)
        assert response.status_code == 201, response.text
        return response.json()["id"]

    def run(self, endpoint_id: str, job_input: dict[str, Any], **policy: int) -> str:
        body: dict[str, Any] = {"input": job_input} | ({"policy": policy} if policy else {})
        return self.http.post(f"/v2/{endpoint_id}/run", json=body).raise_for_status().json()["id"]

    def status(self, endpoint_id: str, job_id: str) -> dict[str, Any]:
        return self.http.get(f"/v2/{endpoint_id}/status/{job_id}").raise_for_status().json()

    def wait_status(self, endpoint_id: str, job_id: str, wanted: str) -> dict[str, Any]:
        return wait_for(
            lambda: (s := self.status(endpoint_id, job_id))["status"] == wanted and s, f"job {job_id} {wanted}"
        )

    def account(self) -> Account:
        return Account.model_validate(self.http.get("/_localpod/account").raise_for_status().json())

    def workers_of(self, endpoint_id: str) -> list[Any]:
        return [w for w in self.account().workers if w.endpoint_id == endpoint_id]


def launch_localpod(tmp: Path, handler: str, *, kill_grace: float, long_poll: float
                    ) -> tuple[httpx.Client, subprocess.Popen[bytes], Path]:
    """Start `python -m localpod` whose workers run `handler` (a script's source) with the worker
    environment's interpreter (the control plane's has no `runpod`); returns once it announces where it
    listens: (an authenticated client, the process, its output file)."""
    script = tmp / "handler.py"
    script.write_text(handler)
    runtime = ["--worker-command", shlex.join([str(require_worker_python()), str(script)])]
    return start_localpod(tmp, runtime, kill_grace=kill_grace, long_poll=long_poll)


def start_localpod(tmp: Path, runtime_args: list[str], *, kill_grace: float, long_poll: float,
                   env: dict[str, str] | None = None, timeout_s: float = 30
                   ) -> tuple[httpx.Client, subprocess.Popen[bytes], Path]:
    """Start `python -m localpod` with `runtime_args` (how it runs workers) on a free port; returns once it
    announces where it listens: (an authenticated client, the process, its output file)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    stdout = tmp / "localpod.out"
    command = [
        sys.executable, "-m", "localpod", "--host", "127.0.0.1", "--port", str(port), "--api-key", API_KEY,
        *runtime_args, "--log-dir", str(tmp / "logs"), "--kill-grace", str(kill_grace), "--long-poll", str(long_poll),
    ]  # fmt: skip
    with open(stdout, "wb") as out:
        process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT,
                                   env=os.environ if env is None else env)
    http = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=AUTH, timeout=10)

    def announced() -> bool:
        if process.poll() is not None:
            raise AssertionError(f"localpod exited: {stdout.read_text()}")
        return "localpod listening on" in stdout.read_text()

    try:
        wait_for(announced, "localpod to announce it listens", timeout=timeout_s)
    except BaseException:
        stop_localpod(http, process)
        raise
    return http, process, stdout


def stop_localpod(http: httpx.Client, process: subprocess.Popen[bytes]) -> None:
    http.close()
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def start_server(tmp: Path) -> LiveServer:
    # runpod 1.10 (the image's lock) takes a few seconds to wind down after a SIGTERM on a loaded machine.
    http, process, stdout = launch_localpod(tmp, HANDLER, kill_grace=5, long_poll=2)
    return LiveServer(http, process, tmp, stdout)


def stop_server(server: LiveServer) -> None:
    stop_localpod(server.http, server.process)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    server = start_server(tmp_path_factory.mktemp("localpod"))
    try:
        yield server
    finally:
        stop_server(server)


def test_server_answers_once_it_announces_where_it_listens(live: LiveServer) -> None:
    assert f"localpod listening on {live.http.base_url}".rstrip("/") in live.stdout.read_text()
    assert live.http.get("/v2/serverless").status_code == 200


def test_real_worker_echoes_its_input(live: LiveServer) -> None:
    endpoint_id = live.endpoint()
    job_id = live.run(endpoint_id, {"greeting": "hello"})
    status = live.wait_status(endpoint_id, job_id, "COMPLETED")
    assert status["output"] == {"echo": {"greeting": "hello"}}
    assert status["workerId"] == live.workers_of(endpoint_id)[0].id


def test_a_cpu_endpoints_real_worker_runs_its_job_in_a_datacenter_offering_its_flavor(live: LiveServer) -> None:
    body = endpoint_body(cpu=[{"id": "cpu3c", "vcpuCount": 2}], dataCenterIds=["EU-RO-1"],
                         workers={"max": 1, "idleTimeout": 1})
    del body["gpu"]
    endpoint_id = live.http.post("/v2/serverless", json=body).raise_for_status().json()["id"]
    status = live.wait_status(endpoint_id, live.run(endpoint_id, {"on": "cpu"}), "COMPLETED")
    assert status["output"] == {"echo": {"on": "cpu"}}
    [worker] = live.workers_of(endpoint_id)
    assert worker.placement is not None
    assert (worker.placement.data_center_id, worker.placement.cpu_flavor_id) == ("EU-RO-1", "cpu3c")


def test_runsync_returns_the_real_workers_result(live: LiveServer) -> None:
    endpoint_id = live.endpoint()
    response = live.http.post(f"/v2/{endpoint_id}/runsync", json={"input": {"n": 1}}, timeout=70)
    assert response.json()["status"] == "COMPLETED" and response.json()["output"] == {"echo": {"n": 1}}


def test_idle_real_worker_is_stopped_after_idle_timeout(live: LiveServer) -> None:
    endpoint_id = live.endpoint()
    live.wait_status(endpoint_id, live.run(endpoint_id, {}), "COMPLETED")
    [worker] = wait_for(lambda: [w for w in live.workers_of(endpoint_id) if w.ended_at], "the idle worker to stop")
    assert worker.exit_code == 0  # a SIGTERM the runpod loop handled: a clean exit
    assert not pid_alive(worker.pid or 0)


def test_raising_handler_fails_the_job_with_its_error(live: LiveServer) -> None:
    endpoint_id = live.endpoint()
    status = live.wait_status(endpoint_id, live.run(endpoint_id, {"mode": "raise"}), "FAILED")
    assert json.loads(status["error"])["error_message"] == "handler exploded on purpose"


def test_progress_update_shows_in_status_until_the_result(live: LiveServer) -> None:
    endpoint_id = live.endpoint()
    flag = live.tmp / "progress-may-finish"
    job_id = live.run(endpoint_id, {"mode": "progress", "flag": str(flag)})
    running = live.wait_status(endpoint_id, job_id, "IN_PROGRESS")
    wait_for(lambda: live.status(endpoint_id, job_id).get("output") == {"step": 1}, "the progress update")
    assert running["workerId"]
    flag.touch()
    assert live.wait_status(endpoint_id, job_id, "COMPLETED")["output"] == {"done": True}


def test_cancel_stops_the_running_handler_and_frees_the_worker(live: LiveServer) -> None:
    endpoint_id = live.endpoint()
    sleeper = live.run(endpoint_id, {"mode": "sleep", "seconds": 120})
    live.wait_status(endpoint_id, sleeper, "IN_PROGRESS")
    assert live.http.post(f"/v2/{endpoint_id}/cancel/{sleeper}").json()["status"] == "CANCELLED"
    started = time.monotonic()
    follower = live.wait_status(endpoint_id, live.run(endpoint_id, {"after": "cancel"}), "COMPLETED")
    # workers.max is 1: the same worker ran the next job, long before the cancelled one could end.
    assert follower["workerId"] == live.status(endpoint_id, sleeper)["workerId"]
    assert time.monotonic() - started < 60 and len(live.workers_of(endpoint_id)) == 1


def test_a_worker_exiting_mid_job_hands_the_job_back_to_the_queue_for_another_worker(live: LiveServer) -> None:
    endpoint_id = live.endpoint()
    job_id = live.run(endpoint_id, {"mode": "exit", "once": str(live.tmp / f"exited-{uuid.uuid4().hex}")})
    status = live.wait_status(endpoint_id, job_id, "COMPLETED")
    first, second = live.workers_of(endpoint_id)[:2]
    assert first.exit_code == 7 and status["output"] == {"survived": True, "worker": second.id}
    assert live.http.get(f"/v2/{endpoint_id}/health").json()["jobs"]["retried"] == 1


def test_execution_timeout_times_out_and_kills_a_blocked_worker(live: LiveServer) -> None:
    endpoint_id = live.endpoint()
    job_id = live.run(endpoint_id, {"mode": "block", "seconds": 120}, executionTimeout=1000)
    live.wait_status(endpoint_id, job_id, "TIMED_OUT")
    [worker] = wait_for(lambda: [w for w in live.workers_of(endpoint_id) if w.ended_at], "the worker to be killed")
    assert not pid_alive(worker.pid or 0)


def test_deleting_an_endpoint_stops_its_worker_and_cancels_its_job(live: LiveServer) -> None:
    endpoint_id = live.endpoint()
    job_id = live.run(endpoint_id, {"mode": "block", "seconds": 120})
    live.wait_status(endpoint_id, job_id, "IN_PROGRESS")
    [worker] = live.workers_of(endpoint_id)
    assert worker.pid and pid_alive(worker.pid)
    assert live.http.delete(f"/v2/serverless/{endpoint_id}").status_code == 204
    wait_for(lambda: not pid_alive(worker.pid or 0), "the worker process to be gone", timeout=30)
    assert [j.status for j in live.account().jobs if j.id == job_id] == ["CANCELLED"]


def test_server_shutdown_stops_all_workers(tmp_path: Path) -> None:
    server = start_server(tmp_path)
    try:
        endpoint_id = server.endpoint()
        server.wait_status(endpoint_id, server.run(endpoint_id, {"mode": "block", "seconds": 120}), "IN_PROGRESS")
        [worker] = server.workers_of(endpoint_id)
    finally:
        stop_server(server)
    assert server.process.returncode in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it handled
    assert "stopping worker" in server.stdout.read_text() and "Traceback" not in server.stdout.read_text()
    assert not pid_alive(worker.pid or 0)


OFFICIAL_SCHEMA_SHA256 = "b8bce61c5a2290d28a7cb2ed53173637166817249986cb18b101b2fd651fd313"
"""sha256 of RunPod's official api-v2-openapi.json as the project received it (shared/runpod-api/)."""


def test_shipped_openapi_copy_is_the_unedited_official_schema():
    import hashlib
    from pathlib import Path

    from localpod.models import DEFAULT_OPENAPI_PATH

    shipped = DEFAULT_OPENAPI_PATH.read_bytes()
    assert hashlib.sha256(shipped).hexdigest() == OFFICIAL_SCHEMA_SHA256
    official = Path(__file__).resolve().parents[2] / "shared" / "runpod-api" / "api-v2-openapi.json"
    if official.exists():  # beside a developer checkout and in CI
        assert shipped == official.read_bytes()


def test_the_answer_shapes_come_from_the_environment_and_a_bad_one_is_refused_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from localpod.__main__ import _parser, config_from_args, main

    monkeypatch.setenv("LOCALPOD_PAGE_SIZE", "2")
    monkeypatch.setenv("LOCALPOD_QUOTA_REFUSAL_STATUS", "500")
    monkeypatch.setenv("LOCALPOD_QUOTA_REFUSAL_TEXT", "Max workers will exceed your worker quota of {quota}")
    argv = ["--log-dir", str(tmp_path), "--worker-command", "python3 handler.py", "--port", "1"]
    parser = _parser()
    config = config_from_args(parser.parse_args(argv), parser)
    assert (config.page_size, config.quota_refusal_status) == (2, 500)
    assert config.quota_refusal_text == "Max workers will exceed your worker quota of {quota}"
    monkeypatch.setenv("LOCALPOD_PAGE_SIZE", "0")
    with pytest.raises(SystemExit):
        main(argv)
    assert "page_size: Input should be greater than or equal to 1" in capsys.readouterr().err
