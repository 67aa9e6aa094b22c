"""The memory plan (`memory/`: model_shape.py, estimates.py, plan.py): the model's size from its config.json alone, the bytes it assumes for named
shapes (Qwen3-0.6B, Qwen3-4B, Llama-3.1-8B at 2k and 4k tokens; Llama-3.1-8B in 4 bits), the decisions it takes, and its CLI.

The shapes are the models' public config.json files (`model_configs/`). Every byte figure below is written out, with
where it comes from, so a change to the planner's arithmetic shows up here as a changed number."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3_5TextConfig, Qwen3MoeConfig

from loraflow_worker.memory.estimates import (
    GIB,
    NF4_BYTES_PER_PARAMETER,
    VLLM_ASLEEP_BYTES,
    activations_bytes,
    sdpa_mask_bytes,
    vllm_memory,
)
from loraflow_worker.memory.model_shape import LinearAttentionShape, read_model_shape, shape_from_config
from loraflow_worker.contract import JobInput
from loraflow_worker.memory.plan import plan_job, plan_memory, usable_memory

CONFIGS = Path(__file__).parent / "model_configs"


@dataclass(frozen=True)
class Named:
    """A named model's figures, worked out by hand from its config.json."""

    folder: str
    parameters: int
    """Its published parameter count (tied embeddings once)."""
    layers: int
    hidden: int
    layer_bytes: int
    """Bytes one token leaves saved in one layer, LoRA aside, with transformers' RMSNorm and MLP (no Liger):
    8·hidden (two norms, fp32 copies) + 4·(q + kv widths) (Qwen3's q/k norms, fp32) + 8·q width (q, k and v
    repeated to every head, and the output, bf16) + 4·heads (fp32 log-sum-exp) + 6·intermediate (SwiGLU: gate, up and
    SiLU outputs, bf16)."""
    lora_layer_bytes: int
    """Bytes one token leaves saved in one layer by rank-16 LoRA on every linear layer with dropout 0.05: 2 bytes per
    input value for PEFT's copy of each adapted layer's input, 1 byte for its dropout mask, 2·16 bytes for each of the
    7 layers' lora_A outputs."""
    lora_parameters: int
    """Rank-16 LoRA parameters on every linear layer: 16 × Σ (in + out)."""


QWEN3_0_6B = Named("qwen3-0.6b", 596_049_920, 28, 1024,
                   layer_bytes=8 * 1024 + 4 * (2048 + 1024) + 8 * 2048 + 4 * 16 + 6 * 3072,  # 55,360
                   lora_layer_bytes=3 * (3 * 1024 + 2048 + 2 * 1024 + 3072) + 2 * 16 * 7,  # 30,944: inputs 10,240 values
                   lora_parameters=16 * 28 * ((1024 + 2048) + 2 * (1024 + 1024) + (2048 + 1024) + 3 * (1024 + 3072)))
QWEN3_4B = Named("qwen3-4b", 4_022_468_096, 36, 2560,
                 layer_bytes=8 * 2560 + 4 * (4096 + 1024) + 8 * 4096 + 4 * 32 + 6 * 9728,  # 132,224
                 lora_layer_bytes=3 * (3 * 2560 + 4096 + 2 * 2560 + 9728) + 2 * 16 * 7,  # 80,096
                 lora_parameters=16 * 36 * ((2560 + 4096) + 2 * (2560 + 1024) + (4096 + 2560) + 3 * (2560 + 9728)))
LLAMA_3_1_8B = Named("llama-3.1-8b", 8_030_261_248, 32, 4096,
                     layer_bytes=8 * 4096 + 8 * 4096 + 4 * 32 + 6 * 14336,  # 151,680: no q/k norms
                     lora_layer_bytes=3 * (3 * 4096 + 4096 + 2 * 4096 + 14336) + 2 * 16 * 7,  # 116,960
                     lora_parameters=16 * 32 * ((4096 + 4096) + 2 * (4096 + 1024) + (4096 + 4096) + 3 * (4096 + 14336)))
NAMED = [QWEN3_0_6B, QWEN3_4B, LLAMA_3_1_8B]
TOKENS = [2048, 4096]
"""Sequence lengths the named shapes are sized at, one sequence each."""


def _shape(named: Named):
    return read_model_shape(CONFIGS / named.folder)


def _plan(named: Named, seq_len: int, **more):
    return plan_memory(_shape(named), **{"algorithm": "sft", "batch_size": 1, "seq_len": seq_len, "lora_rank": 16,
                                         "lora_dropout": 0.05, "gpu_memory_bytes": 80 * GIB, **more})


def _cli(folder: Path, *args: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "loraflow_worker.memory.plan", str(folder), *args],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.parametrize("folder, parameters", [
    ("qwen3-0.6b", 596_049_920), ("qwen3-4b", 4_022_468_096), ("llama-3.1-8b", 8_030_261_248),
    ("llama-3.1-70b", 70_553_706_496),
])
def test_the_parameter_count_from_config_json_is_the_published_one(folder, parameters):
    assert read_model_shape(CONFIGS / folder).parameters == parameters


@pytest.mark.parametrize("config", [
    LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, tie_word_embeddings=False, attention_bias=True),
    Qwen3_5TextConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8,
                      linear_num_key_heads=2, linear_num_value_heads=4, full_attention_interval=2),
    Qwen3MoeConfig(vocab_size=100, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_experts=4,
                   num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8),
], ids=["llama-untied-with-biases", "qwen3_5-gated-deltanet", "qwen3_moe"])
def test_the_shape_counts_what_transformers_builds_from_the_same_config(config):
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shape = shape_from_config(config.to_dict())
    linears = [m for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear)]
    assert shape.parameters == sum(p.numel() for p in model.parameters())
    assert shape.quantizable_parameters == sum(m.weight.numel() for m in linears)
    assert (shape.lora_modules, shape.lora_in_features, shape.lora_out_features) == (
        len(linears), sum(m.in_features for m in linears), sum(m.out_features for m in linears))


def test_a_model_folders_safetensors_headers_give_its_stored_parameters(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert read_model_shape(tiny_model_dir).parameters == sum(p.numel() for p in model.parameters())


def test_a_tied_lm_head_stored_in_the_checkpoint_is_counted_once(tiny_model_dir, tmp_path):
    # Qwen3-0.6B's checkpoint stores lm_head.weight although the config ties it to the embeddings.
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    (tmp_path / "config.json").write_text(json.dumps(config))
    header = {"lm_head.weight": {"dtype": "BF16", "shape": [512, 64], "data_offsets": [0, 65536]},
              "model.embed_tokens.weight": {"dtype": "BF16", "shape": [512, 64], "data_offsets": [65536, 131072]}}
    raw = json.dumps(header).encode()
    (tmp_path / "model.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(131072))
    assert read_model_shape(tmp_path).parameters == 512 * 64


@pytest.mark.parametrize("named", NAMED, ids=lambda n: n.folder)
def test_bf16_weights_are_two_bytes_a_parameter(named):
    assert _plan(named, 2048).breakdown.weights_bytes == named.parameters * 2


@pytest.mark.parametrize("named", NAMED, ids=lambda n: n.folder)
def test_the_adapter_with_adamw_is_sixteen_bytes_a_lora_parameter(named):
    breakdown = _plan(named, 2048).breakdown
    assert breakdown.lora_parameters == named.lora_parameters
    assert breakdown.adapter_bytes == named.lora_parameters * 16  # fp32 weight, gradient, exp_avg, exp_avg_sq


@pytest.mark.parametrize("seq_len", TOKENS)
@pytest.mark.parametrize("named", NAMED, ids=lambda n: n.folder)
def test_activations_without_checkpointing_are_every_layers_bytes_per_token(named, seq_len):
    per_layer = named.layer_bytes + named.lora_layer_bytes
    # Every layer, one layer more for the gradients being back-propagated, the final norm (fp32 copy), the bool mask,
    # and each layer's own bf16 copy of it, which SDPA keeps.
    expected = (seq_len * (named.layers * per_layer + per_layer + 4 * named.hidden) + seq_len * seq_len
                + named.layers * seq_len * seq_len * 2)
    assert activations_bytes(_shape(named), batch_size=1, seq_len=seq_len, lora_rank=16, lora_dropout=0.05,
                             checkpointing=False) == expected


@pytest.mark.parametrize("seq_len", TOKENS)
@pytest.mark.parametrize("named", NAMED, ids=lambda n: n.folder)
def test_activations_with_checkpointing_are_each_layers_input_and_one_recomputed_layer(named, seq_len):
    per_layer = named.layer_bytes + named.lora_layer_bytes
    # Each layer's bf16 input, one layer recomputed with its gradients, the final norm, the mask and the recomputed
    # layer's bf16 copy of it.
    expected = (seq_len * (named.layers * 2 * named.hidden + 2 * per_layer + 4 * named.hidden) + seq_len * seq_len
                + seq_len * seq_len * 2)
    assert activations_bytes(_shape(named), batch_size=1, seq_len=seq_len, lora_rank=16, lora_dropout=0.05,
                             checkpointing=True) == expected


@pytest.mark.parametrize("seq_len", TOKENS)
@pytest.mark.parametrize("named", NAMED, ids=lambda n: n.folder)
def test_trls_fused_lm_head_holds_six_bytes_per_token_and_hidden_unit_and_one_tile(named, seq_len):
    # Saved bf16 hidden state + its fp32 gradient, 32 bytes of fp32 statistics per token, one 4096 × 32768 bf16 tile.
    expected = seq_len * (6 * named.hidden + 32) + min(seq_len, 4096) * 32768 * 2
    assert _plan(named, seq_len).breakdown.logits_bytes == expected


@pytest.mark.parametrize("seq_len", TOKENS)
def test_unfused_logits_are_ten_bytes_per_token_and_vocabulary_entry(seq_len):
    # bf16 logits, transformers' fp32 copy for the loss, cross-entropy's saved fp32 log-softmax.
    assert _plan(QWEN3_0_6B, seq_len, fused_lm_head=False).breakdown.logits_bytes == seq_len * 151_936 * 10


def test_an_attention_layers_copy_of_the_sdpa_mask_is_two_bytes_per_query_and_key_pair():
    # torch converts the bool mask to the query's dtype (bf16) on each SDPA call; 8 × 2048 × 2048 × 2 bytes = 64 MiB.
    assert sdpa_mask_bytes(8, 2048) == 64 * 2**20


def test_lora_without_dropout_keeps_the_input_copies_but_no_masks():
    shape = _shape(QWEN3_0_6B)
    with_dropout = activations_bytes(shape, batch_size=1, seq_len=2048, lora_rank=16, lora_dropout=0.05, checkpointing=False)
    without = activations_bytes(shape, batch_size=1, seq_len=2048, lora_rank=16, lora_dropout=0.0, checkpointing=False)
    # One byte per adapted input value (10,240 per layer) in 28 layers and the gradient layer, per token.
    assert with_dropout - without == 2048 * 10_240 * (28 + 1)


def test_4bit_weights_are_nf4_with_double_quantization_and_the_rest_fp32():
    shape = read_model_shape(CONFIGS / "llama-3.1-70b")
    quantized = 68_451_041_280  # the 80 layers' linear weights
    rest = 70_553_706_496 - quantized  # embeddings, untied LM head, norms
    plan = plan_memory(shape, algorithm="sft", batch_size=1, seq_len=2048, lora_rank=16, lora_dropout=0.0,
                       gpu_memory_bytes=80 * GIB, quantization="4bit")
    assert NF4_BYTES_PER_PARAMETER == 0.5 + 1 / 64 + 4 / 16384
    assert plan.breakdown.weights_bytes == math.ceil(quantized * NF4_BYTES_PER_PARAMETER) + rest * 4


def test_a_4bit_adapter_trains_in_fp32_as_on_a_bf16_base_with_adamw_at_sixteen_bytes_a_parameter():
    # TRL casts a quantized base's adapter to bf16; the worker puts it back in fp32: weight, gradient, AdamW's two states.
    qlora, plain = _plan(LLAMA_3_1_8B, 2048, quantization="4bit"), _plan(LLAMA_3_1_8B, 2048)
    assert qlora.breakdown.adapter_bytes == plain.breakdown.adapter_bytes == LLAMA_3_1_8B.lora_parameters * 16


def test_on_a_4bit_base_the_checkpointed_inputs_and_the_mlps_outputs_are_fp32():
    # prepare_model_for_kbit_training leaves the embeddings and norms in fp32, so the residual stream runs in fp32,
    # and bitsandbytes' Linear4bit returns its input's dtype: each checkpointed layer input is 4 bytes × hidden and
    # SwiGLU's gate, up and SiLU outputs 4 bytes each (12 · intermediate); q, k, v and the attention output stay bf16
    # (SDPA under bf16 autocast), the norms keep their fp32 input as before.
    layer = 8 * 4096 + 8 * 4096 + 4 * 32 + 12 * 14336  # 237,696
    per_layer = layer + LLAMA_3_1_8B.lora_layer_bytes
    seq_len = 2048
    expected = (seq_len * (32 * 4 * 4096 + 2 * per_layer + 4 * 4096) + seq_len * seq_len + seq_len * seq_len * 2)
    assert activations_bytes(_shape(LLAMA_3_1_8B), batch_size=1, seq_len=seq_len, lora_rank=16, lora_dropout=0.05,
                             checkpointing=True, quantization="4bit") == expected


def test_on_a_4bit_base_trls_fused_head_saves_the_fp32_hidden_state():
    # The fp32 hidden state (4) and its fp32 gradient (4), 32 bytes of statistics per token, one bf16 tile, and a bf16
    # copy of a 32768-row chunk of the fp32 head.
    expected = 2048 * (8 * 4096 + 32) + 2048 * 32768 * 2 + 32768 * 4096 * 2
    assert _plan(LLAMA_3_1_8B, 2048, quantization="4bit").breakdown.logits_bytes == expected


@pytest.mark.parametrize("optimizer, per_parameter", [
    ("adamw_torch_fused", 16),  # fp32 weight and gradient, two fp32 states
    ("adamw_8bit", 10),  # two 8-bit states
    ("paged_ademamix_8bit", 11),  # three 8-bit states
    ("lion_32bit", 12),  # one fp32 momentum
    ("sgd", 8),  # transformers builds it without momentum: no state
])
def test_the_adapter_counts_the_chosen_optimizers_state(optimizer, per_parameter):
    plan = _plan(QWEN3_4B, 2048, optimizer=optimizer)
    assert plan.breakdown.adapter_bytes == QWEN3_4B.lora_parameters * per_parameter
    assert plan.optimizer == optimizer and "optimizer" in plan.forced


def test_an_8bit_optimizer_makes_the_estimate_smaller_than_adamw():
    assert _plan(QWEN3_4B, 2048, optimizer="adamw_8bit").estimate_bytes < _plan(QWEN3_4B, 2048).estimate_bytes


def test_a_chosen_optimizer_is_counted_even_where_memory_is_short():
    plan = _plan(LLAMA_3_1_8B, 2048, lora_rank=64, gpu_memory_bytes=22 * GIB, optimizer="adamw_torch")
    assert plan.optimizer == "adamw_torch" and plan.paged_adamw_8bit is False
    assert plan.reasons["paged_adamw_8bit"] == "the job's `training.optimizer` is adamw_torch"


def test_dora_adds_a_trained_magnitude_per_output_and_keeps_more_activations():
    plain, dora = _plan(QWEN3_4B, 2048), _plan(QWEN3_4B, 2048, use_dora=True)
    outputs = 36 * (4096 + 2 * 1024 + 2560 + 2 * 9728 + 2560)  # Σ output widths of q, k, v, o, gate, up, down
    assert dora.breakdown.lora_parameters == plain.breakdown.lora_parameters + outputs
    assert dora.breakdown.adapter_bytes == plain.breakdown.adapter_bytes + outputs * 16
    assert dora.breakdown.activations_bytes > plain.breakdown.activations_bytes
    assert dora.estimate_bytes > plain.estimate_bytes


def test_an_lm_head_to_save_is_a_full_trainable_copy_of_vocabulary_by_hidden_in_fp32_on_a_bf16_base():
    plain, saved = _plan(QWEN3_4B, 2048), _plan(QWEN3_4B, 2048, modules_to_save=["lm_head"])
    # 151,936 × 2,560 values: fp32 weight and gradient, AdamW's two fp32 states (torch keeps them in the weight's dtype)
    assert saved.breakdown.modules_to_save_bytes == 151_936 * 2560 * 16
    assert saved.estimate_bytes - plain.estimate_bytes == (saved.breakdown.modules_to_save_bytes
                                                           + saved.breakdown.head_gradient_bytes)


def test_a_trained_head_adds_the_fp32_gradient_buffer_of_trls_fused_head_to_the_backward():
    # ChunkedLogProbFunction.backward accumulates the head's gradient in fp32 (4 bytes a value) and returns it in the
    # fp32 copy's dtype, no second copy: at the start of the backward, with the activations.
    plan = _plan(QWEN3_4B, 2048, modules_to_save=["lm_head"])
    assert plan.breakdown.head_gradient_bytes == 151_936 * 2560 * 4
    assert plan.estimate_bytes == (plan.breakdown.weights_bytes + plan.breakdown.adapter_bytes
                                   + plan.breakdown.modules_to_save_bytes + plan.breakdown.activations_bytes
                                   + plan.breakdown.logits_bytes + plan.breakdown.head_gradient_bytes)


def test_a_trained_head_of_qwen3_8b_on_a_4bit_base_needs_2_3_gib_more_in_the_backward():
    # Qwen3-8B's head: 151,936 × 4,096, kept in fp32 on a 4-bit base, so the fp32 buffer is the gradient's own dtype.
    shape = shape_from_config({
        "model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151_936,
        "tie_word_embeddings": False,
    })
    plan = plan_memory(shape, algorithm="sft", batch_size=1, seq_len=2048, lora_rank=16, lora_dropout=0.0,
                       gpu_memory_bytes=80 * GIB, quantization="4bit", modules_to_save=["lm_head"])
    assert plan.breakdown.head_gradient_bytes == 151_936 * 4096 * 4
    assert round(plan.breakdown.head_gradient_bytes / GIB, 2) == 2.32


def test_on_a_4bit_base_a_module_to_save_trains_in_fp32_with_fp32_gradient_and_states():
    # The worker puts the copies TRL casts to bf16 back in fp32: weight, gradient and AdamW's two states, 4 bytes each.
    plan = _plan(LLAMA_3_1_8B, 2048, quantization="4bit", modules_to_save=["lm_head"])
    assert plan.breakdown.modules_to_save_bytes == 128_256 * 4096 * 16


@pytest.mark.parametrize("modules, fused", [(["embed_tokens"], True), (["lm_head"], False)])
def test_no_gradient_buffer_is_counted_for_trained_embeddings_or_an_unfused_head(modules, fused):
    plan = _plan(QWEN3_4B, 2048, modules_to_save=modules, fused_lm_head=fused)
    assert plan.breakdown.head_gradient_bytes == 0


def test_an_embedding_to_save_keeps_32_bit_states_under_an_8bit_optimizer():
    head = _plan(QWEN3_4B, 2048, modules_to_save=["lm_head"], optimizer="adamw_8bit").breakdown.modules_to_save_bytes
    embeddings = _plan(QWEN3_4B, 2048, modules_to_save=["embed_tokens"],
                       optimizer="adamw_8bit").breakdown.modules_to_save_bytes
    assert head == 151_936 * 2560 * (4 + 4 + 2 * 1)
    assert embeddings == 151_936 * 2560 * (4 + 4 + 2 * 4)


def test_a_module_to_save_the_plan_cannot_size_is_named_in_its_reasons():
    plan = _plan(QWEN3_4B, 2048, modules_to_save=["norm"])
    assert plan.breakdown.modules_to_save_bytes == 0
    assert plan.reasons["modules_to_save"].startswith("norm not counted")


def test_a_job_plans_with_its_optimizer_dora_and_modules_to_save():
    job = JobInput(run_id="r", model={"id": "Qwen/Qwen3-4B"}, dataset={"hub_id": "d/d"}, artifact_store="file:///s",
                   training={"optimizer": "adamw_8bit"}, lora={"use_dora": True, "modules_to_save": ["lm_head"]})
    plan = plan_job(job, _shape(QWEN3_4B), 80 * GIB)
    assert (plan.optimizer, plan.use_dora, plan.modules_to_save) == ("adamw_8bit", True, ["lm_head"])
    assert plan.breakdown.modules_to_save_bytes > 0


def test_usable_memory_is_the_gpu_less_a_tenth_and_a_gib_of_cuda_overhead():
    assert usable_memory(24 * GIB) == int(24 * GIB * 0.9) - GIB


def test_the_default_deployment_recomputes_activations_on_a_24_gib_gpu():
    # deployments/qwen.toml: Qwen3-0.6B, 8 × 2048, rank 16, dropout 0.05, on an RTX 4090.
    plan = plan_memory(_shape(QWEN3_0_6B), algorithm="sft", batch_size=8, seq_len=2048, lora_rank=16, lora_dropout=0.05,
                       gpu_memory_bytes=24 * GIB)
    assert plan.gradient_checkpointing and plan.fits
    assert plan.estimate_without_checkpointing_bytes > plan.usable_bytes


def test_checkpointing_stays_on_unless_training_without_it_is_within_sixty_percent_of_the_budget():
    shape = _shape(QWEN3_0_6B)
    without = _plan(QWEN3_0_6B, 2048).estimate_without_checkpointing_bytes

    def planned(usable: int):
        gpu = int((usable + GIB) / 0.9) + 1
        return plan_memory(shape, algorithm="sft", batch_size=1, seq_len=2048, lora_rank=16, lora_dropout=0.05,
                           gpu_memory_bytes=gpu).gradient_checkpointing

    assert planned(int(without / 0.7)) is True  # fits without it, but over 60 % of the budget
    assert planned(int(without / 0.55)) is False


def test_forced_checkpointing_off_is_kept_and_named_forced():
    plan = _plan(QWEN3_4B, 4096, batch_size=8, gpu_memory_bytes=24 * GIB, gradient_checkpointing=False)
    assert plan.gradient_checkpointing is False and plan.forced == ["gradient_checkpointing"]
    assert plan.estimate_bytes == plan.estimate_without_checkpointing_bytes
    assert plan.fits is (plan.estimate_with_checkpointing_bytes <= plan.usable_bytes)  # fits says: with checkpointing


def test_8bit_adamw_only_when_torch_adamw_does_not_fit():
    roomy = _plan(LLAMA_3_1_8B, 2048, lora_rank=64)
    short = _plan(LLAMA_3_1_8B, 2048, lora_rank=64, gpu_memory_bytes=22 * GIB)
    assert (roomy.paged_adamw_8bit, short.paged_adamw_8bit) == (False, True)
    assert short.reasons["paged_adamw_8bit"].startswith("memory is short: ~")


def test_a_70b_model_does_not_fit_a_24_gib_gpu():
    plan = plan_memory(read_model_shape(CONFIGS / "llama-3.1-70b"), algorithm="sft", batch_size=1, seq_len=2048,
                       lora_rank=16, lora_dropout=0.0, gpu_memory_bytes=24 * GIB)
    assert plan.fits is False


def test_a_70b_model_in_4bit_fits_an_80_gib_gpu():
    plan = plan_memory(read_model_shape(CONFIGS / "llama-3.1-70b"), algorithm="sft", batch_size=1, seq_len=2048,
                       lora_rank=16, lora_dropout=0.0, gpu_memory_bytes=80 * GIB, quantization="4bit")
    assert plan.fits is True


def test_vllms_share_holds_its_weights_the_rounds_kv_cache_and_its_runtime():
    shape = _shape(QWEN3_4B)
    vllm = vllm_memory(shape, num_generations=16, seq_len=1536)
    assert vllm.weights_bytes == 4_022_468_096 * 2
    # 16 sequences × 36 layers × 96 blocks of 16 tokens × keys and values of 8 KV heads of 128 in bf16.
    assert vllm.kv_cache_bytes == 16 * 36 * 96 * 16 * (2 * 8 * 128 * 2)
    assert vllm.linear_attention_state_bytes == 0 and vllm.block_tokens == 16
    # Its 4096-token profiling step, the sampler's fp32 logits and log-probabilities, 1 GiB of CUDA graphs; floored at 2 GiB.
    step = 4096 * (4 * 2560 + 2 * (2 * 4096 + 2 * 1024) + 6 * 9728)
    assert vllm.runtime_bytes == max(step + 16 * 151_936 * 8 + GIB, 2 * GIB)


def test_vllms_share_of_the_gpu_is_rounded_up_to_a_hundredth():
    plan = plan_memory(_shape(QWEN3_4B), algorithm="grpo", batch_size=8, seq_len=1536, lora_rank=16, lora_dropout=0.0,
                       gpu_memory_bytes=80 * GIB, num_generations=16, vllm_colocate=True)
    v = plan.vllm
    needed = v.weights_bytes + v.kv_cache_bytes + v.linear_attention_state_bytes + v.runtime_bytes
    assert plan.vllm_gpu_memory_utilization == math.ceil(needed / (80 * GIB) * 100) / 100
    assert plan.vllm_bytes == int(plan.vllm_gpu_memory_utilization * 80 * GIB)
    assert plan.estimate_bytes == plan.breakdown.total_bytes and plan.breakdown.vllm_bytes == plan.vllm_bytes


def test_grpo_counts_vllms_share_while_it_generates_and_only_what_it_keeps_asleep_at_the_backward():
    plan = plan_memory(_shape(QWEN3_4B), algorithm="grpo", batch_size=8, seq_len=1536, lora_rank=16, lora_dropout=0.0,
                       gpu_memory_bytes=80 * GIB, num_generations=16, vllm_colocate=True)
    b = plan.breakdown
    stays = b.weights_bytes + b.adapter_bytes + b.modules_to_save_bytes
    # TRL's sleep mode (level 2) frees vLLM's weights and KV cache after each round; its CUDA graphs stay.
    assert b.vllm_asleep_bytes == VLLM_ASLEEP_BYTES == GIB
    assert plan.estimate_bytes == stays + max(b.activations_bytes + b.logits_bytes + GIB, plan.vllm_bytes)
    assert plan.estimate_bytes < stays + b.activations_bytes + b.logits_bytes + plan.vllm_bytes


def test_vllm_colocates_where_its_share_fits_beside_trainings_weights_though_not_beside_its_activations():
    plan = plan_memory(_shape(QWEN3_4B), algorithm="grpo", batch_size=8, seq_len=1536, lora_rank=16, lora_dropout=0.0,
                       gpu_memory_bytes=28 * GIB, num_generations=16, vllm_colocate=True)
    b = plan.breakdown
    stays = b.weights_bytes + b.adapter_bytes
    assert plan.vllm_colocate and plan.fits
    assert stays + b.activations_bytes + b.logits_bytes + plan.vllm_bytes > plan.usable_bytes  # both at once: no room
    assert plan.reasons["vllm_colocate"].endswith("asleep while training steps")


def test_a_hybrid_models_kv_blocks_grow_until_a_page_holds_a_layers_recurrent_state():
    shape = shape_from_config({
        "model_type": "qwen3_5_text", "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24,
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256, "vocab_size": 151_936,
        "full_attention_interval": 4, "linear_num_key_heads": 16, "linear_num_value_heads": 16, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "mamba_ssm_dtype": "float32",
    })
    assert shape.linear_attention == LinearAttentionShape(key_heads=16, value_heads=16, key_head_dim=128, value_head_dim=128,
                                                          conv_kernel=4, recurrent_state_bytes=4)
    # A layer's state: 3 × 6144 bf16 conv inputs + 16 × 128 × 128 fp32 recurrent values = 1,085,440 bytes; an attention
    # token-layer holds 2 × 2 × 256 × 2 = 2048 bytes, so a page needs 530 tokens: 544 in blocks of 16.
    vllm = vllm_memory(shape, num_generations=4, seq_len=1000)
    assert vllm.block_tokens == 544
    assert vllm.kv_cache_bytes == 4 * 6 * 2 * 544 * 2048  # 6 attention layers, 1,000 tokens in 2 blocks
    assert vllm.linear_attention_state_bytes == 4 * 18 * 544 * 2048  # one page per linear layer and sequence


def test_vllm_is_turned_off_where_it_does_not_fit_beside_training():
    plan = plan_memory(_shape(QWEN3_4B), algorithm="grpo", batch_size=8, seq_len=1536, lora_rank=16, lora_dropout=0.0,
                       gpu_memory_bytes=24 * GIB, num_generations=16, vllm_colocate=True)
    assert (plan.vllm_colocate, plan.vllm_bytes, plan.vllm_gpu_memory_utilization) == (False, 0, None)
    assert plan.reasons["vllm_colocate"].endswith("completions come from the training model's generate")


def test_grpo_without_vllm_counts_the_training_models_generation_cache():
    plan = plan_memory(_shape(QWEN3_4B), algorithm="grpo", batch_size=8, seq_len=1536, lora_rank=16, lora_dropout=0.0,
                       gpu_memory_bytes=80 * GIB, num_generations=16)
    # 16 sequences × 1536 tokens × keys and values of 36 layers × 8 heads × 128 in bf16, and one step's fp32 logits
    # and probabilities.
    assert plan.breakdown.generation_bytes == 16 * (1536 * 2 * 36 * 1024 * 2 + 2 * 4 * 151_936)


def test_a_forced_vllm_share_replaces_the_planned_one():
    plan = plan_memory(_shape(QWEN3_4B), algorithm="grpo", batch_size=8, seq_len=1536, lora_rank=16, lora_dropout=0.0,
                       gpu_memory_bytes=80 * GIB, num_generations=16, vllm_colocate=True, vllm_gpu_memory_utilization=0.4)
    assert (plan.vllm_colocate, plan.vllm_gpu_memory_utilization) == (True, 0.4)
    assert plan.forced == ["vllm_gpu_memory_utilization"]


def test_the_planner_imports_without_the_training_stack():
    # The control plane imports it from an environment without torch or transformers.
    probe = "import sys, loraflow_worker.memory.plan; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "[]", done.stderr


def test_the_cli_plans_checkpointing_for_the_default_deployment_on_24_gib(tmp_path):
    (tmp_path / "config.json").write_text((CONFIGS / "qwen3-0.6b" / "config.json").read_text())  # only a config.json
    plan = _cli(tmp_path, "--algorithm", "sft", "--batch-size", "8", "--seq-len", "2048", "--lora-rank", "16",
                "--lora-dropout", "0.05", "--gpu-memory-gib", "24")
    assert plan["gradient_checkpointing"] is True
    assert {"fits", "estimate_gib", "usable_gib", "breakdown"} <= set(plan)


@pytest.mark.parametrize("gib, quantization, fits", [("24", "none", False), ("80", "4bit", True)])
def test_the_cli_says_whether_a_70b_model_fits(gib, quantization, fits):
    plan = _cli(CONFIGS / "llama-3.1-70b", "--algorithm", "sft", "--batch-size", "1", "--seq-len", "2048",
                "--lora-rank", "16", "--gpu-memory-gib", gib, "--quantization", quantization)
    assert plan["fits"] is fits


def test_the_cli_counts_the_optimizer_dora_and_modules_to_save():
    common = ("--algorithm", "sft", "--batch-size", "1", "--seq-len", "2048", "--gpu-memory-gib", "80")
    plain = _cli(CONFIGS / "qwen3-4b", *common)
    knobs = _cli(CONFIGS / "qwen3-4b", *common, "--optimizer", "adamw_8bit", "--use-dora", "--modules-to-save", "lm_head")
    assert (knobs["optimizer"], knobs["use_dora"], knobs["modules_to_save"]) == ("adamw_8bit", True, ["lm_head"])
    assert knobs["breakdown"]["modules_to_save_bytes"] > 0 and knobs["estimate_bytes"] > plain["estimate_bytes"]


def test_the_cli_gives_vllms_share_for_grpo():
    plan = _cli(CONFIGS / "qwen3-4b", "--algorithm", "grpo", "--batch-size", "8", "--seq-len", "1536",
                "--num-generations", "16", "--gpu-memory-gib", "80")
    assert plan["vllm_colocate"] is True and plan["vllm_gib"] == round(plan["vllm_bytes"] / GIB, 2) > 0


def test_the_cli_plans_dpo_larger_than_sft_for_the_same_shape():
    common = ("--batch-size", "8", "--seq-len", "2048", "--gpu-memory-gib", "80")
    sft = _cli(CONFIGS / "qwen3-4b", "--algorithm", "sft", *common)
    dpo = _cli(CONFIGS / "qwen3-4b", "--algorithm", "dpo", *common)  # a chosen and a rejected answer per pair
    assert dpo["breakdown"]["activations_bytes"] == 2 * sft["breakdown"]["activations_bytes"]
    assert dpo["estimate_without_checkpointing_bytes"] > sft["estimate_without_checkpointing_bytes"]
    assert dpo["reasons"]["vllm_colocate"] == "dpo generates no completions"


def test_the_cli_estimates_qlora_llama_3_1_8b_at_8_by_2048_at_no_less_than_25_gib():
    # The fp32 residual stream of a 4-bit base counted: ~26.6 GiB with checkpointing (it was 19.8 with a bf16 stream).
    plan = _cli(CONFIGS / "llama-3.1-8b", "--algorithm", "sft", "--batch-size", "8", "--seq-len", "2048", "--lora-rank",
                "16", "--gpu-memory-gib", "32", "--quantization", "4bit")
    assert plan["gradient_checkpointing"] is True
    assert plan["estimate_gib"] >= 25


def test_the_cli_refuses_a_folder_without_config_json(tmp_path):
    done = subprocess.run([sys.executable, "-m", "loraflow_worker.memory.plan", str(tmp_path), "--batch-size", "1",
                           "--seq-len", "8", "--gpu-memory-gib", "24"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "has no config.json" in done.stderr
