"""The `study` flow's parameter: a run file with a `[study]` section, and the child runs it stands for.

    name = "lr-sweep"
    ...                                   # every field of a run file: the runs' common spec
    [study]
    grid = {"training.learning_rate" = [1e-4, 3e-4]}
    seeds = [1, 2]
    parallel = 2
    metric = "eval_loss"
    budget_usd = 20
    deployment = "train/qwen"             # optional: the children as runs of this deployment, on its pool's workers

    prune = { rule = "median", after_evals = 2 }   # optional: cancel a child losing to the others' median

One child train run per combination of the grid's values and the seeds, each a run spec of its own, named after
the study and the values that differ. Every child is validated here, before the first one starts: a grid value that
makes any child invalid refuses the whole study, naming the child and the field. With `search = "tpe"`, Optuna
picks each next child's values from `space` (`flows/study_search.py`), `trials` of them.
"""

from __future__ import annotations

import itertools
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from flows.forms.run import RunSpec, SpecError, describe_validation_error, read_run_file
from tasks.reports.study import score_metric
from tasks.reports.study_names import child_label, child_name, describe_values

__all__ = ["Child", "StudySettings", "StudySpec", "child_label", "describe_values", "expand", "judging_change",
           "load_study_file", "make_child", "spec_difference"]

MAX_CHILDREN = 1000
"""The most child runs one study starts: a grid beyond that is a mistake more often than a plan (and a search of a
space that large is Optuna's work, not a grid's)."""
METRIC_NEEDS: dict[str, tuple[tuple[str, ...], bool]] = {
    "eval_loss": (("sft", "dpo"), True),
    "eval_reward": (("grpo",), True),
    "eval_reward_accuracy": (("dpo",), True),
    "train_loss": (("sft", "grpo", "dpo"), False),
}
"""Metric → (the algorithms that record it, whether it needs `[evaluation]`)."""
MAXIMIZED = {"eval_reward", "eval_reward_accuracy"}
NOT_VARIED = {"name": "each child is named after the study and its values", "study": "the study itself"}


class PruneRule(BaseModel):
    """When the study cancels a running child that is losing to the others."""

    model_config = ConfigDict(extra="forbid")

    rule: Literal["median"] = Field(
        default="median",
        description="`median`: Optuna's median rule. A child whose best `metric` by an evaluation step is worse than "
        "the median of the other children's values at that same step is cancelled (`pruned`). A grid compares "
        "settings, not seeds: a setting's value is the mean over its seeds that reached the step, it is compared "
        "with the other settings that reached it (running or ended), and a setting worse than their median is pruned "
        "as a whole, its seeds with it. A search passes the rule to Optuna's `MedianPruner`, which compares with the "
        "trials that completed.",
    )
    after_evals: int = Field(
        default=2, ge=1, le=10_000,
        description="Evaluations a child has had since its first step before it may be pruned (the one before the "
        "first step, the base model's, does not count: it says nothing of the child's settings).",
    )
    startup_children: int = Field(
        default=5, ge=0, le=MAX_CHILDREN,
        description="Children that must have completed (every evaluation reported) before any child is pruned "
        "(Optuna's `MedianPruner` `n_startup_trials`, whose default this is): a median of the first few children "
        "running side by side is noise, and a slow starter would be cancelled before it shows what it learns. 0: "
        "judge from the first evaluations, against every other setting that reached the step.",
    )


class SearchRange(BaseModel):
    """A range of `space` for Optuna to pick a value from: whole numbers when `low` and `high` (and `step`) are."""

    model_config = ConfigDict(extra="forbid")

    low: int | float = Field(description="The lowest value.")
    high: int | float = Field(description="The highest value (with `step`, the last step at or below it).")
    log: bool = Field(default=False, description="Pick on a log scale (a learning rate): needs `low` above 0.")
    step: int | float | None = Field(default=None, gt=0, description="Only values `low + k × step`; not with "
                                     "`log`.")

    @model_validator(mode="after")
    def _a_range_optuna_takes(self) -> SearchRange:
        if not self.low < self.high:
            raise ValueError(f"low {self.low} is not below high {self.high}")
        if self.log and self.low <= 0:
            raise ValueError(f"log = true needs low above 0 (low is {self.low})")
        if self.log and self.step is not None:
            raise ValueError("log and step together: Optuna picks on a log scale or in steps, not both; keep one")
        return self

    def is_int(self) -> bool:
        return all(isinstance(v, int) and not isinstance(v, bool) for v in (self.low, self.high, self.step or 1))


SpaceValues = SearchRange | list[Any]


class StudySettings(BaseModel):
    """How the study varies the run, how many children run at once, how they are compared and what they may cost."""

    model_config = ConfigDict(extra="forbid")

    grid: dict[str, list[Any]] = Field(
        default_factory=dict, max_length=6,
        description="Run fields to vary, by their dotted names, each with the values to try, e.g. "
        "`{\"training.learning_rate\" = [1e-4, 3e-4], \"lora.rank\" = [8, 16]}`: one child per combination (times "
        "the seeds). Any field of the run spec but `name`, outside lists.",
    )
    seeds: list[int] = Field(
        default_factory=list, max_length=16,
        description="`training.seed` of the children: each combination of the grid runs once per seed (one seed is "
        "one sample). Empty: the run spec's own seed.",
    )
    parallel: int = Field(
        default=2, ge=1, le=MAX_CHILDREN,
        description="The most children running at once, up to the account's worker quota (`LORAFLOW_WORKER_QUOTA`, "
        "else the `runpod-endpoints` limit's slots): a study asking for more is refused before anything is rented. "
        "Each child holds one slot of that account-wide limit while it rents, as every run does, so other runs of "
        "the account also bound it.",
    )
    metric: str = Field(
        default="eval_loss", max_length=200,
        description="What picks the best child, at its last value (with `training.early_stopping`, at the evaluation "
        "whose adapter the child kept): `eval_loss` (SFT, DPO: needs `[evaluation]`), "
        "`eval_reward` (GRPO: needs `[evaluation]`), `eval_reward_accuracy` (DPO's held-out reward accuracy: needs "
        "`[evaluation]`), `train_loss`, or the adapter's score after training of a task, `task:<task>/<grader>` "
        "(a task and grader of `[[evaluation.tasks]]`), or of a benchmark, `benchmark:<task>/<metric>` (a task of "
        "`[evaluation.benchmarks]` and the harness's metric, e.g. `benchmark:hellaswag/acc`); scores are higher "
        "the better.",
    )
    direction: Literal["minimize", "maximize"] | None = Field(
        default=None,
        description="Whether the best child has the lowest or the highest `metric`. Empty: lowest for a loss, "
        "highest for a reward or an accuracy.",
    )
    publish_best: bool = Field(
        default=False,
        description="Publish only the best child's adapter, with the run file's `[publish]` (which this needs). "
        "False: no child publishes (a `[publish]` beside it would have every child publish to one repo, so it is "
        "refused).",
    )
    budget_usd: float | None = Field(
        default=None, gt=0, le=1_000_000,
        description="The most the whole study may cost, kept as children start: a child starts only when what the "
        "ended children cost, the cost ceilings (GPU price × GPUs × deadline) of those running and its own ceiling fit "
        "it; else it waits for a running child to end, or, with none running, is skipped (a row of the table, with "
        "the reason). A child whose ceiling alone passes it refuses the study before anything is rented. Empty: no "
        "study budget (each child's own `budget_usd` still holds).",
    )
    prune: PruneRule | None = Field(
        default=None,
        description="Cancel a running child that is losing, e.g. `{ rule = \"median\", after_evals = 2 }`: the study "
        "reads each child's evaluations (`loraflow.run.evaluated`) as it runs, and a child worse than the median of "
        "the others at the same step is cancelled (its job, its endpoint), a `pruned` row of the table, its cost "
        "counted. Needs an eval `metric` and `[evaluation]` with `every_steps`. Empty: every child runs to its end.",
    )
    search: Literal["grid", "tpe"] = Field(
        default="grid",
        description="`grid`: one child per combination of `grid` × `seeds`. `tpe`: Optuna's TPE sampler picks each "
        "next child's values from `space`, `trials` children in all, told each child's final `metric` as it ends; the "
        "Optuna study is stored in `LORAFLOW_OPTUNA_STORAGE` (an SQLAlchemy URL, which a Prefect server on another "
        "machine needs; else `loraflow/optuna.db` under Prefect's home), named `<name>-<study flow run id>`.",
    )
    trials: int | None = Field(
        default=None, ge=1, le=MAX_CHILDREN,
        description="With `search = \"tpe\"`: how many children Optuna picks, in all (a resumed study asks only for "
        "those it has not asked yet).",
    )
    startup_trials: int = Field(
        default=10, ge=0, le=MAX_CHILDREN,
        description="With `search = \"tpe\"`: trials whose values are picked at random before TPE models the "
        "results (Optuna's `TPESampler` `n_startup_trials`, whose default this is). The sampler is seeded with the run "
        "file's `training.seed` and, as children run `parallel` at once, lies about the running ones "
        "(`constant_liar`) so that they are not asked alike.",
    )
    space: dict[str, SpaceValues] = Field(
        default_factory=dict, max_length=12,
        description="With `search = \"tpe\"`: run fields by their dotted names (as `grid`'s), each a range "
        "`{ low = 1e-5, high = 1e-3, log = true }` (whole numbers when `low` and `high` are; `step` for a grid of "
        "steps) or a list of values to choose from (`[8, 16, 32]`: numbers, text or true/false).",
    )
    deployment: str | None = Field(
        default=None, pattern=r"^train/[A-Za-z0-9][A-Za-z0-9_.-]*$", max_length=200,
        description="A deployment of the train flow (`train/<name>`) that runs the children: each child is a run of "
        "it, started by the study with the child's whole spec, so children run on whichever workers serve its pool, "
        "each in its own process, and outlive the study's own process (a resumed study adopts them). Its default "
        "parameters never replace a child's spec. Empty: the children run inside the study's own process (one "
        "machine: the local demo).",
    )

    @field_validator("grid")
    @classmethod
    def _fields_of_a_run(cls, grid: dict[str, list[Any]]) -> dict[str, list[Any]]:
        for path, values in grid.items():
            field_problem = run_field_problem(path)
            if field_problem:
                raise ValueError(f"study.grid {path!r}: {field_problem}")
            if not values:
                raise ValueError(f"study.grid {path!r}: give at least one value")
            if len({repr(v) for v in values}) < len(values):
                raise ValueError(f"study.grid {path!r}: a value is listed twice ({values}); list each once")
        return grid

    @field_validator("space")
    @classmethod
    def _space_of_run_fields(cls, space: dict[str, SpaceValues]) -> dict[str, SpaceValues]:
        for path, values in space.items():
            field_problem = run_field_problem(path)
            if field_problem:
                raise ValueError(f"study.space {path!r}: {field_problem}")
            if isinstance(values, SearchRange):
                continue
            if not values:
                raise ValueError(f"study.space {path!r}: give at least one value to choose from")
            if len({repr(v) for v in values}) < len(values):
                raise ValueError(f"study.space {path!r}: a value is listed twice ({values}); list each once")
            if any(not isinstance(v, (str, int, float, bool)) for v in values):
                raise ValueError(f"study.space {path!r}: Optuna chooses among single values (text, numbers, "
                                 "true/false), not lists or tables; vary such a field with `grid` instead")
        return space

    @field_validator("seeds")
    @classmethod
    def _distinct_seeds(cls, seeds: list[int]) -> list[int]:
        if len(set(seeds)) < len(seeds):
            raise ValueError(f"study.seeds {seeds}: a seed is listed twice; list each once")
        return seeds

    @model_validator(mode="after")
    def _seeds_or_a_seed_grid(self) -> StudySettings:
        if self.seeds and "training.seed" in self.grid:
            raise ValueError("`study.seeds` and `study.grid` \"training.seed\" both vary the seed: keep one")
        if self.search == "tpe":
            if self.trials is None or not self.space:
                raise ValueError("study.search \"tpe\" needs `study.trials` (how many children Optuna picks) and "
                                 "`study.space` (the fields it picks them for, e.g. { \"training.learning_rate\" = "
                                 "{ low = 1e-5, high = 1e-3, log = true } })")
            if self.grid or self.seeds:
                raise ValueError("study.search \"tpe\" picks every child's values from `study.space`: remove "
                                 "`study.grid` and `study.seeds` (a seed to vary is a list in the space: "
                                 "\"training.seed\" = [1, 2])")
        elif self.trials is not None or self.space or "startup_trials" in self.model_fields_set:
            raise ValueError("`study.trials`, `study.space` and `study.startup_trials` are for a search: add "
                             "`search = \"tpe\"`, or vary the fields with `study.grid`")
        if self.children() > MAX_CHILDREN:
            raise ValueError(f"the study would start {self.children()} child runs (grid values × seeds), more than "
                             f"{MAX_CHILDREN}: try fewer grid values or seeds, or split it into smaller studies")
        return self

    def children(self) -> int:
        if self.search == "tpe":
            return self.trials or 0
        return math.prod(len(v) for v in self.grid.values()) * max(1, len(self.seeds))

    @field_validator("metric")
    @classmethod
    def _a_series_or_a_score(cls, metric: str) -> str:
        if metric not in METRIC_NEEDS and score_metric(metric) is None:
            raise ValueError(f"study.metric {metric!r} is none of {', '.join(METRIC_NEEDS)}, `task:<task>/<grader>` "
                             "or `benchmark:<task>/<metric>`")
        return metric

    @model_validator(mode="after")
    def _a_task_score_is_higher_the_better(self) -> StudySettings:
        scored = score_metric(self.metric)
        if scored is not None and scored[0] == "task" and self.direction == "minimize":
            raise ValueError(f"study.metric {self.metric!r} is a task's score, from 0 to 1, higher the better: remove "
                             "`study.direction` (or set it to `maximize`)")
        return self

    def maximize(self) -> bool:
        return self.direction == "maximize" if self.direction else maximized(self.metric)


def maximized(metric: str) -> bool:
    """Whether a metric is better higher when the study names no direction: a reward, an accuracy, a score."""
    return metric in MAXIMIZED or score_metric(metric) is not None


def score_metric_problem(metric: str, evaluation: Any) -> str | None:
    """Why a run (its `[evaluation]`) does not record a score metric (`task:<task>/<grader>`,
    `benchmark:<task>/<metric>`); None when it does, or when the metric is not a score."""
    scored = score_metric(metric)
    if scored is None:
        return None
    kind, task, name = scored
    if kind == "benchmark":
        tasks = evaluation.benchmarks.tasks if evaluation is not None and evaluation.benchmarks is not None else []
        if task not in tasks:
            return (f"study.metric {metric!r} names benchmark task {task!r}, which `[evaluation.benchmarks] tasks` "
                    f"does not ask for ({', '.join(tasks) or 'none'})")
        return None
    tasks = {t.name: t for t in evaluation.tasks} if evaluation is not None else {}
    if task not in tasks:
        return (f"study.metric {metric!r} names task {task!r}, which no `[[evaluation.tasks]]` is named "
                f"({', '.join(tasks) or 'none'})")
    labels = [g.label for g in tasks[task].grader_settings()]
    if name not in labels:
        return f"study.metric {metric!r}: task {task!r} has no grader {name!r} (its graders: {', '.join(labels)})"
    return None


class StudySpec(RunSpec):
    """A study: the spec its child runs share (every field of a run file), and the `[study]` section."""

    study: StudySettings = Field(description="What the study varies and how it compares its children.")

    @model_validator(mode="after")
    def _metric_recorded_and_one_publisher(self) -> StudySpec:
        problem = score_metric_problem(self.study.metric, self.evaluation)
        if problem:
            raise ValueError(problem)
        # A score is recorded by every algorithm, once, after training: no held-out rows, nothing to prune by.
        algorithms, needs_evaluation = METRIC_NEEDS.get(self.study.metric, (("sft", "grpo", "dpo"), False))
        if self.algorithm not in algorithms:
            raise ValueError(f"study.metric {self.study.metric!r} is not recorded by {self.algorithm} runs (only "
                             f"{', '.join(algorithms)}): pick one of {_metrics_for(self.algorithm)}")
        if needs_evaluation and (self.evaluation is None or not self.evaluation.held_out):
            raise ValueError(f"study.metric {self.study.metric!r} is measured on held-out examples: add an "
                             "`[evaluation]` section (e.g. `fraction = 0.1`), or use `train_loss`")
        if self.study.publish_best and self.publish is None:
            raise ValueError("study.publish_best needs the run file's `[publish]` (where to publish the best adapter)")
        prune = self.study.prune
        if prune is not None and not needs_evaluation:
            raise ValueError(f"study.prune compares children's held-out evaluations, and study.metric "
                             f"{self.study.metric!r} is not one: pick {_eval_metrics_for(self.algorithm)}, or remove "
                             "study.prune")
        if prune is not None and (self.evaluation is None or "every_steps" not in self.evaluation.model_fields_set):
            raise ValueError("study.prune judges children at their evaluations while they train: set "
                             "`[evaluation]` `every_steps` (e.g. `every_steps = 50`: a child may be pruned "
                             f"after {prune.after_evals} of them, so several before training.max_steps), or "
                             "remove study.prune")
        if self.publish is not None and not self.study.publish_best:
            raise ValueError("`[publish]` without study.publish_best would have every child publish to the same repo: "
                             "set `study.publish_best = true` to publish the best child's adapter, or remove "
                             "`[publish]`")
        return self


def _metrics_for(algorithm: str) -> str:
    return ", ".join(m for m, (algorithms, _) in METRIC_NEEDS.items() if algorithm in algorithms)


def _eval_metrics_for(algorithm: str) -> str:
    return " or ".join(m for m, (algorithms, held_out) in METRIC_NEEDS.items() if algorithm in algorithms and held_out)


class Child(BaseModel):
    """One child run of a study: its place, the values it tries, and its spec."""

    index: int = Field(description="Its place in the study, from 1.")
    values: dict[str, Any] = Field(description="Dotted run field → the value this child tries (`training.seed` "
                                   "included when the study varies seeds).")
    spec: RunSpec = Field(description="The child's whole run spec.")


def run_field_problem(path: str) -> str | None:
    """Why `path` (dotted) does not name a field of a run spec that a study can vary; None when it does."""
    parts = path.split(".")
    if parts[0] in NOT_VARIED:
        return f"`{parts[0]}` is not varied: {NOT_VARIED[parts[0]]}"
    model: type[BaseModel] | None = RunSpec
    for depth, part in enumerate(parts):
        if model is None:
            return f"`{'.'.join(parts[:depth])}` has no fields inside it to vary"
        if part not in model.model_fields:
            known = ", ".join(sorted(model.model_fields))
            where = f"`{'.'.join(parts[:depth])}`" if depth else "a run spec"
            return f"{where} has no field `{part}` (its fields: {known})"
        model = _section_model(model.model_fields[part].annotation)
    return None


def _section_model(annotation: Any) -> type[BaseModel] | None:
    """The model a field holds (`X` or `X | None`), or None for a value, a list or a mapping."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (Union, types.UnionType):
        models = [a for a in typing.get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
        return models[0] if len(models) == 1 else None
    return None


def expand(spec: StudySpec) -> list[Child]:
    """Every child run of a grid study, validated. `SpecError` names each child that is not a valid run, with its
    values and the field."""
    study = spec.study
    base = children_base(spec)
    axes = list(study.grid.items()) + ([("training.seed", study.seeds)] if study.seeds else [])
    varied = [path for path, values in axes if len(values) > 1]
    children, problems, names = [], [], set()
    for index, combination in enumerate(itertools.product(*(values for _, values in axes)), start=1):
        values = dict(zip((path for path, _ in axes), combination, strict=True))
        try:
            child = make_child(spec.name, base, index, values, varied, names)
        except ValidationError as e:
            problems.append(describe_validation_error(e, child_label(index, values)))
            continue
        problem = score_metric_problem(study.metric, child.spec.evaluation)
        if problem:  # a grid that varies the tasks must keep the one the study is judged by
            problems.append(f"{child_label(index, values)}: {problem}")
            continue
        names.add(child.spec.name)
        children.append(child)
    if problems:
        raise SpecError(f"study {spec.name}: {len(problems)} of {study.children()} child run(s) would be invalid, so "
                        "nothing was started:\n" + "\n".join(problems))
    return children


def children_base(spec: StudySpec) -> dict[str, Any]:
    """The fields every child has: those the run file set, without `[study]` (and `[publish]`, with
    `publish_best`: the study publishes once, for the best child only)."""
    base = spec.model_dump(mode="json", exclude_unset=True, exclude={"study"})
    if spec.study.publish_best:
        base.pop("publish", None)
    return base


def make_child(study_name: str, base: dict[str, Any], index: int, values: dict[str, Any],
               varied: list[str] | tuple[str, ...] = (), taken: set[str] | frozenset[str] = frozenset()) -> Child:
    """The child at `index` trying `values` (dotted field → value) on `base`, named after the `varied` fields'
    values (numbered when none). `ValidationError` when the values make an invalid run."""
    data = _with_values(base, values)
    data["name"] = child_name(study_name, {p: values[p] for p in varied}, index, set(taken))
    return Child(index=index, values=values, spec=RunSpec.model_validate(data))


def _with_values(base: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    data = _copy(base)
    for path, value in values.items():
        section = data
        *parents, last = path.split(".")
        for key in parents:
            if not isinstance(section.get(key), dict):
                section[key] = {}
            section = section[key]
        section[last] = value
    return data


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


def judging_change(earlier: dict[str, Any], now: StudySettings) -> str | None:
    """How a resumed study's `[study]` (`now`) judges its children otherwise than its earlier process did (`earlier`:
    the `study` section of the spec that process was given), e.g. `study.metric eval_loss then, train_loss now`; None
    when its metric and direction are the same. The children that ended were ranked, pruned and told to Optuna by
    those: a resume may not change them."""
    then_metric = earlier.get("metric") or "eval_loss"
    then_direction = earlier.get("direction") or ("maximize" if maximized(then_metric) else "minimize")
    now_direction = "maximize" if now.maximize() else "minimize"
    changed = [f"study.{name} {then} then, {new} now" for name, then, new in
               (("metric", then_metric, now.metric), ("direction", then_direction, now_direction)) if then != new]
    return "; ".join(changed) or None


def spec_difference(ran: dict[str, Any], child: RunSpec) -> str | None:
    """How the spec a child's earlier run was given (`ran`: its flow run's `spec` parameter) differs from `child`,
    field by field (`training.max_steps: 8 then, 10 now`); None when every field it was given has the value `child`
    has. A resumed study adopts an earlier run only when it is the same child: the same run file."""
    now = _flatten(child.model_dump(mode="json"))
    then = _flatten(ran)
    changed = [f"{path}: {then[path]!r} then, {now.get(path)!r} now" for path in then if now.get(path) != then[path]]
    return "; ".join(changed[:5]) or None


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            flat |= _flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def load_study_file(path: str | Path) -> StudySpec:
    """Parse and validate a run file with a `[study]` section; `SpecError` names every bad field."""
    path = Path(path)
    data = read_run_file(path)
    if "study" not in data:
        raise SpecError(f"{path} has no [study] section: it is one run (start it with `python -m flows.train "
                        f"{path}`), or add a [study] section with the grid and seeds to try")
    try:
        return StudySpec.model_validate(data)
    except ValidationError as e:
        raise SpecError(describe_validation_error(e, str(path))) from e
