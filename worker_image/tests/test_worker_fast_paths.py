"""Fast-path decisions (pure, from the facts: kernels from the packages and the model, memory savers and vLLM's
share from the memory estimate), the facts this machine gives, their confirmation on a built model, and the CPU
manifest."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3_5ForCausalLM, Qwen3_5TextConfig
from transformers.integrations import use_kernel_func_from_hub_with_fallback

from loraflow_worker.artifacts import open_store
from loraflow_worker.contract import JobInput
from loraflow_worker.fast_paths import (
    ALLOC_CONF_ENV,
    DISABLE_ENV,
    EXPANDABLE_SEGMENTS as EXPANDABLE,
    FAST_PATHS,
    FORCE_ENV,
    Facts,
    cuda_allocator_settings,
    engage_fast_paths,
    gather_facts,
    kernel_hooks,
    plan_fast_paths,
)
from loraflow_worker.memory_estimate import (
    ADAMW_BYTES,
    CUDA_OVERHEAD_BYTES,
    GIB,
    MEMORY_HEADROOM,
    lora_parameters,
    ModelShape,
    read_model_shape,
    training_memory,
    usable_memory,
    vllm_memory,
    Workload,
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
QWEN3_1_7B = ModelShape(parameters=1_720_574_976, hidden_size=2048, intermediate_size=6144, layers=28,
                        attention_layers=28, kv_heads=8, head_dim=128, vocab_size=151_936)
QWEN3_8B = ModelShape(parameters=8_190_735_360, hidden_size=4096, intermediate_size=12288, layers=36,
                      attention_layers=36, kv_heads=8, head_dim=128, vocab_size=151_936)
H100_BYTES, H200_BYTES, RTX_4090_BYTES = 80 * 10**9, 141 * 10**9, 24 * 10**9  # as sold, in GB
SFT = Workload(batch_size=8, seq_len=1024, lora_rank=16)
GRPO = Workload(batch_size=16, seq_len=1024, lora_rank=16, generations=16)


def _cuda(algorithm="sft", model_type="qwen3_5_text", packages=EVERYTHING, **more) -> Facts:
    facts = {"compute_capability": (9, 0), "model": QWEN3_1_7B, "workload": GRPO if algorithm == "grpo" else SFT,
             "gpu_memory_bytes": H100_BYTES, "liger_model_types": LIGER_TYPES,
             "allocator_settings": "" if algorithm == "grpo" else EXPANDABLE, **more}
    return Facts(cuda=True, packages=packages, model_type=model_type, algorithm=algorithm, **facts)


def _gpu_with_usable(usable: int) -> int:
    """The total memory of a GPU whose plans may count on `usable` bytes."""
    return int((usable + CUDA_OVERHEAD_BYTES) / (1 - MEMORY_HEADROOM)) + 1


def _engaged(plan) -> set[str]:
    return {name for name, path in plan.fast_paths.items() if path.engaged}


def _without(*names: str) -> dict[str, str]:
    return {k: v for k, v in EVERYTHING.items() if k not in names}


def test_on_cpu_every_fast_path_is_off_because_there_is_no_cuda():
    plan = plan_fast_paths(Facts(cuda=False, compute_capability=None, packages=EVERYTHING, model_type="qwen3_5_text",
                                 algorithm="grpo", model=QWEN3_1_7B, workload=GRPO))
    assert list(plan.fast_paths) == list(FAST_PATHS)
    assert all(not p.engaged and p.reason == "no CUDA device" for p in plan.fast_paths.values())
    assert plan.trainer_kwargs == {
        "use_cpu": True, "bf16": False, "gradient_checkpointing": False,
        "model_init_kwargs": {"dtype": "float32"}, "use_vllm": False,
    }


def test_sft_on_a_large_gpu_engages_every_kernel_and_needs_no_memory_saver():
    plan = plan_fast_paths(_cuda())
    assert _engaged(plan) == {"bf16", "liger_kernel", "flash_linear_attention", "causal_conv1d", "fused_adamw",
                              "expandable_segments"}
    assert plan.fast_paths["vllm_colocate"].reason == "sft generates no completions"
    assert plan.trainer_kwargs == {
        "use_cpu": False, "bf16": True, "model_init_kwargs": {"dtype": "bfloat16", "device_map": {"": 0}},
        "gradient_checkpointing": False, "optim": "adamw_torch_fused",
    }


def test_the_model_is_loaded_whole_onto_the_one_gpu():
    # TRL's default device map ("auto") would put what does not fit on the CPU without a word.
    assert plan_fast_paths(_cuda()).trainer_kwargs["model_init_kwargs"]["device_map"] == {"": 0}


def test_the_estimate_counts_16_bit_weights_the_adapter_state_and_the_micro_batch_activations():
    facts = _cuda()
    tokens = SFT.batch_size * SFT.seq_len
    adapter = lora_parameters(QWEN3_1_7B, 16) * ADAMW_BYTES
    assert lora_parameters(QWEN3_1_7B, 16) == 16 * 28 * (11 * 2048 + 3 * 6144)
    assert training_memory(facts.model, facts.workload, bf16=True, checkpointing=False, optimizer_bytes=ADAMW_BYTES) == (
        QWEN3_1_7B.parameters * 2 + adapter + tokens * 2048 * 28 * 34)
    assert training_memory(facts.model, facts.workload, bf16=True, checkpointing=True, optimizer_bytes=ADAMW_BYTES) == (
        QWEN3_1_7B.parameters * 2 + adapter + tokens * 2048 * (28 * 2 + 34))
    assert training_memory(facts.model, facts.workload, bf16=False, checkpointing=False, optimizer_bytes=ADAMW_BYTES) == (
        QWEN3_1_7B.parameters * 4 + adapter + tokens * 2048 * 28 * 34 * 2)


def test_gradient_checkpointing_stays_off_when_training_fits_without_it():
    path = plan_fast_paths(_cuda()).fast_paths["gradient_checkpointing"]
    facts = _cuda()
    full = training_memory(facts.model, facts.workload, bf16=True, checkpointing=False, optimizer_bytes=ADAMW_BYTES)
    assert not path.engaged
    assert path.reason == f"not needed: ~{full / GIB:.1f} GiB estimated without it, {usable_memory(H100_BYTES) / GIB:.1f} GiB available"


def test_gradient_checkpointing_turns_on_when_the_activations_do_not_fit():
    facts = _cuda()
    full = training_memory(facts.model, facts.workload, bf16=True, checkpointing=False, optimizer_bytes=ADAMW_BYTES)
    recomputed = training_memory(facts.model, facts.workload, bf16=True, checkpointing=True, optimizer_bytes=ADAMW_BYTES)
    plan = plan_fast_paths(_cuda(gpu_memory_bytes=_gpu_with_usable((full + recomputed) // 2)))
    assert plan.trainer_kwargs["gradient_checkpointing"] is True
    assert plan.fast_paths["gradient_checkpointing"].reason.endswith(
        f"recomputing activations brings it to ~{recomputed / GIB:.1f} GiB")
    assert plan.trainer_kwargs["optim"] == "adamw_torch_fused"  # memory is not short once checkpointing is on


def test_memory_still_short_with_checkpointing_switches_to_8bit_paged_adamw():
    # Qwen3-8B with a rank-64 adapter on a 24 GB GPU: the adapter's AdamW state decides it.
    facts = _cuda(model=QWEN3_8B, workload=Workload(batch_size=1, seq_len=2048, lora_rank=64), gpu_memory_bytes=RTX_4090_BYTES)
    plan = plan_fast_paths(facts)
    assert plan.trainer_kwargs["gradient_checkpointing"] is True
    assert plan.trainer_kwargs["optim"] == "paged_adamw_8bit"
    assert plan.fast_paths["paged_adamw_8bit"].reason.startswith("memory is short: ~")
    assert plan.fast_paths["fused_adamw"] == plan.fast_paths["fused_adamw"].model_copy(
        update={"engaged": False, "reason": "8-bit paged AdamW instead"})
    assert "out-of-memory" not in plan.fast_paths["gradient_checkpointing"].reason  # 8-bit AdamW makes it fit


def test_short_memory_without_bitsandbytes_keeps_torch_adamw_and_says_so():
    facts = _cuda(model=QWEN3_8B, workload=Workload(batch_size=1, seq_len=2048, lora_rank=64),
                  gpu_memory_bytes=RTX_4090_BYTES, packages=_without("bitsandbytes"))
    plan = plan_fast_paths(facts)
    assert plan.trainer_kwargs["optim"] == "adamw_torch_fused"
    assert plan.fast_paths["paged_adamw_8bit"].reason.endswith("but bitsandbytes is not installed")


def test_a_plan_that_cannot_fit_even_at_its_leanest_warns_of_out_of_memory():
    facts = _cuda(model=QWEN3_8B, workload=Workload(batch_size=16, seq_len=4096, lora_rank=16), gpu_memory_bytes=RTX_4090_BYTES)
    reason = plan_fast_paths(facts).fast_paths["gradient_checkpointing"].reason
    assert reason.endswith("expect out-of-memory, lower the batch size or the sequence length")


def test_forced_gradient_checkpointing_is_on_even_where_memory_suffices():
    plan = plan_fast_paths(_cuda(forced=frozenset({"gradient_checkpointing"})))
    assert plan.trainer_kwargs["gradient_checkpointing"] is True
    assert plan.fast_paths["gradient_checkpointing"].reason.startswith("forced on for this run (~")


def test_forced_8bit_adamw_replaces_fused_adamw():
    plan = plan_fast_paths(_cuda(forced=frozenset({"paged_adamw_8bit"})))
    assert plan.trainer_kwargs["optim"] == "paged_adamw_8bit"
    assert plan.fast_paths["paged_adamw_8bit"].reason == "forced on for this run"


def test_grpo_with_vllm_colocates_it_with_sleep_mode_and_leaves_the_allocator_alone():
    plan = plan_fast_paths(_cuda(algorithm="grpo"))
    assert plan.fast_paths["vllm_colocate"].engaged
    assert plan.trainer_kwargs["use_vllm"] is True
    assert (plan.trainer_kwargs["vllm_mode"], plan.trainer_kwargs["vllm_enable_sleep_mode"]) == ("colocate", True)
    assert plan.fast_paths["expandable_segments"] == plan.fast_paths["expandable_segments"].model_copy(
        update={"engaged": False, "reason": "not with vLLM's sleep mode (its memory pool refuses expandable segments)"}
    )


def test_vllms_share_of_the_gpu_is_sized_from_the_model_and_the_gpu():
    grpo = _cuda(algorithm="grpo")
    needed = vllm_memory(grpo.model, grpo.workload)
    h100 = plan_fast_paths(_cuda(algorithm="grpo")).trainer_kwargs["vllm_gpu_memory_utilization"]
    h200 = plan_fast_paths(_cuda(algorithm="grpo", gpu_memory_bytes=H200_BYTES)).trainer_kwargs["vllm_gpu_memory_utilization"]
    assert (h100, h200) == (0.10, 0.06)
    assert h100 * H100_BYTES >= needed > (h100 - 0.01) * H100_BYTES  # rounded up to the next hundredth
    bigger = plan_fast_paths(_cuda(algorithm="grpo", model=QWEN3_8B)).trainer_kwargs["vllm_gpu_memory_utilization"]
    assert bigger > h100


def test_vllms_estimate_holds_its_weights_and_a_kv_cache_for_a_whole_generation_round():
    kv_per_token = 2 * 28 * 8 * 128 * 2  # keys and values, 28 attention layers, 8 heads of 128, bf16
    grpo = _cuda(algorithm="grpo")
    assert vllm_memory(grpo.model, grpo.workload) == QWEN3_1_7B.parameters * 2 + kv_per_token * 16 * 1024 + 2 * GIB


def test_vllms_share_is_taken_off_what_training_may_use():
    share = plan_fast_paths(_cuda(algorithm="grpo")).trainer_kwargs["vllm_gpu_memory_utilization"]
    reason = plan_fast_paths(_cuda(algorithm="grpo")).fast_paths["gradient_checkpointing"].reason
    budget = usable_memory(H100_BYTES) - int(share * H100_BYTES)
    assert reason.endswith(f"{budget / GIB:.1f} GiB available")


def test_vllm_is_not_colocated_where_it_would_not_fit_beside_training():
    facts = _cuda(algorithm="grpo", model=QWEN3_8B, workload=Workload(batch_size=8, seq_len=1536, lora_rank=16, generations=32),
                  gpu_memory_bytes=RTX_4090_BYTES)
    plan = plan_fast_paths(facts)
    assert plan.trainer_kwargs["use_vllm"] is False and "vllm_gpu_memory_utilization" not in plan.trainer_kwargs
    assert plan.fast_paths["vllm_colocate"].reason.endswith("usable: completions come from transformers' generate")
    assert plan.fast_paths["expandable_segments"].reason == "left unset: vLLM's sleep mode was still expected when CUDA initialised"


def test_grpo_without_vllm_generates_with_transformers_and_uses_expandable_segments():
    plan = plan_fast_paths(_cuda(algorithm="grpo", packages=_without("vllm"), allocator_settings="expandable_segments:True"))
    assert plan.trainer_kwargs["use_vllm"] is False and "vllm_mode" not in plan.trainer_kwargs
    assert "transformers' generate" in plan.fast_paths["vllm_colocate"].reason
    assert plan.fast_paths["expandable_segments"].engaged


def test_expandable_segments_count_only_when_the_allocator_holds_them():
    path = plan_fast_paths(_cuda(allocator_settings="")).fast_paths["expandable_segments"]
    assert not path.engaged
    assert path.reason == "the allocator holds '', not expandable_segments:True: CUDA initialised before PYTORCH_CUDA_ALLOC_CONF was set"


def test_an_allocator_setting_from_the_environment_is_kept_and_recorded():
    plan = plan_fast_paths(_cuda(alloc_conf="max_split_size_mb:128", allocator_settings="max_split_size_mb:128"))
    assert plan.fast_paths["expandable_segments"] == plan.fast_paths["expandable_segments"].model_copy(
        update={"engaged": False, "reason": "PYTORCH_CUDA_ALLOC_CONF is set to 'max_split_size_mb:128' by the environment"})


def test_expandable_segments_from_the_environment_keep_vllm_awake():
    # vLLM's sleep mode allocates from its own memory pool, which refuses expandable segments.
    plan = plan_fast_paths(_cuda(algorithm="grpo", alloc_conf=EXPANDABLE, allocator_settings=EXPANDABLE))
    assert plan.trainer_kwargs["use_vllm"] is True and plan.trainer_kwargs["vllm_enable_sleep_mode"] is False
    assert "awake throughout" in plan.fast_paths["vllm_colocate"].reason


def test_a_gpu_without_bf16_trains_in_fp32():
    plan = plan_fast_paths(_cuda(compute_capability=(7, 5), model_type="qwen3"))
    assert plan.fast_paths["bf16"].reason == "sm_75 has no bf16 tensor cores: training in fp32"
    assert plan.trainer_kwargs["bf16"] is False
    assert plan.trainer_kwargs["model_init_kwargs"] == {"dtype": "float32", "device_map": {"": 0}}


def test_liger_needs_the_package_triton_and_kernels_for_the_model_type():
    assert plan_fast_paths(_cuda(packages=_without("liger-kernel"))).fast_paths["liger_kernel"].reason == "liger-kernel not installed"
    assert "triton not installed" in plan_fast_paths(_cuda(packages=_without("triton"))).fast_paths["liger_kernel"].reason
    assert plan_fast_paths(_cuda(model_type="gpt2")).fast_paths["liger_kernel"].reason == (
        "Liger 0.8.5 has no kernels for model type `gpt2`"
    )


def test_disabled_fast_paths_are_off_with_their_settings_dropped():
    disabled = frozenset({"liger_kernel", "fused_adamw", "vllm_colocate", "expandable_segments"})
    plan = plan_fast_paths(_cuda(algorithm="grpo", disabled=disabled, liger_model_types=frozenset()))
    for name in disabled:
        assert plan.fast_paths[name].reason == "disabled for this run"
    assert plan.trainer_kwargs["optim"] == "adamw_torch" and plan.trainer_kwargs["use_vllm"] is False


def test_the_disable_setting_blocks_kernel_imports_and_rejects_unknown_names(tiny_model_dir, monkeypatch):
    monkeypatch.setenv(DISABLE_ENV, "flash_linear_attention, liger_kernel")
    assert "fla" not in sys.modules
    try:
        facts = gather_facts(tiny_model_dir, "sft", SFT)
        assert facts.disabled == {"flash_linear_attention", "liger_kernel"}
        with pytest.raises(ImportError):
            import fla  # noqa: F401
        assert sys.modules.get("liger_kernel", "absent") is not None  # not blocked: Liger is simply not applied
    finally:
        sys.modules.pop("fla", None)
    monkeypatch.setenv(DISABLE_ENV, "liger,bf16")
    with pytest.raises(ValueError, match=r"unknown fast paths liger: use any of bf16, liger_kernel, "):
        gather_facts(tiny_model_dir, "sft", SFT)


def test_the_force_setting_names_only_memory_savers(tiny_model_dir, monkeypatch):
    monkeypatch.setenv(FORCE_ENV, "gradient_checkpointing")
    assert gather_facts(tiny_model_dir, "sft", SFT).forced == {"gradient_checkpointing"}
    monkeypatch.setenv(FORCE_ENV, "liger_kernel")
    with pytest.raises(ValueError, match=r"LORAFLOW_FORCE_FAST_PATHS names unknown fast paths liger_kernel: use any of "
                                         r"gradient_checkpointing, paged_adamw_8bit"):
        gather_facts(tiny_model_dir, "sft", SFT)


def test_gathered_facts_on_this_machine_describe_a_cpu(tiny_model_dir):
    facts = gather_facts(tiny_model_dir, "sft", SFT)
    assert (facts.cuda, facts.compute_capability, facts.model_type) == (False, None, "qwen3")
    assert (facts.gpu_memory_bytes, facts.allocator_settings, facts.workload) == (None, None, SFT)


def test_the_allocator_setting_is_exported_before_cuda_initialises(tiny_model_dir, monkeypatch):
    # This machine has no GPU: torch's device probes stand in for one, recording the variable as CUDA would see it.
    seen_at_init = []

    def device_properties(index):
        seen_at_init.append(os.environ.get(ALLOC_CONF_ENV))
        return SimpleNamespace(major=9, minor=0, total_memory=H100_BYTES)

    monkeypatch.delenv(ALLOC_CONF_ENV, raising=False)
    monkeypatch.setenv(DISABLE_ENV, "liger_kernel")  # Liger's import needs a real driver
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", device_properties)
    facts = gather_facts(tiny_model_dir, "sft", SFT)
    assert seen_at_init == [EXPANDABLE]
    assert (facts.alloc_conf, facts.compute_capability, facts.gpu_memory_bytes) == (None, (9, 0), H100_BYTES)
    assert facts.allocator_settings == cuda_allocator_settings()


def test_the_allocator_keeps_the_setting_it_read_first():
    # What the manifest records: the allocator's own settings, which a later change of the variable does not move.
    script = (
        "import os\n"
        "from loraflow_worker.fast_paths import cuda_allocator_settings\n"
        "print(cuda_allocator_settings())\n"
        "os.environ['PYTORCH_CUDA_ALLOC_CONF'] = 'max_split_size_mb:64'\n"
        "print(cuda_allocator_settings())\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, ALLOC_CONF_ENV: EXPANDABLE})
    assert done.stdout.splitlines() == [EXPANDABLE, EXPANDABLE], done.stderr


def test_the_model_shape_comes_from_the_config_and_the_safetensors_headers(tiny_model_dir):
    shape = read_model_shape(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert shape.parameters == sum(p.numel() for p in model.parameters())
    assert (shape.hidden_size, shape.intermediate_size, shape.layers, shape.attention_layers) == (64, 128, 2, 2)
    assert (shape.kv_heads, shape.head_dim, shape.vocab_size) == (2, 16, 512)


def test_only_full_attention_layers_of_a_gated_deltanet_model_hold_a_kv_cache(tmp_path):
    _tiny_qwen3_5().save_pretrained(tmp_path)
    shape = read_model_shape(tmp_path)
    assert (shape.layers, shape.attention_layers) == (2, 1)


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
    assert manifest.cuda_allocator_settings is None
    rows = [json.loads(line) for line in DEFAULT_CORPUS.read_text().splitlines() if line.strip()]
    assert manifest.dataset_sha256 == rows_sha256(rows)
    # The config hash ignores what names the attempt, and changes with what decides the training.
    assert manifest.config_sha256 == training_config_sha256(job.model_copy(update={"run_id": "other", "attempt": 3}))
    changed = job.model_copy(update={"training": job.training.model_copy(update={"learning_rate": 1e-3})})
    assert manifest.config_sha256 != training_config_sha256(changed)
    assert {"torch", "transformers", "trl", "peft"} <= set(manifest.libraries)
