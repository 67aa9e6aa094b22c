"""How much GPU memory a LoRA run needs, and the memory decisions that follow from it: gradient checkpointing, the
optimizer and vLLM's share of the GPU. One planner for the worker (`training.fast_paths.plan_fast_paths` decides from
it) and for the control plane (which drops the GPUs a run cannot fit before renting one).

Pure Python (pydantic only): the control plane imports it without the training stack. The model is sized by
`model_shape`, each part of the run by `estimates`; this module takes CUDA's own memory and a headroom off the GPU's
(`usable_memory`) and decides. From the command line, with a folder that may hold only a `config.json`:

    python -m loraflow_worker.memory.plan MODEL_DIR --algorithm sft --batch-size 8 --seq-len 2048 \\
        --lora-rank 16 --lora-dropout 0.05 --gpu-memory-gib 24
    python -m loraflow_worker.memory.plan MODEL_DIR --algorithm sft --batch-size 1 --seq-len 2048 \\
        --lora-rank 16 --gpu-memory-gib 80 --quantization 4bit
    python -m loraflow_worker.memory.plan MODEL_DIR --algorithm grpo --batch-size 8 --seq-len 1536 \\
        --num-generations 16 --gpu-memory-gib 80

prints the plan as one JSON object (`gradient_checkpointing`, `fits`, `estimate_gib`, `usable_gib`, `vllm_gib`, the
breakdown in bytes, the reasons).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, computed_field

from loraflow_worker.contract import JobInput
from loraflow_worker.memory.estimates import (
    EIGHT_BIT_ADAMW,
    GIB,
    OPTIMIZER_STATES,
    TORCH_ADAMW,
    VLLM_ASLEEP_BYTES,
    MemoryBreakdown,
    VllmBreakdown,
    activations_bytes,
    adapter_bytes,
    generation_bytes,
    head_gradient_bytes,
    logits_bytes,
    lora_parameters,
    modules_to_save_bytes,
    saved_module_parameters,
    vllm_memory,
    weights_bytes,
)
from loraflow_worker.memory.model_shape import ModelShape, read_model_shape

# ---- The GPU -------------------------------------------------------------------------------------------------------
CUDA_OVERHEAD_BYTES = GIB
"""GPU memory torch's caching allocator never sees, so no estimate counts it: the CUDA context with lazy module
loading (torch's default since CUDA 11.7; about 0.5 GiB on Ampere and Hopper), the kernel images torch, Triton,
Liger and bitsandbytes load on first use, and the cuBLAS/cuBLASLt handles. An allowance, not a measurement: the GPU
smoke's device-level peak less `max_memory_reserved` is the figure to check it against."""
MEMORY_HEADROOM = 0.10
"""Share of the GPU's memory no plan counts on: the caching allocator's fragmentation and the estimate's own error."""
CHECKPOINTING_MARGIN = 0.60
"""Gradient checkpointing goes off only when training without it is estimated at most this share of the memory
available to it: the estimate is not measured, and an out-of-memory failure costs a whole attempt."""


class MemoryPlan(BaseModel):
    """The memory decisions for one run on one GPU, and the estimates they come from (`plan_memory`)."""

    algorithm: Literal["sft", "grpo", "dpo"]
    batch_size: int = Field(description="Sequences per micro-batch (per device step); DPO: pairs, each two sequences.")
    seq_len: int = Field(description="Tokens per sequence at most.")
    lora_rank: int
    lora_dropout: float
    quantization: Literal["none", "4bit"]
    num_generations: int = Field(description="Completions per generation round (GRPO); 0 for SFT.")
    gpu_memory_bytes: int
    usable_bytes: int = Field(description="What a plan may count on: the GPU's memory less the headroom and CUDA's own.")
    gradient_checkpointing: bool = Field(description="Whether training recomputes activations (the plan's choice, or forced).")
    paged_adamw_8bit: bool = Field(description="Whether the optimizer is bitsandbytes' 8-bit paged AdamW (else torch AdamW).")
    optimizer: str = Field(default=TORCH_ADAMW, description="The optimizer counted: the job's `training.optimizer`, or "
                           "the plan's choice (torch AdamW, or 8-bit paged AdamW when memory is short).")
    use_dora: bool = Field(default=False, description="Whether the adapter is DoRA (`lora.use_dora`).")
    modules_to_save: list[str] = Field(default_factory=list, description="Modules trained in full beside the adapter "
                                       "(`lora.modules_to_save`).")
    vllm_colocate: bool = Field(description="Whether vLLM generates the completions on the training GPU.")
    vllm_gpu_memory_utilization: float | None = Field(description="vLLM's share of the GPU when colocated.")
    vllm_bytes: int = Field(description="GPU bytes of vLLM's share (0 when not colocated).")
    estimate_bytes: int = Field(description="The peak the plan counts on the GPU, with the chosen checkpointing: "
                                "training's backward or a colocated vLLM generating, whichever holds more.")
    estimate_with_checkpointing_bytes: int = Field(description="The same with gradient checkpointing on.")
    estimate_without_checkpointing_bytes: int = Field(description="The same with gradient checkpointing off.")
    fits: bool = Field(description="Whether the run fits the GPU with gradient checkpointing on.")
    breakdown: MemoryBreakdown = Field(description="The estimate of the chosen configuration, by what holds the memory.")
    vllm: VllmBreakdown | None = Field(default=None, description="vLLM's share, by what holds it, when colocated.")
    forced: list[str] = Field(default_factory=list, description="Decisions forced by the caller instead of planned.")
    reasons: dict[str, str] = Field(
        description="Why each decision (`gradient_checkpointing`, `paged_adamw_8bit`, `vllm_colocate`) went as it did, "
        "and `modules_to_save` when the plan could not size one of them."
    )

    @computed_field
    @property
    def estimate_gib(self) -> float:
        return round(self.estimate_bytes / GIB, 2)

    @computed_field
    @property
    def estimate_with_checkpointing_gib(self) -> float:
        return round(self.estimate_with_checkpointing_bytes / GIB, 2)

    @computed_field
    @property
    def usable_gib(self) -> float:
        return round(self.usable_bytes / GIB, 2)

    @computed_field
    @property
    def vllm_gib(self) -> float:
        return round(self.vllm_bytes / GIB, 2)


def usable_memory(gpu_memory_bytes: int) -> int:
    """GPU bytes a plan may count on: the total less the headroom and CUDA's own overhead."""
    return int(gpu_memory_bytes * (1 - MEMORY_HEADROOM)) - CUDA_OVERHEAD_BYTES


def gib(size: float) -> str:
    return f"{size / GIB:.1f} GiB"


def plan_memory(
    shape: ModelShape,
    *,
    algorithm: str,
    batch_size: int,
    seq_len: int,
    lora_rank: int,
    lora_dropout: float,
    gpu_memory_bytes: int,
    quantization: str = "none",
    num_generations: int = 0,
    vllm_colocate: bool = False,
    fused_lm_head: bool = True,
    gradient_checkpointing: bool | None = None,
    paged_adamw_8bit: bool | None = None,
    vllm_gpu_memory_utilization: float | None = None,
    liger_kernels: bool = False,
    bf16: bool = True,
    optimizer: str | None = None,
    use_dora: bool = False,
    modules_to_save: tuple[str, ...] | list[str] = (),
) -> MemoryPlan:
    """Plan a LoRA run's memory on a GPU of `gpu_memory_bytes`: whether to recompute activations, which optimizer,
    whether vLLM colocates and with what share, and whether the run fits at all. Pure; safe to call from anywhere.

    `batch_size` is the micro-batch (sequences per device step: completions for GRPO) and `seq_len` its tokens per
    sequence (GRPO: prompt + completion). `num_generations` is the completions generated per round (GRPO: TRL's
    generation batch, `training.batch_size × gradient_accumulation_steps`), not the group size; 0 for SFT.
    `vllm_colocate` asks for vLLM on the training GPU (GRPO): the plan turns it off when vLLM would not fit beside
    training at its leanest. `fused_lm_head`: TRL 1.16's trainers always fuse it. `liger_kernels`: Liger's RMSNorm and
    SwiGLU keep less (leave False when unknown: the estimate errs high).

    Forcing (None: the plan decides): `gradient_checkpointing`; `paged_adamw_8bit` (False also where bitsandbytes is
    missing); `vllm_gpu_memory_utilization`, vLLM's share instead of the planned one; `optimizer`, the job's
    `training.optimizer` (an `estimates.OPTIMIZER_STATES` name), which the plan then counts instead of choosing.
    `use_dora` and `modules_to_save` are the adapter's (`lora.use_dora`, `lora.modules_to_save`).

    The plan, in order: vLLM colocates when its share fits beside training's weights and state while it generates,
    and what it keeps asleep fits beside training at its leanest; gradient checkpointing goes off only when training
    without it is within `CHECKPOINTING_MARGIN` of what vLLM asleep leaves; 8-bit paged AdamW replaces torch AdamW
    only when memory is short; `fits` says whether the run fits with checkpointing on."""
    if algorithm not in ("sft", "grpo", "dpo"):
        raise ValueError(f"algorithm {algorithm!r} is not one of 'sft', 'grpo', 'dpo'")
    if quantization not in ("none", "4bit"):
        raise ValueError(f"quantization {quantization!r} is not one of 'none', '4bit'")
    usable = usable_memory(gpu_memory_bytes)
    grpo = algorithm == "grpo"
    generations = num_generations or (batch_size if grpo else 0)
    # DPO runs each pair's chosen and rejected answers as one batch of twice the sequences, through the adapter and
    # again, without gradients and so without stored activations, through the reference (the adapter switched off):
    # that second forward's logits are counted like the first's.
    sequences = 2 * batch_size if algorithm == "dpo" else batch_size

    if optimizer is not None and paged_adamw_8bit is not None:
        raise ValueError("give `optimizer` or `paged_adamw_8bit`, not both: each chooses the optimizer")

    def training(checkpointing: bool, eight_bit: bool, colocated: bool, share_bytes: int = 0) -> MemoryBreakdown:
        """One configuration's breakdown; `share_bytes`: a colocated vLLM's share, held while it generates."""
        counted = optimizer or (EIGHT_BIT_ADAMW if eight_bit else TORCH_ADAMW)
        return MemoryBreakdown(
            weights_bytes=weights_bytes(shape, quantization=quantization, bf16=bf16),
            adapter_bytes=adapter_bytes(shape, lora_rank, optimizer=counted, use_dora=use_dora),
            lora_parameters=lora_parameters(shape, lora_rank, use_dora=use_dora),
            modules_to_save_bytes=modules_to_save_bytes(shape, modules_to_save, optimizer=counted),
            activations_bytes=activations_bytes(shape, batch_size=sequences, seq_len=seq_len, lora_rank=lora_rank,
                                                lora_dropout=lora_dropout, checkpointing=checkpointing,
                                                liger_kernels=liger_kernels, bf16=bf16, use_dora=use_dora,
                                                quantization=quantization),
            logits_bytes=logits_bytes(shape, batch_size=sequences, seq_len=seq_len, fused_lm_head=fused_lm_head,
                                      quantization=quantization) * (2 if algorithm == "dpo" else 1),
            # One backward per micro-batch, DPO's reference forward having none.
            head_gradient_bytes=head_gradient_bytes(shape, modules_to_save, fused_lm_head=fused_lm_head),
            generation_bytes=generation_bytes(shape, num_generations=generations, seq_len=seq_len) if grpo and not colocated else 0,
            vllm_bytes=share_bytes if colocated else 0,
            # TRL 1.16 puts a colocated vLLM to sleep after each round when `vllm_enable_sleep_mode` is on (fast_paths sets it).
            vllm_asleep_bytes=VLLM_ASLEEP_BYTES if colocated else 0,
        )

    reasons: dict[str, str] = {}
    # vLLM first: its share while it generates, and what it keeps asleep while training steps.
    vllm: VllmBreakdown | None = None
    share: float | None = None
    vllm_bytes = 0
    if not grpo:
        colocate = False
        reasons["vllm_colocate"] = f"{algorithm} generates no completions"
    elif not vllm_colocate:
        colocate = False
        reasons["vllm_colocate"] = "not asked for: completions come from the training model's generate"
    else:
        vllm = vllm_memory(shape, num_generations=generations, seq_len=seq_len)
        needed = vllm.weights_bytes + vllm.kv_cache_bytes + vllm.linear_attention_state_bytes + vllm.runtime_bytes
        leanest = training(True, paged_adamw_8bit is not False, True, needed)
        if vllm_gpu_memory_utilization is not None:
            colocate, share = True, vllm_gpu_memory_utilization
            reasons["vllm_colocate"] = (f"colocated with a forced {share:.2f} of the GPU (~{gib(share * gpu_memory_bytes)}; "
                                        f"~{gib(needed)} estimated for rounds of {generations} completions)")
        elif leanest.total_bytes > usable:
            colocate, vllm = False, None
            stays = leanest.weights_bytes + leanest.adapter_bytes + leanest.modules_to_save_bytes
            reasons["vllm_colocate"] = (f"vLLM needs ~{gib(needed)} while it generates, beside training's ~{gib(stays)} of "
                                        f"weights and state: ~{gib(leanest.total_bytes)} at the peak with training at its "
                                        f"leanest, over the {gib(usable)} usable: completions come from the training "
                                        "model's generate")
        else:
            colocate = True
            share = math.ceil(needed / gpu_memory_bytes * 100) / 100
            reasons["vllm_colocate"] = (f"colocated with {share:.2f} of the GPU (~{gib(needed)} for rounds of {generations} "
                                        f"completions of {seq_len} tokens), asleep while training steps")
        if colocate:
            vllm_bytes = int(share * gpu_memory_bytes)

    # Training's decisions weigh its own peak (the backward, vLLM asleep); the 8-bit optimizer and `fits` the whole
    # peak, vLLM's share while it generates included.
    without = training(False, bool(paged_adamw_8bit), colocate)
    if gradient_checkpointing is not None:
        checkpointing = gradient_checkpointing
        reasons["gradient_checkpointing"] = (f"forced {'on' if checkpointing else 'off'} for this run (~{gib(without.total_bytes)} "
                                             f"estimated without it, {gib(usable)} available)")
    elif without.total_bytes <= CHECKPOINTING_MARGIN * usable:
        checkpointing = False
        reasons["gradient_checkpointing"] = (f"not needed: ~{gib(without.total_bytes)} estimated without it, within "
                                             f"{CHECKPOINTING_MARGIN:.0%} of the {gib(usable)} available")
    else:
        checkpointing = True
        recomputed = training(True, bool(paged_adamw_8bit), colocate)
        reasons["gradient_checkpointing"] = (f"~{gib(without.total_bytes)} estimated without it, over {CHECKPOINTING_MARGIN:.0%} "
                                             f"of the {gib(usable)} available: recomputing activations brings it to "
                                             f"~{gib(recomputed.total_bytes)}")

    with_adamw = training(checkpointing, False, colocate, vllm_bytes)
    if optimizer is not None:
        eight_bit = optimizer == EIGHT_BIT_ADAMW
        reasons["paged_adamw_8bit"] = f"the job's `training.optimizer` is {optimizer}"
    elif paged_adamw_8bit is not None:
        eight_bit = paged_adamw_8bit
        reasons["paged_adamw_8bit"] = f"forced {'on' if eight_bit else 'off'} for this run"
    elif with_adamw.total_bytes <= usable:
        eight_bit = False
        reasons["paged_adamw_8bit"] = f"not needed: ~{gib(with_adamw.total_bytes)} estimated with torch AdamW, {gib(usable)} available"
    else:
        eight_bit = True
        reasons["paged_adamw_8bit"] = f"memory is short: ~{gib(with_adamw.total_bytes)} estimated with torch AdamW, {gib(usable)} available"

    unsized = [name for name in modules_to_save if not saved_module_parameters(shape, name)]
    if unsized:
        reasons["modules_to_save"] = (f"{', '.join(unsized)} not counted: the plan sizes only the LM head and the input "
                                      "embeddings from the model's config")
    forced = [name for name, value in (("gradient_checkpointing", gradient_checkpointing),
                                       ("paged_adamw_8bit", paged_adamw_8bit), ("optimizer", optimizer),
                                       ("vllm_gpu_memory_utilization", vllm_gpu_memory_utilization if colocate else None))
              if value is not None]
    chosen = training(checkpointing, eight_bit, colocate, vllm_bytes)
    with_checkpointing = training(True, eight_bit, colocate, vllm_bytes).total_bytes
    without_checkpointing = training(False, eight_bit, colocate, vllm_bytes).total_bytes
    if chosen.total_bytes > usable:
        reasons["gradient_checkpointing"] += (f"; as planned still ~{gib(chosen.total_bytes)} at the peak: expect "
                                              "out-of-memory, lower the batch size or the sequence length")
    return MemoryPlan(
        algorithm=algorithm,
        batch_size=batch_size,
        seq_len=seq_len,
        lora_rank=lora_rank,
        lora_dropout=lora_dropout,
        quantization=quantization,
        num_generations=generations,
        gpu_memory_bytes=gpu_memory_bytes,
        usable_bytes=usable,
        gradient_checkpointing=checkpointing,
        paged_adamw_8bit=eight_bit,
        optimizer=optimizer or (EIGHT_BIT_ADAMW if eight_bit else TORCH_ADAMW),
        use_dora=use_dora,
        modules_to_save=list(modules_to_save),
        vllm_colocate=colocate,
        vllm_gpu_memory_utilization=share if colocate else None,
        vllm_bytes=vllm_bytes,
        estimate_bytes=chosen.total_bytes,
        estimate_with_checkpointing_bytes=with_checkpointing,
        estimate_without_checkpointing_bytes=without_checkpointing,
        fits=with_checkpointing <= usable,
        breakdown=chosen,
        vllm=vllm if colocate else None,
        forced=forced,
        reasons=reasons,
    )


def plan_job(job: JobInput, shape: ModelShape, gpu_memory_bytes: int) -> MemoryPlan:
    """`plan_memory` for a job, on a GPU of `gpu_memory_bytes`, as the worker will see it on the GPU (TRL's fused LM
    head, vLLM colocated for GRPO unless the job turns it off, the job's forced memory settings, then its
    `fast_paths`, as `training.fast_paths.plan_fast_paths` ranks them): how the control plane judges a GPU before
    renting it. Liger's smaller activations are not counted, so the estimate errs high."""
    t, forced = job.training, job.memory
    micro = forced.micro_batch_size if forced is not None and forced.micro_batch_size else t.batch_size
    if job.algorithm == "grpo":
        assert job.grpo is not None  # the contract requires it
        seq_len = job.grpo.max_prompt_length + job.grpo.max_completion_length
        generations = t.batch_size * t.gradient_accumulation_steps  # TRL's generation batch, which micro-batches keep
    else:
        seq_len, generations = t.max_seq_length, 0
    switches = job.fast_paths
    checkpointing = forced.gradient_checkpointing if forced is not None else None
    return plan_memory(
        shape, algorithm=job.algorithm, batch_size=micro, seq_len=seq_len, lora_rank=job.lora.rank,
        lora_dropout=job.lora.dropout, gpu_memory_bytes=gpu_memory_bytes, quantization=job.lora.quantization,
        num_generations=generations,
        vllm_colocate=job.algorithm == "grpo" and not (forced is not None and forced.vllm_colocate is False)
        and switches.vllm_colocate is not False,
        gradient_checkpointing=switches.gradient_checkpointing if checkpointing is None else checkpointing,
        paged_adamw_8bit=switches.paged_adamw_8bit,
        vllm_gpu_memory_utilization=forced.vllm_gpu_memory_utilization if forced is not None else None,
        bf16=switches.bf16 is not False,
        optimizer=t.optimizer,
        use_dora=job.lora.use_dora,
        modules_to_save=job.lora.modules_to_save,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loraflow_worker.memory.plan",
        description="Print the memory plan of a LoRA run as one JSON object (GiB = 2^30 bytes).",
    )
    parser.add_argument("model_dir", type=Path, help="A model folder, or a folder holding only its config.json.")
    parser.add_argument("--algorithm", choices=("sft", "grpo", "dpo"), default="sft")
    parser.add_argument("--batch-size", type=int, required=True,
                        help="Sequences per micro-batch (GRPO: completions; DPO: pairs of a chosen and a rejected answer).")
    parser.add_argument("--seq-len", type=int, required=True, help="Tokens per sequence (GRPO: prompt + completion).")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--lora-dropout", type=float, default=0.0)
    parser.add_argument("--gpu-memory-gib", type=float, required=True, help="The GPU's memory in GiB.")
    parser.add_argument("--quantization", choices=("none", "4bit"), default="none")
    parser.add_argument("--num-generations", type=int, default=0,
                        help="GRPO: completions per generation round (batch size × accumulation steps); default: the batch size.")
    parser.add_argument("--no-vllm", action="store_true", help="GRPO: generate with the training model, not a colocated vLLM.")
    parser.add_argument("--no-fused-lm-head", action="store_true", help="Count the full logits (TRL 1.16 always fuses the head).")
    parser.add_argument("--liger-kernels", action="store_true", help="Count Liger's RMSNorm and SwiGLU (smaller activations).")
    parser.add_argument("--gradient-checkpointing", choices=("on", "off"), help="Force it instead of planning it.")
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZER_STATES),
                        help="Count this optimizer (`training.optimizer`) instead of planning torch or 8-bit AdamW.")
    parser.add_argument("--use-dora", action="store_true", help="A DoRA adapter (`lora.use_dora`).")
    parser.add_argument("--modules-to-save", nargs="*", default=[], metavar="MODULE",
                        help="Modules trained in full beside the adapter (`lora.modules_to_save`), e.g. lm_head.")
    args = parser.parse_args(argv)
    if not (args.model_dir / "config.json").is_file():
        parser.error(f"{args.model_dir} has no config.json")
    try:
        shape = read_model_shape(args.model_dir)
        plan = plan_memory(
            shape,
            algorithm=args.algorithm,
            batch_size=args.batch_size,
            seq_len=args.seq_len,
            lora_rank=args.lora_rank,
            lora_dropout=args.lora_dropout,
            gpu_memory_bytes=int(args.gpu_memory_gib * GIB),
            quantization=args.quantization,
            num_generations=args.num_generations,
            # As the worker does: vLLM where it can, never with a 4-bit base (the contract refuses that combination).
            vllm_colocate=args.algorithm == "grpo" and not args.no_vllm and args.quantization == "none",
            fused_lm_head=not args.no_fused_lm_head,
            liger_kernels=args.liger_kernels,
            gradient_checkpointing=None if args.gradient_checkpointing is None else args.gradient_checkpointing == "on",
            optimizer=args.optimizer,
            use_dora=args.use_dora,
            modules_to_save=args.modules_to_save,
        )
    except ValueError as e:
        print(f"memory_plan: {e}", file=sys.stderr)
        return 2
    print(json.dumps({**plan.model_dump(mode="json"), "model": shape.model_dump(mode="json")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
