"""Watching one RunPod job to its end, and saying how it ended.

`watch_job` is a poll loop with a deadline and a bounded interval (never a bare `2**n`: an exponent that
grows with each poll overflows after hours). The interval adapts to the job (`next_poll_s`): short when
the worker says it is about to end, so the endpoint is deleted (and stops billing) soon after; longer
while it says the end is far, so many runs polling at once cost RunPod and this machine less. RunPod
offers no long poll on `/status` (only `/runsync` takes `?wait=`), so polling it is.

Transient read errors (429, 5xx, transport) are tolerated for a time budget, with bounded backoff, not a
count: a minute of RunPod trouble must not cost an attempt. While the job waits in the queue, `/health`
says why no worker took it. The run's own cancellation (read from Prefect by the caller) stops the job
from here, however the run was started.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, Field

from tasks.runpod import errors
from tasks.runpod.client import RunpodClient
from tasks.runpod.models import Health, JobStatus

log = logging.getLogger("loraflow.jobs")

OutcomeKind = Literal[
    "completed", "failed", "cancelled", "run_cancelled", "deadline", "timed_out", "no_capacity", "image_pull_failed",
    "stalled", "preempted", "worker_lost", "out_of_memory", "host_out_of_memory", "cuda_unavailable", "submit_failed",
    "unreachable", "lost",
]
RETRIABLE_OUTCOMES: frozenset[str] = frozenset(
    {"no_capacity", "stalled", "preempted", "timed_out", "worker_lost", "out_of_memory", "cuda_unavailable",
     "submit_failed", "unreachable", "lost"}
)
MemoryKind = Literal["gpu", "vllm_kv", "host"]

MAX_POLL_INTERVAL_S = 30.0
"""The longest wait between two polls, backoff after errors and Retry-After included."""
MIN_READ_ERROR_BUDGET_S = 60.0
"""Transient read errors are tolerated for the attempt's stall allowance, and never for less than this."""
DEADLINE_SAVE_GRACE_S = 90.0
"""How long past the run's deadline a started job is left to end by itself: its training stops at the
deadline and saves what it has, and the worker's supervisor kills it 70 s past the deadline at the latest
(`loraflow_worker.runtime.supervisor.DEADLINE_KILL_GRACE_S` + `TERM_GRACE_S`)."""
CANCEL_CHECK_S = 5.0
"""How often the run's own Prefect state is read: a cancel reaches the job within about this long."""
FAST_POLL_S = 0.05
"""The interval once the worker says it is saving or has under `2 × FAST_POLL_S` of training left: the
job's end is seen within this, and the endpoint's teardown starts then (measured: bench/bare_script.py,
bench/overhead.py; at 0.25 s this wait was half the teardown, at 0.1 s still 50 ms of it on average, billed). 20
requests a second for the seconds a save takes, 10 × under RunPod's `/status` limit (2,000 per endpoint per 10 s)."""
STEADY_POLL_MAX_S = 5.0
"""The longest interval while the worker's ETA is far off: no longer than `CANCEL_CHECK_S`, which the same
loop serves, and 2.5 × fewer polls than the 2 s base on a long run."""
HEALTH_CHECK_S = 30.0
"""How often `/health` is read while the job is queued and no worker has taken it."""
MAX_REQUEUES = 2
"""How many times a started job may go back to RunPod's queue (its worker lost: a crash, a preempted host) and be
waited for on the same endpoint; once more, the attempt is given up as preempted (its workers keep being lost)."""
# How a FAILED job's error says what failed, searched anywhere in it (RunPod's runtime and the handler add
# their own prefixes, e.g. `JobFailed: `). First the worker's own markers (loraflow_worker.runtime.supervisor), then
# the libraries' texts, for an error that did not pass through the worker's supervisor.
_FAILURE_KINDS: tuple[tuple[OutcomeKind, MemoryKind | None, re.Pattern[str]], ...] = (
    ("cuda_unavailable", None, re.compile(r"CUDA unavailable:")),
    ("host_out_of_memory", "host", re.compile(r"out of memory \(host RAM\)")),
    ("out_of_memory", "vllm_kv", re.compile(r"out of memory \(vLLM KV cache\)")),
    ("out_of_memory", "gpu", re.compile(r"out of memory \(GPU\)")),
    # vLLM's start-up check when the share it was given leaves nothing for the KV cache.
    ("out_of_memory", "vllm_kv", re.compile(r"No available memory for the cache blocks|"
                                            r"available KV cache memory|KV cache is needed", re.IGNORECASE)),
    # PyTorch's allocator (torch.OutOfMemoryError), a kernel launch (CUDA error), cuBLAS handle creation.
    ("out_of_memory", "gpu", re.compile(r"CUDA out of memory|OutOfMemoryError|CUDA error: out of memory|"
                                        r"CUBLAS_STATUS_ALLOC_FAILED", re.IGNORECASE)),
)


class WatchLimits(BaseModel):
    """How long each phase of a job may take before the run gives up on this attempt."""

    deadline_epoch_s: float = Field(description="Unix time by which the whole run must be over.")
    queue_s: float = Field(description="Longest wait in the queue before any worker takes the job (no capacity).")
    startup_s: float = Field(description="Longest time from the job starting to its first training step "
                                         "(image pull, model and data download).")
    stall_s: float = Field(description="Longest time between two training progress updates.")

    @property
    def read_error_budget_s(self) -> float:
        """How long the job's status may stay unreadable (transient errors only) before the attempt is given up."""
        return max(self.stall_s, MIN_READ_ERROR_BUDGET_S)


class JobOutcome(BaseModel):
    """How a job ended, as far as the control plane can tell."""

    kind: OutcomeKind = Field(description="completed; failed (the code failed: no retry); cancelled (the job was "
                              "cancelled at RunPod); run_cancelled (the Prefect run was cancelled: the job was "
                              "cancelled from here); deadline (the run's deadline passed: no retry); timed_out (RunPod ended the "
                              "job at its execution timeout or TTL); no_capacity (never left the queue); image_pull_failed (never "
                              "left the queue while /health showed workers stuck initializing: every GPU would pull the "
                              "same image, so no retry); stalled (no "
                              "progress); preempted (back in the queue after it started, and no worker took it again within the queue "
                              "allowance, or it went back more than MAX_REQUEUES times); worker_lost (the worker died "
                              "without a result); out_of_memory (the GPU's memory, or vLLM's KV cache: see `memory`); "
                              "host_out_of_memory (the host's RAM: the kernel's OOM killer; a GPU with more memory "
                              "does not cure it); cuda_unavailable (CUDA did not start on the host: the worker "
                              "refused to train on its CPU); submit_failed (`/run` errored: whether a job "
                              "started is unknown); unreachable (the job's status answered only transient errors "
                              "for longer than the attempt's budget for them); lost (the endpoint or its job "
                              "vanished: deleted behind the run, by a person, another process or RunPod).")
    memory: MemoryKind | None = Field(default=None, description="Which memory ran out: gpu (training on the GPU), "
                                      "vllm_kv (vLLM's KV cache at start-up), host (the host's RAM); None otherwise.")
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
        self.in_progress_seen = False
        self.first_step: float | None = None
        self.last_change = now
        self.last_key: tuple | None = None
        self.last_step: int | None = None
        self.requeued_at: float | None = None
        """When the job went back to the queue after it had started; None while a worker holds it."""
        self.requeues = 0
        self.worker_id: str | None = None
        """The worker that held the job at the last poll that showed one."""

    def see(self, status: JobStatus, now: float) -> bool:
        """Take in one status; True when it shows the job back in the queue after it had started (a requeue)."""
        # A status loraflow does not know counts as running: the stall limits then end a job that never moves.
        if (status.running or not status.known) and self.first_running is None:
            self.first_running = self.last_change = now
        # Only RunPod's own IN_PROGRESS or RUNNING proves the job started: a queued job after unknown statuses is
        # not preempted.
        self.in_progress_seen = self.in_progress_seen or status.running
        requeued = False
        if status.status == "IN_QUEUE":
            if self.in_progress_seen and self.requeued_at is None:
                requeued, self.requeued_at = True, now
            self.first_running = None
        elif status.running:
            # Another worker holds it without a poll having seen it queued: it went back and was taken again between
            # two polls.
            if self.requeued_at is None and None not in (status.worker_id, self.worker_id) \
                    and status.worker_id != self.worker_id:
                requeued, self.first_running, self.last_change = True, now, now
            self.requeued_at = None
            self.worker_id = status.worker_id or self.worker_id
        if requeued:
            # RunPod hands the job to another worker, which loads the model again: its startup allowance starts anew
            # when it takes the job, and the job resumes from its checkpoint (or returns its stored results).
            self.requeues += 1
            self.first_step, self.last_key = None, None
        progress = status.progress
        if progress is None:
            return requeued
        # A new message is progress too: the task evaluations after training say each batch of answers in it.
        key = (progress.get("stage"), progress.get("step"), progress.get("loss"), progress.get("message"))
        if key != self.last_key:
            self.last_key, self.last_change = key, now
        if progress.get("stage") == "training" and isinstance(progress.get("step"), int):
            self.last_step = progress["step"]
            if self.first_step is None and progress["step"] > 0:
                self.first_step = now
        return requeued


def watch_job(
    client: RunpodClient,
    endpoint_id: str,
    job_id: str,
    limits: WatchLimits,
    *,
    poll_interval_s: float = 2.0,
    on_status: Callable[[JobStatus], None] = lambda status: None,
    on_read_error: Callable[[errors.RunpodError, float], None] = lambda error, unreadable_s: None,
    on_unknown_status: Callable[[str], None] = lambda status: log.warning(
        "RunPod sent job status %r, which loraflow does not know: treated as running", status),
    on_requeued: Callable[[int], None] = lambda times: log.warning(
        "The job went back to RunPod's queue after it had started (time %d): waiting for another worker", times),
    cancel_requested: Callable[[], bool] = lambda: False,
    clock: Callable[[], float] = time.time,
    sleep: Callable[[float], None] = time.sleep,
) -> JobOutcome:
    """Poll `/status` until the job ends or an attempt limit is passed, then classify the outcome.

    A job that goes back to the queue after it started (its worker lost: RunPod hands it to another worker) is
    waited for on the same endpoint, `on_requeued` hearing how many times it went back, within the queue allowance
    and `MAX_REQUEUES`. A job given up on (queued, stalled, requeued too often or too long, unreachable, past the
    deadline, or its run cancelled) is cancelled first; the caller deletes the endpoint afterwards in any case. `cancel_requested` is
    asked every `CANCEL_CHECK_S`; `on_read_error` hears each transient error with how long the status
    has been unreadable. A 404 for the endpoint or the job means it vanished behind the run (outcome `lost`:
    another attempt starts on a new endpoint). A status loraflow does not know is reported once to
    `on_unknown_status` and treated as running. Other non-transient errors (401, 403, ...) are raised at once.
    """
    seen = _Progress(clock())
    queue = _QueueHealth()
    last: JobStatus | None = None
    unreadable_since: float | None = None
    error_streak = 0
    unknown_seen: set[str] = set()
    next_cancel_check = next_health_check = seen.submitted
    while True:
        now = clock()
        if now >= next_cancel_check:
            next_cancel_check = now + CANCEL_CHECK_S
            if cancel_requested():
                _cancel_quietly(client, endpoint_id, job_id)
                return _outcome("run_cancelled", job_id, last.status if last else "UNKNOWN", seen, now,
                                error="the run was cancelled in Prefect: its job is cancelled and its endpoint deleted")
        try:
            status = client.status(endpoint_id, job_id)
        except errors.TRANSIENT_ERRORS as error:
            now = clock()
            unreadable_since = now if unreadable_since is None else unreadable_since
            error_streak += 1
            on_read_error(error, now - unreadable_since)
            if now >= _deadline(limits, seen):
                _cancel_quietly(client, endpoint_id, job_id)
                return _outcome("deadline", job_id, last.status if last else "UNKNOWN", seen, now,
                                error="the run's deadline passed while the job's status could not be read")
            if now - unreadable_since >= limits.read_error_budget_s:
                _cancel_quietly(client, endpoint_id, job_id)
                return _outcome("unreachable", job_id, last.status if last else "UNKNOWN", seen, now,
                                error=f"the job's status answered only transient errors for "
                                      f"{now - unreadable_since:.0f} s (last: {error})")
            sleep(min(_backoff(poll_interval_s, error_streak, error), max(_deadline(limits, seen) - now, 0.0)))
            continue
        except errors.NotFoundError as error:
            return _outcome("lost", job_id, last.status if last else "UNKNOWN", seen, clock(),
                            error=f"the endpoint or its job vanished while the run watched it ({error}): deleted "
                                  "behind the run, from RunPod's console, by another process or by RunPod")
        unreadable_since, error_streak, last = None, 0, status
        if not status.known and status.status not in unknown_seen:
            unknown_seen.add(status.status)
            on_unknown_status(status.status)
        now = clock()
        on_status(status)
        if seen.see(status, now):
            on_requeued(seen.requeues)
        if status.terminal:
            return _terminal_outcome(status, seen, now)
        if status.status == "IN_QUEUE" and seen.first_running is None and now >= next_health_check:
            next_health_check = now + HEALTH_CHECK_S
            queue.see(_read_health(client, endpoint_id))
        give_up = _give_up(status, seen, limits, now)
        if give_up is not None:
            kind, reason = give_up
            if kind == "no_capacity":
                queue.see(_read_health(client, endpoint_id))
                reason = f"{reason} ({queue.cause()})"
                if queue.image_pull_failing():
                    kind = "image_pull_failed"
            _cancel_quietly(client, endpoint_id, job_id)
            return _outcome(kind, job_id, status.status, seen, now, error=reason)
        sleep(min(next_poll_s(status, poll_interval_s), max(_deadline(limits, seen) - now, 0.0)))


def next_poll_s(status: JobStatus, base_s: float) -> float:
    """Seconds to the next `/status` poll after `status`: `FAST_POLL_S` while the worker saves its results;
    half its ETA while it trains (the end is then seen in time), between `FAST_POLL_S` and
    `STEADY_POLL_MAX_S`; `base_s` in the queue, while loading, or when the worker gives no ETA."""
    progress = status.progress
    if progress is None:
        return base_s
    if progress.get("stage") == "saving":
        return FAST_POLL_S
    eta = progress.get("eta_seconds")
    if progress.get("stage") != "training" or not isinstance(eta, int | float) or isinstance(eta, bool):
        return base_s
    return min(max(eta / 2, FAST_POLL_S), STEADY_POLL_MAX_S)


class _QueueHealth:
    """What `/health` said while the job waited for its first worker: why no worker took it. A counter `/health`
    did not report is unknown, never 0: a verdict that needs it is not given."""

    def __init__(self) -> None:
        self.samples = 0
        self.initializing = 0
        self.unhealthy = 0
        self.throttled = 0
        self.up = 0
        self.unreported: set[str] = set()

    def see(self, health: Health | None) -> None:
        if health is None:
            return
        workers = health.workers
        self.samples += 1
        self.unreported |= {name for name in _WORKER_COUNTERS if getattr(workers, name) is None}
        self.initializing += (workers.initializing or 0) > 0
        self.unhealthy += (workers.unhealthy or 0) > 0
        self.throttled += (workers.throttled or 0) > 0
        self.up += (workers.idle or 0) + (workers.ready or 0) + (workers.running or 0) > 0

    def image_pull_failing(self) -> bool:
        known = not self.unreported & {"initializing", "idle", "running"}
        return (known and bool(self.samples) and not self.unhealthy and self.initializing == self.samples
                and not self.up)

    def cause(self) -> str:
        if self.samples == 0:
            return "the endpoint's /health could not be read, so the cause is unknown"
        if self.unhealthy:
            return "workers unhealthy: they started and failed RunPod's health checks (a worker crashing at start-up)"
        if self.image_pull_failing():
            return ("image pull failing: workers stayed initializing (check the image name and tag, and the registry's "
                    "credentials, and LORAFLOW_WORKER_IMAGE), or the image pulls more slowly than attempts.queue_minutes allows")
        if self.throttled:
            return "workers throttled: RunPod wants a worker but has no free GPU of this type where it may run"
        if self.up:
            return "workers were up but did not take the job"
        if missing := sorted(self.unreported & _NO_STOCK_NEEDS):
            return (f"cause unknown: /health did not report the workers' {', '.join(missing)}, without which an image "
                    "pull cannot be told from no stock")
        return "no stock: RunPod started no worker for this GPU (or no host meets its CUDA and datacenter needs)"


_WORKER_COUNTERS = ("idle", "initializing", "ready", "running", "throttled", "unhealthy")
_NO_STOCK_NEEDS = frozenset({"idle", "initializing", "running", "throttled", "unhealthy"})
"""The counters that must all have been reported, and 0, for "no stock": a worker initializing, throttled, up or
unhealthy would each say something else. `ready` may be missing: idle and running cover it."""


def _read_health(client: RunpodClient, endpoint_id: str) -> Health | None:
    # Advice only: a failed read must not end the watch.
    try:
        return client.health(endpoint_id)
    except errors.RunpodError:
        return None


def _backoff(poll_interval_s: float, error_streak: int, error: errors.RunpodError) -> float:
    """Doubling from the poll interval, capped (the exponent too), at least a 429's Retry-After up to the cap."""
    delay = poll_interval_s * 2 ** min(error_streak, 8)
    if isinstance(error, errors.RateLimitError) and error.retry_after:
        delay = max(delay, error.retry_after)
    return min(delay, MAX_POLL_INTERVAL_S)


def _deadline(limits: WatchLimits, seen: _Progress) -> float:
    """When the watch gives the job up for the run's deadline: a job that started gets time to save."""
    return limits.deadline_epoch_s + (DEADLINE_SAVE_GRACE_S if seen.first_running is not None else 0.0)


def _give_up(status: JobStatus, seen: _Progress, limits: WatchLimits, now: float) -> tuple[OutcomeKind, str] | None:
    if now >= _deadline(limits, seen):
        return "deadline", "the run's deadline passed before the job finished"
    if status.status == "IN_QUEUE":
        if seen.requeued_at is not None:
            if seen.requeues > MAX_REQUEUES:
                return "preempted", (f"the job went back to the queue {seen.requeues} times after it had started: its "
                                     "workers keep being lost (preempted or crashed)")
            if now - seen.requeued_at > limits.queue_s:
                return "preempted", (f"the job went back to the queue after it had started (its worker lost or "
                                     f"preempted) and no worker took it again within {limits.queue_s:.0f} s")
            return None
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
    memory: MemoryKind | None = None
    failure = classify_failure(message) if kind == "failed" else None
    if failure is not None:
        kind, memory = failure
    elif kind == "failed" and not raised_by_handler:
        kind = "worker_lost"
    outcome = _outcome(kind, status.id, status.status, seen, now, error=message)
    outcome.memory = memory
    outcome.output, outcome.traceback = status.output, traceback
    if status.delay_time is not None:
        outcome.queued_seconds = status.delay_time / 1000
    if status.execution_time is not None:
        outcome.running_seconds = status.execution_time / 1000
    return outcome


def classify_failure(message: str | None) -> tuple[OutcomeKind, MemoryKind | None] | None:
    """What a FAILED job's error says failed, wherever in it the sign is: out of memory (and which), CUDA
    unavailable; None for any other failure."""
    for kind, memory, pattern in _FAILURE_KINDS:
        if message and pattern.search(message):
            return kind, memory
    return None


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
