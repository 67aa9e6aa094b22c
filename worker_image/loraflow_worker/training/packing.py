"""Packing (`training.packing`): which models it is refused for, and what the manifest says of it.

TRL packs tokenized examples into rows of `max_length` tokens (best-fit decreasing) and hands the model each
example's positions, restarting at 0 (padding-free); from those positions transformers builds a block-diagonal
causal mask (`masking_utils.find_packed_sequence_indices`), so no token attends across examples. TRL's collator also
passes the boundaries (`cu_seq_lens_q`, `seq_idx`) that a Gated-DeltaNet hybrid's linear-attention layers need, but
only the kernels read them: flash-linear-attention's recurrence and causal-conv1d's short convolution. Their torch
fallbacks run across the whole row, one example's state into the next. The image ships flash-linear-attention but
not causal-conv1d (`requirements-gpu.lock`), so such a run is refused.

Light (no torch or TRL): the control plane refuses such a run before renting with the same words.
"""

from __future__ import annotations

from loraflow_worker.memory.model_shape import GATED_ATTENTION_MODEL_TYPES


def packing_problem(model_type: str, boundary_kernels: bool = False) -> str | None:
    """Why `training.packing` cannot keep a `model_type` model's examples apart; None when it can.
    `boundary_kernels`: flash-linear-attention's and causal-conv1d's kernels are both engaged (the worker knows)."""
    if model_type not in GATED_ATTENTION_MODEL_TYPES or boundary_kernels:
        return None
    return (f"training.packing: `{model_type}` is a Gated-DeltaNet hybrid, whose linear-attention layers keep a packed "
            "row's examples apart only with both flash-linear-attention's and causal-conv1d's kernels, and the worker "
            "image lacks causal-conv1d (its torch convolution would run from one example into the next); set "
            "training.packing = false")


def packed_rows_reason(examples: int, rows: int, max_length: int) -> str:
    return (f"{examples} examples in {rows} rows of at most {max_length} tokens (TRL's best-fit decreasing), "
            "positions restarting per example, no attention across them")
