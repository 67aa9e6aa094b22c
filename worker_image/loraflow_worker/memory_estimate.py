"""How much GPU memory a LoRA run needs: the estimates the fast-path plan decides checkpointing, the optimizer
and vLLM's share from (`fast_paths.plan_fast_paths`), and the model's size they start from, read without loading
its weights."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

GIB = 2**30
CUDA_OVERHEAD_BYTES = 2 * GIB
"""CUDA context, cuBLAS and Triton workspaces: GPU memory the caching allocator never sees (an estimate)."""
MEMORY_HEADROOM = 0.10
"""Share of the GPU's memory no plan counts on: allocator fragmentation and the estimate's own error."""
ACTIVATION_BYTES = 34
"""Bytes per token, per layer and per unit of hidden size that a transformer layer keeps for its backward pass in
16-bit precision (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", without
the attention-score term, which SDPA and flash attention do not store)."""
CHECKPOINT_BYTES = 2
"""The same with gradient checkpointing: each layer keeps only its 16-bit input, and one layer at a time is
recomputed with its full activations."""
ADAMW_BYTES = 16
"""Per trainable (LoRA) parameter with torch AdamW: fp32 weight, gradient, exp_avg and exp_avg_sq."""
ADAMW_8BIT_BYTES = 10
"""The same with 8-bit AdamW: fp32 weight and gradient, 8-bit exp_avg and exp_avg_sq."""
VLLM_RUNTIME_BYTES = 2 * GIB
"""vLLM's own activations, sampler and CUDA graphs beside its weights and KV cache (TRL caps a vLLM step at 4096
batched tokens); an estimate."""
VLLM_KV_BYTES = 2
"""Bytes per value of vLLM's KV cache (bf16, its default for a bf16 model)."""


@dataclass(frozen=True)
class ModelShape:
    """The base model's size, read from its folder without loading it (`read_model_shape`)."""

    parameters: int
    """Parameters stored in its weights."""
    hidden_size: int
    intermediate_size: int
    layers: int
    attention_layers: int
    """Layers with a KV cache: all but Gated-DeltaNet's linear-attention layers."""
    kv_heads: int
    head_dim: int
    vocab_size: int


@dataclass(frozen=True)
class Workload:
    """What one training micro-batch asks of memory (`training_run.job_workload` reads it from the job)."""

    batch_size: int
    """Sequences per micro-batch (`per_device_train_batch_size`; completions for GRPO)."""
    seq_len: int
    """Tokens per sequence at most (SFT `max_length`; GRPO prompt + completion)."""
    lora_rank: int
    generations: int = 0
    """Completions generated per round (GRPO: the generation batch); 0 for SFT."""


def usable_memory(gpu_memory_bytes: int) -> int:
    """GPU bytes a plan may count on: the total less the headroom and CUDA's own overhead."""
    return int(gpu_memory_bytes * (1 - MEMORY_HEADROOM)) - CUDA_OVERHEAD_BYTES


def lora_parameters(model: ModelShape, rank: int) -> int:
    """Trainable parameters of a rank-`rank` LoRA on every linear layer of each block (the contract's default,
    `all-linear`; fewer target modules need less): q, k, v, o take at most 8·hidden inputs and outputs together,
    gate, up and down 3·(hidden + intermediate)."""
    return rank * model.layers * (11 * model.hidden_size + 3 * model.intermediate_size)


def training_memory(model: ModelShape, workload: Workload, *, bf16: bool, checkpointing: bool, optimizer_bytes: int) -> int:
    """Estimated peak GPU bytes of LoRA training: the frozen base weights, the adapter's weights, gradients and
    optimizer state, and the activations of one micro-batch (TRL's fused LM head keeps the logits out of it)."""
    width = 2 if bf16 else 4  # bytes per value
    tokens = workload.batch_size * workload.seq_len
    per_token = model.layers * CHECKPOINT_BYTES + ACTIVATION_BYTES if checkpointing else model.layers * ACTIVATION_BYTES
    activations = tokens * model.hidden_size * per_token * width // 2
    return model.parameters * width + lora_parameters(model, workload.lora_rank) * optimizer_bytes + activations


def vllm_memory(model: ModelShape, workload: Workload) -> int:
    """Estimated GPU bytes a colocated vLLM engine needs: its own bf16 copy of the weights, a KV cache holding one
    whole generation round, and its runtime."""
    kv_per_token = 2 * model.attention_layers * model.kv_heads * model.head_dim * VLLM_KV_BYTES  # keys and values
    return model.parameters * 2 + kv_per_token * workload.generations * workload.seq_len + VLLM_RUNTIME_BYTES


def read_model_shape(model_dir: Path) -> ModelShape:
    """The size of the model in `model_dir` from its config and its safetensors headers (no weight is read)."""
    from safetensors import safe_open
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    text = config.get_text_config()
    parameters = 0
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(file, framework="pt") as weights:
            parameters += sum(math.prod(weights.get_slice(name).get_shape()) for name in weights.keys())
    if not parameters:
        # A checkpoint without safetensors (`pytorch_model.bin`): count the architecture's parameters, built on the
        # meta device (no memory).
        import torch
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            parameters = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    layer_types = getattr(text, "layer_types", None) or []  # per-layer attention kinds, where the model has them
    heads = text.num_attention_heads
    return ModelShape(
        parameters=parameters,
        hidden_size=text.hidden_size,
        intermediate_size=text.intermediate_size,
        layers=text.num_hidden_layers,
        attention_layers=sum(kind != "linear_attention" for kind in layer_types) if layer_types else text.num_hidden_layers,
        kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
        vocab_size=text.vocab_size,
    )


def gib(size: float) -> str:
    return f"{size / GIB:.1f} GiB"
