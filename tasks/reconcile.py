"""The reconciler's decisions and its Prefect-side reads: which of our endpoints no live run owns.

Layer 3 of teardown (after the flow's `finally` and its crash/cancel hooks): anything a crash left
behind at RunPod is found by name and deleted here. Endpoints whose names lack loraflow's prefix are
never touched.
"""

from __future__ import annotations

import re
from datetime import datetime, timezone
from typing import Literal

from prefect import get_client, task
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.filters import FlowFilter, FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType, LogFilter, LogFilterFlowRunId
from prefect.client.schemas.objects import StateType
from prefect.client.schemas.sorting import LogSort
from pydantic import BaseModel, Field

from tasks.runpod.endpoints import ENDPOINT_PREFIX, run_hash
from tasks.runpod.models import Endpoint, Health

LIVE_STATES = [StateType.SCHEDULED, StateType.PENDING, StateType.RUNNING, StateType.PAUSED, StateType.CANCELLING]
_NAME = re.compile(r"-(?P<hash>[0-9a-f]{12})-a(?P<attempt>\d+)$")


class LiveRun(BaseModel):
    """A train flow run that is not final, and when it last gave a sign of life."""

    id: str
    state: str
    last_seen: datetime = Field(description="Latest of its state change and its newest log line.")


class Finding(BaseModel):
    """One endpoint of ours, what the reconciler decided, and what came of it."""

    endpoint_id: str
    name: str
    age_minutes: float
    run_id: str | None = Field(description="The live run owning it, if any.")
    action: Literal["keep", "delete"]
    reason: str
    result: str = ""


def decide(endpoints: list[Endpoint], runs: list[LiveRun], health: dict[str, Health], now: datetime,
           silent_after_s: float, idle_grace_s: float, min_age_s: float) -> list[Finding]:
    """One finding per endpoint of ours: delete when no live run owns it, when its run is silent past
    `silent_after_s`, or when it has had no job for `idle_grace_s`; keep otherwise."""
    by_hash = {run_hash(r.id): r for r in runs}
    findings = []
    for endpoint in endpoints:
        if not endpoint.name.startswith(ENDPOINT_PREFIX):
            continue
        age = (now - datetime.fromisoformat(endpoint.created_at.replace("Z", "+00:00"))).total_seconds()
        match = _NAME.search(endpoint.name)
        run = by_hash.get(match["hash"]) if match else None
        action, reason = _decide_one(run, health.get(endpoint.id), age, now, silent_after_s, idle_grace_s, min_age_s)
        findings.append(Finding(endpoint_id=endpoint.id, name=endpoint.name, age_minutes=round(age / 60, 1),
                                run_id=run.id if run else None, action=action, reason=reason))
    return findings


def _decide_one(run: LiveRun | None, health: Health | None, age: float, now: datetime, silent_after_s: float,
                idle_grace_s: float, min_age_s: float) -> tuple[Literal["keep", "delete"], str]:
    if age < min_age_s:
        return "keep", f"younger than {min_age_s:.0f} s"
    if run is None:
        return "delete", "its run is final or missing"
    silent = (now - run.last_seen).total_seconds()
    if silent > silent_after_s:
        return "delete", f"its run ({run.state}) has been silent for {silent / 60:.0f} min"
    if health is not None and health.jobs.in_queue + health.jobs.in_progress == 0 and age > idle_grace_s:
        return "delete", f"no job for {age / 60:.0f} min (idle past the grace)"
    return "keep", f"its run is {run.state}"


@task(name="read-live-train-runs", cache_policy=NO_CACHE, retries=3, retry_delay_seconds=[2, 10, 30])
def read_live_train_runs(flow_name: str = "train") -> list[LiveRun]:
    with get_client(sync_client=True) as client:
        flow_runs = client.read_flow_runs(
            flow_filter=FlowFilter(name={"any_": [flow_name]}),
            flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=LIVE_STATES))),
        )
        live = []
        for fr in flow_runs:
            seen = fr.state.timestamp if fr.state else fr.created
            logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[fr.id])), limit=1,
                                    sort=LogSort.TIMESTAMP_DESC)
            if logs:
                seen = max(seen, logs[0].timestamp)
            live.append(LiveRun(id=str(fr.id), state=fr.state.name if fr.state else "?",
                                last_seen=seen.astimezone(timezone.utc)))
        return live


@task(name="read-our-endpoints", cache_policy=NO_CACHE, retries=3, retry_delay_seconds=[2, 10, 30])
def read_our_endpoints() -> tuple[list[Endpoint], dict[str, Health]]:
    """Our endpoints (prefix match only) and each one's job counts."""
    from tasks.runpod.errors import NotFoundError
    from tasks.runpod.steps import make_client

    with make_client() as client:
        ours = [e for e in client.list_endpoints() if e.name.startswith(ENDPOINT_PREFIX)]
        health = {}
        for endpoint in ours:
            try:
                health[endpoint.id] = client.health(endpoint.id)
            except NotFoundError:
                pass  # deleted meanwhile
    return ours, health
