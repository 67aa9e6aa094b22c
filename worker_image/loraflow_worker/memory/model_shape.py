"""The base model's shape: its size and the dimensions the memory estimates need, from its `config.json` alone
(`shape_from_config`), refined by its safetensors headers when its folder has them (`read_model_shape`). No weight is
read, and nothing but pydantic is imported: the control plane sizes a model here before renting a GPU for it."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

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
