"""GPU fast paths: decide which to use, engage them, and record what actually took effect.

Kernels fail silently (a Qwen3.5 model without flash-linear-attention trains through a torch loop several
times slower, with one log warning), so every speed-up is recorded as a `FastPath(engaged, reason)` in the
run manifest, and the kernel ones are confirmed on the built model, not assumed from the plan:

    facts = gather_facts(model_dir, "sft", job_workload(job))  # exports the allocator setting, then probes CUDA
    plan = plan_fast_paths(facts)                              # pure: the decisions, testable on CPU
    trainer = SFTTrainer(..., args=sft_config(job, plan, work_dir))
    fast_paths = engage_fast_paths(plan, trainer.model)        # applies Liger, confirms the kernels; for the manifest

The memory decisions (gradient checkpointing, the optimizer, vLLM's share of the GPU) come from an estimate
of what LoRA training needs (`training_memory`, `vllm_memory`) against the GPU's memory, and their reasons
quote both numbers.

TRL 1.16 deprecates `use_liger_kernel` in favour of Hub kernels, which need Hub access at run time, so
Liger is applied here through its own instance-patching API.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import math
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loraflow_worker.manifest import FastPath
from loraflow_worker.memory_estimate import (
    ADAMW_8BIT_BYTES,
    ADAMW_BYTES,
    ModelShape,
    Workload,
    gib,
    read_model_shape,
    training_memory,
    usable_memory,
    vllm_memory,
)

NO_CUDA = "no CUDA device"
FAST_PATHS = (
    "bf16",
    "liger_kernel",
    "flash_linear_attention",
    "causal_conv1d",
    "gradient_checkpointing",
    "fused_adamw",
    "paged_adamw_8bit",
    "expandable_segments",
    "vllm_colocate",
)
"""Every speed-up (or memory saver) the manifest reports on, engaged or not."""
KERNEL_PACKAGES = ("liger-kernel", "flash-linear-attention", "causal-conv1d", "bitsandbytes", "vllm", "triton")
"""Distributions whose presence decides a fast path."""
GATED_DELTANET_MODEL_TYPES = frozenset({"qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"})
"""Model types with Gated-DeltaNet (linear attention) layers, whose fast path is flash-linear-attention."""
BF16_MIN_CAPABILITY = (8, 0)
"""bf16 tensor cores start with Ampere (sm_80)."""
ALLOC_CONF_ENV = "PYTORCH_CUDA_ALLOC_CONF"
EXPANDABLE_SEGMENTS = "expandable_segments:True"
DISABLE_ENV = "LORAFLOW_DISABLE_FAST_PATHS"
"""Comma-separated fast paths to switch off in this worker (A/B measurements, or a kernel bug in the field)."""
FORCE_ENV = "LORAFLOW_FORCE_FAST_PATHS"
"""Comma-separated memory savers to switch on whatever the memory estimate says (A/B measurements, or an
estimate that proved too low in the field)."""
FORCIBLE = ("gradient_checkpointing", "paged_adamw_8bit")
"""The fast paths `LORAFLOW_FORCE_FAST_PATHS` may name: the memory trade-offs (kernels are on when they can be)."""

_KERNEL_MODULES = {"flash_linear_attention": "fla", "causal_conv1d": "causal_conv1d"}
"""Fast paths whose module is blocked from import when disabled: transformers binds these kernels when it
imports the modeling module, so blocking the import is the only switch (Liger is simply not applied)."""


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
    """`PYTORCH_CUDA_ALLOC_CONF` as the environment set it before the worker did anything, if it did."""
    allocator_settings: str | None = None
    """What the CUDA caching allocator holds once CUDA initialised (`cuda_allocator_settings`); None without CUDA."""
    disabled: frozenset[str] = frozenset()
    """Fast paths switched off on purpose (`LORAFLOW_DISABLE_FAST_PATHS`)."""
    forced: frozenset[str] = frozenset()
    """Memory savers switched on whatever the estimate says (`LORAFLOW_FORCE_FAST_PATHS`)."""


@dataclass
class FastPathPlan:
    """The decisions: one `FastPath` per name in `FAST_PATHS`, and the trainer config they need (the model-loading
    kwargs among it, as `model_init_kwargs`)."""

    fast_paths: dict[str, FastPath]
    trainer_kwargs: dict[str, Any] = field(default_factory=dict)


def plan_fast_paths(facts: Facts) -> FastPathPlan:
    """Decide every fast path from `facts` alone (no probing), with the reason for each decision."""
    if not facts.cuda:
        plan = FastPathPlan(
            {name: FastPath(engaged=False, reason=NO_CUDA) for name in FAST_PATHS},
            # TRL defaults to bf16 and gradient checkpointing; on CPU both only slow training down.
            {"use_cpu": True, "bf16": False, "gradient_checkpointing": False, "model_init_kwargs": {"dtype": "float32"}},
        )
        if facts.algorithm == "grpo":
            plan.trainer_kwargs["use_vllm"] = False
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

    gated_deltanet = facts.model_type in GATED_DELTANET_MODEL_TYPES
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

    # Memory: vLLM's share first (it is taken off what training may use), then what training needs within the rest.
    usable = usable_memory(facts.gpu_memory_bytes)
    expandable = _holds_expandable_segments(facts.allocator_settings)
    lean = training_memory(facts.model, facts.workload, bf16=bf16, checkpointing=True, optimizer_bytes=ADAMW_8BIT_BYTES)
    vllm_share = 0.0
    if facts.algorithm != "grpo":
        settle("vllm_colocate", False, f"{facts.algorithm} generates no completions")
    elif not has("vllm"):
        settle("vllm_colocate", False, "vllm not installed: completions come from transformers' generate (slower)")
    elif "vllm_colocate" in facts.disabled:
        settle("vllm_colocate", False, "disabled for this run")
    elif (needed := vllm_memory(facts.model, facts.workload)) + lean > usable:
        settle("vllm_colocate", False, f"vLLM needs ~{gib(needed)} beside training's ~{gib(lean)} at its leanest, "
                                       f"over the {gib(usable)} usable: completions come from transformers' generate")
    else:
        vllm_share = math.ceil(needed / facts.gpu_memory_bytes * 100) / 100
        sleep = ("awake throughout (sleep mode refuses the expandable segments the environment's allocator setting "
                 "asks for)" if expandable else "asleep between generations")
        settle("vllm_colocate", True, f"vllm {facts.packages['vllm']} colocated with training, {sleep}, with "
                                      f"{vllm_share:.2f} of the GPU (~{gib(needed)} for rounds of "
                                      f"{facts.workload.generations} completions)")
    # Counted as held throughout: sleep mode frees most of it between generations, so this errs toward saving memory.
    budget = usable - int(vllm_share * facts.gpu_memory_bytes)

    full = training_memory(facts.model, facts.workload, bf16=bf16, checkpointing=False, optimizer_bytes=ADAMW_BYTES)
    recomputed = training_memory(facts.model, facts.workload, bf16=bf16, checkpointing=True, optimizer_bytes=ADAMW_BYTES)
    if "gradient_checkpointing" in facts.forced:
        settle("gradient_checkpointing", True, f"forced on for this run (~{gib(full)} estimated without it, {gib(budget)} available)")
    elif full <= budget:
        settle("gradient_checkpointing", False, f"not needed: ~{gib(full)} estimated without it, {gib(budget)} available")
    else:
        settle("gradient_checkpointing", True, f"~{gib(full)} estimated without it, over the {gib(budget)} available: "
                                               f"recomputing activations brings it to ~{gib(recomputed)}")
    checkpointing = decided["gradient_checkpointing"].engaged

    with_adamw = training_memory(facts.model, facts.workload, bf16=bf16, checkpointing=checkpointing, optimizer_bytes=ADAMW_BYTES)
    if "paged_adamw_8bit" in facts.forced:
        settle("paged_adamw_8bit", *((True, "forced on for this run") if has("bitsandbytes") else
                                     (False, "forced, but bitsandbytes is not installed")))
    elif with_adamw <= budget:
        settle("paged_adamw_8bit", False, f"not needed: ~{gib(with_adamw)} estimated with torch AdamW, {gib(budget)} available")
    elif not has("bitsandbytes"):
        settle("paged_adamw_8bit", False, f"memory is short (~{gib(with_adamw)} estimated with torch AdamW, "
                                          f"{gib(budget)} available), but bitsandbytes is not installed")
    else:
        settle("paged_adamw_8bit", True, f"memory is short: ~{gib(with_adamw)} estimated with torch AdamW, {gib(budget)} available")
    eight_bit = decided["paged_adamw_8bit"].engaged
    if eight_bit:
        settle("fused_adamw", False, "8-bit paged AdamW instead")
    else:
        settle("fused_adamw", True, "torch AdamW with its fused CUDA kernel (the LoRA optimizer state is small)")
    planned = training_memory(facts.model, facts.workload, bf16=bf16, checkpointing=checkpointing, optimizer_bytes=ADAMW_8BIT_BYTES if eight_bit else ADAMW_BYTES)
    if planned > budget:
        decided["gradient_checkpointing"] = decided["gradient_checkpointing"].model_copy(update={"reason": (
            f"{decided['gradient_checkpointing'].reason}; as planned still ~{gib(planned)}: expect out-of-memory, "
            f"lower the batch size or the sequence length")})

    decided["expandable_segments"] = _allocator_decision(facts, expandable, decided["vllm_colocate"].engaged)

    optim = "paged_adamw_8bit" if decided["paged_adamw_8bit"].engaged else (
        "adamw_torch_fused" if decided["fused_adamw"].engaged else "adamw_torch")
    kwargs: dict[str, Any] = {
        "use_cpu": False,
        "bf16": bf16,
        # The whole model on the one GPU: TRL's default ("auto") would offload what does not fit to the CPU, silently.
        "model_init_kwargs": {"dtype": "bfloat16" if bf16 else "float32", "device_map": {"": 0}},
        "gradient_checkpointing": checkpointing,
        "optim": optim,
    }
    if facts.algorithm == "grpo":
        kwargs["use_vllm"] = decided["vllm_colocate"].engaged
        if kwargs["use_vllm"]:
            kwargs.update(vllm_mode="colocate", vllm_enable_sleep_mode=not expandable, vllm_gpu_memory_utilization=vllm_share)
    return FastPathPlan({name: decided[name] for name in FAST_PATHS}, kwargs)


def allocator_conf(algorithm: str, packages: Mapping[str, str], disabled: frozenset[str]) -> str | None:
    """The `PYTORCH_CUDA_ALLOC_CONF` the worker sets before CUDA initialises: expandable segments (less
    fragmentation), unless they are disabled or vLLM's sleep mode may run (its memory pool refuses them)."""
    if "expandable_segments" in disabled or _vllm_expected(algorithm, packages, disabled):
        return None
    return EXPANDABLE_SEGMENTS


def gather_facts(model_dir: Path, algorithm: str, workload: Workload) -> Facts:
    """Probe this process: CUDA, the GPU's memory, the installed kernel packages, the model's type and size, and
    the fast paths `LORAFLOW_DISABLE_FAST_PATHS` switches off (whose kernel modules it blocks from import) or
    `LORAFLOW_FORCE_FAST_PATHS` switches on.

    The CUDA allocator reads `PYTORCH_CUDA_ALLOC_CONF` once, when CUDA initialises, and probing the GPU
    initialises it: so unless the environment already set it, the variable is set first (`allocator_conf`),
    and what the allocator then holds is recorded as a fact. Call before anything else touches CUDA."""
    import torch
    from transformers import AutoConfig

    disabled = _named_fast_paths(DISABLE_ENV, FAST_PATHS)
    forced = _named_fast_paths(FORCE_ENV, FORCIBLE)
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
    wanted = allocator_conf(algorithm, packages, disabled)
    if cuda and alloc_conf is None and wanted is not None:
        os.environ[ALLOC_CONF_ENV] = wanted
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


def _named_fast_paths(variable: str, valid: tuple[str, ...]) -> frozenset[str]:
    """The fast paths the environment variable `variable` names; an unknown name is an error listing the valid ones."""
    names = frozenset(n.strip() for n in os.environ.get(variable, "").split(",") if n.strip())
    unknown = sorted(names - set(valid))
    if unknown:
        raise ValueError(f"{variable} names unknown fast paths {', '.join(unknown)}: use any of {', '.join(valid)}")
    return names


def _vllm_expected(algorithm: str, packages: Mapping[str, str], disabled: frozenset[str]) -> bool:
    """Whether vLLM may colocate, as far as is known before the GPU's memory is."""
    return algorithm == "grpo" and "vllm" in packages and "vllm_colocate" not in disabled


def _holds_expandable_segments(allocator_settings: str | None) -> bool:
    settings = dict(item.strip().split(":", 1) for item in (allocator_settings or "").split(",") if ":" in item)
    return settings.get("expandable_segments") == "True"


def _allocator_decision(facts: Facts, expandable: bool, vllm: bool) -> FastPath:
    if facts.alloc_conf is not None:
        return FastPath(engaged=expandable, reason=f"{ALLOC_CONF_ENV} is set to {facts.alloc_conf!r} by the environment")
    if "expandable_segments" in facts.disabled:
        return FastPath(engaged=False, reason="disabled for this run")
    if _vllm_expected(facts.algorithm, facts.packages, facts.disabled):
        return FastPath(engaged=False, reason="not with vLLM's sleep mode (its memory pool refuses expandable segments)" if vllm
                        else "left unset: vLLM's sleep mode was still expected when CUDA initialised")
    if expandable:
        return FastPath(engaged=True, reason=f"{ALLOC_CONF_ENV}={EXPANDABLE_SEGMENTS} set before CUDA initialised: less fragmentation")
    return FastPath(engaged=False, reason=f"the allocator holds {facts.allocator_settings!r}, not {EXPANDABLE_SEGMENTS}: "
                                          f"CUDA initialised before {ALLOC_CONF_ENV} was set")


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
