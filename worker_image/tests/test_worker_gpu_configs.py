"""The configuration the worker builds on the GPUs it rents, built here under the image's locked libraries.

For an H100, an H200 and an RTX 4090, the fast paths are planned as on that GPU (CUDA, its compute capability
and memory, the kernel packages at the lock's versions, Liger's model types from the installed Liger), and the
`SFTConfig` / `GRPOConfig` that `sft_config` / `grpo_config` build from the plan, the model-loading kwargs among
them, must be accepted as they are by the locked transformers and TRL: an unknown or renamed keyword, or a value
TRL's validation refuses, fails here instead of on a rented GPU. The one check left out is transformers' probe
for a bf16-capable device, which this CPU machine cannot pass: the tests answer it as an sm_80+ GPU would.
Liger is applied for real to the tiny model under a GPU plan (its instance API works without a GPU).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import transformers.training_args
from peft import get_peft_model
from transformers import AutoModelForCausalLM, Trainer
from trl import GRPOConfig, SFTConfig
from trl.trainer.utils import create_model_from_path

from loraflow_worker.contract import JobInput
from loraflow_worker.training.fast_paths import (
    KERNEL_PACKAGES,
    Facts,
    FastPathPlan,
    allocator_conf,
    engage_fast_paths,
    plan_fast_paths,
)
from loraflow_worker.memory.model_shape import ModelShape, read_model_shape, shape_from_config
from loraflow_worker.memory.plan import usable_memory
from loraflow_worker.training.grpo import grpo_config
from loraflow_worker.training.sft import sft_config
from loraflow_worker.training.run import job_workload, lora_config

LOCK = Path(__file__).resolve().parents[1] / "requirements-gpu.lock"
LOCKED = dict(re.findall(r"^([a-z0-9][a-z0-9._-]*)==(\S+)", LOCK.read_text(), re.MULTILINE))
IMAGE_KERNEL_PACKAGES = {name: LOCKED[name] for name in KERNEL_PACKAGES if name in LOCKED}
"""The kernel packages the image installs, at the lock's versions (vllm, bitsandbytes, flash-linear-attention, ...)."""


@dataclass(frozen=True)
class Gpu:
    name: str
    capability: tuple[int, int]
    memory_bytes: int


# Memory as sold, in GB (torch reports a little more): the plans err on the small side.
H100 = Gpu("H100", (9, 0), 80 * 10**9)
H200 = Gpu("H200", (9, 0), 141 * 10**9)
RTX_4090 = Gpu("RTX 4090", (8, 9), 24 * 10**9)

# The public config.json values of Qwen3-1.7B and Qwen3-8B (the dimensions the memory plan reads).
QWEN3_1_7B = shape_from_config({"model_type": "qwen3", "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
                                "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151_936,
                                "tie_word_embeddings": True})
QWEN3_8B = shape_from_config({"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                              "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151_936,
                              "tie_word_embeddings": False})
QWEN3_5_SHAPED_2B = shape_from_config({
    "model_type": "qwen3_5_text", "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256, "vocab_size": 151_936, "tie_word_embeddings": True,
    "full_attention_interval": 4, "linear_num_key_heads": 16, "linear_num_value_heads": 16, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "mamba_ssm_dtype": "float32",
})
"""Gated-DeltaNet layers with one full-attention layer in four, as Qwen3.5 models are built (a made-up size)."""


@dataclass(frozen=True)
class Case:
    gpu: Gpu
    algorithm: str
    model_type: str
    model: ModelShape
    training: dict
    lora_rank: int = 16
    quantization: str = "none"
    memory: dict | None = None
    expect_checkpointing: bool = False
    expect_optim: str = "adamw_torch_fused"
    expect_vllm: bool = False


GRPO_SETTINGS = {"num_generations": 8, "max_prompt_length": 512, "max_completion_length": 1024,
                 "rewards": [{"name": "format", "pattern": "^<think>"}, {"name": "digit_fraction", "weight": 0.5}]}
CASES = [
    Case(H100, "sft", "qwen3", QWEN3_8B, {"batch_size": 8, "max_seq_length": 2048}, expect_checkpointing=True),
    Case(H200, "sft", "qwen3", QWEN3_1_7B, {"batch_size": 4, "max_seq_length": 1024}),
    Case(H100, "sft", "qwen3_5_text", QWEN3_5_SHAPED_2B, {"batch_size": 4, "max_seq_length": 4096}, expect_checkpointing=True),
    Case(RTX_4090, "sft", "qwen3", QWEN3_8B, {"batch_size": 1, "max_seq_length": 2048}, lora_rank=64,
         expect_checkpointing=True, expect_optim="paged_adamw_8bit"),
    Case(RTX_4090, "sft", "qwen3", QWEN3_8B, {"batch_size": 2, "max_seq_length": 2048}, quantization="4bit",
         expect_checkpointing=True),
    Case(H100, "grpo", "qwen3", QWEN3_1_7B, {"batch_size": 16, "gradient_accumulation_steps": 2}, expect_checkpointing=True,
         expect_vllm=True),
    Case(H200, "grpo", "qwen3", QWEN3_1_7B, {"batch_size": 8}, expect_vllm=True),
    Case(H200, "grpo", "qwen3", QWEN3_8B, {"batch_size": 16}, expect_checkpointing=True, expect_vllm=True),
    Case(RTX_4090, "grpo", "qwen3", QWEN3_1_7B, {"batch_size": 8}, expect_checkpointing=True, expect_vllm=True),
    # Micro-batches of 4: a 4-bit base's residual stream runs in fp32, and 8 sequences of 1536 tokens do not fit.
    Case(RTX_4090, "grpo", "qwen3", QWEN3_8B, {"batch_size": 4, "gradient_accumulation_steps": 2}, quantization="4bit",
         memory={"vllm_colocate": False}, expect_checkpointing=True),
    Case(H100, "grpo", "qwen3", QWEN3_1_7B, {"batch_size": 16}, memory={"micro_batch_size": 4, "vllm_gpu_memory_utilization": 0.2},
         expect_vllm=True),
]


def _id(case: Case) -> str:
    extra = "-4bit" if case.quantization == "4bit" else ""
    extra += "".join(f"-{name}={value}" for name, value in (case.memory or {}).items())
    return f"{case.gpu.name}-{case.algorithm}-{case.model_type}-{case.model.parameters // 10**8 / 10:g}B{extra}"


def _job(case: Case) -> JobInput:
    spec = {"run_id": "gpu-config", "algorithm": case.algorithm, "model": {"id": "Qwen/some-model"},
            "dataset": {"hub_id": "org/data"},
            "lora": {"rank": case.lora_rank, "alpha": 2 * case.lora_rank, "quantization": case.quantization},
            "training": {"max_steps": 100, "checkpoint_every_steps": 20, **case.training},
            "artifact_store": "file:///srv/store", "memory": case.memory}
    if case.algorithm == "grpo":
        spec["grpo"] = GRPO_SETTINGS
    return JobInput.model_validate(spec)


def _facts(case: Case, job: JobInput) -> Facts:
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    return Facts(
        cuda=True,
        compute_capability=case.gpu.capability,
        packages=IMAGE_KERNEL_PACKAGES,
        model_type=case.model_type,
        algorithm=case.algorithm,
        model=case.model,
        workload=job_workload(job),
        gpu_memory_bytes=case.gpu.memory_bytes,
        liger_model_types=frozenset(MODEL_TYPE_TO_APPLY_LIGER_FN),
        # What the allocator holds in the image: the setting gather_facts exports before CUDA initialises.
        allocator_settings=allocator_conf(frozenset()) or "",
        memory=job.memory,
    )


@pytest.fixture
def bf16_capable_device(monkeypatch):
    """transformers' probe for a bf16 device answered as on an sm_80+ GPU; every other check runs as it is."""
    monkeypatch.setattr(transformers.training_args, "is_torch_bf16_gpu_available", lambda: True)


def test_this_environment_has_the_locked_training_libraries():
    # The tests below mean something only under the image's versions (torch aside: its CPU build is older).
    for name in ("transformers", "trl", "peft", "accelerate", "datasets", "liger-kernel", "triton"):
        assert importlib.metadata.version(name) == LOCKED[name], name
    assert {"vllm", "bitsandbytes", "flash-linear-attention", "liger-kernel", "triton"} <= set(IMAGE_KERNEL_PACKAGES)


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_the_gpu_plan_decides_from_the_gpus_memory(case):
    job = _job(case)
    plan = plan_fast_paths(_facts(case, job))
    kwargs = plan.trainer_kwargs
    assert (kwargs["bf16"], kwargs["use_cpu"]) == (True, False)
    assert plan.model_init_kwargs == {"dtype": "bfloat16", "device_map": {"": 0}}
    # A 4-bit base is loaded by the worker (`load_model`), so TRL gets no loading kwargs to ignore.
    assert kwargs.get("model_init_kwargs") == (None if case.quantization == "4bit" else plan.model_init_kwargs)
    assert plan.fast_paths["liger_kernel"].engaged
    assert kwargs["gradient_checkpointing"] is case.expect_checkpointing, plan.fast_paths["gradient_checkpointing"].reason
    assert kwargs["optim"] == case.expect_optim, plan.fast_paths["paged_adamw_8bit"].reason
    assert "out-of-memory" not in plan.fast_paths["gradient_checkpointing"].reason
    if case.algorithm == "grpo":
        assert kwargs["use_vllm"] is case.expect_vllm, plan.fast_paths["vllm_colocate"].reason


@pytest.mark.parametrize("case", [c for c in CASES if c.algorithm == "sft"], ids=_id)
def test_the_locked_trl_accepts_the_sft_config_as_built_for_the_gpu(case, bf16_capable_device, tmp_path):
    job = _job(case)
    plan = plan_fast_paths(_facts(case, job))
    config = sft_config(job, plan, tmp_path)
    _assert_planned_values_survive(config, SFTConfig, plan)
    assert config.max_length == job.training.max_seq_length
    _assert_optimizer_resolves(config)


@pytest.mark.parametrize("case", [c for c in CASES if c.algorithm == "grpo"], ids=_id)
def test_the_locked_trl_accepts_the_grpo_config_as_built_for_the_gpu(case, bf16_capable_device, tmp_path):
    job = _job(case)
    facts = _facts(case, job)
    plan = plan_fast_paths(facts)
    config = grpo_config(job, plan, tmp_path)
    _assert_planned_values_survive(config, GRPOConfig, plan)
    assert (config.num_generations, config.max_completion_length) == (8, 1024)
    assert config.reward_weights == [1.0, 0.5]
    assert config.generation_batch_size == job.training.batch_size * job.training.gradient_accumulation_steps
    assert (config.per_device_train_batch_size * config.gradient_accumulation_steps
            == job.training.batch_size * job.training.gradient_accumulation_steps)
    assert config.use_vllm is case.expect_vllm
    if case.expect_vllm:
        assert (config.vllm_mode, config.vllm_enable_sleep_mode) == ("colocate", True)
        assert config.vllm_max_model_length == 512 + 1024
        share = config.vllm_gpu_memory_utilization
        # vLLM's share holds what the plan says it needs (or what the job forced), and leaves training the rest.
        needed = plan.memory.vllm
        forced = (case.memory or {}).get("vllm_gpu_memory_utilization")
        assert share == forced if forced else share * case.gpu.memory_bytes >= (
            needed.weights_bytes + needed.kv_cache_bytes + needed.linear_attention_state_bytes + needed.runtime_bytes)
        assert share * case.gpu.memory_bytes < usable_memory(case.gpu.memory_bytes)
    _assert_optimizer_resolves(config)


def test_the_model_loading_kwargs_load_the_model_whole_onto_one_device(tiny_model_dir):
    facts = _facts(CASES[0], _job(CASES[0]))
    model_init_kwargs = plan_fast_paths(facts).trainer_kwargs["model_init_kwargs"]
    # As TRL loads it, the device index (0, the GPU) mapped to this machine's only device.
    on_cpu = {**model_init_kwargs, "device_map": {"": "cpu"}}
    model = create_model_from_path(str(tiny_model_dir), **on_cpu)
    assert model.dtype == torch.bfloat16
    assert {p.device.type for p in model.parameters()} == {"cpu"}  # all of it on the mapped device, none offloaded


def test_liger_patches_the_tiny_model_under_a_gpu_plan(tiny_model_dir):
    # In a process of its own: Liger's instance API also swaps classes and functions of transformers' modeling module
    # (Qwen3RMSNorm, apply_rotary_pos_emb), which would give every Qwen3 built later in this process Triton kernels.
    probe = f"import json, {Path(__file__).stem} as t; print(json.dumps(t._liger_on_cpu({str(tiny_model_dir)!r})))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parent)})
    assert done.returncode == 0, done.stderr[-2000:]
    planned, engaged = json.loads(done.stdout.splitlines()[-1])
    assert planned == [True, "planned; confirmed once the model is built"]
    # Per layer (2) the input, post-attention, q and k norms, plus the final norm; each layer's MLP.
    assert engaged == [True, "Liger kernels on 9 LigerRMSNorm, 2 LigerSwiGLUMLP"]


def _liger_on_cpu(model_dir: str) -> tuple[list, list]:
    """Liger's record, as planned for an H100 and as `engage_fast_paths` finds it on the tiny model with its adapter."""
    case = Case(H100, "sft", "qwen3", read_model_shape(Path(model_dir)), {"batch_size": 8, "max_seq_length": 64})
    plan = plan_fast_paths(_facts(case, _job(case)))
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), lora_config(_job(case)))
    engaged = engage_fast_paths(plan, model)["liger_kernel"]
    planned = plan.fast_paths["liger_kernel"]
    return [planned.engaged, planned.reason], [engaged.engaged, engaged.reason]


def _assert_planned_values_survive(config, config_class, plan: FastPathPlan) -> None:
    """Every planned keyword is a field of the config class, and TRL kept its value (it did not drop or override it)."""
    fields = {f.name for f in dataclasses.fields(config_class)}
    assert set(plan.trainer_kwargs) <= fields, set(plan.trainer_kwargs) - fields
    for name, value in plan.trainer_kwargs.items():
        kept = getattr(config, name)
        assert (kept.value if name == "optim" else kept) == value, name


def _assert_optimizer_resolves(config) -> None:
    """transformers maps the planned optimizer name to the optimizer the image will build."""
    optimizer, kwargs = Trainer.get_optimizer_cls_and_kwargs(config)
    if config.optim.value == "paged_adamw_8bit":
        import bitsandbytes

        assert (optimizer, kwargs["optim_bits"], kwargs["is_paged"]) == (bitsandbytes.optim.AdamW, 8, True)
    else:
        assert (optimizer, kwargs["fused"]) == (torch.optim.AdamW, True)
