"""The evaluate file (`EvaluateSpec`): what the `evaluate` flow's form shows and a TOML evaluate file holds: a base
model, its LoRA adapters (named as a serve file names them), the task evaluations and benchmarks a run's
`[evaluation]` takes, asked of them all on one rented GPU; or asked through a serving endpoint's OpenAI route instead
(`openai_base_url`), with the built-in graders only."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from loraflow_worker.contract.evaluate import MAX_EVALUATED_ADAPTERS
from loraflow_worker.contract.task_evaluation import MAX_TASKS
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from flows.forms.run import (
    ARTIFACT_STORE_PATTERN,
    BLOCK_NAME_PATTERN,
    SpecError,
    WorkerSpec,
    describe_validation_error,
    read_run_file,
)
from flows.forms.run_data import BenchmarkSpec, EvaluationSpec, TaskSpec
from flows.forms.serve import AdapterSpec
from tasks.placement.plan import max_deadline_minutes
from tasks.runpod.catalog import resolve_gpu
from tasks.storage.served_adapters import default_adapter_name

SECTION = "evaluate"
"""The section the tasks and benchmarks are under: their files are read, checked and stored by these fields."""
_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"


class EvaluateSettings(BaseModel):
    """What to compare, on what it is asked, for how long."""

    model_config = ConfigDict(extra="forbid")

    base_model: str = Field(min_length=1, description="The base model every adapter was trained on: a Hub model id "
                            "(pinned to its current commit when the evaluation starts), or a local folder (local "
                            "mode). It answers every prompt too, as the leaderboard's `base` row. With "
                            "`openai_base_url`: the model name the endpoint serves the base as.")
    adapters: list[AdapterSpec] = Field(
        min_length=1, max_length=MAX_EVALUATED_ADAPTERS,
        description="The LoRA adapters of `base_model` to compare, as a serve file names them: each a source string "
        "(`runs/<id>` of `artifact_store`, a Hub repo `<org>/<repo>` read at its current commit, a folder in local "
        "mode) or `{ name = \"...\", source = \"...\" }`; `name` is its leaderboard row (default: the last part of "
        "`source`). With `openai_base_url`: `name` is the model name the endpoint serves it as.")
    gpu: list[str] = Field(default=["RTX 4090", "A100 SXM"], min_length=1,
                           description="GPU classes to choose from (names or aliases of the train form's "
                           "`compute.gpu`): the cheapest one in stock whose memory holds the base in bf16. Unused with "
                           "`openai_base_url`.")
    tasks: list[TaskSpec] = Field(
        default_factory=list, max_length=MAX_TASKS,
        description=EvaluationSpec.model_fields["tasks"].description.replace("[[evaluation.tasks]]",
                                                                            "[[evaluate.tasks]]")
        .replace("of the adapter", "of each adapter") + " The first task's first grader ranks the leaderboard.")
    benchmarks: BenchmarkSpec | None = Field(
        default=None,
        description="lm-evaluation-harness benchmarks (`[evaluate.benchmarks]`), as a run's `[evaluation.benchmarks]`, "
        "for the base and each adapter; with no task, the first benchmark ranks the leaderboard. Refused with "
        "`openai_base_url`.")
    deadline_minutes: int = Field(
        default=60, ge=5, json_schema_extra={"maximum": max_deadline_minutes()},
        description="Wall-clock limit of the evaluation, queueing included: the worker stops at it (storing the "
        "scores it has), so it also caps the bill.")
    openai_base_url: str | None = Field(
        default=None, max_length=1024, pattern=r"^https?://\S+$",
        description="Ask a serving endpoint instead of renting a GPU: its OpenAI base URL (a serve prints it, e.g. "
        "`https://api.runpod.ai/v2/<endpoint id>/openai/v1`), so that what is served is what is measured. Each "
        "prompt is asked of `base_model` and of each adapter's `name` there, and graded on this control plane by the "
        "built-in graders only: function graders, judges and benchmarks run your code or another model, which only a "
        "rented worker does.")
    openai_api_key_secret: str | None = Field(
        default=None, max_length=100, pattern=BLOCK_NAME_PATTERN,
        description="With `openai_base_url`: the Prefect Secret block holding its API key (a RunPod endpoint's: your "
        "RunPod API key). Empty: no key is sent.")

    @field_validator("adapters", mode="before")
    @classmethod
    def _sources(cls, value: Any) -> Any:
        return [{"source": item} if isinstance(item, str) else item for item in value] if isinstance(value, list) else value

    @field_validator("gpu")
    @classmethod
    def _known_gpus(cls, names: list[str]) -> list[str]:
        for name in names:
            resolve_gpu(name)
        return names

    @model_validator(mode="after")
    def _distinct_rows(self) -> EvaluateSettings:
        names = self.labels()
        bad = [n for n in names if not re.match(_NAME, n)]
        if bad:
            raise ValueError(f"adapters: {bad} cannot be leaderboard rows (letters, digits, `.`, `_`, `-`): give each "
                             "a `name`")
        twice = sorted({n for n in names if names.count(n) > 1})
        taken = [n for n in ("base", self.base_model) if n in names]
        if twice or taken:
            raise ValueError(f"adapters: the names {twice or taken} are taken twice (the base is the row `base`, and "
                             "answers to base_model at an endpoint): give the adapters distinct names")
        return self

    @model_validator(mode="after")
    def _something_to_ask(self) -> EvaluateSettings:
        if not self.tasks and self.benchmarks is None:
            raise ValueError("set `[[evaluate.tasks]]` or `[evaluate.benchmarks]`: there is nothing to ask")
        names = [task.name for task in self.tasks]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"tasks: the names {twice} are taken twice: give each task its own")
        return self

    @model_validator(mode="after")
    def _endpoint_mode_runs_no_user_code(self) -> EvaluateSettings:
        if self.openai_base_url is None:
            if self.openai_api_key_secret is not None:
                raise ValueError("openai_api_key_secret is the key of openai_base_url, which is not set: set both, "
                                 "or remove it")
            return self
        problems = [f"evaluate.tasks[{i}].graders[{j}]: the `{grader.kind}` grader "
                    + ("runs your code" if grader.kind == "function" else "asks another model")
                    + ", which only a rented worker does: leave openai_base_url out to rent one, or grade with a "
                    "built-in (exact_match, contains, regex, numeric, f1)"
                    for i, task in enumerate(self.tasks) for j, grader in enumerate(task.grader_settings())
                    if grader.kind in ("function", "judge")]
        if self.benchmarks is not None:
            problems.append("evaluate.benchmarks: lm-evaluation-harness runs on a rented worker only: leave "
                            "openai_base_url out to rent one, or remove the benchmarks")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def labels(self) -> list[str]:
        """Each adapter's leaderboard row (and, with `openai_base_url`, its model name), in the order given."""
        return [a.name or default_adapter_name(a.source) for a in self.adapters]

    def task_paths(self) -> list[tuple[str, str]]:
        """(field, path as written) of the task files, function graders' files and benchmarks' task folder, named
        under `evaluate.` as a run's are under `evaluation.`."""
        as_run = EvaluationSpec.model_construct(tasks=self.tasks, benchmarks=self.benchmarks).task_paths()
        return [(SECTION + field.removeprefix("evaluation"), path) for field, path in as_run]


class EvaluateSpec(BaseModel):
    """An evaluate file: a name, the store the results (and the `runs/<id>` adapters) are in, the Hub token, the
    budget, the worker's secrets, and `[evaluate]`."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=_NAME, description="The evaluation's label: in its endpoint's name, its flow run's name "
                      "and the leaderboard's title.")
    artifact_store: str = Field(
        max_length=1024, pattern=ARTIFACT_STORE_PATTERN,
        description="Where the task files, the answers and the scores are stored (`runs/<flow run id>/`), and where "
        "`runs/<id>` adapters are read: `hf://datasets/<org>/<repo>` or `file:///abs/path` (local mode).")
    budget_usd: float | None = Field(
        default=None, gt=0, le=100_000,
        description="Refuse to start when the evaluation's worst-case cost (the GPU's price × deadline_minutes) is "
        "above this. Empty means no budget check (the operator's cap still applies).")
    hub_token_secret: str | None = Field(
        default=None, max_length=100, pattern=BLOCK_NAME_PATTERN,
        description="Name of a Prefect Secret block holding your Hugging Face token (on a shared server, your own): "
        "the checks and the worker read the base, Hub adapters and an hf:// store with it. Unset: the HF_TOKEN of the "
        "process running the flow (else its `hf-token` Secret block).")
    worker: WorkerSpec = Field(
        default_factory=WorkerSpec,
        description="The worker's own environment, as a run's `[worker]`: e.g. a judge's API key in `secrets`.")
    evaluate: EvaluateSettings = Field(description="The base, its adapters and what they are asked.")

    def local_paths(self) -> list[tuple[str, str]]:
        """(field, path as written) of every file or folder of this machine the evaluation reads: its task files,
        graders' files, benchmarks' task folder, and local adapters and base (local mode)."""
        paths = self.evaluate.task_paths()
        if self.evaluate.openai_base_url is None:
            paths += [(f"evaluate.adapters[{i}].source", a.source) for i, a in enumerate(self.evaluate.adapters)
                      if a.source.startswith(("/", "./", "../", "~"))]
        return paths


def load_evaluate_file(path: str | Path) -> EvaluateSpec:
    """Parse and validate a TOML evaluate file; `SpecError` names every bad field."""
    path = Path(path)
    try:
        return EvaluateSpec.model_validate(read_run_file(path))
    except ValidationError as e:
        raise SpecError(describe_validation_error(e, str(path)).replace("the run spec", "the evaluate file")) from e
