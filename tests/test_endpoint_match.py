"""What was created is what was asked: the create answer's compute kind, GPU pools, excluded cards, CUDA floor, CPU
flavors and `workers.max` are compared with the request, and an endpoint unlike it is deleted at once and its
attempt failed naming the difference (REST v1 was reported to make GPU endpoints for CPU requests)."""

from __future__ import annotations

import sys
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from localpod import LocalpodConfig, create_app
from tasks.runpod import errors
from tasks.runpod.client import RunpodClient
from tasks.runpod.endpoint_match import endpoint_differences
from tasks.runpod.endpoints import ensure_endpoint
from tasks.runpod.models import CpuRequest, CreateEndpoint, Endpoint, GpuRequest, Workers

API_KEY = "match-key"


def gpu_request(**gpu: Any) -> CreateEndpoint:
    return CreateEndpoint(name="loraflow-match", image="i", timeout=60_000, workers=Workers(max=1),
                          gpu=GpuRequest(**{"pools": ["ADA_80_PRO"], "min_cuda_version": "13.0", **gpu}))


def cpu_request() -> CreateEndpoint:
    return CreateEndpoint(name="loraflow-match", image="i", timeout=60_000, workers=Workers(max=1),
                          cpu=[CpuRequest(id="cpu3c", vcpu_count=4)])


def answer(**fields: Any) -> Endpoint:
    """An `Endpoint` document as API v2 answers a create."""
    document = {"id": "ep1", "name": "loraflow-match", "workers": {"min": 0, "max": 1, "idleTimeout": 5},
                "createdAt": "2026-12-04T10:00:00Z", "dataCenterIds": [], "networkVolumes": [], "timeout": 60_000,
                "gpu": {"pools": ["ADA_80_PRO"], "allowedCudaVersions": [], "minCudaVersion": "13.0"}}
    return Endpoint.model_validate({**document, **fields})


def test_an_endpoint_made_as_asked_has_no_difference():
    assert endpoint_differences(gpu_request(), answer()) == []
    assert endpoint_differences(gpu_request(excluded_types=["NVIDIA H100 NVL"]),
                                answer(gpu={"pools": ["ADA_80_PRO"], "excludedTypes": [" NVIDIA H100 NVL"],
                                            "allowedCudaVersions": [], "minCudaVersion": "13.0"})) == []
    assert endpoint_differences(cpu_request(), answer(gpu=None, cpu=[{"id": "cpu3c", "vcpuCount": 4, "memory": 8}])) \
        == []


def test_a_gpu_endpoint_made_for_a_cpu_request_is_a_difference_of_compute():
    assert endpoint_differences(cpu_request(), answer()) == [
        "compute: asked for CPU workers, got GPU workers (pools ADA_80_PRO)"]


def test_a_cpu_endpoint_made_for_a_gpu_request_is_a_difference_of_compute():
    assert endpoint_differences(gpu_request(), answer(gpu=None, cpu=[{"id": "cpu3c", "vcpuCount": 2}])) == [
        "compute: asked for GPU workers, got CPU workers (flavors cpu3c × 2 vCPUs)"]


@pytest.mark.parametrize(("gpu", "difference"), [
    ({"pools": ["ADA_24"], "allowedCudaVersions": [], "minCudaVersion": "13.0"},
     "gpu.pools: asked [ADA_80_PRO], got [ADA_24]"),
    ({"pools": ["ADA_80_PRO"], "excludedTypes": ["NVIDIA H100 80GB HBM3"], "minCudaVersion": "13.0"},
     "gpu.excludedTypes: asked [], got [NVIDIA H100 80GB HBM3]"),
    ({"pools": ["ADA_80_PRO"], "allowedCudaVersions": [], "minCudaVersion": None},
     "gpu.minCudaVersion: asked 13.0, got none"),
    ({"pools": ["ADA_80_PRO"], "allowedCudaVersions": ["12.4"], "minCudaVersion": "13.0"},
     "gpu.allowedCudaVersions: asked none, got [12.4]"),
])
def test_each_gpu_field_that_decides_placement_is_compared(gpu, difference):
    assert endpoint_differences(gpu_request(), answer(gpu=gpu)) == [difference]


def test_other_cpu_flavors_and_another_worker_cap_are_differences():
    got = answer(gpu=None, cpu=[{"id": "cpu5c", "vcpuCount": 4}], workers={"min": 0, "max": 3})
    assert endpoint_differences(cpu_request(), got) == ["cpu: asked [cpu3c × 4 vCPUs], got [cpu5c × 4 vCPUs]",
                                                        "workers.max: asked 1, got 3"]


def test_an_answer_without_excluded_types_does_not_say_the_pinned_cards_differ():
    pinned = gpu_request(excluded_types=["NVIDIA H100 NVL"])
    assert endpoint_differences(pinned, answer(gpu={"pools": ["ADA_80_PRO"], "allowedCudaVersions": [],
                                                    "minCudaVersion": "13.0"})) == []
    assert endpoint_differences(pinned, answer(gpu={"pools": ["ADA_80_PRO"], "excludedTypes": None,
                                                    "minCudaVersion": "13.0"})) == []


def test_an_answer_that_says_no_card_is_excluded_differs_from_a_pinned_request():
    pinned = gpu_request(excluded_types=["NVIDIA H100 NVL"])
    assert endpoint_differences(pinned, answer(gpu={"pools": ["ADA_80_PRO"], "excludedTypes": [],
                                                    "minCudaVersion": "13.0"})) == [
        "gpu.excludedTypes: asked [NVIDIA H100 NVL], got []"]


def test_an_answer_without_a_cuda_floor_does_not_say_it_differs_but_a_null_one_does():
    assert endpoint_differences(gpu_request(), answer(gpu={"pools": ["ADA_80_PRO"]})) == []
    assert endpoint_differences(gpu_request(), answer(gpu={"pools": ["ADA_80_PRO"], "minCudaVersion": None})) == [
        "gpu.minCudaVersion: asked 13.0, got none"]


def test_an_answer_that_names_no_compute_is_judged_on_what_it_names():
    assert endpoint_differences(gpu_request(), answer(gpu=None)) == []


@pytest.fixture
def pod(tmp_path):
    config = LocalpodConfig(api_key=API_KEY, worker_quota=10, log_dir=tmp_path / "logs",
                            worker_command=[sys.executable, "-c", "raise SystemExit('no workers')"])
    with TestClient(create_app(config)) as client:
        yield client


def runpod_client(pod: TestClient) -> RunpodClient:
    def forward(request: httpx.Request) -> httpx.Response:
        reply = pod.request(request.method, request.url.raw_path.decode(), content=request.content,
                            headers=request.headers)
        return httpx.Response(reply.status_code, headers=reply.headers, content=reply.content)

    return RunpodClient(API_KEY, api_url="http://localpod/v2", transport=httpx.MockTransport(forward))


def test_an_endpoint_made_unlike_the_request_is_deleted_and_the_attempt_fails_naming_the_difference(pod):
    fault = pod.post("/_localpod/faults", json={"route": "create_endpoint", "action": "create_as_gpu"})
    assert fault.status_code == 201, fault.text
    client = runpod_client(pod)
    with pytest.raises(errors.EndpointMismatchError, match="compute: asked for CPU workers, got GPU workers") as e:
        ensure_endpoint(client, cpu_request())
    assert not errors.is_transient(e.value)
    assert client.list_endpoints() == []  # deleted at once
    assert pod.get(f"/v2/serverless/{e.value.endpoint_id}", headers={"Authorization": f"Bearer {API_KEY}"}
                   ).status_code == 404
    assert pod.get("/_localpod/account").json()["faultsInjected"]["create_as_gpu"] == 1
    # The fault spent, the same request makes what it asks for.
    assert ensure_endpoint(client, cpu_request()).cpu[0].id == "cpu3c"


def test_the_create_as_gpu_fault_is_refused_on_any_route_but_create(pod):
    refused = pod.post("/_localpod/faults", json={"route": "run", "action": "create_as_gpu"})
    assert refused.status_code == 400 and "create_endpoint route only" in refused.text


def test_a_difference_stays_a_failure_when_the_delete_of_the_unlike_endpoint_meets_a_transient_error(pod):
    # Chaos seed 31: the confirming GET of that delete answered 500, the error was taken for the create's and
    # retried, and a second create made the attempt a second endpoint of its name, which it then ran on.
    for rule in ({"route": "create_endpoint", "action": "create_patched", "times": 1,
                  "create_patch": {"workers": {"max": 0}}},
                 {"route": "get_endpoint", "action": "status_500", "times": 1}):
        assert pod.post("/_localpod/faults", json=rule).status_code == 201
    client = runpod_client(pod)
    with pytest.raises(errors.EndpointMismatchError, match="workers.max: asked 1, got 0") as e:
        ensure_endpoint(client, gpu_request())
    assert not errors.is_transient(e.value)
    assert "teardown deletes it by name" in str(e.value)
    assert pod.get("/_localpod/account").json()["faultsInjected"]["status_500"] == 1
    assert len(client.list_endpoints()) <= 1  # never a second endpoint of the name


def test_of_two_endpoints_of_one_name_the_one_as_asked_is_kept_and_the_other_deleted(pod):
    # A create the client gave up on that RunPod carried out later leaves a second endpoint of the attempt's name.
    client = runpod_client(pod)
    assert pod.post("/_localpod/faults", json={"route": "create_endpoint", "action": "create_patched", "times": 1,
                                               "create_patch": {"workers": {"max": 0}}}).status_code == 201
    unlike = client.create_endpoint(gpu_request())
    as_asked = client.create_endpoint(gpu_request())
    assert ensure_endpoint(client, gpu_request()).id == as_asked.id
    assert [e.id for e in client.list_endpoints()] == [as_asked.id]
    assert unlike.id != as_asked.id
