"""GPU fast paths: decide which to use, engage them, and record what actually took effect.

Kernels fail silently (a Qwen3.5 model without flash-linear-attention trains through a torch loop several
times slower, with one log warning), so every speed-up is recorded as a `FastPath(engaged, reason)` in the
run manifest, and the kernel ones are confirmed on the built model, not assumed from the plan:

    facts = gather_facts(model_dir, "sft", job_workload(job), job.memory, job.fast_paths)  # probes CUDA, reads the allocator
    plan = plan_fast_paths(facts)                              # pure: the decisions, testable on CPU
    trainer = SFTTrainer(..., args=sft_config(job, plan, work_dir))
    fast_paths = engage_fast_paths(plan, trainer.model)        # applies Liger, confirms the kernels; for the manifest

The memory decisions (gradient checkpointing, the optimizer, vLLM's share of the GPU) come from the memory plan
(`memory.plan.plan_memory`, the same planner the control plane sizes GPUs with) against the GPU's memory, overridden
by what the job's `memory` settings force; their reasons quote the plan's numbers, and the plan goes into the
manifest whole. The run switches fast paths off, or memory savers on, with its `fast_paths` settings (the job input's,
from the run form), never with the worker's environment.

TRL 1.16 deprecates `use_liger_kernel` in favour of Hub kernels, which need Hub access at run time, so
Liger is applied here through its own instance-patching API.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loraflow_worker.artifacts.manifest import FastPath
from loraflow_worker.contract import FastPathSettings, MemorySettings
from loraflow_worker.contract.training_settings import BITSANDBYTES_OPTIMIZERS
from loraflow_worker.memory.model_shape import GATED_ATTENTION_MODEL_TYPES, ModelShape, read_model_shape
from loraflow_worker.memory.plan import MemoryPlan, plan_memory
from loraflow_worker.runtime.environment import ALLOC_CONF_ENV, EXPANDABLE_SEGMENTS, allocator_conf

NO_CUDA = "no CUDA device"
FAST_PATHS = tuple(FastPathSettings.model_fields)
"""Every speed-up (or memory saver) the manifest reports on, engaged or not: each a field of the job's `fast_paths`."""
KERNEL_PACKAGES = ("liger-kernel", "flash-linear-attention", "causal-conv1d", "bitsandbytes", "vllm", "triton")
"""Distributions whose presence decides a fast path."""
BF16_MIN_CAPABILITY = (8, 0)
"""bf16 tensor cores start with Ampere (sm_80)."""

VLLM_TEXT_ONLY = {"limit_mm_per_prompt": {"image": 0, "video": 0}}
"""What the colocated vLLM engine is built with for a text run: no image or video inputs, so vLLM 0.33 neither loads
nor profiles a checkpoint's vision tower (`_mark_tower_model` in `vllm/model_executor/models/interfaces.py` skips a
tower whose modalities all have a limit of 0; ignored for text-only models). `grpo.text_only_vllm` passes it."""

_KERNEL_MODULES = {"flash_linear_attention": "fla", "causal_conv1d": "causal_conv1d"}
"""Fast paths whose module is blocked from import when disabled: transformers binds these kernels when it
imports the modeling module, so blocking the import is the only switch (Liger is simply not applied)."""


@dataclass(frozen=True)
class Workload:
    """What one training micro-batch asks of memory (`run.job_workload` reads it from the job)."""

    batch_size: int
    """Sequences per micro-batch (`per_device_train_batch_size`: the job's forced micro-batch, or its batch size;
    completions for GRPO)."""
    seq_len: int
    """Tokens per sequence at most (SFT `max_length`; GRPO prompt + completion)."""
    lora_rank: int
    lora_dropout: float = 0.0
    quantization: str = "none"
    """`lora.quantization`: `none` or `4bit` (QLoRA)."""
    generations: int = 0
    """Completions generated per round (GRPO: the generation batch); 0 for SFT."""
    optimizer: str | None = None
    """`training.optimizer`: the job's choice, or None for the plan's (torch AdamW, 8-bit paged AdamW when short)."""
    use_dora: bool = False
    modules_to_save: tuple[str, ...] = ()


@dataclass(frozen=True)
class Facts:
    """What the fast-path decisions depend on. `gather_facts` probes them; tests pass them in."""

    cuda: bool
    compute_capability: tuple[int, int] | None
    packages: Mapping[str, str]
    """Installed distributions among `KERNEL_PACKAGES`, name -> version."""
    model_type: str
    algorithm: str
    model: ModelShape
    workload: Workload
    gpu_memory_bytes: int | None = None
    """Total memory of the GPU (device 0); None without CUDA."""
    liger_model_types: frozenset[str] = frozenset()
    """Model types Liger has kernels for (read from the installed Liger)."""
    alloc_conf: str | None = None
    """`PYTORCH_CUDA_ALLOC_CONF` as this process's environment held it when the facts were gathered: the supervisor's
    setting (`runtime.environment.allocator_conf`) or the worker environment's own; None when neither set it."""
    allocator_settings: str | None = None
    """What the CUDA caching allocator holds once CUDA initialised (`cuda_allocator_settings`); None without CUDA."""
    disabled: frozenset[str] = frozenset()
    """Fast paths the job switches off (`fast_paths`: false)."""
    forced: frozenset[str] = frozenset()
    """Memory savers the job switches on whatever the estimate says (`fast_paths`: true)."""
    required: frozenset[str] = frozenset()
    """Fast paths the job demands (`fast_paths`: "require"): the plan refuses to go without them."""
    memory: MemorySettings | None = None
    """The job's forced memory settings (`JobInput.memory`), which override the memory plan's choices."""


@dataclass
class FastPathPlan:
    """The decisions: one `FastPath` per name in `FAST_PATHS`, the trainer config they need (the model-loading kwargs
    among it, as `model_init_kwargs`, unless the worker loads the model itself: a 4-bit base), the model-loading
    kwargs on their own, and the memory plan they come from (None without CUDA)."""

    fast_paths: dict[str, FastPath]
    trainer_kwargs: dict[str, Any] = field(default_factory=dict)
    model_init_kwargs: dict[str, Any] = field(default_factory=dict)
    memory: MemoryPlan | None = None


def plan_fast_paths(facts: Facts) -> FastPathPlan:
    """Decide every fast path from `facts` alone (no probing), with the reason for each decision. Raises `ValueError`
    when the job's `training.optimizer` is bitsandbytes' and bitsandbytes is not installed, or when a fast path the
    job demands (`Facts.required`) is not planned."""
    plan = _plan(facts)
    missing = sorted(name for name in facts.required if not plan.fast_paths[name].engaged)
    if missing:
        raise ValueError("; ".join(
            f"`fast_paths.{name}` is 'require', but it is not used for this run: {plan.fast_paths[name].reason}. Leave "
            f"`fast_paths.{name}` empty to go on without it" for name in missing))
    return plan


def _plan(facts: Facts) -> FastPathPlan:
    four_bit = facts.workload.quantization == "4bit"
    chosen = facts.workload.optimizer
    if chosen in BITSANDBYTES_OPTIMIZERS and "bitsandbytes" not in facts.packages:
        raise ValueError(f"`training.optimizer` '{chosen}' is bitsandbytes', which this worker does not have: choose "
                         "adamw_torch_fused (or leave `training.optimizer` empty), or run on the image")
    if not facts.cuda:
        model_init_kwargs = {"dtype": "float32"}
        plan = FastPathPlan(
            {name: FastPath(engaged=False, reason=NO_CUDA) for name in FAST_PATHS},
            # TRL defaults to bf16 and gradient checkpointing; on CPU both only slow training down.
            {"use_cpu": True, "bf16": False, "gradient_checkpointing": False},
            model_init_kwargs,
        )
        if not four_bit:
            plan.trainer_kwargs["model_init_kwargs"] = model_init_kwargs
        if facts.algorithm == "grpo":
            plan.trainer_kwargs["use_vllm"] = False
        if chosen is not None:
            plan.trainer_kwargs["optim"] = chosen
        return plan

    decided: dict[str, FastPath] = {}
    has = facts.packages.__contains__

    def settle(name: str, engaged: bool, reason: str) -> None:
        """Record a decision: a fast path that would engage is off when this run disables it."""
        if engaged and name in facts.disabled:
            engaged, reason = False, "disabled for this run"
        decided[name] = FastPath(engaged=engaged, reason=reason)

    sm = f"sm_{facts.compute_capability[0]}{facts.compute_capability[1]}" if facts.compute_capability else "this GPU"
    bf16_capable = facts.compute_capability is not None and facts.compute_capability >= BF16_MIN_CAPABILITY
    settle("bf16", bf16_capable, f"{sm} supports bf16" if bf16_capable else f"{sm} has no bf16 tensor cores: training in fp32")
    bf16 = decided["bf16"].engaged

    if not has("liger-kernel"):
        settle("liger_kernel", False, "liger-kernel not installed")
    elif not has("triton"):
        settle("liger_kernel", False, "triton not installed (Liger's kernels are Triton kernels)")
    elif "liger_kernel" in facts.disabled:
        settle("liger_kernel", False, "disabled for this run")  # gather_facts does not even import Liger then
    elif facts.model_type not in facts.liger_model_types:
        settle("liger_kernel", False, f"Liger {facts.packages['liger-kernel']} has no kernels for model type `{facts.model_type}`")
    else:
        settle("liger_kernel", True, "planned; confirmed once the model is built")

    gated_deltanet = facts.model_type in GATED_ATTENTION_MODEL_TYPES  # their linear attention: flash-linear-attention
    for name, distribution, fallback in (
        ("flash_linear_attention", "flash-linear-attention", "its torch loop, several times slower"),
        ("causal_conv1d", "causal-conv1d", "its torch conv1d (a small share of the step)"),
    ):
        if not gated_deltanet:
            settle(name, False, f"`{facts.model_type}` has no Gated-DeltaNet layers")
        elif not has(distribution):
            settle(name, False, f"{distribution} not installed: transformers runs {fallback}")
        else:
            settle(name, True, "planned; confirmed once the model is built")

    # Memory: the plan decides checkpointing, the optimizer and vLLM's share; the job's memory settings and
    # fast_paths force what they name (memory first: the control plane sets it after an out-of-memory attempt).
    forced = facts.memory or MemorySettings()
    if facts.algorithm != "grpo":
        vllm_off = f"{facts.algorithm} generates no completions"
    elif not has("vllm"):
        vllm_off = "vllm not installed: completions come from transformers' generate (slower)"
    elif "vllm_colocate" in facts.disabled:
        vllm_off = "disabled for this run"
    elif forced.vllm_colocate is False:
        vllm_off = "turned off by the job's memory settings: completions come from transformers' generate"
    elif four_bit:
        # The contract refuses this combination; a job built without it still never merges into a 4-bit base.
        vllm_off = "not with a 4-bit base (TRL's merge of the adapter into it for vLLM misbehaves)"
    else:
        vllm_off = None
    checkpointing = forced.gradient_checkpointing
    if checkpointing is None and "gradient_checkpointing" in facts.forced | facts.disabled:
        checkpointing = "gradient_checkpointing" in facts.forced
    eight_bit = None
    if "paged_adamw_8bit" in facts.forced | facts.disabled:
        eight_bit = "paged_adamw_8bit" in facts.forced and has("bitsandbytes")

    def planned(eight_bit: bool | None) -> MemoryPlan:
        w = facts.workload
        return plan_memory(
            facts.model, algorithm=facts.algorithm, batch_size=w.batch_size, seq_len=w.seq_len, lora_rank=w.lora_rank,
            lora_dropout=w.lora_dropout, gpu_memory_bytes=facts.gpu_memory_bytes, quantization=w.quantization,
            num_generations=w.generations, vllm_colocate=vllm_off is None, fused_lm_head=True,
            gradient_checkpointing=checkpointing, paged_adamw_8bit=eight_bit,
            vllm_gpu_memory_utilization=forced.vllm_gpu_memory_utilization,
            liger_kernels=decided["liger_kernel"].engaged, bf16=bf16,
            optimizer=w.optimizer, use_dora=w.use_dora, modules_to_save=w.modules_to_save,
        )

    memory = planned(eight_bit)
    eight_bit_reason = memory.reasons["paged_adamw_8bit"]
    # Where bitsandbytes is missing the plan's own choice falls back to torch AdamW; a job's optimizer stays as counted.
    if chosen is None and "paged_adamw_8bit" in facts.forced and not has("bitsandbytes"):
        memory, eight_bit_reason = planned(False), "forced, but bitsandbytes is not installed"
    elif chosen is None and memory.paged_adamw_8bit and not has("bitsandbytes"):
        short = eight_bit_reason.removeprefix("memory is short: ")
        memory, eight_bit_reason = planned(False), f"memory is short ({short}), but bitsandbytes is not installed"

    if vllm_off is not None:
        settle("vllm_colocate", False, vllm_off)
    elif not memory.vllm_colocate:
        settle("vllm_colocate", False, memory.reasons["vllm_colocate"])
    else:
        settle("vllm_colocate", True, f"vllm {facts.packages['vllm']} colocated with training, asleep between "
                                      f"generation rounds (one weight sync per round, tool turns included: "
                                      f"`vllm_colocate.py`): {memory.reasons['vllm_colocate']}")
    settle("gradient_checkpointing", memory.gradient_checkpointing, memory.reasons["gradient_checkpointing"])
    settle("paged_adamw_8bit", memory.paged_adamw_8bit, eight_bit_reason)
    if chosen is not None:
        settle("fused_adamw", chosen == "adamw_torch_fused", f"the job's `training.optimizer` is {chosen}")
    elif decided["paged_adamw_8bit"].engaged:
        settle("fused_adamw", False, "8-bit paged AdamW instead")
    else:
        settle("fused_adamw", True, "torch AdamW with its fused CUDA kernel (the LoRA optimizer state is small)")
    decided["expandable_segments"] = _allocator_decision(facts, _holds_expandable_segments(facts.allocator_settings),
                                                         decided["vllm_colocate"].engaged)

    optim = chosen or ("paged_adamw_8bit" if decided["paged_adamw_8bit"].engaged else (
        "adamw_torch_fused" if decided["fused_adamw"].engaged else "adamw_torch"))
    # The whole model on the one GPU: TRL's default ("auto") would offload what does not fit to the CPU, silently.
    model_init_kwargs = {"dtype": "bfloat16" if bf16 else "float32", "device_map": {"": 0}}
    kwargs: dict[str, Any] = {
        "use_cpu": False,
        "bf16": bf16,
        "gradient_checkpointing": decided["gradient_checkpointing"].engaged,
        "optim": optim,
    }
    if not four_bit:
        kwargs["model_init_kwargs"] = model_init_kwargs  # a 4-bit base is loaded by the worker (`run.load_model`)
    if facts.algorithm == "grpo":
        kwargs["use_vllm"] = decided["vllm_colocate"].engaged
        if kwargs["use_vllm"]:
            # Sleep mode frees vLLM's weights and KV cache while training steps; vLLM 0.33 keeps it working with
            # expandable segments (see `_allocator_decision`).
            kwargs.update(vllm_mode="colocate", vllm_enable_sleep_mode=True,
                          vllm_gpu_memory_utilization=memory.vllm_gpu_memory_utilization)
    return FastPathPlan({name: decided[name] for name in FAST_PATHS}, kwargs, model_init_kwargs, memory)


def gather_facts(model_dir: Path, algorithm: str, workload: Workload, memory: MemorySettings | None = None,
                 fast_paths: FastPathSettings | None = None) -> Facts:
    """Probe this process: CUDA, the GPU's memory, the installed kernel packages, the model's type and size; `memory`
    (the job's forced memory settings) and `fast_paths` (the job's switches: the kernel modules of those it switches
    off are blocked from import) join the facts as given.

    The CUDA allocator reads `PYTORCH_CUDA_ALLOC_CONF` once, when CUDA initialises. A training process the supervisor
    started has it in its environment from the start (`runtime.environment.child_env`), since its imports initialise
    CUDA; a process nobody set it for (the GPU smoke's, a test's) gets it here, before probing the GPU initialises
    CUDA, which counts only where nothing initialised it before. What the allocator then holds is recorded as a fact."""
    import torch
    from transformers import AutoConfig

    fast_paths = fast_paths or FastPathSettings()
    disabled, forced, required = fast_paths.switched_off(), fast_paths.switched_on(), fast_paths.required()
    for name in disabled & set(_KERNEL_MODULES):
        sys.modules.setdefault(_KERNEL_MODULES[name], None)  # `import fla` now raises ImportError
    packages = {}
    for name in KERNEL_PACKAGES:
        try:
            packages[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    cuda = torch.cuda.is_available()  # counts devices; initialises neither CUDA nor its allocator
    alloc_conf = os.environ.get(ALLOC_CONF_ENV)
    wanted = allocator_conf(disabled)
    if cuda and alloc_conf is None and wanted is not None:
        os.environ[ALLOC_CONF_ENV] = wanted  # too late where CUDA initialised already: the decision then says so
    gpu = torch.cuda.get_device_properties(0) if cuda else None  # CUDA initialises here, and its allocator with it
    liger_model_types: frozenset[str] = frozenset()
    if cuda and "liger-kernel" in packages and "triton" in packages and "liger_kernel" not in disabled:
        # Only where a plan can use them: importing Liger (and Triton) takes seconds.
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

        liger_model_types = frozenset(MODEL_TYPE_TO_APPLY_LIGER_FN)
    return Facts(
        cuda=cuda,
        compute_capability=(gpu.major, gpu.minor) if gpu else None,
        packages=packages,
        model_type=AutoConfig.from_pretrained(model_dir).model_type,
        algorithm=algorithm,
        model=read_model_shape(model_dir),
        workload=workload,
        gpu_memory_bytes=gpu.total_memory if gpu else None,
        liger_model_types=liger_model_types,
        alloc_conf=alloc_conf,
        allocator_settings=cuda_allocator_settings() if cuda else None,
        disabled=disabled,
        forced=forced,
        required=required,
        memory=memory,
    )


def cuda_allocator_settings() -> str:
    """The settings the CUDA caching allocator took from `PYTORCH_CUDA_ALLOC_CONF` ('' for none): what it actually
    runs with, which differs from the variable when the variable was set after CUDA initialised.
    TODO: switch to a public getter once torch has one (2.13 and 2.14 have only this binding, the counterpart of
    `torch._C._accelerator_setAllocatorSettings`, which `torch.cuda.memory` points to)."""
    import torch

    return torch._C._accelerator_getAllocatorSettings()


def engage_fast_paths(plan: FastPathPlan, model: Any) -> dict[str, FastPath]:
    """Apply the planned Liger kernels to `model` (a PEFT or plain transformers model, already built) and
    confirm the kernel fast paths on it. Returns the record for the manifest. Call once per model."""
    record = dict(plan.fast_paths)
    from peft import PeftModel

    base = model.get_base_model() if isinstance(model, PeftModel) else model
    if record["liger_kernel"].engaged:
        record["liger_kernel"] = _engage_liger(base)
    hooks = kernel_hooks(base)
    for name, package in (("flash_linear_attention", "fla"), ("causal_conv1d", "causal_conv1d")):
        if record[name].engaged:
            record[name] = _confirm_kernel(hooks, package)
        elif any(pkg == package and bound for pkg, bound in hooks.values()):
            # Planned off, yet transformers bound the kernels (e.g. imported before they were disabled).
            record[name] = FastPath(engaged=True, reason=f"planned off ({record[name].reason}), but transformers bound `{package}` kernels")
    return record


def kernel_hooks(model: Any) -> dict[str, tuple[str, bool]]:
    """transformers' optional-kernel hooks in `model`'s modeling module: function name -> (package, whether
    transformers bound the package's kernel rather than its torch fallback).

    transformers chooses at import time of the modeling module (`use_kernel_func_from_hub_with_fallback`) and
    keeps the choice in the wrapper's closure. TODO: read it from a public attribute once transformers
    exposes one (checked against 5.20 and 5.24)."""
    module = sys.modules[type(model).__module__]
    hooks = {}
    for name, value in vars(module).items():
        if inspect.isfunction(value) and value.__closure__:
            captured = inspect.getclosurevars(value).nonlocals
            if "package" in captured and "is_new_implementation" in captured:
                hooks[name] = (captured["package"], bool(captured["is_new_implementation"]))
    return hooks


def _holds_expandable_segments(allocator_settings: str | None) -> bool:
    settings = dict(item.strip().split(":", 1) for item in (allocator_settings or "").split(",") if ":" in item)
    return settings.get("expandable_segments") == "True"


def _allocator_decision(facts: Facts, expandable: bool, vllm: bool) -> FastPath:
    wanted = allocator_conf(facts.disabled)
    if facts.alloc_conf is not None and facts.alloc_conf != wanted:
        return FastPath(engaged=expandable, reason=f"{ALLOC_CONF_ENV} is set to {facts.alloc_conf!r} by the environment")
    if "expandable_segments" in facts.disabled:
        return FastPath(engaged=False, reason="disabled for this run")
    given = ("in the training process's environment from its start" if facts.alloc_conf == wanted
             else "set before CUDA initialised")
    if expandable:
        beside_vllm = (" (vLLM's sleep-mode pool turns them off around its own allocations and back on: vLLM 0.33, "
                       "`CuMemAllocator.use_memory_pool`)" if vllm else "")
        return FastPath(engaged=True, reason=f"{ALLOC_CONF_ENV}={EXPANDABLE_SEGMENTS} {given}, and the allocator holds "
                                             f"it: less fragmentation{beside_vllm}")
    cause = (f"CUDA initialised before {ALLOC_CONF_ENV} was set" if facts.alloc_conf is None
             else f"although {ALLOC_CONF_ENV} held it when the training process started")
    return FastPath(engaged=False, reason=f"the allocator holds {facts.allocator_settings!r}, not {EXPANDABLE_SEGMENTS}: "
                                          f"{cause}")


def _confirm_kernel(hooks: dict[str, tuple[str, bool]], package: str) -> FastPath:
    functions = sorted(name for name, (pkg, _) in hooks.items() if pkg == package)
    if not functions:
        return FastPath(engaged=False, reason=f"the modeling code has no `{package}` kernel hook: cannot confirm, counted as off")
    fallen_back = [name for name in functions if not hooks[name][1]]
    if fallen_back:
        return FastPath(
            engaged=False,
            reason=f"installed, but transformers uses its torch fallback for {', '.join(fallen_back)} (importing `{package}` failed)",
        )
    return FastPath(engaged=True, reason=f"transformers uses `{package}` kernels for {', '.join(functions)}")


def _engage_liger(model: Any) -> FastPath:
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    # TRL 1.16 patches the LM head with its own fused log-prob head; Liger's (fused linear) cross-entropy
    # would replace the forward that carries it, so only Liger's layer kernels are applied.
    _apply_liger_kernel_to_instance(model=model, fused_linear_cross_entropy=False, cross_entropy=False)
    patched: dict[str, int] = {}
    for module in model.modules():
        kind = module._get_name()
        if kind.startswith("Liger"):
            patched[kind] = patched.get(kind, 0) + 1
    if not patched:
        return FastPath(engaged=False, reason=f"Liger patched no layer of `{model.config.model_type}`")
    return FastPath(engaged=True, reason="Liger kernels on " + ", ".join(f"{n} {kind}" for kind, n in sorted(patched.items())))
