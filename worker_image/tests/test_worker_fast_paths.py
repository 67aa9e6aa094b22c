"""Fast-path decisions (pure, from the facts), their confirmation on a built model, and the CPU manifest."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
import torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
from transformers.integrations import use_kernel_func_from_hub_with_fallback

from loraflow_worker.artifacts import open_store
from loraflow_worker.contract import JobInput
from loraflow_worker.fast_paths import (
    DISABLE_ENV,
    FAST_PATHS,
    Facts,
    engage_fast_paths,
    gather_facts,
    kernel_hooks,
    plan_fast_paths,
)
from loraflow_worker.manifest import rows_sha256, training_config_sha256
from loraflow_worker.sft import train_sft
from loraflow_worker.tiny_model import DEFAULT_CORPUS

EVERYTHING = {
    "liger-kernel": "0.8.5",
    "flash-linear-attention": "0.6.0",
    "causal-conv1d": "1.6.0",
    "bitsandbytes": "0.50.2",
    "vllm": "0.33.0",
    "triton": "3.8.0",
}
LIGER_TYPES = frozenset({"qwen3", "qwen3_5", "qwen3_5_text"})


def _cuda(algorithm="sft", model_type="qwen3_5_text", packages=EVERYTHING, **more) -> Facts:
    return Facts(cuda=True, compute_capability=(9, 0), packages=packages, model_type=model_type,
                 algorithm=algorithm, liger_model_types=LIGER_TYPES, **more)


def _engaged(plan) -> set[str]:
    return {name for name, path in plan.fast_paths.items() if path.engaged}


def _without(*names: str) -> dict[str, str]:
    return {k: v for k, v in EVERYTHING.items() if k not in names}


def test_on_cpu_every_fast_path_is_off_because_there_is_no_cuda():
    plan = plan_fast_paths(Facts(cuda=False, compute_capability=None, packages=EVERYTHING, model_type="qwen3_5_text", algorithm="grpo"))
    assert list(plan.fast_paths) == list(FAST_PATHS)
    assert all(not p.engaged and p.reason == "no CUDA device" for p in plan.fast_paths.values())
    assert plan.trainer_kwargs == {
        "use_cpu": True, "bf16": False, "gradient_checkpointing": False,
        "model_init_kwargs": {"dtype": "float32"}, "use_vllm": False,
    }
    assert plan.env == {}


def test_sft_on_cuda_with_everything_installed_engages_every_training_fast_path():
    plan = plan_fast_paths(_cuda())
    assert _engaged(plan) == set(FAST_PATHS) - {"vllm_colocate"}
    assert plan.fast_paths["vllm_colocate"].reason == "sft generates no completions"
    assert plan.trainer_kwargs == {
        "use_cpu": False, "bf16": True, "model_init_kwargs": {"dtype": "bfloat16"},
        "gradient_checkpointing": True, "optim": "paged_adamw_8bit",
    }
    assert plan.env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def test_missing_fla_on_a_gated_deltanet_model_is_recorded_as_the_slow_torch_loop():
    plan = plan_fast_paths(_cuda(packages=_without("flash-linear-attention")))
    fla = plan.fast_paths["flash_linear_attention"]
    assert not fla.engaged
    assert fla.reason == "flash-linear-attention not installed: transformers runs its torch loop, several times slower"
    assert {"liger_kernel", "causal_conv1d", "bf16"} <= _engaged(plan)


def test_models_without_gated_deltanet_layers_do_not_need_fla():
    plan = plan_fast_paths(_cuda(model_type="qwen3"))
    for name in ("flash_linear_attention", "causal_conv1d"):
        assert plan.fast_paths[name].reason == "`qwen3` has no Gated-DeltaNet layers"
    assert plan.fast_paths["liger_kernel"].engaged


def test_grpo_with_vllm_colocates_it_with_sleep_mode_and_leaves_the_allocator_alone():
    plan = plan_fast_paths(_cuda(algorithm="grpo"))
    assert plan.fast_paths["vllm_colocate"].engaged
    assert plan.trainer_kwargs["use_vllm"] is True
    assert (plan.trainer_kwargs["vllm_mode"], plan.trainer_kwargs["vllm_enable_sleep_mode"]) == ("colocate", True)
    assert plan.fast_paths["expandable_segments"] == plan.fast_paths["expandable_segments"].model_copy(
        update={"engaged": False, "reason": "not with vLLM's sleep mode"}
    )
    assert plan.env == {}


def test_grpo_without_vllm_generates_with_transformers_and_uses_expandable_segments():
    plan = plan_fast_paths(_cuda(algorithm="grpo", packages=_without("vllm")))
    assert plan.trainer_kwargs["use_vllm"] is False and "vllm_mode" not in plan.trainer_kwargs
    assert "transformers' generate" in plan.fast_paths["vllm_colocate"].reason
    assert plan.env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def test_a_gpu_without_bf16_trains_in_fp32():
    plan = plan_fast_paths(Facts(cuda=True, compute_capability=(7, 5), packages=EVERYTHING, model_type="qwen3",
                                 algorithm="sft", liger_model_types=LIGER_TYPES))
    assert plan.fast_paths["bf16"].reason == "sm_75 has no bf16 tensor cores: training in fp32"
    assert plan.trainer_kwargs["bf16"] is False and plan.trainer_kwargs["model_init_kwargs"] == {"dtype": "float32"}


def test_liger_needs_the_package_triton_and_kernels_for_the_model_type():
    assert plan_fast_paths(_cuda(packages=_without("liger-kernel"))).fast_paths["liger_kernel"].reason == "liger-kernel not installed"
    assert "triton not installed" in plan_fast_paths(_cuda(packages=_without("triton"))).fast_paths["liger_kernel"].reason
    assert plan_fast_paths(_cuda(model_type="gpt2")).fast_paths["liger_kernel"].reason == (
        "Liger 0.8.5 has no kernels for model type `gpt2`"
    )


def test_without_bitsandbytes_the_optimizer_is_torch_adamw():
    plan = plan_fast_paths(_cuda(packages=_without("bitsandbytes")))
    assert "optim" not in plan.trainer_kwargs
    assert plan.fast_paths["paged_adamw_8bit"].reason == "bitsandbytes not installed: torch AdamW"


def test_an_allocator_setting_from_the_environment_is_kept():
    plan = plan_fast_paths(_cuda(alloc_conf="max_split_size_mb:128"))
    assert plan.env == {}
    assert "already set to 'max_split_size_mb:128'" in plan.fast_paths["expandable_segments"].reason


def test_disabled_fast_paths_are_off_with_their_settings_dropped():
    plan = plan_fast_paths(_cuda(algorithm="grpo", disabled=frozenset({"liger_kernel", "paged_adamw_8bit", "vllm_colocate"})))
    for name in ("liger_kernel", "paged_adamw_8bit", "vllm_colocate"):
        assert plan.fast_paths[name].reason == "disabled for this run"
    assert "optim" not in plan.trainer_kwargs and plan.trainer_kwargs["use_vllm"] is False
    assert plan.env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}  # no vLLM, so no sleep mode


def test_the_disable_setting_blocks_kernel_imports_and_rejects_unknown_names(tiny_model_dir, monkeypatch):
    monkeypatch.setenv(DISABLE_ENV, "flash_linear_attention, liger_kernel")
    assert "fla" not in sys.modules
    try:
        facts = gather_facts(tiny_model_dir, "sft")
        assert facts.disabled == {"flash_linear_attention", "liger_kernel"}
        with pytest.raises(ImportError):
            import fla  # noqa: F401
        assert "liger_kernel" not in sys.modules  # Liger is switched off by not applying it
    finally:
        sys.modules.pop("fla", None)
    monkeypatch.setenv(DISABLE_ENV, "liger,bf16")
    with pytest.raises(ValueError, match=r"unknown fast paths liger: use any of bf16, liger_kernel, "):
        gather_facts(tiny_model_dir, "sft")


def test_gathered_facts_on_this_machine_describe_a_cpu(tiny_model_dir):
    facts = gather_facts(tiny_model_dir, "sft")
    assert (facts.cuda, facts.compute_capability, facts.model_type) == (False, None, "qwen3")


def _tiny_qwen3_5() -> Qwen3_5ForCausalLM:
    config = Qwen3_5TextConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_num_key_heads=2, linear_num_value_heads=2, full_attention_interval=2,
    )
    return Qwen3_5ForCausalLM(config)


def test_kernel_hooks_show_qwen3_5_on_its_torch_fallback_without_fla():
    hooks = kernel_hooks(_tiny_qwen3_5())
    assert hooks["torch_chunk_gated_delta_rule"] == ("fla", False)
    assert hooks["causal_conv1d_fn"] == ("causal_conv1d", False)


def test_an_installed_kernel_that_transformers_did_not_bind_is_recorded_as_off():
    # The field failure this guards against: fla installed, but its import failed, so transformers silently
    # fell back to the torch loop. The plan (from the installed packages) says on; the model says otherwise.
    plan = plan_fast_paths(_cuda(packages=_without("liger-kernel")))
    record = engage_fast_paths(plan, _tiny_qwen3_5())
    assert not record["flash_linear_attention"].engaged
    assert record["flash_linear_attention"].reason == (
        "installed, but transformers uses its torch fallback for torch_chunk_gated_delta_rule, "
        "torch_recurrent_gated_delta_rule (importing `fla` failed)"
    )
    assert not record["causal_conv1d"].engaged


@use_kernel_func_from_hub_with_fallback("sqrt", "math")
def _reference_sqrt(x):
    return x**0.5


class _ModelUsingMathKernel(torch.nn.Module):
    """A model whose modeling module (this one) binds `math.sqrt` through transformers' kernel hook."""


def test_kernel_hooks_see_a_kernel_transformers_did_bind():
    assert kernel_hooks(_ModelUsingMathKernel()) == {"_reference_sqrt": ("math", True)}


def test_a_cpu_sft_run_records_no_fast_path_and_its_reproducibility_facts(tiny_model_dir, tmp_path):
    store_root = tmp_path / "store"
    (store_root / "runs/m/dataset").mkdir(parents=True)
    shutil.copyfile(DEFAULT_CORPUS, store_root / "runs/m/dataset/train.jsonl")
    job = JobInput.model_validate({
        "run_id": "m", "model": {"id": str(tiny_model_dir)}, "dataset": {"store_path": "runs/m/dataset/train.jsonl"},
        "training": {"max_steps": 2, "batch_size": 4}, "artifact_store": store_root.as_uri(),
    })
    work_dir = tmp_path / "work"
    work_dir.mkdir()
    manifest = train_sft(job, open_store(job.artifact_store), work_dir, lambda progress: None).manifest

    assert set(manifest.fast_paths) == set(FAST_PATHS)
    assert all(not p.engaged and p.reason == "no CUDA device" for p in manifest.fast_paths.values())
    assert manifest.device == "cpu" and manifest.cuda_version is None and manifest.seed == 42
    rows = [json.loads(line) for line in DEFAULT_CORPUS.read_text().splitlines() if line.strip()]
    assert manifest.dataset_sha256 == rows_sha256(rows)
    # The config hash ignores what names the attempt, and changes with what decides the training.
    assert manifest.config_sha256 == training_config_sha256(job.model_copy(update={"run_id": "other", "attempt": 3}))
    changed = job.model_copy(update={"training": job.training.model_copy(update={"learning_rate": 1e-3})})
    assert manifest.config_sha256 != training_config_sha256(changed)
    assert {"torch", "transformers", "trl", "peft"} <= set(manifest.libraries)
