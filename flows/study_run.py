"""How a study runs its children: adopts what an earlier process of it left, starts the rest `parallel` at a time
within its budget, waits on them by polling Prefect, and reads each one's outcome as it ends.

A child is a `train` flow run either way:
- with `study.deployment`, a run of that deployment (`run_deployment`, `timeout=0`, a subflow of the study with its
  tags and the idempotency key `<study>:<index>:v<its values' fingerprint>`): it runs on whichever worker serves the
  deployment's pool, in a process of its own, and the study holds nothing for it but a flow run id, read back with
  every other running child's in one request a round;
- without, a subflow in the study's own process (one thread per running child: one machine, the local demo).

The study may be started again in the same flow run (`python -m flows.study RUN_FILE --resume <id>`, or a Prefect
retry): it finds the runs its earlier process started by their tag and adopts those that completed or were pruned,
and the deployment runs still going; only the rest start (`adoption_plan`).

With `prune`, each round also reads the running children's new evaluations and cancels a loser
(`tasks/lifecycle/study_pruning.py`); with `search = "tpe"`, the children are not known in advance: each is asked of
Optuna when a slot frees, and its trial told how it ended (`flows/study_search.py`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
from loraflow_worker.contract import JobResult
from prefect import get_client, get_run_logger, tags, task
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import FlowRun, StateType
from prefect.exceptions import ObjectNotFound
from prefect.futures import PrefectFuture, wait
from prefect.runtime import flow_run

from flows.forms.overrides import RunOverrides
from flows.forms.run import RunSpec, SpecError
from flows.study_search import InvalidTrial, Search
from flows.forms.study import Child, StudySpec, child_label, describe_values, spec_difference
from flows.train import train
from tasks.lifecycle.steps import run_cancel_requested
from tasks.lifecycle.study_children import (
    EVENT_WAIT_S,
    ChildPlan,
    adoption_plan,
    cancel_children,
    child_key,
    earlier_cost,
    end_stale_children,
    flow_run_page,
    found_child,
    read_child_costs,
    read_runs,
    run_minutes,
    start_deployment_child,
    study_child_runs,
    study_tags,
    unfinished_children,
)
from tasks.lifecycle.study_pruning import Pruning, pruned_step
from tasks.placement.cost import study_budget_decision
from tasks.reports.study import ChildRow, best_child, completed_row
from tasks.reports.study_names import child_name
from tasks.settings import Settings
from tasks.storage.artifacts import RunResults, read_run_results

POLL_SECONDS = 5.0
"""How often the study looks at its own state (a cancel) and its running children."""
_FINAL = {StateType.COMPLETED, StateType.FAILED, StateType.CRASHED, StateType.CANCELLED}


@dataclass
class Going:
    """A child the study started or adopted and has not yet written its row for."""

    child: Child
    ceiling: float
    flow_run_id: str | None = None  # a deployment run's from its start; a subflow's once its task returns
    future: PrefectFuture | None = None  # a subflow's task, while it runs
    results: RunResults | None = None  # a subflow that completed: what it returned (its job's own result)
    ended: FlowRun | None = None  # its flow run once it ended, while its cost is read
    ended_at: float = 0.0  # when it was seen ended (monotonic)
    error: str | None = None  # why its outcome could not be read (a subflow's task that raised)
    late_told: bool = False  # whether the log has said that no worker picked it up in time


@dataclass
class Outcome:
    """What the children's run leaves for the comparison."""

    rows: list[ChildRow]
    pins: dict[int, JobResult]  # the best subflow child's job result, which pins its adapter for publishing
    cancelled: bool


def child_parameters(spec: RunSpec) -> dict:
    """A deployment child's parameters: its whole spec (the fields its run file set, so that the rules that judge
    what was set judge it as they judged the child here), and every other parameter of the train flow explicitly
    None, so that no default of the deployment's (a `run_file`, a `max_steps`) replaces or changes it."""
    return {"spec": spec.model_dump(mode="json", exclude_unset=True)} | dict.fromkeys(RunOverrides.model_fields)


@task(name="study-child", cache_policy=NO_CACHE)
def run_child(child: Child, study_name: str, study_run_id: str) -> tuple[str | None, RunResults | None]:
    """One child as a `train` subflow in the study's process, tagged with the study: its flow run id (None when the
    study was cancelled before it started) and, when it completed, what it returned. Never raises for the child's own
    failure: the study reads that from its flow run."""
    if run_cancel_requested():  # the study's own state: this task runs in the study's flow run
        return None, None
    with tags(*study_tags(study_name, study_run_id)):
        final = train(child.spec, return_state=True)
    return str(final.state_details.flow_run_id), final.result() if final.is_completed() else None


def run_children(children: list[Child], spec: StudySpec, study_run_id: str, ceiling_of: Callable[[Child], float],
                 search: Search | None = None) -> Outcome:
    """Adopt, start and wait on the children until each has a row; a cancel of the study cancels the running
    children (each tears its endpoint down) and starts no more. `ceiling_of`: a child's cost ceiling (USD). With
    `search`, `children` are those its trials asked before (a resumed study's), and the rest are asked as slots free.
    Rows in the study's order."""
    logger = get_run_logger()
    settings = spec.study
    total = settings.children()
    told = search.told() if search is not None else {}
    plans = _plan(children, study_run_id, told)
    # The seeds of one setting are judged as one (a search's trials are Optuna's to judge, one by one).
    setting_of = {c.index: describe_values({p: v for p, v in c.values.items() if p != "training.seed"})
                  for c in children} if search is None else {}
    pruning = (Pruning(after_evals=settings.prune.after_evals, metric=settings.metric, maximize=settings.maximize(),
                       startup=settings.prune.startup_children, setting_of=setting_of, search=search)
               if settings.prune is not None else None)
    earlier = _earlier_costs(children, plans, ceiling_of)
    rows: dict[int, ChildRow] = {}
    going: dict[int, Going] = {}
    pending: list[tuple[Child, int]] = []
    for child in children:
        plan = plans[child.index]
        if plan.action == "adopt":
            going[child.index] = Going(child, ceiling_of(child), flow_run_id=plan.run.flow_run_id)
        elif plan.action == "told":  # a trial told how it ended, with no run: its row is what it was told with
            state, reason = told[child.index]
            known = state in ("failed", "skipped", "not started", "cancelled")  # those a child with no run ends as
            rows[child.index] = _row(child, state=state if known else "failed", reason=reason,
                                     ceiling=ceiling_of(child))
        else:
            pending.append((child, plan.start))
    for index, values, child in search.asked() if search is not None else []:
        if child is None:  # values that made no valid run: told FAIL when asked
            rows[index] = _trial_row(spec, index, values, told.get(index, ("failed", ""))[1])
    if pruning is not None:
        pruning.adopt({g.child.index: g.flow_run_id for g in going.values() if g.flow_run_id})
    run_tags = list(dict.fromkeys([*study_tags(spec.name, study_run_id), *(flow_run.tags or [])]))
    spent, pins, cancelled = sum(earlier.values()), {}, False
    if spent:
        logger.info("Earlier starts of %d child(ren) cost $%.4f: counted in the study's budget and their rows",
                    len(earlier), spent)
    while pending or going or (search is not None and search.left() and not cancelled):
        if not cancelled and run_cancel_requested():
            cancelled = True
            logger.warning("Study cancelled: cancelling its running children, starting no more")
            for child, _ in pending:
                rows[child.index] = _row(child, state="not started", reason="the study was cancelled first",
                                         ceiling=ceiling_of(child))
                _tell(search, rows[child.index])
            pending = []
        if cancelled:
            cancel_children(study_run_id)  # again each round: a child that had just started is caught too
        while not cancelled and sum(g.ended is None for g in going.values()) < settings.parallel:
            if not pending and search is not None and search.left():
                try:
                    pending.append((search.ask(), 1))
                except InvalidTrial as invalid:
                    rows[invalid.index] = _trial_row(spec, invalid.index, invalid.values, invalid.problem)
                    logger.warning("Trial %d's values make no valid run: %s", invalid.index - 1, invalid.problem)
                continue
            if not pending:
                break
            child, start = pending[0]
            ceiling = ceiling_of(child)
            decision, why = study_budget_decision(settings.budget_usd, spent, [g.ceiling for g in going.values()],
                                                  ceiling)
            if decision == "wait":
                break
            pending.pop(0)
            if decision == "skip":
                rows[child.index] = _row(child, state="skipped", reason=why, ceiling=ceiling)
                _tell(search, rows[child.index])
                logger.warning("Child %d/%d %s skipped: %s", child.index, total, child.spec.name, why)
                continue
            started = _start(child, ceiling, spec, study_run_id, run_tags, start)
            if isinstance(started, ChildRow):
                rows[child.index] = started
                _tell(search, started)
            else:
                going[child.index] = started
        _wait_a_round(going)
        if pruning is not None and not cancelled:
            _find_subflow_runs(going, study_run_id)
            pruning.round({i: g.flow_run_id for i, g in going.items() if g.flow_run_id and g.ended is None},
                          [g.flow_run_id for g in going.values() if g.flow_run_id])
        for index, ended in _settled(going, spec, pruning.reasons if pruning is not None else {}):
            child_row, results = ended
            rows[index] = child_row
            if child_row.state != "not started":  # a child that ran with no readable cost counts at its ceiling
                spent += child_row.cost_usd if child_row.cost_usd is not None else child_row.cost_ceiling_usd or 0.0
            if results is not None and results.result is not None:
                pins[index] = results.result
            if pruning is not None:
                pruning.ended(index, child_row.flow_run_id, results.result.metrics
                              if results is not None and results.result is not None else None,
                              completed=child_row.state == "completed")
            _tell(search, child_row)
            best = best_child(list(rows.values()), settings.maximize())
            pins = {i: r for i, r in pins.items() if best is not None and i == best.index}
            logger.info("Child %d/%d %s (%s) ended %s", index, total, child_row.name, child_row.values,
                        child_row.state)
    for index, usd in earlier.items():  # a child's row counts every start of it
        if index in rows:
            rows[index] = rows[index].model_copy(update={"cost_usd": round((rows[index].cost_usd or 0.0) + usd, 6)})
    return Outcome(rows=[rows[i] for i in sorted(rows)], pins=pins, cancelled=cancelled)


def _earlier_costs(children: list[Child], plans: dict[int, ChildPlan],
                   ceiling_of: Callable[[Child], float]) -> dict[int, float]:
    """What each child's earlier starts (`ChildPlan.earlier`) cost, by child index: their `loraflow.run.finished`,
    else their wall time at the child's ceiling (`earlier_cost`). Empty on a first start."""
    ids = {run_id: index for index, plan in plans.items() for run_id in plan.earlier}
    if not ids:
        return {}
    by_index = {c.index: c for c in children}
    costs = read_child_costs(list(ids))
    runs = read_runs(list(ids))
    spent: dict[int, float] = {}
    for run_id, index in ids.items():
        child = by_index[index]
        run = runs.get(run_id)
        usd = earlier_cost(costs.get(run_id), run_minutes(run) if run is not None else None, ceiling_of(child),
                           child.spec.deadline_minutes)
        spent[index] = spent.get(index, 0.0) + usd
    return {index: usd for index, usd in spent.items() if usd > 0}


def rebuild_trials(search: Search, study_run_id: str) -> None:
    """A resumed search whose Optuna study lacks trials its children's runs show (opened on another machine, or its
    file lost) gets them back from those runs (`Search.rebuild`), before it asks for more: else it would ask new
    values at indices whose children already ran. `SpecError` when they cannot be rebuilt."""
    trials = search.spec.study.trials or 0
    by_name = {child_name(search.spec.name, {}, i, set()): i for i in range(1, trials + 1)}
    found = [f for run in study_child_runs(study_run_id) if (f := found_child(run, study_run_id, by_name))]
    added = search.rebuild(found)
    if added:
        get_run_logger().warning("The Optuna study %s in %s lacked %d trial(s) this study's children ran: rebuilt "
                                 "from their runs' values (their results are told as they are read)", search.name,
                                 search.storage_shown, added)


def _trial_row(spec: StudySpec, index: int, values: dict, problem: str) -> ChildRow:
    """The row of a search's trial whose values make no valid run: it never ran."""
    return ChildRow(index=index, name=f"{spec.name} trial {index - 1}", values=describe_values(values), state="failed",
                    reason=problem[:500])


def _tell(search: Search | None, row: ChildRow) -> None:
    if search is not None:
        search.tell(row)


def _plan(children: list[Child], study_run_id: str, told: dict[int, tuple[str, str]]) -> dict[int, ChildPlan]:
    """What to do with each child, from the runs an earlier process of this study left (none on a first start);
    `told`: a search's trials told how they ended, never started again. A resumed study given another run file than
    its own would adopt other children's runs: refused, naming them."""
    logger = get_run_logger()
    by_name = {c.spec.name: c.index for c in children}
    found = [f for run in study_child_runs(study_run_id) if (f := found_child(run, study_run_id, by_name))]
    plans = adoption_plan([c.index for c in children], found, final=told)
    differ = [f"  - {child_label(c.index, c.values)}: {why}" for c in children
              if (plan := plans[c.index]).run is not None and (why := spec_difference(plan.run.spec, c.spec))]
    if differ:
        raise SpecError(f"{len(differ)} child run(s) this study started before ran another spec than this run file "
                        "gives them, so nothing was started: resume the study with its own run file\n"
                        + "\n".join(differ))
    stale = [run_id for plan in plans.values() for run_id in plan.stale]
    if stale:
        logger.warning("%d child subflow(s) died with the study's earlier process: tearing them down, to run again",
                       len(stale))
        end_stale_children(stale)
    if found or told:
        adopted = [p.run for p in plans.values() if p.action == "adopt"]
        logger.info("Resumed: %d child run(s) found; adopting %d completed, %d pruned and %d still running; %d to "
                    "start", len(found), sum(r.state == "COMPLETED" for r in adopted),
                    sum(r.pruned_at is not None and r.state != "COMPLETED" for r in adopted),
                    sum(r.state not in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED") and r.pruned_at is None
                        for r in adopted), sum(p.action == "start" for p in plans.values()))
    return plans


def _start(child: Child, ceiling: float, spec: StudySpec, study_run_id: str, run_tags: list[str],
           start: int) -> Going | ChildRow:
    """Start the child (its `start`-th start) as a deployment run or a subflow; a row when it could not start."""
    deployment = spec.study.deployment
    if deployment is None:
        return Going(child, ceiling, future=run_child.submit(child, spec.name, study_run_id))
    try:
        key = child_key(study_run_id, child.index, child.values, start)
        return Going(child, ceiling, flow_run_id=start_deployment_child(deployment, child_parameters(child.spec),
                                                                        run_tags, key))
    except (httpx.HTTPError, ObjectNotFound) as e:
        return _row(child, state="failed", ceiling=ceiling,
                    reason=f"could not be started as a run of {deployment}: {type(e).__name__}: {e}"[:500])


def _wait_a_round(going: dict[int, Going]) -> None:
    """Until a subflow child ends or `POLL_SECONDS` pass; then a subflow that ended has its flow run id."""
    futures = {g.future: g for g in going.values() if g.future is not None}
    if not futures:
        if going:
            time.sleep(POLL_SECONDS)
        return
    done, _ = wait(list(futures), timeout=POLL_SECONDS)
    for future in done:
        g = futures[future]
        try:
            g.flow_run_id, g.results = future.result()
        except Exception as e:  # noqa: BLE001 - one child's unreadable outcome is its row, not the study's end
            g.error = f"its outcome could not be read: {type(e).__name__}: {e}"[:500]
        g.future = None


def _find_subflow_runs(going: dict[int, Going], study_run_id: str) -> None:
    """The flow runs of the subflow children still running, which their tasks return only when they end: found by
    the study's tag and their names, in one request (pruning judges a child by its run's evaluations)."""
    missing = {g.child.spec.name: index for index, g in going.items() if g.future is not None and not g.flow_run_id}
    if not missing:
        return
    try:
        with get_client(sync_client=True) as client:
            runs = unfinished_children(client, study_run_id)
    except (httpx.HTTPError, ObjectNotFound):
        return  # found next round
    for run in runs:
        if (found := found_child(run, study_run_id, missing)) is not None and not found.deployment:
            going[found.index].flow_run_id = found.flow_run_id


def _settled(going: dict[int, Going], spec: StudySpec,
             pruned: dict[int, str]) -> list[tuple[int, tuple[ChildRow, RunResults | None]]]:
    """The children whose run ended and whose cost is read (or not readable within `EVENT_WAIT_S`), each with its
    row and, for a subflow that completed, what it returned; taken out of `going`. `pruned`: why the study pruned
    the children it pruned, by index."""
    done = []
    for index, g in list(going.items()):
        if g.error is not None:
            done.append((index, (_row(g.child, state="failed", reason=g.error, ceiling=g.ceiling), None)))
        elif g.future is None and g.flow_run_id is None:  # its task saw the study cancelled before it started
            done.append((index, (_row(g.child, state="not started", reason="the study was cancelled first",
                                      ceiling=g.ceiling), None)))
        else:
            continue
        del going[index]
    # A subflow is read once its task returned (with its results); its run id may be known before (pruning).
    watched = [g.flow_run_id for g in going.values() if g.flow_run_id and g.ended is None and g.future is None]
    try:
        runs = read_runs(watched) if watched else {}
    except (httpx.HTTPError, ObjectNotFound):
        runs = {}  # read again next round
    now = time.monotonic()
    for g in going.values():
        run = runs.get(g.flow_run_id or "")
        if run is not None and run.state_type in _FINAL:
            g.ended, g.ended_at = run, now
        elif run is not None and run.state_name == "Late" and not g.late_told:
            # Prefect calls a run Late when no worker took it at its time: the study waits, but says why.
            g.late_told = True
            get_run_logger().warning("Child %s (%s) waits for a worker: no worker serving %s's pool has picked it "
                                     "up (start one: prefect worker start --pool <its pool>)", g.child.spec.name,
                                     g.flow_run_id, spec.study.deployment)
    ended = {g.flow_run_id: index for index, g in going.items() if g.ended is not None}
    costs = read_child_costs(list(ended)) if ended else {}
    for run_id, index in ended.items():
        g = going[index]
        if run_id not in costs and now - g.ended_at < EVENT_WAIT_S:
            continue  # its loraflow.run.finished may not be stored yet
        done.append((index, (_ended_row(g, costs.get(run_id), spec, pruned.get(index)), g.results)))
        del going[index]
    return done


def _ended_row(g: Going, cost: float | None, spec: StudySpec, pruned: str | None = None) -> ChildRow:
    """An ended child's row, from its flow run, its cost and (completed) its results: those it returned as a
    subflow, else those it stored under its own run id. A cancelled run the study pruned (`pruned`: why; else its
    `study-pruned:` tag, after a resume) is `pruned`."""
    run = g.ended
    run_id = str(run.id)
    row = _row(g.child, state="failed", ceiling=g.ceiling).model_copy(update={
        "flow_run_id": run_id, "summary_url": flow_run_page(run_id), "minutes": run_minutes(run), "cost_usd": cost})
    message = (run.state.message if run.state is not None else "") or (run.state_name or "")
    step = pruned_step(run.tags)
    if run.state_type == StateType.CANCELLED and (pruned or step is not None):
        return row.model_copy(update={"state": "pruned", "reason": (pruned or f"pruned at step {step}")[:500]})
    if run.state_type == StateType.CANCELLED:
        return row.model_copy(update={"state": "cancelled", "reason": message[:500]})
    if run.state_type != StateType.COMPLETED:
        return row.model_copy(update={"reason": message[:500]})
    results = g.results
    if results is None:
        try:
            results = read_run_results(spec.artifact_store, run_id,
                                       Settings().store_token(spec.artifact_store, spec.hub_token_secret))
        except Exception as e:  # noqa: BLE001 - a completed child whose results cannot be read is still a row
            return row.model_copy(update={"state": "completed", "reason": f"its results could not be read from "
                                          f"{spec.artifact_store}: {type(e).__name__}: {e}"[:500]})
    if not results.done or results.result is None:
        return row.model_copy(update={"state": "completed", "reason": "it completed but its results are not in "
                                      f"{spec.artifact_store}"})
    return completed_row(row, results.result.metrics, spec.study.metric).model_copy(
        update={"state": "completed", "adapter_url": results.adapter_url})


def _row(child: Child, *, state: str, ceiling: float, reason: str = "") -> ChildRow:
    return ChildRow(index=child.index, name=child.spec.name, values=describe_values(child.values), state=state,
                    reason=reason, cost_ceiling_usd=ceiling)
