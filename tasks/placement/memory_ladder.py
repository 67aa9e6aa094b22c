"""The out-of-memory ladder: what the next attempt of a run changes after one ran out of memory, by the kind
of memory that ran out, before the run moves to a dearer GPU or gives up.

- The GPU's memory, in training: the same GPU again with gradient checkpointing on and half the micro-batch
  (gradient accumulation keeps the effective batch); then a GPU with more memory.
- vLLM at start-up (GRPO with vLLM colocated): vLLM's share of the GPU moved the way its error asks (a small share
  raised goes at least to the floor); then vLLM colocate off (generation by the training model); then a GPU with
  more memory. vLLM 0.33 fails in two opposite ways: "No available memory for the cache blocks" / "KV cache is
  needed, which is larger than the available KV cache memory" (`v1/core/kv_cache_planning.py`: its share holds its
  weights and runtime but no KV cache, so the share is raised) and "Free memory on device ... is less than desired
  GPU memory utilization" (`v1/worker/utils.py`: training holds what the share asks for, so the share is lowered).
  A run without vLLM that reports a vLLM failure is treated as out of GPU memory.
- The host's RAM: half the micro-batch; then the run fails naming host memory (a GPU with more memory does not
  cure it).

One rung per kind before the dearer step, so the ladder fits the run's attempt budget (3 by default).

The forced settings travel in the job input (`JobInput.memory`), never in the endpoint's env.
"""

from __future__ import annotations

import re

from loraflow_worker.contract import MemorySettings
from pydantic import BaseModel, Field

VLLM_SHARE_STEP = 0.75
"""A vLLM share that failed is retried at this fraction of itself (too big) or divided by it (too small)."""
VLLM_SHARE_FLOOR = 0.1
"""Below this share of the GPU a colocated vLLM cannot hold a model and any KV cache: a share lowered below it turns
colocate off instead, and a share raised is raised at least to it."""
VLLM_SHARE_CEILING = 0.8
"""Above this share training keeps too little of the GPU beside vLLM: colocate goes off instead."""
_SHARE_TOO_BIG = re.compile(r"less than desired GPU memory utilization", re.IGNORECASE)


class MemoryContext(BaseModel):
    """What the ladder needs to know of the run."""

    forced: MemorySettings | None = Field(default=None, description="What the attempt that failed forced; None: the plan's own.")
    batch_size: int = Field(description="The run's `training.batch_size`: the micro-batch the plan starts from.")
    effective_batch: int = Field(description="`batch_size × gradient_accumulation_steps`: kept on every rung.")
    vllm: bool = Field(default=False, description="Whether the run colocates vLLM (GRPO, colocate not turned off).")
    vllm_share: float | None = Field(default=None, description="The share of the GPU the plan gives a colocated "
                                     "vLLM (GRPO); None when there is none or it is unknown.")


class Rung(BaseModel):
    memory: MemorySettings = Field(description="The settings the next attempt forces.")
    reason: str


def next_rung(memory_kind: str | None, context: MemoryContext, error: str | None = None) -> Rung | None:
    """The next attempt's forced settings after running out of `memory_kind` memory (gpu, vllm_kv, host; `error`:
    the failure's text); None when this kind's ladder is spent (the caller moves to a bigger GPU, or fails)."""
    forced = context.forced or MemorySettings()
    if memory_kind == "vllm_kv" and not context.vllm:
        memory_kind = "gpu"
    micro = forced.micro_batch_size or context.batch_size
    if memory_kind == "gpu":
        if forced.gradient_checkpointing:  # this rung was taken: a bigger GPU, within the attempt budget
            return None
        micro_next = _smaller_micro_batch(micro, context.effective_batch) or micro
        return Rung(memory=forced.model_copy(update={"gradient_checkpointing": True, "micro_batch_size": micro_next}),
                    reason=f"retrying with gradient checkpointing on and a micro-batch of {micro_next} (gradient "
                           f"accumulation keeps the batch of {context.effective_batch})")
    if memory_kind == "vllm_kv":
        if forced.vllm_colocate is False:
            return None
        share = context.vllm_share
        if share is not None and forced.vllm_gpu_memory_utilization is None:
            lower = bool(_SHARE_TOO_BIG.search(error or ""))
            moved = round(share * VLLM_SHARE_STEP if lower else share / VLLM_SHARE_STEP, 3)
            if not lower:
                # A small model's share (0.03-0.05 of a large GPU) divided by the step still falls short of the floor.
                moved = max(moved, VLLM_SHARE_FLOOR)
            if VLLM_SHARE_FLOOR <= moved <= VLLM_SHARE_CEILING:
                why = "training holds what it asked for" if lower else "it had no room left for its KV cache"
                return Rung(memory=forced.model_copy(update={"vllm_gpu_memory_utilization": moved}),
                            reason=f"retrying with vLLM's share of the GPU {'lowered' if lower else 'raised'} from "
                                   f"{share:.2f} to {moved:.2f} ({why})")
        return Rung(memory=forced.model_copy(update={"vllm_colocate": False, "vllm_gpu_memory_utilization": None}),
                    reason="retrying with vLLM colocate off: the training model generates the completions (slower)")
    if memory_kind == "host":
        smaller = _smaller_micro_batch(micro, context.effective_batch)
        if forced.micro_batch_size is not None or smaller is None:  # taken, or nothing smaller: fail
            return None
        return Rung(memory=forced.model_copy(update={"micro_batch_size": smaller}),
                    reason=f"retrying with a micro-batch of {smaller} (gradient accumulation keeps the batch of "
                           f"{context.effective_batch})")
    return None


def _smaller_micro_batch(micro: int, effective_batch: int) -> int | None:
    """The largest micro-batch of at most half `micro` that divides the effective batch; None below 1."""
    for candidate in range(micro // 2, 0, -1):
        if effective_batch % candidate == 0:
            return candidate
    return None
