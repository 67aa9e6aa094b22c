"""A training attempt, the job a `train` run rents an endpoint for, on the path every rented job takes
(`tasks/jobs/rented.py`): inside one slot of the endpoint quota, create the endpoint (RunPod's own quota error waits),
submit the job once, watch it to its end through the Prefect steps (its progress artifact), and delete the endpoint
whatever happened. What only training does: a stale warm volume or a refused GPU class said as such, for the flow to
try again cold or on the next class.
"""

from __future__ import annotations

from collections.abc import Callable

from prefect import get_run_logger

from tasks.jobs.rented import Rental, rented_endpoint
from tasks.lifecycle.attempts import MIN_TIME_FOR_ATTEMPT_S, GpuClassRefused
from tasks.lifecycle.quota import remember_named_quota, wait_for_runpod_quota
from tasks.lifecycle.steps import (
    WatchedJob,
    create_endpoint,
    report_job_end,
    run_cancel_requested,
    submit_job,
    wait_for_job,
)
from tasks.lifecycle.teardown import UndeletedEndpoint
from tasks.placement.plan import AttemptPlan
from tasks.placement.weight_cache import gone_volume
from tasks.runpod.errors import BadRequestError, NotFoundError, QuotaExceededError, RunpodError, is_transient
from tasks.runpod.jobs import JobOutcome
from tasks.settings import make_client


def run_attempt(plan: AttemptPlan, progress_key: str, endpoint_ids: list[str] | None = None,
                on_submitted: Callable[[], None] | None = None,
                run_name: str | None = None) -> tuple[JobOutcome, UndeletedEndpoint | None]:
    """One endpoint's life, inside one quota slot: create → submit → wait → delete (always); then the job's last
    report (`report_job_end`: its final progress line and evaluations, after the delete). The id of the
    endpoint it created is appended to `endpoint_ids`; `on_submitted` is called once the job is submitted (work
    the flow can do while the job runs, off the path from the slot to the submit); `run_name` labels the run's
    evaluation events (`wait_for_job`).

    When the delete stays unconfirmed after its retries, a slot lease of its own and a record
    (`UndeletedEndpoint`, returned) outlive the attempt, for the reconciler; the attempt's outcome, or the
    error it raised, is kept as it was. Raises `WarmVolumeGone` when RunPod refused the endpoint because its
    warm volume no longer exists (nothing was created: the caller runs the attempt again, cold), and
    `GpuClassRefused` when RunPod refused its request otherwise (400, not the quota: the caller moves to the next
    GPU class).
    """
    # The slot is given back while the flow collects and reports (it waits for that at its end).
    with rented_endpoint(plan.endpoint_name, plan.run_id, logger=get_run_logger(), release_later=True,
                         give_up_at=plan.limits.deadline_epoch_s - MIN_TIME_FOR_ATTEMPT_S) as rental:
        try:
            ended = _create_submit_wait(plan, progress_key, rental, on_submitted, run_name)
        finally:
            if rental.endpoint is not None and endpoint_ids is not None:
                endpoint_ids.append(rental.endpoint.id)
    if isinstance(ended, WatchedJob):  # its last report waits for the delete, never the delete for it
        report_job_end(ended)
        return ended.outcome, rental.undeleted
    return ended, rental.undeleted


def _create_submit_wait(plan: AttemptPlan, progress_key: str, rental: Rental,
                        on_submitted: Callable[[], None] | None, run_name: str | None) -> JobOutcome | WatchedJob:
    if run_cancel_requested():  # cancelled while it waited for the slot: create nothing
        return JobOutcome(kind="run_cancelled", job_id="", status="UNKNOWN",
                          error="the run was cancelled while it waited for an endpoint slot")
    try:
        endpoint = wait_for_runpod_quota(lambda: create_endpoint(plan.create_request),
                                         give_up_at=plan.limits.deadline_epoch_s - MIN_TIME_FOR_ATTEMPT_S,
                                         cancel_requested=run_cancel_requested, logger=get_run_logger(),
                                         on_quota_named=remember_named_quota)
    except (BadRequestError, NotFoundError) as refused:
        # RunPod refuses (4xx) an endpoint whose network volume is gone: a stale warm record, not a failed run.
        gone = gone_volume(refused, plan.create_request.network_volumes, _volume_exists)
        if gone is not None:
            raise gone from refused
        if isinstance(refused, BadRequestError) and not isinstance(refused, QuotaExceededError):
            raise GpuClassRefused(plan.gpu.name, refused) from refused
        raise
    if endpoint is None:
        return JobOutcome(kind="run_cancelled", job_id="", status="UNKNOWN",
                          error="the run was cancelled while it waited for room in RunPod's worker quota")
    rental.endpoint = endpoint
    submitted = submit_job(endpoint, plan.job_input.model_dump(mode="json"), plan.policy, return_state=True)
    if not submitted.is_completed():
        # `/run` is not idempotent: rather than POST again (maybe starting a second job), give this
        # endpoint up (deleted by the caller, with any job it got) and let a new attempt start clean.
        error = submitted.result(raise_on_failure=False)
        if isinstance(error, NotFoundError):  # the endpoint vanished between its create and the submit
            return JobOutcome(kind="lost", job_id="", status="UNKNOWN",
                              error=f"the endpoint vanished before its job was submitted ({error})")
        if not is_transient(error):
            raise error
        return JobOutcome(kind="submit_failed", job_id="", status="UNKNOWN", error=str(error))
    if on_submitted is not None:
        on_submitted()
    return wait_for_job(endpoint, submitted.result(), plan.limits, progress_key=progress_key, run_name=run_name)


def existing_volume_ids() -> set[str] | None:
    """The ids of the account's network volumes now; None (trust the records) when they cannot be listed."""
    try:
        with make_client() as client:
            return {v.id for v in client.list_network_volumes()}
    except RunpodError as e:
        get_run_logger().warning("The network volumes could not be listed (%s): warm records are not checked", e)
        return None


def _volume_exists(volume_id: str) -> bool:
    """Whether the volume exists; True when that cannot be told (the refusal then stands as the error)."""
    existing = existing_volume_ids()
    return existing is None or volume_id in existing
