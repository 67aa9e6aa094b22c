"""Pruning a study's losing children (`[study] prune`): their evaluations read back from `loraflow.run.evaluated`
(one request a round for all the running children), the median rule that judges them, the cancel that stops one,
and `Pruning`, which does that each round of the study's poll.

The rule is Optuna's `MedianPruner` comparison (`optuna/pruners/_percentile.py`), mirrored in a plain function rather
than called: Optuna's pruner compares a trial with the trials that *completed*, at the trial's last reported step,
where a grid study's children run side by side, so that a loser is seen while the others still run. Here nothing is
pruned before `startup_children` children completed (Optuna's `n_startup_trials`: the median of a few children side by
side is noise); then a child's setting (its values but the seed) is compared, by the mean over its seeds of each one's
best value by an evaluation step, with the median of the other settings' means at that same step (running or ended,
their seeds that reached it), so that two seeds of one setting never prune each other and a setting is pruned as a
whole; otherwise as Optuna: a NaN is pruned, one other setting at the step is enough, and the judged step is the
latest of the child's that another setting reached. One difference the events make: a running child's events hold
the evaluations a poll of its job saw (the worker's progress carries the latest one, so evaluations that come faster
than the polls are seen only in its final metrics), so another child that reached the step but has no value at it
counts with its latest one before it (a loss that has only fallen since: the rule errs towards keeping the child). A
search (`search = "tpe"`) passes the rule to Optuna's own `MedianPruner` instead (`flows/study_search.py`), each
completed trial reported with all its evaluations.

A pruned child is cancelled as a study cancels its children (CANCELLING: its train flow cancels its job and deletes
its endpoint, in the study's process or on a worker alike) and tagged `study-pruned:<step>` first, so that a resumed
study, which finds its children by their tags, neither starts it again nor reads it as an ordinary cancel.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Protocol

import httpx
from loraflow_worker.contract import TrainMetrics
from prefect import get_client, get_run_logger
from prefect.events.filters import EventFilter, EventNameFilter, EventOccurredFilter, EventResourceFilter
from prefect.exceptions import ObjectNotFound
from prefect.states import Cancelling

from tasks.reports import events
from tasks.reports.study import SERIES_OF_METRIC

log = logging.getLogger("loraflow.study")

PRUNED_TAG = "study-pruned:"
"""A pruned child's tag, followed by the step it was judged at."""
OVERLAP_S = 30.0
"""How far back each read of the evaluations reaches before the previous one: the server stores events in batches, so
one that occurred before the last read may become readable after it (each event is counted once, by its id)."""
EVENTS_PAGE = 50
"""Events per read (the most the server's `/events/filter` returns at once); a later page only when one is full."""
IDS_PER_READ = 50
"""Children named in one filter (a resumed study reads its earlier children's evaluations once, in such reads)."""
_HISTORY = timedelta(days=8)  # a run lives at most 7 days


@dataclass(frozen=True)
class Verdict:
    """Why a child was pruned: at `step`, its best value by then against the median of `others` other children."""

    step: int
    value: float
    median: float
    others: int

    def reason(self, metric: str, against: str = "other child(ren)") -> str:
        """`pruned at step 8: eval_loss 6.1 (its best by then) was worse than the median 5.2 of 2 other child(ren)
        at that step`."""
        return (f"pruned at step {self.step}: {metric} {self.value:.4g} (its best by then) was worse than the median "
                f"{self.median:.4g} of {self.others} {against} at that step")


def trained_steps(series: dict[int, float]) -> list[int]:
    """The steps of a child's evaluations since its first step: the one before it (step 0, the base model) tells
    nothing of the child's settings, so it is neither judged nor counted."""
    return sorted(step for step in series if step > 0)


def median_rule(own: dict[int, float], others: Iterable[dict[int, float] | Sequence[dict[int, float]]], *,
                after_evals: int, maximize: bool, own_seeds: Sequence[dict[int, float]] = (), completed: int = 0,
                startup: int = 0) -> Verdict | None:
    """Whether a running child whose evaluations are `own` (step → value) is pruned, given the other settings'
    (`others`: each one child's series, or the series of a setting's seeds; running or ended) and the other seeds of
    its own setting (`own_seeds`). Nothing is pruned before `startup` children `completed` (Optuna's
    `n_startup_trials`). Then it is judged at its latest evaluation step, from its `after_evals`-th on, that another
    setting reached: its setting's value there is the mean over its seeds of each one's best by that step, another
    setting's the mean of its seeds' values there (those that reached it), and it is pruned when its setting's is worse
    than the median of the others'. So seeds of one setting never prune each other, and a seed is pruned only with
    its setting. None: not pruned (too few evaluations or completed children yet, no other setting at any of its
    steps yet, or not worse)."""
    steps = trained_steps(own)
    if len(steps) < after_evals or completed < startup:
        return None
    settings = [[o] if isinstance(o, dict) else list(o) for o in others]
    for step in reversed(steps[after_evals - 1:]):
        theirs = [statistics.fmean(reached) for setting in settings
                  if (reached := [v for o in setting if (v := value_at(o, step)) is not None and not math.isnan(v)])]
        if not theirs:
            continue
        values = [own[s] for s in steps if s <= step]
        if any(math.isnan(v) for v in values):  # Optuna's rule: a NaN has diverged
            return Verdict(step, math.nan, statistics.median(theirs), len(theirs))
        bests = [max(values) if maximize else min(values)]
        for seed in own_seeds:  # the setting's other seeds, those that reached the step, each at its best by then
            reached = [v for s, v in seed.items() if 0 < s <= step and not math.isnan(v)]
            if reached and value_at(seed, step) is not None:
                bests.append(max(reached) if maximize else min(reached))
        best, median = statistics.fmean(bests), statistics.median(theirs)
        worse = best < median if maximize else best > median
        return Verdict(step, best, median, len(theirs)) if worse else None
    return None


def value_at(series: dict[int, float], step: int) -> float | None:
    """A child's value at `step`: its own there, else, when it reached the step (it has evaluated at or after it),
    its latest since its first step before it; None when it has not reached the step."""
    if step in series:
        return series[step]
    trained = trained_steps(series)
    before = [s for s in trained if s < step]
    return series[before[-1]] if before and trained[-1] > step else None


def pruned_step(tags: Iterable[str] | None) -> int | None:
    """The step a child's run was pruned at, from its `study-pruned:<step>` tag; None when it was not pruned."""
    for tag in tags or ():
        if tag.startswith(PRUNED_TAG) and tag[len(PRUNED_TAG):].isdigit():
            return int(tag[len(PRUNED_TAG):])
    return None


@dataclass
class EvaluationLog:
    """A study's metric at each evaluation of each child run read so far (`series`: its name in `metrics.json` and
    in `loraflow.run.evaluated`'s payload, e.g. `eval_loss`), by flow run id."""

    series: str
    by_run: dict[str, dict[int, float]] = field(default_factory=dict)
    _seen: dict[str, datetime] = field(default_factory=dict)  # event id → when it occurred
    _since: datetime | None = None

    def of(self, flow_run_id: str | None) -> dict[int, float]:
        return self.by_run.get(flow_run_id or "", {})

    def add(self, flow_run_id: str, points: Iterable[tuple[int, float]]) -> None:
        """Evaluations known otherwise (a completed child's own metrics, which hold every one)."""
        self.by_run.setdefault(flow_run_id, {}).update({int(step): float(value) for step, value in points})

    def read(self, flow_run_ids: Sequence[str]) -> None:
        """The new `loraflow.run.evaluated` of these runs: one request for all of them (another page only when one is
        full), from a little before the previous read. Never raises: an unreadable server is read again next round."""
        if not flow_run_ids:
            return
        now = datetime.now(UTC)
        try:
            self._read(list(flow_run_ids), self._since or now - _HISTORY, now)
        except (httpx.HTTPError, ObjectNotFound) as e:
            log.warning("Could not read the children's evaluations yet (%s: %s)", type(e).__name__, e)
            return
        self._since = now - timedelta(seconds=OVERLAP_S)
        self._seen = {i: at for i, at in self._seen.items() if at >= self._since - timedelta(seconds=OVERLAP_S)}

    def read_history(self, flow_run_ids: Sequence[str]) -> None:
        """Every evaluation these runs sent (a resumed study's earlier children), `IDS_PER_READ` runs a read."""
        now = datetime.now(UTC)
        for start in range(0, len(flow_run_ids), IDS_PER_READ):
            try:
                self._read(list(flow_run_ids[start:start + IDS_PER_READ]), now - _HISTORY, now)
            except (httpx.HTTPError, ObjectNotFound) as e:
                log.warning("Could not read the earlier children's evaluations (%s: %s): they are judged without "
                            "them", type(e).__name__, e)

    def _read(self, flow_run_ids: list[str], since: datetime, now: datetime) -> None:
        event_filter = EventFilter(
            occurred=EventOccurredFilter(since=since, until=now + timedelta(hours=1)),
            event=EventNameFilter(name=[events.RUN_EVALUATED]),
            resource=EventResourceFilter(id=[f"{events.RUN_RESOURCE}{i}" for i in flow_run_ids]))
        with get_client(sync_client=True) as client:
            page = client.read_events(event_filter, limit=EVENTS_PAGE)
            while True:
                for event in page.events:
                    self._take(event)
                if page.next_page is None or len(page.events) < EVENTS_PAGE:
                    return
                page = client.read_events_page(page.next_page)

    def _take(self, event) -> None:
        event_id = str(event.id)
        if event_id in self._seen:
            return
        self._seen[event_id] = event.occurred
        run_id = event.resource.id.removeprefix(events.RUN_RESOURCE)
        step, value = event.payload.get("step"), event.payload.get(self.series)
        if isinstance(step, int) and isinstance(value, (int, float)):
            self.by_run.setdefault(run_id, {})[step] = float(value)


def prune_child(flow_run_id: str, step: int, reason: str) -> bool:
    """Stop a pruned child: tag it `study-pruned:<step>`, then ask it to cancel (CANCELLING, as a cancelled study
    asks its children): its train flow cancels its job, deletes its endpoint and ends Cancelled, its cost in its
    `loraflow.run.finished`. False when it had ended meanwhile, or the server could not be reached (judged again
    next round). Never raises."""
    try:
        with get_client(sync_client=True) as client:
            run = client.read_flow_run(flow_run_id)
            if run.state is None or run.state.is_final() or run.state.is_cancelling():
                return False
            if pruned_step(run.tags) is None:
                client.update_flow_run(flow_run_id, tags=[*run.tags, f"{PRUNED_TAG}{step}"])
            client.set_flow_run_state(flow_run_id, Cancelling(message=f"its study {reason}"), force=True)
            return True
    except (httpx.HTTPError, ObjectNotFound) as e:
        log.warning("Could not prune child %s yet (%s: %s)", flow_run_id, type(e).__name__, e)
        return False


class OptunaTrials(Protocol):
    """What pruning asks of a search's Optuna study (`flows/study_search.py`, `Search`), by child index."""

    def report(self, index: int, series: dict[int, float]) -> None: ...

    def should_prune(self, index: int, after_evals: int) -> Verdict | None: ...

    def tell_pruned(self, index: int, reason: str, flow_run_id: str | None) -> None: ...


class Pruning:
    """A study's pruning, round by round as it polls its children: the evaluations it has read, the run each child
    has now, and the children it pruned and why. A grid judges with `median_rule` over every other child that
    reached the step; a search (`search`) reports each evaluation to the child's trial and asks Optuna's
    `MedianPruner`, then tells the trial `PRUNED` at once."""

    def __init__(self, *, after_evals: int, metric: str, maximize: bool, startup: int = 0,
                 setting_of: dict[int, str] | None = None, search: OptunaTrials | None = None):
        self.after_evals, self.metric, self.maximize, self.startup = after_evals, metric, maximize, startup
        self.setting_of = setting_of or {}  # child index → its setting (its values but the seed): seeds judged as one
        self.completed: set[int] = set()  # the children that completed, for `startup`
        self.search = search
        self.log = EvaluationLog(SERIES_OF_METRIC[metric][0])
        self.run_of: dict[int, str] = {}  # child index → its latest run (running or ended): the others judged against
        self.reasons: dict[int, str] = {}  # child index → why it was pruned

    def adopt(self, runs: dict[int, str]) -> None:
        """A resumed study's earlier children (child index → run): their evaluations so far, read once."""
        self.run_of.update(runs)
        self.log.read_history(list(runs.values()))

    def round(self, running: dict[int, str], watched: list[str]) -> list[int]:
        """Read the new evaluations of `watched` (the runs still going, or ended with their cost unread) and judge
        each `running` child (index → run): a loser is cancelled. Returns the children pruned this round."""
        self.run_of.update(running)
        self.log.read(watched)
        pruned = []
        for index, run_id in running.items():
            if index in self.reasons:
                continue  # asked to cancel already; it ends Cancelled shortly
            verdict, against = self._judge(index, run_id)
            if verdict is None:
                continue
            reason = verdict.reason(self.metric, against)
            if prune_child(run_id, verdict.step, reason):
                self.reasons[index] = reason
                if self.search is not None:
                    self.search.tell_pruned(index, reason, run_id)
                get_run_logger().warning("Child %d (%s) %s: cancelling it", index, run_id, reason)
                pruned.append(index)
        return pruned

    def ended(self, index: int, run_id: str | None, metrics: TrainMetrics | None, *, completed: bool) -> None:
        """A child ended (`completed`: it completed, which counts towards `startup`): the evaluations of a completed
        one are all in its metrics when the study has them (a subflow's; some were never events: see the module's
        docstring), for the children judged after it (a search's trial is reported them before it is told)."""
        if completed:
            self.completed.add(index)
        if run_id is None:
            return
        self.run_of[index] = run_id
        if metrics is not None:
            self.log.add(run_id, getattr(metrics, self.log.series))
            if self.search is not None:  # the completed trial's every step, for the trials judged against it
                self.search.report(index, self.log.of(run_id))

    def _judge(self, index: int, run_id: str) -> tuple[Verdict | None, str]:
        own = self.log.of(run_id)
        if self.search is not None:
            self.search.report(index, own)
            return self.search.should_prune(index, self.after_evals), "completed trial(s)"
        settings: dict[object, list[dict[int, float]]] = {}
        for i, other in self.run_of.items():
            if i != index:
                settings.setdefault(self.setting_of.get(i, i), []).append(self.log.of(other))
        own_seeds = settings.pop(self.setting_of.get(index, index), [])
        verdict = median_rule(own, list(settings.values()), after_evals=self.after_evals, maximize=self.maximize,
                              own_seeds=own_seeds, completed=len(self.completed - {index}), startup=self.startup)
        seeded = own_seeds or any(len(s) > 1 for s in settings.values())
        return verdict, "other setting(s) (the mean of each one's seeds)" if seeded else "other child(ren)"
