"""GPU bytes of each part of a LoRA run, estimated from the model's shape: the terms `plan.plan_memory` adds up.

What is counted, per micro-batch of `batch_size` sequences of `seq_len` tokens (the bytes of each term are stated
where it is computed; every figure is an estimate until a GPU measures it):
- the frozen base weights: 2 bytes a parameter in bf16; with `quantization="4bit"` (QLoRA) the blocks' linear weights
  in nf4 with double quantization (`NF4_BYTES_PER_PARAMETER`) and everything else in fp32, as
  `peft.prepare_model_for_kbit_training` leaves it;
- the LoRA adapter (rank r on every linear layer of the blocks, the contract's default `all-linear`; DoRA's
  magnitudes) with its gradient and the state of the run's optimizer (`OPTIMIZER_STATES`);
- the full trainable copies of `lora.modules_to_save` (the LM head, the input embeddings), with theirs, in fp32 (the
  worker keeps every trainable tensor in fp32, `training.run.keep_trainable_in_fp32`);
- the activations saved for backward, with and without gradient checkpointing, including the input copy each adapted
  layer keeps for `lora_A(dropout(x))`, the dropout mask, DoRA's kept outputs and weight, and the bf16 copy of the
  attention mask each attention layer hands SDPA; on a 4-bit base the residual stream and the projections' outputs
  in fp32 (`KBIT_STREAM_BYTES`);
- the LM head as TRL 1.16 computes it: its fused, chunked log-probability head (both trainers add it with
  `add_fused_lm_head` and never build the `(batch, seq, vocab)` logits), or the full logits when not fused; and,
  when the head trains (`lora.modules_to_save`), the fp32 buffer its backward accumulates the head's gradient in;
- for GRPO with vLLM colocated, vLLM's share: its weights, the KV cache (and Gated-DeltaNet state) of a whole
  generation round, its runtime, held while it generates; asleep during training, only what its sleep keeps
  (`VLLM_ASLEEP_BYTES`); for GRPO without vLLM, the training model's own generation cache.
CUDA's own memory and a headroom are taken off the GPU's memory by the plan (`plan.usable_memory`), not here.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, Field, computed_field

from loraflow_worker.memory.model_shape import KV_BYTES, ModelShape

GIB = 2**30


# ---- Weights -------------------------------------------------------------------------------------------------------
NF4_BYTES_PER_PARAMETER = 0.5 + 1 / 64 + 4 / (64 * 256)
"""A 4-bit linear weight in bitsandbytes' nf4 with double quantization (`Params4bit`, blocksize 64): half a byte for
the value, one 8-bit absmax per block of 64 values, and one fp32 absmax of those per 256 blocks (≈ 0.5159 bytes)."""
KBIT_OTHER_BYTES = 4
"""What `peft.prepare_model_for_kbit_training` makes of every weight it does not quantize (embeddings, LM head, norms,
biases): fp32, for stable training of a 4-bit base (PEFT 0.21, `utils/other.py`)."""
KBIT_STREAM_BYTES = 4
"""Bytes of a residual-stream value, and of a frozen projection's output, on a 4-bit base: the fp32 embeddings
`prepare_model_for_kbit_training` leaves start the stream in fp32, its fp32 RMSNorm weights keep it there, and
bitsandbytes' `Linear4bit.forward` casts its bf16 product back to its input's dtype (bitsandbytes 0.50,
`nn/modules.py`), so q, k, v and the MLP's gate and up come out in fp32; only SDPA, under bf16 autocast, runs in bf16.
On a bf16 base all of them are bf16 (2 bytes)."""

# ---- The adapter and its optimizer ---------------------------------------------------------------------------------
ADAPTER_BYTES = 4
"""Bytes of a LoRA parameter, and of its gradient: fp32 on every base. PEFT's `autocast_adapter_dtype` upcasts the
adapter of a bf16 base; TRL 1.16 casts that of a 4-bit base to bf16 (`SFTTrainer.__init__`, after the QLoRA paper), and
the worker puts it back in fp32 (`training.run.keep_trainable_in_fp32`)."""
SAVED_MODULE_BYTES = 4
"""Bytes of a parameter of a `lora.modules_to_save` copy, and of its gradient: fp32 on every base. PEFT deep-copies the
module in the base's dtype (bf16, or fp32 on a 4-bit base, which TRL 1.16 then casts to bf16); the worker puts the
copy in fp32 (`training.run.keep_trainable_in_fp32`): in bf16 a small learning rate's update rounds away."""
OPTIMIZER_STATES: dict[str, tuple[int, int | None]] = {
    "adamw_torch": (2, None), "adamw_torch_fused": (2, None),
    "adafactor": (0, None),
    "sgd": (0, None), "adagrad": (1, None), "rmsprop": (1, None),
    "adamw_bnb_8bit": (2, 1), "adamw_8bit": (2, 1), "paged_adamw_8bit": (2, 1), "paged_adamw_32bit": (2, 4),
    "ademamix": (3, 4), "paged_ademamix_32bit": (3, 4), "ademamix_8bit": (3, 1), "paged_ademamix_8bit": (3, 1),
    "lion_32bit": (1, 4), "paged_lion_32bit": (1, 4), "lion_8bit": (1, 1), "paged_lion_8bit": (1, 1),
    "rmsprop_bnb": (1, 4), "rmsprop_bnb_32bit": (1, 4), "rmsprop_bnb_8bit": (1, 1),
}
"""Per trained parameter, for each `training.optimizer`: the state values the optimizer keeps and the bytes of each
(None: the parameter's own dtype, as torch's optimizers keep `zeros_like(param)`). AdamW keeps exp_avg and exp_avg_sq;
AdEMAMix a second, slow exp_avg besides; Lion one momentum; Adagrad and RMSprop one sum of squares; transformers builds
SGD and RMSprop without momentum; Adafactor a factored second moment (a row and a column per matrix: counted as none).
bitsandbytes keeps 8-bit states in one byte a value (its per-block absmax aside) and its 32-bit ones in fp32."""
TORCH_ADAMW = "adamw_torch_fused"
"""The optimizer the memory plan counts when it chooses torch AdamW (fused or not, the same state)."""
EIGHT_BIT_ADAMW = "paged_adamw_8bit"
"""The optimizer the memory plan chooses when memory is short."""
HEAD_MODULES = frozenset({"lm_head", "embed_out", "output"})
EMBEDDING_MODULES = frozenset({"embed_tokens", "wte", "embed_in", "word_embeddings"})
"""`lora.modules_to_save` names the planner can size from a config: the LM head and the input embeddings, each
vocabulary × hidden. Others (a norm, a block's layer) are counted as nothing."""


def trained_parameter_bytes(optimizer: str, parameter_bytes: int, *, embedding: bool = False) -> int:
    """Bytes a trained parameter of `parameter_bytes` holds with its gradient and `optimizer`'s state. bitsandbytes'
    8-bit optimizers keep an embedding's state in 32 bits (transformers' `Trainer.create_optimizer`, and PEFT's
    LoRA+ optimizer, register the override)."""
    states, state_bytes = OPTIMIZER_STATES[optimizer]
    if state_bytes is None:
        state_bytes = parameter_bytes
    elif embedding and state_bytes == 1:
        state_bytes = 4
    return 2 * parameter_bytes + states * state_bytes


def lora_parameters(shape: ModelShape, rank: int, *, use_dora: bool = False) -> int:
    """Trainable parameters of a rank-`rank` LoRA on every linear layer of the blocks (`all-linear`; fewer target
    modules need less): A is rank × in, B is out × rank; DoRA adds a magnitude per output (PEFT's
    `lora_magnitude_vector`)."""
    return rank * (shape.lora_in_features + shape.lora_out_features) + (shape.lora_out_features if use_dora else 0)


def adapter_bytes(shape: ModelShape, rank: int, *, optimizer: str, use_dora: bool = False) -> int:
    """LoRA weights (with DoRA's magnitudes), gradients and optimizer state."""
    return lora_parameters(shape, rank, use_dora=use_dora) * trained_parameter_bytes(optimizer, ADAPTER_BYTES)


def saved_module_parameters(shape: ModelShape, name: str) -> int:
    """Parameters of the module `lora.modules_to_save` names (matched by its last part, as PEFT matches it): the LM
    head's or the input embeddings' vocabulary × hidden; 0 for a module the planner cannot size."""
    last = name.rsplit(".", 1)[-1]
    return shape.vocab_size * shape.hidden_size if last in HEAD_MODULES | EMBEDDING_MODULES else 0


def modules_to_save_bytes(shape: ModelShape, modules: tuple[str, ...] | list[str], *, optimizer: str) -> int:
    """The full trainable copies `lora.modules_to_save` makes (PEFT's `ModulesToSaveWrapper` deep-copies the module;
    the frozen original stays, counted with the weights): each copy's weights (`SAVED_MODULE_BYTES`), their gradients
    in the same dtype and the optimizer's state (torch's optimizers keep it in the weight's dtype: fp32 states for an
    fp32 copy)."""
    return sum(saved_module_parameters(shape, name) * trained_parameter_bytes(
        optimizer, SAVED_MODULE_BYTES, embedding=name.rsplit(".", 1)[-1] in EMBEDDING_MODULES) for name in modules)


def head_gradient_bytes(shape: ModelShape, modules: tuple[str, ...] | list[str], *, fused_lm_head: bool) -> int:
    """What the backward of TRL's fused head holds besides the gradient counted with a trained LM head
    (`lora.modules_to_save` naming it): `ChunkedLogProbFunction.backward` (`trl/kernels/chunked_logprob.py`)
    accumulates the head's weight gradient over its tiles in an fp32 buffer of the head's whole size (vocabulary ×
    hidden × 4 bytes: 2.3 GiB for Qwen3-8B's 151,936 × 4,096), then returns it cast to the head's dtype, which for the
    fp32 copy (`SAVED_MODULE_BYTES`) is the buffer itself. Counted in full at the start of the model's backward, with every activation held: on the
    first micro-batch of a step autograd may keep the returned tensor as the gradient, but on the others it comes on
    top of the gradient accumulated so far. Not fused, autograd writes the head's gradient in its own dtype: nothing
    besides the gradient. 0 when the head does not train."""
    if not fused_lm_head or not any(name.rsplit(".", 1)[-1] in HEAD_MODULES for name in modules):
        return 0
    return shape.vocab_size * shape.hidden_size * 4


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
VLLM_ASLEEP_BYTES = VLLM_CUDA_GRAPH_BYTES
"""What a colocated vLLM keeps while asleep: sleep level 2 frees only what vLLM 0.33 allocated in its sleep-mode pool
(`CuMemAllocator`, tags `weights` and `kv_cache`), so its CUDA graphs, captured into torch's own pool, stay (the
same allowance as `VLLM_CUDA_GRAPH_BYTES`, not a measurement)."""
VLLM_BLOCK_TOKENS = 16
"""Tokens per KV-cache block (vLLM's default block size, and the alignment its FlashAttention backend asks for)."""


class MemoryBreakdown(BaseModel):
    """Estimated GPU bytes by what holds them, for one configuration (checkpointing on or off, an optimizer)."""

    weights_bytes: int = Field(description="The frozen base weights (bf16, or 4-bit with fp32 for the rest).")
    adapter_bytes: int = Field(description="LoRA weights, their gradients and the optimizer's state.")
    lora_parameters: int = Field(description="Trainable LoRA parameters (rank r on every linear layer of the blocks), "
                                 "DoRA's magnitudes included.")
    modules_to_save_bytes: int = Field(
        default=0, description="The full trainable copies of `lora.modules_to_save`: weights, gradients and the "
        "optimizer's state.")
    activations_bytes: int = Field(
        description="Activations saved for backward of one micro-batch, PEFT's input copies and dropout masks included, "
        "with the gradients of the layer being back-propagated."
    )
    logits_bytes: int = Field(description="The LM head's working memory (TRL's fused head, or the full logits).")
    head_gradient_bytes: int = Field(
        default=0, description="A trained LM head (`lora.modules_to_save`): the fp32 buffer TRL's fused head accumulates "
        "its gradient in during backward, and the cast to a bf16 head's dtype.")
    generation_bytes: int = Field(
        default=0,
        description="GRPO without vLLM: the training model's KV cache and logits while it generates a round (held at a "
        "different time than the activations: the larger of the two counts).",
    )
    vllm_bytes: int = Field(default=0, description="vLLM's share of the GPU, when colocated: held while it generates "
                            "a round, when training holds no activations.")
    vllm_asleep_bytes: int = Field(default=0, description="What a colocated vLLM keeps asleep, while training steps.")

    @computed_field
    @property
    def total_bytes(self) -> int:
        """The peak: what stays (weights, adapter, modules to save) plus the largest of what comes and goes, training's
        backward (with what vLLM keeps asleep), the training model's own generation, or vLLM's share generating."""
        stays = self.weights_bytes + self.adapter_bytes + self.modules_to_save_bytes
        backward = self.activations_bytes + self.logits_bytes + self.head_gradient_bytes + self.vllm_asleep_bytes
        return stays + max(backward, self.generation_bytes, self.vllm_bytes)


class VllmBreakdown(BaseModel):
    """vLLM's share of the GPU, by what holds it."""

    weights_bytes: int = Field(description="vLLM's own bf16 copy of the weights.")
    kv_cache_bytes: int = Field(description="KV cache of a whole generation round, in whole blocks.")
    linear_attention_state_bytes: int = Field(description="Gated-DeltaNet state of the round's sequences, in KV-cache pages.")
    runtime_bytes: int = Field(description="Activations of its profiling step, the sampler and CUDA graphs (floored).")
    block_tokens: int = Field(description="Tokens per KV-cache block (raised for hybrid models to fit a layer's state in a page).")


def weights_bytes(shape: ModelShape, *, quantization: str, bf16: bool = True) -> int:
    """The frozen base weights: 2 bytes a parameter in bf16 (4 in fp32); with 4-bit, the quantizable weights in nf4
    with double quantization and the rest in fp32 (`prepare_model_for_kbit_training`)."""
    if quantization == "4bit":
        rest = shape.parameters - shape.quantizable_parameters
        return math.ceil(shape.quantizable_parameters * NF4_BYTES_PER_PARAMETER) + rest * KBIT_OTHER_BYTES
    return shape.parameters * (2 if bf16 else 4)


def stream_bytes(quantization: str) -> int:
    """Bytes of a residual-stream value and of a frozen projection's output: fp32 on a 4-bit base
    (`KBIT_STREAM_BYTES`), else bf16."""
    return KBIT_STREAM_BYTES if quantization == "4bit" else 2


def attention_layer_bytes(shape: ModelShape, *, liger_kernels: bool = False, quantization: str = "none") -> int:
    """Bytes one token leaves saved for backward in one full-attention layer of a frozen base, LoRA aside (`s`: the
    stream's bytes, `stream_bytes`):
    - the input and post-attention RMSNorms: transformers' saves an fp32 copy of its input (4 bytes × hidden; on an
      fp32 stream the input itself), Liger's its input (s); neither keeps its output, since the norm's weight is
      frozen;
    - Qwen3's q and k norms, likewise over the query and key widths;
    - attention: q, k and v with k and v repeated to every query head (transformers repeats them for SDPA whenever a
      padding mask is passed, `integrations/sdpa_attention.py`), and the output, in bf16 (SDPA runs under bf16
      autocast whatever the stream); the fp32 log-sum-exp per head;
    - Qwen3.5's output gate: the sigmoid's output (s: it comes from q_proj) and the bf16 attention output it multiplies;
    - the SwiGLU MLP: the gate and up projections' outputs and, without Liger (which recomputes it), the SiLU's output
      (s each).
    The frozen linear layers keep nothing: backward through them needs only their weights (bitsandbytes' 4-bit matmul
    keeps only the packed weight)."""
    stream = stream_bytes(quantization)
    norm = stream if liger_kernels else 4
    total = 2 * norm * shape.hidden_size
    if shape.qk_norm:
        total += norm * (shape.q_dim + shape.kv_dim)
    total += 2 * 4 * shape.q_dim + 4 * shape.attention_heads
    if shape.attention_output_gate:
        total += (stream + 2) * shape.q_dim
    return total + _mlp_bytes(shape, liger_kernels, stream)


def linear_attention_layer_bytes(shape: ModelShape, *, liger_kernels: bool = False, quantization: str = "none") -> int:
    """The same for a Gated-DeltaNet layer, LoRA aside (an approximation, not checked against flash-linear-attention's
    kernels): the two norms; the short convolution's input (a projection's output: s bytes), its output and the
    normalised q, k and v (2 bytes each) over the convolution's width; the chunked delta rule's gates (fp32 per value
    head); the gated norm's fp32 input, its gate (a projection's output: s) and its bf16 output over the value width;
    the MLP."""
    linear = shape.linear_attention
    stream = stream_bytes(quantization)
    norm = stream if liger_kernels else 4
    mixer = (stream + 4) * linear.conv_dim + (6 + stream) * linear.value_dim + 8 * linear.value_heads
    return 2 * norm * shape.hidden_size + mixer + _mlp_bytes(shape, liger_kernels, stream)


def _mlp_bytes(shape: ModelShape, liger_kernels: bool, stream: int) -> int:
    return (2 if liger_kernels else 3) * stream * shape.intermediate_size


def lora_activation_bytes(shape: ModelShape, rank: int, dropout: float, *, use_dora: bool = False) -> int:
    """Bytes one token leaves saved for backward by every adapted layer together (all layers): PEFT computes
    `lora_B(lora_A(dropout(x)))` on its own copy of the layer's input (cast to the adapter's dtype, then by autocast
    to bf16: 2 bytes per input value, even without dropout), the bool dropout mask when dropout > 0 (1 byte), and
    lora_A's rank-wide output, which lora_B keeps (bf16). DoRA (PEFT's `DoraLinearLayer.forward`) scales the base
    output and the LoRA output by the magnitude over the weight's norm, so both (bf16, the layer's output width) are
    kept for the magnitude's gradient."""
    mask = shape.lora_in_features if dropout > 0 else 0
    dora = 2 * 2 * shape.lora_out_features if use_dora else 0
    return 2 * shape.lora_in_features + mask + 2 * rank * shape.lora_modules + dora


def dora_weight_bytes(shape: ModelShape) -> int:
    """DoRA's transient in each adapted layer's forward: the fp32 product B·A and the bf16 weight W + B·A whose column
    norms it takes (PEFT's `get_weight_norm`), for the largest linear layer (the MLP's, or a gated `q_proj`): 6 bytes a
    weight, freed before the next layer."""
    q_width = shape.q_dim * (2 if shape.attention_output_gate else 1)
    return 6 * shape.hidden_size * max(shape.intermediate_size, q_width)


def sdpa_mask_bytes(batch_size: int, seq_len: int) -> int:
    """The additive mask one attention layer hands SDPA and keeps for backward: torch converts transformers' bool
    mask to the query's dtype (bf16) on every call (`convert_boolean_attn_mask`), and the memory-efficient kernel
    saves that copy (batch × seq² × 2 bytes)."""
    return batch_size * seq_len * seq_len * 2


def activations_bytes(shape: ModelShape, *, batch_size: int, seq_len: int, lora_rank: int, lora_dropout: float,
                      checkpointing: bool, liger_kernels: bool = False, bf16: bool = True, use_dora: bool = False,
                      quantization: str = "none") -> int:
    """Activations of one micro-batch at the start of backward, when they are all held. Without checkpointing: every
    layer's saved activations (`attention_layer_bytes`, `linear_attention_layer_bytes`), each attention layer's own
    copy of the SDPA mask (`sdpa_mask_bytes`), and the adapted layers' copies (`lora_activation_bytes`), plus one
    layer more for the gradients of the layer being back-propagated. With it: each layer's input (the stream's bytes
    × hidden: 2, or 4 on a 4-bit base), plus one layer recomputed with its gradients and its mask copy. Also the
    final norm and transformers' bool attention mask (batch × seq², shared by the layers). In fp32 (no bf16) twice as
    much. DoRA keeps more per adapted layer (`lora_activation_bytes`) and builds one layer's weight at a time
    (`dora_weight_bytes`)."""
    tokens = batch_size * seq_len
    stream = stream_bytes(quantization)
    attention = attention_layer_bytes(shape, liger_kernels=liger_kernels, quantization=quantization)
    linear = (linear_attention_layer_bytes(shape, liger_kernels=liger_kernels, quantization=quantization)
              if shape.linear_attention else 0)
    lora = lora_activation_bytes(shape, lora_rank, lora_dropout, use_dora=use_dora)
    lora_per_layer = lora // shape.layers
    largest = max(attention, linear) + lora_per_layer
    if checkpointing:
        per_token = shape.layers * stream * shape.hidden_size + 2 * largest
        masks = 1
    else:
        per_token = (shape.attention_layers * attention + shape.linear_attention_layers * linear
                     + lora + largest)
        masks = shape.attention_layers
    per_token += (stream if liger_kernels else 4) * shape.hidden_size  # the final norm
    total = (tokens * per_token + batch_size * seq_len * seq_len + masks * sdpa_mask_bytes(batch_size, seq_len)
             + (dora_weight_bytes(shape) if use_dora else 0))
    return total if bf16 else 2 * total


def logits_bytes(shape: ModelShape, *, batch_size: int, seq_len: int, fused_lm_head: bool, quantization: str) -> int:
    """The LM head's memory at its peak (its backward, at the start of the model's). TRL's fused head: per token the
    saved hidden state and the fp32 gradient of it (`FUSED_HEAD_BYTES_PER_TOKEN_AND_HIDDEN`; on a 4-bit base the
    hidden state it saves, as given, is fp32: 2 bytes more) and its fp32 statistics, plus one bf16 tile of 4096 tokens
    × 32768 vocabulary entries, plus a bf16 copy of a vocabulary chunk of the head's weight when it is not bf16 (fp32
    on a 4-bit base). Not fused: the whole (tokens × vocab) logits, `UNFUSED_LOGIT_BYTES` each."""
    tokens = batch_size * seq_len
    if not fused_lm_head:
        return tokens * shape.vocab_size * UNFUSED_LOGIT_BYTES
    vocab_chunk = min(shape.vocab_size, FUSED_HEAD_VOCAB_CHUNK)
    per_hidden = FUSED_HEAD_BYTES_PER_TOKEN_AND_HIDDEN + stream_bytes(quantization) - 2
    total = (tokens * (per_hidden * shape.hidden_size + FUSED_HEAD_BYTES_PER_TOKEN)
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
