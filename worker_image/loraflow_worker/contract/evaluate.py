"""An evaluate job's input and result: one base model and any number of its LoRA adapters asked the same task
evaluations and benchmarks on one rented worker, so that adapters trained by different runs (or published on the Hub)
are compared on equal terms. The base answers once; every adapter's scores are against that one set of answers.

The control plane's `evaluate` flow builds the input (`flows/evaluate.py`) and ranks the result into a leaderboard.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from loraflow_worker.contract.env_names import MAX_WORKER_ENV, worker_env_name
from loraflow_worker.contract.sources import ModelSource
from loraflow_worker.contract.stored_inputs import Sha256, StoredInputs
from loraflow_worker.contract.task_evaluation import (
    MAX_TASKS,
    BenchmarkScore,
    BenchmarkSettings,
    TaskEvaluation,
    TaskScore,
    taken_twice,
    task_files,
)
from loraflow_worker.contract.version import CONTRACT_VERSION, _Strict

MAX_EVALUATED_ADAPTERS = 16
"""As many adapters as one serve loads: an evaluation of more is a study, not a comparison."""
ADAPTER_LABEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
"""What an adapter's label may be: the leaderboard's row name, and a folder name on the worker."""


class EvaluatedAdapter(_Strict):
    """One adapter to evaluate: a completed run's stored adapter (`run_id`, read from the job's `artifact_store` at
    `adapter_revision` and checked against `adapter_sha256`), or a PEFT adapter folder named by `source` (a Hub repo at
    a pinned revision, or a local folder in local mode). Exactly one of `run_id` and `source`."""

    label: str = Field(description="The adapter's name on the leaderboard: letters, digits, `.`, `_`, `-`.")
    run_id: str | None = Field(
        default=None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._-]+$",
        description="A completed run of `artifact_store` whose adapter (`runs/<run_id>/adapter`) is evaluated.")
    adapter_revision: str | None = Field(
        default=None, min_length=1, max_length=100,
        description="With `run_id`: the store commit that holds the run's adapter (its `JobResult.revision`). None: "
        "the latest (a `file://` store).")
    adapter_sha256: dict[str, Sha256] = Field(
        default_factory=dict,
        description="With `run_id`: path relative to the adapter folder → sha256 of each adapter file as the run "
        "stored it; the worker refuses an adapter that differs.")
    source: ModelSource | None = Field(
        default=None,
        description="A PEFT adapter that is not a run of this store: a Hub repo (pinned to the commit the control "
        "plane read) or, in local mode, a folder.")

    @field_validator("label")
    @classmethod
    def _label(cls, label: str) -> str:
        if not ADAPTER_LABEL.match(label):
            raise ValueError(f"{label!r} cannot be an adapter's label (letters, digits, `.`, `_`, `-`, at most 64)")
        return label

    @model_validator(mode="after")
    def _one_place(self) -> "EvaluatedAdapter":
        if (self.run_id is None) == (self.source is None):
            raise ValueError(f"adapter {self.label!r}: name exactly one of `run_id` and `source`")
        if self.source is not None and (self.adapter_revision is not None or self.adapter_sha256):
            raise ValueError(f"adapter {self.label!r}: `adapter_revision` and `adapter_sha256` belong to a `run_id`")
        return self


class EvaluateInput(_Strict):
    """An evaluate job's `input`: the base and each adapter answer every task and benchmark; the answers and scores
    are stored under `runs/<run_id>/` of `artifact_store`, `DONE` last, and returned as an `EvaluateResult`."""

    contract_version: int = Field(default=CONTRACT_VERSION, description="Version of this contract.")
    mode: Literal["evaluate"] = Field(description="`evaluate`: what makes this an evaluate job.")
    run_id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._-]+$",
                        description="The evaluate flow run's id: its results' folder in the store.")
    artifact_store: str = Field(min_length=1, max_length=1024,
                                description="Artifact store URL: `file:///abs/path` or `hf://datasets/<org>/<repo>`.")
    base_model: ModelSource = Field(description="The base model every adapter was trained on.")
    adapters: list[EvaluatedAdapter] = Field(
        min_length=1, max_length=MAX_EVALUATED_ADAPTERS, description="The adapters, each asked what the base is asked.")
    tasks: list[TaskEvaluation] = Field(
        default_factory=list, max_length=MAX_TASKS,
        description="Task evaluations: prompts with expected answers, graded (their files stored by the control plane).")
    benchmarks: BenchmarkSettings | None = Field(
        default=None, description="lm-evaluation-harness benchmarks; None: none.")
    seed: int = Field(default=42, ge=0, description="Seeds sampling (tasks with a temperature) and the harness.")
    inputs: StoredInputs | None = Field(
        default=None,
        description="The task files, grader files and benchmark task folder as the control plane stored them (commit "
        "and sha256): the worker reads each there and refuses one that changed since.")
    worker_secret_names: list[str] = Field(
        default_factory=list, max_length=MAX_WORKER_ENV,
        description="Names, never values, of secrets RunPod puts in the worker's env (a judge's API key): handed to "
        "the graders and removed from everything the worker stores or returns.")
    deadline_epoch_s: float | None = Field(
        default=None,
        description="Unix time by which the worker must have answered; None means no deadline. Reached, the job "
        "stores and returns the scores it has, and says what is missing (`stopped`).")

    def input_files(self) -> dict[str, str]:
        """Store path → the field that names it, for every file of the job that the worker reads from the store (at
        `inputs`): the task files and grader files."""
        return task_files(self.tasks, "tasks")

    @field_validator("worker_secret_names")
    @classmethod
    def _names_a_job_may_set(cls, names: list[str]) -> list[str]:
        return [worker_env_name(name) for name in names]

    @field_validator("adapters")
    @classmethod
    def _labels_unique(cls, adapters: list[EvaluatedAdapter]) -> list[EvaluatedAdapter]:
        if twice := taken_twice([a.label for a in adapters]):
            raise ValueError(f"adapters: the labels {twice} are taken twice: give each adapter its own")
        return adapters

    @field_validator("tasks")
    @classmethod
    def _task_names_unique(cls, tasks: list[TaskEvaluation]) -> list[TaskEvaluation]:
        if twice := taken_twice([t.name for t in tasks]):
            raise ValueError(f"tasks: the names {twice} are taken twice")
        return tasks

    @model_validator(mode="after")
    def _something_to_ask(self) -> "EvaluateInput":
        if not self.tasks and self.benchmarks is None:
            raise ValueError("an evaluate job needs `tasks` or `benchmarks`: there is nothing to ask")
        return self

    @model_validator(mode="after")
    def _every_file_pinned(self) -> "EvaluateInput":
        # A file the job names but the pins leave out would be read unchecked.
        if self.inputs is not None:
            missing = [f"{field} ({path})" for path, field in self.input_files().items()
                       if path not in self.inputs.sha256]
            if missing:
                raise ValueError(f"no sha256 for {', '.join(missing)}: the control plane pins every file it stores "
                                 "for the job; give each store path's hash in `inputs.sha256`")
        return self


class AdapterScores(_Strict):
    """One adapter's scores: each against the same base answers (`TaskScore.base` is the base's for every adapter)."""

    label: str = Field(description="The adapter's label, as the input named it.")
    task_scores: list[TaskScore] = Field(default_factory=list, description="Per task and grader.")
    benchmark_scores: list[BenchmarkScore] = Field(default_factory=list, description="Per benchmark task and metric.")
    answers_store_path: str | None = Field(
        default=None, description="The folder of this adapter's stored answers (`<task>.jsonl`, base beside adapter, "
        "best and worst first); None when no task ran.")


class EvaluateResult(_Strict):
    """What an evaluate job returns (and stores as `runs/<run_id>/result.json`)."""

    contract_version: int = Field(default=CONTRACT_VERSION)
    run_id: str
    adapters: list[AdapterScores] = Field(description="One entry per adapter, in the input's order.")
    base_model_revision: str | None = Field(default=None, description="The base model's commit; None for a local folder.")
    stopped: str | None = Field(
        default=None, description="Why some scores are missing (the deadline, a grader or benchmark that failed); "
        "None: every task and benchmark was scored for every adapter.")
    seconds: float = Field(default=0.0, ge=0, description="The worker's time on the job, loading included.")
