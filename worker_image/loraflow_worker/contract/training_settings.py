"""The settings every training method shares: the LoRA adapter's shape, the optimisation, held-out evaluation."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from loraflow_worker.contract.sources import RowFormat
from loraflow_worker.contract.version import _Strict


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
    quantization: Literal["none", "4bit"] = Field(
        default="none",
        description="`none`: the base model in bf16. `4bit`: QLoRA — the base loaded in 4 bits (nf4, double "
        "quantization, bf16 compute) through bitsandbytes, to fit a larger model on one GPU. GRPO with `4bit` needs "
        "`memory.vllm_colocate` false.",
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
    checkpoint_every_steps: int | None = Field(
        default=None,
        ge=1,
        le=10_000_000,
        description="Save a resumable checkpoint (adapter, optimizer, scheduler, RNG) to the artifact store "
        "every this many optimizer steps, so a new attempt of the run resumes there. At most one checkpoint "
        "is stored per minute (the Hub's commit quota); a save that comes sooner stays local. None: no "
        "step-based checkpoints (`checkpoint_every_minutes` may still save some).",
    )
    checkpoint_every_minutes: int | None = Field(
        default=15,
        ge=1,
        le=10_080,
        description="Save a resumable checkpoint to the artifact store once this many minutes have passed since "
        "training began or since the last checkpoint, whichever came later, so a preempted or failed attempt "
        "loses at most this much training. Works alongside `checkpoint_every_steps`: a checkpoint is saved "
        "when either says so. The default 15 costs about 4 commits an hour of the artifact repo's quota (the "
        "Hub allows about 128 per hour per repo, shared by the runs that write to it). None: no time-based "
        "checkpoints.",
    )
    keep_checkpoints: int = Field(
        default=1, ge=1, le=100,
        description="Checkpoints kept in the artifact store; older ones are deleted in the commit that adds a new one.",
    )
    report_to: list[Literal["wandb", "mlflow"]] = Field(
        default_factory=list,
        max_length=2,
        description="Trackers that record the training (and evaluation) metrics, through TRL's own integrations. "
        "`wandb`: online when the run's `[worker] secrets` give `WANDB_API_KEY`, else offline; the project is "
        "`WANDB_PROJECT` from `[worker] env` (default `loraflow`). `mlflow`: to the tracking server at "
        "`MLFLOW_TRACKING_URI` from `[worker] env` (its credentials, e.g. `MLFLOW_TRACKING_TOKEN`, in `[worker] "
        "secrets`), else to a file store; the experiment is `MLFLOW_EXPERIMENT_NAME` (default `loraflow`). Each "
        "attempt is one tracker run named `<run id>-a<attempt>`. Either way the tracker's local files are stored "
        "with the run under `tracking/a<attempt>/`, and the summary links the tracker's run. Empty: no tracker.",
    )

    @field_validator("report_to")
    @classmethod
    def _each_tracker_once(cls, trackers: list[str]) -> list[str]:
        if len(set(trackers)) != len(trackers):
            raise ValueError("name each tracker once")
        return trackers


class EvaluationSettings(RowFormat):
    """Held-out evaluation while training: before the first step, every `every_steps` optimizer steps and after
    the last (the Trainer's `eval_on_start` and step strategy), on at most `max_samples` examples that are not
    trained on. SFT records the loss on them (`eval_loss`). GRPO records the mean total reward (the rewards summed
    with their weights, as in training) of ONE completion per evaluation prompt, sampled the way training samples
    (temperature `grpo.temperature`, at most `grpo.max_completion_length` tokens; not greedy): a noisy estimate,
    which a larger `max_samples` steadies (`eval_reward`)."""

    fraction: float | None = Field(
        default=None,
        gt=0.0,
        lt=0.5,
        description="Hold this share of the training dataset out for evaluation, picked at random with "
        "`training.seed` (the same seed holds the same rows out on every attempt); the rest is trained on. "
        "Give `fraction` or `store_path`, not both.",
    )
    store_path: str | None = Field(
        default=None,
        max_length=1024,
        description="Path of a JSONL file of evaluation examples inside the artifact store, in the training "
        "dataset's formats or in `format` with `columns` (set by the control plane when it publishes "
        "`evaluation.local_file`).",
    )
    every_steps: int = Field(
        default=50, ge=1, le=10_000_000,
        description="Evaluate every this many optimizer steps, besides once before the first step and once after "
        "the last.",
    )
    max_samples: int = Field(
        default=200, ge=1, le=100_000,
        description="Evaluate on at most this many examples (a seeded sample of the held-out ones), so that "
        "evaluation stays a small share of the run's time and cost.",
    )

    @model_validator(mode="after")
    def _exactly_one_source(self) -> EvaluationSettings:
        if (self.fraction is None) == (self.store_path is None):
            raise ValueError("give exactly one of `fraction` (a held-out share of the dataset) or `store_path` "
                             "(an evaluation file in the store)")
        if self.store_path is None and (self.format != "auto" or self.columns):
            raise ValueError("`format` and `columns` describe an evaluation file (`store_path`): the held-out "
                             "`fraction` of the dataset is in the dataset's format already; remove them")
        return self
