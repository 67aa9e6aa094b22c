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
(`newest_heartbeats`), and judges each by its own interval: silent means no heartbeat for 3 × the interval
its sender used, at least. The endpoint heartbeat carries that interval in its payload (`interval_s`), with
the sending process's own flow-run heartbeat interval (`flow_run_interval_s`): Prefect's flow-run heartbeat
carries none, so a run's flow-run interval is what its endpoint heartbeat says, else the reconciler's own
setting (`intervals_in_force`), the one place it can be read.
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
SILENT_AFTER_BEATS = 3
"""A sender is silent after this many of its intervals without a heartbeat: one late or lost beat is not death."""
PREFECT_MIN_HEARTBEAT_S = 30
"""Prefect's flow engine sends its heartbeat no more often than every this many seconds, whatever the setting
(`MINIMUM_HEARTBEAT_INTERVAL` in `prefect/flow_engine.py`; the setting itself refuses less)."""

# When this process last sent each endpoint's heartbeat (monotonic seconds). Per process on purpose:
# every process that watches an endpoint beats for it on its own.
_last_beat: dict[str, float] = {}


def beat(endpoint: Endpoint, job_status: str | None = None, *, interval_s: float | None = None,
         clock: Callable[[], float] = time.monotonic) -> Event | None:
    """Send `loraflow.endpoint.heartbeat` for `endpoint`, unless this process sent one less than
    `interval_s` ago (`LORAFLOW_HEARTBEAT_SECONDS` when None). Call it on every poll of the endpoint's
    job. Its payload says `interval_s` and this process's flow-run heartbeat interval
    (`flow_run_interval_s`; None: off): the reconciler judges the run by them.

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
    # The intervals this process keeps: the reconciler judges this run by them, not by its own settings.
    payload: dict[str, Any] = {"interval_s": interval_s, "flow_run_interval_s": flow_run_heartbeat_s()}
    if job_status:
        payload["job_status"] = job_status
    return emit_event(
        event=ENDPOINT_HEARTBEAT,
        resource={"prefect.resource.id": f"{ENDPOINT_RESOURCE}{endpoint.id}", "prefect.resource.name": endpoint.name},
        payload=payload,
    )


def flow_run_heartbeat_s() -> int | None:
    """How often Prefect's flow engine sends `prefect.flow-run.heartbeat` for a run started in this process:
    `PREFECT_FLOWS_HEARTBEAT_FREQUENCY` (default 180 s), raised to Prefect's minimum; None when it is off."""
    from prefect.settings import get_current_settings

    frequency = get_current_settings().flows.heartbeat_frequency
    return None if frequency is None else max(frequency, PREFECT_MIN_HEARTBEAT_S)


class HeartbeatIntervals(BaseModel):
    """The heartbeat intervals in force in one process: what its runs send, and what a reconciler there assumes
    of a run that has not said."""

    endpoint_s: float = Field(description="`LORAFLOW_HEARTBEAT_SECONDS`: seconds between endpoint heartbeats.")
    flow_run_s: float | None = Field(description="`PREFECT_FLOWS_HEARTBEAT_FREQUENCY` (at least 30): seconds "
                                     "between flow-run heartbeats; None when they are off.")

    def silence_floor(self) -> tuple[float, str]:
        """The shortest silence that may mean death here (3 × the longer interval), and how it comes about:
        `3 × 180 s = 540 s, PREFECT_FLOWS_HEARTBEAT_FREQUENCY; LORAFLOW_HEARTBEAT_SECONDS is 60 s`."""
        endpoint = f"LORAFLOW_HEARTBEAT_SECONDS is {self.endpoint_s:g} s"
        if self.flow_run_s is None:
            longer, setting = self.endpoint_s, "LORAFLOW_HEARTBEAT_SECONDS"
            other = "Prefect's flow-run heartbeat is off"
        elif self.flow_run_s > self.endpoint_s:
            longer, setting, other = self.flow_run_s, "PREFECT_FLOWS_HEARTBEAT_FREQUENCY", endpoint
        else:
            longer, setting = self.endpoint_s, "LORAFLOW_HEARTBEAT_SECONDS"
            other = f"PREFECT_FLOWS_HEARTBEAT_FREQUENCY is {self.flow_run_s:g} s"
        floor = SILENT_AFTER_BEATS * longer
        return floor, f"{SILENT_AFTER_BEATS} × {longer:g} s = {floor:g} s, {setting}; {other}"


def intervals_in_force() -> HeartbeatIntervals:
    """This process's heartbeat settings (`LORAFLOW_HEARTBEAT_SECONDS`, `PREFECT_FLOWS_HEARTBEAT_FREQUENCY`)."""
    from tasks.settings import Settings

    return HeartbeatIntervals(endpoint_s=Settings().loraflow_heartbeat_seconds, flow_run_s=flow_run_heartbeat_s())


class EndpointBeat(BaseModel):
    """An endpoint's newest heartbeat, with the intervals its sender said it keeps (None: not said, or not read)."""

    at: datetime = Field(description="When it was sent (the sender's clock).")
    interval_s: float | None = Field(default=None, description="Seconds between this endpoint's heartbeats.")
    flow_run_interval_s: float | None = Field(
        default=None, description="Seconds between its run's flow-run heartbeats (the sender's Prefect setting).")


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


def newest_endpoint_beat(client: Any, endpoint_id: str, since: datetime, until: datetime) -> EndpointBeat | None:
    """The newest `loraflow.endpoint.heartbeat` of one endpoint between `since` and `until`, with the
    intervals in its payload (events before the payload carried them: None); None when there is none. One
    request (`POST /events/filter`, newest first); `client` is a sync Prefect client."""
    event_filter = EventFilter(
        occurred=EventOccurredFilter(since=since, until=until),
        event=EventNameFilter(name=[ENDPOINT_HEARTBEAT]),
        resource=EventResourceFilter(id=[f"{ENDPOINT_RESOURCE}{endpoint_id}"]),
    )
    events = client.read_events(event_filter, limit=1).events
    if not events:
        return None
    payload = events[0].payload
    return EndpointBeat(at=events[0].occurred, interval_s=_seconds(payload.get("interval_s")),
                        flow_run_interval_s=_seconds(payload.get("flow_run_interval_s")))


def _seconds(value: Any) -> float | None:
    # A payload is whatever its sender wrote: an interval that is not a positive number is not one.
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else None
