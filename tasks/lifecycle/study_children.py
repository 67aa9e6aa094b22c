"""A study's children as Prefect knows them: found by the study's tag, started as deployment runs, adopted by a
resumed study, cancelled with it, and read back for the comparison (state, wall time, cost, page).

Children are found by tag (`study-run:<study flow run id>`), not by a list in the study's memory: the study's
cancellation and crash hooks run in another process when a runner kills the study's (Prefect's runner runs the
hooks itself), and they must still reach every child; a study started again (`--resume`, a Prefect retry) finds
what its earlier process started the same way. A child that runs as a deployment run carries an idempotency key,
`<study flow run id>:<child index>:<its values' fingerprint>` (`:<n>` after it for the child's n-th start), so that
starting it twice makes one run, and a child with other values at the same place (a search resumed without its Optuna
study asks new ones) never gets another child's run back from Prefect.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

import httpx
from prefect import get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterId,
    FlowRunFilterState,
    FlowRunFilterStateType,
    FlowRunFilterTags,
)
from prefect.client.schemas.objects import FlowRun, StateType
from prefect.client.schemas.sorting import FlowRunSort
from prefect.context import FlowRunContext
from prefect.events.filters import (
    EventFilter,
    EventNameFilter,
    EventOccurredFilter,
    EventResourceFilter,
)
from prefect.exceptions import ObjectNotFound
from prefect.settings import get_current_settings
from prefect.states import Cancelled, Cancelling, Crashed, Pending, Scheduled
from prefect.tasks import Task
from prefect.telemetry.run_telemetry import LABELS_TRACEPARENT_KEY
from prefect.utilities.slugify import slugify
from pydantic import BaseModel, Field

from tasks.lifecycle.study_pruning import pruned_step
from tasks.lifecycle.teardown import delete_run_endpoints, start_reconcile
from tasks.reports import events

log = logging.getLogger("loraflow.study")

EVENT_WAIT_S = 30.0
"""How long a finished child's `loraflow.run.finished` may take to be readable (the server stores events in batches)."""
NOT_FINAL = [StateType.SCHEDULED, StateType.PENDING, StateType.RUNNING, StateType.PAUSED, StateType.CANCELLING]
PAGE = 200
"""Flow runs per read (the Prefect server's default limit)."""
EVENTS_PAGE = 50
"""Events per read (the most the server's `/events/filter` returns at once)."""
_KEY = re.compile(r"^(?P<study>[0-9a-f-]{36}):(?P<index>[0-9]+)(?::v(?P<values>[0-9a-f]{12}))?(?::(?P<start>[0-9]+))?$")


def study_tags(study_name: str, study_run_id: str) -> list[str]:
    """The tags of every child: `study` (all studies' children), `study:<name>`, `study-run:<flow run id>`."""
    return ["study", f"study:{study_name}", f"study-run:{study_run_id}"]


def unfinished_children(client, study_run_id: str) -> list[FlowRun]:
    """The study's child flow runs that have not ended (`client`: a sync Prefect client)."""
    return _read_all(client, FlowRunFilter(tags=FlowRunFilterTags(all_=[f"study-run:{study_run_id}"]),
                                           state=FlowRunFilterState(type=FlowRunFilterStateType(any_=NOT_FINAL))))


def study_child_runs(study_run_id: str) -> list[FlowRun]:
    """Every flow run the study started, ended or not, in any earlier process of it."""
    with get_client(sync_client=True) as client:
        return _read_all(client, FlowRunFilter(tags=FlowRunFilterTags(all_=[f"study-run:{study_run_id}"])))


def read_runs(flow_run_ids: Sequence[str]) -> dict[str, FlowRun]:
    """The flow runs by id, in one read per `PAGE` (the study's poll of its running children)."""
    with get_client(sync_client=True) as client:
        found: dict[str, FlowRun] = {}
        for start in range(0, len(flow_run_ids), PAGE):
            ids = list(flow_run_ids[start:start + PAGE])
            for run in client.read_flow_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=ids)),
                                             limit=len(ids)):
                found[str(run.id)] = run
        return found


def _read_all(client, flow_run_filter: FlowRunFilter) -> list[FlowRun]:
    runs: list[FlowRun] = []
    while True:
        page = client.read_flow_runs(flow_run_filter=flow_run_filter, sort=FlowRunSort.ID_DESC, limit=PAGE,
                                     offset=len(runs))
        runs += page
        if len(page) < PAGE:
            return runs


def values_fingerprint(values: dict[str, Any]) -> str:
    """12 hex digits that differ for any two sets of a child's values (dotted field → value)."""
    text = json.dumps(values, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def child_key(study_run_id: str, index: int, values: dict[str, Any], start: int = 1) -> str:
    """The idempotency key of the child's `start`-th deployment run: `<study>:<index>:v<values' fingerprint>`, then
    `:<n>` after it. Prefect returns the run an earlier start with the same key made, whatever it ran: the values in
    the key keep a child with other values at the same index from being handed it."""
    key = f"{study_run_id}:{index}:v{values_fingerprint(values)}"
    return key if start == 1 else f"{key}:{start}"


class FoundChild(BaseModel):
    """A flow run an earlier process of the study started for one of its children."""

    index: int = Field(description="The child's place in the study, from 1.")
    start: int = Field(description="Which start of the child it was (its key's `:<n>`; 1 for the first; 0 for an "
                       "in-process run, which has no key).")
    flow_run_id: str = Field(description="The flow run.")
    state: str = Field(description="Its state type (`COMPLETED`, `RUNNING`, ...).")
    deployment: bool = Field(description="A deployment run (its own process, on a worker) rather than a subflow in "
                             "the study's own process.")
    spec: dict[str, Any] = Field(default_factory=dict, description="The `spec` parameter it was given.")
    pruned_at: int | None = Field(default=None, description="The step its study pruned it at (its `study-pruned:` "
                                  "tag); None when it was not pruned.")


def found_child(run: FlowRun, study_run_id: str, index_by_name: dict[str, int]) -> FoundChild | None:
    """Which child `run` was: by its idempotency key (a deployment run), else by its spec's name (a subflow); None
    for a run of the study's that is not a child (its merge of the best adapter, say)."""
    spec = run.parameters.get("spec") if isinstance(run.parameters, dict) else None
    spec = spec if isinstance(spec, dict) else {}
    key = _KEY.match(run.idempotency_key or "")
    if key and key["study"] == study_run_id:
        index, start = int(key["index"]), int(key["start"] or 1)
    elif spec.get("name") in index_by_name:
        index, start = index_by_name[spec["name"]], 0
    else:
        return None
    return FoundChild(index=index, start=start, flow_run_id=str(run.id), state=run.state_type.value if run.state_type
                      else "PENDING", deployment=run.deployment_id is not None, spec=spec,
                      pruned_at=pruned_step(run.tags))


class ChildPlan(BaseModel):
    """What a (re)started study does with one child, given the runs its earlier processes left."""

    index: int = Field(description="The child's place in the study.")
    action: Literal["adopt", "start", "told"] = Field(
        description="`adopt`: wait on (or read) `run`; `start`: start it; `told`: nothing (a search's trial told how "
        "it ended, with no run: the budget skipped it, or the study was cancelled before its turn).")
    run: FoundChild | None = Field(default=None, description="The run adopted: completed, or a deployment run "
                                   "still going.")
    start: int = Field(default=1, description="For `start`: which start of the child this is (its key's `:<n>`).")
    stale: list[str] = Field(default_factory=list, description="Subflow runs left unfinished by the study's earlier "
                             "process: they died with it, and are torn down and marked Crashed before it starts again.")
    earlier: list[str] = Field(default_factory=list, description="The child's runs that are not adopted (earlier "
                               "starts that failed, crashed or were cancelled, `stale` among them): what they cost "
                               "counts in the study's budget and in the child's row.")


_FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def adoption_plan(indices: Iterable[int], found: Sequence[FoundChild],
                  final: Iterable[int] = ()) -> dict[int, ChildPlan]:
    """Per child: adopt its completed or pruned run, else its deployment run still going (on a worker, it outlived
    the study's process), else start it (again): its earlier runs failed, were cancelled, or were subflows of a study
    process that is gone. No child that completed, was pruned or is running starts twice. The children in `final`
    (a search's trials told how they ended) never start again: their latest run is adopted, however it ended. Every
    run not adopted is the child's `earlier`: it ran, and what it cost counts."""
    by_index: dict[int, list[FoundChild]] = {}
    for run in found:
        by_index.setdefault(run.index, []).append(run)
    final = set(final)
    plans = {}
    for index in indices:
        runs = sorted(by_index.get(index, []), key=lambda r: r.start)
        if index in final:
            plans[index] = ChildPlan(index=index, action="adopt" if runs else "told", run=runs[-1] if runs else None,
                                     earlier=[r.flow_run_id for r in runs[:-1]])
            continue
        completed = [r for r in runs if r.state == "COMPLETED" or r.pruned_at is not None]
        going = [r for r in runs if r.state not in _FINAL and r.deployment]
        if completed or going:
            adopted = (completed or going)[-1]
            plans[index] = ChildPlan(index=index, action="adopt", run=adopted,
                                     earlier=[r.flow_run_id for r in runs if r is not adopted])
            continue
        starts = [r.start for r in runs if r.deployment]
        plans[index] = ChildPlan(index=index, action="start", start=max(starts, default=0) + 1,
                                 stale=[r.flow_run_id for r in runs if r.state not in _FINAL and not r.deployment],
                                 earlier=[r.flow_run_id for r in runs])
    return plans


def earlier_cost(cost_usd: float | None, minutes: float | None, ceiling_usd: float, deadline_minutes: float) -> float:
    """What an earlier run of a child cost: its `loraflow.run.finished`'s figure (`cost_usd`), else (a run whose
    process died before it could send one) its child's cost ceiling for the time it lived, at most the whole ceiling:
    its workers ran no longer than its flow run, at no more than the ceiling's price."""
    if cost_usd is not None:
        return cost_usd
    if minutes is None:
        return 0.0  # it never started: nothing was rented
    return ceiling_usd * min(1.0, minutes / deadline_minutes) if deadline_minutes > 0 else ceiling_usd


def start_deployment_child(deployment: str, parameters: dict[str, Any], tags: list[str], key: str) -> str:
    """Start one child as a run of `deployment` (a subflow of the study, so its page links it) and return at once
    (the study polls its state with the others'); the key makes a second start return the first run.

    What Prefect's `run_deployment(as_subflow=True)` does, but with the tracking task run (the child's place in the
    study's graph) keyed by the child's key: `run_deployment` keys it by a counter the flow run's process keeps, which
    a resumed study's new process restarts at 0, and Prefect's server answers a task run's create with the one already
    there for that flow run, task and key: a child started after a resume would nest under an earlier child's task."""
    context = FlowRunContext.get()
    with get_client(sync_client=True) as client:
        found = client.read_deployment_by_name(deployment)
        parent_task_run_id, labels = None, {}
        if context is not None and context.flow_run is not None:
            tracking = Task(name=deployment, fn=_no_op, version=found.version)
            tracking.task_key = f"prefect.deployments.flow_runs.run_deployment.{slugify(deployment)}"  # as Prefect's
            parent_task_run_id = client.create_task_run(tracking, flow_run_id=context.flow_run.id, dynamic_key=key,
                                                        state=Pending()).id
            if traceparent := context.flow_run.labels.get(LABELS_TRACEPARENT_KEY):
                labels = {LABELS_TRACEPARENT_KEY: traceparent}
        run = client.create_flow_run_from_deployment(found.id, parameters=parameters, state=Scheduled(), tags=tags,
                                                     idempotency_key=key, parent_task_run_id=parent_task_run_id,
                                                     labels=labels)
    return str(run.id)


def _no_op() -> None:
    """The tracking task's function: it never runs (the child's flow run is what runs)."""


def end_stale_children(flow_run_ids: Sequence[str]) -> None:
    """Subflows a study's earlier process left unfinished died with it: delete their endpoints (confirmed) and mark
    them Crashed, before the resumed study runs the children again. A delete that fails is the reconcile flow's."""
    with get_client(sync_client=True) as client:
        for flow_run_id in flow_run_ids:
            try:
                delete_run_endpoints(flow_run_id)
            except Exception as e:  # noqa: BLE001 - the reconcile flow deletes what is left
                log.error("Child %s's endpoints could not be deleted (%s: %s); reconcile will retry", flow_run_id,
                          type(e).__name__, e)
            client.set_flow_run_state(flow_run_id, Crashed(message="its study's process ended while it ran; the "
                                                                     "resumed study runs it again"), force=True)


StudyEnd = Literal["cancel", "tear down", "leave running"]


def on_study_end(deployment_child: bool, study_state: StateType) -> StudyEnd:
    """What the study's hook does with a child still going when the study ends `study_state`. A deployment child runs
    in a process of its own: cancelled with its study (it tears its own endpoint down), left running when the study
    crashed or failed of its own (a resumed study adopts it). A subflow ran in the study's process, which is gone or
    going: its endpoints are deleted here and it is marked Cancelled."""
    if not deployment_child:
        return "tear down"
    return "cancel" if study_state in (StateType.CANCELLING, StateType.CANCELLED) else "leave running"


def cancel_children(study_run_id: str) -> list[str]:
    """Ask every running child of the study to stop (CANCELLING, as `prefect flow-run cancel` does): each sees it,
    tears its endpoint down and ends Cancelled. Returns the children asked. Never raises: asked again next round."""
    try:
        with get_client(sync_client=True) as client:
            asked = []
            for child in unfinished_children(client, study_run_id):
                if child.state is not None and not child.state.is_cancelling():
                    client.set_flow_run_state(child.id, Cancelling(message="its study was cancelled"), force=True)
                    asked.append(str(child.id))
            return asked
    except (httpx.HTTPError, ObjectNotFound) as e:
        log.warning("Could not cancel study %s's children yet (%s: %s)", study_run_id, type(e).__name__, e)
        return []


def cancel_children_hook(flow, flow_run, state) -> None:
    """The study's cancellation, crash and failure hook (`on_study_end` decides per child). When a runner kills the
    study's process its subflow children die with it, so their own hooks never run: delete each one's endpoints here
    (confirmed) and mark it Cancelled. Deployment children are asked to cancel when the study was cancelled, and left
    running when it crashed or failed. Then the study's own endpoints (the merge of its best adapter rents one, named
    after the study) are deleted, and the reconcile deployment started, as a train run's hook does. Never raises."""
    try:
        with get_client(sync_client=True) as client:
            children = unfinished_children(client, str(flow_run.id))
            for child in children:
                action = on_study_end(child.deployment_id is not None, state.type)
                if action == "leave running":
                    log.warning("Study %s ended %s: child %s runs on (resume the study to adopt it)", flow_run.id,
                                state.name, child.name)
                    continue
                if action == "cancel":
                    if child.state is not None and not child.state.is_cancelling():
                        client.set_flow_run_state(child.id, Cancelling(message="its study was cancelled"), force=True)
                    continue
                try:
                    deleted = delete_run_endpoints(str(child.id))
                    log.warning("Study %s ended %s: deleted child %s's endpoints %s", flow_run.id, state.name,
                                child.name, deleted or "(none left)")
                except Exception as e:  # noqa: BLE001 - the next child, and the reconcile flow, still get their turn
                    log.error("Child %s's endpoints could not be deleted (%s: %s); reconcile will retry", child.name,
                              type(e).__name__, e)
                client.set_flow_run_state(child.id, Cancelled(message=f"its study ended {state.name}"), force=True)
    except Exception as e:  # noqa: BLE001 - never raised into Prefect's hook machinery
        log.error("Study %s ended %s and its children could not be reached (%s: %s)", flow_run.id, state.name,
                  type(e).__name__, e)
    try:
        deleted = delete_run_endpoints(str(flow_run.id))
        if deleted:
            log.warning("Study %s ended %s: deleted its own endpoints %s", flow_run.id, state.name, deleted)
    except Exception as e:  # noqa: BLE001 - the reconcile flow is the next layer
        log.error("Study %s's own endpoints could not be deleted (%s: %s); reconcile will retry", flow_run.id,
                  type(e).__name__, e)
    start_reconcile()


def flow_run_page(flow_run_id: str) -> str | None:
    """The flow run's page in the Prefect UI (its summary is one of its artifacts); None when no UI URL is known."""
    ui_url = get_current_settings().ui_url
    return f"{ui_url.rstrip('/')}/runs/flow-run/{flow_run_id}" if ui_url else None


def run_minutes(run: FlowRun) -> float | None:
    """A flow run's wall time, in minutes (to now while it runs); None before it started."""
    if run.start_time is None:
        return None
    end = run.end_time or datetime.now(UTC)
    return round((end - run.start_time).total_seconds() / 60, 2)


def read_child_costs(flow_run_ids: Sequence[str]) -> dict[str, float | None]:
    """What each ended child's workers ran × the GPU price, as its `loraflow.run.finished` says, for the children
    whose event is readable now (None: the event names no cost); a child missing from the answer has no readable
    event yet (the server stores events in batches; a lost one is possible: events are notifications). One read per
    `EVENTS_PAGE` children: the study asks again each round, never waits on one child."""
    since = datetime.now(UTC) - timedelta(days=8)  # a run lives at most 7 days
    costs: dict[str, float | None] = {}
    for start in range(0, len(flow_run_ids), EVENTS_PAGE):
        ids = list(flow_run_ids[start:start + EVENTS_PAGE])
        event_filter = EventFilter(
            occurred=EventOccurredFilter(since=since, until=datetime.now(UTC) + timedelta(hours=1)),
            event=EventNameFilter(name=[events.RUN_FINISHED]),
            resource=EventResourceFilter(id=[f"{events.RUN_RESOURCE}{i}" for i in ids]))
        try:
            with get_client(sync_client=True) as client:
                found = client.request("POST", "/events/filter", json={
                    "filter": event_filter.model_dump(mode="json"), "limit": EVENTS_PAGE}).json()["events"]
        except httpx.HTTPError as e:
            log.warning("Could not read the children's loraflow.run.finished yet (%s)", e)
            continue
        for event in found:
            run_id = event["resource"]["prefect.resource.id"].removeprefix(events.RUN_RESOURCE)
            cost = event.get("payload", {}).get("cost_usd")
            costs[run_id] = float(cost) if cost is not None else None
    return costs
