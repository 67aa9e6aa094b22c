"""How much GPU memory a LoRA run needs, and the memory decisions that follow from it: gradient checkpointing, the
optimizer and vLLM's share of the GPU. One planner for the worker (`fast_paths.plan_fast_paths` decides from it) and
for the control plane (which drops the GPUs a run cannot fit before renting one).

Pure Python (pydantic only): the control plane imports it without the training stack, and a model is sized from its
`config.json` alone (`shape_from_config`), refined by its safetensors headers when its folder has them
(`read_model_shape`). From the command line, with a folder that may hold only a `config.json`:

    python -m loraflow_worker.memory_plan MODEL_DIR --algorithm sft --batch-size 8 --seq-len 2048 \\
        --lora-rank 16 --lora-dropout 0.05 --gpu-memory-gib 24
    python -m loraflow_worker.memory_plan MODEL_DIR --algorithm sft --batch-size 1 --seq-len 2048 \\
        --lora-rank 16 --gpu-memory-gib 80 --quantization 4bit
    python -m loraflow_worker.memory_plan MODEL_DIR --algorithm grpo --batch-size 8 --seq-len 1536 \\
        --num-generations 16 --gpu-memory-gib 80

prints the plan as one JSON object (`gradient_checkpointing`, `fits`, `estimate_gib`, `usable_gib`, `vllm_gib`, the
breakdown in bytes, the reasons).

What is counted, per micro-batch of `batch_size` sequences of `seq_len` tokens (the bytes of each term are stated
where it is computed; every figure is an estimate until a GPU measures it):
- the frozen base weights: 2 bytes a parameter in bf16; with `quantization="4bit"` (QLoRA) the blocks' linear weights
  in nf4 with double quantization (`NF4_BYTES_PER_PARAMETER`) and everything else in fp32, as
  `peft.prepare_model_for_kbit_training` leaves it;
- the LoRA adapter (rank r on every linear layer of the blocks, the contract's default `all-linear`) with its gradient
  and optimizer state;
- the activations saved for backward, with and without gradient checkpointing, including the input copy each adapted
  layer keeps for `lora_A(dropout(x))` and the dropout mask;
- the LM head as TRL 1.16 computes it: its fused, chunked log-probability head (both trainers add it with
  `add_fused_lm_head` and never build the `(batch, seq, vocab)` logits), or the full logits when not fused;
- for GRPO with vLLM colocated, vLLM's share: its weights, the KV cache (and Gated-DeltaNet state) of a whole
  generation round, its runtime; for GRPO without vLLM, the training model's own generation cache;
- CUDA's own memory and a headroom, taken off the GPU's memory before anything is planned (`usable_memory`).
"""

from __future__ import annotations

import argparse
import json
import math
import struct
import sys
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, computed_field

from loraflow_worker.contract import JobInput

GIB = 2**30

# ---- The GPU -------------------------------------------------------------------------------------------------------
CUDA_OVERHEAD_BYTES = GIB
"""GPU memory torch's caching allocator never sees, so no estimate below counts it: the CUDA context with lazy module
loading (torch's default since CUDA 11.7; about 0.5 GiB on Ampere and Hopper), the kernel images torch, Triton,
Liger and bitsandbytes load on first use, and the cuBLAS/cuBLASLt handles. An allowance, not a measurement: the GPU
smoke's device-level peak less `max_memory_reserved` is the figure to check it against."""
MEMORY_HEADROOM = 0.10
"""Share of the GPU's memory no plan counts on: the caching allocator's fragmentation and the estimate's own error."""
CHECKPOINTING_MARGIN = 0.60
"""Gradient checkpointing goes off only when training without it is estimated at most this share of the memory
available to it: the estimate is not measured, and an out-of-memory failure costs a whole attempt."""

# ---- Weights -------------------------------------------------------------------------------------------------------
NF4_BYTES_PER_PARAMETER = 0.5 + 1 / 64 + 4 / (64 * 256)
"""A 4-bit linear weight in bitsandbytes' nf4 with double quantization (`Params4bit`, blocksize 64): half a byte for
the value, one 8-bit absmax per block of 64 values, and one fp32 absmax of those per 256 blocks (≈ 0.5159 bytes)."""
KBIT_OTHER_BYTES = 4
"""What `peft.prepare_model_for_kbit_training` makes of every weight it does not quantize (embeddings, LM head, norms,
biases): fp32, for stable training of a 4-bit base (PEFT 0.21, `utils/other.py`)."""

# ---- The adapter and its optimizer ---------------------------------------------------------------------------------
ADAMW_BYTES = 16
"""Per LoRA parameter with torch AdamW: fp32 weight (PEFT's `autocast_adapter_dtype` upcasts the adapter of a bf16
model), gradient, exp_avg and exp_avg_sq."""
ADAMW_8BIT_BYTES = 10
"""The same with bitsandbytes' 8-bit paged AdamW: fp32 weight and gradient, 8-bit exp_avg and exp_avg_sq."""
QLORA_ADAMW_BYTES = 8
"""Per LoRA parameter of a 4-bit base with torch AdamW: TRL 1.16 casts the adapter of a quantized model to bf16
(`SFTTrainer.__init__`, after the QLoRA paper), so weight, gradient and both states are bf16."""
QLORA_ADAMW_8BIT_BYTES = 6
"""The same with 8-bit paged AdamW: bf16 weight and gradient, 8-bit states."""

# ---- The LM head -----------------------------------------------------------------------------------------------------
FUSED_HEAD_TOKEN_CHUNK = 4096
"""Tokens per tile of TRL's fused log-probability head (`trl/kernels/chunked_logprob.py`, `TOKEN_CHUNK_SIZE`)."""
FUSED_HEAD_VOCAB_CHUNK = 32768
"""Vocabulary entries per tile (`trl/trainer/utils.py`, `_CHUNKED_LOGPROB_CHUNK_SIZE`)."""
FUSED_HEAD_BYTES_PER_TOKEN_AND_HIDDEN = 6
"""Per token and hidden unit in the fused head: the bf16 hidden state it saves for backward (2) and the fp32 gradient
of it that backward accumulates (4)."""
FUSED_HEAD_BYTES_PER_TOKEN = 32
"""Per token: the fused head's fp32 running statistics and outputs (max, sums, target logit, log-probability, ...)."""
UNFUSED_LOGIT_BYTES = 10
"""Per logit when the head is not fused: the bf16 logits (2), transformers' fp32 copy for the loss (4), and the fp32
log-softmax that cross-entropy saves for backward (4)."""

# ---- vLLM ------------------------------------------------------------------------------------------------------------
VLLM_MAX_BATCHED_TOKENS = 4096
"""Tokens of vLLM's largest step and of its start-up profiling run: TRL 1.16 builds the colocated engine with
`max_num_batched_tokens=4096` (`trl/generation/vllm_generation.py`)."""
VLLM_CUDA_GRAPH_BYTES = GIB
"""vLLM's CUDA graphs, which vLLM 0.33 profiles and takes out of its share before sizing the KV cache
(`vllm/v1/worker/gpu_worker.py`, `determine_available_memory`): an allowance, not a measurement."""
VLLM_MIN_RUNTIME_BYTES = 2 * GIB
"""The floor under vLLM's runtime (activations of its profiling step, sampler, CUDA graphs): vLLM refuses to start
when what it profiles beside its weights leaves no room for a KV cache, so a small model's computed runtime is not
trusted below this."""
VLLM_BLOCK_TOKENS = 16
"""Tokens per KV-cache block (vLLM's default block size, and the alignment its FlashAttention backend asks for)."""
KV_BYTES = 2
"""Bytes per cached key or value: bf16, vLLM's and transformers' cache dtype for a bf16 model."""


class LinearAttentionShape(BaseModel):
    """The Gated-DeltaNet (linear attention) mixer of Qwen3.5 / Qwen3-Next layers."""

    model_config = ConfigDict(frozen=True)

    key_heads: int = Field(description="`linear_num_key_heads`.")
    value_heads: int = Field(description="`linear_num_value_heads`.")
    key_head_dim: int = Field(description="`linear_key_head_dim`.")
    value_head_dim: int = Field(description="`linear_value_head_dim`.")
    conv_kernel: int = Field(description="`linear_conv_kernel_dim`: width of the short convolution over q, k and v.")
    recurrent_state_bytes: int = Field(
        description="Bytes per value of the recurrent state in vLLM: 4 when the config's `mamba_ssm_dtype` is float32 "
        "(vLLM 0.33 follows it for Qwen3.5), else 2 (the model's dtype)."
    )

    @property
    def key_dim(self) -> int:
        return self.key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    def state_bytes(self) -> int:
        """One sequence's state in one layer, as vLLM 0.33 holds it (`MambaStateShapeCalculator.
        gated_delta_net_state_shape`): the convolution's last `conv_kernel - 1` inputs in bf16, and the recurrent
        state of `value_heads × value_head_dim × key_head_dim` values."""
        conv = (self.conv_kernel - 1) * self.conv_dim * KV_BYTES
        return conv + self.value_heads * self.value_head_dim * self.key_head_dim * self.recurrent_state_bytes


class ModelShape(BaseModel):
    """The base model's size and the dimensions the memory formulas need, from its `config.json` (`shape_from_config`)
    and, for a model folder, its safetensors headers (`read_model_shape`). No weight is read."""

    model_config = ConfigDict(frozen=True)

    model_type: str = Field(description="`model_type` of the (text) config, e.g. `qwen3`, `llama`.")
    parameters: int = Field(description="Parameters the model holds in memory (tied embeddings counted once).")
    quantizable_parameters: int = Field(
        description="Weights of the blocks' linear layers: what 4-bit loading quantizes (embeddings, the LM head, norms "
        "and biases are not)."
    )
    hidden_size: int
    intermediate_size: int = Field(description="MLP width a token goes through (for MoE: experts per token × expert width).")
    vocab_size: int
    layers: int
    attention_layers: int = Field(description="Layers with softmax attention and so a KV cache (not Gated-DeltaNet ones).")
    attention_heads: int
    kv_heads: int
    head_dim: int
    qk_norm: bool = Field(default=False, description="RMSNorm on each head's queries and keys (Qwen3 and later).")
    attention_output_gate: bool = Field(
        default=False, description="A sigmoid gate on the attention output (Qwen3.5 / Qwen3-Next: `q_proj` is twice as wide)."
    )
    tied_embeddings: bool = Field(description="The LM head shares the input embeddings' weight.")
    linear_attention: LinearAttentionShape | None = Field(
        default=None, description="The Gated-DeltaNet mixer, for models with linear-attention layers."
    )
    lora_in_features: int = Field(description="Sum of the input widths of every linear layer in the blocks (all layers).")
    lora_out_features: int = Field(description="Sum of their output widths.")
    lora_modules: int = Field(description="Linear layers in the blocks: those `all-linear` LoRA adapts.")

    @property
    def linear_attention_layers(self) -> int:
        return self.layers - self.attention_layers

    @property
    def q_dim(self) -> int:
        return self.attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim


class MemoryBreakdown(BaseModel):
    """Estimated GPU bytes by what holds them, for one configuration (checkpointing on or off, an optimizer)."""

    weights_bytes: int = Field(description="The frozen base weights (bf16, or 4-bit with fp32 for the rest).")
    adapter_bytes: int = Field(description="LoRA weights, their gradients and the optimizer's state.")
    lora_parameters: int = Field(description="Trainable LoRA parameters (rank r on every linear layer of the blocks).")
    activations_bytes: int = Field(
        description="Activations saved for backward of one micro-batch, PEFT's input copies and dropout masks included, "
        "with the gradients of the layer being back-propagated."
    )
    logits_bytes: int = Field(description="The LM head's working memory (TRL's fused head, or the full logits).")
    generation_bytes: int = Field(
        default=0,
        description="GRPO without vLLM: the training model's KV cache and logits while it generates a round (held at a "
        "different time than the activations: the larger of the two counts).",
    )
    vllm_bytes: int = Field(default=0, description="vLLM's share of the GPU, when colocated.")

    @computed_field
    @property
    def total_bytes(self) -> int:
        return (self.weights_bytes + self.adapter_bytes + max(self.activations_bytes + self.logits_bytes, self.generation_bytes)
                + self.vllm_bytes)


class VllmBreakdown(BaseModel):
    """vLLM's share of the GPU, by what holds it."""

    weights_bytes: int = Field(description="vLLM's own bf16 copy of the weights.")
    kv_cache_bytes: int = Field(description="KV cache of a whole generation round, in whole blocks.")
    linear_attention_state_bytes: int = Field(description="Gated-DeltaNet state of the round's sequences, in KV-cache pages.")
    runtime_bytes: int = Field(description="Activations of its profiling step, the sampler and CUDA graphs (floored).")
    block_tokens: int = Field(description="Tokens per KV-cache block (raised for hybrid models to fit a layer's state in a page).")


class MemoryPlan(BaseModel):
    """The memory decisions for one run on one GPU, and the estimates they come from (`plan_memory`)."""

    algorithm: Literal["sft", "grpo"]
    batch_size: int = Field(description="Sequences per micro-batch (per device step).")
    seq_len: int = Field(description="Tokens per sequence at most.")
    lora_rank: int
    lora_dropout: float
    quantization: Literal["none", "4bit"]
    num_generations: int = Field(description="Completions per generation round (GRPO); 0 for SFT.")
    gpu_memory_bytes: int
    usable_bytes: int = Field(description="What a plan may count on: the GPU's memory less the headroom and CUDA's own.")
    gradient_checkpointing: bool = Field(description="Whether training recomputes activations (the plan's choice, or forced).")
    paged_adamw_8bit: bool = Field(description="Whether the optimizer is bitsandbytes' 8-bit paged AdamW (else torch AdamW).")
    vllm_colocate: bool = Field(description="Whether vLLM generates the completions on the training GPU.")
    vllm_gpu_memory_utilization: float | None = Field(description="vLLM's share of the GPU when colocated.")
    vllm_bytes: int = Field(description="GPU bytes of vLLM's share (0 when not colocated).")
    estimate_bytes: int = Field(description="Everything the plan counts on the GPU, with the chosen checkpointing.")
    estimate_with_checkpointing_bytes: int = Field(description="The same with gradient checkpointing on.")
    estimate_without_checkpointing_bytes: int = Field(description="The same with gradient checkpointing off.")
    fits: bool = Field(description="Whether the run fits the GPU with gradient checkpointing on.")
    breakdown: MemoryBreakdown = Field(description="The estimate of the chosen configuration, by what holds the memory.")
    vllm: VllmBreakdown | None = Field(default=None, description="vLLM's share, by what holds it, when colocated.")
    forced: list[str] = Field(default_factory=list, description="Decisions forced by the caller instead of planned.")
    reasons: dict[str, str] = Field(
        description="Why each decision (`gradient_checkpointing`, `paged_adamw_8bit`, `vllm_colocate`) went as it did."
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


# ---- The model's shape ---------------------------------------------------------------------------------------------

GATED_ATTENTION_MODEL_TYPES = frozenset({"qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"})
"""Model types whose full-attention layers gate their output (`q_proj` twice as wide) and whose other layers are
Gated-DeltaNet (transformers 5.20, `modeling_qwen3_5.py`)."""
_QWEN2_STYLE_QKV_BIAS = frozenset({"qwen2", "qwen2_moe"})
"""Model types with biases on q, k and v (and not on o) without saying so in an `attention_bias` key."""


def shape_from_config(config: dict) -> ModelShape:
    """The shape of the model a `config.json` describes, parameters counted from its dimensions: embeddings (the LM
    head once more unless tied), attention with grouped KV heads (biases, Qwen3's q/k norms, Qwen3.5's output gate),
    Gated-DeltaNet layers where `layer_types` (or `full_attention_interval`) has them, the MLP (SwiGLU; a
    mixture of experts when the config has experts) and the norms. A multimodal config's `text_config` is the model
    trained; its vision tower is not counted (a model folder's safetensors headers count it, `read_model_shape`)."""
    text = config.get("text_config") or config
    model_type = text.get("model_type") or config.get("model_type") or "unknown"
    try:
        h = text["hidden_size"]
        layers = text["num_hidden_layers"]
        heads = text["num_attention_heads"]
        vocab = text["vocab_size"]
    except KeyError as e:
        raise ValueError(f"config.json of model type `{model_type}` has no `{e.args[0]}`: cannot size the model") from e
    kv_heads = text.get("num_key_value_heads") or heads
    head_dim = text.get("head_dim") or h // heads
    tied = bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings", False)))
    gated = model_type in GATED_ATTENTION_MODEL_TYPES
    qk_norm = model_type.startswith("qwen3")
    q_dim, kv_dim = heads * head_dim, kv_heads * head_dim

    layer_types = text.get("layer_types")
    if not layer_types and text.get("full_attention_interval"):
        interval = text["full_attention_interval"]
        # As transformers builds them (Qwen3_5TextConfig.__post_init__): every `interval`-th layer has full attention.
        layer_types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
    linear_layers = sum(kind == "linear_attention" for kind in layer_types or [])
    linear = None
    if linear_layers:
        # transformers' Qwen3_5TextConfig defaults, for keys a config leaves out.
        linear = LinearAttentionShape(
            key_heads=text.get("linear_num_key_heads", 16),
            value_heads=text.get("linear_num_value_heads", 32),
            key_head_dim=text.get("linear_key_head_dim", 128),
            value_head_dim=text.get("linear_value_head_dim", 128),
            conv_kernel=text.get("linear_conv_kernel_dim", 4),
            recurrent_state_bytes=4 if text.get("mamba_ssm_dtype") == "float32" else 2,
        )
    attention_layers = layers - linear_layers

    # Attention: (in, out) of each linear layer, and its biases.
    attention_linears = [(h, q_dim * (2 if gated else 1)), (h, kv_dim), (h, kv_dim), (q_dim, h)]
    if text.get("attention_bias") or model_type in _QWEN2_STYLE_QKV_BIAS:
        attention_biases = q_dim * (2 if gated else 1) + 2 * kv_dim + (h if text.get("attention_bias") else 0)
    else:
        attention_biases = 0
    attention_norms = 2 * head_dim if qk_norm else 0
    # Gated-DeltaNet (transformers' Qwen3_5GatedDeltaNet): in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj; a
    # depthwise convolution, dt_bias, A_log and a gated norm over the value head dim.
    if linear:
        linear_linears = [(h, linear.conv_dim), (h, linear.value_dim), (h, linear.value_heads), (h, linear.value_heads),
                          (linear.value_dim, h)]
        linear_other = linear.conv_dim * linear.conv_kernel + 2 * linear.value_heads + linear.value_head_dim
    else:
        linear_linears, linear_other = [], 0

    experts = text.get("num_experts") or text.get("num_local_experts") or 0
    if experts:
        # A mixture of experts in every layer (an approximation: `decoder_sparse_step` and `mlp_only_layers` are not
        # read): a router and `experts` SwiGLU experts, plus a shared expert and its gate when the config has one; a
        # token goes through `num_experts_per_tok` of them. In transformers 5 the router and the experts are plain
        # parameters (`Qwen3MoeTopKRouter`, `Qwen3MoeExperts`: 3-D tensors), not linear layers, so neither `all-linear`
        # LoRA nor bitsandbytes' 4-bit loading touches them; the shared expert is linear layers.
        expert_width = text.get("moe_intermediate_size") or text["intermediate_size"]
        shared_width = text.get("shared_expert_intermediate_size") or 0
        mlp_linears = [(h, shared_width), (h, shared_width), (shared_width, h), (h, 1)] if shared_width else []
        mlp_other = experts * h + experts * 3 * h * expert_width
        intermediate = (text.get("num_experts_per_tok") or 1) * expert_width + shared_width
    else:
        intermediate = text["intermediate_size"]
        mlp_linears = [(h, intermediate), (h, intermediate), (intermediate, h)]
        mlp_other = 3 * intermediate if text.get("mlp_bias") else 0

    def weights(linears: list[tuple[int, int]]) -> int:
        return sum(i * o for i, o in linears)

    per_layer_norms = 2 * h
    quantizable = (attention_layers * weights(attention_linears) + linear_layers * weights(linear_linears)
                   + layers * weights(mlp_linears))
    other = (attention_layers * (attention_biases + attention_norms) + linear_layers * linear_other
             + layers * (per_layer_norms + mlp_other) + h + vocab * h * (1 if tied else 2))
    adapted = attention_layers * attention_linears + linear_layers * linear_linears + layers * mlp_linears
    return ModelShape(
        model_type=model_type,
        parameters=quantizable + other,
        quantizable_parameters=quantizable,
        hidden_size=h,
        intermediate_size=intermediate,
        vocab_size=vocab,
        layers=layers,
        attention_layers=attention_layers,
        attention_heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        qk_norm=qk_norm,
        attention_output_gate=gated,
        tied_embeddings=tied,
        linear_attention=linear,
        lora_in_features=sum(i for i, _ in adapted),
        lora_out_features=sum(o for _, o in adapted),
        lora_modules=len(adapted),
    )


_FLOAT_DTYPES = frozenset({"BF16", "F16", "F32", "F64"})


def read_model_shape(model_dir: Path) -> ModelShape:
    """The shape of the model in `model_dir`: from its `config.json`, with the parameter count taken from its
    safetensors headers when it has unquantized ones (they count what the config does not say, e.g. a vision tower).
    Reads the headers only (the first bytes of each file), no weight."""
    model_dir = Path(model_dir)
    shape = shape_from_config(json.loads((model_dir / "config.json").read_text()))
    stored = 0
    for file in sorted(model_dir.glob("*.safetensors")):
        with file.open("rb") as f:
            # The safetensors format: an 8-byte little-endian header length, then a JSON header naming each tensor's
            # dtype and shape.
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for name, tensor in header.items():
            if name == "__metadata__":
                continue
            if tensor["dtype"] not in _FLOAT_DTYPES:
                return shape  # a pre-quantized checkpoint: its packed tensors do not count parameters
            if shape.tied_embeddings and name.endswith("lm_head.weight"):
                continue  # stored, but tied to the embeddings once loaded
            stored += math.prod(tensor["shape"])
    if not stored:
        return shape
    return shape.model_copy(update={"parameters": stored,
                                    "quantizable_parameters": shape.quantizable_parameters + max(0, stored - shape.parameters)})


# ---- The estimates ---------------------------------------------------------------------------------------------------


def lora_parameters(shape: ModelShape, rank: int) -> int:
    """Trainable parameters of a rank-`rank` LoRA on every linear layer of the blocks (`all-linear`; fewer target
    modules need less): A is rank × in, B is out × rank."""
    return rank * (shape.lora_in_features + shape.lora_out_features)


def weights_bytes(shape: ModelShape, *, quantization: str, bf16: bool = True) -> int:
    """The frozen base weights: 2 bytes a parameter in bf16 (4 in fp32); with 4-bit, the quantizable weights in nf4
    with double quantization and the rest in fp32 (`prepare_model_for_kbit_training`)."""
    if quantization == "4bit":
        rest = shape.parameters - shape.quantizable_parameters
        return math.ceil(shape.quantizable_parameters * NF4_BYTES_PER_PARAMETER) + rest * KBIT_OTHER_BYTES
    return shape.parameters * (2 if bf16 else 4)


def adapter_bytes(shape: ModelShape, rank: int, *, quantization: str, paged_adamw_8bit: bool) -> int:
    """LoRA weights, gradients and optimizer state."""
    if quantization == "4bit":
        per_parameter = QLORA_ADAMW_8BIT_BYTES if paged_adamw_8bit else QLORA_ADAMW_BYTES
    else:
        per_parameter = ADAMW_8BIT_BYTES if paged_adamw_8bit else ADAMW_BYTES
    return lora_parameters(shape, rank) * per_parameter


def attention_layer_bytes(shape: ModelShape, *, liger_kernels: bool = False) -> int:
    """Bytes one token leaves saved for backward in one full-attention layer of a frozen bf16 base, LoRA aside:
    - the input and post-attention RMSNorms: transformers' saves an fp32 copy of its input (4 bytes × hidden),
      Liger's its bf16 input (2);
    - Qwen3's q and k norms, likewise over the query and key widths;
    - attention: q, k and v with k and v repeated to every query head (transformers repeats them for SDPA whenever a
      padding mask is passed, `integrations/sdpa_attention.py`), and the output, in bf16; the fp32 log-sum-exp per head;
    - Qwen3.5's output gate: the sigmoid's output and the attention output it multiplies (bf16);
    - the SwiGLU MLP: the gate and up projections' outputs and, without Liger (which recomputes it), the SiLU's output.
    The frozen linear layers keep nothing: backward through them needs only their weights."""
    norm = 2 if liger_kernels else 4
    total = 2 * norm * shape.hidden_size
    if shape.qk_norm:
        total += norm * (shape.q_dim + shape.kv_dim)
    total += 2 * 4 * shape.q_dim + 4 * shape.attention_heads
    if shape.attention_output_gate:
        total += 2 * 2 * shape.q_dim
    return total + _mlp_bytes(shape, liger_kernels)


def linear_attention_layer_bytes(shape: ModelShape, *, liger_kernels: bool = False) -> int:
    """The same for a Gated-DeltaNet layer, LoRA aside (an approximation, not checked against flash-linear-attention's
    kernels): the two norms; the short convolution's input and output and the normalised q, k and v (6 bytes × the
    convolution's width); the chunked delta rule's gates (fp32 per value head); the gated norm's fp32 input, its gate
    and its output (8 bytes × the value width); the MLP."""
    linear = shape.linear_attention
    norm = 2 if liger_kernels else 4
    mixer = 6 * linear.conv_dim + 8 * linear.value_dim + 8 * linear.value_heads
    return 2 * norm * shape.hidden_size + mixer + _mlp_bytes(shape, liger_kernels)


def _mlp_bytes(shape: ModelShape, liger_kernels: bool) -> int:
    return (2 if liger_kernels else 3) * 2 * shape.intermediate_size


def lora_activation_bytes(shape: ModelShape, rank: int, dropout: float) -> int:
    """Bytes one token leaves saved for backward by every adapted layer together (all layers): PEFT computes
    `lora_B(lora_A(dropout(x)))` on its own copy of the layer's input (cast to the adapter's dtype, then by autocast
    to bf16: 2 bytes per input value, even without dropout), the bool dropout mask when dropout > 0 (1 byte), and
    lora_A's rank-wide output, which lora_B keeps (bf16)."""
    mask = shape.lora_in_features if dropout > 0 else 0
    return 2 * shape.lora_in_features + mask + 2 * rank * shape.lora_modules


def activations_bytes(shape: ModelShape, *, batch_size: int, seq_len: int, lora_rank: int, lora_dropout: float,
                      checkpointing: bool, liger_kernels: bool = False, bf16: bool = True) -> int:
    """Activations of one micro-batch at the start of backward, when they are all held. Without checkpointing: every
    layer's saved activations (`attention_layer_bytes`, `linear_attention_layer_bytes`) and the adapted layers' copies
    (`lora_activation_bytes`), plus one layer more for the gradients of the layer being back-propagated. With it:
    each layer's bf16 input (2 bytes × hidden), plus one layer recomputed with its gradients. Also the final norm and
    transformers' bool attention mask (batch × seq², shared by the layers). In fp32 (no bf16) twice as much."""
    tokens = batch_size * seq_len
    attention = attention_layer_bytes(shape, liger_kernels=liger_kernels)
    linear = linear_attention_layer_bytes(shape, liger_kernels=liger_kernels) if shape.linear_attention else 0
    lora_per_layer = lora_activation_bytes(shape, lora_rank, lora_dropout) // shape.layers
    largest = max(attention, linear) + lora_per_layer
    if checkpointing:
        per_token = shape.layers * 2 * shape.hidden_size + 2 * largest
    else:
        per_token = (shape.attention_layers * attention + shape.linear_attention_layers * linear
                     + lora_activation_bytes(shape, lora_rank, lora_dropout) + largest)
    per_token += (2 if liger_kernels else 4) * shape.hidden_size  # the final norm
    total = tokens * per_token + batch_size * seq_len * seq_len
    return total if bf16 else 2 * total


def logits_bytes(shape: ModelShape, *, batch_size: int, seq_len: int, fused_lm_head: bool, quantization: str) -> int:
    """The LM head's memory at its peak (its backward, at the start of the model's). TRL's fused head: per token the
    saved hidden state and the fp32 gradient of it (`FUSED_HEAD_BYTES_PER_TOKEN_AND_HIDDEN`) and its fp32 statistics,
    plus one bf16 tile of 4096 tokens × 32768 vocabulary entries, plus a bf16 copy of a vocabulary chunk of the head's
    weight when it is not bf16 (fp32 on a 4-bit base). Not fused: the whole (tokens × vocab) logits,
    `UNFUSED_LOGIT_BYTES` each."""
    tokens = batch_size * seq_len
    if not fused_lm_head:
        return tokens * shape.vocab_size * UNFUSED_LOGIT_BYTES
    vocab_chunk = min(shape.vocab_size, FUSED_HEAD_VOCAB_CHUNK)
    total = (tokens * (FUSED_HEAD_BYTES_PER_TOKEN_AND_HIDDEN * shape.hidden_size + FUSED_HEAD_BYTES_PER_TOKEN)
             + min(tokens, FUSED_HEAD_TOKEN_CHUNK) * vocab_chunk * 2)
    if quantization == "4bit":
        total += vocab_chunk * shape.hidden_size * 2
    return total


def kv_bytes_per_token(shape: ModelShape) -> int:
    """Keys and values of one token in every full-attention layer (bf16)."""
    return 2 * shape.attention_layers * shape.kv_dim * KV_BYTES


def generation_bytes(shape: ModelShape, *, num_generations: int, seq_len: int) -> int:
    """GRPO without vLLM: transformers' `generate` on the training model for a round of `num_generations`
    completions: the KV cache of every sequence at full length (bf16), the Gated-DeltaNet state of each sequence,
    and the fp32 logits and probabilities of one decoding step."""
    state = shape.linear_attention_layers * shape.linear_attention.state_bytes() if shape.linear_attention else 0
    return num_generations * (seq_len * kv_bytes_per_token(shape) + state + 2 * 4 * shape.vocab_size)


def vllm_memory(shape: ModelShape, *, num_generations: int, seq_len: int) -> VllmBreakdown:
    """What a colocated vLLM 0.33 engine needs to generate a round of `num_generations` completions of up to
    `seq_len` tokens each at once:
    - its own bf16 copy of the weights;
    - the KV cache of every sequence, in whole blocks per full-attention layer. For a hybrid (Gated-DeltaNet) model,
      vLLM raises the block size until one layer's attention page holds a layer's recurrent state, and gives each
      sequence one such page per linear-attention layer (`Platform._align_hybrid_block_size`,
      `vllm/platforms/interface.py`);
    - its runtime: the activations of its profiling step (`VLLM_MAX_BATCHED_TOKENS` tokens through one layer's
      residual, projections, attention output and MLP), the sampler's fp32 logits and log-probabilities for every
      sequence, CUDA graphs (`VLLM_CUDA_GRAPH_BYTES`); at least `VLLM_MIN_RUNTIME_BYTES`."""
    sequences = max(num_generations, 1)
    per_token_layer = 2 * shape.kv_dim * KV_BYTES
    block = VLLM_BLOCK_TOKENS
    state_pages = 0
    if shape.linear_attention:
        state = shape.linear_attention.state_bytes()
        if state > block * per_token_layer:
            block = math.ceil(state / (per_token_layer * VLLM_BLOCK_TOKENS)) * VLLM_BLOCK_TOKENS
        state_pages = sequences * shape.linear_attention_layers * block * per_token_layer
    blocks_per_sequence = math.ceil(seq_len / block)
    kv = sequences * shape.attention_layers * blocks_per_sequence * block * per_token_layer
    step = VLLM_MAX_BATCHED_TOKENS * (4 * shape.hidden_size + 2 * (2 * shape.q_dim + 2 * shape.kv_dim)
                                      + 6 * shape.intermediate_size)
    sampler = sequences * shape.vocab_size * 4 * 2
    runtime = max(step + sampler + VLLM_CUDA_GRAPH_BYTES, VLLM_MIN_RUNTIME_BYTES)
    return VllmBreakdown(weights_bytes=shape.parameters * 2, kv_cache_bytes=kv, linear_attention_state_bytes=state_pages,
                         runtime_bytes=runtime, block_tokens=block)


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
    missing); `vllm_gpu_memory_utilization`, vLLM's share instead of the planned one.

    The plan, in order: vLLM's share is taken off the usable memory; gradient checkpointing goes off only when training
    without it is within `CHECKPOINTING_MARGIN` of what remains; 8-bit paged AdamW replaces torch AdamW only when memory
    is short; `fits` says whether the run fits with checkpointing on."""
    if algorithm not in ("sft", "grpo"):
        raise ValueError(f"algorithm {algorithm!r} is not one of 'sft', 'grpo'")
    if quantization not in ("none", "4bit"):
        raise ValueError(f"quantization {quantization!r} is not one of 'none', '4bit'")
    usable = usable_memory(gpu_memory_bytes)
    grpo = algorithm == "grpo"
    generations = num_generations or (batch_size if grpo else 0)

    def training(checkpointing: bool, eight_bit: bool, colocated: bool) -> MemoryBreakdown:
        return MemoryBreakdown(
            weights_bytes=weights_bytes(shape, quantization=quantization, bf16=bf16),
            adapter_bytes=adapter_bytes(shape, lora_rank, quantization=quantization, paged_adamw_8bit=eight_bit),
            lora_parameters=lora_parameters(shape, lora_rank),
            activations_bytes=activations_bytes(shape, batch_size=batch_size, seq_len=seq_len, lora_rank=lora_rank,
                                                lora_dropout=lora_dropout, checkpointing=checkpointing,
                                                liger_kernels=liger_kernels, bf16=bf16),
            logits_bytes=logits_bytes(shape, batch_size=batch_size, seq_len=seq_len, fused_lm_head=fused_lm_head,
                                      quantization=quantization),
            generation_bytes=generation_bytes(shape, num_generations=generations, seq_len=seq_len) if grpo and not colocated else 0,
        )

    reasons: dict[str, str] = {}
    # vLLM first: its share is taken off what training may use.
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
        leanest = training(True, paged_adamw_8bit is not False, True).total_bytes
        if vllm_gpu_memory_utilization is not None:
            colocate, share = True, vllm_gpu_memory_utilization
            reasons["vllm_colocate"] = (f"colocated with a forced {share:.2f} of the GPU (~{gib(share * gpu_memory_bytes)}; "
                                        f"~{gib(needed)} estimated for rounds of {generations} completions)")
        elif needed + leanest > usable:
            colocate, vllm = False, None
            reasons["vllm_colocate"] = (f"vLLM needs ~{gib(needed)} beside training's ~{gib(leanest)} at its leanest, over "
                                        f"the {gib(usable)} usable: completions come from the training model's generate")
        else:
            colocate = True
            share = math.ceil(needed / gpu_memory_bytes * 100) / 100
            reasons["vllm_colocate"] = (f"colocated with {share:.2f} of the GPU (~{gib(needed)} for rounds of {generations} "
                                        f"completions of {seq_len} tokens)")
        if colocate:
            vllm_bytes = int(share * gpu_memory_bytes)
    # Counted as held throughout: sleep mode frees most of it between generations, so this errs toward saving memory.
    budget = usable - vllm_bytes

    without = training(False, bool(paged_adamw_8bit), colocate)
    if gradient_checkpointing is not None:
        checkpointing = gradient_checkpointing
        reasons["gradient_checkpointing"] = (f"forced {'on' if checkpointing else 'off'} for this run (~{gib(without.total_bytes)} "
                                             f"estimated without it, {gib(budget)} available)")
    elif without.total_bytes <= CHECKPOINTING_MARGIN * budget:
        checkpointing = False
        reasons["gradient_checkpointing"] = (f"not needed: ~{gib(without.total_bytes)} estimated without it, within "
                                             f"{CHECKPOINTING_MARGIN:.0%} of the {gib(budget)} available")
    else:
        checkpointing = True
        recomputed = training(True, bool(paged_adamw_8bit), colocate)
        reasons["gradient_checkpointing"] = (f"~{gib(without.total_bytes)} estimated without it, over {CHECKPOINTING_MARGIN:.0%} "
                                             f"of the {gib(budget)} available: recomputing activations brings it to "
                                             f"~{gib(recomputed.total_bytes)}")

    with_adamw = training(checkpointing, False, colocate)
    if paged_adamw_8bit is not None:
        eight_bit = paged_adamw_8bit
        reasons["paged_adamw_8bit"] = f"forced {'on' if eight_bit else 'off'} for this run"
    elif with_adamw.total_bytes <= budget:
        eight_bit = False
        reasons["paged_adamw_8bit"] = f"not needed: ~{gib(with_adamw.total_bytes)} estimated with torch AdamW, {gib(budget)} available"
    else:
        eight_bit = True
        reasons["paged_adamw_8bit"] = f"memory is short: ~{gib(with_adamw.total_bytes)} estimated with torch AdamW, {gib(budget)} available"

    forced = [name for name, value in (("gradient_checkpointing", gradient_checkpointing),
                                       ("paged_adamw_8bit", paged_adamw_8bit),
                                       ("vllm_gpu_memory_utilization", vllm_gpu_memory_utilization if colocate else None))
              if value is not None]
    chosen = training(checkpointing, eight_bit, colocate).model_copy(update={"vllm_bytes": vllm_bytes})
    with_checkpointing = training(True, eight_bit, colocate).total_bytes + vllm_bytes
    without_checkpointing = training(False, eight_bit, colocate).total_bytes + vllm_bytes
    if chosen.total_bytes > usable:
        reasons["gradient_checkpointing"] += (f"; as planned still ~{gib(chosen.total_bytes - vllm_bytes)}: expect "
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
    `fast_paths`, as `fast_paths.plan_fast_paths` ranks them): how the control plane judges a GPU before renting it.
    Liger's smaller activations are not counted, so the estimate errs high."""
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
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loraflow_worker.memory_plan",
        description="Print the memory plan of a LoRA run as one JSON object (GiB = 2^30 bytes).",
    )
    parser.add_argument("model_dir", type=Path, help="A model folder, or a folder holding only its config.json.")
    parser.add_argument("--algorithm", choices=("sft", "grpo"), default="sft")
    parser.add_argument("--batch-size", type=int, required=True, help="Sequences per micro-batch (GRPO: completions).")
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
        )
    except ValueError as e:
        print(f"memory_plan: {e}", file=sys.stderr)
        return 2
    print(json.dumps({**plan.model_dump(mode="json"), "model": shape.model_dump(mode="json")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
