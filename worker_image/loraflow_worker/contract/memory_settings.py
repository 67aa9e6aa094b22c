"""Memory settings the control plane forces on an attempt after one ran out of memory, and the checks that refuse
the ones that cannot apply to a job."""

from __future__ import annotations

from pydantic import Field

from loraflow_worker.contract.lora_settings import LoraSettings
from loraflow_worker.contract.training_settings import TrainingSettings
from loraflow_worker.contract.version import _Strict


class MemorySettings(_Strict):
    """Memory settings forced on an attempt instead of the worker's memory plan (each None: the plan decides). The
    control plane sets them after an out-of-memory attempt; the run manifest records which were forced."""

    gradient_checkpointing: bool | None = Field(
        default=None, description="Force gradient checkpointing on (recompute activations: less memory, ~30% slower) or off."
    )
    micro_batch_size: int | None = Field(
        default=None,
        ge=1,
        le=4096,
        description="Sequences per device step. The worker sets the gradient accumulation steps so that micro-batch × "
        "accumulation is the run's effective batch (`training.batch_size` × `training.gradient_accumulation_steps`), "
        "which it must divide.",
    )
    vllm_gpu_memory_utilization: float | None = Field(
        default=None,
        gt=0.0,
        lt=1.0,
        description="GRPO: the share of the GPU's memory the colocated vLLM engine takes, instead of the planned one.",
    )
    vllm_colocate: bool | None = Field(
        default=None,
        description="GRPO: false turns vLLM colocation off, so the training model generates the completions "
        "(transformers' `generate`: slower, but no memory set aside for vLLM). None: vLLM colocates where the "
        "memory plan says it fits. True is refused: to force vLLM's share, set `vllm_gpu_memory_utilization`.",
    )


def memory_setting_problems(algorithm: str, lora: LoraSettings, training: TrainingSettings,
                            memory: MemorySettings | None) -> list[str]:
    """What is wrong with a job's forced memory settings and its quantization (empty when nothing). Shared by the
    worker's `JobInput` and the control plane, so both refuse the same jobs with the same words."""
    memory = memory or MemorySettings()
    problems = []
    effective = training.batch_size * training.gradient_accumulation_steps
    micro = memory.micro_batch_size
    if micro is not None and effective % micro:
        divisors = [d for d in range(1, effective + 1) if effective % d == 0]
        problems.append(
            f"`memory.micro_batch_size` ({micro}) must divide the effective batch, `training.batch_size` × "
            f"`training.gradient_accumulation_steps` ({training.batch_size} × {training.gradient_accumulation_steps} = "
            f"{effective} sequences per optimizer step), so that micro-batches × accumulation steps keep it: use one of "
            f"{', '.join(map(str, divisors))}"
        )
    vllm_set = [f"`memory.{name}`" for name in ("vllm_gpu_memory_utilization", "vllm_colocate") if getattr(memory, name) is not None]
    if algorithm != "grpo" and vllm_set:
        problems.append(f"{' and '.join(vllm_set)} {'applies' if len(vllm_set) == 1 else 'apply'} to GRPO only "
                        f"(algorithm is '{algorithm}'): remove {'it' if len(vllm_set) == 1 else 'them'}")
    if memory.vllm_colocate is True:
        problems.append("`memory.vllm_colocate` can only turn colocation off (false): vLLM colocates wherever the memory "
                        "plan says it fits; to force its share, set `memory.vllm_gpu_memory_utilization` instead")
    if memory.vllm_colocate is False and memory.vllm_gpu_memory_utilization is not None:
        problems.append("`memory.vllm_gpu_memory_utilization` is set but `memory.vllm_colocate` is false: there is no "
                        "colocated vLLM to give a share to; remove one of them")
    if lora.quantization == "4bit" and algorithm == "grpo" and memory.vllm_colocate is not False:
        # TRL loads a colocated vLLM with the adapter merged into the base; into a 4-bit base that merge misbehaves.
        problems.append(
            "`lora.quantization` '4bit' with algorithm 'grpo' needs vLLM colocation off: TRL merges the adapter into the "
            "4-bit base to load it into vLLM, which misbehaves. Set `memory.vllm_colocate` to false (the training model "
            "generates the completions), or `lora.quantization` to 'none'"
        )
    return problems
