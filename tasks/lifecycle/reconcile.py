"""The reconciler's decisions and its reads: which of this control plane's endpoints no live run owns.

Layer 3 of teardown (after the flow's `finally` and its crash/cancel hooks): anything a crash left
behind at RunPod is found by name and deleted here. Only endpoints named with loraflow's prefix and
this control plane's tag (`endpoints.parse_endpoint_name`) are ever judged; another control plane's
(a teammate's server, staging, a script's ephemeral server on the same RunPod account) are reported
and left alone, since the runs that own them live in a Prefect database this reconciler cannot see.

A run is alive while it sends heartbeat events (`tasks/lifecycle/liveness.py`), whatever its logging settings, each
judged by its sender's own interval: silent means no heartbeat for max(the policy's threshold, 3 × that
interval). A threshold below 3 × the intervals in force where the reconciler runs is refused before anything
is read (`check_silence_threshold`). A Crashed run is not taken for dead while its heartbeats go on: Prefect's
zombie automation marks a run Crashed when its heartbeats stop reaching the server, which a server restart
does to live runs too.
"""

from __future__ import annotations

import math
from datetime import datetime, timedelta, timezone
from typing import Any, Literal
from uuid import UUID

from prefect import get_client, task
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterEndTime,
    FlowRunFilterExpectedStartTime,
    FlowRunFilterId,
    FlowRunFilterState,
    FlowRunFilterStateType,
)
from prefect.client.schemas.objects import FlowRun, StateType
from prefect.client.schemas.sorting import FlowRunSort
from pydantic import BaseModel, Field

from tasks.lifecycle.liveness import (
    SILENT_AFTER_BEATS,
    EndpointBeat,
    HeartbeatIntervals,
    newest_endpoint_beat,
    newest_heartbeats,
)
from tasks.runpod.endpoints import ENDPOINT_PREFIX, parse_endpoint_name, run_hash
from tasks.runpod.models import Endpoint, Health
from tasks.settings import make_client

EXECUTING_STATES = [StateType.PENDING, StateType.RUNNING, StateType.PAUSED, StateType.CANCELLING]
"""States of a run whose process may hold an endpoint. A SCHEDULED-type run (Scheduled, Late,
AwaitingRetry) counts too once it is due; runs scheduled for later are not read at all, so a server
with thousands of upcoming runs costs no more pages."""
CLOCK_ROOM = timedelta(minutes=10)
"""Heartbeats carry the sender's clock: events up to this far past the reconciler's now still count."""
LONGEST_ENDPOINT_HEARTBEAT_S = 3600
"""The upper bound of LORAFLOW_HEARTBEAT_SECONDS (`tasks/settings.py`): a sweep looks back twice 3 × this at
least, so that a run beating that rarely is seen alive, whatever the reconciler's own settings."""


class LiveRun(BaseModel):
    """A flow run that may hold an endpoint, and when it last gave a sign of life."""

    id: str
    state: str
    last_seen: datetime | None = Field(
        description="Latest of its last state change and its newest flow-run heartbeat; a Crashed run's state "
        "change is no sign of life (the zombie automation set it). None: no sign in the window.")
    crashed: bool = Field(default=False, description="Final-Crashed: kept only while its heartbeats go on.")


class RunsSeen(BaseModel):
    """Prefect's side of a sweep."""

    runs: list[LiveRun] = Field(description="Every live flow run, of any flow, and the recently Crashed ones.")
    endpoint_beats: dict[str, EndpointBeat] = Field(
        default_factory=dict, description="Endpoint id → its newest heartbeat (with its sender's intervals when "
        "that heartbeat is older than the policy's threshold: only then do they change the decision).")


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
    expires_at: datetime | None = Field(default=None, description="A serving endpoint's expiry, from its name: kept "
                                        "until then while its run lives, deleted after; None for a job's endpoint.")


def check_silence_threshold(silent_after_minutes: float, intervals: HeartbeatIntervals) -> None:
    """Refuse a silence threshold below 3 × the heartbeat intervals in force here (a live run would look dead
    between two of its beats): a `ValueError` naming both figures, the setting and the fix."""
    floor_s, why = intervals.silence_floor()
    if silent_after_minutes * 60 < floor_s:
        raise ValueError(
            f"silent_after_minutes={silent_after_minutes:g} ({silent_after_minutes * 60:g} s) is below "
            f"{SILENT_AFTER_BEATS} × the heartbeat interval in force ({why}): a live run would look dead between "
            f"two heartbeats; set it to at least {math.ceil(floor_s / 6) / 10:g} min, or shorten that heartbeat "
            "where the runs and the reconciler run"
        )


def lookback_s(silent_after_s: float) -> float:
    """How far back a sweep reads heartbeats and Crashed runs: past the longest silence any run may be allowed."""
    return 2 * max(silent_after_s, SILENT_AFTER_BEATS * LONGEST_ENDPOINT_HEARTBEAT_S)


def decide(seen: EndpointsSeen, runs: RunsSeen, namespace: str, now: datetime, *, silent_after_s: float,
           idle_grace_s: float, min_age_s: float, intervals: HeartbeatIntervals) -> list[Finding]:
    """One finding per loraflow endpoint. Another control plane's, or an untagged one: keep. Ours:
    delete when no live run owns it, when its run is silent, or when it has had no job for `idle_grace_s`;
    keep otherwise (and whenever it is younger than `min_age_s`). A serving endpoint (`serving_endpoint_name`) is
    deleted once the expiry in its name has passed, whatever its run, and is never judged idle: it waits for requests.

    Silent: every sign of life is older than max(`silent_after_s`, 3 × the interval of its sender). The
    endpoint heartbeat's interval is in its payload; a run's flow-run heartbeat interval is what its endpoint
    heartbeat says, else `intervals` (the reconciler's own settings), as for an endpoint heartbeat that does
    not say. A Crashed run keeps its endpoint only while a heartbeat is fresh."""
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
            finding.jobs = f"{_count(health.jobs.in_queue)} queued, {_count(health.jobs.in_progress)} running"
        elif health_error is not None:
            finding.jobs = f"/health failed: {health_error}"
        signs = _signs_of_life(run, runs.endpoint_beats.get(endpoint.id), silent_after_s, intervals) if run else []
        if parsed.expires_at is not None:
            finding.expires_at = datetime.fromtimestamp(parsed.expires_at, timezone.utc)
        finding.action, finding.reason = _decide_one(run, signs, health, age, now, idle_grace_s, min_age_s,
                                                     finding.expires_at)
    return findings


def _signs_of_life(run: LiveRun, beat: EndpointBeat | None, silent_after_s: float,
                   intervals: HeartbeatIntervals) -> list[tuple[datetime, float]]:
    """Each sign of life of `run` on one endpoint: (when, the silence after which it no longer counts)."""
    signs = []
    if run.last_seen is not None:
        flow_run_s = (beat.flow_run_interval_s if beat is not None else None) or intervals.flow_run_s
        signs.append((run.last_seen, max(silent_after_s, SILENT_AFTER_BEATS * (flow_run_s or 0))))
    if beat is not None:
        signs.append((beat.at, max(silent_after_s, SILENT_AFTER_BEATS * (beat.interval_s or intervals.endpoint_s))))
    return signs


def _decide_one(run: LiveRun | None, signs: list[tuple[datetime, float]], health: Health | None, age: float,
                now: datetime, idle_grace_s: float, min_age_s: float,
                expires_at: datetime | None = None) -> tuple[Literal["keep", "delete"], str]:
    if expires_at is not None and now >= expires_at:
        return "delete", f"a serving endpoint whose time ran out at {expires_at:%Y-%m-%d %H:%M:%S} UTC"
    if age < min_age_s:
        return "keep", f"younger than {min_age_s:.0f} s"
    if run is None:
        return "delete", "its run is final or missing"
    if not signs:
        return "delete", f"its run is {run.state} and no heartbeat of it was found"
    if all((now - at).total_seconds() > allowed for at, allowed in signs):
        silent = min((now - at).total_seconds() for at, _ in signs)
        allowed = max(allowed for _, allowed in signs)
        return "delete", (f"its run ({run.state}) has sent no heartbeat for {silent / 60:.1f} min (silent after "
                          f"{allowed / 60:.1f} min: the policy's threshold, or 3 × its own heartbeat interval)")
    state = f"{run.state}, but its heartbeats go on: its process lives" if run.crashed else run.state
    if expires_at is not None:
        return "keep", f"its run is {state}; serving until {expires_at:%Y-%m-%d %H:%M:%S} UTC"
    if health is None:
        return "keep", f"its run is {state}; its jobs are unknown, so idleness is not judged"
    if health.jobs.in_queue is None or health.jobs.in_progress is None:
        return "keep", f"its run is {state}; /health did not report its queued and running jobs, so idleness is not judged"
    if health.jobs.in_queue + health.jobs.in_progress == 0 and age > idle_grace_s:
        return "delete", f"no job for {age / 60:.0f} min (idle past the grace)"
    return "keep", f"its run is {state}"


def live_flow_runs(client: Any, now: datetime) -> list[FlowRun]:
    """Every flow run, of any flow, that may hold an endpoint: executing ones, and SCHEDULED-type ones
    that are due. All pages: the server answers at most `PREFECT_SERVER_API_DEFAULT_LIMIT` (200) runs
    a request. `client` is a sync Prefect client."""
    state = FlowRunFilterState
    executing = FlowRunFilter(state=state(type=FlowRunFilterStateType(any_=EXECUTING_STATES)))
    due = FlowRunFilter(state=state(type=FlowRunFilterStateType(any_=[StateType.SCHEDULED])),
                        expected_start_time=FlowRunFilterExpectedStartTime(before_=now))
    return _every_flow_run(client, executing) + _every_flow_run(client, due)


def crashed_flow_runs(client: Any, since: datetime) -> list[FlowRun]:
    """Every flow run that ended Crashed since `since` (all pages). Prefect's zombie automation marks a run
    Crashed when no heartbeat reached the server for a while, a server restart included: its process may
    live on. `client` is a sync Prefect client."""
    crashed = FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.CRASHED])),
                            end_time=FlowRunFilterEndTime(after_=since))
    return _every_flow_run(client, crashed)


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
def read_live_runs(lookback_s: float, endpoint_ids: list[str], doubtful_after_s: float) -> RunsSeen:
    """Every live flow run with when it last changed state or beat, the runs that ended Crashed within
    `lookback_s` seconds with their heartbeats, and the newest heartbeat of each of `endpoint_ids` (our
    endpoints). A heartbeat older than `doubtful_after_s` (the policy's threshold) is read again with its
    payload, the intervals its sender keeps: one request per such endpoint, none for the live."""
    now = datetime.now(timezone.utc)
    since, until = now - timedelta(seconds=lookback_s), now + CLOCK_ROOM
    with get_client(sync_client=True) as client:
        flow_runs = live_flow_runs(client, now)
        crashed = crashed_flow_runs(client, since)
        beats = newest_heartbeats(client, since=since, until=until)
        endpoint_beats = {}
        for endpoint_id in endpoint_ids:
            at = beats.endpoints.get(endpoint_id)
            if at is None:
                continue
            beat = None
            if (now - at).total_seconds() > doubtful_after_s:
                beat = newest_endpoint_beat(client, endpoint_id, since, until)
            endpoint_beats[endpoint_id] = beat or EndpointBeat(at=at)
    runs = []
    for fr in flow_runs:
        seen = [fr.state.timestamp if fr.state else fr.created, beats.flow_runs.get(str(fr.id))]
        runs.append(LiveRun(id=str(fr.id), state=fr.state.name if fr.state else "?",
                            last_seen=max(t.astimezone(timezone.utc) for t in seen if t is not None)))
    for fr in crashed:  # its state change is the zombie automation's, no sign of life: only its heartbeat counts
        flow_run_beat = beats.flow_runs.get(str(fr.id))
        runs.append(LiveRun(id=str(fr.id), state=fr.state.name if fr.state else "Crashed", crashed=True,
                            last_seen=flow_run_beat.astimezone(timezone.utc) if flow_run_beat else None))
    return RunsSeen(runs=runs, endpoint_beats=endpoint_beats)


@task(name="read-loraflow-endpoints", cache_policy=NO_CACHE, retries=3, retry_delay_seconds=[2, 10, 30])
def read_loraflow_endpoints(namespace: str) -> EndpointsSeen:
    """Every endpoint with loraflow's prefix, and the job counts of those tagged `namespace`. A
    `/health` that fails is recorded for its endpoint and the others are still read; one answering 404
    was deleted meanwhile and is left out."""
    from tasks.runpod.errors import NotFoundError, RunpodError

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


def _count(value: int | None) -> str:
    """A /health counter as the findings show it: `?` when RunPod did not report it."""
    return "?" if value is None else str(value)
