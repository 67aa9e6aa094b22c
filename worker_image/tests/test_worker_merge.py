"""Merge jobs: a stored run's adapter merged into its base (bf16) and published as a plain model repo.

The run is the shared finished SFT job (`run-a`, its adapter in a file store, its base the tiny model's folder); the
repo goes to the Hub stand-in (`localpod.hub`), started with the control plane's interpreter. huggingface_hub reads
HF_ENDPOINT at import, so each job runs the handler in a process of its own whose environment names the stand-in,
as a RunPod worker's would.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from huggingface_hub import HfApi, snapshot_download

from worker_test_support import hub_stand_in
from loraflow_worker.contract import CONTRACT_VERSION, MergeResult
from loraflow_worker.runtime.merge import MERGE_TITLE, RECORD_FILE, compare_logits

from tests.hub_fixture import HubStandIn

REPO_ROOT = Path(__file__).resolve().parents[2]
TOKEN = "hf_test_token_for_the_stand_in"
MERGED = "acme/tiny-merged"
RUN_HANDLER = (
    "import json, logging, sys\n"
    "logging.basicConfig(level=logging.INFO, stream=sys.stderr)\n"
    "from loraflow_worker.handler import handler\n"
    "print(json.dumps(handler(json.load(sys.stdin))))\n"
)
# Logits of the same fixed input through one model, the way a user loads it: argv = model folder [, adapter folder].
LOGITS = """
import json, sys, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16)
if len(sys.argv) > 2:
    from peft import PeftModel
    model = PeftModel.from_pretrained(model, sys.argv[2])
with torch.no_grad():
    logits = model(input_ids=torch.tensor([[5, 17, 42, 7, 99, 3]])).logits.float()
print(json.dumps({"logits": logits.flatten().tolist(), "peft": "peft" in sys.modules}))
"""


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> Iterator[HubStandIn]:
    with hub_stand_in(tmp_path_factory.mktemp("hub") / "data") as stand_in:
        yield stand_in


@pytest.fixture(scope="module")
def merged(hub, finished_job, tiny_model_dir, tmp_path_factory) -> dict:
    """`run-a` merged into the tiny model and published to MERGED."""
    return _merge_in_a_worker(hub, _merge_job(finished_job, tiny_model_dir), tmp_path_factory.mktemp("merge"))


def test_a_merged_model_loads_without_peft_and_matches_base_plus_adapter(merged, hub, finished_job, tiny_model_dir,
                                                                        tmp_path):
    result = MergeResult.model_validate(merged)
    assert result.logits_check.passed and result.logits_check.inputs == 3, result.logits_check
    assert result.logits_check.max_abs_difference <= result.logits_check.tolerance
    files = set(HfApi(endpoint=hub.url, token=TOKEN).list_repo_files(MERGED))
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md", RECORD_FILE} <= files, files
    assert "adapter_config.json" not in files and "adapter_model.safetensors" not in files
    folder = snapshot_download(MERGED, endpoint=hub.url, token=TOKEN, cache_dir=tmp_path / "cache")

    merged_logits = _logits(folder)
    reference = _logits(str(tiny_model_dir), str(finished_job.run_dir / "adapter"))
    base_only = _logits(str(tiny_model_dir))
    assert not merged_logits["peft"], "the merged model must load with transformers alone"
    difference = (torch.tensor(merged_logits["logits"]) - torch.tensor(reference["logits"])).abs().max().item()
    adapter_effect = (torch.tensor(reference["logits"]) - torch.tensor(base_only["logits"])).abs().max().item()
    # The adapter changes the output, and the merged model carries that change: bf16 noise is far below it.
    assert adapter_effect > 0.01 and difference < adapter_effect / 10, (difference, adapter_effect)


def test_the_card_names_the_base_the_adapter_the_run_and_the_check(merged, hub, finished_job, tiny_model_dir):
    card = Path(HfApi(endpoint=hub.url, token=TOKEN).hf_hub_download(MERGED, "README.md")).read_text()
    check = merged["logits_check"]
    assert f"`{tiny_model_dir}`" in card
    assert f"`{(finished_job.run_dir / 'adapter').as_uri()}` (the run's artifact store)" in card, card
    assert "`e2e-merge` (`run-a`)" in card
    assert f"max absolute difference {check['max_abs_difference']:.4g}" in card
    assert (f"over 3 fixed inputs ({check['tokens']} tokens), tolerance {check['tolerance']:.4g}; the adapter moves "
            f"the base's logits by up to {check['adapter_effect']:.4g}: passed") in card
    assert "library_name: transformers" in card and "vllm serve acme/tiny-merged" in card


def test_a_redelivered_merge_job_returns_the_earlier_commit_without_committing_again(merged, hub, finished_job,
                                                                                      tiny_model_dir, tmp_path):
    before = hub.commits("model", MERGED)
    again = _merge_in_a_worker(hub, _merge_job(finished_job, tiny_model_dir), tmp_path)
    assert again["already_merged"] is True
    assert again["commit_url"] == merged["commit_url"] and again["logits_check"] == merged["logits_check"]
    assert hub.commits("model", MERGED) == before
    assert [c["title"] for c in before].count(MERGE_TITLE.format(run_id="run-a")) == 1


def test_a_merge_beyond_the_tolerance_fails_and_publishes_nothing(hub, finished_job, tiny_model_dir, tmp_path):
    job = _merge_job(finished_job, tiny_model_dir, merged_model_id="acme/tiny-merged-strict", logits_tolerance=0.0)
    done = _run_handler(hub, job, tmp_path)
    # bf16 rounds the merged weights once more: with no tolerance at all, that alone is a mismatch.
    assert done.returncode != 0
    assert "MergeMismatch: the merged model's logits differ from base + adapter's by up to" in done.stderr
    assert "beyond the tolerance 0" in done.stderr and "nothing was published to acme/tiny-merged-strict" in done.stderr
    assert not HfApi(endpoint=hub.url, token=TOKEN).repo_exists("acme/tiny-merged-strict")


def test_an_adapter_changed_after_the_run_stored_it_is_refused_and_nothing_is_published(hub, finished_job,
                                                                                      tiny_model_dir, tmp_path):
    store_root = tmp_path / "store"
    shutil.copytree(finished_job.run_dir, store_root / "runs" / "run-a")
    swapped = store_root / "runs" / "run-a" / "adapter" / "adapter_model.safetensors"
    swapped.write_bytes(b"a teammate's weights")
    job = _merge_job(finished_job, tiny_model_dir, artifact_store=store_root.as_uri(),
                     merged_model_id="acme/tiny-merged-swapped")
    done = _run_handler(hub, job, tmp_path)
    assert done.returncode != 0
    assert ("ArtifactChanged: runs/run-a/adapter/adapter_model.safetensors changed after the run stored it: its sha256 "
            f"was {finished_job.result['adapter_sha256']['adapter_model.safetensors']} then") in done.stderr, \
        done.stderr[-3000:]
    assert not HfApi(endpoint=hub.url, token=TOKEN).repo_exists("acme/tiny-merged-swapped")


def test_the_logits_comparison_refuses_a_perturbed_merge_and_accepts_noise():
    torch.manual_seed(0)
    reference = [torch.randn(1, 6, 50) * 8, torch.randn(1, 4, 50) * 8]
    noise = [r + torch.randn_like(r) * 0.01 for r in reference]
    perturbed = [reference[0].clone(), reference[1] + torch.where(torch.arange(50) == 7, 1.5, 0.0)]
    accepted = compare_logits(reference, noise, None)
    assert accepted.passed and accepted.tokens == 10 and accepted.inputs == 2
    assert accepted.tolerance == pytest.approx(0.02 * max(r.abs().max().item() for r in reference))
    refused = compare_logits(reference, perturbed, None)
    assert not refused.passed and refused.max_abs_difference == pytest.approx(1.5, rel=1e-5)
    assert not compare_logits(reference, noise, 0.001).passed
    with pytest.raises(ValueError, match="same inputs"):
        compare_logits(reference, reference[:1], None)


def test_a_merge_that_left_the_base_as_it_was_fails_though_the_adapter_moves_less_than_the_tolerance():
    torch.manual_seed(0)
    base = [torch.randn(1, 6, 50) * 8]
    adapted = [base[0] + torch.where(torch.arange(50) == 3, 0.5, 0.0)]  # under 2 % of the logits' scale
    unchanged = compare_logits(adapted, base, None, base=base)
    assert unchanged.max_abs_difference == pytest.approx(0.5, rel=1e-5)
    assert unchanged.max_abs_difference <= unchanged.tolerance
    assert unchanged.adapter_effect == pytest.approx(0.5, rel=1e-5) and not unchanged.passed
    merged = compare_logits(adapted, [a + torch.randn_like(a) * 0.01 for a in adapted], None, base=base)
    assert merged.passed and merged.adapter_effect == pytest.approx(0.5, rel=1e-5)


def _merge_job(finished_job, base: Path, **fields) -> dict:
    job_input = {"contract_version": CONTRACT_VERSION, "mode": "merge", "run_id": "run-a", "run_name": "e2e-merge",
                 "artifact_store": finished_job.run_dir.parent.parent.as_uri(), "base_model": {"id": str(base)},
                 "merged_model_id": MERGED, "private": True,
                 # The run's own result pins the adapter it stored, as the control plane passes it on.
                 "adapter_revision": finished_job.result["revision"],
                 "adapter_sha256": finished_job.result["adapter_sha256"]}
    return {"id": "job-merge-1", "input": {**job_input, **fields}}


def _run_handler(hub: HubStandIn, job: dict, base: Path) -> subprocess.CompletedProcess:
    env = {name: value for name, value in os.environ.items() if not name.startswith(("HF_", "HUGGING_FACE_"))}
    env |= {"HF_ENDPOINT": hub.url, "HF_TOKEN": TOKEN, "HF_HOME": str(base / "hf-home"),
            "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "LORAFLOW_WORK_DIR": str(base)}
    return subprocess.run([sys.executable, "-c", RUN_HANDLER], input=json.dumps(job), env=env, capture_output=True,
                          text=True, timeout=300, check=False)


def _merge_in_a_worker(hub: HubStandIn, job: dict, base: Path) -> dict:
    done = _run_handler(hub, job, base)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def _logits(*argv: str) -> dict:
    done = subprocess.run([sys.executable, "-c", LOGITS, *argv], capture_output=True, text=True, timeout=300,
                          check=False, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])
