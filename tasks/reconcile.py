"""The reconciler's decisions and its reads: which of this control plane's endpoints no live run owns.

Layer 3 of teardown (after the flow's `finally` and its crash/cancel hooks): anything a crash left
behind at RunPod is found by name and deleted here. Only endpoints named with loraflow's prefix and
this control plane's tag (`endpoints.parse_endpoint_name`) are ever judged; another control plane's
(a teammate's server, staging, a script's ephemeral server on the same RunPod account) are reported
and left alone, since the runs that own them live in a Prefect database this reconciler cannot see.

A run is alive while it sends heartbeat events (`tasks/liveness.py`), whatever its logging settings.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any, Literal
from uuid import UUID

from prefect import get_client, task
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterExpectedStartTime,
    FlowRunFilterId,
    FlowRunFilterState,
    FlowRunFilterStateType,
)
from prefect.client.schemas.objects import FlowRun, StateType
from prefect.client.schemas.sorting import FlowRunSort
from pydantic import BaseModel, Field

from tasks.liveness import newest_heartbeats
from tasks.runpod.endpoints import ENDPOINT_PREFIX, parse_endpoint_name, run_hash
from tasks.runpod.models import Endpoint, Health

EXECUTING_STATES = [StateType.PENDING, StateType.RUNNING, StateType.PAUSED, StateType.CANCELLING]
"""States of a run whose process may hold an endpoint. A SCHEDULED-type run (Scheduled, Late,
AwaitingRetry) counts too once it is due; runs scheduled for later are not read at all, so a server
with thousands of upcoming runs costs no more pages."""
CLOCK_ROOM = timedelta(minutes=10)
"""Heartbeats carry the sender's clock: events up to this far past the reconciler's now still count."""


class LiveRun(BaseModel):
    """A flow run that is not final, and when it last gave a sign of life."""

    id: str
    state: str
    last_seen: datetime = Field(description="Latest of its last state change and its newest flow-run heartbeat.")


class RunsSeen(BaseModel):
    """Prefect's side of a sweep."""

    runs: list[LiveRun] = Field(description="Every live flow run, of any flow.")
    endpoint_beats: dict[str, datetime] = Field(
        default_factory=dict, description="Endpoint id → when a run last sent that endpoint's heartbeat.")


class EndpointsSeen(BaseModel):
    """RunPod's side of a sweep: every endpoint with loraflow's prefix, and the job counts of ours."""

    endpoints: list[Endpoint]
    health: dict[str, Health] = Field(default_factory=dict, description="Endpoint id → its `/health`.")
    health_errors: dict[str, str] = Field(
        default_factory=dict, description="Endpoint id → why its `/health` could not be read.")


class Finding(BaseModel):
    """One loraflow endpoint, what the reconciler decided, and what came of it."""

    endpoint_id: str
    name: str
    age_minutes: float
    control_plane: str = Field(description="The tag in its name: `ours`, another control plane's tag, or "
                               "`untagged` (a loraflow name from before tags, or one made by hand).")
    run_id: str | None = Field(description="The live run owning it, if any.")
    jobs: str = Field(description="Its queued and running jobs, or why `/health` could not be read; empty when "
                      "not read (another control plane's).")
    action: Literal["keep", "delete"]
    reason: str
    result: str = ""


def decide(seen: EndpointsSeen, runs: RunsSeen, namespace: str, now: datetime, *, silent_after_s: float,
           idle_grace_s: float, min_age_s: float) -> list[Finding]:
    """One finding per loraflow endpoint. Another control plane's, or an untagged one: keep. Ours:
    delete when no live run owns it, when its run has sent no heartbeat for `silent_after_s`, or when it
    has had no job for `idle_grace_s`; keep otherwise (and whenever it is younger than `min_age_s`)."""
    by_hash = {run_hash(r.id): r for r in runs.runs}
    findings = []
    for endpoint in seen.endpoints:
        if not endpoint.name.startswith(ENDPOINT_PREFIX):
            continue
        age = (now - datetime.fromisoformat(endpoint.created_at.replace("Z", "+00:00"))).total_seconds()
        parsed = parse_endpoint_name(endpoint.name)
        finding = Finding(endpoint_id=endpoint.id, name=endpoint.name, age_minutes=round(age / 60, 1),
                          control_plane="untagged", run_id=None, jobs="", action="keep", reason="")
        findings.append(finding)
        if parsed is None:
            finding.reason = "no control-plane tag in its name: no reconciler can tell whose it is"
            continue
        if parsed.namespace != namespace:
            finding.control_plane = parsed.namespace
            finding.reason = f"another control plane's (tag {parsed.namespace}; ours is {namespace})"
            continue
        finding.control_plane = "ours"
        run = by_hash.get(parsed.run_hash)
        finding.run_id = run.id if run else None
        health, health_error = seen.health.get(endpoint.id), seen.health_errors.get(endpoint.id)
        if health is not None:
            finding.jobs = f"{health.jobs.in_queue} queued, {health.jobs.in_progress} running"
        elif health_error is not None:
            finding.jobs = f"/health failed: {health_error}"
        finding.action, finding.reason = _decide_one(run, runs.endpoint_beats.get(endpoint.id), health, age, now,
                                                     silent_after_s, idle_grace_s, min_age_s)
    return findings


def _decide_one(run: LiveRun | None, endpoint_beat: datetime | None, health: Health | None, age: float, now: datetime,
                silent_after_s: float, idle_grace_s: float, min_age_s: float) -> tuple[Literal["keep", "delete"], str]:
    if age < min_age_s:
        return "keep", f"younger than {min_age_s:.0f} s"
    if run is None:
        return "delete", "its run is final or missing"
    last_seen = max(run.last_seen, endpoint_beat) if endpoint_beat else run.last_seen
    silent = (now - last_seen).total_seconds()
    if silent > silent_after_s:
        return "delete", f"its run ({run.state}) has sent no heartbeat for {silent / 60:.1f} min"
    if health is None:
        return "keep", f"its run is {run.state}; its jobs are unknown, so idleness is not judged"
    if health.jobs.in_queue + health.jobs.in_progress == 0 and age > idle_grace_s:
        return "delete", f"no job for {age / 60:.0f} min (idle past the grace)"
    return "keep", f"its run is {run.state}"


def live_flow_runs(client: Any, now: datetime) -> list[FlowRun]:
    """Every flow run, of any flow, that may hold an endpoint: executing ones, and SCHEDULED-type ones
    that are due. All pages: the server answers at most `PREFECT_SERVER_API_DEFAULT_LIMIT` (200) runs
    a request. `client` is a sync Prefect client."""
    state = FlowRunFilterState
    executing = FlowRunFilter(state=state(type=FlowRunFilterStateType(any_=EXECUTING_STATES)))
    due = FlowRunFilter(state=state(type=FlowRunFilterStateType(any_=[StateType.SCHEDULED])),
                        expected_start_time=FlowRunFilterExpectedStartTime(before_=now))
    return _every_flow_run(client, executing) + _every_flow_run(client, due)


def _every_flow_run(client: Any, flow_run_filter: FlowRunFilter) -> list[FlowRun]:
    # Each page leaves out the runs already read, instead of skipping an offset: a run that ends during
    # the sweep then moves no live run out of the pages still to come (with offsets, each run ending
    # between two pages would hide one live run, whose endpoint would look orphaned). Reading until a
    # page brings nothing new works whatever page size the server uses.
    found: dict[UUID, FlowRun] = {}
    while True:
        page_filter = flow_run_filter
        if found:
            page_filter = flow_run_filter.model_copy(update={"id": FlowRunFilterId(not_any_=list(found))})
        new = [r for r in client.read_flow_runs(flow_run_filter=page_filter, sort=FlowRunSort.ID_DESC)
               if r.id not in found]
        if not new:
            return list(found.values())
        found.update((r.id, r) for r in new)


@task(name="read-live-runs", cache_policy=NO_CACHE, retries=3, retry_delay_seconds=[2, 10, 30])
def read_live_runs(lookback_s: float) -> RunsSeen:
    """Every live flow run with when it last changed state or beat, and each endpoint's last heartbeat,
    over the last `lookback_s` seconds (keep it above the silence threshold)."""
    now = datetime.now(timezone.utc)
    with get_client(sync_client=True) as client:
        flow_runs = live_flow_runs(client, now)
        beats = newest_heartbeats(client, since=now - timedelta(seconds=lookback_s), until=now + CLOCK_ROOM)
    runs = []
    for fr in flow_runs:
        seen = [fr.state.timestamp if fr.state else fr.created, beats.flow_runs.get(str(fr.id))]
        runs.append(LiveRun(id=str(fr.id), state=fr.state.name if fr.state else "?",
                            last_seen=max(t.astimezone(timezone.utc) for t in seen if t is not None)))
    return RunsSeen(runs=runs, endpoint_beats=beats.endpoints)


@task(name="read-loraflow-endpoints", cache_policy=NO_CACHE, retries=3, retry_delay_seconds=[2, 10, 30])
def read_loraflow_endpoints(namespace: str) -> EndpointsSeen:
    """Every endpoint with loraflow's prefix, and the job counts of those tagged `namespace`. A
    `/health` that fails is recorded for its endpoint and the others are still read; one answering 404
    was deleted meanwhile and is left out."""
    from tasks.runpod.errors import NotFoundError, RunpodError
    from tasks.runpod.steps import make_client

    with make_client() as client:
        seen = EndpointsSeen(endpoints=[e for e in client.list_endpoints() if e.name.startswith(ENDPOINT_PREFIX)])
        gone = set()
        for endpoint in seen.endpoints:
            parsed = parse_endpoint_name(endpoint.name)
            if parsed is None or parsed.namespace != namespace:
                continue  # not ours to judge: no need to ask about its jobs
            try:
                seen.health[endpoint.id] = client.health(endpoint.id)
            except NotFoundError:
                gone.add(endpoint.id)
            except RunpodError as e:
                seen.health_errors[endpoint.id] = f"{type(e).__name__}: {e}"
    seen.endpoints = [e for e in seen.endpoints if e.id not in gone]
    return seen
