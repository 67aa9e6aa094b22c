"""Task evaluations and benchmarks: is the adapter better at its task than the base?

A run's `evaluation.tasks` are prompts with expected answers, each answered by the base and by the kept adapter on the
worker that trained, right after training, and graded by built-in graders, the user's grader functions (the reward
files' contract) or a judge model; `evaluation.benchmarks` are EleutherAI lm-evaluation-harness tasks run the same way
for the base and the adapter. What comes back (`TaskScore`, `BenchmarkScore`) holds each score with its standard error
beside the base's, and the difference with the standard error of the paired difference.
"""

from __future__ import annotations

import math
import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from loraflow_worker.contract.version import _Strict

MAX_TASKS = 20
MAX_GRADERS = 10
TASK_NAME_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,47}$"
"""A task's name: it labels scores (`task:<name>/<grader>`), files (`evaluation/<name>.jsonl`) and events."""

BENCHMARK_TASK_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:()-]{0,99}$")
"""An lm-evaluation-harness task, group or tag name (a few of the harness's own hold parentheses)."""

BUILTIN_GRADERS = ("exact_match", "contains", "regex", "numeric", "f1")
"""Graders the worker ships: each scores an answer against the row's expected `answer`."""

GRADERS_WITHOUT_ANSWER = ("function", "judge")
"""Graders that may score rows that carry no `answer` (a function may judge the completion alone; a judge follows its
rubric)."""

GraderKind = Literal["exact_match", "contains", "regex", "numeric", "f1", "function", "judge"]
_FUNCTION_REFERENCE = re.compile(r"^(?P<file>[^:]+\.py):(?P<function>[A-Za-z_][A-Za-z0-9_]*)$")


class GraderSettings(_Strict):
    """One grader of a task's answers. Every grader gives each answer a score in [0, 1]."""

    kind: GraderKind = Field(
        description="`exact_match`: the answer equals the expected one (after `normalize`); `contains`: the expected "
        "answer appears in it; `regex`: `pattern` is searched in the answer and its first group (or the whole match) "
        "compared with the expected one, or, without `pattern`, the expected answer is itself a pattern searched in "
        "the answer; `numeric`: the last number in the answer (or `pattern`'s first group) is within `tolerance` of "
        "the expected number; `f1`: the token overlap F1 of the answer and the expected one (SQuAD's); `function`: "
        "the user's function (`function`), called as a reward function is, with each row's `answer` among its "
        "keyword arguments; `judge`: an OpenAI-compatible model (`judge_model` at `judge_base_url`) asked with "
        "`rubric` to score the answer from 0 to 10, read as a share of 10.")
    name: str | None = Field(
        default=None, pattern=r"^[a-z0-9][a-z0-9_.-]{0,47}$",
        description="How the scores are labelled (`task:<task>/<name>`). None: the kind, or for `function` the "
        "function's name.")
    normalize: bool = Field(
        default=True,
        description="`exact_match`, `contains`, `regex`, `f1`: compare lowercased, without punctuation, articles "
        "(a, an, the) or repeated whitespace (SQuAD's normalisation). False: compare the text as it is, trimmed.")
    pattern: str | None = Field(
        default=None, max_length=500,
        description="`regex` and `numeric`: a regular expression (Python's `re`) whose first group (or whole match) "
        "is the part of the answer that is graded.")
    tolerance: float = Field(
        default=1e-6, ge=0.0,
        description="`numeric`: the largest absolute difference from the expected number that still scores 1.")
    function: str | None = Field(
        default=None, max_length=300,
        description="`function`: `file.py:function`, the file as the control plane stored it (`store_path`), the "
        "function's name in it.")
    store_path: str | None = Field(
        default=None, max_length=1024,
        description="`function`: where the control plane stored the grader's file in the artifact store (pinned by "
        "`JobInput.inputs` as every stored file is).")
    judge_model: str | None = Field(default=None, max_length=200, description="`judge`: the model's name.")
    judge_base_url: str | None = Field(
        default=None, max_length=500,
        description="`judge`: the OpenAI-compatible API's base URL (e.g. `https://api.openai.com/v1`).")
    judge_api_key_env: str | None = Field(
        default=None, max_length=100,
        description="`judge`: the worker variable that holds the judge's API key (one of the run's "
        "`[worker] secrets`); None: the judge's API takes no key.")
    rubric: str | None = Field(
        default=None, max_length=20_000,
        description="`judge`: what makes an answer good; the judge sees it with the prompt, the expected answer (when "
        "the row has one) and the answer, and replies with a score from 0 to 10.")

    @property
    def label(self) -> str:
        if self.name is not None:
            return self.name
        if self.kind == "function" and self.function:
            return self.function.rsplit(":", 1)[-1]
        return self.kind

    @property
    def needs_answer(self) -> bool:
        return self.kind not in GRADERS_WITHOUT_ANSWER

    @model_validator(mode="after")
    def _fields_of_its_kind(self) -> GraderSettings:
        if self.pattern is not None:
            if self.kind not in ("regex", "numeric"):
                raise ValueError(f"`pattern` is for the `regex` and `numeric` graders, not `{self.kind}`")
            try:
                re.compile(self.pattern)
            except re.error as e:
                raise ValueError(f"`pattern` {self.pattern!r} is not a regular expression: {e}") from None
        if self.kind == "function":
            if self.function is None or not _FUNCTION_REFERENCE.match(self.function):
                raise ValueError("a `function` grader names its function as `file.py:function` in `function`")
        elif self.function is not None or self.store_path is not None:
            raise ValueError(f"`function` and `store_path` are for the `function` grader, not `{self.kind}`")
        judge_fields = (self.judge_model, self.judge_base_url, self.judge_api_key_env, self.rubric)
        if self.kind == "judge":
            if not self.judge_model or not self.judge_base_url or not self.rubric:
                raise ValueError("a `judge` grader needs `judge_model`, `judge_base_url` and `rubric`")
        elif any(value is not None for value in judge_fields):
            raise ValueError(f"`judge_model`, `judge_base_url`, `judge_api_key_env` and `rubric` are for the `judge` "
                             f"grader, not `{self.kind}`")
        return self


PROMPT_COLUMNS = ("messages", "prompt")
"""A task row's prompt: `messages` (a chat) or `prompt` (text, or messages); its other columns are `answer` and what
function graders get as keyword arguments."""


def task_prompt(row: dict[str, Any], at: str) -> str | list[dict[str, Any]]:
    """The prompt of a task row: a text `prompt` as it is, or messages up to the last user turn (a trailing assistant
    turn is not the answer, and is dropped). ValueError naming `at` (where the row is) otherwise. The control plane
    checks a task file with it before renting, and the worker reads the rows with it."""
    present = [column for column in PROMPT_COLUMNS if column in row]
    if len(present) != 1:
        raise ValueError(f"{at}: a row has `messages` (a chat) or `prompt` (text or messages), one of them; this one "
                         f"has {', '.join(f'`{c}`' for c in sorted(row)) or 'no columns'}")
    value = row[present[0]]
    if present[0] == "prompt" and isinstance(value, str):
        if not value.strip():
            raise ValueError(f"{at}: `prompt` is empty")
        return value
    if not isinstance(value, list) or not value or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in value):
        raise ValueError(f"{at}: `{present[0]}` is a list of messages, each with a `role` and `content`")
    users = [i for i, message in enumerate(value) if message["role"] == "user"]
    if not users:
        raise ValueError(f"{at}: `{present[0]}` has no user turn to answer")
    return value[:users[-1] + 1]


def function_reference(reference: str) -> tuple[str, str]:
    """(file, function) of a `file.py:function` grader reference; ValueError otherwise."""
    matched = _FUNCTION_REFERENCE.match(reference)
    if matched is None:
        raise ValueError(f"{reference!r} is not `file.py:function`")
    return matched["file"], matched["function"]


class TaskEvaluation(_Strict):
    """One task: prompts with expected answers (a JSONL file: chat `messages` or a plain `prompt`, and `answer`),
    answered by the base and the adapter and graded."""

    name: str = Field(pattern=TASK_NAME_PATTERN, description="The task's name: lowercase letters, digits, `-`, `_`.")
    store_path: str = Field(
        min_length=1, max_length=1024,
        description="The task's JSONL file in the artifact store (set by the control plane when it stores "
        "`local_file`): one prompt a row, as `messages` (the last a user turn) or `prompt` (text, or messages), with "
        "its expected `answer` (text or number) where a grader needs one.")
    graders: list[GraderSettings] = Field(min_length=1, max_length=MAX_GRADERS, description="How answers are scored.")
    max_new_tokens: int = Field(default=256, ge=1, le=32_768, description="The longest answer, in tokens.")
    max_samples: int = Field(
        default=200, ge=1, le=100_000,
        description="Ask at most this many prompts (the first ones of the file), so evaluation stays a small share "
        "of the run's time and cost.")
    temperature: float = Field(
        default=0.0, ge=0.0, le=2.0,
        description="Sampling temperature; 0: greedy (the same answer every time), what a score should be.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling's share (with a temperature).")
    samples_kept: int = Field(
        default=20, ge=0, le=1000,
        description="How many prompts' answers (base and adapter, with their scores) are stored with the run, in "
        "`evaluation/<name>.jsonl` of its folder: the best and worst of the adapter first.")

    @field_validator("graders")
    @classmethod
    def _labels_unique(cls, graders: list[GraderSettings]) -> list[GraderSettings]:
        if doubled := taken_twice([g.label for g in graders]):
            raise ValueError(f"two graders of one task are labelled {', '.join(doubled)}: give each a `name`")
        return graders


def task_files(tasks: list[TaskEvaluation], field: str) -> dict[str, str]:
    """Store path → the field that names it (`<field>[i]`, `<field>[i].graders[j]`), for each task's file and grader
    file: what a job reads from the store at its `inputs` pins."""
    files = {}
    for i, task in enumerate(tasks):
        files[task.store_path] = f"{field}[{i}]"
        files |= {grader.store_path: f"{field}[{i}].graders[{j}]" for j, grader in enumerate(task.graders)
                  if grader.store_path is not None}
    return files


class BenchmarkSettings(_Strict):
    """Standard benchmarks through EleutherAI's lm-evaluation-harness, for the base and the adapter."""

    tasks: list[str] = Field(
        min_length=1, max_length=50,
        description="lm-evaluation-harness task (or group) names, e.g. `hellaswag`, `gsm8k`; with `task_dir`, also "
        "the tasks its YAML files define.")
    limit: int | None = Field(
        default=None, ge=1, le=1_000_000,
        description="At most this many examples per task (the harness's `limit`); None: every example.")
    num_fewshot: int | None = Field(
        default=None, ge=0, le=64,
        description="Few-shot examples per prompt (the harness's `num_fewshot`); None: each task's own default.")
    task_dir_store_path: str | None = Field(
        default=None, max_length=1024,
        description="The folder of the harness's own task YAMLs (and their data files) the control plane stored from "
        "`task_dir`, for private tasks: the harness reads them with `include_path`.")
    batch_size: int = Field(default=8, ge=1, le=1024, description="Prompts scored at once.")

    @field_validator("tasks")
    @classmethod
    def _names(cls, tasks: list[str]) -> list[str]:
        for task in tasks:
            # Parentheses: a few of the harness's names have them (`tmmluplus_education_(profession_level)`).
            if not BENCHMARK_TASK_NAME.match(task):
                raise ValueError(f"{task!r} is not an lm-evaluation-harness task name")
        if len(set(tasks)) != len(tasks):
            raise ValueError("name each benchmark task once")
        return tasks


class TaskScore(_Strict):
    """One task and grader: the base's mean score, the adapter's, and their difference, each with its standard
    error (the difference's from the paired per-prompt differences)."""

    task: str
    grader: str
    n: int = Field(description="Prompts scored (by both the base and the adapter).")
    base: float
    base_stderr: float
    adapter: float
    adapter_stderr: float
    delta: float = Field(description="adapter - base.")
    delta_stderr: float = Field(description="Standard error of the paired difference (per prompt).")
    failed: int = Field(default=0, description="Answers the grader could not score (counted as 0), e.g. a judge that "
                        "did not answer with a score.")
    answered_by: Literal["vllm", "transformers"] | None = Field(
        default=None, description="What generated the answers, the base's and the adapter's alike: `vllm` (one vLLM "
        "engine, the adapter as a LoRA request) or `transformers` (PEFT on the base; where vLLM does not run, or "
        "refuses the adapter, as the job's progress said); None where it was not recorded.")

    @property
    def metric(self) -> str:
        return f"task:{self.task}/{self.grader}"


class BenchmarkScore(_Strict):
    """One benchmark task and metric as lm-evaluation-harness reports them, for the base and the adapter."""

    task: str
    metric: str = Field(description="The harness's metric name, without its filter (e.g. `acc`, `exact_match`).")
    n: int | None = Field(default=None, description="Examples scored, as the harness reports them.")
    base: float
    base_stderr: float | None
    adapter: float
    adapter_stderr: float | None
    delta: float = Field(description="adapter - base.")
    higher_is_better: bool = True

    @property
    def name(self) -> str:
        return f"benchmark:{self.task}/{self.metric}"


def taken_twice(names: list[str]) -> list[str]:
    """The names that appear more than once in `names`, sorted: what a list of named things refuses."""
    return sorted({name for name in names if names.count(name) > 1})


def mean_and_stderr(values: list[float]) -> tuple[float, float]:
    """The mean and its standard error (sample standard deviation / sqrt(n)); 0 for fewer than two values."""
    n = len(values)
    if n == 0:
        return 0.0, 0.0
    mean = sum(values) / n
    if n < 2:
        return mean, 0.0
    variance = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(variance / n)


def task_score(task: str, grader: str, base: list[float], adapter: list[float], failed: int = 0,
               answered_by: Literal["vllm", "transformers"] | None = None) -> TaskScore:
    """The score of one task and grader from the per-prompt scores of the base and the adapter (same prompts, same
    order), answered by `answered_by`."""
    if len(base) != len(adapter):
        raise ValueError(f"{task}/{grader}: {len(base)} base scores but {len(adapter)} adapter scores")
    base_mean, base_se = mean_and_stderr(base)
    adapter_mean, adapter_se = mean_and_stderr(adapter)
    _, delta_se = mean_and_stderr([a - b for a, b in zip(adapter, base)])
    return TaskScore(task=task, grader=grader, n=len(base), base=base_mean, base_stderr=base_se,
                     adapter=adapter_mean, adapter_stderr=adapter_se, delta=adapter_mean - base_mean,
                     delta_stderr=delta_se, failed=failed, answered_by=answered_by)
