"""Packing (`training.packing`): which models it is refused for, and what the manifest says of it.

TRL packs tokenized examples into rows of `max_length` tokens (best-fit decreasing); the worker hands the model a
batch of those rows with each example's positions restarting at 0 and no attention mask (`training.sft.PackedRows`), from
which transformers builds a block-diagonal causal mask (`masking_utils.find_packed_sequence_indices`), so no token
attends across examples; each example's first label is masked, so no token is trained from the example before it. A
Gated-DeltaNet hybrid's linear-attention layers (their recurrence and short convolution)
read no positions: they would need the boundaries as `cu_seqlens`/`seq_idx`, which only flash-linear-attention's and
causal-conv1d's kernels take (TRL passes them with a flattened row, for FlashAttention), and the image lacks
causal-conv1d (`requirements-gpu.lock`). Such a run is refused.

Light (no torch or TRL): the control plane refuses such a run before renting with the same words.
"""

from __future__ import annotations

from loraflow_worker.memory.model_shape import GATED_ATTENTION_MODEL_TYPES


def packing_problem(model_type: str) -> str | None:
    """Why `training.packing` cannot keep a `model_type` model's examples apart; None when it can."""
    if model_type not in GATED_ATTENTION_MODEL_TYPES:
        return None
    return (f"training.packing: `{model_type}` is a Gated-DeltaNet hybrid, whose linear-attention layers would carry "
            "their state and convolution from one packed example into the next (they need the boundaries passed to "
            "causal-conv1d's kernel, which the worker image lacks); set training.packing = false")


def packed_rows_reason(examples: int, rows: int, max_length: int) -> str:
    return (f"{examples} examples in {rows} rows of at most {max_length} tokens (TRL's best-fit decreasing), "
            "positions restarting per example, no attention or loss across them")
