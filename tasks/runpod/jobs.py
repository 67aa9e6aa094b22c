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

OutcomeKind = Literal[
    "completed", "failed", "cancelled", "timed_out", "no_capacity", "stalled", "preempted", "worker_lost",
    "out_of_memory", "submit_failed",
]
RETRIABLE_OUTCOMES: frozenset[str] = frozenset(
    {"no_capacity", "stalled", "preempted", "worker_lost", "out_of_memory", "submit_failed"}
)

MAX_CONSECUTIVE_READ_ERRORS = 10
_OOM = re.compile(r"^out of memory|CUDA out of memory|OutOfMemoryError", re.IGNORECASE)


class WatchLimits(BaseModel):
    """How long each phase of a job may take before the run gives up on this attempt."""

    deadline_epoch_s: float = Field(description="Unix time by which the whole run must be over.")
    queue_s: float = Field(description="Longest wait in the queue before any worker takes the job (no capacity).")
    startup_s: float = Field(description="Longest time from the job starting to its first training step "
                                         "(image pull, model and data download).")
    stall_s: float = Field(description="Longest time between two training progress updates.")


class JobOutcome(BaseModel):
    """How a job ended, as far as the control plane can tell."""

    kind: OutcomeKind = Field(description="completed; failed (the code failed: no retry); cancelled; timed_out; "
                              "no_capacity (never left the queue); stalled (no progress); preempted (requeued "
                              "after it started); worker_lost (the worker died without a result); out_of_memory; "
                              "submit_failed (`/run` errored: whether a job started is unknown).")
    job_id: str
    status: str = Field(description="RunPod's last job status.")
    output: Any = None
    error: str | None = Field(default=None, description="The worker's error message, or why the attempt was given up.")
    traceback: str | None = Field(default=None, description="The worker's traceback, when it sent one.")
    queued_seconds: float = 0.0
    running_seconds: float = 0.0
    last_step: int | None = Field(default=None, description="Last training step the worker reported.")

    @property
    def retriable(self) -> bool:
        return self.kind in RETRIABLE_OUTCOMES


def parse_worker_error(error: str | None) -> tuple[str | None, str | None, bool]:
    """(message, traceback, raised_by_handler) from a FAILED job's `error`.

    A handler exception arrives as a JSON string with `error_type`, `error_message` and
    `error_traceback`; a failure of the platform (the worker died) as plain text.
    """
    if not error:
        return None, None, False
    try:
        payload = json.loads(error)
    except ValueError:
        return error, None, False
    if not isinstance(payload, dict):
        return error, None, False
    # runpod 1.12 sends the type as str(type(exc)): "<class 'ValueError'>".
    kind = re.sub(r"^<class '(?:.*\.)?([^'.]+)'>$", r"\1", str(payload.get("error_type") or ""))
    message = payload.get("error_message") or error
    if kind and kind not in message:
        message = f"{kind}: {message}"
    return message, payload.get("error_traceback"), True


class _Progress:
    """What the polls have seen so far of one job."""

    def __init__(self, now: float):
        self.submitted = now
        self.first_running: float | None = None
        self.first_step: float | None = None
        self.last_change = now
        self.last_key: tuple | None = None
        self.last_step: int | None = None

    def see(self, status: JobStatus, now: float) -> None:
        if status.status == "IN_PROGRESS" and self.first_running is None:
            self.first_running = self.last_change = now
        progress = status.output if status.status == "IN_PROGRESS" and isinstance(status.output, dict) else None
        if progress is None:
            return
        key = (progress.get("stage"), progress.get("step"), progress.get("loss"))
        if key != self.last_key:
            self.last_key, self.last_change = key, now
        if progress.get("stage") == "training" and isinstance(progress.get("step"), int):
            self.last_step = progress["step"]
            if self.first_step is None and progress["step"] > 0:
                self.first_step = now


def watch_job(
    client: RunpodClient,
    endpoint_id: str,
    job_id: str,
    limits: WatchLimits,
    *,
    poll_interval_s: float = 2.0,
    on_status: Callable[[JobStatus], None] = lambda status: None,
    clock: Callable[[], float] = time.time,
    sleep: Callable[[float], None] = time.sleep,
) -> JobOutcome:
    """Poll `/status` until the job ends or an attempt limit is passed, then classify the outcome.

    A job given up on (queued, stalled, requeued, past the deadline) is cancelled first; the caller
    deletes the endpoint afterwards in any case.
    """
    seen = _Progress(clock())
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
            seen.see(status, now)
            if status.terminal:
                return _terminal_outcome(status, seen, now)
            give_up = _give_up(status, seen, limits, now)
            if give_up is not None:
                kind, reason = give_up
                _cancel_quietly(client, endpoint_id, job_id)
                return _outcome(kind, job_id, status.status, seen, now, error=reason)
        elif now >= limits.deadline_epoch_s:
            return _outcome("timed_out", job_id, "UNKNOWN", seen, now, error="the run's deadline passed")
        sleep(min(poll_interval_s, max(limits.deadline_epoch_s - now, 0.0)))


def _give_up(status: JobStatus, seen: _Progress, limits: WatchLimits, now: float) -> tuple[OutcomeKind, str] | None:
    if now >= limits.deadline_epoch_s:
        return "timed_out", "the run's deadline passed before the job finished"
    if status.status == "IN_QUEUE":
        if seen.first_running is not None:
            return "preempted", "the job went back to the queue after it had started (worker preempted)"
        if now - seen.submitted > limits.queue_s:
            return "no_capacity", f"the job stayed queued for {now - seen.submitted:.0f} s: no worker started"
        return None
    if seen.first_step is None and seen.first_running is not None and now - seen.first_running > limits.startup_s:
        return "stalled", f"no training step within {limits.startup_s:.0f} s of the job starting"
    if seen.first_step is not None and now - seen.last_change > limits.stall_s:
        return "stalled", f"no progress for {now - seen.last_change:.0f} s after step {seen.last_step}"
    return None


def _terminal_outcome(status: JobStatus, seen: _Progress, now: float) -> JobOutcome:
    message, traceback, raised_by_handler = parse_worker_error(status.error)
    kind: OutcomeKind = {"COMPLETED": "completed", "FAILED": "failed", "CANCELLED": "cancelled",
                         "TIMED_OUT": "timed_out"}[status.status]  # type: ignore[assignment]
    if kind == "failed" and message and _OOM.search(message):
        kind = "out_of_memory"
    elif kind == "failed" and not raised_by_handler:
        kind = "worker_lost"
    outcome = _outcome(kind, status.id, status.status, seen, now, error=message)
    outcome.output, outcome.traceback = status.output, traceback
    if status.delay_time is not None:
        outcome.queued_seconds = status.delay_time / 1000
    if status.execution_time is not None:
        outcome.running_seconds = status.execution_time / 1000
    return outcome


def _outcome(kind: OutcomeKind, job_id: str, status: str, seen: _Progress, now: float, error: str | None) -> JobOutcome:
    started = seen.first_running or now
    return JobOutcome(kind=kind, job_id=job_id, status=status, error=error, last_step=seen.last_step,
                      queued_seconds=started - seen.submitted, running_seconds=now - started)


def _cancel_quietly(client: RunpodClient, endpoint_id: str, job_id: str) -> None:
    # The endpoint is deleted right after this, which stops the job anyway; cancelling first makes
    # the worker stop cleanly. A failure here must not hide the outcome.
    try:
        client.cancel(endpoint_id, job_id)
    except errors.RunpodError:
        pass
