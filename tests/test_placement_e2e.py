"""Placement on the local stack, with localpod's hosts set through `/_localpod/cuda`: a run rents only where
some host runs the worker image's CUDA (13.0: its torch build), or is refused before anything exists; a
preload, which needs no CUDA, runs on hosts of any driver."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
from loraflow_worker.contract import CONTRACT_VERSION

from tests.conftest import REPO, localpod_account, prefect_api, run_train_flow
from tests.test_preload_e2e import hub_run_file, placements, run_preload, sweep_table
from tests.test_train_e2e import flow_run_state, run_endpoints

pytestmark = pytest.mark.timeout(900)

OLD_DRIVERS = ["12.4", "12.6", "12.8"]
"""Hosts whose NVIDIA driver stops short of CUDA 13.0: the worker image's torch cannot run there."""


@contextmanager
def hosts(stack, *changes: dict) -> Iterator[None]:
    """localpod's hosts changed as `POST /_localpod/cuda` bodies say, restored to its defaults afterwards."""
    try:
        for change in changes:
            httpx.post(f"{stack.localpod_url}/_localpod/cuda", json=change, timeout=10).raise_for_status()
        yield
    finally:
        httpx.delete(f"{stack.localpod_url}/_localpod/cuda", timeout=10).raise_for_status()


@pytest.fixture
def hub_model(local_stack, tiny_model):
    from huggingface_hub import HfApi

    model = "acme/tiny-placement"
    api = HfApi(endpoint=local_stack.hub_url, token=local_stack.client_env["HF_TOKEN"])
    api.create_repo(model, exist_ok=True)
    api.upload_folder(repo_id=model, folder_path=str(tiny_model), commit_message="tiny model")
    return model


def test_a_run_no_host_can_serve_is_refused_before_any_endpoint_exists_naming_cuda(local_stack, tiny_model, tmp_path):
    with hosts(local_stack, {"pool": "ADA_24", "versions": OLD_DRIVERS}):
        run = run_train_flow(local_stack, hub_run_file(tmp_path, "e2e-nocuda", str(tiny_model)))
    assert run.returncode == 1
    message = flow_run_state(local_stack, run.flow_run_id)["message"]
    assert "NoHostForImage" in message, message
    assert "RTX 4090: hosts run CUDA 12.4, 12.6, 12.8; needs >= 13.0" in message, message
    assert "compute.gpu" in message and "LORAFLOW_IMAGE_MIN_CUDA" in message, message
    assert run_endpoints(local_stack, "e2e-nocuda") == []


def test_a_run_whose_image_speaks_another_contract_is_refused_before_any_endpoint_exists(local_stack, tiny_model,
                                                                                       tmp_path):
    stale = f"registry.example/loraflow-worker:0.0.9-contract{CONTRACT_VERSION - 1}-cu130-sm90"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "RUNPOD_"))} | local_stack.client_env
    proc = subprocess.run([sys.executable, "-m", "flows.train", str(hub_run_file(tmp_path, "e2e-stale", str(tiny_model)))],
                          cwd=REPO, env=env | {"LORAFLOW_WORKER_IMAGE": stale}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    output = proc.stdout + proc.stderr
    assert "ImageContractError" in output and f"contract version {CONTRACT_VERSION - 1}" in output, output[-3000:]
    assert "make image" in output
    assert run_endpoints(local_stack, "e2e-stale") == []


def test_preload_needs_no_cuda_floor_and_a_run_lands_only_where_hosts_meet_its_floor(local_stack, hub_model, tmp_path):
    # The 4090's hosts run CUDA 13.0 in EU-CZ-1 only (US-TX-3's are old by default); EU-RO-1's hosts are all old.
    with hosts(local_stack, {"data_center_id": "EU-RO-1", "versions": ["12.4"]},
               {"pool": "ADA_24", "data_center_id": "US-CA-2", "versions": OLD_DRIVERS}):
        code, output, sweep_id = run_preload(local_stack, {"models": [{"id": hub_model}], "data_centers": ["EU-RO-1"],
                                                           "minutes_per_data_center": 10, "queue_minutes": 3})
        assert code == 0, output[-5000:]
        assert sweep_table(local_stack, sweep_id)["EU-RO-1"]["status"] == "ok"
        run = run_train_flow(local_stack, hub_run_file(tmp_path, "e2e-hosts", hub_model))
    assert run.returncode == 0, run.output[-5000:]
    # The weights are warm in EU-RO-1, but no host there runs the image: the run goes cold where one does.
    assert "weights warm" not in run.output, run.output[-3000:]
    assert placements(local_stack, "e2e-hosts") == ["EU-CZ-1"]
    assert "Not renting" not in run.output  # the 4090 has such hosts: nothing was excluded
    assert not localpod_account(local_stack)["liveEndpoints"]


def test_a_run_whose_memory_plan_fits_no_gpu_of_its_list_is_refused_before_any_endpoint_exists(local_stack, tmp_path):
    # A Llama-3.1-70B-shaped model (its config.json only: the plan reads nothing else) on an RTX 4090 and an H100.
    model = tmp_path / "llama-70b-config"
    model.mkdir()
    shutil.copy(REPO / "worker_image" / "tests" / "model_configs" / "llama-3.1-70b" / "config.json", model)
    run_file = hub_run_file(tmp_path, "e2e-toobig", str(model))
    run_file.write_text(run_file.read_text() + '[compute]\ngpu = ["RTX 4090", "H100"]\n')
    run = run_train_flow(local_stack, run_file)
    assert run.returncode == 1
    message = flow_run_state(local_stack, run.flow_run_id)["message"]
    assert "NoGpuFits" in message and "RTX 4090 (24 GiB): needs ~" in message and "H100 (80 GiB)" in message, message
    assert "to compute.gpu" in message and 'lora.quantization = "4bit"' in message, message
    assert run_endpoints(local_stack, "e2e-toobig") == []


def test_a_gpu_class_runpod_refuses_with_400_hands_the_run_to_the_next_class_and_the_summary_names_it(
        local_stack, tiny_model, tmp_path):
    # RunPod's 400 for the first class's create (the endpoint's name starts with the run's): the run moves on.
    httpx.post(f"{local_stack.localpod_url}/_localpod/faults", json={
        "route": "create_endpoint", "action": "status_400", "endpoint_name_prefix": "loraflow-e2e-refused-"},
               timeout=10).raise_for_status()
    run_file = hub_run_file(tmp_path, "e2e-refused", str(tiny_model))
    run_file.write_text(run_file.read_text() + '[compute]\ngpu = ["H100", "RTX 4090"]\n')
    run = run_train_flow(local_stack, run_file)
    assert run.returncode == 0, run.output[-5000:]
    assert "RunPod refused the endpoint on H100; trying RTX 4090" in run.output, run.output[-3000:]
    [endpoint] = run_endpoints(local_stack, "e2e-refused")  # the refused create made nothing
    assert endpoint["deletedAt"] is not None
    artifacts = {a["key"]: a for a in prefect_api(local_stack, "POST", "/artifacts/filter", json={
        "artifacts": {"flow_run_id": {"any_": [run.flow_run_id]}}}).json()}
    summary = artifacts["train-e2e-refused-summary"]["data"]
    assert "| GPU | 1 × RTX 4090 |" in summary, summary
    assert ("| Refused by RunPod | H100: RunPod answered 400 to POST /v2/serverless: localpod fault injection: "
            "create_endpoint refused as invalid |") in summary, summary
    assert "| Prices | RunPod's catalog |" in summary and "| GPU classes | pools and cards from RunPod's catalog |" \
        in summary, summary
    assert "| Attempts | 1 |" in summary  # a refusal rents nothing: it takes no attempt
