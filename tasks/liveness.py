"""A run's sign of life that no logging setting can silence: Prefect events, sent and read back.

Events travel on Prefect's events channel, not its log channel, so `PREFECT_LOGGING_LEVEL=WARNING` or
`PREFECT_LOGGING_TO_API_ENABLED=false` leave them alone. Two kinds count:

- `prefect.flow-run.heartbeat`: Prefect's flow engine sends it for every flow run, however the run was
  started, from a background thread every `PREFECT_FLOWS_HEARTBEAT_FREQUENCY` seconds (default 180,
  at least 30) until the run's state is final (`prefect/flow_engine.py`, `_send_heartbeats`).
- `loraflow.endpoint.heartbeat`: a run sends it while it watches the job on one of its endpoints
  (`beat`, every `LORAFLOW_HEARTBEAT_SECONDS`, default 60). It names the endpoint, so the reconciler
  knows which endpoint a live run is still using, and it comes from the loop that watches the job,
  not from a thread that outlives a stuck watch.

The reconciler reads the newest of each, per run and per endpoint, in one request
(`newest_heartbeats`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

from prefect.events import Event, emit_event
from prefect.events.filters import EventFilter, EventNameFilter, EventOccurredFilter, EventResourceFilter
from pydantic import BaseModel, Field

from tasks.runpod.models import Endpoint

FLOW_RUN_HEARTBEAT = "prefect.flow-run.heartbeat"
ENDPOINT_HEARTBEAT = "loraflow.endpoint.heartbeat"
FLOW_RUN_RESOURCE = "prefect.flow-run."
ENDPOINT_RESOURCE = "loraflow.endpoint."

# When this process last sent each endpoint's heartbeat (monotonic seconds). Per process on purpose:
# every process that watches an endpoint beats for it on its own.
_last_beat: dict[str, float] = {}


def beat(endpoint: Endpoint, job_status: str | None = None, *, interval_s: float | None = None,
         clock: Callable[[], float] = time.monotonic) -> Event | None:
    """Send `loraflow.endpoint.heartbeat` for `endpoint`, unless this process sent one less than
    `interval_s` ago (`LORAFLOW_HEARTBEAT_SECONDS` when None). Call it on every poll of the endpoint's
    job.

    Returns the event sent, or None when it was too soon (or Prefect sends no events here). Returns
    quickly: Prefect's events worker sends the event in the background. Never raises: a lost heartbeat
    is one missed beat, not a failed run. Inside a flow or task run, Prefect adds the run as a related
    resource, so the event shows on the run's page.
    """
    if interval_s is None:
        from tasks.settings import Settings

        interval_s = Settings().loraflow_heartbeat_seconds
    now = clock()
    last = _last_beat.get(endpoint.id)
    if last is not None and now - last < interval_s:
        return None
    _last_beat[endpoint.id] = now
    payload: dict[str, Any] = {"job_status": job_status} if job_status else {}
    return emit_event(
        event=ENDPOINT_HEARTBEAT,
        resource={"prefect.resource.id": f"{ENDPOINT_RESOURCE}{endpoint.id}", "prefect.resource.name": endpoint.name},
        payload=payload,
    )


class Heartbeats(BaseModel):
    """The newest heartbeat event of each run and each endpoint in a time window."""

    flow_runs: dict[str, datetime] = Field(default_factory=dict, description="Flow run id → its newest "
                                           f"`{FLOW_RUN_HEARTBEAT}`.")
    endpoints: dict[str, datetime] = Field(default_factory=dict, description="RunPod endpoint id → its newest "
                                           f"`{ENDPOINT_HEARTBEAT}`.")


def newest_heartbeats(client: Any, since: datetime, until: datetime) -> Heartbeats:
    """The newest heartbeat of every run and endpoint that sent one between `since` and `until`, in one
    request, however many runs are live: Prefect's events API groups events by resource
    (`POST /events/count-by/resource`, `prefect/server/api/events.py`), and each group's `end_time` is
    its newest event's `occurred`. `client` is a sync Prefect client (`get_client(sync_client=True)`).

    `occurred` is the sender's clock: give `until` some room past now for clocks running ahead.
    """
    event_filter = EventFilter(
        occurred=EventOccurredFilter(since=since, until=until),
        event=EventNameFilter(name=[FLOW_RUN_HEARTBEAT, ENDPOINT_HEARTBEAT]),
        resource=EventResourceFilter(id_prefix=[FLOW_RUN_RESOURCE, ENDPOINT_RESOURCE]),
    )
    # One day per time bucket: a window of up to 1000 days stays under the server's bucket cap.
    response = client.request("POST", "/events/count-by/{countable}", path_params={"countable": "resource"},
                              json={"filter": event_filter.model_dump(mode="json"), "time_unit": "day",
                                    "time_interval": 1.0})
    found = Heartbeats()
    for count in response.json():
        resource_id, newest = count["value"], datetime.fromisoformat(count["end_time"])
        if resource_id.startswith(FLOW_RUN_RESOURCE):
            found.flow_runs[resource_id.removeprefix(FLOW_RUN_RESOURCE)] = newest
        elif resource_id.startswith(ENDPOINT_RESOURCE):
            found.endpoints[resource_id.removeprefix(ENDPOINT_RESOURCE)] = newest
    return found
