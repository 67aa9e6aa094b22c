"""QLoRA (`lora.quantization: 4bit`) against the locked transformers, PEFT, TRL and bitsandbytes: the quantization
config the worker builds, the 4-bit base it loads and prepares, and a short SFT run on it. bitsandbytes' CPU backend
loads, runs and back-propagates through 4-bit layers, so all of it runs here; only its speed needs a GPU."""

from __future__ import annotations

import json
import shutil

import bitsandbytes
import pytest
import torch
from peft import get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from loraflow_worker.artifacts import open_store
from loraflow_worker.contract import JobInput
from loraflow_worker.training.fast_paths import FastPathPlan
from loraflow_worker.training.grpo import train_grpo
from loraflow_worker.training.sft import train_sft
from loraflow_worker.self_test.tiny_model import DEFAULT_CORPUS
from loraflow_worker.training.run import load_model, lora_config, quantization_config


def _job(model_dir="org/model", quantization="4bit", **fields) -> JobInput:
    return JobInput.model_validate({"run_id": "q", "model": {"id": str(model_dir)}, "dataset": {"hub_id": "org/data"},
                                    "lora": {"rank": 4, "quantization": quantization}, "artifact_store": "file:///srv/store",
                                    **fields})


def _cpu_plan(checkpointing: bool = False) -> FastPathPlan:
    # What plan_fast_paths gives a 4-bit job on the CPU: no loading kwargs for TRL, fp32 for the worker's own loading.
    return FastPathPlan({}, {"use_cpu": True, "bf16": False, "gradient_checkpointing": checkpointing}, {"dtype": "float32"})


def test_4bit_is_nf4_with_double_quantization_computing_in_bf16():
    config = quantization_config(_job())
    assert (config.load_in_4bit, config.bnb_4bit_quant_type, config.bnb_4bit_use_double_quant) == (True, "nf4", True)
    assert config.bnb_4bit_compute_dtype == torch.bfloat16


def test_a_bf16_base_gets_no_quantization_and_trl_loads_it_from_its_folder(tiny_model_dir):
    assert quantization_config(_job(quantization="none")) is None
    assert load_model(tiny_model_dir, _job(quantization="none"), _cpu_plan()) == str(tiny_model_dir)


def test_the_4bit_base_quantizes_the_blocks_linear_layers_and_nothing_else(tiny_model_dir):
    model = load_model(tiny_model_dir, _job(), _cpu_plan())
    block_linears = [m for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear)]
    assert block_linears and all(isinstance(m, bitsandbytes.nn.Linear4bit) for m in block_linears)
    state = block_linears[0].weight.quant_state
    assert (state.quant_type, state.nested) == ("nf4", True)  # nested: the absmax values are quantized again
    assert not isinstance(model.lm_head, bitsandbytes.nn.Linear4bit)


def test_the_4bit_base_is_prepared_for_kbit_training(tiny_model_dir):
    model = load_model(tiny_model_dir, _job(), _cpu_plan())
    assert not any(p.requires_grad for p in model.parameters())  # frozen: only the adapter will train
    unquantized = [p for p in model.parameters() if p.__class__.__name__ != "Params4bit"]
    assert {p.dtype for p in unquantized} == {torch.float32}  # embeddings, LM head, norms upcast for stable training


def test_the_4bit_base_gets_gradient_checkpointing_when_the_plan_has_it(tiny_model_dir):
    assert load_model(tiny_model_dir, _job(), _cpu_plan(checkpointing=True)).is_gradient_checkpointing
    assert not load_model(tiny_model_dir, _job(), _cpu_plan(checkpointing=False)).is_gradient_checkpointing


def test_the_locked_peft_adapts_the_4bit_layers_with_the_jobs_lora_config(tiny_model_dir):
    job = _job()
    model = get_peft_model(load_model(tiny_model_dir, job, _cpu_plan()), lora_config(job))
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in name or ".lora_B." in name for name in trainable)
    assert sum(isinstance(m, bitsandbytes.nn.Linear4bit) for m in model.modules()) == 14  # 7 per layer, 2 layers


@pytest.fixture(scope="module")
def qlora_run(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("qlora")
    (root / "store/runs/q/dataset").mkdir(parents=True)
    shutil.copyfile(DEFAULT_CORPUS, root / "store/runs/q/dataset/train.jsonl")
    job = JobInput.model_validate({
        "run_id": "q", "model": {"id": str(tiny_model_dir)}, "dataset": {"store_path": "runs/q/dataset/train.jsonl"},
        "lora": {"rank": 4, "quantization": "4bit"}, "training": {"max_steps": 3, "batch_size": 4, "learning_rate": 1e-2},
        "artifact_store": (root / "store").as_uri(),
    })
    (root / "work").mkdir()
    return train_sft(job, open_store(job.artifact_store), root / "work", lambda progress: None)


def test_a_qlora_sft_run_trains_the_adapter(qlora_run):
    weights = load_file(qlora_run.adapter_dir / "adapter_model.safetensors")
    lora_b = [tensor for name, tensor in weights.items() if "lora_B" in name]
    assert lora_b and any(tensor.abs().sum() > 0 for tensor in lora_b)  # lora_B starts at zero
    assert qlora_run.metrics.steps == 3 and all(loss == loss for _, loss in qlora_run.metrics.losses)


def test_a_qlora_adapter_names_its_base_not_a_quantized_copy(qlora_run):
    config = json.loads((qlora_run.adapter_dir / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == qlora_run.manifest.job.model.id


def test_a_qlora_runs_adapter_trains_in_fp32_where_trl_cast_it_to_bf16_and_the_manifest_says_so(qlora_run):
    weights = load_file(qlora_run.adapter_dir / "adapter_model.safetensors")
    assert {t.dtype for name, t in weights.items() if "lora_" in name} == {torch.float32}
    assert qlora_run.manifest.trainable_dtypes == {"lora": "float32"}


def test_the_manifest_of_a_qlora_run_records_the_quantization(qlora_run):
    assert qlora_run.manifest.job.lora.quantization == "4bit"
    assert "bitsandbytes" in qlora_run.manifest.libraries


BF16_STUCK = 2.0**-4
"""Above this magnitude bf16's spacing is at least 2^-4 × 2^-7, so an AdamW step of 2e-4 (about the learning rate) is
under half of it and rounds away."""


def test_a_qlora_runs_lm_head_trains_in_fp32_and_moves_where_bf16_could_not(tiny_model_dir, tmp_path):
    # TRL casts a quantized model's trainable parameters to bf16; the worker keeps the full copies in fp32.
    (tmp_path / "store/runs/h/dataset").mkdir(parents=True)
    shutil.copyfile(DEFAULT_CORPUS, tmp_path / "store/runs/h/dataset/train.jsonl")
    job = JobInput.model_validate({
        "run_id": "h", "model": {"id": str(tiny_model_dir)}, "dataset": {"store_path": "runs/h/dataset/train.jsonl"},
        "lora": {"rank": 4, "quantization": "4bit", "modules_to_save": ["lm_head"]},
        "training": {"max_steps": 2, "batch_size": 4, "learning_rate": 2e-4, "weight_decay": 0.0},
        "artifact_store": (tmp_path / "store").as_uri(),
    })
    (tmp_path / "work").mkdir()
    outcome = train_sft(job, open_store(job.artifact_store), tmp_path / "work", lambda progress: None)
    weights = load_file(outcome.adapter_dir / "adapter_model.safetensors")
    head = next(tensor for name, tensor in weights.items() if "lm_head" in name)
    assert head.dtype == torch.float32
    assert outcome.manifest.trainable_dtypes == {"lora": "float32", "modules_to_save": "float32"}
    # Training starts from the base's head as TRL's cast left it: rounded to bf16.
    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).lm_head.weight.detach().bfloat16()
    large = start.abs() > BF16_STUCK
    assert large.sum() > 20
    moved = (head[large] - start[large].float()).abs()
    assert (moved > 0).float().mean() > 0.9, moved


def test_a_bf16_weight_of_that_magnitude_does_not_move_at_that_learning_rate():
    # Why the copies must stay fp32: the same AdamW step on bf16 weights rounds back to where they were.
    weight = torch.nn.Parameter(torch.tensor([0.07, 0.1, -0.3, 0.5], dtype=torch.bfloat16))
    before = weight.detach().clone()
    optimizer = torch.optim.AdamW([weight], lr=2e-4, weight_decay=0.0)
    for _ in range(3):
        weight.grad = torch.ones_like(weight)
        optimizer.step()
    assert torch.equal(weight.detach(), before)


def test_a_qlora_grpo_run_generates_with_the_training_model_and_trains(tiny_model_dir, tmp_path):
    (tmp_path / "store/runs/g/dataset").mkdir(parents=True)
    shutil.copyfile(DEFAULT_CORPUS, tmp_path / "store/runs/g/dataset/train.jsonl")
    job = JobInput.model_validate({
        "run_id": "g", "algorithm": "grpo", "model": {"id": str(tiny_model_dir)},
        "dataset": {"store_path": "runs/g/dataset/train.jsonl"}, "lora": {"rank": 4, "quantization": "4bit"},
        "training": {"max_steps": 2, "batch_size": 8, "learning_rate": 1e-2},
        "grpo": {"num_generations": 4, "max_completion_length": 8, "rewards": [{"name": "digit_fraction"}]},
        "memory": {"vllm_colocate": False}, "artifact_store": (tmp_path / "store").as_uri(),
    })
    (tmp_path / "work").mkdir()
    outcome = train_grpo(job, open_store(job.artifact_store), tmp_path / "work", lambda progress: None)
    assert outcome.metrics.steps == 2 and len(outcome.metrics.rewards) == 2
    assert outcome.manifest.forced_memory_settings == ["vllm_colocate"]
