"""Where a serving endpoint may go, decided before renting: the GPU memory RunPod's vLLM worker needs for a base
model and its LoRA adapters (`serving_memory`, an estimate from the model's `config.json` alone), and the cheapest GPU
class of a serve's list whose card holds it, whose hosts run the worker image's CUDA and that RunPod stocks
(`choose_serving_gpu`).

The estimate, as vLLM spends the memory (vllm/worker/gpu_worker.py `determine_available_memory`, code-read): of the
GPU, the share `GPU_MEMORY_UTILIZATION` (vLLM's default 0.9; serving.md §2) holds the weights, the LoRA slots, the
activations of one profiling pass and the KV cache, which must hold at least one sequence of `max_model_len` or vLLM
refuses to start. So a GPU holds the serve when

    weights (parameters × 2 bytes, bf16) + LoRA slots (MAX_LORAS × MAX_LORA_RANK × the blocks' linear in + out widths
    × 2 bytes: vLLM allocates every slot at the largest rank) + KV cache (max_model_len × 2 (K and V) × attention
    layers × KV heads × head dim × 2 bytes, and a linear-attention model's recurrent state) + `OVERHEAD_BYTES`

is within `GPU_MEMORY_UTILIZATION` × its memory. Whatever the KV cache gets beyond one sequence serves concurrent
requests: a GPU with more room answers more of them at once, which this estimate does not price.
"""

from __future__ import annotations

from collections.abc import Sequence

from loraflow_worker.memory.model_shape import KV_BYTES, ModelShape, shape_from_config
from pydantic import BaseModel, Field

from tasks.placement.gpu_fit import GIB, cuda_fits
from tasks.runpod.catalog import GPU_CLASSES, GpuClass, cuda_floor
from tasks.runpod.live_catalog import GpuOffer

BF16_BYTES = 2
GPU_MEMORY_UTILIZATION = 0.9
"""vLLM's default `--gpu-memory-utilization` (serving.md §2): the share of the GPU it takes; loraflow leaves it."""
OVERHEAD_BYTES = 2 * GIB
"""CUDA context, the sampler and the activations of vLLM's profiling pass (one batch of up to 8192 tokens), and the
CUDA graphs it captures: about 1-2 GiB for models of 1-14 B parameters (vLLM's startup log's "model weights take" vs
"KV cache" lines); the upper end, to stay on the safe side."""


class ServingMemory(BaseModel):
    """GPU memory a base model and its adapters need on RunPod's vLLM worker (see the module docstring)."""

    weights_bytes: int = Field(description="The base's weights in bf16.")
    lora_bytes: int = Field(description="vLLM's LoRA slots: MAX_LORAS × MAX_LORA_RANK over every linear layer.")
    kv_bytes_per_token: int = Field(description="KV cache per token: 2 × attention layers × KV heads × head dim × 2.")
    kv_cache_bytes: int = Field(description="KV cache of one sequence of max_model_len (and a linear-attention "
                                "model's recurrent state of one sequence).")
    overhead_bytes: int = Field(default=OVERHEAD_BYTES, description="CUDA context, activations, CUDA graphs.")
    max_model_len: int

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.lora_bytes + self.kv_cache_bytes + self.overhead_bytes

    def fits(self, gpu: GpuClass) -> bool:
        return self.total_bytes <= GPU_MEMORY_UTILIZATION * gpu.vram_gb * GIB

    def describe(self) -> str:
        return (f"~{self.total_bytes / GIB:.1f} GiB: weights {self.weights_bytes / GIB:.1f} GiB (bf16), LoRA slots "
                f"{self.lora_bytes / GIB:.2f} GiB, KV cache for {self.max_model_len} tokens "
                f"{self.kv_cache_bytes / GIB:.2f} GiB, overhead {self.overhead_bytes / GIB:.1f} GiB")


def kv_bytes_per_token(shape: ModelShape) -> int:
    """Bytes of KV cache one token takes in every attention layer: K and V, each KV heads × head dim, in bf16."""
    return 2 * shape.attention_layers * shape.kv_heads * shape.head_dim * KV_BYTES


def serving_memory(config: dict, *, max_model_len: int, max_loras: int, max_lora_rank: int) -> ServingMemory:
    """The estimate for a model of this `config.json` served with `max_loras` adapter slots of `max_lora_rank`."""
    shape = shape_from_config(config)
    per_token = kv_bytes_per_token(shape)
    state = (shape.linear_attention.state_bytes() * shape.linear_attention_layers
             if shape.linear_attention is not None else 0)
    return ServingMemory(
        weights_bytes=shape.parameters * BF16_BYTES,
        lora_bytes=max_loras * max_lora_rank * (shape.lora_in_features + shape.lora_out_features) * BF16_BYTES,
        kv_bytes_per_token=per_token, kv_cache_bytes=per_token * max_model_len + state, max_model_len=max_model_len)


class ServingGpuRefused(ValueError):
    """No GPU class of the serve's `serve.gpu` can serve it: refused before renting, naming the field and the fix."""


def choose_serving_gpu(gpus: Sequence[GpuClass], offers: dict[str, GpuOffer], memory: ServingMemory,
                       image_min_cuda: str, *, field: str = "serve.gpu",
                       smaller: str = "lower serve.max_model_len (the KV cache), or serve fewer adapters",
                       ) -> tuple[GpuClass, list[str]]:
    """The cheapest class of `gpus` (ties: the order given) whose card RunPod lists in its pool, whose hosts run
    `image_min_cuda` (and the card's own floor) and whose memory holds `memory`, preferring those in stock somewhere;
    pinned in its pool as its offer says. Also: why each other class was passed over. Raises `ServingGpuRefused`
    naming `field` (the form's GPU list), each class's reason, the smallest class loraflow knows that would hold it,
    and `smaller`: how the form asks for less memory."""
    passed: list[str] = []
    candidates = []
    fits = cuda_fits(gpus, offers, [cuda_floor(g, image_min_cuda) for g in gpus])
    for gpu, fit in zip(gpus, fits, strict=True):
        offer = offers[gpu.name]
        if offer.not_in_pool is not None:
            passed.append(offer.not_in_pool)
        elif not fit.meets:
            passed.append(f"{fit.describe()}: no host runs the vLLM worker image")
        elif not memory.fits(gpu):
            passed.append(f"{gpu.name} ({gpu.vram_gb} GiB × {GPU_MEMORY_UTILIZATION:g} for vLLM) cannot hold "
                          f"{memory.total_bytes / GIB:.1f} GiB")
        else:
            candidates.append(offer.pinned(gpu))
    if not candidates:
        bigger = next((g.name for g in sorted(GPU_CLASSES.values(), key=lambda g: (g.vram_gb, g.usd_per_hour))
                       if memory.fits(g)), None)
        fix = f"add {bigger} to {field}" if bigger else "no GPU class loraflow rents holds it"
        raise ServingGpuRefused(
            f"{field}: no GPU of the list holds it; it needs {memory.describe()}. " + "; ".join(passed)
            + f". Fix: {fix}, or {smaller}.")
    stocked = [g for g in candidates if offers[g.name].in_stock_data_centers()]
    pool = stocked or candidates
    chosen = min(pool, key=lambda g: (offers[g.name].usd_per_hour, candidates.index(g)))
    for gpu in candidates:
        if gpu is not chosen:
            why = "dearer" if gpu in pool else "no stock now"
            passed.append(f"{gpu.name} (${offers[gpu.name].usd_per_hour:.2f}/hr): {why}")
    return chosen, passed
