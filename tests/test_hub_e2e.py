"""A run the way it goes on RunPod: the base model comes from a Hub repo (pinned to a commit by the
control plane, downloaded by the worker), and results go to a private `hf://` dataset repo, in few
commits (the Hub allows 128 per hour per repo) — here against the local Hub stand-in. And the Hub token:
runs started together by different people each give their workers their own token."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
from huggingface_hub import HfApi, snapshot_download

from deployments.local_stack import WORKER_PYTHON, check_adapter
from tasks.lifecycle.secret_key import secret_name_key
from tasks.lifecycle.secret_retention import newest_secret_uses
from tasks.reports.events import RUN_FINISHED
from tasks.runpod.secrets import fingerprint
from tasks.settings import Settings
from tests.conftest import REPO, localpod_account, prefect_api, run_train_flow
from tests.test_crash_recovery_e2e import flow_env, wait_for
from tests.test_run_events import wait_for_events
from tests.test_train_e2e import run_endpoints, write_run_file

pytestmark = pytest.mark.timeout(600)

# Loads an adapter from the Hub by its model id, as a user would (argv: base model id, adapter repo id).
PEFT_LOAD_BY_ID = """
import json, sys
from peft import PeftModel
from transformers import AutoModelForCausalLM
model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(sys.argv[1]), sys.argv[2])
print(json.dumps({"adapters": list(model.peft_config), "base": model.peft_config["default"].base_model_name_or_path}))
"""
# Loads the merged model from the Hub with transformers alone, then base + adapter with PEFT, and compares their
# logits on a fixed input (argv: merged repo id, base model id, adapter repo id).
MERGED_AGAINST_ADAPTER = """
import json, sys, torch
from transformers import AutoModelForCausalLM
ids = torch.tensor([[5, 17, 42, 7, 99, 3, 11]])
with torch.no_grad():
    merged = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16)(input_ids=ids).logits.float()
    without_peft = "peft" not in sys.modules
    from peft import PeftModel
    base = AutoModelForCausalLM.from_pretrained(sys.argv[2], dtype=torch.bfloat16)
    before = base(input_ids=ids).logits.float()
    adapted = PeftModel.from_pretrained(base, sys.argv[3])(input_ids=ids).logits.float()
print(json.dumps({"without_peft": without_peft, "difference": (merged - adapted).abs().max().item(),
                  "adapter_effect": (adapted - before).abs().max().item()}))
"""


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
    # Both trackers, without their credentials: W&B offline and an MLflow file store, stored with the run.
    text = text.replace("[training]\n", '[training]\nreport_to = ["wandb", "mlflow"]\n')
    run_file.write_text(text + '[publish]\nhub_model_id = "acme/tiny-qwen3-lora"\nmerged_model_id = "acme/tiny-qwen3-merged"\n')
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
    assert f"{prefix}/tracking/a1/mlruns.tar.gz" in files
    assert any(f.startswith(f"{prefix}/tracking/a1/wandb/offline-run-") and f.endswith(".wandb") for f in files), files
    # The dataset, the results (the trackers' files among them), DONE: a handful of commits per run, not one per file.
    assert 2 <= len(run_commits) <= 6, [c.get("title") for c in run_commits]

    manifest = api.hf_hub_download("acme/runs", f"{prefix}/manifest.json", repo_type="dataset", cache_dir=tmp_path / "cache")
    recorded = json.loads(open(manifest).read())
    assert recorded["base_model_id"] == "acme/tiny-qwen3"
    assert recorded["base_model_revision"] == model_sha

    local = snapshot_download("acme/runs", repo_type="dataset", allow_patterns=[f"{prefix}/adapter/*"],
                              endpoint=local_stack.hub_url, token=token, cache_dir=tmp_path / "cache")
    report = check_adapter(tiny_model, Path(local) / prefix / "adapter")
    assert report["loads"] and report["vocab_size"] == json.loads((tiny_model / "config.json").read_text())["vocab_size"], report

    # [publish]: the adapter and its card, by name, in a private model repo; PEFT loads it from the Hub by id.
    assert api.repo_info("acme/tiny-qwen3-lora").private
    assert {"adapter_config.json", "adapter_model.safetensors", "README.md"} <= set(api.list_repo_files("acme/tiny-qwen3-lora"))
    card = Path(api.hf_hub_download("acme/tiny-qwen3-lora", "README.md", cache_dir=tmp_path / "cache")).read_text()
    assert "base_model: acme/tiny-qwen3" in card and "library_name: peft" in card, card[:500]
    hub_env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HF_ENDPOINT": local_stack.hub_url, "HF_TOKEN": token,
               "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HOME": str(tmp_path / "hf-home")}
    load = subprocess.run([str(WORKER_PYTHON), "-c", PEFT_LOAD_BY_ID, "acme/tiny-qwen3", "acme/tiny-qwen3-lora"],
                          capture_output=True, text=True, timeout=300, env=hub_env)
    assert load.returncode == 0, load.stderr[-3000:]
    assert json.loads(load.stdout.strip().splitlines()[-1]) == {"adapters": ["default"], "base": "acme/tiny-qwen3"}
    # [publish] merged_model_id: the base with the adapter merged, on a CPU endpoint of its own, loaded from the Hub by
    # transformers alone; its logits are base + adapter's, and its card names the base, the adapter and the run.
    merged_files = set(api.list_repo_files("acme/tiny-qwen3-merged"))
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md"} <= merged_files, merged_files
    assert "adapter_config.json" not in merged_files and api.repo_info("acme/tiny-qwen3-merged").private
    compared = subprocess.run([str(WORKER_PYTHON), "-c", MERGED_AGAINST_ADAPTER, "acme/tiny-qwen3-merged",
                               "acme/tiny-qwen3", "acme/tiny-qwen3-lora"],
                              capture_output=True, text=True, timeout=300, env=hub_env)
    assert compared.returncode == 0, compared.stderr[-3000:]
    logits = json.loads(compared.stdout.strip().splitlines()[-1])
    assert logits["without_peft"] and logits["adapter_effect"] > 0.01, logits
    assert logits["difference"] < logits["adapter_effect"] / 10, logits
    merged_card = Path(api.hf_hub_download("acme/tiny-qwen3-merged", "README.md", cache_dir=tmp_path / "cache")).read_text()
    assert "base_model: acme/tiny-qwen3" in merged_card and "library_name: transformers" in merged_card, merged_card[:600]
    assert f"| base model | `acme/tiny-qwen3` at revision `{model_sha}` |" in merged_card, merged_card
    assert "| adapter | `acme/tiny-qwen3-lora` |" in merged_card
    assert f"| run | `e2e-hub` (`{run.flow_run_id}`) |" in merged_card
    assert "| logits check | max absolute difference " in merged_card and ": passed |" in merged_card
    [merge_endpoint] = run_endpoints(local_stack, "merge-e2e-hub")  # its CPU endpoint, deleted once the job ended
    assert merge_endpoint["deletedAt"] is not None
    assert merge_endpoint["id"] not in {e["id"] for e in localpod_account(local_stack)["liveEndpoints"]}
    [summary] = prefect_api(local_stack, "POST", "/artifacts/filter", json={"artifacts": {
        "flow_run_id": {"any_": [run.flow_run_id]}, "key": {"any_": ["train-e2e-hub-summary"]}}}).json()
    published_row = f"| Published model | [acme/tiny-qwen3-lora]({local_stack.hub_url}/acme/tiny-qwen3-lora) |"
    assert published_row in summary["data"]
    [merged_row] = [line for line in summary["data"].splitlines() if line.startswith("| Merged model |")]
    assert merged_row.startswith(f"| Merged model | [acme/tiny-qwen3-merged]({local_stack.hub_url}/acme/tiny-qwen3-merged)"
                                 ": logits max \\|Δlogit\\| "), merged_row
    assert " over 3 inputs (the adapter moves them by up to " in merged_row, merged_row
    assert "); merged on CPU cpu" in merged_row, merged_row
    [finished] = wait_for_events(local_stack, RUN_FINISHED, resource={"id": [f"loraflow.run.{run.flow_run_id}"]})
    assert finished["payload"]["merged_model"] == "acme/tiny-qwen3-merged" and "merge_error" not in finished["payload"]
    tracked = [line for line in summary["data"].splitlines() if line.startswith(("| W&B run |", "| MLflow run |"))]
    assert len(tracked) == 2 and all(f"`{run.flow_run_id}-a1`" in line and "recorded locally" in line
                                     for line in tracked), tracked


ALICE_TOKEN, BOB_TOKEN = "hf_alice_e2e_0000000001", "hf_bob_e2e_0000000002"


def worker_hub_tokens(stack, labels: list[str], procs: list[subprocess.Popen]) -> dict[str, str | None]:
    """While the runs go: each run's (label's) worker's `HF_TOKEN` as its process booted with it (None: unset),
    read from the process itself. Fails if an endpoint's env ever holds a token's value."""
    seen: dict[str, str | None] = {}
    while any(p.poll() is None for p in procs):
        account = localpod_account(stack)
        names = {e["id"]: e["name"] for e in account["endpoints"]}
        for worker in account["workers"]:
            name = names.get(worker["endpointId"], "")
            label = next((la for la in labels if name.startswith(f"loraflow-{la}-")), None)
            if label is None or label in seen or worker["endedAt"] is not None:
                continue
            try:
                environ = Path(f"/proc/{worker['pid']}/environ").read_bytes().split(b"\0")
            except OSError:  # ended meanwhile: its run's next worker is read instead
                continue
            env = dict(item.decode().split("=", 1) for item in environ if b"=" in item)
            seen[label] = env.get("HF_TOKEN")
        endpoints = httpx.get(f"{stack.localpod_url}/v2/serverless", timeout=10,
                              headers={"Authorization": f"Bearer {stack.client_env['RUNPOD_API_KEY']}"}).text
        assert ALICE_TOKEN not in endpoints and BOB_TOKEN not in endpoints
        time.sleep(0.2)
    return seen


def test_runs_started_together_by_two_people_give_each_worker_its_own_token(local_stack, tiny_model, tmp_path):
    from prefect.blocks.system import Secret
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: local_stack.prefect_api_url}):
        Secret(value=ALICE_TOKEN).save("e2e-alice-hf-token", overwrite=True)
    # Alice names her block in the run (it wins over the flow process's HF_TOKEN, the stack's); Bob's flow
    # process has his HF_TOKEN; a third run has no token anywhere.
    envs = {"e2e-tok-alice": flow_env(local_stack),
            "e2e-tok-bob": flow_env(local_stack, HF_TOKEN=BOB_TOKEN),
            "e2e-tok-none": {k: v for k, v in flow_env(local_stack, HF_TOKEN_BLOCK="e2e-no-such-block").items()
                             if k != "HF_TOKEN"}}
    procs = []
    for label, env in envs.items():
        run_file = write_run_file(tmp_path / f"{label}.toml", name=label, model=tiny_model, store=tmp_path / "store",
                                  max_steps=3)
        if label == "e2e-tok-alice":
            run_file.write_text(f'hub_token_secret = "e2e-alice-hf-token"\n{run_file.read_text()}')
        # Output to files, not pipes: a pipe nobody reads while the runs go would block them once full.
        with (tmp_path / f"{label}.log").open("wb") as log:
            procs.append(subprocess.Popen([sys.executable, "-m", "flows.train", str(run_file)], cwd=REPO, env=env,
                                          stdout=log, stderr=subprocess.STDOUT))
    try:
        tokens = worker_hub_tokens(local_stack, list(envs), procs)
    finally:
        for proc in procs:
            proc.wait(timeout=300)
    outputs = [(tmp_path / f"{label}.log").read_text()[-3000:] for label in envs]
    assert [p.returncode for p in procs] == [0, 0, 0], "\n\n".join(outputs)
    assert tokens == {"e2e-tok-alice": ALICE_TOKEN, "e2e-tok-bob": BOB_TOKEN, "e2e-tok-none": None}

    # One secret per token, named by its fingerprint (keyed with the namespace's key), each recorded as used (what
    # pruning reads).
    secrets = {s["name"] for s in httpx.get(f"{local_stack.localpod_url}/v2/account/secrets", timeout=10, headers={
        "Authorization": f"Bearer {local_stack.client_env['RUNPOD_API_KEY']}"}).json()["secrets"]}
    with temporary_settings({PREFECT_API_URL: local_stack.prefect_api_url}):
        key = secret_name_key(Settings().control_plane_namespace())
    ours = {name for name in secrets if fingerprint(ALICE_TOKEN, key) in name or fingerprint(BOB_TOKEN, key) in name}
    assert len(ours) == 2 and all(name.startswith("loraflow-hf-token-") for name in ours), secrets

    from prefect import get_client

    with temporary_settings({PREFECT_API_URL: local_stack.prefect_api_url}), get_client(sync_client=True) as client:
        now = datetime.now(UTC)

        def recorded():
            found = newest_secret_uses(client, since=now - timedelta(hours=1), until=now + timedelta(hours=1))
            return found if ours <= set(found) else None

        uses = wait_for(recorded, 30, "the secrets' use events")
    assert all(now - timedelta(minutes=15) < uses[name] for name in ours)


def test_a_run_naming_a_token_block_that_does_not_exist_is_refused_before_anything_is_rented(local_stack, tiny_model,
                                                                                            tmp_path):
    run_file = write_run_file(tmp_path / "run.toml", name="e2e-tok-missing", model=tiny_model, store=tmp_path / "store")
    run_file.write_text(f'hub_token_secret = "e2e-nobodys-block"\n{run_file.read_text()}')
    run = run_train_flow(local_stack, run_file)
    assert run.returncode == 1
    assert "hub_token_secret: the Prefect Secret block 'e2e-nobodys-block' cannot be read" in run.output, run.output[-3000:]
    assert run_endpoints(local_stack, "e2e-tok-missing") == []
