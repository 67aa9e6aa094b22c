"""The `preload` flow on the local stack: a real Prefect server, localpod's catalog (GPU and CPU stock, volume
tiers), network volumes and CPU endpoints, the real worker in preload mode, and the Hub stand-in counting what
it serves."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest
from huggingface_hub import HfApi

from tasks.preflight.chats import TOKENIZER_FILES
from tasks.runpod.catalog import GPU_CLASSES
from tasks.runpod.endpoints import run_hash
from tests.conftest import REPO, localpod_account, prefect_api, run_train_flow
from tests.test_train_e2e import write_run_file

pytestmark = pytest.mark.timeout(900)

MODEL = "acme/tiny-preload"
EXCLUDED = ("original/consolidated.pth", "model.gguf")


def run_preload(stack, spec: dict, timeout_s: float = 600) -> tuple[int, str, str | None]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "RUNPOD_"))} | stack.client_env
    proc = subprocess.run([sys.executable, "-m", "flows.preload", json.dumps(spec)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout_s)
    output = proc.stdout + proc.stderr
    match = re.search(r"flow run ([0-9a-f-]{36}):", output)
    return proc.returncode, output, match.group(1) if match else None


def sweep_table(stack, flow_run_id: str) -> dict[str, dict]:
    [artifact] = prefect_api(stack, "POST", "/artifacts/filter", json={
        "artifacts": {"flow_run_id": {"any_": [flow_run_id]}, "key": {"any_": ["preload-sweep"]}}}).json()
    rows = artifact["data"] if isinstance(artifact["data"], list) else json.loads(artifact["data"])
    return {row["datacenter"]: row for row in rows}


def set_stock(stack, data_center: str, available: bool) -> None:
    for pool in sorted({g.pool for g in GPU_CLASSES.values()}):
        httpx.post(f"{stack.localpod_url}/_localpod/stock", json={"pool": pool, "available": available,
                                                                   "data_center_id": data_center}, timeout=10)


@pytest.fixture
def hub_model(local_stack, tiny_model, request):
    """A model repo of the tiny model, of its own per test and per session: no test finds another's warm weights,
    nor a cold worker the blobs an earlier session left in this machine's Hugging Face cache (localpod's
    workers share it, and the Hub client links a blob it already holds instead of downloading it)."""
    label = request.node.name.removeprefix('test_')[:40].replace('_', '-').strip('-')
    model = f"{MODEL}-{label}-{uuid.uuid4().hex[:6]}"
    api = HfApi(endpoint=local_stack.hub_url, token=local_stack.client_env["HF_TOKEN"])
    api.create_repo(model, exist_ok=True)
    api.upload_folder(repo_id=model, folder_path=str(tiny_model), commit_message="tiny model")
    for name in EXCLUDED:  # files no training reads: never downloaded
        api.upload_file(path_or_fileobj=b"\0" * 1000, path_in_repo=name, repo_id=model)
    return model


def test_a_sweep_warms_the_datacenters_with_stock_on_cpus_and_a_second_finds_everything_cached(local_stack, hub_model):
    set_stock(local_stack, "EU-CZ-1", available=False)  # it offers no CPU flavor: a GPU or nothing
    try:
        code, output, run_id = run_preload(local_stack, {
            "models": [{"id": hub_model}], "data_centers": ["EU-RO-1", "US-CA-2", "EU-CZ-1"],
            "minutes_per_data_center": 10, "queue_minutes": 3})
    finally:
        set_stock(local_stack, "EU-CZ-1", available=True)
    assert code == 1 and run_id, output[-5000:]  # not every datacenter is ok: the sweep fails, after all ran
    table = sweep_table(local_stack, run_id)
    total = table.pop("total")
    assert {dc: row["status"] for dc, row in table.items()} == {"EU-RO-1": "ok", "US-CA-2": "ok",
                                                                 "EU-CZ-1": "no_capacity"}, table
    assert table["EU-RO-1"]["downloaded"] == hub_model and table["EU-RO-1"]["MB downloaded"] > 0
    # A download needs no GPU: both ran on a CPU flavor, and their endpoints were deleted.
    assert all(table[dc]["compute"].startswith("CPU ") and table[dc]["teardown"] == "deleted"
               for dc in ("EU-RO-1", "US-CA-2")), table
    # Storage: each 10 GB volume at RunPod's $0.07/GB-month, and the total over this control plane's volumes.
    assert table["EU-RO-1"]["storage $/month"] == "0.70" and float(total["storage $/month"]) >= 1.40
    assert "budget max_storage_usd_per_month $20.00" in total["note"]

    account = localpod_account(local_stack)
    assert not account["liveEndpoints"], account["liveEndpoints"]
    cpu_endpoints = [e for e in account["endpoints"] if e["name"].startswith("loraflow-preload-")
                     and run_hash(run_id) in e["name"]]
    assert len(cpu_endpoints) == 2, cpu_endpoints
    volumes = {v["dataCenter"]: v for v in account["volumes"] if v["name"].startswith("loraflow-cache-")}
    assert set(volumes) >= {"EU-RO-1", "US-CA-2"} and "EU-CZ-1" not in volumes
    assert {volumes[dc]["type"] for dc in ("EU-RO-1", "US-CA-2")} == {"STANDARD"}
    kept = {p.name for p in Path(volumes["EU-RO-1"]["path"]).rglob("*") if p.is_file()}
    assert "config.json" in kept and not kept & {Path(name).name for name in EXCLUDED}, kept

    code, output, run_id = run_preload(local_stack, {
        "models": [{"id": hub_model}], "data_centers": ["EU-RO-1", "US-CA-2"], "minutes_per_data_center": 10})
    assert code == 0, output[-5000:]
    table = sweep_table(local_stack, run_id)
    table.pop("total")
    assert all(row["already cached"] == hub_model and row["MB downloaded"] == 0 for row in table.values()), table


def test_a_run_after_a_sweep_trains_where_the_weights_are_warm_and_downloads_none(local_stack, hub_model, tmp_path):
    code, output, _ = run_preload(local_stack, {"models": [{"id": hub_model}], "data_centers": ["EU-RO-1"],
                                                "minutes_per_data_center": 10})
    assert code == 0, output[-5000:]
    served_before = files_served(local_stack, hub_model)
    run = run_train_flow(local_stack, hub_run_file(tmp_path, "e2e-warm", hub_model))
    assert run.returncode == 0, run.output[-5000:]
    assert "weights warm in EU-RO-1" in run.output, run.output[-3000:]
    assert placements(local_stack, "e2e-warm") == ["EU-RO-1"]
    # Every weight came from the volume; the files the Hub served are those the control plane reads before renting
    # (none, when its own Hub cache already has them).
    assert files_served(local_stack, hub_model) <= served_before + control_plane_reads(local_stack, hub_model)

    # With no datacenters named, a sweep warms where this control plane's training ran: the run just placed.
    code, output, run_id = run_preload(local_stack, {"models": [{"id": hub_model}], "max_default_data_centers": 1,
                                                     "minutes_per_data_center": 10})
    assert code == 0, output[-5000:]
    table = sweep_table(local_stack, run_id)
    assert set(table) == {"EU-RO-1", "total"} and table["EU-RO-1"]["already cached"] == hub_model, table
    assert "where this control plane's training ran in the last 14 days" in table["total"]["note"]

    # The volume deleted under its warm record (as by hand, or by the volumes flow): the next run goes cold.
    for volume in [v for v in localpod_account(local_stack)["volumes"] if v["dataCenter"] == "EU-RO-1"]:
        answer = httpx.delete(f"{local_stack.localpod_url}/v2/network-volumes/{volume['id']}", timeout=10,
                              headers={"Authorization": f"Bearer {local_stack.client_env['RUNPOD_API_KEY']}"})
        assert answer.status_code == 204, answer.text
    run = run_train_flow(local_stack, hub_run_file(tmp_path, "e2e-gone", hub_model))
    assert run.returncode == 0, run.output[-5000:]
    assert "no longer exists: record cleared" in run.output and "weights warm" not in run.output, run.output[-3000:]
    # Downloaded from the Hub: a cold start.
    assert files_served(local_stack, hub_model) > served_before + control_plane_reads(local_stack, hub_model)


def test_with_the_warm_datacenter_out_of_stock_a_run_still_completes_cold(local_stack, hub_model, tmp_path):
    code, output, _ = run_preload(local_stack, {"models": [{"id": hub_model}], "data_centers": ["EU-RO-1"],
                                                "minutes_per_data_center": 10})
    assert code == 0, output[-5000:]
    set_stock(local_stack, "EU-RO-1", available=False)
    try:
        run = run_train_flow(local_stack, hub_run_file(tmp_path, "e2e-cold", hub_model))
    finally:
        set_stock(local_stack, "EU-RO-1", available=True)
    assert run.returncode == 0, run.output[-5000:]
    # The catalog shows no stock where the weights are warm: the run goes elsewhere and downloads them.
    assert "weights warm" not in run.output
    assert placements(local_stack, "e2e-cold") and "EU-RO-1" not in placements(local_stack, "e2e-cold")


def test_a_sweep_keeps_only_its_models_and_replaces_a_volume_larger_than_they_need(local_stack, hub_model, tiny_model):
    """One datacenter over three sweeps: a model dropped from the list is removed from the volume and its
    record; a volume grown far past the need is replaced by a right-sized one and deleted; a datacenter that
    offers only high-performance storage is skipped, without failing the sweep."""
    dropped = f"{hub_model}-dropped"
    api = HfApi(endpoint=local_stack.hub_url, token=local_stack.client_env["HF_TOKEN"])
    api.create_repo(dropped, exist_ok=True)
    api.upload_folder(repo_id=dropped, folder_path=str(tiny_model), commit_message="tiny model")
    sweep = {"data_centers": ["US-KS-2"], "minutes_per_data_center": 10}
    code, output, _ = run_preload(local_stack, sweep | {"models": [{"id": hub_model}, {"id": dropped}]})
    assert code == 0, output[-5000:]
    first = weight_cache_record(local_stack, "US-KS-2")
    assert set(first["models"]) == {hub_model, dropped}
    folder = volume_folder(local_stack, first["volume_id"])
    assert (folder / "huggingface" / "hub" / f"models--{dropped.replace('/', '--')}").is_dir()

    httpx.post(f"{local_stack.localpod_url}/_localpod/volume-types",
               json={"data_center_id": "US-CA-2", "types": ["HIGH_PERFORMANCE"]}, timeout=10).raise_for_status()
    try:
        code, output, run_id = run_preload(local_stack, sweep | {"models": [{"id": hub_model}],
                                                                 "data_centers": ["US-KS-2", "US-CA-2"]})
    finally:
        httpx.delete(f"{local_stack.localpod_url}/_localpod/volume-types", timeout=10).raise_for_status()
    assert code == 0, output[-5000:]
    table = sweep_table(local_stack, run_id)
    assert (table["US-KS-2"]["already cached"], table["US-KS-2"]["removed"]) == (hub_model, dropped), table
    assert table["US-CA-2"]["status"] == "skipped" and "offers only HIGH_PERFORMANCE storage" in table["US-CA-2"]["note"]
    assert not (folder / "huggingface" / "hub" / f"models--{dropped.replace('/', '--')}").exists()
    assert set(weight_cache_record(local_stack, "US-KS-2")["models"]) == {hub_model}

    pod_api = f"{local_stack.localpod_url}/v2/network-volumes/{first['volume_id']}"
    auth = {"Authorization": f"Bearer {local_stack.client_env['RUNPOD_API_KEY']}"}
    httpx.patch(pod_api, json={"size": 60}, headers=auth, timeout=10).raise_for_status()
    code, output, run_id = run_preload(local_stack, sweep | {"models": [{"id": hub_model}]})
    assert code == 0, output[-5000:]
    record = weight_cache_record(local_stack, "US-KS-2")
    assert record["volume_id"] != first["volume_id"] and record["volume_gb"] == 10 and set(record["models"]) == {hub_model}
    volumes = {v["id"]: v for v in localpod_account(local_stack)["volumes"]}
    assert first["volume_id"] not in volumes and volumes[record["volume_id"]]["type"] == "STANDARD"
    row = sweep_table(local_stack, run_id)["US-KS-2"]
    assert (row["downloaded"], row["volume_gb"], row["storage $/month"]) == (hub_model, 10, "0.70"), row
    assert f"old volume {first['volume_id']} (60 GB) replaced: deleted" in row["note"], row


def test_a_preload_whose_endpoint_cannot_be_deleted_keeps_its_slot_and_record_until_reconcile_settles_it(
        local_stack, hub_model, monkeypatch):
    """In this process, so the delete task's retries can be cut to one (its ~7 min schedule is the production
    one); everything else is the real flow against the stack."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    import tasks.jobs.rented as rented
    from flows.preload import PreloadSpec, preload
    from flows.reconcile import reconcile
    from flows.reconcile import ReconcilePolicy
    from tasks.lifecycle.teardown import undeleted_endpoints
    from tests.test_crash_recovery_e2e import live_endpoints, slots_in_use
    from tests.test_run_watch_e2e import leave_nothing_behind, localpod

    prefix = "loraflow-preload-eu-ro-1-"
    # The path every rented job takes deletes its endpoint (tasks/jobs/rented.py).
    monkeypatch.setattr(rented, "delete_endpoint", rented.delete_endpoint.with_options(retries=1, retry_delay_seconds=[0]))
    for key, value in local_stack.client_env.items():
        if not key.startswith("PREFECT_"):
            monkeypatch.setenv(key, value)
    pod = localpod(local_stack)
    rule = pod.post("/_localpod/faults", json={"route": "delete_endpoint", "action": "status_500", "probability": 1.0,
                                               "endpoint_name_prefix": prefix}).json()
    records = []
    with temporary_settings({PREFECT_API_URL: local_stack.prefect_api_url}):
        try:
            state = preload(PreloadSpec(models=[{"id": hub_model}], data_centers=["EU-RO-1"],
                                        minutes_per_data_center=10), return_state=True)
            assert state.is_completed(), state.message  # the model is warm: the endpoint is the reconciler's
            records = [r for r in undeleted_endpoints() if r.endpoint_name.startswith(prefix)]
            assert len(records) == 1 and records[0].lease_id is not None and "500" in records[0].error, records
            # The endpoint still lives, so it still holds a slot, after the sweep ended.
            assert [e["id"] for e in live_endpoints(local_stack, prefix)] == [records[0].endpoint_id]
            assert slots_in_use(local_stack) == 1

            pod.delete(f"/_localpod/faults/{rule['id']}")
            reconcile(ReconcilePolicy(min_age_minutes=24 * 60))  # settles records; deletes no other endpoint
            assert not live_endpoints(local_stack, prefix) and slots_in_use(local_stack) == 0
            assert [r for r in undeleted_endpoints() if r.endpoint_name.startswith(prefix)] == []
        finally:  # whatever failed above, leave no fault, endpoint, slot or record to the tests that follow
            leave_nothing_behind(local_stack, pod, prefix, rule["id"], records)


def weight_cache_record(stack, data_center: str) -> dict:
    return prefect_api(stack, "GET", f"/variables/name/loraflow-weight-cache-{data_center.lower()}").json()["value"]


def volume_folder(stack, volume_id: str) -> Path:
    return Path(next(v["path"] for v in localpod_account(stack)["volumes"] if v["id"] == volume_id))


def hub_run_file(tmp_path: Path, name: str, model: str) -> Path:
    run_file = write_run_file(tmp_path / f"{name}.toml", name=name, model=Path("unused"), store=tmp_path / "store",
                              max_steps=4)
    run_file.write_text(run_file.read_text().replace('id = "unused"', f'id = "{model}"'))
    return run_file


def files_served(stack, model_id: str) -> int:
    """File GETs the Hub stand-in served for the model (metadata requests and HEADs are not counted)."""
    return httpx.get(f"{stack.hub_url}/_hub/downloads/model/{model_id}", timeout=10).json()["count"]


def control_plane_reads(stack, model_id: str) -> int:
    """Files of the model a run's checks read from the Hub: config.json for the memory plan, the tokenizer's to render
    the first chats."""
    names = HfApi(endpoint=stack.hub_url, token=stack.client_env["HF_TOKEN"]).list_repo_files(model_id)
    return len({"config.json"} | {n for n in names if any(fnmatch.fnmatch(n, p) for p in TOKENIZER_FILES)})


def placements(stack, run_name: str) -> list[str]:
    """The datacenters the run's workers were placed in."""
    account = localpod_account(stack)
    endpoints = {e["id"] for e in account["endpoints"] if e["name"].startswith(f"loraflow-{run_name}-")}
    return [w["placement"]["dataCenterId"] for w in account["workers"]
            if w["endpointId"] in endpoints and w.get("placement")]
