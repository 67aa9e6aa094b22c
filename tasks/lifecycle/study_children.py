"""A study's children as Prefect knows them: found by the study's tag, cancelled with it, and read back for the
comparison (wall time, cost, page).

Children are found by tag (`study-run:<study flow run id>`), not by a list in the study's memory: the study's
cancellation and crash hooks run in another process when a runner kills the study's (Prefect's runner runs the
hooks itself), and they must still reach every child.
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime, timedelta

import httpx
from prefect import get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterState,
    FlowRunFilterStateType,
    FlowRunFilterTags,
)
from prefect.client.schemas.objects import StateType
from prefect.events.filters import (
    EventFilter,
    EventNameFilter,
    EventOccurredFilter,
    EventResourceFilter,
)
from prefect.exceptions import ObjectNotFound
from prefect.settings import get_current_settings
from prefect.states import Cancelled, Cancelling

from tasks.lifecycle.teardown import delete_run_endpoints, start_reconcile
from tasks.reports import events

log = logging.getLogger("loraflow.study")

EVENT_WAIT_S = 30.0
"""How long a finished child's `loraflow.run.finished` may take to be readable (the server stores events in batches)."""
NOT_FINAL = [StateType.SCHEDULED, StateType.PENDING, StateType.RUNNING, StateType.PAUSED, StateType.CANCELLING]


def study_tags(study_name: str, study_run_id: str) -> list[str]:
    """The tags of every child: `study` (all studies' children), `study:<name>`, `study-run:<flow run id>`."""
    return ["study", f"study:{study_name}", f"study-run:{study_run_id}"]


def unfinished_children(client, study_run_id: str) -> list:
    """The study's child flow runs that have not ended (`client`: a sync Prefect client)."""
    return client.read_flow_runs(flow_run_filter=FlowRunFilter(
        tags=FlowRunFilterTags(all_=[f"study-run:{study_run_id}"]),
        state=FlowRunFilterState(type=FlowRunFilterStateType(any_=NOT_FINAL))))


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
    """The study's cancellation and crash hook. When a runner kills the study's process its children die with it,
    so their own hooks never run: delete each unfinished child's endpoints here (confirmed) and mark it Cancelled,
    then those of the study itself (the merge of its best adapter rents one, named after the study), and start the
    reconcile deployment as a train run's hook does. Never raises."""
    try:
        with get_client(sync_client=True) as client:
            children = unfinished_children(client, str(flow_run.id))
            for child in children:
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


def child_minutes(flow_run_id: str) -> float | None:
    """The child flow run's wall time, in minutes; None when it cannot be read."""
    try:
        with get_client(sync_client=True) as client:
            run = client.read_flow_run(flow_run_id)
    except (httpx.HTTPError, ObjectNotFound):
        return None
    if run.start_time is None:
        return None
    end = run.end_time or datetime.now(UTC)
    return round((end - run.start_time).total_seconds() / 60, 2)


def child_cost_usd(flow_run_id: str, wait_s: float = EVENT_WAIT_S) -> float | None:
    """What the child's workers ran, × the GPU price, as its `loraflow.run.finished` says; None when the event is
    not readable within `wait_s` (a lost event is possible: events are notifications)."""
    since = datetime.now(UTC) - timedelta(days=8)  # a run lives at most 7 days
    event_filter = EventFilter(occurred=EventOccurredFilter(since=since, until=datetime.now(UTC) + timedelta(hours=1)),
                               event=EventNameFilter(name=[events.RUN_FINISHED]),
                               resource=EventResourceFilter(id=[f"{events.RUN_RESOURCE}{flow_run_id}"]))
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with get_client(sync_client=True) as client:
                found = client.request("POST", "/events/filter", json={
                    "filter": event_filter.model_dump(mode="json"), "limit": 1}).json()["events"]
        except httpx.HTTPError as e:
            log.warning("Could not read child %s's loraflow.run.finished (%s)", flow_run_id, e)
            found = []
        if found:
            cost = found[0].get("payload", {}).get("cost_usd")
            return float(cost) if cost is not None else None
        if time.monotonic() > deadline:
            log.warning("Child %s's loraflow.run.finished was not readable after %.0f s: its cost is unknown",
                        flow_run_id, wait_s)
            return None
        time.sleep(2.0)
