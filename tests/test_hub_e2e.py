"""A run the way it goes on RunPod: the base model comes from a Hub repo (pinned to a commit by the
control plane, downloaded by the worker), and results go to a private `hf://` dataset repo, in few
commits (the Hub allows 128 per hour per repo) — here against the local Hub stand-in."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from huggingface_hub import HfApi, snapshot_download

from deployments.local_stack import check_adapter
from tests.conftest import prefect_api, run_train_flow
from tests.test_train_e2e import write_run_file

pytestmark = pytest.mark.timeout(600)


def test_hub_model_and_hf_store_run_end_to_end(local_stack, tiny_model, tmp_path):
    token = local_stack.client_env["HF_TOKEN"]
    api = HfApi(endpoint=local_stack.hub_url, token=token)
    api.create_repo("acme/tiny-qwen3", exist_ok=True)
    api.upload_folder(repo_id="acme/tiny-qwen3", folder_path=str(tiny_model), commit_message="tiny model")
    model_sha = api.model_info("acme/tiny-qwen3").sha
    # The store repo exists and is public: the run must make it private.
    api.create_repo("acme/runs", repo_type="dataset", private=False, exist_ok=True)

    run_file = write_run_file(tmp_path / "run.toml", name="e2e-hub", model=tiny_model, store=tmp_path / "unused")
    text = run_file.read_text().replace(f'id = "{tiny_model}"', 'id = "acme/tiny-qwen3"')
    text = text.replace(f'artifact_store = "file://{tmp_path / "unused"}"', 'artifact_store = "hf://datasets/acme/runs"')
    run_file.write_text(text)
    run = run_train_flow(local_stack, run_file)
    assert run.returncode == 0, run.output[-5000:]
    assert prefect_api(local_stack, "GET", f"/flow_runs/{run.flow_run_id}").json()["state"]["type"] == "COMPLETED"

    # The worker read the token from a RunPod account secret: no endpoint's env held its value.
    secrets = httpx.get(f"{local_stack.localpod_url}/v2/account/secrets",
                        headers={"Authorization": f"Bearer {local_stack.client_env['RUNPOD_API_KEY']}"}).json()["secrets"]
    assert any(s["name"].startswith("loraflow-hf-token-") for s in secrets), secrets
    assert api.repo_info("acme/runs", repo_type="dataset").private
    prefix = f"runs/{run.flow_run_id}"
    files = set(api.list_repo_files("acme/runs", repo_type="dataset"))
    assert {f"{prefix}/DONE", f"{prefix}/metrics.json", f"{prefix}/manifest.json", f"{prefix}/adapter/adapter_config.json"} <= files
    commits = httpx.get(f"{local_stack.hub_url}/_hub/commits/datasets/acme/runs").json()["commits"]
    run_commits = [c for c in commits if run.flow_run_id in c.get("title", "") + c.get("message", "")]
    # The dataset, the results, DONE: a handful of commits per run, not one per file.
    assert 2 <= len(run_commits) <= 6, [c.get("title") for c in run_commits]

    manifest = api.hf_hub_download("acme/runs", f"{prefix}/manifest.json", repo_type="dataset", cache_dir=tmp_path / "cache")
    recorded = json.loads(open(manifest).read())
    assert recorded["base_model_id"] == "acme/tiny-qwen3"
    assert recorded["base_model_revision"] == model_sha

    local = snapshot_download("acme/runs", repo_type="dataset", allow_patterns=[f"{prefix}/adapter/*"],
                              endpoint=local_stack.hub_url, token=token, cache_dir=tmp_path / "cache")
    report = check_adapter(tiny_model, Path(local) / prefix / "adapter")
    assert report["loads"] and report["vocab_size"] == json.loads((tiny_model / "config.json").read_text())["vocab_size"], report
