"""The run form's data sections: where training rows come from (`[dataset]`, its `[[dataset.mix]]` entries) and
which rows are held out to evaluate on (`[evaluation]`), as `flows.forms.run.RunSpec` takes them. Every source is
checked before anything is rented; these models say what a source is, the checks read it.
"""

from __future__ import annotations

import math
from typing import Annotated

from loraflow_worker.contract import (
    BenchmarkSettings,
    EvaluationSettings,
    GraderSettings,
    MixSource,
    RowFormat,
    SourceFields,
    TaskEvaluation,
)
from loraflow_worker.contract.task_evaluation import BUILTIN_GRADERS, MAX_GRADERS, MAX_TASKS, function_reference
from loraflow_worker.contract.dataset_formats import DatasetFormat, columns_problem
from loraflow_worker.contract.sources import MAX_MIX_SOURCES
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from tasks.storage.hub_datasets import FIRST_ROWS


class Section(BaseModel):
    """A section of the run form. An unknown key is refused: a misspelt field silently left at its default would
    train something other than what was meant."""

    model_config = ConfigDict(extra="forbid")


_LOCAL_FILE_DESCRIPTION = (
    "Path of a JSONL file on the machine that runs the flow, one example per line in `format`. With `auto`, one of "
    "TRL's conversational formats: `{\"messages\": [...]}` (SFT, GRPO), `{\"prompt\": [...], \"completion\": [...]}` "
    "(SFT, GRPO) or prompt-only `{\"prompt\": [...], ...}` (GRPO; other columns such as `answer` reach the rewards). "
    "Every line is converted and checked before anything is rented, and the file is published to the run's artifact "
    "store for the worker. Relative paths are resolved from the working directory."
)


class _SourceSpec(Section):
    """One source of training rows: a Hub dataset or a local JSONL file, in a format, with the dataset's own column
    names."""

    hub_id: str | None = Field(
        default=None, max_length=512, pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]*$",
        description="Hugging Face Hub dataset id, e.g. `trl-lib/Capybara`. Leave empty to use `local_file`. Checked "
        "before anything is rented: the dataset, its `revision`, `config` and `split` exist (configs and splits as "
        "its README's `configs:` declares them, or as `datasets` finds them by file name), and the first "
        f"{FIRST_ROWS} rows convert and have the format the algorithm trains on when the split's first file is JSON "
        "Lines (other files, "
        "e.g. Parquet, are read by the worker only); the run trains on the commit the revision names then.",
    )
    config: str | None = Field(
        default=None, max_length=256, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
        description="The Hub dataset's config (subset), e.g. `main` for `openai/gsm8k`: "
        "`load_dataset(hub_id, config, split=split, revision=revision)`. Empty: the dataset's only or default config "
        "(a dataset with several and no default is refused, naming them). Hub datasets only.",
    )
    revision: str | None = Field(
        default=None, max_length=256,
        description="The Hub dataset's revision: a branch, tag or commit sha. Empty: its default branch. Either way "
        "the run is pinned to the commit it names when the run starts, and the manifest records it. Hub datasets only.",
    )
    split: str = Field(default="train", max_length=128, pattern=r"^[A-Za-z0-9_.\[\]:%-]+$",
                       description="Split of the Hub dataset to train on (`datasets` slicing such as `train[:1000]` "
                       "works).")
    local_file: str | None = Field(default=None, max_length=4096, description=_LOCAL_FILE_DESCRIPTION)
    # The job's own fields: the same choices, defaults and descriptions.
    format: DatasetFormat = RowFormat.model_fields["format"]
    columns: dict[str, str] = RowFormat.model_fields["columns"]

    @model_validator(mode="after")
    def _columns_of_the_format(self) -> _SourceSpec:
        problem = columns_problem(self.format, self.columns)
        if problem:
            raise ValueError(problem)
        return self

    def row_format(self) -> RowFormat:
        """How this source's rows are laid out, as the job says it."""
        return RowFormat(format=self.format, columns=self.columns)

    def hub_source(self) -> SourceFields:
        """This Hub source as the job names it (a local file is named by its copy in the store instead)."""
        return SourceFields(hub_id=self.hub_id, config=self.config, revision=self.revision, split=self.split,
                            format=self.format, columns=self.columns)

    def _one_source_problem(self) -> str | None:
        if (self.hub_id is None) == (self.local_file is None):
            return "set exactly one of `hub_id` (a Hub dataset) or `local_file` (a JSONL file)"
        hub_only = [f"`{name}`" for name in ("config", "revision") if getattr(self, name) is not None]
        if self.local_file is not None and hub_only:
            return (f"{' and '.join(hub_only)} {'apply' if len(hub_only) > 1 else 'applies'} to a Hub dataset "
                    "(`hub_id`) only: remove it for `local_file`")
        return None


class MixEntrySpec(_SourceSpec):
    """One source of a mixture (`[[dataset.mix]]`): a Hub dataset or a local file, with its share of the
    examples."""

    fraction: float = MixSource.model_fields["fraction"]

    @model_validator(mode="after")
    def _one_source(self) -> MixEntrySpec:
        problem = self._one_source_problem()
        if problem:
            raise ValueError(problem)
        return self


class DatasetSpec(_SourceSpec):
    """Training data: a Hub dataset or a local JSONL file (published to the run's artifact store so the worker can
    read it), or a mixture of such sources (`[[dataset.mix]]`). Rows come in TRL's conversational formats, or as
    Alpaca or ShareGPT rows (`format`), with your own column names (`columns`); the worker converts them to TRL's
    formats before training. Every source is checked before anything is rented, and a refusal names the source,
    the row and the field."""

    mix: list[MixEntrySpec] = Field(
        default_factory=list, max_length=MAX_MIX_SOURCES,
        description="A mixture of sources (`[[dataset.mix]]` entries, each with the fields above and a `fraction`), "
        "in place of a single source: set either `mix` or the fields above, not both. The fractions are sampling "
        "probabilities that sum to 1: each training example is drawn at random (seeded with `training.seed`, so the "
        "same seed gives the same mixture) from entry i with probability `fraction` i, until one entry has no "
        "examples left (`datasets.interleave_datasets` with `first_exhausted`, LLaMA-Factory's `interleave_under`): "
        "no example repeats, and the mixture is as large as the first source to run out allows. Sources in `messages` "
        "and prompt-completion shapes mix as `messages` (Alpaca rows with ShareGPT ones, say), prompt-only ones only "
        "with each other (refused before renting where the rows were read); only the columns every source has are "
        "kept. The manifest records how many examples each entry gave.",
    )

    @field_validator("mix")
    @classmethod
    def _fractions_sum_to_one(cls, mix: list[MixEntrySpec]) -> list[MixEntrySpec]:
        if len(mix) == 1:
            raise ValueError("a mix needs at least 2 sources; give a single source as `dataset.hub_id` or "
                             "`dataset.local_file` instead")
        total = sum(entry.fraction for entry in mix)
        if mix and not math.isclose(total, 1.0, abs_tol=1e-6):
            raise ValueError(f"the fractions of `dataset.mix` are sampling probabilities and must sum to 1; these sum "
                             f"to {total:g} ({', '.join(f'{e.fraction:g}' for e in mix)}): scale them")
        return mix

    @model_validator(mode="after")
    def _one_source(self) -> DatasetSpec:
        if self.mix:
            # By value, not by what was set: Prefect hands the flow its spec as JSON with every field written out.
            beside = [name for name, field in _SourceSpec.model_fields.items()
                      if getattr(self, name) != field.get_default(call_default_factory=True)]
            if beside:
                raise ValueError(f"{', '.join(f'`dataset.{f}`' for f in beside)} beside `dataset.mix`: each mix entry "
                                 "is a source of its own; move them into the `[[dataset.mix]]` entries")
            return self
        problem = self._one_source_problem()
        if problem:
            raise ValueError(problem)
        return self

    def sources(self) -> list[tuple[str, _SourceSpec]]:
        """(the spec field that names it, the source) of each source rows come from: the mix's entries, or this."""
        if self.mix:
            return [(f"dataset.mix[{i}]", entry) for i, entry in enumerate(self.mix)]
        return [("dataset", self)]


class GraderSpec(GraderSettings):
    """A grader written as a table (`{ kind = "numeric", tolerance = 0.01 }`): the job's grader, less the store path
    the control plane sets."""

    @model_validator(mode="after")
    def _no_store_path(self) -> GraderSpec:
        if self.store_path is not None:
            raise ValueError("`store_path` is set by loraflow when it stores the grader's file: name the file in "
                             "`function` (`file.py:function`) instead")
        return self


def grader_settings(grader: str | GraderSpec) -> GraderSettings:
    """The job's grader for one entry of a task's `graders`: a built-in's name, `file.py:function`, or a table."""
    if isinstance(grader, GraderSpec):
        return GraderSettings.model_validate(grader.model_dump(exclude_none=True))
    if grader in BUILTIN_GRADERS:
        return GraderSettings(kind=grader)
    if grader.endswith(".py") or ".py:" in grader:
        function_reference(grader)  # `file.py:function`, or refused as not one
        return GraderSettings(kind="function", function=grader)
    if grader in ("function", "judge"):
        raise ValueError(f"the `{grader}` grader needs its settings: write it as a table, e.g. "
                         + ("`{ kind = \"judge\", judge_model = \"...\", judge_base_url = \"...\", rubric = \"...\" }`"
                            if grader == "judge" else "`\"graders.py:my_grader\"`"))
    raise ValueError(f"unknown grader {grader!r}: use one of {', '.join(BUILTIN_GRADERS)}, `file.py:function` (a "
                     "function of your own), or a table such as `{ kind = \"judge\", ... }`")


_TASK_FIELDS = TaskEvaluation.model_fields
# A string is a grader's name, a table its settings: each refused on its own terms, not as "not a string".
Grader = Annotated[Annotated[str, Tag("name")] | Annotated[GraderSpec, Tag("table")],
                   Discriminator(lambda value: "name" if isinstance(value, str) else "table")]


class TaskSpec(Section):
    """One task evaluation: prompts with expected answers, answered after training by the base model and by the kept
    adapter on the worker that trained, each answer scored by the task's graders. The run reports, per grader, the
    base's mean score, the adapter's, and their difference with its standard error."""

    name: str = _TASK_FIELDS["name"]
    local_file: str = Field(
        max_length=4096,
        description="A JSONL file of prompts on the machine that runs the flow: each line `messages` (a chat, up to "
        "its last user turn; a trailing assistant turn is dropped) or `prompt` (text, or a list of messages), and the "
        "expected `answer` (text or a number) where a grader needs one; other columns reach function graders as "
        "keyword arguments. Checked before anything is rented and stored with the run. Relative paths are resolved "
        "from the working directory.")
    graders: list[Grader] = Field(
        min_length=1, max_length=MAX_GRADERS,
        description="How each answer is scored, each from 0 to 1: a built-in's name (`exact_match`, `contains`, "
        "`regex`, `numeric`, `f1`), `file.py:function` (your function, called as a reward function is, never run "
        "before the worker), or a table with a `kind` and its settings, e.g. `{ kind = \"numeric\", tolerance = "
        "0.01 }`, `{ kind = \"regex\", pattern = \"answer: (.*)\" }`, `{ kind = \"judge\", judge_model = "
        "\"gpt-4o-mini\", judge_base_url = \"https://api.openai.com/v1\", rubric = \"...\", judge_api_key_env = "
        "\"OPENAI_API_KEY\" }` "
        "(the key's variable one of `[worker] secrets`).")
    max_new_tokens: int = _TASK_FIELDS["max_new_tokens"]
    max_samples: int = _TASK_FIELDS["max_samples"]
    temperature: float = _TASK_FIELDS["temperature"]
    top_p: float = _TASK_FIELDS["top_p"]
    samples_kept: int = _TASK_FIELDS["samples_kept"]

    @field_validator("graders")
    @classmethod
    def _graders_known(cls, graders: list[Grader]) -> list[Grader]:
        labels = [grader_settings(grader).label for grader in graders]
        doubled = sorted({label for label in labels if labels.count(label) > 1})
        if doubled:
            raise ValueError(f"two graders are labelled {', '.join(doubled)}: give each a `name`")
        return graders

    def grader_settings(self) -> list[GraderSettings]:
        """The task's graders as the job takes them (a function's file not yet stored)."""
        return [grader_settings(grader) for grader in self.graders]


_BENCHMARK_FIELDS = BenchmarkSettings.model_fields


class BenchmarkSpec(Section):
    """Standard benchmarks after training, run by EleutherAI's lm-evaluation-harness for the base model and for the
    adapter on the worker that trained; the scores and standard errors are the harness's."""

    tasks: list[str] = _BENCHMARK_FIELDS["tasks"]
    limit: int | None = _BENCHMARK_FIELDS["limit"]
    num_fewshot: int | None = _BENCHMARK_FIELDS["num_fewshot"]
    task_dir: str | None = Field(
        default=None, max_length=4096,
        description="A folder on the machine that runs the flow holding the harness's own task YAML files (and the "
        "data files they read), for private tasks named in `tasks`; stored with the run. Relative paths are resolved "
        "from the working directory.")
    batch_size: int = _BENCHMARK_FIELDS["batch_size"]

    _task_names = field_validator("tasks")(BenchmarkSettings._names.__func__)


class EvaluationSpec(Section):
    """Held-out evaluation while training, as hosted fine-tuning reports validation loss: before the first step,
    every `every_steps` steps and after the last. SFT: the loss on the held-out examples (`eval_loss`). GRPO: the
    mean total reward (rewards summed with their weights) of ONE completion per held-out prompt, sampled as training
    samples (`grpo.temperature`, up to `grpo.max_completion_length` tokens; not greedy), so a noisy estimate that a
    larger `max_samples` steadies (`eval_reward`). Stored in the run's `metrics.json`, shown in the progress line,
    the summary and its curve. After training, `tasks` and `benchmarks` ask the base and the adapter the same
    prompts and report both scores and their difference (they need no held-out rows). Evaluation time is inside the
    run's deadline, so inside its cost ceiling."""

    fraction: float | None = Field(
        default=None, gt=0.0, lt=0.5,
        description="Hold this share of the dataset out for evaluation (e.g. 0.1), picked at random with "
        "`training.seed`, so every attempt holds out the same rows; the rest is trained on. Set `fraction` or "
        "`local_file`, not both.",
    )
    local_file: str | None = Field(
        default=None, max_length=4096,
        description="A JSONL file of evaluation examples on the machine that runs the flow, in the formats "
        "`dataset.local_file` takes, read as `format` and `columns` say (checked the same way before anything is "
        "rented, and published to the run's artifact store with the dataset); the whole dataset is trained on. "
        "Relative paths are resolved from the working directory.",
    )
    format: DatasetFormat = Field(
        default="auto", description="The format of `local_file`'s rows, as `dataset.format` (`auto`, `alpaca`, "
        "`sharegpt`).")
    columns: dict[str, str] = Field(
        default_factory=dict, max_length=8,
        description="`local_file`'s own column names, as `dataset.columns` (the format's names → the file's).")
    # The job's own fields: the same defaults, bounds and descriptions.
    every_steps: int = EvaluationSettings.model_fields["every_steps"]
    max_samples: int = EvaluationSettings.model_fields["max_samples"]
    tasks: list[TaskSpec] = Field(
        default_factory=list, max_length=MAX_TASKS,
        description="Task evaluations after training (`[[evaluation.tasks]]`): your prompts and expected answers, "
        "asked of the base model and of the adapter, each answer graded; the summary shows the base's score, the "
        "adapter's and the difference with its standard error. They need no held-out rows.")
    benchmarks: BenchmarkSpec | None = Field(
        default=None,
        description="lm-evaluation-harness benchmarks after training (`[evaluation.benchmarks]`), for the base and the "
        "adapter. They need no held-out rows.")

    @property
    def held_out(self) -> bool:
        """Whether the run evaluates on held-out rows while training."""
        return self.fraction is not None or self.local_file is not None

    def task_paths(self) -> list[tuple[str, str]]:
        """(field, path as written) of the task files, the function graders' files and the benchmarks' task
        folder."""
        paths = []
        for i, task in enumerate(self.tasks):
            paths.append((f"evaluation.tasks[{i}].local_file", task.local_file))
            paths += [(f"evaluation.tasks[{i}].graders[{j}]", function_reference(grader.function)[0])
                      for j, grader in enumerate(task.grader_settings()) if grader.kind == "function"]
        if self.benchmarks is not None and self.benchmarks.task_dir is not None:
            paths.append(("evaluation.benchmarks.task_dir", self.benchmarks.task_dir))
        return paths

    @model_validator(mode="after")
    def _one_source(self) -> EvaluationSpec:
        if self.fraction is not None and self.local_file is not None:
            raise ValueError("set one of `fraction` (a held-out share of the dataset, e.g. 0.1) or `local_file` (a "
                             "JSONL file of evaluation examples), not both")
        if not self.held_out and not self.tasks and self.benchmarks is None:
            raise ValueError("set `fraction` (a held-out share of the dataset, e.g. 0.1), `local_file` (a JSONL file "
                             "of evaluation examples), `[[evaluation.tasks]]` or `[evaluation.benchmarks]`")
        if self.local_file is None and (self.format != "auto" or self.columns):
            raise ValueError("`evaluation.format` and `evaluation.columns` describe `evaluation.local_file`: the "
                             "held-out `fraction` is in the dataset's format already; remove them")
        problem = columns_problem(self.format, self.columns)
        if problem:
            raise ValueError(problem)
        names = [task.name for task in self.tasks]
        doubled = sorted({name for name in names if names.count(name) > 1})
        if doubled:
            raise ValueError(f"two tasks are named {', '.join(doubled)}: name each task once")
        return self
