"""localpod serves CPU serverless as RunPod's official schema states it: CPU flavors in its catalog
(`/v2/catalog/cpus[/{id}]`, `cpuAvailability` of `/v2/catalog/datacenters`), endpoints created with
`cpu: [{id, vcpuCount}]` whose workers start only in a datacenter offering one of their flavors with stock
(within `dataCenterIds`, and in their network volume's datacenter), with no CUDA need, and bill their vCPUs as
`cpuAmount`. `/_localpod/cpu-stock` takes flavors out of stock.

Most tests drive the app in-process and ask the placement directly; the billing test starts a real (sleeping)
worker process. `tests/test_localpod.py` runs a job on a CPU endpoint's real runpod worker.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from localpod import LocalpodConfig, create_app
from localpod.catalog import tables
from localpod.models import Account
from localpod.state.account import LocalpodState
from tests.test_localpod import API_KEY, AUTH, SCHEMAS, assert_problem, endpoint_body, wait_for

SERVERLESS = {"include": "AVAILABILITY", "product": "SERVERLESS"}
SLEEPER = "import time; time.sleep(300)"


@pytest.fixture
def pod(tmp_path: Path) -> Iterator[TestClient]:
    config = LocalpodConfig(api_key=API_KEY, worker_quota=10, log_dir=tmp_path / "logs", long_poll_s=0.2,
                            kill_grace_s=1, worker_command=[sys.executable, "-c", SLEEPER])
    with TestClient(create_app(config)) as c:
        yield c


def state_of(pod: TestClient) -> LocalpodState:
    return pod.app.state.localpod


def cpu_body(cpu: list[dict[str, Any]] | None = None, **overrides: Any) -> dict[str, Any]:
    body = endpoint_body(cpu=cpu or [{"id": "cpu3c", "vcpuCount": 4}], **overrides)
    del body["gpu"]
    return body


def cpu_endpoint(pod: TestClient, cpu: list[dict[str, Any]] | None = None, **overrides: Any) -> dict[str, Any]:
    answer = pod.post("/v2/serverless", json=cpu_body(cpu, **overrides), headers=AUTH)
    assert answer.status_code == 201, answer.text
    return answer.json()


def cpus(pod: TestClient, **params: Any) -> dict[str, dict[str, Any]]:
    answer = pod.get("/v2/catalog/cpus", params=params, headers=AUTH)
    assert answer.status_code == 200, answer.text
    assert SCHEMAS.errors("ListCpuTypesResponse", answer.json()) == []
    return {c["id"]: c for c in answer.json()["cpus"]}


def levels(document: dict[str, Any]) -> dict[str, str]:
    return {dc["id"]: dc["availability"] for dc in document.get("dataCenters", [])}


def cpu_stock(pod: TestClient, available: bool, **where: str) -> dict[str, Any]:
    answer = pod.post("/_localpod/cpu-stock", json={"available": available, **where})
    assert answer.status_code == 200, answer.text
    return answer.json()


def placement(pod: TestClient, endpoint_id: str) -> tuple[str, str | None] | None:
    state = state_of(pod)
    placed = state.faults.place(state.endpoints[endpoint_id].spec)
    return (placed.data_center_id, placed.cpu_flavor_id) if placed else None


def create_volume(pod: TestClient, data_center: str) -> str:
    answer = pod.post("/v2/network-volumes", json={"name": "w", "size": 10, "dataCenter": data_center}, headers=AUTH)
    assert answer.status_code == 201, answer.text
    return answer.json()["id"]


def cpu_billed(pod: TestClient, endpoint_id: str) -> dict[str, float]:
    answer = pod.get("/v2/billing/serverless", params={"serverlessId": endpoint_id, "bucketSize": "hour"},
                     headers=AUTH)
    assert answer.status_code == 200 and SCHEMAS.errors("ListServerlessBillingResponse", answer.json()) == []
    return answer.json()["metadata"]["totals"]


def account(pod: TestClient) -> Account:
    return Account.model_validate(pod.get("/_localpod/account").json())


# --- the CPU catalog ---------------------------------------------------------------------------------


def test_cpu_flavors_carry_vcpu_ranges_ram_and_prices_but_no_availability_unasked(pod: TestClient) -> None:
    listed = cpus(pod)
    assert set(listed) == {"cpu3c", "cpu3g", "cpu5c"}
    assert listed["cpu3c"]["vcpu"] == {"min": 2, "max": 32}
    assert listed["cpu3g"]["ramGbPerVcpu"] > listed["cpu3c"]["ramGbPerVcpu"]  # general purpose: more RAM per vCPU
    assert all(c["price"]["serverlessPerVcpu"] > 0 for c in listed.values())
    assert all("availability" not in c and "dataCenters" not in c for c in listed.values())


def test_serverless_availability_lists_the_datacenters_offering_each_flavor(pod: TestClient) -> None:
    listed = cpus(pod, **SERVERLESS)
    assert listed["cpu3c"]["availability"] == "HIGH"
    assert set(levels(listed["cpu3c"])) == {"US-KS-2", "US-CA-2", "EU-RO-1", "US-TX-3"}
    assert "EU-CZ-1" not in levels(listed["cpu5c"])  # EU-CZ-1 offers no CPU serverless


def test_asked_for_serverless_the_flavors_are_what_runpods_sdk_offers_at_most_8_vcpus(pod: TestClient) -> None:
    # RunPod's SDK: cpu3g-8-32, cpu3c-8-16, cpu5c-8-16 (issue 37).
    serverless = cpus(pod, **SERVERLESS)
    assert {i: (c["vcpu"]["max"], c["ramGbPerVcpu"]) for i, c in serverless.items()} == {
        "cpu3c": (8, 2.0), "cpu3g": (8, 4.0), "cpu5c": (8, 2.0)}
    assert all(c["vcpu"]["max"] == 32 for c in cpus(pod, include="AVAILABILITY", product="POD").values())


def test_a_vcpu_count_past_a_serverless_workers_leaves_the_flavor_unavailable_to_serverless(pod: TestClient) -> None:
    assert all(c["availability"] == "NONE" for c in cpus(pod, **SERVERLESS, vcpuCount=16).values())
    assert cpus(pod, include="AVAILABILITY", product="POD", vcpuCount=16)["cpu3g"]["availability"] == "HIGH"


def test_a_vcpu_count_beyond_a_flavors_range_leaves_it_unavailable(pod: TestClient) -> None:
    listed = cpus(pod, **SERVERLESS, vcpuCount=64)
    assert all(c["availability"] == "NONE" and "dataCenters" not in c for c in listed.values())
    assert cpus(pod, **SERVERLESS, vcpuCount=8)["cpu3g"]["availability"] == "HIGH"


def test_one_flavor_is_answered_by_id_and_an_unknown_one_is_404_naming_the_known(pod: TestClient) -> None:
    answer = pod.get("/v2/catalog/cpus/cpu5c", params=SERVERLESS, headers=AUTH)
    assert answer.status_code == 200 and SCHEMAS.errors("CpuType", answer.json()) == []
    assert answer.json()["group"] == "Gen 5" and levels(answer.json())["US-KS-2"] == "HIGH"
    detail = assert_problem(pod.get("/v2/catalog/cpus/cpu9x", headers=AUTH), 404)["detail"]
    assert "cpu9x" in detail and "cpu3c" in detail


@pytest.mark.parametrize(("params", "complaint"), [
    ({"include": "AVAILABILITY"}, "requires product"),
    ({"product": "SERVERLESS"}, "valid only with include=AVAILABILITY"),
    ({"vcpuCount": "4"}, "valid only with include=AVAILABILITY"),
    ({"include": "AVAILABILITY", "product": "CLUSTER"}, "CpuProduct"),
    ({**SERVERLESS, "vcpuCount": "6"}, "power of two"),
    ({**SERVERLESS, "vcpuCount": "1"}, "power of two"),
])
def test_cpu_catalog_queries_runpod_would_refuse_are_refused(pod: TestClient, params, complaint) -> None:
    assert complaint in assert_problem(pod.get("/v2/catalog/cpus", params=params, headers=AUTH), 400)["detail"]


def test_route_faults_reach_the_cpu_catalog(pod: TestClient) -> None:
    pod.post("/_localpod/faults", json={"route": "get_cpu_type", "action": "status_429"}).raise_for_status()
    assert_problem(pod.get("/v2/catalog/cpus/cpu3c", headers=AUTH), 429)
    assert pod.get("/v2/catalog/cpus/cpu3c", headers=AUTH).status_code == 200


def test_datacenters_list_their_cpu_availability_when_asked(pod: TestClient) -> None:
    answer = pod.get("/v2/catalog/datacenters", params={"include": "GPU_AVAILABILITY,CPU_AVAILABILITY"},
                     headers=AUTH)
    assert answer.status_code == 200 and SCHEMAS.errors("ListDataCentersResponse", answer.json()) == []
    by_id = {dc["id"]: dc for dc in answer.json()["dataCenters"]}
    assert {c["id"]: c["availability"] for c in by_id["US-CA-2"]["cpuAvailability"]} == {"cpu3c": "MEDIUM",
                                                                                         "cpu3g": "HIGH"}
    assert "cpuAvailability" not in by_id["EU-CZ-1"] and "gpuAvailability" in by_id["EU-CZ-1"]
    unasked = pod.get("/v2/catalog/datacenters/US-CA-2", headers=AUTH).json()
    assert "cpuAvailability" not in unasked


# --- CPU stock ---------------------------------------------------------------------------------------


def test_a_flavor_out_of_stock_in_one_datacenter_is_none_there_only(pod: TestClient) -> None:
    stock = cpu_stock(pod, False, cpu_flavor="cpu3c", data_center_id="US-KS-2")
    assert stock == {"out_of_stock": [], "out_of_stock_by_data_center": {"US-KS-2": ["cpu3c"]}}
    flavor = cpus(pod, **SERVERLESS)["cpu3c"]
    assert levels(flavor)["US-KS-2"] == "NONE" and levels(flavor)["EU-RO-1"] == "HIGH"
    answer = pod.get("/v2/catalog/datacenters/US-KS-2", params={"include": "CPU_AVAILABILITY"}, headers=AUTH)
    assert {c["id"]: c["availability"] for c in answer.json()["cpuAvailability"]}["cpu3c"] == "NONE"


def test_every_flavor_out_everywhere_leaves_no_cpu_available_until_restocked(pod: TestClient) -> None:
    assert cpu_stock(pod, False)["out_of_stock"] == ["cpu3c", "cpu3g", "cpu5c"]
    assert all(c["availability"] == "NONE" for c in cpus(pod, **SERVERLESS).values())
    assert cpu_stock(pod, True) == {"out_of_stock": [], "out_of_stock_by_data_center": {}}
    assert pod.get("/_localpod/cpu-stock").json()["out_of_stock"] == []


@pytest.mark.parametrize("body", [{"available": False, "cpu_flavor": "cpu9x"},
                                  {"available": False, "data_center_id": "MARS-1"}])
def test_cpu_stock_of_an_unknown_flavor_or_datacenter_is_refused(pod: TestClient, body: dict[str, Any]) -> None:
    problem = assert_problem(pod.post("/_localpod/cpu-stock", json=body), 400)
    assert "known" in problem["errors"][0]


# --- CPU endpoints -----------------------------------------------------------------------------------


def test_a_cpu_endpoints_memory_is_its_vcpus_times_the_flavors_ram_per_vcpu(pod: TestClient) -> None:
    endpoint = cpu_endpoint(pod, [{"id": "cpu3g", "vcpuCount": 8}, {"id": "cpu3c", "vcpuCount": 4}])
    assert endpoint["cpu"] == [{"id": "cpu3g", "vcpuCount": 8, "memory": 32},
                               {"id": "cpu3c", "vcpuCount": 4, "memory": 8}]
    assert "gpu" not in endpoint


@pytest.mark.parametrize(("cpu", "complaint"), [
    ([{"id": "cpu9x", "vcpuCount": 4}], "no CPU flavor 'cpu9x'"),
    ([{"id": "cpu3c", "vcpuCount": 6}], "power of two"),
    ([{"id": "cpu3c", "vcpuCount": 64}], "from 2 to 8"),
    # RunPod's serverless CPU workers stop at 8 vCPUs (issue 37), whatever the flavor's range for pods.
    ([{"id": "cpu3g", "vcpuCount": 16}], "not valid for a serverless cpu3g worker: give a power of two from 2 to 8"),
])
def test_a_cpu_configuration_the_catalog_does_not_offer_is_refused(pod: TestClient, cpu, complaint) -> None:
    answer = pod.post("/v2/serverless", json=cpu_body(cpu), headers=AUTH)
    assert complaint in assert_problem(answer, 400)["detail"]


@pytest.mark.parametrize(("cpu", "disk", "fits"), [
    ({"id": "cpu3c", "vcpuCount": 2}, 20, True), ({"id": "cpu3c", "vcpuCount": 2}, 21, False),
    ({"id": "cpu3g", "vcpuCount": 8}, 80, True), ({"id": "cpu3g", "vcpuCount": 8}, 81, False),
    ({"id": "cpu5c", "vcpuCount": 2}, 30, True), ({"id": "cpu5c", "vcpuCount": 2}, 31, False),
])
def test_a_cpu_workers_container_disk_is_at_most_its_flavors_gb_per_vcpu(pod: TestClient, cpu, disk, fits) -> None:
    # 10 GB per vCPU on cpu3c and cpu3g, 15 on cpu5c (issue 37).
    answer = pod.post("/v2/serverless", json=cpu_body([cpu], disk=disk), headers=AUTH)
    if fits:
        assert answer.status_code == 201, answer.text
    else:
        assert f"disk: {disk} GB is more than a serverless {cpu['id']} worker of {cpu['vcpuCount']} vCPUs may have" \
            in assert_problem(answer, 400)["detail"]


def test_a_cpu_endpoint_starts_in_the_first_datacenter_offering_its_flavor(pod: TestClient) -> None:
    assert placement(pod, cpu_endpoint(pod, [{"id": "cpu3g", "vcpuCount": 4}])["id"]) == ("US-KS-2", "cpu3g")
    chosen = cpu_endpoint(pod, [{"id": "cpu5c", "vcpuCount": 4}], dataCenterIds=["US-CA-2", "EU-RO-1"])
    assert placement(pod, chosen["id"]) == ("EU-RO-1", "cpu5c")  # US-CA-2 offers no cpu5c


def test_a_cpu_endpoints_flavors_are_tried_in_their_order_in_each_datacenter(pod: TestClient) -> None:
    endpoint = cpu_endpoint(pod, [{"id": "cpu5c", "vcpuCount": 4}, {"id": "cpu3c", "vcpuCount": 4}],
                            dataCenterIds=["US-CA-2"])
    assert placement(pod, endpoint["id"]) == ("US-CA-2", "cpu3c")


def test_a_cpu_endpoint_with_a_volume_starts_in_the_volumes_datacenter(pod: TestClient) -> None:
    volume_id = create_volume(pod, "EU-RO-1")
    assert placement(pod, cpu_endpoint(pod, networkVolumes=[volume_id])["id"]) == ("EU-RO-1", "cpu3c")


def test_a_cpu_endpoint_whose_volumes_datacenter_offers_no_cpu_is_throttled_saying_why(pod: TestClient) -> None:
    volume_id = create_volume(pod, "EU-CZ-1")
    endpoint = cpu_endpoint(pod, networkVolumes=[volume_id], workers={"max": 1})
    assert placement(pod, endpoint["id"]) is None
    state = state_of(pod)
    assert state.faults.unplaceable_reason(state.endpoints[endpoint["id"]].spec) == (
        "no stock of CPU flavor cpu3c in EU-CZ-1 (its network volume's datacenter is EU-CZ-1)")
    pod.post(f"/v2/{endpoint['id']}/run", json={"input": {}}, headers=AUTH).raise_for_status()
    assert pod.get(f"/v2/{endpoint['id']}/health", headers=AUTH).json()["workers"]["throttled"] == 1
    workers = pod.get(f"/v2/serverless/{endpoint['id']}/workers", headers=AUTH).json()
    assert SCHEMAS.errors("ListEndpointWorkersResponse", workers) == []
    assert [(w["status"], w["gpuCount"]) for w in workers["workers"]] == [("THROTTLED", 0)]


def test_no_cpu_worker_starts_while_its_flavors_are_out_of_stock(pod: TestClient) -> None:
    endpoint = cpu_endpoint(pod, dataCenterIds=["EU-RO-1"])
    cpu_stock(pod, False, cpu_flavor="cpu3c", data_center_id="EU-RO-1")
    assert placement(pod, endpoint["id"]) is None
    cpu_stock(pod, True, cpu_flavor="cpu3c", data_center_id="EU-RO-1")
    assert placement(pod, endpoint["id"]) == ("EU-RO-1", "cpu3c")


def test_a_gpu_pool_out_of_stock_does_not_stop_a_cpu_endpoint(pod: TestClient) -> None:
    for pool in tables.KNOWN_POOLS:
        pod.post("/_localpod/stock", json={"pool": pool, "available": False}).raise_for_status()
    assert placement(pod, cpu_endpoint(pod)["id"]) == ("US-KS-2", "cpu3c")


def test_a_cpu_worker_is_listed_with_its_datacenter_and_bills_its_vcpus_as_cpu(pod: TestClient) -> None:
    endpoint = cpu_endpoint(pod, [{"id": "cpu5c", "vcpuCount": 8}], workers={"min": 1, "max": 1})
    wait_for(lambda: [w for w in account(pod).workers if w.endpoint_id == endpoint["id"]], "the CPU worker")
    workers = pod.get(f"/v2/serverless/{endpoint['id']}/workers", headers=AUTH).json()
    assert SCHEMAS.errors("ListEndpointWorkersResponse", workers) == []
    [listed] = workers["workers"]
    assert (listed["dataCenterId"], listed["gpuCount"], listed["gpuTypeId"]) == ("US-KS-2", 0, None)
    wait_for(lambda: cpu_billed(pod, endpoint["id"])["cpuAmount"] >= 1e-5, "the running worker's CPU cost")
    assert pod.delete(f"/v2/serverless/{endpoint['id']}", headers=AUTH).status_code == 204
    [worker] = wait_for(lambda: [w for w in account(pod).workers if w.endpoint_id == endpoint["id"] and w.ended_at],
                        "the worker to end", timeout=30)
    assert worker.placement is not None and (worker.placement.cpu_flavor_id, worker.placement.vcpu_count) == (
        "cpu5c", 8)
    totals = cpu_billed(pod, endpoint["id"])
    seconds = (worker.ended_at - worker.started_at).total_seconds()
    price = tables.cpu_type("cpu5c").serverless_usd_per_vcpu
    assert totals["cpuAmount"] == pytest.approx(seconds * 8 * price / 3600, abs=2e-6)
    assert totals["gpuAmount"] == 0 and totals["totalAmount"] == totals["cpuAmount"] > 0
