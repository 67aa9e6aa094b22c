"""The settings every training method shares: the optimisation, held-out evaluation, early stopping (the LoRA
adapter's shape is `lora_settings`)."""

from __future__ import annotations

from typing import Literal, NamedTuple, Protocol

from pydantic import Field, field_validator, model_validator

from loraflow_worker.contract.chat_templates import trl_template_names
from loraflow_worker.contract.fast_path_settings import FastPathSettings
from loraflow_worker.contract.sources import RowFormat
from loraflow_worker.contract.task_evaluation import MAX_TASKS, BenchmarkSettings, TaskEvaluation
from loraflow_worker.contract.version import _Strict

LrScheduler = Literal["linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
                      "inverse_sqrt", "reduce_lr_on_plateau"]
"""transformers 5.20's `SchedulerType` names that need nothing beyond the warmup."""
REFUSED_LR_SCHEDULERS = {
    "cosine_with_min_lr": "it needs a floor (`min_lr` in transformers' `lr_scheduler_kwargs`), which loraflow does "
                          "not take: use `cosine`",
    "cosine_warmup_with_min_lr": "it needs a floor (`min_lr` in transformers' `lr_scheduler_kwargs`), which loraflow "
                                 "does not take: use `cosine`",
    "warmup_stable_decay": "it needs `num_decay_steps` (transformers' `lr_scheduler_kwargs`), which loraflow does not "
                           "take: use `cosine` or `linear`",
    "greedy": "it steers by evaluation metrics through `lr_scheduler_kwargs`, which loraflow does not take",
}
"""The other `SchedulerType` names, and why a run cannot use them."""

Optimizer = Literal[
    "adamw_torch", "adamw_torch_fused", "adafactor", "sgd", "adagrad", "rmsprop",
    "adamw_bnb_8bit", "adamw_8bit", "ademamix", "ademamix_8bit", "lion_8bit", "lion_32bit", "paged_adamw_32bit",
    "paged_adamw_8bit", "paged_ademamix_32bit", "paged_ademamix_8bit", "paged_lion_32bit", "paged_lion_8bit",
    "rmsprop_bnb", "rmsprop_bnb_8bit", "rmsprop_bnb_32bit",
]
"""transformers 5.20's `OptimizerNames` that the image can build with nothing beyond the learning rate and weight
decay: torch's and bitsandbytes' (the image's GPU stack carries bitsandbytes)."""
BITSANDBYTES_OPTIMIZERS = frozenset(name for name in Optimizer.__args__ if name not in (
    "adamw_torch", "adamw_torch_fused", "adafactor", "sgd", "adagrad", "rmsprop"))
"""The optimizers bitsandbytes implements: they need it installed (the image has it)."""
_NEEDS_TARGET_MODULES = "it optimizes a full model's chosen modules (`optim_target_modules`), not a LoRA adapter"
REFUSED_OPTIMIZERS = {
    "adamw_torch_xla": "it runs on TPUs (torch_xla), not on CUDA GPUs",
    "adamw_torch_npu_fused": "it runs on Ascend NPUs, not on CUDA GPUs",
    "adamw_anyprecision": "it needs torchdistx, which the image does not carry",
    "adamw_torch_4bit": "it needs torchao, which the image does not carry",
    "adamw_torch_8bit": "it needs torchao, which the image does not carry: `adamw_8bit` is bitsandbytes' 8-bit AdamW",
    "galore_adamw": _NEEDS_TARGET_MODULES, "galore_adamw_8bit": _NEEDS_TARGET_MODULES,
    "galore_adafactor": _NEEDS_TARGET_MODULES, "galore_adamw_layerwise": _NEEDS_TARGET_MODULES,
    "galore_adamw_8bit_layerwise": _NEEDS_TARGET_MODULES, "galore_adafactor_layerwise": _NEEDS_TARGET_MODULES,
    "apollo_adamw": _NEEDS_TARGET_MODULES, "apollo_adamw_layerwise": _NEEDS_TARGET_MODULES,
    "lomo": "it needs lomo-optim, which the image does not carry",
    "adalomo": "it needs lomo-optim, which the image does not carry",
    "grokadamw": "it needs grokadamw, which the image does not carry",
    "schedule_free_radam": "it needs schedulefree, which the image does not carry",
    "schedule_free_adamw": "it needs schedulefree, which the image does not carry",
    "schedule_free_sgd": "it needs schedulefree, which the image does not carry",
    "stable_adamw": "it needs torch-optimi, which the image does not carry",
}
"""The other `OptimizerNames`, and why a run cannot use them."""
EvalMetric = Literal["eval_loss", "eval_reward", "eval_reward_accuracies", "eval_reward_margins"]
"""The held-out evaluation metrics a run records, by their names in `TrainMetrics` (`metrics.json`)."""
class EvalMetricInfo(NamedTuple):
    algorithms: tuple[str, ...]
    """The algorithms whose runs record it."""
    better: Literal["lower", "higher"]
    log_key: str
    """The key TRL's trainer logs it under."""


EVAL_METRICS: dict[str, EvalMetricInfo] = {
    "eval_loss": EvalMetricInfo(("sft", "dpo"), "lower", "eval_loss"),
    "eval_reward": EvalMetricInfo(("grpo",), "higher", "eval_reward"),
    "eval_reward_accuracies": EvalMetricInfo(("dpo",), "higher", "eval_rewards/accuracies"),
    "eval_reward_margins": EvalMetricInfo(("dpo",), "higher", "eval_rewards/margins"),
}
"""Each evaluation metric: who records it, which way is better, and where TRL logs it."""


def default_eval_metric(algorithm: str) -> str:
    """The evaluation metric an algorithm records first: the held-out loss (SFT, DPO) or mean reward (GRPO)."""
    return "eval_reward" if algorithm == "grpo" else "eval_loss"


class EarlyStoppingSettings(_Strict):
    """The rule of transformers' `EarlyStoppingCallback` (`early_stopping_patience`, `early_stopping_threshold`),
    with the best evaluation's adapter kept as `load_best_model_at_end` keeps it."""

    metric: EvalMetric | None = Field(
        default=None,
        description="The evaluation metric watched: `eval_loss` (SFT, DPO; lower is better), `eval_reward` (GRPO; "
        "higher is better), `eval_reward_accuracies` or `eval_reward_margins` (DPO's held-out pairs; higher is "
        "better). Empty: `eval_loss`, or `eval_reward` for GRPO.",
    )
    patience: int = Field(
        default=3, ge=1, le=10_000,
        description="Stop after this many evaluations in a row (every `evaluation.every_steps` steps) that did not "
        "improve on the best by more than `min_delta`.",
    )
    min_delta: float = Field(
        default=0.0, ge=0.0, le=1_000_000.0,
        description="How much better than the best so far an evaluation must be to count as an improvement (0: any "
        "better value).",
    )

    def metric_for(self, algorithm: str) -> str:
        """The metric watched in a run of `algorithm`."""
        return self.metric or default_eval_metric(algorithm)


class TrainingSettings(_Strict):
    """Optimisation settings shared by every algorithm."""

    learning_rate: float = Field(default=2e-4, gt=0.0, le=1.0, description="Peak learning rate of the adapter weights.")
    lr_scheduler: LrScheduler = Field(
        default="linear",
        description="How the learning rate moves over the run (transformers `lr_scheduler_type`): `linear` (down to "
        "0), `cosine` (a half cosine down to 0), `cosine_with_restarts`, `polynomial`, `constant`, "
        "`constant_with_warmup`, `inverse_sqrt`, or `reduce_lr_on_plateau` (SFT with `evaluation`: divided by 10 when "
        "the eval loss stops falling). Each but `constant` and `reduce_lr_on_plateau` starts with the warmup.",
    )
    warmup_ratio: float | None = Field(
        default=None, ge=0.0, lt=1.0,
        description="Warm the learning rate up linearly from 0 over this share of the optimizer steps (e.g. 0.03). "
        "Give `warmup_ratio` or `warmup_steps`, not both; neither: no warmup.",
    )
    warmup_steps: int | None = Field(
        default=None, ge=0, le=10_000_000,
        description="Warm the learning rate up linearly from 0 over this many optimizer steps. Give `warmup_ratio` or "
        "`warmup_steps`, not both.",
    )
    weight_decay: float = Field(
        default=0.0, ge=0.0, le=1.0,
        description="Decoupled weight decay of the optimizer (transformers `weight_decay`), on every trained weight "
        "but biases and norms. 0: none.",
    )
    max_grad_norm: float = Field(
        default=1.0, ge=0.0, le=1_000_000.0,
        description="Clip the gradients to this global norm before each optimizer step (transformers "
        "`max_grad_norm`). 0: no clipping.",
    )
    optimizer: Optimizer | None = Field(
        default=None,
        description="The optimizer (transformers `optim`): `adamw_torch`, `adamw_torch_fused`, `adafactor`, `sgd`, "
        "`adagrad`, `rmsprop`, or one of bitsandbytes' (`adamw_8bit`, `paged_adamw_8bit`, `paged_adamw_32bit`, "
        "`lion_8bit`, `lion_32bit`, `paged_lion_8bit`, `ademamix`, `ademamix_8bit`, `rmsprop_bnb_8bit`, ...: the "
        "8-bit ones keep a quarter of a 32-bit optimizer's state). Empty: automatic, torch's fused AdamW, or "
        "bitsandbytes' 8-bit paged AdamW when the memory plan finds memory short (as `fast_paths` decide).",
    )
    epochs: float = Field(default=1.0, gt=0.0, le=1000.0, description="Passes over the dataset. Ignored when `max_steps` is set.")
    max_steps: int | None = Field(
        default=None, ge=1, le=10_000_000, description="Stop after this many optimizer steps. None trains for `epochs`."
    )
    batch_size: int = Field(default=8, ge=1, le=4096, description="Examples per device per optimizer step.")
    gradient_accumulation_steps: int = Field(default=1, ge=1, le=1024, description="Micro-batches summed per optimizer step.")
    max_seq_length: int = Field(default=1024, ge=8, le=262_144, description="Tokens per example; longer examples are truncated.")
    loss_on: Literal["completion", "all"] = Field(
        default="completion",
        description="SFT: which tokens the loss is on. `completion`: the answers only — the assistant turns of "
        "`messages` chats, the `completion` of prompt/completion examples (a `text` example has no prompt: all of "
        "it); the prompts, system and user turns are context the model is not trained to write (Axolotl's "
        "`train_on_inputs: false`, hosted fine-tuning). `all`: every token of every example. The assistant turns are "
        "found by the chat template's `{% generation %}` markers (see `chat_template`); the share of tokens that "
        "carry the loss is in the manifest and the summary.",
    )
    packing: bool = Field(
        default=False,
        description="SFT: pack the examples into rows of `max_seq_length` tokens (TRL's best-fit decreasing; an "
        "example longer than a row is truncated, as unpacked) instead of padding each batch to its longest: no "
        "attention across examples (each keeps its own positions, from which transformers builds the mask), the loss "
        "on the same tokens as unpacked. Faster on data of mixed lengths (short chats waste most of a padded batch). "
        "Refused for Gated-DeltaNet hybrids (Qwen3-Next, Qwen3.5), whose linear-attention layers would run across "
        "a packed row's examples. The manifest's fast paths say whether it was engaged.",
    )
    chat_template: str | None = Field(
        default=None,
        max_length=1024,
        description="SFT: the chat template the chats are rendered with, in training and in the saved adapter's "
        "tokenizer. Empty: the model's own where it marks the assistant turns with `{% generation %}`, else TRL's "
        "training version of it (Qwen, Llama 3, Gemma, Phi, DeepSeek, ... families), else the model's own with the "
        "assistant turns found by rendering each turn's prefix (refused before renting where the template rewrites "
        "earlier turns). Or the name of one of TRL's training templates (e.g. `qwen3_training`, `llama3_training`), "
        "or a `.jinja` file on the machine that runs the flow (relative to its working directory), which the run "
        "stores with its inputs.",
    )
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
    early_stopping: EarlyStoppingSettings | None = Field(
        default=None,
        description="Stop training once held-out evaluation (`[evaluation]`, which it needs) stops improving: after "
        "`patience` evaluations in a row without an improvement of more than `min_delta` in `metric`. The adapter "
        "stored is the one of the best evaluation (the last that improved), whether the run stopped early or trained "
        "to its last step; the metrics and the summary say where it stopped, of how many steps, and which step's "
        "adapter was kept. Empty: train every step, keep the last step's adapter.",
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

    @field_validator("chat_template")
    @classmethod
    def _a_template_the_worker_has(cls, template: str | None) -> str | None:
        if template is None or template.endswith((".jinja", ".j2")) or template in trl_template_names():
            return template
        raise ValueError(f"{template!r} is neither a `.jinja` file nor one of TRL's training templates: "
                         f"{', '.join(trl_template_names())}")

    @field_validator("lr_scheduler", mode="before")
    @classmethod
    def _why_a_scheduler_is_refused(cls, name: object) -> object:
        # Before the Literal's own check, so a transformers name loraflow refuses gets its reason.
        if isinstance(name, str) and name in REFUSED_LR_SCHEDULERS:
            raise ValueError(f"`training.lr_scheduler` '{name}' cannot be used: {REFUSED_LR_SCHEDULERS[name]}")
        return name

    @field_validator("optimizer", mode="before")
    @classmethod
    def _why_an_optimizer_is_refused(cls, name: object) -> object:
        if isinstance(name, str) and name in REFUSED_OPTIMIZERS:
            raise ValueError(f"`training.optimizer` '{name}' cannot be used: {REFUSED_OPTIMIZERS[name]}")
        return name

    @model_validator(mode="after")
    def _one_warmup_that_the_scheduler_uses(self) -> TrainingSettings:
        if self.warmup_ratio is not None and self.warmup_steps is not None:
            raise ValueError(f"give `training.warmup_ratio` ({self.warmup_ratio}) or `training.warmup_steps` "
                             f"({self.warmup_steps}), not both: remove one")
        if self.warmup_steps is not None and self.max_steps is not None and self.warmup_steps >= self.max_steps:
            raise ValueError(f"`training.warmup_steps` ({self.warmup_steps}) must be fewer than `training.max_steps` "
                             f"({self.max_steps}): the learning rate would never reach its peak")
        if self.lr_scheduler in ("constant", "reduce_lr_on_plateau") and (self.warmup_ratio or self.warmup_steps):
            fix = "use `constant_with_warmup`" if self.lr_scheduler == "constant" else "remove the warmup"
            raise ValueError(f"`training.lr_scheduler` '{self.lr_scheduler}' has no warmup (transformers builds it "
                             f"without one), yet `training.warmup_ratio` or `training.warmup_steps` is set: {fix}")
        return self

    @property
    def warmup(self) -> int | float:
        """transformers 5's `warmup_steps`: whole steps (from 1), or a share of the steps (below 1)."""
        return self.warmup_steps if self.warmup_steps is not None else self.warmup_ratio or 0

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

    tasks: list[TaskEvaluation] = Field(
        default_factory=list, max_length=MAX_TASKS,
        description="Task evaluations after training: prompts with expected answers, answered by the base and the "
        "kept adapter and graded (`TaskEvaluation`).")
    benchmarks: BenchmarkSettings | None = Field(
        default=None, description="lm-evaluation-harness benchmarks after training, for the base and the adapter.")

    @property
    def held_out(self) -> bool:
        """Whether the run evaluates on held-out rows while training (a `fraction` or an evaluation file)."""
        return self.fraction is not None or self.store_path is not None

    @model_validator(mode="after")
    def _one_source(self) -> EvaluationSettings:
        if self.fraction is not None and self.store_path is not None:
            raise ValueError("give one of `fraction` (a held-out share of the dataset) or `store_path` (an evaluation "
                             "file in the store), not both")
        if not self.held_out and not self.tasks and self.benchmarks is None:
            raise ValueError("give `fraction` (a held-out share of the dataset), `store_path` (an evaluation file in "
                             "the store), `tasks` or `benchmarks`")
        if self.store_path is None and (self.format != "auto" or self.columns):
            raise ValueError("`format` and `columns` describe an evaluation file (`store_path`): the held-out "
                             "`fraction` of the dataset is in the dataset's format already; remove them")
        names = [t.name for t in self.tasks]
        doubled = sorted({n for n in names if names.count(n) > 1})
        if doubled:
            raise ValueError(f"two tasks are named {', '.join(doubled)}: name each task once")
        return self


def sft_only_settings(training: TrainingSettings) -> list[str]:
    """The settings only SFT takes that `training` sets away from their defaults, as `training.<name>`."""
    # Not `model_fields_set`: a job read back from its JSON has every field set.
    return [f"`training.{name}`" for name, default in
            (("loss_on", "completion"), ("chat_template", None), ("packing", False))
            if getattr(training, name) != default]


class HeldOutEvaluation(Protocol):
    """An `[evaluation]` section, the job's or the run form's: whether it holds rows out to evaluate on while
    training (task evaluations and benchmarks alone do not)."""

    @property
    def held_out(self) -> bool: ...


def early_stopping_problems(algorithm: str, training: TrainingSettings,
                            evaluation: HeldOutEvaluation | None) -> list[str]:
    """What is wrong with a job's `training.early_stopping` given its algorithm and evaluation (empty when nothing).
    Shared by the worker's `JobInput` and the control plane's run spec."""
    stopping = training.early_stopping
    if stopping is None:
        return []
    problems = []
    if evaluation is None or not evaluation.held_out:
        problems.append("`training.early_stopping` stops when held-out evaluation stops improving, and the run has no "
                        "held-out rows (`evaluation.fraction` or `evaluation.local_file`): add them (e.g. "
                        "`fraction = 0.1`) or remove `training.early_stopping`")
    metric = stopping.metric_for(algorithm)
    algorithms = EVAL_METRICS[metric].algorithms
    if algorithm not in algorithms:
        recorded = [name for name, info in EVAL_METRICS.items() if algorithm in info.algorithms]
        problems.append(f"`training.early_stopping.metric` '{metric}' is recorded by {' and '.join(algorithms)} runs "
                        f"only, not by algorithm '{algorithm}': use {' or '.join(recorded)}")
    return problems


def optimisation_problems(algorithm: str, training: TrainingSettings, evaluation: HeldOutEvaluation | None,
                          fast_paths: FastPathSettings) -> list[str]:
    """What is wrong with a job's scheduler and optimizer given its other sections (empty when nothing). Shared by the
    worker's `JobInput` and the control plane's run spec, so both refuse the same jobs with the same words."""
    problems = fast_paths.problems(algorithm)
    if training.lr_scheduler == "reduce_lr_on_plateau" and (algorithm != "sft" or evaluation is None
                                                            or not evaluation.held_out):
        # transformers steps ReduceLROnPlateau on the eval loss (`metric_for_best_model` defaults to it).
        problems.append("`training.lr_scheduler` 'reduce_lr_on_plateau' lowers the learning rate when the eval loss "
                        "stops falling: it needs algorithm 'sft' and an `evaluation` section; add one or choose "
                        "another scheduler")
    if training.optimizer is not None:
        for switch in ("paged_adamw_8bit", "fused_adamw"):
            if getattr(fast_paths, switch) is not None:
                problems.append(f"`training.optimizer` ('{training.optimizer}') chooses the optimizer, and so does "
                                f"`fast_paths.{switch}`: remove one of them")
    return problems
