"""GPU fast paths: decide which to use, engage them, and record what actually took effect.

Kernels fail silently (a Qwen3.5 model without flash-linear-attention trains through a torch loop several
times slower, with one log warning), so every speed-up is recorded as a `FastPath(engaged, reason)` in the
run manifest, and the kernel ones are confirmed on the built model, not assumed from the plan:

    facts = gather_facts(model_dir, "sft")              # probes torch, the installed packages, the config
    plan = plan_fast_paths(facts)                       # pure: the decisions, testable on CPU
    os.environ.update(plan.env)                         # before the first CUDA allocation
    trainer = SFTTrainer(..., args=SFTConfig(..., **plan.trainer_kwargs))
    fast_paths = engage_fast_paths(plan, trainer.model) # applies Liger, confirms the kernels; for the manifest

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

from loraflow_worker.manifest import FastPath

NO_CUDA = "no CUDA device"
FAST_PATHS = (
    "bf16",
    "liger_kernel",
    "flash_linear_attention",
    "causal_conv1d",
    "gradient_checkpointing",
    "paged_adamw_8bit",
    "expandable_segments",
    "vllm_colocate",
)
"""Every speed-up the manifest reports on, engaged or not."""
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
    liger_model_types: frozenset[str] = frozenset()
    """Model types Liger has kernels for (read from the installed Liger)."""
    alloc_conf: str | None = None
    """`PYTORCH_CUDA_ALLOC_CONF` as the environment already sets it, if it does."""
    disabled: frozenset[str] = frozenset()
    """Fast paths switched off on purpose (the GPU smoke script's A/B runs)."""


@dataclass
class FastPathPlan:
    """The decisions: one `FastPath` per name in `FAST_PATHS`, the trainer config they need, the environment."""

    fast_paths: dict[str, FastPath]
    trainer_kwargs: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)


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

    decided: dict[str, tuple[bool, str]] = {}
    kwargs: dict[str, Any] = {"use_cpu": False}
    env: dict[str, str] = {}
    has = facts.packages.__contains__
    sm = f"sm_{facts.compute_capability[0]}{facts.compute_capability[1]}" if facts.compute_capability else "this GPU"

    bf16 = facts.compute_capability is not None and facts.compute_capability >= BF16_MIN_CAPABILITY
    decided["bf16"] = (True, f"{sm} supports bf16") if bf16 else (False, f"{sm} has no bf16 tensor cores: training in fp32")
    kwargs.update(bf16=bf16, model_init_kwargs={"dtype": "bfloat16" if bf16 else "float32"})

    if not has("liger-kernel"):
        decided["liger_kernel"] = (False, "liger-kernel not installed")
    elif not has("triton"):
        decided["liger_kernel"] = (False, "triton not installed (Liger's kernels are Triton kernels)")
    elif facts.model_type not in facts.liger_model_types:
        decided["liger_kernel"] = (False, f"Liger {facts.packages['liger-kernel']} has no kernels for model type `{facts.model_type}`")
    else:
        decided["liger_kernel"] = (True, "planned; confirmed once the model is built")

    gated_deltanet = facts.model_type in GATED_DELTANET_MODEL_TYPES
    for name, distribution, fallback in (
        ("flash_linear_attention", "flash-linear-attention", "its torch loop, several times slower"),
        ("causal_conv1d", "causal-conv1d", "its torch conv1d (a small share of the step)"),
    ):
        if not gated_deltanet:
            decided[name] = (False, f"`{facts.model_type}` has no Gated-DeltaNet layers")
        elif not has(distribution):
            decided[name] = (False, f"{distribution} not installed: transformers runs {fallback}")
        else:
            decided[name] = (True, "planned; confirmed once the model is built")

    decided["gradient_checkpointing"] = (True, "recomputes activations in the backward pass: less memory, ~20% slower steps")
    kwargs["gradient_checkpointing"] = True

    if has("bitsandbytes"):
        decided["paged_adamw_8bit"] = (True, f"bitsandbytes {facts.packages['bitsandbytes']}: 8-bit paged AdamW")
        kwargs["optim"] = "paged_adamw_8bit"
    else:
        decided["paged_adamw_8bit"] = (False, "bitsandbytes not installed: torch AdamW")

    vllm = facts.algorithm == "grpo" and has("vllm") and "vllm_colocate" not in facts.disabled
    if facts.algorithm != "grpo":
        decided["vllm_colocate"] = (False, f"{facts.algorithm} generates no completions")
    elif not has("vllm"):
        decided["vllm_colocate"] = (False, "vllm not installed: completions come from transformers' generate (slower)")
    else:
        decided["vllm_colocate"] = (True, f"vllm {facts.packages['vllm']} colocated with training, sleeping during optimizer steps")
    if facts.algorithm == "grpo":
        kwargs["use_vllm"] = vllm
        if vllm:
            kwargs.update(vllm_mode="colocate", vllm_enable_sleep_mode=True)

    if facts.alloc_conf is not None:
        decided["expandable_segments"] = (False, f"{ALLOC_CONF_ENV} is already set to {facts.alloc_conf!r} by the environment")
    elif vllm:
        # vLLM's sleep mode allocates through its own CUDA memory pool, which refuses expandable segments.
        decided["expandable_segments"] = (False, "not with vLLM's sleep mode")
    else:
        decided["expandable_segments"] = (True, f"{ALLOC_CONF_ENV}={EXPANDABLE_SEGMENTS}: less fragmentation")
        env[ALLOC_CONF_ENV] = EXPANDABLE_SEGMENTS

    for name in facts.disabled & set(decided):
        if decided[name][0]:
            decided[name] = (False, "disabled for this run")
    _undo_disabled(facts.disabled, decided, kwargs, env)
    return FastPathPlan({name: FastPath(engaged=decided[name][0], reason=decided[name][1]) for name in FAST_PATHS}, kwargs, env)


def gather_facts(model_dir: Path, algorithm: str) -> Facts:
    """Probe this process: CUDA, the installed kernel packages, the model's type, the allocator setting, and
    the fast paths `LORAFLOW_DISABLE_FAST_PATHS` switches off (whose kernel modules it blocks from import)."""
    import torch
    from transformers import AutoConfig

    disabled = disabled_fast_paths()
    for name in disabled & set(_KERNEL_MODULES):
        sys.modules.setdefault(_KERNEL_MODULES[name], None)  # `import fla` now raises ImportError
    cuda = torch.cuda.is_available()
    packages = {}
    for name in KERNEL_PACKAGES:
        try:
            packages[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    liger_model_types: frozenset[str] = frozenset()
    if cuda and "liger-kernel" in packages and "triton" in packages:
        # Importing Liger imports Triton, which fails without a GPU driver ("0 active drivers"): only on CUDA.
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

        liger_model_types = frozenset(MODEL_TYPE_TO_APPLY_LIGER_FN)
    return Facts(
        cuda=cuda,
        compute_capability=torch.cuda.get_device_capability(0) if cuda else None,
        packages=packages,
        model_type=AutoConfig.from_pretrained(model_dir).model_type,
        algorithm=algorithm,
        liger_model_types=liger_model_types,
        alloc_conf=os.environ.get(ALLOC_CONF_ENV),
        disabled=disabled,
    )


def disabled_fast_paths() -> frozenset[str]:
    """The fast paths `LORAFLOW_DISABLE_FAST_PATHS` names; an unknown name is an error listing the valid ones."""
    names = frozenset(n.strip() for n in os.environ.get(DISABLE_ENV, "").split(",") if n.strip())
    unknown = sorted(names - set(FAST_PATHS))
    if unknown:
        raise ValueError(f"{DISABLE_ENV} names unknown fast paths {', '.join(unknown)}: use any of {', '.join(FAST_PATHS)}")
    return names


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


def _undo_disabled(disabled: frozenset[str], decided: dict[str, tuple[bool, str]], kwargs: dict[str, Any], env: dict[str, str]) -> None:
    """Drop the config of fast paths switched off after deciding them (bf16 stays as decided: it is precision)."""
    if "gradient_checkpointing" in disabled:
        kwargs["gradient_checkpointing"] = False
    if "paged_adamw_8bit" in disabled:
        kwargs.pop("optim", None)
    if "expandable_segments" in disabled:
        env.pop(ALLOC_CONF_ENV, None)
    if "bf16" in disabled:
        kwargs.update(bf16=False, model_init_kwargs={"dtype": "float32"})
