"""The one path every job that rents an endpoint takes (a training attempt, a merge, a preload, a serve):

1. one slot of the `runpod-endpoints` limit per worker the endpoint may run (one, but a serving endpoint's
   `workers.max`), held for as long as the endpoint may exist (`rented_endpoint`);
2. the endpoint created, RunPod's own quota refusal waited out;
3. the job submitted once and watched to its end, the endpoint's heartbeat sent for the reconciler;
4. the endpoint deleted whatever happened, confirmed (`delete-endpoint`); a delete that stays unconfirmed keeps a
   slot lease of its own and a record for the reconciler (`UndeletedEndpoint`), and the slot is never without one.

The jobs differ in their endpoint request, their job input and what they collect. Steps 2-3 are `run_job` for a
job watched inside one task (merge, preload); a training attempt takes them through the Prefect tasks of
`tasks/lifecycle/steps.py`, which give it its progress artifact and its page's task runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from tasks.lifecycle.liveness import beat
from tasks.lifecycle.quota import endpoint_slot, release_meanwhile, remember_named_quota, wait_for_runpod_quota
from tasks.lifecycle.steps import delete_endpoint
from tasks.lifecycle.teardown import UndeletedEndpoint, keep_undeleted_endpoint, take_slot_for_undeleted
from tasks.runpod.client import RunpodClient
from tasks.runpod.endpoints import ensure_endpoint
from tasks.runpod.jobs import JobOutcome, WatchLimits, watch_job
from tasks.runpod.models import CreateEndpoint, Endpoint, JobPolicy, JobStatus, RunRequest
from tasks.settings import Settings


@dataclass
class Rental:
    """One endpoint's life inside `rented_endpoint`: the endpoint once the job has made it, and after the block
    whether its delete was confirmed (else the record kept for the reconciler)."""

    name: str
    owner: str
    """The flow run the endpoint belongs to, as the record of an unconfirmed delete names it."""
    endpoint: Endpoint | None = None
    deleted: bool = False
    undeleted: UndeletedEndpoint | None = None


@contextmanager
def rented_endpoint(name: str, owner: str, *, give_up_at: float, logger: Any, slots: int = 1,
                    release_later: bool = False) -> Iterator[Rental]:
    """Hold `slots` slots of the endpoint limit (one per worker the endpoint may run: its `workers.max`; waiting for
    them until `give_up_at`) around the block, which creates the endpoint `name` and sets `Rental.endpoint`; then
    delete it, whatever the block did, and keep as many slots and a record for a delete that stays unconfirmed. An
    error of the block is raised after the teardown, unchanged. `release_later`: the slots are given back while the
    caller goes on, once the endpoint is deleted (`quota.release_meanwhile`; the caller's flow waits for it at its
    end, `quota.wait_for_slot_releases`)."""
    rental = Rental(name=name, owner=owner)
    slot = ExitStack()
    try:
        slot.enter_context(endpoint_slot(Settings().loraflow_slot_lease_seconds, give_up_at=give_up_at,
                                         logger=logger, slots=slots))
        try:
            yield rental
        finally:
            endpoint_id = rental.endpoint.id if rental.endpoint else None
            deleted = delete_endpoint(name, endpoint_id, return_state=True)
            rental.deleted = deleted.is_completed()
            if not rental.deleted:
                # Taken while this job still holds its slot, when the limit has room: the endpoint is never
                # without one.
                rental.undeleted = UndeletedEndpoint(endpoint_name=name, endpoint_id=endpoint_id, run_id=owner,
                                                     lease_id=take_slot_for_undeleted(0.0, slots), slots=slots,
                                                     error=str(deleted.result(raise_on_failure=False))[:500])
    finally:
        if release_later:
            release_meanwhile(slot.close, logger)
        else:
            slot.close()
        if rental.undeleted is not None:
            keep_undeleted_endpoint(rental.undeleted, logger)


def run_job(client: RunpodClient, rental: Rental, request: CreateEndpoint, job_input: BaseModel, *,
            deadline_epoch_s: float, queue_s: float, logger: Any,
            cancel_requested: Callable[[], bool] = lambda: False,
            on_status: Callable[[JobStatus], None] | None = None) -> JobOutcome | None:
    """Create `request`'s endpoint (RunPod's quota refusal waited out until a minute before the deadline) into
    `rental`, submit `job_input` once with an execution timeout and a TTL from the time left, and watch the job to
    its end, sending the endpoint's heartbeat (`on_status` sees each status too). None: cancelled, or no room in
    RunPod's quota before the deadline."""
    endpoint = wait_for_runpod_quota(lambda: ensure_endpoint(client, request), give_up_at=deadline_epoch_s - 60,
                                     cancel_requested=cancel_requested, on_quota_named=remember_named_quota)
    if endpoint is None:
        return None
    rental.endpoint = endpoint
    remaining = max(int(deadline_epoch_s - time.time()), 60)
    job = client.run(endpoint.id, RunRequest(input=job_input.model_dump(mode="json"), policy=JobPolicy(
        execution_timeout=(remaining + 300) * 1000, ttl=(remaining + 600) * 1000)))
    logger.info("Job %s submitted to %s", job.id, endpoint.name)

    def watched(status: JobStatus) -> None:
        beat(endpoint, status.status)
        if on_status is not None:
            on_status(status)

    # Such a job reports no training steps: only the queue allowance and the time budget apply.
    limits = WatchLimits(deadline_epoch_s=deadline_epoch_s, queue_s=queue_s, startup_s=remaining, stall_s=remaining)
    return watch_job(client, endpoint.id, job.id, limits, on_status=watched, cancel_requested=cancel_requested)
