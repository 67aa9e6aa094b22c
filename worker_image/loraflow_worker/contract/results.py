"""What the worker sends back: progress while it trains, the result of a finished run with its metrics and
trackers, and what a run stopped by its deadline stored; and where a run's folder lies in the artifact store."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from loraflow_worker.contract.stored_inputs import Sha256
from loraflow_worker.contract.task_evaluation import BenchmarkScore, TaskScore
from loraflow_worker.contract.version import CONTRACT_VERSION, _Strict


class EarlyStopped(_Strict):
    """What `training.early_stopping` did in a run: where training ended, of how many steps, and which
    evaluation's adapter was kept."""

    metric: str = Field(description="The evaluation metric watched, by its name here (e.g. `eval_loss`).")
    patience: int = Field(description="Evaluations in a row without an improvement that stop training.")
    min_delta: float = Field(description="The least change that counts as an improvement.")
    stopped: bool = Field(description="True: training stopped before its last step; False: it trained to the end.")
    step: int = Field(description="The step training ended at (`steps`).")
    total_steps: int = Field(description="Optimizer steps the run was to take.")
    best_step: int | None = Field(
        description="The step of the best evaluation, whose adapter is the run's adapter (None: no evaluation gave a "
        "number, and the adapter is the last step's).")
    best_value: float | None = Field(description="`metric` at `best_step`.")
    reason: str | None = Field(
        description="Why training stopped, e.g. `eval_loss did not improve by more than 0.01 for 3 evaluations`; None "
        "when it trained to the end.")

    def summary(self) -> str:
        """One line for people: where training ended and which step's adapter the run keeps."""
        if self.best_step is None:
            kept = f"adapter from step {self.step}: no evaluation gave a {self.metric}"
        else:
            kept = f"adapter from step {self.best_step} ({self.metric} {self.best_value:.4f}, the best evaluation)"
        if self.stopped:
            return f"stopped at step {self.step} of {self.total_steps}: {self.reason}; {kept}"
        return f"trained to step {self.step} of {self.total_steps}; {kept}"


class TrainMetrics(_Strict):
    """Summary of a finished training run, as stored in `metrics.json`."""

    steps: int = Field(description="Optimizer steps taken.")
    losses: list[tuple[int, float]] = Field(description="(step, training loss) pairs, in step order.")
    rewards: list[tuple[int, float]] = Field(
        default_factory=list, description="GRPO: (step, mean total reward of the step's completions) pairs; empty for SFT."
    )
    eval_loss: list[tuple[int, float]] = Field(
        default_factory=list,
        description="SFT with `evaluation`: (step, loss on the held-out examples) pairs in step order, from step 0 "
        "(before training) to the last step; empty otherwise.",
    )
    eval_reward: list[tuple[int, float]] = Field(
        default_factory=list,
        description="GRPO with `evaluation`: (step, mean total reward of one sampled completion per held-out prompt) "
        "pairs in step order, from step 0 to the last step; empty otherwise.",
    )
    reward_accuracies: list[tuple[int, float]] = Field(
        default_factory=list,
        description="DPO: (step, share of the step's pairs whose chosen answer the adapter raised above the rejected "
        "one, relative to the reference: TRL's `rewards/accuracies`) pairs; empty otherwise.",
    )
    reward_margins: list[tuple[int, float]] = Field(
        default_factory=list,
        description="DPO: (step, mean of the chosen answer's implicit reward minus the rejected one's: TRL's "
        "`rewards/margins`) pairs; empty otherwise.",
    )
    eval_reward_accuracies: list[tuple[int, float]] = Field(
        default_factory=list,
        description="DPO with `evaluation`: `reward_accuracies` on the held-out pairs, from step 0 to the last step.",
    )
    eval_reward_margins: list[tuple[int, float]] = Field(
        default_factory=list,
        description="DPO with `evaluation`: `reward_margins` on the held-out pairs, from step 0 to the last step.",
    )
    learning_rates: list[tuple[int, float]] = Field(
        default_factory=list,
        description="(step, learning rate) pairs of every logged step, in step order: the schedule as the Trainer "
        "applied it (with LoRA+, the A matrices' rate; the B matrices' is `lora.loraplus_lr_ratio` times it).",
    )
    first_loss: float | None = Field(description="Loss at the first logged step.")
    final_loss: float | None = Field(description="Loss at the last logged step.")
    tokens: int = Field(description="Training tokens processed (non-padding).")
    wall_seconds: float = Field(description="Seconds spent in training.")
    device: str = Field(description="Device trained on, e.g. `cpu` or `cuda:0 (NVIDIA H100 80GB HBM3)`.")
    early_stopping: EarlyStopped | None = Field(
        default=None,
        description="With `training.early_stopping`: where training ended, of how many steps, why, and the step whose "
        "adapter the run stored (its best evaluation); None otherwise.",
    )
    task_scores: list[TaskScore] = Field(
        default_factory=list,
        description="With `evaluation.tasks`: per task and grader, the base's and the kept adapter's mean scores and "
        "their difference, each with its standard error.",
    )
    benchmark_scores: list[BenchmarkScore] = Field(
        default_factory=list,
        description="With `evaluation.benchmarks`: per lm-evaluation-harness task and metric, the base's and the "
        "adapter's scores with the harness's standard errors.",
    )


class TrackerRun(_Strict):
    """Where one tracker recorded an attempt (`training.report_to`)."""

    tracker: Literal["wandb", "mlflow"] = Field(description="The tracker.")
    run_id: str = Field(description="The tracker's own id of the run.")
    run_name: str = Field(description="The run's name in the tracker: `<run id>-a<attempt>`.")
    url: str | None = Field(
        default=None, description="The run's page in the tracker (W&B online, an MLflow tracking server); None when "
        "the run was recorded locally only (W&B offline, an MLflow file store).")
    store_path: str | None = Field(
        default=None, description="Folder of the tracker's local files inside the artifact store (the offline W&B "
        "run or the MLflow file store); None when none were stored.")
    note: str = Field(default="", description="How to open what was stored, or why something was not.")


class JobResult(_Strict):
    """What the worker returns as the job's `output` when training completed."""

    contract_version: int = Field(default=CONTRACT_VERSION)
    run_id: str
    attempt: int
    status: Literal["completed"] = "completed"
    run_prefix: str = Field(description="Path of this run's folder inside the artifact store, e.g. `runs/<run_id>`.")
    adapter_path: str = Field(description="Path of the adapter folder inside the artifact store.")
    metrics: TrainMetrics
    resumed_from_step: int = Field(
        default=0, description="The step of the checkpoint this attempt resumed from (0: it trained from the start): "
        "what `metrics` holds of the steps before it, an earlier attempt trained.")
    trackers: list[TrackerRun] = Field(
        default_factory=list, description="Where the trackers of `training.report_to` recorded this attempt.")
    adapter_sha256: dict[str, Sha256] = Field(
        default_factory=dict,
        description="Path relative to `adapter_path` → sha256 of each adapter file, as the worker stored it: "
        "publishing and merging refuse an adapter that differs. Empty: stored by a worker before contract version 10.")
    revision: str | None = Field(
        default=None,
        description="The store commit that holds the adapter and `DONE`, where publishing and merging read the "
        "adapter. Set in the job's output; None in the stored `result.json` (it is written in that commit, which cannot name "
        "itself) and for a `file://` store, which has no revisions.")


class PartialResult(_Strict):
    """What a run stopped by its job's deadline stored, as `<run_prefix>/partial/result.json`. The run is not
    complete (there is no `DONE`): a new attempt resumes from `checkpoint_path`."""

    contract_version: int = Field(default=CONTRACT_VERSION)
    run_id: str = Field(description="The Prefect flow run id.")
    attempt: int = Field(description="The attempt that stored this.")
    step: int = Field(description="Optimizer steps taken when training stopped.")
    total_steps: int = Field(description="Optimizer steps the run was to take.")
    loss: float | None = Field(description="The last logged training loss; None when none was logged.")
    stopped_because: str = Field(description="Why training stopped before its last step.")
    adapter_path: str = Field(description="Folder of the adapter trained so far, inside the artifact store.")
    checkpoint_path: str = Field(description="Folder of the checkpoint of `step` inside the artifact store.")


class Progress(_Strict):
    """A progress update the worker sends while training (`runpod.serverless.progress_update`)."""

    kind: Literal["progress"] = "progress"
    stage: Literal["loading", "training", "saving"] = Field(description="What the worker is doing.")
    step: int = Field(default=0, description="Optimizer steps done.")
    total_steps: int | None = Field(default=None, description="Optimizer steps planned, when known.")
    loss: float | None = Field(default=None, description="Latest training loss.")
    reward: float | None = Field(default=None, description="Latest mean total reward (GRPO).")
    reward_accuracy: float | None = Field(
        default=None, description="DPO: the latest share of pairs whose chosen answer the adapter prefers (the "
        "held-out pairs' once evaluated, else the training pairs')."
    )
    eval_loss: float | None = Field(
        default=None, description="Latest loss on the held-out examples (SFT with evaluation).")
    eval_reward: float | None = Field(
        default=None, description="Latest mean reward on the held-out prompts (GRPO with evaluation).")
    eval_reward_accuracy: float | None = Field(
        default=None, description="Latest reward accuracy on the held-out pairs (DPO with evaluation: "
        "`eval_reward_accuracies`' latest value).")
    eval_reward_margin: float | None = Field(
        default=None, description="Latest reward margin on the held-out pairs (DPO with evaluation: "
        "`eval_reward_margins`' latest value).")
    eval_step: int | None = Field(
        default=None, description="The step of the latest evaluation, whose values the `eval_*` fields hold: a new "
        "one tells the control plane that an evaluation happened (None: none yet).")
    tokens_per_second: float | None = Field(default=None, description="Training tokens per second in this attempt so far.")
    eta_seconds: float | None = Field(default=None, description="Estimated seconds until training ends.")
    message: str = Field(default="", max_length=2000, description="Free text for the log.")


PROGRESS_EVAL_FIELDS = {"eval_loss": "eval_loss", "eval_reward": "eval_reward",
                        "eval_reward_accuracy": "eval_reward_accuracies", "eval_reward_margin": "eval_reward_margins"}
"""`Progress`' evaluation fields → the metric each is the latest value of (its name in `TrainMetrics` and in
`training.early_stopping.metric`)."""


TRAJECTORIES_FILE = "trajectories.jsonl"
"""A GRPO run's sample of trajectories, beside its metrics in the run's folder (one JSON object per line: `step`,
`prompt`, `tool_calls` with their `result`, `answer`, `reward`, `rewards`)."""


def run_prefix(run_id: str) -> str:
    """The folder of a run inside the artifact store. Both sides derive it the same way."""
    return f"runs/{run_id}"
