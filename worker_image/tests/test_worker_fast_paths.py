"""Fast-path decisions (pure, from the facts: kernels from the packages and the model, memory savers and vLLM's
share from the memory plan and the job's forced memory settings), the facts this machine gives, their confirmation on
a built model, and the CPU manifest. The memory plan's own arithmetic is tested in test_worker_memory_plan.py."""

from __future__ import annotations

import dataclasses
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
from loraflow_worker.contract import FastPathSettings, JobInput, MemorySettings
from loraflow_worker.training.fast_paths import (
    ALLOC_CONF_ENV,
    EXPANDABLE_SEGMENTS as EXPANDABLE,
    FAST_PATHS,
    Facts,
    Workload,
    allocator_conf,
    cuda_allocator_settings,
    engage_fast_paths,
    gather_facts,
    kernel_hooks,
    plan_fast_paths,
)
from loraflow_worker.artifacts.manifest import rows_sha256, training_config_sha256
from loraflow_worker.memory.model_shape import read_model_shape, shape_from_config
from loraflow_worker.memory.plan import CUDA_OVERHEAD_BYTES, MEMORY_HEADROOM, plan_job, plan_memory
from loraflow_worker.training.sft import train_sft
from loraflow_worker.self_test.tiny_model import DEFAULT_CORPUS

EVERYTHING = {
    "liger-kernel": "0.8.5",
    "flash-linear-attention": "0.6.0",
    "causal-conv1d": "1.6.0",
    "bitsandbytes": "0.50.2",
    "vllm": "0.33.0",
    "triton": "3.8.0",
}
LIGER_TYPES = frozenset({"qwen3", "qwen3_5", "qwen3_5_text"})
# The public config.json values of Qwen3-1.7B and Qwen3-8B (the dimensions the memory plan reads).
QWEN3_1_7B = shape_from_config({"model_type": "qwen3", "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
                                "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151_936,
                                "tie_word_embeddings": True})
QWEN3_8B = shape_from_config({"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                              "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151_936,
                              "tie_word_embeddings": False})
H100_BYTES, H200_BYTES, RTX_4090_BYTES = 80 * 10**9, 141 * 10**9, 24 * 10**9  # as sold, in GB
SFT = Workload(batch_size=8, seq_len=1024, lora_rank=16)
GRPO = Workload(batch_size=16, seq_len=1024, lora_rank=16, generations=16)


def _cuda(algorithm="sft", model_type="qwen3_5_text", packages=EVERYTHING, **more) -> Facts:
    facts = {"compute_capability": (9, 0), "model": QWEN3_1_7B, "workload": GRPO if algorithm == "grpo" else SFT,
             "gpu_memory_bytes": H100_BYTES, "liger_model_types": LIGER_TYPES, "allocator_settings": EXPANDABLE, **more}
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
    assert plan.memory is None


def test_sft_on_a_large_gpu_engages_every_kernel_and_needs_no_memory_saver():
    plan = plan_fast_paths(_cuda(model_type="qwen3_5_text"))
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


def test_the_memory_decisions_are_the_memory_plans():
    facts = _cuda()
    plan = plan_fast_paths(facts)
    expected = plan_memory(QWEN3_1_7B, algorithm="sft", batch_size=8, seq_len=1024, lora_rank=16, lora_dropout=0.0,
                           gpu_memory_bytes=H100_BYTES, liger_kernels=True)
    assert plan.memory == expected
    for name in ("gradient_checkpointing", "paged_adamw_8bit"):
        assert (plan.fast_paths[name].engaged, plan.fast_paths[name].reason) == (getattr(expected, name), expected.reasons[name])


def test_the_plan_counts_liger_only_where_it_is_planned():
    without_liger = plan_fast_paths(_cuda(model_type="gpt2")).memory
    with_liger = plan_fast_paths(_cuda()).memory
    assert with_liger.estimate_without_checkpointing_bytes < without_liger.estimate_without_checkpointing_bytes


def test_gradient_checkpointing_turns_on_when_the_activations_do_not_fit():
    full = plan_fast_paths(_cuda()).memory.estimate_without_checkpointing_bytes
    plan = plan_fast_paths(_cuda(gpu_memory_bytes=_gpu_with_usable(full)))  # fits, but not within the margin
    assert plan.trainer_kwargs["gradient_checkpointing"] is True
    assert "over 60% of the" in plan.fast_paths["gradient_checkpointing"].reason
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
    assert plan.memory.paged_adamw_8bit is False


def test_a_plan_that_cannot_fit_even_at_its_leanest_warns_of_out_of_memory():
    facts = _cuda(model=QWEN3_8B, workload=Workload(batch_size=16, seq_len=4096, lora_rank=16), gpu_memory_bytes=RTX_4090_BYTES)
    reason = plan_fast_paths(facts).fast_paths["gradient_checkpointing"].reason
    assert reason.endswith("expect out-of-memory, lower the batch size or the sequence length")


def test_forced_gradient_checkpointing_is_on_even_where_memory_suffices():
    plan = plan_fast_paths(_cuda(forced=frozenset({"gradient_checkpointing"})))
    assert plan.trainer_kwargs["gradient_checkpointing"] is True
    assert plan.fast_paths["gradient_checkpointing"].reason.startswith("forced on for this run (~")


def test_the_jobs_optimizer_is_the_trainers_even_where_memory_is_short():
    facts = _cuda(model=QWEN3_8B, workload=Workload(batch_size=1, seq_len=2048, lora_rank=64, optimizer="lion_8bit"),
                  gpu_memory_bytes=RTX_4090_BYTES)
    plan = plan_fast_paths(facts)
    assert plan.trainer_kwargs["optim"] == "lion_8bit" and plan.memory.optimizer == "lion_8bit"
    assert not plan.fast_paths["paged_adamw_8bit"].engaged and not plan.fast_paths["fused_adamw"].engaged
    assert plan.fast_paths["fused_adamw"].reason == "the job's `training.optimizer` is lion_8bit"


def test_the_jobs_optimizer_is_the_trainers_on_cpu_too():
    plan = plan_fast_paths(Facts(cuda=False, compute_capability=None, packages=EVERYTHING, model_type="qwen3",
                                 algorithm="sft", model=QWEN3_1_7B, workload=Workload(8, 1024, 16, optimizer="adafactor")))
    assert plan.trainer_kwargs["optim"] == "adafactor"


def test_a_bitsandbytes_optimizer_without_bitsandbytes_is_refused_naming_the_setting():
    with pytest.raises(ValueError, match=r"`training.optimizer` 'adamw_8bit' is bitsandbytes'"):
        plan_fast_paths(_cuda(workload=Workload(8, 1024, 16, optimizer="adamw_8bit"), packages=_without("bitsandbytes")))


def test_forced_8bit_adamw_replaces_fused_adamw():
    plan = plan_fast_paths(_cuda(forced=frozenset({"paged_adamw_8bit"})))
    assert plan.trainer_kwargs["optim"] == "paged_adamw_8bit"
    assert plan.fast_paths["paged_adamw_8bit"].reason == "forced on for this run"


def test_the_jobs_forced_checkpointing_overrides_the_plan():
    short = _cuda(model=QWEN3_8B, workload=Workload(batch_size=4, seq_len=2048, lora_rank=16))
    assert plan_fast_paths(short).trainer_kwargs["gradient_checkpointing"] is True
    plan = plan_fast_paths(_cuda(model=QWEN3_8B, workload=Workload(batch_size=4, seq_len=2048, lora_rank=16),
                                 memory=MemorySettings(gradient_checkpointing=False)))
    assert plan.trainer_kwargs["gradient_checkpointing"] is False
    assert plan.fast_paths["gradient_checkpointing"].reason.startswith("forced off for this run (~")
    assert plan.memory.forced == ["gradient_checkpointing"]


def test_grpo_with_vllm_colocates_it_with_sleep_mode_and_keeps_expandable_segments():
    plan = plan_fast_paths(_cuda(algorithm="grpo"))
    assert plan.fast_paths["vllm_colocate"].engaged
    assert plan.trainer_kwargs["use_vllm"] is True
    assert (plan.trainer_kwargs["vllm_mode"], plan.trainer_kwargs["vllm_enable_sleep_mode"]) == ("colocate", True)
    segments = plan.fast_paths["expandable_segments"]
    assert segments.engaged
    assert segments.reason.endswith("(vLLM's sleep-mode pool turns them off around its own allocations and back on: "
                                    "vLLM 0.33, `CuMemAllocator.use_memory_pool`)")


def test_the_allocator_setting_asks_for_expandable_segments_with_vllm_too():
    assert allocator_conf(frozenset()) == EXPANDABLE
    assert allocator_conf(frozenset({"expandable_segments"})) is None


def test_vllms_share_of_the_gpu_is_the_memory_plans():
    plan = plan_fast_paths(_cuda(algorithm="grpo"))
    assert plan.trainer_kwargs["vllm_gpu_memory_utilization"] == plan.memory.vllm_gpu_memory_utilization
    h200 = plan_fast_paths(_cuda(algorithm="grpo", gpu_memory_bytes=H200_BYTES)).trainer_kwargs["vllm_gpu_memory_utilization"]
    assert h200 < plan.trainer_kwargs["vllm_gpu_memory_utilization"]  # the same bytes are a smaller share of more memory
    bigger = plan_fast_paths(_cuda(algorithm="grpo", model=QWEN3_8B)).trainer_kwargs["vllm_gpu_memory_utilization"]
    assert bigger > plan.trainer_kwargs["vllm_gpu_memory_utilization"]


def test_the_jobs_forced_vllm_share_replaces_the_planned_one():
    plan = plan_fast_paths(_cuda(algorithm="grpo", memory=MemorySettings(vllm_gpu_memory_utilization=0.35)))
    assert plan.trainer_kwargs["vllm_gpu_memory_utilization"] == 0.35
    assert "colocated with a forced 0.35 of the GPU" in plan.fast_paths["vllm_colocate"].reason


def test_the_jobs_memory_settings_can_turn_vllm_off():
    plan = plan_fast_paths(_cuda(algorithm="grpo", memory=MemorySettings(vllm_colocate=False)))
    assert plan.trainer_kwargs["use_vllm"] is False and "vllm_gpu_memory_utilization" not in plan.trainer_kwargs
    assert plan.fast_paths["vllm_colocate"].reason == (
        "turned off by the job's memory settings: completions come from transformers' generate")
    assert plan.memory.breakdown.generation_bytes > 0  # the training model's own generation is planned instead


def test_vllm_is_not_colocated_where_it_would_not_fit_beside_training():
    facts = _cuda(algorithm="grpo", model=QWEN3_8B, workload=Workload(batch_size=8, seq_len=1536, lora_rank=16, generations=32),
                  gpu_memory_bytes=RTX_4090_BYTES)
    plan = plan_fast_paths(facts)
    assert plan.trainer_kwargs["use_vllm"] is False and "vllm_gpu_memory_utilization" not in plan.trainer_kwargs
    assert plan.fast_paths["vllm_colocate"].reason.endswith("usable: completions come from the training model's generate")


def test_a_4bit_base_never_colocates_vllm_and_is_loaded_by_the_worker():
    plan = plan_fast_paths(_cuda(algorithm="grpo", workload=Workload(batch_size=16, seq_len=1024, lora_rank=16,
                                                                      quantization="4bit", generations=16)))
    assert plan.trainer_kwargs["use_vllm"] is False
    assert plan.fast_paths["vllm_colocate"].reason.startswith("not with a 4-bit base")
    assert "model_init_kwargs" not in plan.trainer_kwargs  # TRL would ignore them for a model it did not load
    assert plan.model_init_kwargs == {"dtype": "bfloat16", "device_map": {"": 0}}
    assert plan.memory.quantization == "4bit"


def test_grpo_without_vllm_generates_with_transformers_and_uses_expandable_segments():
    plan = plan_fast_paths(_cuda(algorithm="grpo", packages=_without("vllm"), allocator_settings="expandable_segments:True"))
    assert plan.trainer_kwargs["use_vllm"] is False and "vllm_mode" not in plan.trainer_kwargs
    assert "transformers' generate" in plan.fast_paths["vllm_colocate"].reason
    assert plan.fast_paths["expandable_segments"].engaged


def test_expandable_segments_count_only_when_the_allocator_holds_them():
    path = plan_fast_paths(_cuda(allocator_settings="")).fast_paths["expandable_segments"]
    assert not path.engaged
    assert path.reason == "the allocator holds '', not expandable_segments:True: CUDA initialised before PYTORCH_CUDA_ALLOC_CONF was set"


def test_expandable_segments_the_training_process_started_with_count_as_engaged_when_the_allocator_holds_them():
    path = plan_fast_paths(_cuda(alloc_conf=EXPANDABLE, allocator_settings=EXPANDABLE)).fast_paths["expandable_segments"]
    assert path.engaged
    assert path.reason.startswith("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in the training process's "
                                  "environment from its start, and the allocator holds it")


def test_an_allocator_setting_from_the_environment_is_kept_and_recorded():
    plan = plan_fast_paths(_cuda(alloc_conf="max_split_size_mb:128", allocator_settings="max_split_size_mb:128"))
    assert plan.fast_paths["expandable_segments"] == plan.fast_paths["expandable_segments"].model_copy(
        update={"engaged": False, "reason": "PYTORCH_CUDA_ALLOC_CONF is set to 'max_split_size_mb:128' by the environment"})


def test_expandable_segments_from_the_environment_keep_vllm_asleep_between_generations():
    # vLLM 0.33's sleep-mode pool turns expandable segments off around its own allocations, so sleep mode stays.
    plan = plan_fast_paths(_cuda(algorithm="grpo", alloc_conf=EXPANDABLE, allocator_settings=EXPANDABLE))
    assert plan.trainer_kwargs["use_vllm"] is True and plan.trainer_kwargs["vllm_enable_sleep_mode"] is True
    assert "asleep between generation rounds (one weight sync per round" in plan.fast_paths["vllm_colocate"].reason


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


def test_the_jobs_switched_off_fast_paths_are_facts_and_their_kernels_are_blocked(tiny_model_dir):
    assert "fla" not in sys.modules
    try:
        facts = gather_facts(tiny_model_dir, "sft", SFT, None,
                             FastPathSettings(flash_linear_attention=False, liger_kernel=False))
        assert facts.disabled == {"flash_linear_attention", "liger_kernel"} and facts.forced == set()
        with pytest.raises(ImportError):
            import fla  # noqa: F401
        assert sys.modules.get("liger_kernel", "absent") is not None  # not blocked: Liger is simply not applied
    finally:
        sys.modules.pop("fla", None)


def test_the_job_forces_memory_savers_only(tiny_model_dir):
    facts = gather_facts(tiny_model_dir, "sft", SFT, None, FastPathSettings(gradient_checkpointing=True, bf16=False))
    assert (facts.forced, facts.disabled) == ({"gradient_checkpointing"}, {"bf16"})
    with pytest.raises(ValueError, match=r"`liger_kernel` cannot be forced on: .* Only gradient_checkpointing and "
                                         r"paged_adamw_8bit can be true"):
        FastPathSettings(liger_kernel=True)


def test_a_job_may_require_vllm_in_the_one_vllm_setting():
    assert FastPathSettings(vllm_colocate="require").required() == {"vllm_colocate"}
    with pytest.raises(ValueError, match=r"`vllm_colocate` cannot be forced on: .*set false to switch it off \(or "
                                         r"\"require\" to fail the job where vLLM cannot be used\)"):
        FastPathSettings(vllm_colocate=True)


def test_requiring_vllm_in_a_job_that_generates_nothing_is_refused_naming_the_setting():
    with pytest.raises(ValueError, match=r"`fast_paths.vllm_colocate` is 'require', but only GRPO generates completions "
                                         r"\(algorithm is 'sft'\): remove it"):
        JobInput(run_id="r", model={"id": "m"}, dataset={"hub_id": "d"}, artifact_store="file:///s",
                 fast_paths={"vllm_colocate": "require"})


def test_a_required_vllm_that_the_plan_colocates_is_planned_as_an_automatic_one():
    required = plan_fast_paths(_cuda(algorithm="grpo", required=frozenset({"vllm_colocate"})))
    assert required == plan_fast_paths(_cuda(algorithm="grpo"))


@pytest.mark.parametrize(("facts", "why"), [
    ({"packages": _without("vllm")}, "vllm not installed"),
    ({"memory": MemorySettings(vllm_colocate=False)}, "turned off by the job's memory settings"),
    ({"cuda": False}, "no CUDA device"),
])
def test_a_required_vllm_the_plan_does_not_colocate_fails_the_job_with_the_plans_reason(facts, why):
    facts = dataclasses.replace(_cuda(algorithm="grpo", required=frozenset({"vllm_colocate"})), **facts)
    with pytest.raises(ValueError, match=rf"`fast_paths.vllm_colocate` is 'require', but it is not used for this run: "
                                         rf"{why}.*Leave `fast_paths.vllm_colocate` empty to go on without it"):
        plan_fast_paths(facts)


def test_the_control_planes_plan_of_a_job_follows_its_fast_paths():
    job = JobInput(run_id="r", algorithm="grpo", model={"id": "m"}, dataset={"hub_id": "d"}, artifact_store="file:///s",
                   training={"batch_size": 16}, grpo={"rewards": [{"name": "digit_fraction"}]})
    automatic = plan_job(job, QWEN3_1_7B, H100_BYTES)
    assert (automatic.vllm_colocate, automatic.gradient_checkpointing, automatic.paged_adamw_8bit) == (True, True, False)
    switched = job.model_copy(update={"fast_paths": FastPathSettings(vllm_colocate=False, gradient_checkpointing=False,
                                                                     paged_adamw_8bit=True)})
    plan = plan_job(switched, QWEN3_1_7B, H100_BYTES)
    assert (plan.vllm_colocate, plan.gradient_checkpointing, plan.paged_adamw_8bit) == (False, False, True)


def test_the_worker_environment_switches_no_fast_path(tiny_model_dir, monkeypatch):
    # The switches of before: a run's `fast_paths` is the only way now.
    monkeypatch.setenv("LORAFLOW_DISABLE_FAST_PATHS", "liger_kernel")
    monkeypatch.setenv("LORAFLOW_FORCE_FAST_PATHS", "gradient_checkpointing")
    facts = gather_facts(tiny_model_dir, "sft", SFT)
    assert (facts.disabled, facts.forced) == (set(), set())



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
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", device_properties)
    # Liger off: its import needs a real driver.
    facts = gather_facts(tiny_model_dir, "sft", SFT, None, FastPathSettings(liger_kernel=False))
    assert seen_at_init == [EXPANDABLE]
    assert (facts.alloc_conf, facts.compute_capability, facts.gpu_memory_bytes) == (None, (9, 0), H100_BYTES)
    assert facts.allocator_settings == cuda_allocator_settings()


def test_the_allocator_keeps_the_setting_it_read_first():
    # What the manifest records: the allocator's own settings, which a later change of the variable does not move.
    script = (
        "import os\n"
        "from loraflow_worker.training.fast_paths import cuda_allocator_settings\n"
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
