"""Where this control plane's training ran: recorded when a run's job starts, read back by the preload sweep.

When a training job is first IN_PROGRESS, the run asks RunPod where its worker was placed
(`GET /v2/serverless/{id}/workers`) and sends `loraflow.run.placed` with the datacenter as the event's
resource (`record_placement`). Events live in this control plane's Prefect database, so the history is this
control plane's own. The preload sweep, when no datacenters are named, warms the datacenters where training
ran lately (`recent_training_data_centers`): read back the way heartbeats are (`tasks/lifecycle/liveness.py`), in one
count-by-resource request, whatever the number of runs.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta
from typing import Any

from tasks.reports import events
from tasks.runpod.client import RunpodClient
from tasks.runpod.errors import RunpodError
from tasks.runpod.models import Endpoint, EndpointWorker

log = logging.getLogger("loraflow.placement")


def record_placement(client: RunpodClient, endpoint: Endpoint, worker_id: str | None, run_id: str | None) -> str | None:
    """Send `loraflow.run.placed` for the datacenter of the endpoint's worker (the one named `worker_id` when
    listed, else the one placed worker of a one-worker endpoint); returns the datacenter, or None when no
    placed worker is listed yet (ask again later) or RunPod could not be read. Never raises: a missed
    placement only narrows the preload sweep's default."""
    try:
        workers = client.list_endpoint_workers(endpoint.id)
    except (RunpodError, ValueError) as e:
        log.warning("Could not read where endpoint %s's worker runs (%s: %s)", endpoint.id, type(e).__name__, e)
        return None
    worker = placed_worker(workers, worker_id)
    if worker is None or worker.data_center_id is None:
        return None
    events.run_placed(run_id, worker.data_center_id, endpoint_id=endpoint.id, endpoint_name=endpoint.name,
                      gpu_type=worker.gpu_type_id)
    return worker.data_center_id


def placed_worker(workers: list[EndpointWorker], worker_id: str | None) -> EndpointWorker | None:
    """The worker named `worker_id` when it is placed, else the first placed one; None when none is placed."""
    placed = [w for w in workers if w.data_center_id]
    return next((w for w in placed if w.id == worker_id), placed[0] if placed else None)


def newest_placements(client: Any, since: datetime, until: datetime) -> dict[str, datetime]:
    """Datacenter → the newest `loraflow.run.placed` there between `since` and `until`, in one request
    (`POST /events/count-by/resource`: each group's `end_time` is its newest event). `client` is a sync
    Prefect client."""
    from prefect.events.filters import EventFilter, EventNameFilter, EventOccurredFilter, EventResourceFilter

    event_filter = EventFilter(
        occurred=EventOccurredFilter(since=since, until=until),
        event=EventNameFilter(name=[events.RUN_PLACED]),
        resource=EventResourceFilter(id_prefix=[events.DATA_CENTER_RESOURCE]),
    )
    # One day per time bucket: a window of up to 1000 days stays under the server's bucket cap.
    response = client.request("POST", "/events/count-by/{countable}", path_params={"countable": "resource"},
                              json={"filter": event_filter.model_dump(mode="json"), "time_unit": "day",
                                    "time_interval": 1.0})
    return {count["value"].removeprefix(events.DATA_CENTER_RESOURCE): datetime.fromisoformat(count["end_time"])
            for count in response.json() if count["value"].startswith(events.DATA_CENTER_RESOURCE)}


def recent_training_data_centers(days: float, now: datetime | None = None) -> list[str]:
    """The datacenters where this control plane's training ran in the last `days`, most recent first."""
    from prefect import get_client

    now = now or datetime.now(UTC)
    with get_client(sync_client=True) as client:
        # `occurred` is the sender's clock: some room past now for clocks running ahead.
        newest = newest_placements(client, now - timedelta(days=days), now + timedelta(minutes=10))
    return sorted(newest, key=lambda dc: newest[dc], reverse=True)
