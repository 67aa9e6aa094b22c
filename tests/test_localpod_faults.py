"""Fault injection in localpod: route faults as an HTTP client meets them, worker faults on real
`runpod.serverless` workers, and GPU pools kept out of stock.

One `python -m localpod` server serves the whole module; every test names its endpoints with its
own prefix, and the faults, stock and endpoints it leaves are cleared after it.
"""

from __future__ import annotations

import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from localpod.models import Account
from tests.test_localpod import endpoint_body, launch_localpod, pid_alive, stop_localpod, wait_for

HANDLER = '''
import asyncio, os
import runpod

async def handler(job):
    job_input = job["input"]
    if job_input.get("mode") == "env":
        return {"fault": os.environ.get("LORAFLOW_TEST_FAULT")}
    for step in range(1, job_input.get("steps", 2) + 1):
        runpod.serverless.progress_update(job, {"step": step})
        await asyncio.sleep(job_input.get("step_s", 0.5))
    return {"done": True, "worker": os.environ["RUNPOD_POD_ID"]}

runpod.serverless.start({"handler": handler})
'''

SPARE_POOL = "AMPERE_80"  # the pool the stock test takes out; other tests use ADA_24


@dataclass
class Pod:
    http: httpx.Client
    process: subprocess.Popen[bytes]
    stdout: Path

    def endpoint(self, name: str, **overrides: Any) -> str:
        response = self.http.post("/v2/serverless", json=endpoint_body(name=name, **overrides))
        assert response.status_code == 201, response.text
        return response.json()["id"]

    def worker_endpoint(self, name: str, **overrides: Any) -> str:
        return self.endpoint(name, workers={"max": 1, "idleTimeout": 1}, **overrides)

    def run(self, endpoint_id: str, job_input: dict[str, Any]) -> str:
        return self.http.post(f"/v2/{endpoint_id}/run", json={"input": job_input}).raise_for_status().json()["id"]

    def status(self, endpoint_id: str, job_id: str) -> dict[str, Any]:
        return self.http.get(f"/v2/{endpoint_id}/status/{job_id}").raise_for_status().json()

    def wait_status(self, endpoint_id: str, job_id: str, wanted: str) -> dict[str, Any]:
        return wait_for(
            lambda: (s := self.status(endpoint_id, job_id))["status"] == wanted and s, f"job {job_id} {wanted}"
        )

    def add_fault(self, path: str, **rule: Any) -> dict[str, Any]:
        response = self.http.post(f"/_localpod/{path}", json=rule)
        assert response.status_code == 201, response.text
        return response.json()

    def account(self) -> Account:
        return Account.model_validate(self.http.get("/_localpod/account").raise_for_status().json())

    def workers_of(self, endpoint_id: str) -> list[Any]:
        return [w for w in self.account().workers if w.endpoint_id == endpoint_id]


@pytest.fixture(scope="module")
def pod(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pod]:
    http, process, stdout = launch_localpod(tmp_path_factory.mktemp("localpod-faults"), HANDLER, kill_grace=1, long_poll=1)
    try:
        yield Pod(http, process, stdout)
    finally:
        stop_localpod(http, process)


@pytest.fixture(autouse=True)
def clean_pod(pod: Pod) -> Iterator[None]:
    yield
    pod.http.delete("/_localpod/faults").raise_for_status()
    pod.http.delete("/_localpod/worker-faults").raise_for_status()
    pod.http.post("/_localpod/stock", json={"pool": SPARE_POOL, "available": True}).raise_for_status()
    for endpoint in pod.account().live_endpoints:
        pod.http.delete(f"/v2/serverless/{endpoint.id}")


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def process_state(pid: int) -> str:
    """The one-letter state in /proc/PID/stat: R, S, T (stopped), Z ..."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0]


# --- route faults, as the client meets them --------------------------------------------------------


def test_429_carries_retry_after_and_creates_nothing(pod: Pod) -> None:
    name = unique("rate")
    pod.add_fault("faults", route="create_endpoint", action="status_429", retry_after_s=7, endpoint_name_prefix=name)
    response = pod.http.post("/v2/serverless", json=endpoint_body(name=name))
    assert response.status_code == 429 and response.headers["retry-after"] == "7"
    assert response.headers["content-type"].startswith("application/problem+json")
    assert [e.name for e in pod.account().live_endpoints if e.name == name] == []


def test_500_answers_a_problem_and_leaves_the_endpoint_alone(pod: Pod) -> None:
    name = unique("five")
    endpoint_id = pod.endpoint(name)
    pod.add_fault("faults", route="delete_endpoint", action="status_500", endpoint_name_prefix=name)
    response = pod.http.delete(f"/v2/serverless/{endpoint_id}")
    assert response.status_code == 500 and response.json()["status"] == 500
    assert pod.http.get(f"/v2/serverless/{endpoint_id}").status_code == 200


def test_400_refuses_a_create_as_invalid_and_creates_nothing(pod: Pod) -> None:
    name = unique("four")
    pod.add_fault("faults", route="create_endpoint", action="status_400", endpoint_name_prefix=name)
    response = pod.http.post("/v2/serverless", json=endpoint_body(name=name))
    assert response.status_code == 400 and response.json()["status"] == 400
    assert response.headers["content-type"].startswith("application/problem+json")
    assert [e.name for e in pod.account().live_endpoints if e.name == name] == []
    assert pod.http.post("/v2/serverless", json=endpoint_body(name=name)).status_code == 201  # once: times=1


def test_answer_answers_the_status_and_body_given_and_creates_nothing(pod: Pod) -> None:
    # The quota refusal as REST v1 answered it: a 500 whose body carries RunPod's text.
    name = unique("answer")
    body = {"error": "create endpoint: graphql: Max workers across all endpoints must not exceed your workers quota"}
    pod.add_fault("faults", route="create_endpoint", action="answer", status_code=500, answer_body=body,
                  endpoint_name_prefix=name, times=2)
    answers = [pod.http.post("/v2/serverless", json=endpoint_body(name=name)) for _ in range(2)]
    assert [(a.status_code, a.json()) for a in answers] == [(500, body)] * 2
    assert [e.name for e in pod.account().live_endpoints if e.name == name] == []
    assert pod.http.post("/v2/serverless", json=endpoint_body(name=name)).status_code == 201  # times=2 spent


def test_answer_without_a_body_answers_an_error_response_with_the_status(pod: Pod) -> None:
    name = unique("answer-plain")
    endpoint_id = pod.endpoint(name)
    pod.add_fault("faults", route="get_endpoint", action="answer", status_code=503, endpoint_name_prefix=name)
    response = pod.http.get(f"/v2/serverless/{endpoint_id}")
    assert response.status_code == 503 and response.json()["status"] == 503
    assert response.headers["content-type"].startswith("application/problem+json")


def test_create_patched_makes_an_endpoint_unlike_the_request_and_answers_it(pod: Pod) -> None:
    name = unique("patched")
    pod.add_fault("faults", route="create_endpoint", action="create_patched", create_patch={"workers": {"max": 2}},
                  endpoint_name_prefix=name)
    made = pod.http.post("/v2/serverless", json=endpoint_body(name=name, workers={"max": 1}))
    assert made.status_code == 201, made.text
    assert made.json()["workers"]["max"] == 2  # asked 1
    assert pod.http.get(f"/v2/serverless/{made.json()['id']}").json()["workers"]["max"] == 2
    again = pod.http.post("/v2/serverless", json=endpoint_body(name=name + "-b", workers={"max": 1}))
    assert again.json()["workers"]["max"] == 1  # once: times=1


def test_drop_is_a_transport_error_for_the_client(pod: Pod) -> None:
    endpoint_id = pod.endpoint(unique("drop"))
    job_id = pod.run(endpoint_id, {})
    pod.add_fault("faults", route="status", action="drop")
    with pytest.raises(httpx.RemoteProtocolError):
        pod.http.get(f"/v2/{endpoint_id}/status/{job_id}")
    assert pod.status(endpoint_id, job_id)["status"] == "IN_QUEUE"


def test_hang_with_hang_s_answers_normally_after_the_wait(pod: Pod) -> None:
    endpoint_id = pod.endpoint(unique("slow"))
    pod.add_fault("faults", route="get_endpoint", action="hang", hang_s=1.0)
    started = time.monotonic()
    response = pod.http.get(f"/v2/serverless/{endpoint_id}")
    assert response.status_code == 200 and response.json()["id"] == endpoint_id
    assert time.monotonic() - started >= 1.0


def test_a_held_request_is_answered_as_the_other_rules_say(pod: Pod) -> None:
    # A slow RunPod (the batch's background noise) must not skip a scenario's answer queued behind it.
    endpoint_id = pod.endpoint(unique("slow-then"))
    pod.add_fault("faults", route="get_endpoint", action="hang", hang_s=0.2, times=1)
    pod.add_fault("faults", route="get_endpoint", action="status_500", times=1)
    started = time.monotonic()
    assert pod.http.get(f"/v2/serverless/{endpoint_id}").status_code == 500
    assert time.monotonic() - started >= 0.2
    assert pod.http.get(f"/v2/serverless/{endpoint_id}").status_code == 200


def test_hang_without_hang_s_runs_into_the_client_timeout_and_queues_nothing(pod: Pod) -> None:
    endpoint_id = pod.endpoint(unique("stuck"))
    pod.add_fault("faults", route="run", action="hang")
    with pytest.raises(httpx.ReadTimeout):
        pod.http.post(f"/v2/{endpoint_id}/run", json={"input": {}}, timeout=0.5)
    assert pod.http.get(f"/v2/{endpoint_id}/health").json()["jobs"]["inQueue"] == 0


def test_act_then_500_creates_the_endpoint_but_answers_500(pod: Pod) -> None:
    name = unique("ambiguous")
    pod.add_fault("faults", route="create_endpoint", action="act_then_500", endpoint_name_prefix=name)
    assert pod.http.post("/v2/serverless", json=endpoint_body(name=name)).status_code == 500
    listed = pod.http.get("/v2/serverless").json()["endpoints"]
    assert [e["name"] for e in listed if e["name"] == name] == [name]


def test_probability_with_a_seed_gives_the_same_faults_on_every_run(pod: Pod) -> None:
    name = unique("dice")
    endpoint_id = pod.endpoint(name)

    def one_run() -> list[int]:
        rule = pod.add_fault(
            "faults", route="health", action="status_500", probability=0.5, seed=1234, endpoint_name_prefix=name
        )
        codes = [pod.http.get(f"/v2/{endpoint_id}/health").status_code for _ in range(16)]
        assert pod.http.delete(f"/_localpod/faults/{rule['id']}").status_code == 204
        return codes

    first, second = one_run(), one_run()
    assert first == second
    assert set(first) == {200, 500}


def test_times_n_faults_the_next_n_requests_then_answers_normally(pod: Pod) -> None:
    name = unique("twice")
    endpoint_id = pod.endpoint(name)
    rule = pod.add_fault("faults", route="run", action="status_500", times=2, endpoint_name_prefix=name)
    codes = [pod.http.post(f"/v2/{endpoint_id}/run", json={"input": {}}).status_code for _ in range(4)]
    assert codes == [500, 500, 200, 200]
    [listed] = [f for f in pod.http.get("/_localpod/faults").json() if f["id"] == rule["id"]]
    assert listed["hits"] == 2 and listed["remaining"] == 0


def test_a_name_prefix_limits_a_rule_to_matching_endpoints(pod: Pod) -> None:
    hit, spared = pod.endpoint(unique("aim")), pod.endpoint(unique("spare"))
    pod.add_fault("faults", route="get_endpoint", action="status_500", probability=1.0, endpoint_name_prefix="aim-")
    assert pod.http.get(f"/v2/serverless/{spared}").status_code == 200
    assert pod.http.get(f"/v2/serverless/{hit}").status_code == 500


def test_a_datacenter_limits_a_volume_create_rule_to_creates_there(pod: Pod) -> None:
    pod.add_fault("faults", route="create_network_volume", action="status_500", probability=1.0,
                  data_center_id="US-CA-2")
    refused = pod.http.post("/v2/network-volumes", json={"name": unique("vol"), "size": 10, "dataCenter": "US-CA-2"})
    created = pod.http.post("/v2/network-volumes", json={"name": unique("vol"), "size": 10, "dataCenter": "EU-RO-1"})
    assert (refused.status_code, created.status_code) == (500, 201)
    pod.http.delete(f"/v2/network-volumes/{created.json()['id']}").raise_for_status()


def test_rules_are_listed_with_ids_and_removed_one_by_one_or_all(pod: Pod) -> None:
    first = pod.add_fault("faults", route="cancel", action="status_500")
    second = pod.add_fault("faults", route="patch_endpoint", action="drop", times=3)
    assert first["times"] == 1 and first["hits"] == 0 and first["remaining"] == 1
    assert [f["id"] for f in pod.http.get("/_localpod/faults").json()] == [first["id"], second["id"]]
    assert pod.http.delete(f"/_localpod/faults/{first['id']}").status_code == 204
    assert pod.http.delete(f"/_localpod/faults/{first['id']}").status_code == 404
    assert pod.http.delete("/_localpod/faults").status_code == 204
    assert pod.http.get("/_localpod/faults").json() == []


@pytest.mark.parametrize(
    ("path", "rule", "complaint"),
    [
        ("faults", {"route": "run", "action": "status_500", "retry_after_s": 3}, "retry_after_s applies to status_429"),
        ("faults", {"route": "runsync", "action": "status_500"}, "$.body.route"),
        ("faults", {"route": "list_endpoints", "action": "drop", "endpoint_name_prefix": "x"}, "names no endpoint"),
        ("faults", {"route": "get_endpoint", "action": "drop", "data_center_id": "EU-RO-1"}, "create_network_volume only"),
        ("faults", {"route": "status", "action": "answer"}, "answer needs status_code"),
        ("faults", {"route": "status", "action": "status_500", "status_code": 500}, "answer needs status_code"),
        ("faults", {"route": "status", "action": "drop", "answer_body": {}}, "answer_body applies to answer only"),
        ("faults", {"route": "run", "action": "create_patched", "create_patch": {"workers": {"max": 2}}},
         "create_patched applies to the create_endpoint route"),
        ("faults", {"route": "create_endpoint", "action": "create_patched"}, "needs create_patch"),
        ("worker-faults", {"action": "env"}, "env needs `env`"),
        ("worker-faults", {"action": "crash", "times": 0}, "$.body.times"),
        ("worker-faults", {"action": "crash", "at_step": 2, "after_s": 1}, "give after_s or at_step, not both"),
        ("worker-faults", {"action": "preempt", "dead_worker_jobs": "requeue"}, "dead_worker_jobs applies to crash"),
        ("worker-faults", {"action": "env", "env": {"A": "1"}, "at_step": 2}, "not to env"),
    ],
)
def test_inconsistent_rules_are_refused_with_the_reason(pod: Pod, path: str, rule: dict, complaint: str) -> None:
    response = pod.http.post(f"/_localpod/{path}", json=rule)
    assert response.status_code == 400
    assert any(complaint in error for error in response.json()["errors"]), response.json()


def test_account_counts_injected_faults_by_kind(pod: Pod) -> None:
    before = pod.account().faults_injected
    pod.add_fault("faults", route="list_endpoints", action="status_429", times=2)
    assert [pod.http.get("/v2/serverless").status_code for _ in range(3)] == [429, 429, 200]
    after = pod.account().faults_injected
    assert set(after) == {
        "status_429", "status_500", "status_400", "hang", "drop", "act_then_500", "unknown_status", "create_as_gpu",
        "answer", "create_patched", "worker_crash", "worker_hang", "worker_preempt", "worker_env",
    }  # fmt: skip
    assert {k: after[k] - before[k] for k in after if after[k] != before[k]} == {"status_429": 2}


# --- worker faults, on real runpod workers ---------------------------------------------------------


def test_a_crash_that_fails_its_job_says_the_worker_exited_without_a_result(pod: Pod) -> None:
    name = unique("crash")
    endpoint_id = pod.worker_endpoint(name)
    rule = pod.add_fault("worker-faults", action="crash", endpoint_name_prefix=name, dead_worker_jobs="fail")
    job_id = pod.run(endpoint_id, {"steps": 3, "step_s": 1.0})
    error = pod.wait_status(endpoint_id, job_id, "FAILED")["error"]
    assert f"exited with code {-signal.SIGKILL} without a result" in error and "last lines of its log" in error
    [listed] = pod.http.get("/_localpod/worker-faults").json()
    assert listed["id"] == rule["id"] and listed["hits"] == 1 and listed["remaining"] == 0
    assert pod.account().faults_injected["worker_crash"] >= 1


def test_a_crashed_workers_job_goes_back_to_the_queue_and_another_worker_completes_it(pod: Pod) -> None:
    name = unique("requeue")
    endpoint_id = pod.worker_endpoint(name)
    pod.add_fault("worker-faults", action="crash", endpoint_name_prefix=name)  # the server's default: requeue
    job_id = pod.run(endpoint_id, {"steps": 2, "step_s": 0.5})
    final = pod.wait_status(endpoint_id, job_id, "COMPLETED")
    first, second = pod.workers_of(endpoint_id)
    assert first.exit_code == -signal.SIGKILL and final["output"]["worker"] == second.id
    health = pod.http.get(f"/v2/{endpoint_id}/health").json()
    assert health["jobs"]["retried"] == 1 and health["jobs"]["failed"] == 0


def test_a_fault_at_a_step_fires_once_the_jobs_progress_reports_that_step(pod: Pod) -> None:
    name = unique("atstep")
    endpoint_id = pod.worker_endpoint(name)
    pod.add_fault("worker-faults", action="crash", at_step=3, endpoint_name_prefix=name, dead_worker_jobs="fail")
    job_id = pod.run(endpoint_id, {"steps": 4, "step_s": 0.5})
    seen: list[Any] = []

    def failed() -> bool:
        status = pod.status(endpoint_id, job_id)
        seen.append(status.get("output"))
        return status["status"] == "FAILED"

    wait_for(failed, "the job to fail at step 3")
    assert {"step": 3} in seen and {"step": 4} not in seen



def test_hang_stops_the_worker_until_its_endpoint_is_deleted(pod: Pod) -> None:
    name = unique("freeze")
    endpoint_id = pod.worker_endpoint(name)
    pod.add_fault("worker-faults", action="hang", endpoint_name_prefix=name)
    job_id = pod.run(endpoint_id, {"steps": 2, "step_s": 1.0})
    pid = wait_for(lambda: [w.pid for w in pod.workers_of(endpoint_id) if w.pid], "the worker to start")[0]
    wait_for(lambda: process_state(pid) == "T", "the worker to be stopped")
    billed_before = pod.account().billed_worker_seconds
    # Unstopped, the handler would report step 2 one second after step 1, and finish a second later.
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:
        status = pod.status(endpoint_id, job_id)
        assert status["status"] == "IN_PROGRESS" and status["output"] == {"step": 1}
        time.sleep(0.1)
    account = pod.account()
    assert account.billed_worker_seconds >= billed_before + 1.0  # a stopped worker still bills
    assert [e.name for e in account.live_endpoints if e.id == endpoint_id] == [name]
    assert pod.http.delete(f"/v2/serverless/{endpoint_id}").status_code == 204
    wait_for(lambda: not pid_alive(pid), "the stopped worker to be gone", timeout=15)
    assert [j.status for j in pod.account().jobs if j.id == job_id] == ["CANCELLED"]


def test_preempt_kills_the_worker_and_requeues_the_job_for_a_new_one(pod: Pod) -> None:
    name = unique("preempt")
    endpoint_id = pod.worker_endpoint(name)
    pod.add_fault("worker-faults", action="preempt", after_s=0.3, endpoint_name_prefix=name)
    job_id = pod.run(endpoint_id, {"steps": 2, "step_s": 0.3})
    seen: list[str] = []

    def completed() -> dict[str, Any] | None:
        status = pod.status(endpoint_id, job_id)
        if not seen or seen[-1] != status["status"]:
            seen.append(status["status"])
        return status if status["status"] == "COMPLETED" else None

    final = wait_for(completed, "the requeued job to complete")
    assert seen[seen.index("IN_PROGRESS") :] == ["IN_PROGRESS", "IN_QUEUE", "IN_PROGRESS", "COMPLETED"]
    first, second = pod.workers_of(endpoint_id)
    assert first.exit_code == -signal.SIGKILL
    assert final["workerId"] == second.id and final["output"]["worker"] == second.id


def test_env_reaches_only_the_next_worker_of_matching_endpoints(pod: Pod) -> None:
    name = unique("envy")
    matching, other = pod.worker_endpoint(name), pod.worker_endpoint(unique("plain"))
    pod.add_fault("worker-faults", action="env", env={"LORAFLOW_TEST_FAULT": "oom"}, endpoint_name_prefix=name)
    jobs = {endpoint_id: pod.run(endpoint_id, {"mode": "env"}) for endpoint_id in (matching, other)}
    outputs = {e: pod.wait_status(e, job_id, "COMPLETED")["output"] for e, job_id in jobs.items()}
    assert outputs == {matching: {"fault": "oom"}, other: {"fault": None}}
    [listed] = pod.http.get("/_localpod/worker-faults").json()
    assert listed["hits"] == 1 and listed["remaining"] == 0


# --- stock -----------------------------------------------------------------------------------------


def test_an_out_of_stock_pool_keeps_jobs_queued_without_workers_until_restocked(pod: Pod) -> None:
    stock = pod.http.post("/_localpod/stock", json={"pool": SPARE_POOL, "available": False}).json()
    assert stock == {"out_of_stock": [SPARE_POOL]}
    starved = pod.worker_endpoint(unique("starved"), gpu={"pools": [SPARE_POOL]})
    fallback = pod.worker_endpoint(unique("fallback"), gpu={"pools": [SPARE_POOL, "ADA_24"]})
    queued = pod.run(starved, {"mode": "env"})
    # The endpoint with a pool in stock gets a worker and finishes: the supervisor had its chances.
    pod.wait_status(fallback, pod.run(fallback, {"mode": "env"}), "COMPLETED")
    assert pod.status(starved, queued)["status"] == "IN_QUEUE"
    assert pod.workers_of(starved) == []
    assert pod.http.get(f"/v2/{starved}/health").json()["workers"]["throttled"] == 1
    assert pod.account().out_of_stock_pools == [SPARE_POOL]
    assert pod.http.post("/_localpod/stock", json={"pool": SPARE_POOL, "available": True}).json() == {
        "out_of_stock": []
    }
    pod.wait_status(starved, queued, "COMPLETED")
    assert len(pod.workers_of(starved)) == 1



# --- a dead worker's job: the server's mode --------------------------------------------------------


def test_a_dead_workers_job_is_requeued_unless_the_command_line_or_environment_says_fail(monkeypatch, tmp_path) -> None:
    from tests.test_localpod_docker import parse

    monkeypatch.delenv("LOCALPOD_DEAD_WORKER_JOBS", raising=False)
    base = ("--worker-command", "true", "--log-dir", str(tmp_path))
    assert parse(*base).dead_worker_jobs == "requeue"
    assert parse(*base, "--dead-worker-jobs", "fail").dead_worker_jobs == "fail"
    monkeypatch.setenv("LOCALPOD_DEAD_WORKER_JOBS", "fail")
    assert parse(*base).dead_worker_jobs == "fail"
