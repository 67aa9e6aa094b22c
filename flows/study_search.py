"""A study's search (`search = "tpe"`): Optuna's TPE sampler picks each next child's values from `[study] space`, and
is told how each child ended, in an Optuna study stored in SQL, so that a resumed study goes on with it and
`optuna-dashboard` reads it.

    [study]
    search = "tpe"
    trials = 20
    space = { "training.learning_rate" = { low = 1e-5, high = 1e-3, log = true }, "lora.rank" = [8, 16, 32] }

A child is trial number n's values on the run file's spec, validated like a grid's child, at index n + 1 (so its
deployment run's key, `<study flow run id>:<n + 1>`, and its name, `<study>-c<n + 1>`, follow the trial). It is told
its final `metric` when it completes, `PRUNED` when the study prunes it (the same median rule, passed to Optuna's
`MedianPruner` with each evaluation as `trial.report`), and `FAIL` otherwise (failed, cancelled, skipped for the
budget, values that make no valid run). The Optuna study is named `<study name>-<study flow run id>` and stored in
`LORAFLOW_OPTUNA_STORAGE` (an SQLAlchemy URL: on a team, a database of its own on the team's PostgreSQL, which a
study on a Prefect server elsewhere must name), else in `loraflow/optuna.db` under Prefect's home (the same file from
any folder of this machine). A resume whose Optuna study lacks trials its children show (another machine's file, a
lost one) rebuilds them from the children's runs (`Search.rebuild`); a resume that changes `direction` or `metric` is
refused. Before anything is rented, the children at the space's corners (each range's ends, each listed value) are
validated, their files read and their cost ceilings checked, as a grid's are.
"""

from __future__ import annotations

import math
import statistics
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState, create_trial
from prefect.settings import get_current_settings
from pydantic import ValidationError

from flows.forms.run import SpecError, describe_validation_error
from tasks.reports.study_names import describe_values
from flows.forms.study import Child, SearchRange, SpaceValues, StudySpec, children_base, make_child
from tasks.lifecycle.study_children import FoundChild
from tasks.lifecycle.study_pruning import Verdict, trained_steps
from tasks.reports.study import ChildRow
from tasks.settings import Settings

OPTUNA_STORAGE_ENV = "LORAFLOW_OPTUNA_STORAGE"
LOCAL_STORAGE = Path("loraflow") / "optuna.db"
"""The Optuna storage without `LORAFLOW_OPTUNA_STORAGE`: an SQLite file under Prefect's home (`PREFECT_HOME`,
`~/.prefect`), which a study resumed from any folder of this machine opens again."""
_ENDED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
_LOOPBACK = {"localhost", "127.0.0.1", "::1"}


def storage_url() -> str:
    """`LORAFLOW_OPTUNA_STORAGE`; else, with a Prefect server on this machine (or none: an ephemeral one), the SQLite
    file `loraflow/optuna.db` under Prefect's home (its folder made). `SpecError` with a Prefect server elsewhere (a
    team's): the study may run, or be resumed, on any of its workers, and each must reach the same Optuna study."""
    configured = Settings().loraflow_optuna_storage
    if configured is not None:
        return configured.get_secret_value()
    settings = get_current_settings()
    api = settings.api.url
    if api and (urlparse(str(api)).hostname or "") not in _LOOPBACK:
        raise SpecError(f"study.search \"tpe\" on the Prefect server at {api} needs {OPTUNA_STORAGE_ENV}: the study "
                        "may run, or be resumed, on any machine that server's workers run on, and each must open the "
                        "same Optuna study. Set it to an SQLAlchemy URL every such machine reaches, e.g. a database of "
                        "its own on the team's PostgreSQL: postgresql+psycopg://USER:PASSWORD@HOST:5432/optuna")
    path = Path(settings.home) / LOCAL_STORAGE
    path.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path}"


def shown_url(url: str) -> str:
    """The storage URL as logs and refusals show it: without its password."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return "(not an SQLAlchemy URL)"


def distributions(space: dict[str, SpaceValues]) -> dict[str, BaseDistribution]:
    """Each field of `space` as the Optuna distribution its values are picked from: a range of whole numbers, a
    range of floats (`log`, `step` as given), or a choice among the listed values."""
    found: dict[str, BaseDistribution] = {}
    for path, values in space.items():
        if isinstance(values, SearchRange) and values.is_int():
            found[path] = IntDistribution(int(values.low), int(values.high), log=values.log,
                                          step=int(values.step or 1))
        elif isinstance(values, SearchRange):
            found[path] = FloatDistribution(float(values.low), float(values.high), log=values.log,
                                            step=float(values.step) if values.step is not None else None)
        else:
            found[path] = CategoricalDistribution(values)
    return found


def corner_values(space: dict[str, SpaceValues]) -> list[dict[str, Any]]:
    """The values at the space's corners: each field at each of its extremes (a range's low and its highest value
    reachable, each listed value) with the others at their first, each set once. The children they make stand for
    the search's before anything is rented: every value Optuna may pick lies between them."""
    extremes = {path: _extremes(d) for path, d in distributions(space).items()}
    firsts = {path: values[0] for path, values in extremes.items()}
    corners: list[dict[str, Any]] = []
    for path, values in extremes.items():
        for value in values:
            corner = firsts | {path: value}
            if corner not in corners:
                corners.append(corner)
    return corners


def _extremes(distribution: BaseDistribution) -> list[Any]:
    if isinstance(distribution, CategoricalDistribution):
        return list(distribution.choices)
    return [distribution.low, distribution.high]  # Optuna lowers `high` to the last step at or below it


def space_corners(spec: StudySpec) -> list[Child]:
    """The children at the space's corners (`corner_values`), validated: `SpecError` names each set of values that
    makes no valid run, and the field, so nothing is rented for a search some of whose children could not run."""
    base = children_base(spec)
    children, problems = [], []
    for index, values in enumerate(corner_values(spec.study.space), start=1):
        try:
            children.append(make_child(spec.name, base, index, values, varied=list(values),
                                       taken={c.spec.name for c in children}))
        except ValidationError as e:
            problems.append(describe_validation_error(e, f"values {describe_values(values)}"))
    if problems:
        raise SpecError(f"study {spec.name}: {len(problems)} of the space's {len(children) + len(problems)} corner "
                        "values would make invalid children, so nothing was started:\n" + "\n".join(problems))
    return children


class InvalidTrial(Exception):
    """Optuna picked values that make no valid run (a rule between fields the corners did not meet): told FAIL."""

    def __init__(self, index: int, values: dict[str, Any], problem: str):
        super().__init__(problem)
        self.index, self.values, self.problem = index, values, problem


class Search:
    """The study's Optuna study, created, or loaded when the study is resumed (its trials asked and told before are
    kept: a told trial is never asked again). `SpecError` when the storage cannot be opened, naming the setting."""

    def __init__(self, spec: StudySpec, study_run_id: str, storage: str | None = None):
        self.spec, self.base = spec, children_base(spec)
        self.space = distributions(spec.study.space)
        self.name = f"{spec.name}-{study_run_id}"
        url = storage or storage_url()
        self.storage_shown = shown_url(url)
        direction = "maximize" if spec.study.maximize() else "minimize"
        startup = spec.study.prune.startup_children if spec.study.prune is not None else 0
        try:
            with warnings.catch_warnings():
                # `constant_liar` is marked experimental in Optuna 4.9; it is the sampler's documented way to keep
                # parallel trials apart.
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                sampler = optuna.samplers.TPESampler(n_startup_trials=spec.study.startup_trials, constant_liar=True,
                                                     seed=spec.training.seed)
            self.study = optuna.create_study(
                storage=optuna.storages.RDBStorage(url), study_name=self.name, load_if_exists=True,
                direction=direction, sampler=sampler,
                # The study's median rule through Optuna's own pruner: no trial is pruned before `startup_children`
                # trials completed; then judged at every reported step (the study reports a trial's evaluations only
                # from its `after_evals`-th on) against the completed trials that reported there.
                pruner=optuna.pruners.MedianPruner(n_startup_trials=startup, n_warmup_steps=0, n_min_trials=1))
        except Exception as e:  # noqa: BLE001 - SQLAlchemy's, a driver's or Optuna's own: all mean the same here
            why = " ".join(str(e).split())[:300]
            raise SpecError(f"the study's Optuna storage {self.storage_shown} could not be opened ({type(e).__name__}: "
                            f"{why}): set {OPTUNA_STORAGE_ENV} to an SQLAlchemy URL of a database this process can "
                            "reach (e.g. postgresql+psycopg://USER:PASSWORD@HOST:5432/optuna), or unset it for a local "
                            "SQLite file under Prefect's home") from e
        self._same_judging(direction)
        self._trial_ids = {t.number: t._trial_id for t in self.study.get_trials(deepcopy=False)}

    def _same_judging(self, direction: str) -> None:
        """A resumed study judges by what it judged by: its Optuna study's direction and metric are this run file's,
        or `SpecError` names both (the trials told so far were told the other's values)."""
        metric = self.spec.study.metric
        stored = self.study.user_attrs.get("metric")
        if stored is None and not self.study.get_trials(deepcopy=False):
            self.study.set_user_attr("metric", metric)
            stored = metric
        then = self.study.direction.name.lower()
        if (stored or metric, then) != (metric, direction):
            raise SpecError(f"the study's Optuna study {self.name} in {self.storage_shown} was told {stored or '?'} to "
                            f"{then}, and this run file asks {metric} to {direction}: its trials' values mean the "
                            "other, so nothing was started. Resume the study with its own study.metric and "
                            "study.direction, or start a new study")

    def asked(self) -> list[tuple[int, dict[str, Any], Child | None]]:
        """Every trial asked before (a resumed study's): its child's index, its values, and its child (None when the
        values make no valid run: it was told FAIL when asked)."""
        found = []
        for trial in self.study.get_trials(deepcopy=False):
            values = {path: trial.params[path] for path in self.space if path in trial.params}
            try:
                child = make_child(self.spec.name, self.base, trial.number + 1, values)
            except ValidationError:
                child = None
            found.append((trial.number + 1, values, child))
        return found

    def told(self) -> dict[int, tuple[str, str]]:
        """The children whose trials were told, by index: the row state and reason they were told with."""
        return {t.number + 1: (t.user_attrs.get("row_state", "failed"), t.user_attrs.get("reason", ""))
                for t in self.study.get_trials(deepcopy=False, states=_ENDED)}

    def left(self) -> int:
        """Trials still to ask."""
        return max(0, (self.spec.study.trials or 0) - len(self._trial_ids))

    def rebuild(self, found: Sequence[FoundChild]) -> int:
        """Add the trials the Optuna study lacks that the study's child runs show (`found`: every run an earlier
        process of this study started; a resume on another machine, or after the Optuna file was lost, opens an
        empty study): each child's trial with the values its run was given, RUNNING, so that its run is adopted and
        its trial told as any asked trial's is; an index with no run (asked, never started) a FAIL trial told
        `not started`. Trials are numbered in order, so each keeps its child's index. Returns the trials added.
        `SpecError`, naming the storage, when a run's values are not this run file's space's, or its trial here
        holds other values than its run."""
        specs: dict[int, list[dict[str, Any]]] = {}
        for run in found:
            specs.setdefault(run.index, []).append(run.spec)
        trials = self.study.get_trials(deepcopy=False)
        problems, values_of = [], {}
        for index in sorted(specs):
            distinct = {repr(v): v for v in (self._values_of(s) for s in specs[index])}
            if len(distinct) > 1 or None in distinct.values():
                problems.append(f"child {index}'s runs were given " + (" and ".join(distinct) if len(distinct) > 1
                                else f"no value of each of {', '.join(self.space)}"))
                continue
            (values,) = distinct.values()
            if index <= len(trials) and trials[index - 1].params != values:
                problems.append(f"trial {index - 1} holds {describe_values(trials[index - 1].params)} where its "
                                f"child's run trained {describe_values(values)}")
            values_of[index] = values
        added = []
        for index in range(len(trials) + 1, max(specs, default=0) + 1):
            if index not in values_of:
                added.append(create_trial(state=TrialState.FAIL, user_attrs={
                    "row_state": "not started", "reason": f"its trial was lost with the Optuna study in "
                    f"{self.storage_shown} before its child started"}))
                continue
            try:
                added.append(create_trial(state=TrialState.RUNNING, params=values_of[index],
                                          distributions={path: self.space[path] for path in values_of[index]},
                                          user_attrs={"child": make_child(self.spec.name, self.base, index,
                                                                          values_of[index]).spec.name}))
            except (ValueError, ValidationError) as e:
                problems.append(f"child {index} ran {describe_values(values_of[index])}, outside this run file's "
                                f"study.space ({' '.join(str(e).split())[:200]})")
        if problems:
            raise SpecError(f"the study's Optuna study {self.name} in {self.storage_shown} holds {len(trials)} "
                            f"trial(s) and its children's runs show {max(specs)}, and the missing trials cannot be "
                            "rebuilt from them, so nothing was started: resume the study with its own run file and "
                            f"{OPTUNA_STORAGE_ENV} set to the storage it ran with\n"
                            + "\n".join(f"  - {p}" for p in problems))
        for trial in added:
            self.study.add_trial(trial)
        self._trial_ids = {t.number: t._trial_id for t in self.study.get_trials(deepcopy=False)}
        return len(added)

    def _values_of(self, spec: dict[str, Any]) -> dict[str, Any] | None:
        """The space's values in the `spec` a child's run was given; None when one is missing."""
        values = {}
        for path in self.space:
            section: Any = spec
            for key in path.split("."):
                if not isinstance(section, dict) or key not in section:
                    return None
                section = section[key]
            values[path] = section
        return values

    def ask(self) -> Child:
        """The next trial's child, its values Optuna's. `InvalidTrial` (told FAIL) when they make no valid run."""
        trial = self.study.ask(self.space)
        self._trial_ids[trial.number] = trial._trial_id
        index, values = trial.number + 1, {path: trial.params[path] for path in self.space}
        try:
            child = make_child(self.spec.name, self.base, index, values)
        except ValidationError as e:
            problem = describe_validation_error(e, f"trial {trial.number} ({describe_values(values)})")
            self._tell(index, None, TrialState.FAIL, "failed", problem)
            raise InvalidTrial(index, values, problem) from None
        trial.set_user_attr("child", child.spec.name)
        return child

    def report(self, index: int, series: dict[int, float]) -> None:
        """The child's evaluations since its first step, as its trial's intermediate values (each step once)."""
        trial = self._running(index)
        if trial is None:
            return
        reported = self.study._storage.get_trial(trial._trial_id).intermediate_values
        for step in trained_steps(series):
            if step not in reported:
                trial.report(series[step], step)

    def should_prune(self, index: int, after_evals: int) -> Verdict | None:
        """Optuna's `MedianPruner` on the child's trial, from its `after_evals`-th evaluation on: why it is pruned
        (its best by its last step against the median of the completed trials there), or None."""
        trial = self._running(index)
        if trial is None:
            return None
        frozen = self.study._storage.get_trial(trial._trial_id)
        if len(frozen.intermediate_values) < after_evals or not trial.should_prune():
            return None
        step = frozen.last_step
        values = list(frozen.intermediate_values.values())
        best = max(values) if self.spec.study.maximize() else min(values)
        theirs = [t.intermediate_values[step] for t in self.study.get_trials(deepcopy=False,
                                                                               states=(TrialState.COMPLETE,))
                  if step in t.intermediate_values]
        return Verdict(step, best, statistics.median(theirs) if theirs else math.nan, len(theirs))

    def tell(self, row: ChildRow) -> None:
        """How the child of `row` ended, told once: its `metric` when it completed with one, `PRUNED`, else `FAIL`."""
        if row.state == "completed" and row.metric is not None and math.isfinite(row.metric):
            self._tell(row.index, row.metric, TrialState.COMPLETE, row.state, row.reason, row.flow_run_id)
        else:
            state = TrialState.PRUNED if row.state == "pruned" else TrialState.FAIL
            self._tell(row.index, None, state, row.state, row.reason, row.flow_run_id)

    def tell_pruned(self, index: int, reason: str, flow_run_id: str | None) -> None:
        """The child was pruned: told at once, so a resumed study never starts it again."""
        self._tell(index, None, TrialState.PRUNED, "pruned", reason, flow_run_id)

    def _running(self, index: int) -> optuna.trial.Trial | None:
        trial_id = self._trial_ids.get(index - 1)
        if trial_id is None or self.study._storage.get_trial(trial_id).state != TrialState.RUNNING:
            return None
        return optuna.trial.Trial(self.study, trial_id)

    def _tell(self, index: int, value: float | None, state: TrialState, row_state: str, reason: str,
              flow_run_id: str | None = None) -> None:
        trial = self._running(index)
        if trial is None:
            return  # told already (a pruned child's end, an adopted trial's)
        # What the row said, for a resumed study to show a child it will not run again, and the dashboard to link.
        trial.set_user_attr("row_state", row_state)
        trial.set_user_attr("reason", reason[:500])
        if flow_run_id:
            trial.set_user_attr("flow_run_id", flow_run_id)
        self.study.tell(index - 1, value if state == TrialState.COMPLETE else None, state=state)
