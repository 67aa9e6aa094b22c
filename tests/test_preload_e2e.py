"""The `preload` flow on the local stack: a real Prefect server, localpod's catalog, stock and network
volumes, the real worker in preload mode, and the Hub stand-in counting what it serves."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from huggingface_hub import HfApi

from tasks.runpod.catalog import GPU_CLASSES
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
    """A model repo of the tiny model, of its own per test: no test finds another's warm weights."""
    model = f"{MODEL}-{request.node.name.removeprefix('test_')[:40].replace('_', '-').strip('-')}"
    api = HfApi(endpoint=local_stack.hub_url, token=local_stack.client_env["HF_TOKEN"])
    api.create_repo(model, exist_ok=True)
    api.upload_folder(repo_id=model, folder_path=str(tiny_model), commit_message="tiny model")
    for name in EXCLUDED:  # files no training reads: never downloaded
        api.upload_file(path_or_fileobj=b"\0" * 1000, path_in_repo=name, repo_id=model)
    return model


def test_a_sweep_warms_the_datacenters_with_stock_and_a_second_finds_everything_cached(local_stack, hub_model):
    set_stock(local_stack, "EU-CZ-1", available=False)
    try:
        code, output, run_id = run_preload(local_stack, {
            "models": [{"id": hub_model}], "data_centers": ["EU-RO-1", "US-CA-2", "EU-CZ-1"],
            "minutes_per_data_center": 10, "queue_minutes": 3})
    finally:
        set_stock(local_stack, "EU-CZ-1", available=True)
    assert code == 1 and run_id, output[-5000:]  # not every datacenter is ok: the sweep fails, after all ran
    table = sweep_table(local_stack, run_id)
    assert {dc: row["status"] for dc, row in table.items()} == {"EU-RO-1": "ok", "US-CA-2": "ok",
                                                                 "EU-CZ-1": "no_capacity"}, table
    assert table["EU-RO-1"]["downloaded"] == hub_model and table["EU-RO-1"]["MB downloaded"] > 0

    account = localpod_account(local_stack)
    assert not account["liveEndpoints"], account["liveEndpoints"]
    volumes = {v["dataCenter"]: Path(v["path"]) for v in account["volumes"]}
    assert set(volumes) >= {"EU-RO-1", "US-CA-2"} and "EU-CZ-1" not in volumes
    kept = {p.name for p in volumes["EU-RO-1"].rglob("*") if p.is_file()}
    assert "config.json" in kept and not kept & {Path(name).name for name in EXCLUDED}, kept

    code, output, run_id = run_preload(local_stack, {
        "models": [{"id": hub_model}], "data_centers": ["EU-RO-1", "US-CA-2"], "minutes_per_data_center": 10})
    assert code == 0, output[-5000:]
    table = sweep_table(local_stack, run_id)
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
    # Every weight came from the volume; the one file the Hub served is the config.json the control plane reads
    # for the memory plan (none, when its own Hub cache already has it).
    assert files_served(local_stack, hub_model) <= served_before + 1


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


def hub_run_file(tmp_path: Path, name: str, model: str) -> Path:
    run_file = write_run_file(tmp_path / f"{name}.toml", name=name, model=Path("unused"), store=tmp_path / "store",
                              max_steps=4)
    run_file.write_text(run_file.read_text().replace('id = "unused"', f'id = "{model}"'))
    return run_file


def files_served(stack, model_id: str) -> int:
    """File GETs the Hub stand-in served for the model (metadata requests and HEADs are not counted)."""
    return httpx.get(f"{stack.hub_url}/_hub/downloads/model/{model_id}", timeout=10).json()["count"]


def placements(stack, run_name: str) -> list[str]:
    """The datacenters the run's workers were placed in."""
    account = localpod_account(stack)
    endpoints = {e["id"] for e in account["endpoints"] if e["name"].startswith(f"loraflow-{run_name}-")}
    return [w["placement"]["dataCenterId"] for w in account["workers"]
            if w["endpointId"] in endpoints and w.get("placement")]
