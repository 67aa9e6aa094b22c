"""What the GPU smoke runs: the worker's configurations (variants of its fast paths), the model and batch sizes on
a GPU and on a CPU, the runs a lent machine's slot holds, the runs that calibrate the memory plan, and each run's
share of the time."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Variant:
    """One configuration of the worker: `all` less the `disabled` fast paths, plus the `forced` memory savers, with
    the base model loaded in `quantization` bits when set. `needs` is (distribution, why): without it the variant
    is skipped, not run. The rest are what only a GPU shows of a setting, each with its check (`measure`): `packing`
    (every packed example's first label is -100 where the loss is computed), `modules_to_save` (the share of the
    head copy's weights that moved after `HEAD_CHECK_STEP` steps), `tools` (a tool-using GRPO run, after an SFT run
    that teaches the model the call: vLLM's weight syncs per step), `task_eval` (a task evaluation after training:
answered by vLLM where it runs, its scores against transformers' answers to the same task). `full_attention`: on the Qwen3 model of full-
    attention layers whatever the mode (packing refuses Gated-DeltaNet layers; vLLM's Qwen3 path). `learning_rate`:
    the run's, in place of 1e-4. A `probe` (a name of `probes.PROBES`; algorithm `probe`) trains nothing: its child
    runs the probe on the smoke model and reports what it found."""

    name: str
    algorithms: tuple[str, ...]
    disabled: frozenset[str] = frozenset()
    forced: frozenset[str] = frozenset()
    quantization: str | None = None
    needs: tuple[str, str] | None = None
    full_attention: bool = False
    packing: bool = False
    modules_to_save: tuple[str, ...] = ()
    tools: bool = False
    learning_rate: float | None = None
    task_eval: bool = False
    probe: str | None = None
    what: str = ""
    """What a probe measures, in a few words (`--list`)."""

    def describe(self) -> str:
        """What the variant changes from `all`, in a few words (`--list`)."""
        parts = [f"without {', '.join(sorted(self.disabled))}" if self.disabled else "",
                 f"{', '.join(sorted(self.forced))} forced on" if self.forced else "",
                 f"base in {self.quantization}" if self.quantization else "",
                 "packed rows: every example's first label -100" if self.packing else "",
                 f"modules_to_save {', '.join(self.modules_to_save)}: share of the copy moved after "
                 f"{HEAD_CHECK_STEP} steps" if self.modules_to_save else "",
                 "tools, after an SFT run that teaches the call: vLLM weight syncs per step" if self.tools else "",
                 f"learning rate {self.learning_rate:g}" if self.learning_rate else "",
                 "a task evaluation after training: vLLM answered where it runs, scores as transformers'"
                 if self.task_eval else "",
                 f"probe: {self.what}" if self.probe else "",
                 "GRPO on it" if self.full_attention and not (self.packing or self.tools or self.probe or self.task_eval)
                 else ""]
        return "; ".join(part for part in parts if part) or "every fast path installed"


KERNELS = frozenset({"liger_kernel", "flash_linear_attention", "causal_conv1d", "fused_adamw", "expandable_segments"})
"""The speed-ups `no-kernels` removes together. Precision (bf16) and the memory trade-offs (gradient checkpointing,
8-bit AdamW, which the memory estimate decides) are measured by variants of their own."""
VARIANTS = (
    Variant("all", ("sft", "grpo")),
    Variant("no-liger", ("sft",), disabled=frozenset({"liger_kernel"}),
            needs=("liger-kernel", "without it `all` already ran without Liger")),
    Variant("no-fla", ("sft",), disabled=frozenset({"flash_linear_attention", "causal_conv1d"}),
            needs=("flash-linear-attention", "without it `all` already ran transformers' torch loop")),
    Variant("qlora", ("sft",), quantization="4bit",
            needs=("bitsandbytes", "QLoRA loads the base model in 4 bits through it")),
    Variant("no-fused-adamw", ("sft",), disabled=frozenset({"fused_adamw"})),
    Variant("no-expandable-segments", ("sft",), disabled=frozenset({"expandable_segments"})),
    Variant("no-kernels", ("sft",), disabled=KERNELS),
    Variant("checkpointing", ("sft",), forced=frozenset({"gradient_checkpointing"})),
    Variant("no-checkpointing", ("sft",), disabled=frozenset({"gradient_checkpointing"})),
    Variant("checkpointing-no-liger", ("sft",), disabled=frozenset({"liger_kernel"}),
            forced=frozenset({"gradient_checkpointing"})),
    Variant("no-checkpointing-no-liger", ("sft",), disabled=frozenset({"gradient_checkpointing", "liger_kernel"})),
    Variant("qlora-checkpointing", ("sft",), forced=frozenset({"gradient_checkpointing"}), quantization="4bit",
            needs=("bitsandbytes", "QLoRA loads the base model in 4 bits through it")),
    Variant("paged-adamw-8bit", ("sft",), forced=frozenset({"paged_adamw_8bit"}),
            needs=("bitsandbytes", "8-bit paged AdamW is its optimizer")),
    Variant("no-vllm", ("grpo",), disabled=frozenset({"vllm_colocate"})),
    Variant("dpo", ("dpo",)),
    Variant("grpo-qwen3", ("grpo",), full_attention=True),
    Variant("tools-grpo", ("grpo",), full_attention=True, tools=True),
    Variant("packed", ("sft",), full_attention=True, packing=True),
    Variant("modules-to-save", ("sft",), modules_to_save=("lm_head",)),
    Variant("modules-to-save-1e-5", ("sft",), modules_to_save=("lm_head",), learning_rate=1e-5),
    Variant("task-eval", ("sft",), full_attention=True, task_eval=True),
    Variant("cuda-init", ("probe",), probe="cuda_init",
            what="CUDA initialised by the training process's imports? expandable segments as the plan reads them"),
    Variant("merge-drift", ("probe",), probe="merge_drift", full_attention=True,
            what="base values 200 vLLM syncs change, TRL's merge/unmerge against the worker's temporaries, LoRA and DoRA"),
    Variant("packed-logprobs", ("probe",), probe="packed_logprobs", full_attention=True,
            what="per-token log-probs packed against alone, bf16 SDPA, Liger off and on"),
    Variant("head-update", ("probe",), probe="head_update", full_attention=True,
            what="AdamW at 1e-5 on a bf16 against an fp32 copy of the LM head, the same gradients"),
)
SLOT_RUNS = (("all", "sft"), ("no-liger", "sft"), ("no-fla", "sft"), ("qlora", "sft"), ("no-vllm", "grpo"))
"""What a GPU run does unless `--variants` says otherwise: what fits a lent machine's slot. GRPO goes without vLLM
(`use_vllm=False`): a lent machine has none, and vLLM's start alone would take a large part of the budget."""
MEMORY_RUNS = (("checkpointing", "sft"), ("no-checkpointing", "sft"), ("qlora-checkpointing", "sft"),
               ("checkpointing-no-liger", "sft"), ("no-checkpointing-no-liger", "sft"), ("qlora", "sft"))
"""What `--memory` runs unless `--variants` says otherwise: gradient checkpointing on and off, each with and without
Liger, and QLoRA with checkpointing and as planned, so that one command sets the memory plan's estimate of each
configuration beside the peaks it measured. QLoRA with checkpointing comes third: should time run short, the runs
left out are the ones that differ from a run already made in one switch only."""
MEMORY_STEPS = (1, 2)
"""`--memory`'s warm-up and timed steps unless told otherwise: the optimizer's state exists from the first optimizer
step on and the batches are all of one length, so each later step repeats the same peak; more steps only cost time."""
BF16_RUNS = (("cuda-init", "probe"), ("merge-drift", "probe"), ("packed-logprobs", "probe"), ("head-update", "probe"),
             ("modules-to-save-1e-5", "sft"), ("modules-to-save", "sft"), ("qlora", "sft"), ("dpo", "dpo"))
"""What `--bf16` runs unless `--variants` says otherwise: what a bf16 GPU does to training that the CPU tests cannot
show (`probes`), the head copy of `modules_to_save` trained at 1e-5 and at 1e-4 through the worker (its dtype and how
much of it moved), and the memory plan against the peaks for QLoRA, `modules_to_save` and DPO, 1 warm-up and 2 timed
steps each (4 for the head copies): one command of at most 8 minutes on a lent machine."""
CPU_VARIANTS = ("all", "no-kernels")
"""What `--cpu` runs unless `--variants` says otherwise (on CPU every fast path is off anyway)."""
CHECK_VARIANTS = ("dpo", "grpo-qwen3", "tools-grpo", "packed", "modules-to-save", "task-eval")
"""The variants that check what only a GPU shows, rather than time a fast path: one command on a lent machine
(`--variants dpo,grpo-qwen3,tools-grpo,packed,modules-to-save,task-eval`); the tests run them on the CPU."""
HEAD_CHECK_STEP = 4
"""The step after which `modules-to-save` reads how much of the head copy moved (its run takes at least as many)."""
ALGORITHM_WEIGHT = {"sft": 1.0, "dpo": 1.5, "grpo": 2.0, "probe": 1.0}
"""A run's share of the time left, relative to the other runs still to come. A GRPO step also generates its
completions token by token (transformers' `generate` without vLLM), so it gets twice an SFT run's share; a DPO step
runs the policy on a chosen and a rejected answer and the reference on both: estimates, not measurements (no GPU
run has been timed yet). A probe loads the smoke model and works on it for seconds: an SFT run's share."""
TOOL_COMPLETION_TOKENS = 192
"""`tools-grpo`'s completions at least: a call of the tool, the tool's answer and the model's reply (`tool_use`)."""


@dataclass(frozen=True)
class Size:
    """Model and batch shape of a smoke run."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    seq_len: int
    batch: int
    generations: int
    completion_len: int


GPU_SIZE = Size(vocab=151_936, hidden=2048, layers=8, heads=16, seq_len=2048, batch=8, generations=8, completion_len=256)
"""Qwen3's vocabulary and a 2B-class width (Qwen3.5-2B: hidden 2048), fewer layers to keep each run short."""
CPU_SIZE = Size(vocab=1024, hidden=64, layers=4, heads=4, seq_len=64, batch=4, generations=2, completion_len=8)


@dataclass(frozen=True)
class Run:
    """One (variant, algorithm) of a smoke run; `skipped` says why it will not run, when it will not."""

    variant: Variant
    algorithm: str
    skipped: str | None = None

    @property
    def weight(self) -> float:
        return ALGORITHM_WEIGHT[self.algorithm]


def skip_reason(variant: Variant, packages: Mapping[str, str]) -> str | None:
    """Why `variant` cannot run with the installed `packages` (distribution -> version), or None."""
    if variant.needs is None or variant.needs[0] in packages:
        return None
    distribution, why = variant.needs
    return f"{distribution} is not installed ({why})"


def parse_variant_names(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in {v.name for v in VARIANTS}]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown variant(s) {', '.join(unknown) or '(none given)'}: "
                                         f"use any of {', '.join(v.name for v in VARIANTS)}")
    return names


def by_name(names: Sequence[str]) -> list[Variant]:
    known = {v.name: v for v in VARIANTS}
    return [known[name] for name in names]


def list_variants() -> str:
    """Every variant: its algorithms, the model it trains, which default selections run it, and what it changes or
    checks (`--list`)."""
    defaults = {"slot": {name for name, _ in SLOT_RUNS}, "memory": {name for name, _ in MEMORY_RUNS},
                "cpu": set(CPU_VARIANTS), "checks": set(CHECK_VARIANTS), "bf16": {name for name, _ in BF16_RUNS}}
    lines = [f"{'variant':<27}{'algorithms':<15}{'model':<15}{'run by':<18}what"]
    for v in VARIANTS:
        model = "Qwen3" if v.full_attention else "the mode's"
        runs = ",".join(name for name, members in defaults.items() if v.name in members) or "-"
        lines.append(f"{v.name:<27}{','.join(v.algorithms):<15}{model:<15}{runs:<18}{v.describe()}"
                     + (f" (needs {v.needs[0]})" if v.needs else ""))
    lines.append("model: the mode's is Qwen3.5 (Gated-DeltaNet layers, one full-attention layer in four), or with --memory or --bf16 "
                 "Qwen3 (full attention only); run by: the selections that include it (slot: a GPU run's default; "
                 "memory: --memory; cpu: --cpu; checks: CHECK_VARIANTS, named with --variants; bf16: --bf16)")
    return "\n".join(lines)
