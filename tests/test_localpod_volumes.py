"""localpod serves RunPod's network volumes (`/v2/network-volumes`) as the official schema and RunPod's rules
state them; each volume is a folder on this machine. An endpoint that attaches a volume has its workers
started in the volume's datacenter only, and each worker sees the volume: a docker worker at /runpod-volume,
a process worker through LORAFLOW_VOLUME_PATH.

Most tests drive the app in-process with endpoints that start no worker (`workers.max = 0`) and ask the
placement and the worker settings directly; one starts a real (sleeping) worker process.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from localpod import LocalpodConfig, create_app
from localpod.models import Account
from localpod.state.account import LocalpodState
from localpod.workers.supervisor import WorkerSupervisor
from tests.test_localpod import API_KEY, AUTH, SCHEMAS, assert_problem, create_endpoint, endpoint_body, wait_for
from tests.test_localpod_docker import docker_endpoint_spec, option_values, parse, worker_command

# A worker that writes the datacenter RunPod told it into its volume, then idles until it is stopped.
VOLUME_WORKER = ("import os, pathlib, time; pathlib.Path(os.environ['LORAFLOW_VOLUME_PATH'], 'dc.txt')"
                 ".write_text(os.environ['RUNPOD_DC_ID']); time.sleep(300)")
VOLUME_DATA_CENTERS = ("US-KS-2", "US-CA-2", "EU-RO-1", "EU-CZ-1")  # localpod's catalog: all but US-TX-3


def config(tmp_path: Path, **fields: Any) -> LocalpodConfig:
    return LocalpodConfig(api_key=API_KEY, worker_quota=10, log_dir=tmp_path / "logs", long_poll_s=0.2,
                          kill_grace_s=1, worker_command=[sys.executable, "-c", VOLUME_WORKER], **fields)


@pytest.fixture
def pod(tmp_path: Path) -> Iterator[TestClient]:
    with TestClient(create_app(config(tmp_path))) as c:
        yield c


def state_of(pod: TestClient) -> LocalpodState:
    return pod.app.state.localpod


def create_volume(pod: TestClient, **overrides: Any) -> dict[str, Any]:
    answer = pod.post("/v2/network-volumes", json={"name": "weights", "size": 50, "dataCenter": "EU-CZ-1", **overrides},
                      headers=AUTH)
    assert answer.status_code == 201, answer.text
    assert SCHEMAS.errors("NetworkVolume", answer.json()) == []
    return answer.json()


def account(pod: TestClient) -> Account:
    return Account.model_validate(pod.get("/_localpod/account").raise_for_status().json())


def folder(pod: TestClient, volume_id: str) -> Path:
    return Path(next(v.path for v in account(pod).volumes if v.id == volume_id))


def placement(pod: TestClient, endpoint_id: str) -> str | None:
    state = state_of(pod)
    placed = state.faults.place(state.endpoints[endpoint_id].spec)
    return placed.data_center_id if placed else None


def stock_out(pod: TestClient, pool: str, data_center_id: str) -> None:
    answer = pod.post("/_localpod/stock", json={"pool": pool, "available": False, "data_center_id": data_center_id})
    assert answer.status_code == 200, answer.text


# --- the volume routes -------------------------------------------------------------------------------


def test_a_created_volume_is_answered_by_id_and_listed(pod: TestClient) -> None:
    volume = create_volume(pod, name="weights", size=50, dataCenter="EU-RO-1")
    assert {k: volume[k] for k in ("name", "size", "dataCenter")} == {"name": "weights", "size": 50,
                                                                       "dataCenter": "EU-RO-1"}
    assert pod.get(f"/v2/network-volumes/{volume['id']}", headers=AUTH).json() == volume
    listed = pod.get("/v2/network-volumes", headers=AUTH).json()
    assert SCHEMAS.errors("ListNetworkVolumesResponse", listed) == []
    assert listed["networkVolumes"] == [volume]


def test_a_volume_is_an_empty_folder_from_its_creation(pod: TestClient) -> None:
    volume = create_volume(pod)
    path = folder(pod, volume["id"])
    assert path.is_dir() and not any(path.iterdir())


def test_an_omitted_type_is_the_datacenters_primary_tier(pod: TestClient) -> None:
    assert create_volume(pod, dataCenter="EU-RO-1")["type"] == "STANDARD"
    assert create_volume(pod, dataCenter="EU-RO-1", type="HIGH_PERFORMANCE")["type"] == "HIGH_PERFORMANCE"


def test_a_tier_the_datacenter_does_not_offer_is_refused(pod: TestClient) -> None:
    answer = pod.post("/v2/network-volumes", json={"name": "w", "size": 10, "dataCenter": "EU-CZ-1",
                                                   "type": "HIGH_PERFORMANCE"}, headers=AUTH)
    assert "only STANDARD" in assert_problem(answer, 400)["detail"]


def set_volume_types(pod: TestClient, data_center_id: str, types: list[str]) -> dict[str, list[str]]:
    answer = pod.post("/_localpod/volume-types", json={"data_center_id": data_center_id, "types": types})
    assert answer.status_code == 200, answer.text
    return answer.json()["network_volume_types"]


def catalog_tiers(pod: TestClient, data_center_id: str) -> list[str]:
    answer = pod.get(f"/v2/catalog/datacenters/{data_center_id}", headers=AUTH)
    assert answer.status_code == 200 and SCHEMAS.errors("DataCenter", answer.json()) == []
    return answer.json()["networkVolumeTypes"]


def test_a_datacenter_set_to_offer_only_high_performance_gives_it_by_default_and_refuses_standard(pod) -> None:
    set_volume_types(pod, "EU-RO-1", ["HIGH_PERFORMANCE"])
    assert catalog_tiers(pod, "EU-RO-1") == ["HIGH_PERFORMANCE"]
    assert create_volume(pod, dataCenter="EU-RO-1")["type"] == "HIGH_PERFORMANCE"
    answer = pod.post("/v2/network-volumes", json={"name": "w", "size": 10, "dataCenter": "EU-RO-1",
                                                   "type": "STANDARD"}, headers=AUTH)
    detail = assert_problem(answer, 400)["detail"]
    assert "no STANDARD" in detail and "only HIGH_PERFORMANCE" in detail


def test_the_primary_tier_is_the_first_a_datacenter_offers(pod: TestClient) -> None:
    set_volume_types(pod, "US-KS-2", ["HIGH_PERFORMANCE", "STANDARD"])
    assert create_volume(pod, dataCenter="US-KS-2")["type"] == "HIGH_PERFORMANCE"
    assert create_volume(pod, dataCenter="US-KS-2", type="STANDARD")["type"] == "STANDARD"


def test_the_datacenter_filter_on_tiers_follows_the_tiers_set(pod: TestClient) -> None:
    set_volume_types(pod, "EU-RO-1", ["HIGH_PERFORMANCE"])
    answer = pod.get("/v2/catalog/datacenters", params={"networkVolumeTypes": "STANDARD"}, headers=AUTH)
    assert "EU-RO-1" not in [dc["id"] for dc in answer.json()["dataCenters"]]


def test_a_datacenter_set_to_offer_no_tier_refuses_volumes(pod: TestClient) -> None:
    tiers = set_volume_types(pod, "EU-CZ-1", [])
    assert tiers["EU-CZ-1"] == [] and tiers["EU-RO-1"] == ["STANDARD", "HIGH_PERFORMANCE"]
    answer = pod.post("/v2/network-volumes", json={"name": "w", "size": 10, "dataCenter": "EU-CZ-1"}, headers=AUTH)
    assert "EU-CZ-1 does not support network volumes" in assert_problem(answer, 400)["detail"]


def test_deleting_the_tiers_set_restores_the_catalogs(pod: TestClient) -> None:
    set_volume_types(pod, "EU-RO-1", ["HIGH_PERFORMANCE"])
    assert pod.delete("/_localpod/volume-types").status_code == 204
    assert catalog_tiers(pod, "EU-RO-1") == ["STANDARD", "HIGH_PERFORMANCE"]
    assert pod.get("/_localpod/volume-types").json()["network_volume_types"]["EU-CZ-1"] == ["STANDARD"]


def test_a_volume_keeps_its_tier_when_its_datacenters_tiers_change(pod: TestClient) -> None:
    volume = create_volume(pod, dataCenter="EU-RO-1")
    set_volume_types(pod, "EU-RO-1", ["HIGH_PERFORMANCE"])
    assert pod.get(f"/v2/network-volumes/{volume['id']}", headers=AUTH).json()["type"] == "STANDARD"


@pytest.mark.parametrize(("body", "complaint"), [
    ({"data_center_id": "MARS-1", "types": ["STANDARD"]}, "MARS-1"),
    ({"data_center_id": "EU-RO-1", "types": ["FAST"]}, "types"),
    ({"data_center_id": "EU-RO-1", "types": ["STANDARD", "STANDARD"]}, "once"),
])
def test_tiers_set_for_an_unknown_datacenter_or_tier_are_refused(pod: TestClient, body, complaint) -> None:
    problem = assert_problem(pod.post("/_localpod/volume-types", json=body), 400)
    assert any(complaint in error for error in problem["errors"])


def test_names_need_not_be_unique(pod: TestClient) -> None:
    first, second = create_volume(pod, name="same"), create_volume(pod, name="same")
    assert first["id"] != second["id"]


@pytest.mark.parametrize("data_center", ["US-TX-3", "US-MO-9"])
def test_a_datacenter_without_network_volumes_is_refused_naming_those_with_them(pod: TestClient, data_center) -> None:
    answer = pod.post("/v2/network-volumes", json={"name": "w", "size": 10, "dataCenter": data_center}, headers=AUTH)
    detail = assert_problem(answer, 400)["detail"]
    assert data_center in detail and all(dc in detail for dc in VOLUME_DATA_CENTERS)
    assert pod.get("/v2/network-volumes", headers=AUTH).json() == {"networkVolumes": []}


@pytest.mark.parametrize("size", [9, 4097])
def test_sizes_outside_10_to_4096_gb_are_refused(pod: TestClient, size: int) -> None:
    answer = pod.post("/v2/network-volumes", json={"name": "w", "size": size, "dataCenter": "EU-RO-1"}, headers=AUTH)
    assert "CreateNetworkVolumeRequest" in assert_problem(answer, 400)["detail"]


def test_fields_the_schema_does_not_know_are_refused(pod: TestClient) -> None:
    # `dataCenterId` is the datacenter's name elsewhere in the API, not here.
    answer = pod.post("/v2/network-volumes", json={"name": "w", "size": 10, "dataCenterId": "EU-RO-1"}, headers=AUTH)
    assert_problem(answer, 400)


def test_a_volume_grows_and_is_renamed(pod: TestClient) -> None:
    volume = create_volume(pod, size=50)
    answer = pod.patch(f"/v2/network-volumes/{volume['id']}", json={"size": 200, "name": "bigger"}, headers=AUTH)
    assert answer.status_code == 200, answer.text
    assert SCHEMAS.errors("NetworkVolume", answer.json()) == []
    assert (answer.json()["size"], answer.json()["name"]) == (200, "bigger")
    assert pod.get(f"/v2/network-volumes/{volume['id']}", headers=AUTH).json()["size"] == 200


def test_a_volume_never_shrinks_and_the_refusal_names_its_size(pod: TestClient) -> None:
    volume = create_volume(pod, size=50)
    answer = pod.patch(f"/v2/network-volumes/{volume['id']}", json={"size": 40}, headers=AUTH)
    assert "50 GB" in assert_problem(answer, 400)["detail"]
    assert pod.get(f"/v2/network-volumes/{volume['id']}", headers=AUTH).json()["size"] == 50


def test_an_empty_patch_is_refused(pod: TestClient) -> None:
    volume = create_volume(pod)
    assert_problem(pod.patch(f"/v2/network-volumes/{volume['id']}", json={}, headers=AUTH), 400)


def test_a_deleted_volume_is_gone_with_its_folder(pod: TestClient) -> None:
    volume = create_volume(pod)
    path = folder(pod, volume["id"])
    (path / "model.safetensors").write_text("weights")
    assert pod.delete(f"/v2/network-volumes/{volume['id']}", headers=AUTH).status_code == 204
    assert_problem(pod.get(f"/v2/network-volumes/{volume['id']}", headers=AUTH), 404)
    assert not path.exists()


@pytest.mark.parametrize("method", ["GET", "PATCH", "DELETE"])
def test_an_unknown_volume_is_404(pod: TestClient, method: str) -> None:
    body = {"size": 20} if method == "PATCH" else None
    assert_problem(pod.request(method, "/v2/network-volumes/nosuchvol1", json=body, headers=AUTH), 404)


def test_the_volume_routes_need_the_account_key(pod: TestClient) -> None:
    assert_problem(pod.get("/v2/network-volumes"), 401)


def test_route_faults_reach_the_volume_routes(pod: TestClient) -> None:
    pod.post("/_localpod/faults", json={"route": "list_network_volumes", "action": "status_429"}).raise_for_status()
    assert_problem(pod.get("/v2/network-volumes", headers=AUTH), 429)
    assert pod.get("/v2/network-volumes", headers=AUTH).status_code == 200


def test_the_account_lists_each_volume_with_its_folder(pod: TestClient) -> None:
    volume = create_volume(pod, name="weights", size=30, dataCenter="US-CA-2")
    [listed] = account(pod).volumes
    assert (listed.id, listed.name, listed.data_center, listed.size) == (volume["id"], "weights", "US-CA-2", 30)
    assert listed.type == "STANDARD"
    assert Path(listed.path).is_dir()


# --- a datacenter where creating a volume fails ------------------------------------------------------


def test_creating_a_volume_where_creation_is_set_to_fail_answers_500_and_creates_nothing(tmp_path: Path) -> None:
    with TestClient(create_app(config(tmp_path, volume_create_fails_in=["EU-CZ-1"]))) as pod:
        answer = pod.post("/v2/network-volumes", json={"name": "w", "size": 10, "dataCenter": "EU-CZ-1"}, headers=AUTH)
        assert "EU-CZ-1" in assert_problem(answer, 500)["detail"]
        assert pod.get("/v2/network-volumes", headers=AUTH).json() == {"networkVolumes": []}
        assert account(pod).faults_injected["status_500"] == 1
        create_volume(pod, dataCenter="EU-RO-1")  # other datacenters are unaffected


def test_the_volume_settings_come_from_the_command_line(tmp_path: Path) -> None:
    settings = parse("--worker-command", "true", "--log-dir", str(tmp_path), "--volume-dir", str(tmp_path / "vols"),
                     "--volume-create-fails-in", "EU-CZ-1", "--volume-create-fails-in", "US-KS-2")
    assert settings.volume_dir == tmp_path / "vols"
    assert settings.volume_create_fails_in == ["EU-CZ-1", "US-KS-2"]
    assert parse("--worker-command", "true", "--log-dir", str(tmp_path)).volume_dir == tmp_path / "volumes"


def test_creation_can_be_set_to_fail_only_in_a_datacenter_that_has_volumes(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="EU-RO-1"):
        config(tmp_path, volume_create_fails_in=["US-TX-3"])


# --- endpoints that attach a volume ------------------------------------------------------------------


def test_a_volume_an_endpoint_attaches_is_deleted_when_asked_as_runpods_schema_allows(pod: TestClient) -> None:
    volume = create_volume(pod)
    endpoint = create_endpoint(pod, networkVolumes=[volume["id"]])
    path = folder(pod, volume["id"])
    assert pod.delete(f"/v2/network-volumes/{volume['id']}", headers=AUTH).status_code == 204
    assert pod.get(f"/v2/network-volumes/{volume['id']}", headers=AUTH).status_code == 404
    assert not path.exists()
    # The endpoint still names the volume, as it would on RunPod.
    assert pod.get(f"/v2/serverless/{endpoint['id']}", headers=AUTH).json()["networkVolumes"] == [volume["id"]]


def test_no_worker_starts_for_an_endpoint_whose_volume_was_deleted_and_health_says_throttled(pod: TestClient) -> None:
    volume = create_volume(pod)
    endpoint = create_endpoint(pod, networkVolumes=[volume["id"]], workers={"max": 1})
    pod.delete(f"/v2/network-volumes/{volume['id']}", headers=AUTH).raise_for_status()
    assert placement(pod, endpoint["id"]) is None
    reason = state_of(pod).faults.unplaceable_reason(state_of(pod).endpoints[endpoint["id"]].spec)
    assert volume["id"] in reason and "deleted" in reason
    pod.post(f"/v2/{endpoint['id']}/run", json={"input": {}}, headers=AUTH).raise_for_status()
    assert pod.get(f"/v2/{endpoint['id']}/health", headers=AUTH).json()["workers"]["throttled"] == 1


def test_once_its_endpoint_is_deleted_the_volume_can_be(pod: TestClient) -> None:
    volume = create_volume(pod)
    endpoint = create_endpoint(pod, networkVolumes=[volume["id"]])
    assert pod.delete(f"/v2/serverless/{endpoint['id']}", headers=AUTH).status_code == 204
    assert pod.delete(f"/v2/network-volumes/{volume['id']}", headers=AUTH).status_code == 204


def test_an_endpoint_attaching_an_unknown_volume_is_refused(pod: TestClient) -> None:
    answer = pod.post("/v2/serverless", json=endpoint_body(networkVolumes=["nosuchvol1"]), headers=AUTH)
    assert "nosuchvol1" in assert_problem(answer, 400)["detail"]


def test_an_endpoint_patched_onto_an_unknown_volume_is_refused(pod: TestClient) -> None:
    endpoint = create_endpoint(pod)
    answer = pod.patch(f"/v2/serverless/{endpoint['id']}", json={"networkVolumes": ["nosuchvol1"]}, headers=AUTH)
    assert "nosuchvol1" in assert_problem(answer, 400)["detail"]


def test_an_endpoint_attaching_volumes_in_two_datacenters_is_refused(pod: TestClient) -> None:
    ro, cz = create_volume(pod, dataCenter="EU-RO-1"), create_volume(pod, dataCenter="EU-CZ-1")
    answer = pod.post("/v2/serverless", json=endpoint_body(networkVolumes=[ro["id"], cz["id"]]), headers=AUTH)
    detail = assert_problem(answer, 400)["detail"]
    assert "EU-RO-1" in detail and "EU-CZ-1" in detail


def test_an_endpoint_attaching_two_volumes_of_one_datacenter_is_refused(pod: TestClient) -> None:
    first, second = create_volume(pod), create_volume(pod)  # a worker mounts one volume, at /runpod-volume
    answer = pod.post("/v2/serverless", json=endpoint_body(networkVolumes=[first["id"], second["id"]]), headers=AUTH)
    assert "one network volume" in assert_problem(answer, 400)["detail"]


def test_an_endpoint_with_a_volume_is_placed_in_the_volumes_datacenter_only(pod: TestClient) -> None:
    volume = create_volume(pod, dataCenter="EU-CZ-1")
    assert placement(pod, create_endpoint(pod)["id"]) == "US-CA-2"  # the first in the catalog with RTX 4090s
    assert placement(pod, create_endpoint(pod, networkVolumes=[volume["id"]])["id"]) == "EU-CZ-1"


def test_with_the_volumes_datacenter_out_of_stock_no_worker_is_placed(pod: TestClient) -> None:
    volume = create_volume(pod, dataCenter="EU-CZ-1")
    endpoint = create_endpoint(pod, networkVolumes=[volume["id"]], workers={"max": 1})
    stock_out(pod, "ADA_24", "EU-CZ-1")
    assert placement(pod, endpoint["id"]) is None  # other datacenters still stock RTX 4090s
    pod.post(f"/v2/{endpoint['id']}/run", json={"input": {}}, headers=AUTH).raise_for_status()
    assert pod.get(f"/v2/{endpoint['id']}/health", headers=AUTH).json()["workers"]["throttled"] == 1


def test_allowed_datacenters_without_the_volumes_place_nothing(pod: TestClient) -> None:
    volume = create_volume(pod, dataCenter="EU-CZ-1")
    endpoint = create_endpoint(pod, networkVolumes=[volume["id"]], dataCenterIds=["US-CA-2"])
    assert placement(pod, endpoint["id"]) is None


def test_a_process_worker_is_told_its_volumes_folder(pod: TestClient) -> None:
    volume = create_volume(pod)
    endpoint = create_endpoint(pod, networkVolumes=[volume["id"]])
    state = state_of(pod)
    env = WorkerSupervisor(state).runpod_env(state.endpoints[endpoint["id"]], "worker1", "worker-key")
    assert env["LORAFLOW_VOLUME_PATH"] == str(folder(pod, volume["id"]))


def test_a_process_worker_of_an_endpoint_without_a_volume_is_told_of_none(pod: TestClient) -> None:
    endpoint = create_endpoint(pod)
    state = state_of(pod)
    assert "LORAFLOW_VOLUME_PATH" not in WorkerSupervisor(state).runpod_env(state.endpoints[endpoint["id"]], "w", "k")


def test_a_worker_starts_in_its_volumes_datacenter_and_writes_into_the_volume(pod: TestClient) -> None:
    volume = create_volume(pod, dataCenter="EU-RO-1")
    create_endpoint(pod, networkVolumes=[volume["id"]], workers={"min": 1, "max": 1})
    written = folder(pod, volume["id"]) / "dc.txt"
    assert wait_for(lambda: written.exists() and written.read_text(), "the worker's RUNPOD_DC_ID") == "EU-RO-1"


# --- docker workers ----------------------------------------------------------------------------------


@pytest.fixture
def docker_state(tmp_path: Path) -> LocalpodState:
    config = LocalpodConfig(api_key=API_KEY, port=18765, log_dir=tmp_path / "logs", worker_runtime="docker")
    return create_app(config).state.localpod


def test_a_docker_worker_has_the_volume_mounted_at_runpod_volume(docker_state: LocalpodState) -> None:
    volume = docker_state.volumes.create("weights", 50, "EU-RO-1", None)
    command, env, _ = worker_command(docker_state, docker_endpoint_spec(networkVolumes=[volume.id]))
    assert f"{volume.path}:/runpod-volume" in option_values(command, "--volume")
    assert "LORAFLOW_VOLUME_PATH" not in env  # the mount is where RunPod puts it: nothing to be told


def test_a_docker_worker_of_an_endpoint_without_a_volume_mounts_none(docker_state: LocalpodState) -> None:
    command, _, _ = worker_command(docker_state, docker_endpoint_spec())
    assert not any(v.endswith(":/runpod-volume") for v in option_values(command, "--volume"))
