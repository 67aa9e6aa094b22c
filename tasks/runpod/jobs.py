"""Watching one RunPod job to its end, and saying how it ended.

`watch_job` is a poll loop with a deadline and a bounded interval (no exponential backoff: an
exponent that grows with each poll overflows after hours). Transient read errors are tolerated a
bounded number of times in a row here, not retried by restarting the task.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, Field

from tasks.runpod import errors
from tasks.runpod.client import RunpodClient
from tasks.runpod.models import JobStatus

OutcomeKind = Literal["completed", "failed", "cancelled", "timed_out", "no_capacity"]

MAX_CONSECUTIVE_READ_ERRORS = 10


class JobOutcome(BaseModel):
    """How a job ended, as far as the control plane can tell."""

    kind: OutcomeKind = Field(description="completed; failed (the code failed: no retry); cancelled; timed_out; no_capacity (never left the queue).")
    job_id: str
    status: str = Field(description="RunPod's last job status.")
    output: Any = None
    error: str | None = Field(default=None, description="The worker's error message, when it failed.")
    traceback: str | None = Field(default=None, description="The worker's traceback, when it sent one.")
    queued_seconds: float = 0.0
    running_seconds: float = 0.0


def parse_worker_error(error: str | None) -> tuple[str | None, str | None]:
    """(message, traceback) from a FAILED job's `error`: a worker exception arrives as a JSON string
    with `error_type`, `error_message` and `error_traceback`; other failures as plain text."""
    if not error:
        return None, None
    try:
        payload = json.loads(error)
    except ValueError:
        return error, None
    if not isinstance(payload, dict):
        return error, None
    # runpod 1.12 sends the type as str(type(exc)): "<class 'ValueError'>".
    kind = re.sub(r"^<class '(?:.*\.)?([^'.]+)'>$", r"\1", str(payload.get("error_type") or ""))
    message = payload.get("error_message") or error
    if kind and kind not in message:
        message = f"{kind}: {message}"
    return message, payload.get("error_traceback")


def watch_job(
    client: RunpodClient,
    endpoint_id: str,
    job_id: str,
    *,
    deadline: float,
    queue_allowance_s: float,
    poll_interval_s: float = 2.0,
    on_status: Callable[[JobStatus], None] = lambda status: None,
    clock: Callable[[], float] = time.time,
    sleep: Callable[[float], None] = time.sleep,
) -> JobOutcome:
    """Poll `/status` until the job ends, the run's deadline passes, or it stays queued too long.

    `deadline` is a unix time. A job still queued after `queue_allowance_s` is cancelled and reported
    as `no_capacity` (a slow image pull also looks like this; the allowance must cover it).
    """
    started = clock()
    first_running: float | None = None
    read_errors = 0
    status: JobStatus | None = None
    while True:
        try:
            status = client.status(endpoint_id, job_id)
            read_errors = 0
        except errors.TRANSIENT_ERRORS:
            read_errors += 1
            if read_errors >= MAX_CONSECUTIVE_READ_ERRORS:
                raise
        now = clock()
        if status is not None:
            on_status(status)
            if status.status == "IN_PROGRESS" and first_running is None:
                first_running = now
            if status.terminal:
                return _outcome(status, started, first_running, now)
            if status.status == "IN_QUEUE" and first_running is None and now - started > queue_allowance_s:
                _cancel_quietly(client, endpoint_id, job_id)
                return JobOutcome(kind="no_capacity", job_id=job_id, status=status.status, queued_seconds=now - started,
                                  error=f"the job stayed queued for {now - started:.0f} s: no worker started")
        if now >= deadline:
            _cancel_quietly(client, endpoint_id, job_id)
            return JobOutcome(kind="timed_out", job_id=job_id, status=status.status if status else "UNKNOWN",
                              error="the run's deadline passed before the job finished",
                              queued_seconds=(first_running or now) - started,
                              running_seconds=now - first_running if first_running else 0.0)
        sleep(min(poll_interval_s, max(deadline - now, 0.0)))


def _outcome(status: JobStatus, started: float, first_running: float | None, now: float) -> JobOutcome:
    kind: OutcomeKind = {
        "COMPLETED": "completed",
        "FAILED": "failed",
        "CANCELLED": "cancelled",
        "TIMED_OUT": "timed_out",
    }[status.status]  # type: ignore[assignment]
    message, traceback = parse_worker_error(status.error)
    queued = (status.delay_time / 1000) if status.delay_time is not None else (first_running or now) - started
    running = (status.execution_time / 1000) if status.execution_time is not None else 0.0
    return JobOutcome(kind=kind, job_id=status.id, status=status.status, output=status.output,
                      error=message, traceback=traceback, queued_seconds=queued, running_seconds=running)


def _cancel_quietly(client: RunpodClient, endpoint_id: str, job_id: str) -> None:
    # The endpoint is deleted right after this, which stops the job anyway; cancelling first makes
    # the worker stop cleanly. A failure here must not hide the outcome.
    try:
        client.cancel(endpoint_id, job_id)
    except errors.RunpodError:
        pass
