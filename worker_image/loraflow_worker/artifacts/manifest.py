"""The run manifest (`runs/<id>/manifest.json`): what produced an adapter, and on what.

Light (pydantic only) so the control plane can read it. Unknown fields are ignored on reading, so a
newer worker's manifest still loads in an older control plane.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, Field

from loraflow_worker.contract import JobInput
from loraflow_worker.memory.plan import MemoryPlan

RECORDED_LIBRARIES = (
    "torch", "transformers", "trl", "peft", "accelerate", "datasets",
    "liger-kernel", "flash-linear-attention", "fla-core", "causal-conv1d", "bitsandbytes", "vllm", "triton",
)
"""Libraries whose versions the manifest records, when installed."""
_NOT_TRAINING_CONFIG = {"contract_version", "run_id", "attempt", "artifact_store", "deadline_epoch_s", "mode", "memory",
                        "checkpoint_key"}
"""What names or schedules an attempt, not what it trains: `memory` too, since a forced micro-batch keeps the effective
batch and checkpointing or vLLM's share change how much memory training takes, not what it learns."""


class FastPath(BaseModel):
    """Whether one speed-up was actually in effect, and why (kernels can fail to engage silently)."""

    engaged: bool = Field(description="True when the fast path was in effect during training.")
    reason: str = Field(description="Why it was or was not engaged, e.g. `no CUDA device`.")


class LossRecord(BaseModel):
    """Which tokens an SFT run's loss was on (`training.loss_on`), as training masked them."""

    loss_on: str = Field(description="`completion` (the answers only) or `all` (every token).")
    masked_by: str = Field(
        description="How the tokens without loss were found: the chat template's assistant markers, each turn's "
        "rendered prefix, the prompt of prompt/completion examples, or nothing (`all`, plain text)."
    )
    chat_template: str | None = Field(
        default=None, description="The chat template the chats were rendered with, and where it came from; None for "
        "data without chats.")
    token_share: float = Field(
        ge=0.0, le=1.0,
        description="Share of the training tokens (after truncation to `training.max_seq_length`) that carry the loss.",
    )


class SourceRows(BaseModel):
    """How many training examples one source of the dataset gave."""

    source: str = Field(description="The source, as the job names it, e.g. `dataset.mix[1] (hub org/data, split "
                        "train)`.")
    format: str = Field(description="The format its rows came in (`auto`, `alpaca`, `sharegpt`), converted to TRL's.")
    fraction: float | None = Field(default=None, description="Its `fraction` in a mix; None for a single source.")
    rows: int = Field(description="Examples it gave to the training data (before any evaluation share is held out).")


class VllmWeightSyncs(BaseModel):
    """GRPO with a colocated vLLM: how often the training weights were loaded into vLLM. Each sync merges the adapter
    into the bf16 base and unmerges it (a little drift each time), and costs a full copy of the weights."""

    per_step: dict[int, int] = Field(
        description="Optimizer step → weight syncs while generating the completions it trained on: 1 for a step that "
        "had its own generation round, however many tool turns the round took; 0 or absent for a step whose "
        "completions an earlier round generated (`steps_per_generation`).")
    generate_calls_per_step: dict[int, int] = Field(
        description="Optimizer step → vLLM generate calls for its completions: one per round, and one more per tool "
        "turn.")
    evaluation_syncs: int = Field(default=0, description="Weight syncs for the evaluation rounds, one per round.")


class RunManifest(BaseModel):
    """Everything needed to know how an adapter was made, stored beside it."""

    contract_version: int = Field(description="Job contract version the worker spoke.")
    job: JobInput = Field(description="The validated job input that produced the adapter.")
    base_model_id: str = Field(description="Base model: a Hub model id, or a local folder in local mode.")
    base_model_revision: str | None = Field(
        description="Hub commit sha the base model was downloaded at; None for a local folder."
    )
    device: str = Field(description="Device trained on, e.g. `cpu` or `cuda:0 (NVIDIA H100 80GB HBM3)`.")
    seed: int = Field(description="Random seed used for data order and adapter initialisation.")
    libraries: dict[str, str] = Field(description="Versions of the training libraries, by package name.")
    fast_paths: dict[str, FastPath] = Field(
        description="Speed-ups and memory savers by name (`bf16`, `liger_kernel`, `gradient_checkpointing`, ...), "
        "whether each engaged, and why."
    )
    memory_plan: MemoryPlan | None = Field(
        default=None,
        description="The memory plan the worker decided gradient checkpointing, the optimizer and vLLM's share from: its "
        "estimates by what holds the memory, the decisions and their reasons, and which it was forced to take; None "
        "on CPU.",
    )
    forced_memory_settings: list[str] = Field(
        default_factory=list,
        description="The job's memory settings that were forced (`JobInput.memory`, e.g. `micro_batch_size`): they "
        "overrode the plan.",
    )
    loss: LossRecord | None = Field(default=None, description="SFT: which tokens carried the loss; None for GRPO.")
    vllm_weight_syncs: VllmWeightSyncs | None = Field(
        default=None, description="GRPO with vLLM colocated: the weight syncs into vLLM per optimizer step; None where "
        "vLLM did not generate.")
    cuda_version: str | None = Field(default=None, description="CUDA version torch was built with; None on CPU.")
    cuda_allocator_settings: str | None = Field(
        default=None,
        description="The settings the CUDA caching allocator ran with, as it took them from `PYTORCH_CUDA_ALLOC_CONF` "
        "(e.g. `expandable_segments:True`; empty for its defaults); None on CPU.",
    )
    cuda_alloc_conf: str | None = Field(
        default=None,
        description="`PYTORCH_CUDA_ALLOC_CONF` in the training process's environment: the worker's supervisor puts it "
        "there before the process starts (unless the worker's own environment has one), so before anything initialises "
        "CUDA; None where neither set it. `cuda_allocator_settings` says what the allocator took from it.",
    )
    trainable_dtypes: dict[str, str] = Field(
        default_factory=dict,
        description="The dtype each group of trained tensors trained in: `lora` (the adapter's matrices), "
        "`dora_magnitude`, `modules_to_save` (the full copies), e.g. `{\"lora\": \"float32\"}`. The worker keeps "
        "them all in fp32, where a small learning rate's update does not round away as in bf16.",
    )
    dataset_sources: list[SourceRows] = Field(
        default_factory=list,
        description="Where the training examples came from: each source (the mix's entries, in order) and how many "
        "examples it gave.",
    )
    input_sha256: dict[str, str] = Field(
        default_factory=dict,
        description="Store path → sha256 of each of the run's own files as training read them from the store (dataset "
        "files, evaluation file, chat template, reward, tools and environment files): with pins in the job "
        "(`job.inputs`), checked equal to the hashes the control plane recorded when it stored them.",
    )
    dataset_sha256: str | None = Field(
        default=None, description="sha256 of the training rows as canonical JSON lines, in order (`rows_sha256`)."
    )
    config_sha256: str | None = Field(
        default=None,
        description="sha256 of the job's training configuration (`training_config_sha256`): equal hashes, same training.",
    )


def library_versions() -> dict[str, str]:
    """Versions of the installed `RECORDED_LIBRARIES`."""
    versions = {}
    for name in RECORDED_LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def rows_sha256(rows: Iterable[dict[str, Any]]) -> str:
    """sha256 of `rows` as JSON lines with sorted keys: the same rows in the same order give the same hash,
    whichever file or Hub dataset they came from."""
    digest = hashlib.sha256()
    for row in rows:
        digest.update(json.dumps(row, sort_keys=True, ensure_ascii=False, default=str).encode())
        digest.update(b"\n")
    return digest.hexdigest()


def training_config_sha256(job: JobInput) -> str:
    """sha256 of what decides the training in `job` (algorithm, model, dataset, LoRA, training and GRPO
    settings, extra packages), leaving out what names or schedules this attempt (run id, attempt, store, deadline)."""
    config = job.model_dump(mode="json", exclude=_NOT_TRAINING_CONFIG)
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()
