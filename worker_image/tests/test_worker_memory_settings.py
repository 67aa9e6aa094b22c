"""Memory settings a job forces (`JobInput.memory`, set by the control plane after an out-of-memory attempt): what the
contract refuses, and how the worker applies them (a micro-batch with gradient accumulation that keeps the effective
batch, the plan overridden, the manifest saying so)."""

from __future__ import annotations

import shutil

import pytest
from pydantic import ValidationError

from loraflow_worker.artifacts import open_store
from loraflow_worker.contract import CONTRACT_VERSION, JobInput, MemorySettings
from loraflow_worker.training.fast_paths import Workload, gather_facts
from loraflow_worker.handler import JobRefused, handler
from loraflow_worker.artifacts.manifest import training_config_sha256
from loraflow_worker.training.sft import train_sft
from loraflow_worker.self_test.tiny_model import DEFAULT_CORPUS
from loraflow_worker.training.run import job_workload, shared_trainer_args

GRPO = {"num_generations": 4, "rewards": [{"name": "format", "pattern": "x"}]}


def _job(**fields) -> JobInput:
    return JobInput.model_validate({"run_id": "r", "model": {"id": "org/model"}, "dataset": {"hub_id": "org/data"},
                                    "artifact_store": "file:///srv/store", **fields})


def _refusal(**fields) -> str:
    with pytest.raises(ValidationError) as refused:
        _job(**fields)
    return str(refused.value)


def test_a_micro_batch_that_does_not_divide_the_effective_batch_is_refused_with_the_divisors():
    message = _refusal(training={"batch_size": 6, "gradient_accumulation_steps": 2}, memory={"micro_batch_size": 5})
    assert ("`memory.micro_batch_size` (5) must divide the effective batch, `training.batch_size` × "
            "`training.gradient_accumulation_steps` (6 × 2 = 12 sequences per optimizer step), so that micro-batches × "
            "accumulation steps keep it: use one of 1, 2, 3, 4, 6, 12") in message


def test_vllm_settings_on_an_sft_job_are_refused():
    assert "`memory.vllm_gpu_memory_utilization` applies to GRPO only (algorithm is 'sft'): remove it" in _refusal(
        memory={"vllm_gpu_memory_utilization": 0.3})


def test_forcing_vllm_colocation_on_is_refused_naming_the_share_setting():
    message = _refusal(algorithm="grpo", grpo=GRPO, memory={"vllm_colocate": True})
    assert "`memory.vllm_colocate` can only turn colocation off (false)" in message
    assert "set `memory.vllm_gpu_memory_utilization` instead" in message


def test_a_vllm_share_with_colocation_off_is_refused():
    message = _refusal(algorithm="grpo", grpo=GRPO, memory={"vllm_colocate": False, "vllm_gpu_memory_utilization": 0.3})
    assert "there is no colocated vLLM to give a share to" in message


def test_a_vllm_share_outside_zero_to_one_is_refused():
    assert "less than 1" in _refusal(algorithm="grpo", grpo=GRPO, memory={"vllm_gpu_memory_utilization": 1.0})


def test_4bit_grpo_with_vllm_colocation_is_refused_naming_both_and_the_fix():
    message = _refusal(algorithm="grpo", grpo=GRPO, lora={"quantization": "4bit"})
    assert ("`lora.quantization` '4bit' with algorithm 'grpo' needs vLLM colocation off: TRL merges the adapter into "
            "the 4-bit base to load it into vLLM, which misbehaves. Set `memory.vllm_colocate` to false (the training "
            "model generates the completions), or `lora.quantization` to 'none'") in message


def test_4bit_grpo_with_vllm_colocation_off_is_accepted():
    job = _job(algorithm="grpo", grpo=GRPO, lora={"quantization": "4bit"}, memory={"vllm_colocate": False})
    assert (job.lora.quantization, job.memory.vllm_colocate) == ("4bit", False)


def test_the_handler_refuses_a_bad_memory_setting_before_anything_else(tmp_path):
    job = {"id": "j", "input": {"contract_version": CONTRACT_VERSION, "run_id": "r", "model": {"id": "/nonexistent"},
                                "dataset": {"store_path": "x.jsonl"}, "artifact_store": tmp_path.as_uri(),
                                "memory": {"micro_batch_size": 3}}}
    with pytest.raises(JobRefused, match=r"invalid job input: `memory`: Value error, `memory.micro_batch_size` \(3\)"):
        handler(job)


def test_a_forced_micro_batch_keeps_the_effective_batch_with_gradient_accumulation(tmp_path):
    job = _job(training={"batch_size": 8, "gradient_accumulation_steps": 2}, memory={"micro_batch_size": 4})
    args = shared_trainer_args(job, tmp_path)
    assert (args["per_device_train_batch_size"], args["gradient_accumulation_steps"]) == (4, 4)


def test_the_memory_plan_sizes_the_forced_micro_batch():
    job = _job(algorithm="grpo", grpo=GRPO, training={"batch_size": 8, "gradient_accumulation_steps": 2},
               lora={"dropout": 0.05}, memory={"micro_batch_size": 2})
    assert job_workload(job) == Workload(batch_size=2, seq_len=512 + 512, lora_rank=16, lora_dropout=0.05,
                                         generations=16)  # TRL's generation batch: the effective batch, unchanged


def test_memory_settings_leave_the_training_config_hash_alone():
    # They change how much memory an attempt takes, not what it learns: its adapter is the same run's.
    assert training_config_sha256(_job(memory={"micro_batch_size": 2, "gradient_checkpointing": True})) == (
        training_config_sha256(_job()))


def test_the_jobs_memory_settings_join_the_facts(tiny_model_dir):
    memory = MemorySettings(gradient_checkpointing=True)
    facts = gather_facts(tiny_model_dir, "sft", Workload(batch_size=2, seq_len=64, lora_rank=4), memory)
    assert facts.memory == memory


def test_a_run_records_its_forced_memory_settings_in_the_manifest(tiny_model_dir, tmp_path):
    store_root = tmp_path / "store"
    (store_root / "runs/m/dataset").mkdir(parents=True)
    shutil.copyfile(DEFAULT_CORPUS, store_root / "runs/m/dataset/train.jsonl")
    job = JobInput.model_validate({
        "run_id": "m", "model": {"id": str(tiny_model_dir)}, "dataset": {"store_path": "runs/m/dataset/train.jsonl"},
        "training": {"max_steps": 2, "batch_size": 4}, "memory": {"micro_batch_size": 2},
        "artifact_store": store_root.as_uri(),
    })
    work_dir = tmp_path / "work"
    work_dir.mkdir()
    outcome = train_sft(job, open_store(job.artifact_store), work_dir, lambda progress: None)
    assert outcome.manifest.forced_memory_settings == ["micro_batch_size"]
    assert outcome.metrics.steps == 2
    assert outcome.manifest.memory_plan is None  # no GPU, no memory plan
