"""An SFT job through `handler()` against a file:// artifact store; the training runs in a child process.

One job trains the tiny model for 50 steps (the session fixture `finished_job`, in conftest.py); the
tests below each check one thing about what it did and what it left in the store.
"""

from __future__ import annotations

import json
import time

import pytest
import torch
from worker_test_support import PLANTED_SECRET, stored_files_containing
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from loraflow_worker.contract import CONTRACT_VERSION, JobResult, TrainMetrics
from loraflow_worker.handler import WORK_DIR_ENV, JobFailed, handler
from loraflow_worker.artifacts.manifest import RunManifest
from loraflow_worker.training.monitor import PROGRESS_INTERVAL_S


def test_result_is_a_completed_job_result(finished_job):
    result = JobResult.model_validate(finished_job.result)
    assert (result.status, result.run_id, result.attempt) == ("completed", "run-a", 1)
    assert (result.run_prefix, result.adapter_path) == ("runs/run-a", "runs/run-a/adapter")
    assert result.metrics.steps == 50
    assert result.metrics.device == "cpu"
    assert result.metrics.tokens > 50 * 8 * 10  # 50 steps of 8 examples, each well over 10 tokens


def test_loss_falls_substantially(finished_job):
    metrics = TrainMetrics.model_validate(finished_job.result["metrics"])
    assert [step for step, _ in metrics.losses] == list(range(1, 51))
    assert metrics.first_loss > 5.0
    assert metrics.final_loss < 0.5 * metrics.first_loss


def test_store_holds_the_run_layout(finished_job):
    run_dir = finished_job.run_dir
    for name in ("DONE", "metrics.json", "manifest.json", "result.json", "adapter/adapter_config.json",
                 "adapter/adapter_model.safetensors", "adapter/tokenizer.json"):
        assert (run_dir / name).is_file(), name
    assert JobResult.model_validate_json((run_dir / "result.json").read_text()).model_dump(mode="json") == finished_job.result
    assert TrainMetrics.model_validate_json((run_dir / "metrics.json").read_text()).steps == 50


def test_the_training_process_the_supervisor_started_had_the_allocator_setting_in_its_environment(finished_job):
    # Set before the process started, so before any import could initialise CUDA; on a GPU the manifest's
    # `cuda_allocator_settings` and `fast_paths.expandable_segments` say the allocator took it.
    manifest = RunManifest.model_validate_json((finished_job.run_dir / "manifest.json").read_text())
    assert manifest.cuda_alloc_conf == "expandable_segments:True"


def test_manifest_records_versions_device_and_fast_paths(finished_job):
    manifest = RunManifest.model_validate_json((finished_job.run_dir / "manifest.json").read_text())
    assert manifest.contract_version == CONTRACT_VERSION
    assert manifest.base_model_id == finished_job.job["input"]["model"]["id"]
    assert manifest.base_model_revision is None  # a local folder has no Hub commit
    assert manifest.device == "cpu" and manifest.seed == 42
    assert set(manifest.libraries) >= {"torch", "transformers", "trl", "peft"}
    assert manifest.libraries["trl"].startswith("1.")
    assert manifest.fast_paths and all(
        not path.engaged and path.reason == "no CUDA device" for path in manifest.fast_paths.values()
    )
    assert manifest.job.run_id == "run-a"


def test_adapter_changes_the_logits_and_leaves_base_weights_alone(finished_job, tiny_model_dir):
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    base_state = {k: v.clone() for k, v in base.state_dict().items()}
    tokenizer = AutoTokenizer.from_pretrained(finished_job.run_dir / "adapter")
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of Peru?"}], add_generation_prompt=True, return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    with torch.no_grad():
        base_logits = base(ids).logits
        tuned = PeftModel.from_pretrained(base, finished_job.run_dir / "adapter")
        tuned_logits = tuned(ids).logits

    assert (tuned_logits - base_logits).abs().max() > 1e-2
    for name, value in tuned.get_base_model().state_dict().items():
        if "lora_" not in name:
            assert torch.equal(value, base_state[name.replace(".base_layer", "")]), name


def test_adapter_file_holds_only_trained_lora_weights(finished_job):
    tensors = load_file(finished_job.run_dir / "adapter" / "adapter_model.safetensors")
    assert tensors and all("lora_A" in name or "lora_B" in name for name in tensors)
    # lora_B starts at zero: non-zero means training moved the adapter.
    assert all(t.abs().max() > 0 for name, t in tensors.items() if "lora_B" in name)


def test_stale_files_from_a_previous_job_are_removed(finished_job):
    assert not (finished_job.work_dir / "adapter" / "stale-from-previous-job.safetensors").exists()
    assert not (finished_job.run_dir / "adapter" / "stale-from-previous-job.safetensors").exists()


def test_job_spec_reaches_the_training_process_as_a_file(finished_job):
    spec = json.loads((finished_job.work_dir / "job.json").read_text())
    assert spec["run_id"] == "run-a" and spec["training"]["checkpoint_every_steps"] == 20


def test_first_checkpoint_is_stored_complete_and_later_ones_respect_the_commit_interval(finished_job):
    # Saves at 20 and 40 and at the end: 40 came seconds after 20 (one checkpoint commit a minute at
    # most), and the end's checkpoint would resume nothing.
    checkpoints = finished_job.run_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-20"]
    step = checkpoints / "step-20"
    for name in ("COMPLETE", "adapter_model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth",
                 "trainer_state.json"):
        assert (step / name).is_file(), name
    state = json.loads((step / "trainer_state.json").read_text())
    assert state["global_step"] == 20
    assert [e["step"] for e in state["log_history"] if "loss" in e] == list(range(1, 21))


def test_progress_carries_throughput_and_eta(finished_job):
    last = [u for u in finished_job.progress if u["stage"] == "training"][-1]
    assert last["tokens_per_second"] > 0 and last["eta_seconds"] == 0


def test_the_saving_update_carries_the_final_loss(finished_job):
    saving = finished_job.progress[-1]
    assert saving["stage"] == "saving" and saving["step"] == saving["total_steps"] == 50
    assert saving["loss"] == finished_job.result["metrics"]["final_loss"]


def test_planted_token_is_in_no_stored_file_and_not_in_the_result(finished_job):
    assert stored_files_containing(finished_job.run_dir, PLANTED_SECRET) == []
    assert PLANTED_SECRET not in json.dumps(finished_job.result)


def test_progress_is_sent_for_each_stage_and_the_first_and_last_step(finished_job):
    stages = [u["stage"] for u in finished_job.progress]
    assert stages[0] == "loading" and stages[-1] == "saving"
    training = [u for u in finished_job.progress if u["stage"] == "training"]
    assert training[0]["step"] == 1 and training[0]["loss"] is not None
    assert training[-1]["step"] == training[-1]["total_steps"] == 50
    assert len(training) <= 2 + finished_job.seconds / PROGRESS_INTERVAL_S + 1


def test_redelivered_job_returns_the_stored_result_without_training(finished_job, record_progress):
    marker = finished_job.work_dir / "marker"
    marker.write_text("a fresh run would clear the work dir")
    adapter = finished_job.run_dir / "adapter" / "adapter_model.safetensors"
    stamp = adapter.stat().st_mtime_ns
    with pytest.MonkeyPatch.context() as env, record_progress() as progress:
        env.setenv(WORK_DIR_ENV, str(finished_job.work_dir.parent))
        again = handler(finished_job.job)

    assert again == finished_job.result
    assert marker.exists() and progress == []
    assert adapter.stat().st_mtime_ns == stamp


def test_done_is_written_after_everything_else(tiny_model_dir, make_job, tmp_path, monkeypatch):
    # A folder where DONE should go makes the DONE write fail: everything else must already be stored.
    store_root = tmp_path / "store"
    job = make_job("run-b", tiny_model_dir, store_root, training={"max_steps": 2})
    (store_root / "runs" / "run-b" / "DONE").mkdir(parents=True)
    monkeypatch.setenv(WORK_DIR_ENV, str(tmp_path / "work"))
    with pytest.raises(JobFailed, match="^IsADirectoryError: "):
        handler(job)
    run_dir = store_root / "runs" / "run-b"
    for name in ("metrics.json", "manifest.json", "result.json", "adapter/adapter_model.safetensors"):
        assert (run_dir / name).is_file(), name


@pytest.mark.timeout(60)
def test_training_stops_with_an_error_when_the_deadline_passes(tiny_model_dir, make_job, tmp_path, monkeypatch):
    store_root = tmp_path / "store"
    # Long enough for the training process to start training (~10 s of imports and loading) on most days;
    # if it is slower, it stops before its first step, with the same error.
    deadline = time.time() + 12
    job = make_job("run-c", tiny_model_dir, store_root, training={"max_steps": 100_000}, deadline_epoch_s=deadline)
    monkeypatch.setenv(WORK_DIR_ENV, str(tmp_path / "work"))
    with pytest.raises(JobFailed, match="^DeadlineReached: deadline reached"):
        handler(job)
    assert time.time() - deadline < 8  # it noticed promptly (at a step end, or right after loading)
    assert not (store_root / "runs" / "run-c" / "DONE").exists()
    assert not (store_root / "runs" / "run-c" / "result.json").exists()
