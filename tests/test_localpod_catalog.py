"""localpod serves RunPod's catalog (`/v2/catalog/gpus`, `/v2/catalog/datacenters`) and serverless billing
(`/v2/billing/serverless`) as the official schema states them; its stock is set per datacenter, and a
worker starts only in a datacenter its endpoint allows that has stock, and is told which (RUNPOD_DC_ID).

Most tests drive the app in-process; the placement and billing tests start real (sleeping) worker
processes through the app's own supervisor.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from localpod import LocalpodConfig, create_app
from localpod.catalog.placement import place
from localpod.catalog.tables import POOL_SERVERLESS_USD_PER_HOUR
from localpod.models import Account
from tests.test_localpod import API_KEY, AUTH, SCHEMAS, assert_problem, create_endpoint, endpoint_body, wait_for

SERVERLESS = {"include": "AVAILABILITY", "product": "SERVERLESS"}
RTX_4090 = "NVIDIA GeForce RTX 4090"
# A worker that writes down the datacenter RunPod told it, then idles until it is stopped.
DC_WORKER = "import os, time; open('dc.txt', 'w').write(os.environ['RUNPOD_DC_ID']); time.sleep(300)"


@pytest.fixture
def pod(tmp_path: Path) -> Iterator[TestClient]:
    config = LocalpodConfig(api_key=API_KEY, worker_quota=10, log_dir=tmp_path / "logs", long_poll_s=0.2,
                            kill_grace_s=1, worker_command=[sys.executable, "-c", DC_WORKER])
    with TestClient(create_app(config)) as c:
        yield c


def gpus(pod: TestClient, **params: Any) -> list[dict[str, Any]]:
    answer = pod.get("/v2/catalog/gpus", params=params, headers=AUTH)
    assert answer.status_code == 200, answer.text
    assert SCHEMAS.errors("ListGpuTypesResponse", answer.json()) == []
    return answer.json()["gpus"]


def gpu(pod: TestClient, type_id: str) -> dict[str, Any]:
    answer = pod.get(f"/v2/catalog/gpus/{type_id}", params=SERVERLESS, headers=AUTH)
    assert answer.status_code == 200, answer.text
    assert SCHEMAS.errors("GpuType", answer.json()) == []
    return answer.json()


def stock(pod: TestClient, pool: str, available: bool, data_center_id: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"pool": pool, "available": available}
    if data_center_id is not None:
        body["data_center_id"] = data_center_id
    answer = pod.post("/_localpod/stock", json=body)
    assert answer.status_code == 200, answer.text
    return answer.json()


def levels(document: dict[str, Any]) -> dict[str, str]:
    return {dc["id"]: dc["availability"] for dc in document.get("dataCenters", [])}


def account(pod: TestClient) -> Account:
    return Account.model_validate(pod.get("/_localpod/account").json())


def gpu_endpoint(pod: TestClient, **overrides: Any) -> dict[str, Any]:
    """An endpoint that keeps one worker up (workers.min = 1), so the supervisor starts it at once."""
    return create_endpoint(pod, **{"workers": {"min": 1, "max": 1}, **overrides})


# --- the GPU catalog ---------------------------------------------------------------------------------


def test_gpu_types_without_include_carry_prices_but_no_availability(pod: TestClient) -> None:
    listed = gpus(pod)
    assert {g["pool"] for g in listed} >= {"ADA_24", "AMPERE_80", "ADA_80_PRO", "HOPPER_141", "BLACKWELL_180"}
    assert all("availability" not in g and "dataCenters" not in g and "cudaVersions" not in g for g in listed)
    assert {g["id"]: g["price"].get("serverless") for g in listed}[RTX_4090] == POOL_SERVERLESS_USD_PER_HOUR["ADA_24"]


def test_serverless_availability_lists_datacenters_and_cuda_versions(pod: TestClient) -> None:
    rtx = {g["id"]: g for g in gpus(pod, **SERVERLESS)}[RTX_4090]
    assert rtx["availability"] == "HIGH"
    assert "US-KS-2" not in levels(rtx)  # RunPod observed US-KS-2 to stock no RTX 4090
    assert set(levels(rtx)) == {"US-CA-2", "EU-RO-1", "EU-CZ-1", "US-TX-3"}
    assert {"version": "12.8", "available": True} in rtx["cudaVersions"]


def test_one_gpu_type_is_answered_by_id_and_an_unknown_one_is_404(pod: TestClient) -> None:
    assert gpu(pod, "NVIDIA H200")["pool"] == "HOPPER_141"
    body = assert_problem(pod.get("/v2/catalog/gpus/NVIDIA GeForce GTX 1080", headers=AUTH), 404)
    assert "GTX 1080" in body["detail"]


@pytest.mark.parametrize(("params", "status", "complaint"), [
    ({"include": "AVAILABILITY"}, 400, "requires product"),
    ({"product": "SERVERLESS"}, 400, "valid only with include=AVAILABILITY"),
    ({"minCudaVersion": "12"}, 400, "valid only with include=AVAILABILITY"),
    ({"include": "EVERYTHING", "product": "SERVERLESS"}, 400, "CatalogInclude"),
    ({**SERVERLESS, "product": "SPOT"}, 400, "Product"),
    ({**SERVERLESS, "cudaVersions": "12.8", "minCudaVersion": "12"}, 400, "mutually exclusive"),
    ({**SERVERLESS, "cudaVersions": "12"}, 422, "cudaVersions"),
    ({**SERVERLESS, "countryCodes": "fr"}, 422, "countryCodes"),
    ({**SERVERLESS, "count": "0"}, 400, "count"),
])
def test_filters_out_of_place_or_malformed_are_refused_as_runpod_does(pod, params, status, complaint) -> None:
    body = assert_problem(pod.get("/v2/catalog/gpus", params=params, headers=AUTH), status)
    assert complaint in body["detail"]


def test_a_cuda_floor_leaves_only_the_versions_and_datacenters_whose_hosts_meet_it(pod: TestClient) -> None:
    listed = {g["id"]: g for g in gpus(pod, **SERVERLESS, minCudaVersion="13")}
    assert listed["NVIDIA B200"]["cudaVersions"] == [{"version": "13.0", "available": True}]
    rtx = listed[RTX_4090]
    assert rtx["availability"] == "HIGH" and rtx["cudaVersions"] == [{"version": "13.0", "available": True}]
    assert levels(rtx)["US-TX-3"] == "NONE"  # its RTX 4090 hosts run CUDA 12.8 at most


def test_a_cuda_floor_no_host_meets_leaves_the_gpu_unavailable_without_datacenters(pod: TestClient) -> None:
    rtx = {g["id"]: g for g in gpus(pod, **SERVERLESS, minCudaVersion="13.1")}[RTX_4090]
    assert rtx["availability"] == "NONE"
    assert "dataCenters" not in rtx and "cudaVersions" not in rtx


def test_country_codes_scope_the_datacenters_and_drop_gpus_offered_elsewhere(pod: TestClient) -> None:
    listed = {g["id"]: g for g in gpus(pod, **SERVERLESS, countryCodes="RO")}
    assert set(levels(listed[RTX_4090])) == {"EU-RO-1"}
    assert "NVIDIA B200" not in listed  # offered in the US and Czechia only


# --- stock per datacenter ----------------------------------------------------------------------------


def test_a_pool_out_of_stock_in_one_datacenter_is_none_there_only(pod: TestClient) -> None:
    answer = stock(pod, "ADA_24", False, "EU-RO-1")
    assert answer == {"out_of_stock": [], "out_of_stock_by_data_center": {"EU-RO-1": ["ADA_24"]}}
    rtx = gpu(pod, RTX_4090)
    assert levels(rtx) == {"US-CA-2": "HIGH", "EU-RO-1": "NONE", "EU-CZ-1": "MEDIUM", "US-TX-3": "HIGH"}
    assert rtx["availability"] == "HIGH"


def test_a_pool_out_of_stock_everywhere_is_unavailable_and_reads_as_before(pod: TestClient) -> None:
    assert stock(pod, "ADA_24", False) == {"out_of_stock": ["ADA_24"]}
    rtx = gpu(pod, RTX_4090)
    assert rtx["availability"] == "NONE" and "dataCenters" not in rtx
    assert all(not v["available"] for v in rtx["cudaVersions"])
    assert account(pod).out_of_stock_pools == ["ADA_24"]


def test_restocking_one_datacenter_of_a_pool_out_everywhere_brings_it_back_there(pod: TestClient) -> None:
    stock(pod, "HOPPER_141", False)
    answer = stock(pod, "HOPPER_141", True, "US-TX-3")
    assert answer["out_of_stock"] == []
    others = ("EU-CZ-1", "EU-RO-1", "US-CA-2", "US-KS-2")
    assert answer["out_of_stock_by_data_center"] == {dc: ["HOPPER_141"] for dc in others}
    assert levels(gpu(pod, "NVIDIA H200")) == {"US-KS-2": "NONE", "EU-RO-1": "NONE", "US-TX-3": "HIGH"}


def test_a_global_restock_clears_every_datacenter(pod: TestClient) -> None:
    stock(pod, "ADA_24", False, "EU-RO-1")
    assert stock(pod, "ADA_24", True) == {"out_of_stock": []}
    assert pod.get("/_localpod/stock").json() == {"out_of_stock": []}


def test_stock_in_a_datacenter_localpod_does_not_know_is_refused_naming_the_known_ones(pod: TestClient) -> None:
    answer = pod.post("/_localpod/stock", json={"pool": "ADA_24", "available": False, "data_center_id": "MARS-1"})
    body = assert_problem(answer, 400)
    assert "MARS-1" in body["errors"][0] and "EU-RO-1" in body["errors"][0]


# --- datacenters -------------------------------------------------------------------------------------


def test_datacenters_say_which_support_network_volumes(pod: TestClient) -> None:
    answer = pod.get("/v2/catalog/datacenters", headers=AUTH)
    assert answer.status_code == 200 and SCHEMAS.errors("ListDataCentersResponse", answer.json()) == []
    volumes = {dc["id"]: dc["networkVolumeTypes"] for dc in answer.json()["dataCenters"]}
    assert volumes["US-TX-3"] == [] and all(volumes[dc] for dc in ("US-KS-2", "US-CA-2", "EU-RO-1", "EU-CZ-1"))
    assert all("gpuAvailability" not in dc for dc in answer.json()["dataCenters"])


def test_datacenters_filter_on_volumes_and_region(pod: TestClient) -> None:
    answer = pod.get("/v2/catalog/datacenters", params={"networkVolumeTypes": "STANDARD", "regions": "EUROPE"},
                     headers=AUTH)
    assert [dc["id"] for dc in answer.json()["dataCenters"]] == ["EU-RO-1", "EU-CZ-1"]
    assert_problem(pod.get("/v2/catalog/datacenters", params={"regions": "MARS"}, headers=AUTH), 400)


def test_datacenter_gpu_availability_follows_the_stock(pod: TestClient) -> None:
    stock(pod, "ADA_24", False, "US-CA-2")
    answer = pod.get("/v2/catalog/datacenters/US-CA-2", params={"include": "GPU_AVAILABILITY"}, headers=AUTH)
    assert answer.status_code == 200 and SCHEMAS.errors("DataCenter", answer.json()) == []
    offered = {g["id"]: g["availability"] for g in answer.json()["gpuAvailability"]}
    assert offered[RTX_4090] == "NONE" and offered["NVIDIA A100 80GB PCIe"] == "HIGH"
    assert_problem(pod.get("/v2/catalog/datacenters/US-XX-9", headers=AUTH), 404)


def test_the_catalog_needs_the_account_key(pod: TestClient) -> None:
    assert_problem(pod.get("/v2/catalog/gpus"), 401)


# --- placement ---------------------------------------------------------------------------------------


def test_placement_takes_the_first_allowed_datacenter_with_stock_of_a_pool() -> None:
    spec = {"gpu": {"pools": ["ADA_24"]}, "dataCenterIds": ["EU-RO-1", "US-CA-2"]}
    assert place(spec, lambda pool, dc: True).data_center_id == "EU-RO-1"
    out_in_ro = place(spec, lambda pool, dc: dc != "EU-RO-1")
    assert (out_in_ro.data_center_id, out_in_ro.pool, out_in_ro.gpu_type_id) == ("US-CA-2", "ADA_24", RTX_4090)
    assert place(spec, lambda pool, dc: dc == "US-TX-3") is None  # stock only where it is not allowed


def test_placement_skips_datacenters_that_offer_only_excluded_types() -> None:
    a100_sxm = {"gpu": {"pools": ["AMPERE_80"], "excludedTypes": ["NVIDIA A100 80GB PCIe"]},
                "dataCenterIds": ["US-CA-2", "EU-CZ-1", "US-KS-2"]}
    placed = place(a100_sxm, lambda pool, dc: True)
    assert (placed.data_center_id, placed.gpu_type_id) == ("US-KS-2", "NVIDIA A100-SXM4-80GB")


def test_the_h100_pool_holds_the_sxm_card_alone_as_runpods_sdk_maps_it(pod: TestClient) -> None:
    pools = {g["id"]: g["pool"] for g in gpus(pod)}
    assert [card for card, pool in pools.items() if pool == "ADA_80_PRO"] == ["NVIDIA H100 80GB HBM3"]
    assert pools["NVIDIA H100 PCIe"] is None and pools["NVIDIA H100 NVL"] is None  # pod cards, in no serverless pool


def test_an_excluded_type_outside_the_listed_pools_is_refused_with_400_naming_it(pod: TestClient) -> None:
    body = {"gpu": {"pools": ["ADA_80_PRO"], "excludedTypes": ["NVIDIA H100 PCIe", "NVIDIA H100 NVL"]}}
    problem = assert_problem(pod.post("/v2/serverless", json=endpoint_body(**body), headers=AUTH), 400)
    assert "NVIDIA H100 NVL, NVIDIA H100 PCIe" in problem["detail"] and "ADA_80_PRO" in problem["detail"]
    assert not account(pod).live_endpoints


def test_an_excluded_type_of_the_pool_is_taken_whitespace_trimmed(pod: TestClient) -> None:
    body = {"gpu": {"pools": ["AMPERE_80"], "excludedTypes": [" NVIDIA A100 80GB PCIe"]}}
    assert pod.post("/v2/serverless", json=endpoint_body(**body), headers=AUTH).status_code == 201


def test_a_selection_that_excludes_every_type_of_its_pools_is_refused(pod: TestClient) -> None:
    body = {"gpu": {"pools": ["ADA_80_PRO"], "excludedTypes": ["NVIDIA H100 80GB HBM3"]}}
    problem = assert_problem(pod.post("/v2/serverless", json=endpoint_body(**body), headers=AUTH), 400)
    assert "keep at least one" in problem["detail"]


def test_a_datacenter_that_does_not_offer_the_pool_places_nothing() -> None:
    assert place({"gpu": {"pools": ["ADA_24"]}, "dataCenterIds": ["US-KS-2"]}, lambda p, d: True) is None
    assert place({"gpu": {"pools": ["ADA_24"]}, "dataCenterIds": ["US-TX-9"]}, lambda p, d: True) is None


def test_a_worker_starts_in_an_allowed_datacenter_with_stock_and_is_told_which(pod: TestClient) -> None:
    stock(pod, "ADA_24", False, "EU-RO-1")
    endpoint = gpu_endpoint(pod, dataCenterIds=["EU-RO-1", "US-CA-2"])
    worker = wait_for(lambda: next((w for w in account(pod).workers if w.endpoint_id == endpoint["id"]), None),
                      "the endpoint's worker")
    assert worker.placement is not None and worker.placement.data_center_id == "US-CA-2"
    assert worker.placement.pool == "ADA_24"
    told = Path(worker.log_path).parent / "disks" / worker.id / "dc.txt"  # the worker's own scratch folder
    assert wait_for(lambda: told.exists() and told.read_text(), "the worker's RUNPOD_DC_ID") == "US-CA-2"


def test_no_worker_starts_while_no_allowed_datacenter_has_stock(pod: TestClient) -> None:
    stock(pod, "ADA_24", False, "EU-RO-1")
    endpoint = create_endpoint(pod, dataCenterIds=["EU-RO-1"], workers={"max": 1})
    pod.post(f"/v2/{endpoint['id']}/run", json={"input": {}}, headers=AUTH).raise_for_status()
    health = wait_for(lambda: pod.get(f"/v2/{endpoint['id']}/health", headers=AUTH).json(), "health")
    assert health["workers"]["throttled"] == 1
    assert not [w for w in account(pod).workers if w.endpoint_id == endpoint["id"]]
    stock(pod, "ADA_24", True, "EU-RO-1")
    worker = wait_for(lambda: next((w for w in account(pod).workers if w.endpoint_id == endpoint["id"]), None),
                      "a worker once EU-RO-1 is restocked")
    assert worker.placement is not None and worker.placement.data_center_id == "EU-RO-1"


# --- billing -----------------------------------------------------------------------------------------


def test_billing_charges_worker_seconds_at_the_pools_serverless_price(pod: TestClient) -> None:
    endpoint = gpu_endpoint(pod, gpu={"pools": ["AMPERE_80"], "count": 2})
    wait_for(lambda: [w for w in account(pod).workers if w.endpoint_id == endpoint["id"]], "the worker")
    assert pod.delete(f"/v2/serverless/{endpoint['id']}", headers=AUTH).status_code == 204
    [worker] = wait_for(lambda: [w for w in account(pod).workers if w.endpoint_id == endpoint["id"] and w.ended_at],
                        "the worker to end", timeout=30)
    answer = pod.get("/v2/billing/serverless", params={"serverlessId": endpoint["id"], "bucketSize": "hour"},
                     headers=AUTH)
    assert answer.status_code == 200 and SCHEMAS.errors("ListServerlessBillingResponse", answer.json()) == []
    billed = sum(r["totalAmount"] for r in answer.json()["records"])
    seconds = (worker.ended_at - worker.started_at).total_seconds()
    assert billed == pytest.approx(seconds * 2 * POOL_SERVERLESS_USD_PER_HOUR["AMPERE_80"] / 3600, abs=2e-6)
    assert {r["serverlessId"] for r in answer.json()["records"]} == {endpoint["id"]}
    assert answer.json()["metadata"]["totals"]["totalAmount"] == pytest.approx(billed)


def test_billing_of_an_account_without_workers_is_empty_over_a_bucket_aligned_window(pod: TestClient) -> None:
    answer = pod.get("/v2/billing/serverless", params={"startTime": "2026-06-01T10:30:00Z",
                                                       "endTime": "2026-06-03T01:00:00Z"}, headers=AUTH)
    assert answer.status_code == 200 and SCHEMAS.errors("ListServerlessBillingResponse", answer.json()) == []
    assert answer.json()["records"] == []
    assert answer.json()["metadata"]["query"] == {"startTime": "2026-06-01T00:00:00Z",
                                                  "endTime": "2026-06-04T00:00:00Z", "bucketSize": "day",
                                                  "serverlessId": None}


@pytest.mark.parametrize(("params", "complaint"), [
    ({"lastN": "3", "startTime": "2026-06-01T00:00:00Z"}, "mutually exclusive"),
    ({"bucketSize": "fortnight"}, "BillingBucketSize"),
    ({"startTime": "2026-06-01"}, "time zone"),
])
def test_billing_queries_runpod_would_refuse_are_refused(pod: TestClient, params, complaint) -> None:
    body = assert_problem(pod.get("/v2/billing/serverless", params=params, headers=AUTH), 400)
    assert complaint in body["detail"]
