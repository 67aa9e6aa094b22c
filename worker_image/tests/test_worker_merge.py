"""Merge jobs: a stored run's adapter merged into its base (bf16) and published as a plain model repo, checked by its
logits once merged and again as saved; an adapter that trained the head of a tied model gives an untied merged model.

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
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from worker_test_support import hub_stand_in
from loraflow_worker.artifacts.pins import folder_sha256
from loraflow_worker.contract import CONTRACT_VERSION, MergeInput, MergeResult
from loraflow_worker.runtime.merge import (
    MERGE_TITLE,
    RECORD_FILE,
    compare_logits,
    merged_card,
    probe_inputs,
    probe_logits,
    saved_logits_check,
    untie_a_trained_head,
)

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


HEAD_MERGED = "acme/tiny-head-merged"


@pytest.fixture(scope="module")
def head_adapter(tiny_model_dir, tmp_path_factory) -> Path:
    """`run-head`'s adapter in a file store: LoRA plus a trained copy of the LM head of the tiny model, whose head is
    tied to its input embeddings (as Qwen3 up to 4B)."""
    store = tmp_path_factory.mktemp("head-store")
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert base.config.tie_word_embeddings
    torch.manual_seed(0)  # before PEFT draws the A matrices: the adapter is the same whatever ran before in the session
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", modules_to_save=["lm_head"],
                                            task_type="CAUSAL_LM"))
    with torch.no_grad():  # what training would leave: the head moved away from the embeddings, B away from zero
        for name, parameter in model.named_parameters():
            if "modules_to_save" in name or "lora_B" in name:
                parameter.add_(torch.randn_like(parameter) * 0.05)
    model.peft_config["default"].base_model_name_or_path = str(tiny_model_dir)
    model.save_pretrained(store / "runs/run-head/adapter")
    return store / "runs/run-head/adapter"


@pytest.fixture(scope="module")
def head_merged(hub, head_adapter, tiny_model_dir, tmp_path_factory) -> tuple[dict, Path]:
    """`run-head` merged and published to HEAD_MERGED; the result and the published folder."""
    job = {"id": "job-merge-head", "input": {
        "contract_version": CONTRACT_VERSION, "mode": "merge", "run_id": "run-head", "run_name": "head",
        "artifact_store": head_adapter.parents[2].as_uri(), "base_model": {"id": str(tiny_model_dir)},
        "merged_model_id": HEAD_MERGED, "adapter_sha256": folder_sha256(head_adapter),
        # A bf16 merge of this random tiny model (rank-4 LoRA on every linear layer) rounds its logits by about 2 % of
        # their scale, the default tolerance, whatever the adapter's size: 0.066-0.086 against 0.068-0.078 were seen.
        # This test is about the head, not the tolerance.
        "logits_tolerance": 0.15}}
    work = tmp_path_factory.mktemp("merge-head")
    result = _merge_in_a_worker(hub, job, work)
    return result, Path(snapshot_download(HEAD_MERGED, endpoint=hub.url, token=TOKEN, cache_dir=work / "cache"))


def test_a_trained_head_of_a_tied_model_is_published_untied_with_the_trained_weights(head_merged, head_adapter,
                                                                                   tiny_model_dir):
    result, folder = head_merged
    assert MergeResult.model_validate(result).logits_check.passed
    assert json.loads((folder / "config.json").read_text())["tie_word_embeddings"] is False
    weights = load_file(folder / "model.safetensors")
    trained = next(t for name, t in load_file(head_adapter / "adapter_model.safetensors").items() if "lm_head" in name)
    assert torch.equal(weights["lm_head.weight"], trained.bfloat16())
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    assert torch.equal(weights["model.embed_tokens.weight"], base.get_input_embeddings().weight)
    card = (folder / "README.md").read_text()
    assert "the merged model's config unties them (`tie_word_embeddings: false`)" in card


def test_a_merged_head_that_differs_from_the_embeddings_unties_the_config_and_saves_both(tiny_model_dir, tmp_path):
    # Whatever PEFT did to the config: the values decide. A tied head left as it was keeps the config as it was.
    tied = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    assert not untie_a_trained_head(tied) and tied.config.tie_word_embeddings
    trained = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    trained.lm_head.weight = torch.nn.Parameter(trained.lm_head.weight.detach() + 0.25)
    assert trained.config.tie_word_embeddings and untie_a_trained_head(trained)
    trained.save_pretrained(tmp_path / "merged")
    assert json.loads((tmp_path / "merged/config.json").read_text())["tie_word_embeddings"] is False
    saved = load_file(tmp_path / "merged/model.safetensors")
    assert torch.equal(saved["lm_head.weight"], trained.lm_head.weight)
    assert torch.equal(saved["model.embed_tokens.weight"], tied.get_input_embeddings().weight)


def test_the_saved_merged_model_is_loaded_back_and_its_logits_checked_again(head_merged, head_adapter, tiny_model_dir,
                                                                           tmp_path):
    # What is published is the files: a folder that lost the trained head (the embeddings alone, the config tying the
    # head to them, as a save of a tied model writes) loads another model than the one merged in memory.
    _, folder = head_merged
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    inputs = probe_inputs(tokenizer)
    unmerged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16),
                                         head_adapter)
    reference = probe_logits(unmerged, inputs)
    with unmerged.disable_adapter():
        base = probe_logits(unmerged, inputs)
    assert saved_logits_check(folder, inputs, reference, None, base=base).passed
    retied = shutil.copytree(folder, tmp_path / "retied")
    config = json.loads((retied / "config.json").read_text())
    (retied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    weights = load_file(retied / "model.safetensors")
    del weights["lm_head.weight"]
    save_file(weights, retied / "model.safetensors", metadata={"format": "pt"})
    check = saved_logits_check(retied, inputs, reference, None, base=base)
    assert not check.passed and check.max_abs_difference > check.adapter_effect / 2


def test_the_card_says_the_check_is_of_the_saved_model_and_what_a_qlora_merges_check_covers(merged, hub):
    card = Path(HfApi(endpoint=hub.url, token=TOKEN).hf_hub_download(MERGED, "README.md")).read_text()
    assert "The logits check compares the merged model as published: its saved files, loaded back" in card
    result = MergeResult.model_validate(merged)
    qlora = MergeInput.model_validate({"mode": "merge", "run_id": "run-q", "run_name": "q", "quantization": "4bit",
                                       "artifact_store": "file:///s", "base_model": {"id": "org/base"},
                                       "merged_model_id": "acme/q-merged"})
    text = merged_card(qlora, result)
    assert "The logits check covers that merge's arithmetic" in text
    assert "It does not compare with the 4-bit model the adapter was trained against" in text


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
