"""localpod models RunPod's hosts: each GPU type's hosts run some CUDA versions in each datacenter, the catalog
reports them, a worker starts only on hosts that meet its endpoint's CUDA need (else its jobs wait IN_QUEUE,
throttled, as on RunPod), `GET /v2/serverless/{id}/workers` lists what runs and what waits, and `/_localpod/cuda`
changes the hosts. Also: the unknown_status route fault, and the lifted `LORAFLOW_REQUIRE_CUDA`.

The placement tests start real (sleeping) worker processes through the app's own supervisor; the rest drive the
app in-process.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from localpod import LocalpodConfig, create_app
from localpod.models import Account
from localpod.state.account import LocalpodState
from localpod.workers.supervisor import WorkerSupervisor
from tests.test_localpod import (
    API_KEY,
    AUTH,
    SCHEMAS,
    assert_problem,
    create_endpoint,
    endpoint_body,
    run_job,
    take_job,
    wait_for,
)
from tests.test_localpod_catalog import DC_WORKER, SERVERLESS, levels

RTX_4090 = "NVIDIA GeForce RTX 4090"
NEWER = ["12.4", "12.6", "12.8", "12.9", "13.0"]  # Ampere/Ada/Hopper hosts outside US-TX-3
OLDER = ["12.4", "12.6", "12.8"]  # theirs in US-TX-3
BLACKWELL = ["12.8", "12.9", "13.0"]
CUDA_13 = {"pools": ["ADA_24"], "minCudaVersion": "13.0"}


def config(tmp_path: Path, **fields: Any) -> LocalpodConfig:
    return LocalpodConfig(api_key=API_KEY, worker_quota=10, log_dir=tmp_path / "logs", long_poll_s=0.2,
                          kill_grace_s=1, **{"worker_command": [sys.executable, "-c", DC_WORKER], **fields})


@pytest.fixture
def pod(tmp_path: Path) -> Iterator[TestClient]:
    with TestClient(create_app(config(tmp_path))) as c:
        yield c


def state_of(pod: TestClient) -> LocalpodState:
    return pod.app.state.localpod


def set_cuda(pod: TestClient, versions: list[str], **where: str) -> dict[str, Any]:
    answer = pod.post("/_localpod/cuda", json={**where, "versions": versions})
    assert answer.status_code == 200, answer.text
    return answer.json()["hosts"]


def gpu(pod: TestClient, type_id: str, **params: str) -> dict[str, Any]:
    answer = pod.get(f"/v2/catalog/gpus/{type_id}", params={**SERVERLESS, **params}, headers=AUTH)
    assert answer.status_code == 200, answer.text
    assert SCHEMAS.errors("GpuType", answer.json()) == []
    return answer.json()


def versions(document: dict[str, Any]) -> dict[str, bool]:
    return {v["version"]: v["available"] for v in document.get("cudaVersions", [])}


def account(pod: TestClient) -> Account:
    return Account.model_validate(pod.get("/_localpod/account").raise_for_status().json())


def workers_of(pod: TestClient, endpoint_id: str) -> list[Any]:
    return [w for w in account(pod).workers if w.endpoint_id == endpoint_id]


def listed_workers(pod: TestClient, endpoint_id: str) -> dict[str, Any]:
    answer = pod.get(f"/v2/serverless/{endpoint_id}/workers", headers=AUTH)
    assert answer.status_code == 200, answer.text
    assert SCHEMAS.errors("ListEndpointWorkersResponse", answer.json()) == []
    return answer.json()


def told_dc(worker: Any) -> str:
    told = Path(worker.log_path).parent / "disks" / worker.id / "dc.txt"  # DC_WORKER writes its RUNPOD_DC_ID there
    return wait_for(lambda: told.exists() and told.read_text(), "the worker's RUNPOD_DC_ID")


def throttled(pod: TestClient, endpoint_id: str) -> int:
    return pod.get(f"/v2/{endpoint_id}/health", headers=AUTH).json()["workers"]["throttled"]


def settle(pod: TestClient) -> None:
    """Let the supervisor make a few passes (its tick is 0.1 s)."""
    time.sleep(0.5)


# --- the default hosts -------------------------------------------------------------------------------


def test_the_default_hosts_run_newer_cuda_outside_us_tx_3_and_blackwell_from_12_8(pod: TestClient) -> None:
    hosts = pod.get("/_localpod/cuda").json()["hosts"]
    assert hosts[RTX_4090] == {"US-CA-2": NEWER, "EU-RO-1": NEWER, "EU-CZ-1": NEWER, "US-TX-3": OLDER}
    assert hosts["NVIDIA H200"] == {"US-KS-2": NEWER, "EU-RO-1": NEWER, "US-TX-3": OLDER}
    assert hosts["NVIDIA RTX PRO 6000 Blackwell Server Edition"]["US-TX-3"] == BLACKWELL
    assert hosts["NVIDIA B200"] == {"US-KS-2": BLACKWELL, "EU-CZ-1": BLACKWELL}


def test_a_cuda_13_endpoint_starts_its_worker_outside_us_tx_3(pod: TestClient) -> None:
    allowed = ["US-TX-3", "EU-RO-1"]
    plain = create_endpoint(pod, dataCenterIds=allowed)  # workers.max 0: placed only on paper
    assert state_of(pod).faults.place(state_of(pod).endpoints[plain["id"]].spec).data_center_id == "US-TX-3"
    endpoint = create_endpoint(pod, gpu=CUDA_13, dataCenterIds=allowed, workers={"min": 1, "max": 1})
    worker = wait_for(lambda: next(iter(workers_of(pod, endpoint["id"])), None), "the endpoint's worker")
    assert worker.placement is not None
    assert (worker.placement.data_center_id, worker.placement.gpu_type_id) == ("EU-RO-1", RTX_4090)
    assert told_dc(worker) == "EU-RO-1"


def test_allowed_cuda_versions_place_on_hosts_running_one_of_them(pod: TestClient) -> None:
    endpoint = create_endpoint(pod, gpu={"pools": ["ADA_24"], "allowedCudaVersions": ["12.9"]},
                               dataCenterIds=["US-TX-3", "EU-CZ-1"])
    assert state_of(pod).faults.place(state_of(pod).endpoints[endpoint["id"]].spec).data_center_id == "EU-CZ-1"


# --- no host meets the endpoint's CUDA -----------------------------------------------------------------


def test_with_no_host_meeting_the_floor_the_job_waits_throttled_until_a_datacenter_gets_it(pod: TestClient) -> None:
    set_cuda(pod, OLDER, pool="ADA_24")
    endpoint = create_endpoint(pod, gpu=CUDA_13, workers={"max": 1})
    job_id = run_job(pod, endpoint["id"])
    assert wait_for(lambda: throttled(pod, endpoint["id"]), "the worker throttled") == 1
    settle(pod)
    assert workers_of(pod, endpoint["id"]) == []
    assert pod.get(f"/v2/{endpoint['id']}/status/{job_id}", headers=AUTH).json()["status"] == "IN_QUEUE"
    listed = listed_workers(pod, endpoint["id"])
    assert [w["status"] for w in listed["workers"]] == ["THROTTLED"]  # waiting on capacity: never placed
    assert listed["workers"][0]["dataCenterId"] is None and listed["summary"]["throttled"] >= 1

    set_cuda(pod, ["13.0"], gpu_type_id=RTX_4090, data_center_id="EU-CZ-1")
    worker = wait_for(lambda: next(iter(workers_of(pod, endpoint["id"])), None), "a worker once EU-CZ-1 runs 13.0")
    assert worker.placement is not None and worker.placement.data_center_id == "EU-CZ-1"
    assert told_dc(worker) == "EU-CZ-1"
    assert throttled(pod, endpoint["id"]) == 0


def test_the_log_says_once_why_no_worker_starts(pod: TestClient, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="localpod.workers")
    set_cuda(pod, OLDER, gpu_type_id=RTX_4090)
    endpoint = create_endpoint(pod, gpu=CUDA_13, workers={"max": 1})
    run_job(pod, endpoint["id"])
    wait_for(lambda: throttled(pod, endpoint["id"]), "the worker throttled")
    settle(pod)
    why = "no host of NVIDIA GeForce RTX 4090 in US-CA-2, EU-RO-1, EU-CZ-1, US-TX-3 runs CUDA >= 13.0"
    assert [r.getMessage() for r in caplog.records].count(
        f"no worker can start for endpoint {endpoint['id']} (loraflow-test): {why}; its jobs stay IN_QUEUE") == 1


def test_a_network_volume_pins_the_cuda_search_to_its_datacenter(pod: TestClient) -> None:
    volume = pod.post("/v2/network-volumes", json={"name": "w", "size": 10, "dataCenter": "EU-RO-1"}, headers=AUTH)
    set_cuda(pod, OLDER, gpu_type_id=RTX_4090, data_center_id="EU-RO-1")
    endpoint = create_endpoint(pod, gpu=CUDA_13, networkVolumes=[volume.json()["id"]])
    state = state_of(pod)
    spec = state.endpoints[endpoint["id"]].spec
    assert state.faults.place(spec) is None  # US-CA-2 and EU-CZ-1 run 13.0, but the volume is in EU-RO-1
    assert "in EU-RO-1 runs CUDA >= 13.0" in (state.faults.unplaceable_reason(spec) or "")


def test_hosts_that_report_no_cuda_still_serve_endpoints_without_a_cuda_need(pod: TestClient) -> None:
    set_cuda(pod, [])
    state = state_of(pod)
    floorless = create_endpoint(pod, gpu={"pools": ["ADA_24"]})
    cpu = endpoint_body(name="cpu", cpu=[{"id": "cpu5c", "vcpuCount": 4}])
    del cpu["gpu"]
    cpu_endpoint = pod.post("/v2/serverless", json=cpu, headers=AUTH).json()
    assert state.faults.place(state.endpoints[floorless["id"]].spec) is not None
    assert state.faults.place(state.endpoints[cpu_endpoint["id"]].spec) is not None
    floored = create_endpoint(pod, gpu={"pools": ["ADA_24"], "minCudaVersion": "12.0"})
    assert state.faults.place(state.endpoints[floored["id"]].spec) is None


# --- the catalog follows the hosts -------------------------------------------------------------------


def test_the_catalogs_cuda_versions_are_the_union_of_the_hosts_and_follow_them(pod: TestClient) -> None:
    assert versions(gpu(pod, RTX_4090)) == dict.fromkeys(NEWER, True)
    for dc in ("US-CA-2", "EU-RO-1", "EU-CZ-1"):
        set_cuda(pod, ["12.8"], gpu_type_id=RTX_4090, data_center_id=dc)
    assert versions(gpu(pod, RTX_4090)) == dict.fromkeys(OLDER, True)  # only US-TX-3's remain beyond 12.8


def test_a_version_only_out_of_stock_hosts_run_is_listed_unavailable(pod: TestClient) -> None:
    set_cuda(pod, ["13.1"], gpu_type_id=RTX_4090, data_center_id="EU-CZ-1")
    pod.post("/_localpod/stock", json={"pool": "ADA_24", "available": False, "data_center_id": "EU-CZ-1"})
    assert versions(gpu(pod, RTX_4090)) == {**dict.fromkeys(NEWER, True), "13.1": False}


def test_a_cuda_filter_scopes_the_per_datacenter_stock_to_the_hosts(pod: TestClient) -> None:
    set_cuda(pod, OLDER, gpu_type_id=RTX_4090, data_center_id="US-CA-2")
    assert levels(gpu(pod, RTX_4090))["US-CA-2"] == "HIGH"  # without a filter every host counts
    floored = gpu(pod, RTX_4090, minCudaVersion="12.9")
    assert levels(floored) == {"US-CA-2": "NONE", "EU-RO-1": "HIGH", "EU-CZ-1": "MEDIUM", "US-TX-3": "NONE"}
    assert versions(floored) == {"12.9": True, "13.0": True}
    exact = gpu(pod, RTX_4090, cudaVersions="12.4")
    assert levels(exact) == {"US-CA-2": "HIGH", "EU-RO-1": "HIGH", "EU-CZ-1": "MEDIUM", "US-TX-3": "HIGH"}


def test_restoring_the_defaults_brings_the_catalog_back(pod: TestClient) -> None:
    set_cuda(pod, [], pool="ADA_24")
    assert "cudaVersions" not in gpu(pod, RTX_4090)  # the schema: absent when the hosts report none
    assert pod.delete("/_localpod/cuda").status_code == 204
    assert versions(gpu(pod, RTX_4090)) == dict.fromkeys(NEWER, True)


def test_setting_every_type_answers_the_whole_table(pod: TestClient) -> None:
    hosts = set_cuda(pod, ["12.9", "12.10", "12.9"])
    assert hosts[RTX_4090]["US-TX-3"] == ["12.9", "12.10"]  # deduplicated, sorted numerically
    assert all(v == ["12.9", "12.10"] for by_dc in hosts.values() for v in by_dc.values())
    assert set(hosts["NVIDIA B200"]) == {"US-KS-2", "EU-CZ-1"}  # the datacenters offering it, no others


@pytest.mark.parametrize(("body", "field"), [
    ({"data_center_id": "MARS-1", "versions": ["13.0"]}, "data_center_id"),
    ({"gpu_type_id": "NVIDIA GeForce GTX 1080", "versions": ["13.0"]}, "gpu_type_id"),
    ({"pool": "VOODOO_2", "versions": ["13.0"]}, "pool"),
    ({"gpu_type_id": RTX_4090, "pool": "ADA_24", "versions": ["13.0"]}, "gpu_type_id or pool"),
    ({"versions": ["13"]}, "versions"),
    ({"versions": ["cuda12.8"]}, "versions"),
    ({"pool": "ADA_24"}, "versions"),
])
def test_bad_cuda_changes_are_refused_with_422_naming_the_field(pod: TestClient, body: dict, field: str) -> None:
    problem = assert_problem(pod.post("/_localpod/cuda", json=body), 422)
    assert field in problem["detail"]
    assert pod.get("/_localpod/cuda").json()["hosts"][RTX_4090]["US-CA-2"] == NEWER  # nothing changed


def test_an_unknown_datacenter_is_refused_naming_the_known_ones(pod: TestClient) -> None:
    problem = assert_problem(pod.post("/_localpod/cuda", json={"data_center_id": "MARS-1", "versions": []}), 422)
    assert "MARS-1" in problem["detail"] and "EU-RO-1" in problem["detail"]


# --- GET /v2/serverless/{id}/workers -----------------------------------------------------------------


def test_the_workers_list_matches_the_schema_and_places_a_started_worker(pod: TestClient) -> None:
    endpoint = create_endpoint(pod, dataCenterIds=["EU-RO-1"], workers={"min": 1, "max": 1})
    worker = wait_for(lambda: next(iter(workers_of(pod, endpoint["id"])), None), "the endpoint's worker")
    listed = listed_workers(pod, endpoint["id"])
    [entry] = listed["workers"]
    assert entry["id"] == worker.id and entry["status"] == "INITIALIZING"  # it never calls localpod back
    assert (entry["gpuTypeId"], entry["dataCenterId"], entry["gpuCount"]) == (RTX_4090, "EU-RO-1", 1)
    assert entry["image"] == "localpod/unused:latest" and entry["isStale"] is False
    assert listed["summary"] == {"running": 0, "idle": 0, "initializing": 1, "throttled": 0, "unhealthy": 0,
                                 "total": 1}


def test_a_worker_with_a_job_is_running_and_one_started_before_an_update_is_stale(pod: TestClient) -> None:
    endpoint = create_endpoint(pod)  # workers.max 0: the test plays the worker
    run_job(pod, endpoint["id"])
    take_job(pod, endpoint["id"])
    pod.patch(f"/v2/serverless/{endpoint['id']}", json={"timeout": 60000}, headers=AUTH)
    listed = listed_workers(pod, endpoint["id"])
    [entry] = listed["workers"]
    assert entry["status"] == "RUNNING" and entry["dataCenterId"] is None  # a hand-run worker was never placed
    assert (entry["version"], listed["endpointVersion"], entry["isStale"]) == (1, 2, True)
    assert listed["summary"]["running"] == 1


def test_the_workers_of_a_deleted_endpoint_are_404(pod: TestClient) -> None:
    endpoint = create_endpoint(pod)
    pod.delete(f"/v2/serverless/{endpoint['id']}", headers=AUTH)
    assert endpoint["id"] in assert_problem(pod.get(f"/v2/serverless/{endpoint['id']}/workers", headers=AUTH),
                                            404)["detail"]
    assert_problem(pod.get("/v2/serverless/nosuchendpoint/workers", headers=AUTH), 404)


def test_the_workers_list_needs_the_key_and_can_be_faulted(pod: TestClient) -> None:
    endpoint = create_endpoint(pod)
    assert_problem(pod.get(f"/v2/serverless/{endpoint['id']}/workers"), 401)
    pod.post("/_localpod/faults", json={"route": "list_endpoint_workers", "action": "status_500"}).raise_for_status()
    assert_problem(pod.get(f"/v2/serverless/{endpoint['id']}/workers", headers=AUTH), 500)
    listed_workers(pod, endpoint["id"])


# --- the unknown_status fault ------------------------------------------------------------------------


def test_the_unknown_status_fault_answers_the_given_status_once_then_the_real_one(pod: TestClient) -> None:
    endpoint = create_endpoint(pod)
    job_id = run_job(pod, endpoint["id"])
    rule = {"route": "status", "action": "unknown_status", "job_status": "RUNNING"}
    assert pod.post("/_localpod/faults", json=rule).status_code == 201
    faked = pod.get(f"/v2/{endpoint['id']}/status/{job_id}", headers=AUTH)
    assert faked.status_code == 200
    assert faked.json()["status"] == "RUNNING" and faked.json()["id"] == job_id and "delayTime" in faked.json()
    assert pod.get(f"/v2/{endpoint['id']}/status/{job_id}", headers=AUTH).json()["status"] == "IN_QUEUE"
    assert account(pod).faults_injected["unknown_status"] == 1


@pytest.mark.parametrize(("rule", "complaint"), [
    ({"route": "status", "action": "unknown_status"}, "needs job_status"),
    ({"route": "health", "action": "unknown_status", "job_status": "RUNNING"}, "status route"),
    ({"route": "status", "action": "status_500", "job_status": "RUNNING"}, "job_status applies to unknown_status"),
])
def test_inconsistent_unknown_status_rules_are_refused(pod: TestClient, rule: dict, complaint: str) -> None:
    problem = assert_problem(pod.post("/_localpod/faults", json=rule), 400)
    assert any(complaint in error for error in problem["errors"]), problem


# --- LORAFLOW_REQUIRE_CUDA ---------------------------------------------------------------------------


@pytest.mark.parametrize("runtime", ["process", "docker"])
def test_a_worker_gets_require_cuda_lifted_and_the_log_says_so(
    tmp_path: Path, runtime: str, caplog: pytest.LogCaptureFixture
) -> None:
    fields: dict[str, Any] = {"worker_runtime": "docker", "worker_command": None} if runtime == "docker" else {}
    state: LocalpodState = create_app(config(tmp_path, **fields)).state.localpod
    endpoint = state.add_endpoint(endpoint_body(env={"LORAFLOW_REQUIRE_CUDA": "1", "OTHER": "kept"}))
    caplog.set_level(logging.INFO, logger="localpod.workers")
    env = WorkerSupervisor(state).runpod_env(endpoint, "w0rker0000id01", "worker-token")
    assert (env["LORAFLOW_REQUIRE_CUDA"], env["OTHER"]) == ("0", "kept")
    assert [r.getMessage() for r in caplog.records] == [
        "LORAFLOW_REQUIRE_CUDA lifted for worker w0rker0000id01: localpod's workers run on this machine's CPU"]


def test_a_worker_of_an_endpoint_without_require_cuda_gets_none_and_no_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state: LocalpodState = create_app(config(tmp_path)).state.localpod
    endpoint = state.add_endpoint(endpoint_body())
    caplog.set_level(logging.INFO, logger="localpod.workers")
    assert "LORAFLOW_REQUIRE_CUDA" not in WorkerSupervisor(state).runpod_env(endpoint, "w", "k")
    assert caplog.records == []
