"""The job contract between the control plane and the worker.

The control plane builds a `JobInput`, sends it as the RunPod job's `input`, and reads a
`JobResult` back from the job's `output`. Both sides validate with these models, so a typo is caught
before a GPU is billed, and a worker refuses a job whose `contract_version` it does not understand.

This module must stay light (pydantic only): the control plane imports it without the training stack.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

CONTRACT_VERSION = 1
"""Bump when a change to `JobInput` or `JobResult` is not backwards compatible."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelSource(_Strict):
    """The base model to fine-tune."""

    id: str = Field(
        min_length=1,
        max_length=512,
        description="Hugging Face Hub model id (`Qwen/Qwen3-0.6B`), or a local directory path in local "
        "mode (the worker must be able to read it).",
    )
    revision: str | None = Field(
        default=None,
        max_length=256,
        description="Hub revision (branch, tag or commit sha). None means the repo's default branch; "
        "the run manifest records the commit actually used.",
    )


class DatasetSource(_Strict):
    """Where the training examples come from: a Hub dataset, or a file in the run's artifact store."""

    hub_id: str | None = Field(
        default=None,
        max_length=512,
        description="Hugging Face Hub dataset id, e.g. `trl-lib/Capybara`. Leave empty when using a "
        "file in the artifact store.",
    )
    split: str = Field(default="train", max_length=128, description="Dataset split to train on.")
    store_path: str | None = Field(
        default=None,
        max_length=1024,
        description="Path of a JSONL file inside the artifact store (set by the control plane when it "
        "publishes a local dataset file).",
    )

    @model_validator(mode="after")
    def _exactly_one_source(self) -> DatasetSource:
        if (self.hub_id is None) == (self.store_path is None):
            raise ValueError("give exactly one of `hub_id` (a Hub dataset) or `store_path` (a file in the store)")
        return self


class LoraSettings(_Strict):
    """LoRA adapter shape (PEFT `LoraConfig`)."""

    rank: int = Field(default=16, ge=1, le=1024, description="LoRA rank `r`: adapter width. Larger learns more, costs more memory.")
    alpha: int = Field(default=32, ge=1, le=4096, description="LoRA alpha: the adapter's output is scaled by alpha / rank.")
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0, description="Dropout on the LoRA input during training (0 to disable).")
    target_modules: list[str] | Literal["all-linear"] = Field(
        default="all-linear",
        description="Module names to adapt (e.g. `[\"q_proj\", \"v_proj\"]`), or `all-linear` for every "
        "linear layer except the output head.",
    )


class TrainingSettings(_Strict):
    """Optimisation settings shared by every algorithm."""

    learning_rate: float = Field(default=2e-4, gt=0.0, le=1.0, description="Peak learning rate of the adapter weights.")
    epochs: float = Field(default=1.0, gt=0.0, le=1000.0, description="Passes over the dataset. Ignored when `max_steps` is set.")
    max_steps: int | None = Field(
        default=None, ge=1, le=10_000_000, description="Stop after this many optimizer steps. None trains for `epochs`."
    )
    batch_size: int = Field(default=8, ge=1, le=4096, description="Examples per device per optimizer step.")
    gradient_accumulation_steps: int = Field(default=1, ge=1, le=1024, description="Micro-batches summed per optimizer step.")
    max_seq_length: int = Field(default=1024, ge=8, le=262_144, description="Tokens per example; longer examples are truncated.")
    seed: int = Field(default=42, ge=0, le=2**31 - 1, description="Random seed for data order and adapter initialisation.")
    logging_steps: int = Field(default=1, ge=1, le=100_000, description="Record loss every this many steps.")


class JobInput(_Strict):
    """What the control plane asks the worker to do: the RunPod job's `input`."""

    contract_version: int = Field(default=CONTRACT_VERSION, description="Version of this contract.")
    mode: Literal["train"] = Field(default="train", description="What the worker should do.")
    run_id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._-]+$", description="The Prefect flow run id.")
    attempt: int = Field(default=1, ge=1, le=100, description="Attempt number of this run (1 for the first try).")
    algorithm: Literal["sft"] = Field(default="sft", description="Training algorithm.")
    model: ModelSource
    dataset: DatasetSource
    lora: LoraSettings = Field(default_factory=LoraSettings)
    training: TrainingSettings = Field(default_factory=TrainingSettings)
    artifact_store: str = Field(
        min_length=1,
        max_length=1024,
        description="Artifact store URL: `file:///abs/path` or `hf://datasets/<org>/<repo>`.",
    )
    deadline_epoch_s: float | None = Field(
        default=None, description="Unix time by which the worker must have stopped; None means no deadline."
    )


class TrainMetrics(_Strict):
    """Summary of a finished training run, as stored in `metrics.json`."""

    steps: int = Field(description="Optimizer steps taken.")
    losses: list[tuple[int, float]] = Field(description="(step, training loss) pairs, in step order.")
    first_loss: float | None = Field(description="Loss at the first logged step.")
    final_loss: float | None = Field(description="Loss at the last logged step.")
    tokens: int = Field(description="Training tokens processed (non-padding).")
    wall_seconds: float = Field(description="Seconds spent in training.")
    device: str = Field(description="Device trained on, e.g. `cpu` or `cuda:0 (NVIDIA H100 80GB HBM3)`.")


class JobResult(_Strict):
    """What the worker returns as the job's `output` when training completed."""

    contract_version: int = Field(default=CONTRACT_VERSION)
    run_id: str
    attempt: int
    status: Literal["completed"] = "completed"
    run_prefix: str = Field(description="Path of this run's folder inside the artifact store, e.g. `runs/<run_id>`.")
    adapter_path: str = Field(description="Path of the adapter folder inside the artifact store.")
    metrics: TrainMetrics


class Progress(_Strict):
    """A progress update the worker sends while training (`runpod.serverless.progress_update`)."""

    kind: Literal["progress"] = "progress"
    stage: Literal["loading", "training", "saving"] = Field(description="What the worker is doing.")
    step: int = Field(default=0, description="Optimizer steps done.")
    total_steps: int | None = Field(default=None, description="Optimizer steps planned, when known.")
    loss: float | None = Field(default=None, description="Latest training loss.")
    message: str = Field(default="", max_length=2000, description="Free text for the log.")


def run_prefix(run_id: str) -> str:
    """The folder of a run inside the artifact store. Both sides derive it the same way."""
    return f"runs/{run_id}"
