"""The worker process's own end: it exits once the run's deadline has passed, job or no job.

runpod's loop polls for jobs until the platform stops the worker, and an idle worker is billed like a
busy one. The control plane deletes the endpoint when the run ends, but a control plane that died (or a
job that never arrived) must not leave a GPU billed past the run's deadline: the worker stops itself.

The deadline comes from `LORAFLOW_RUN_DEADLINE_EPOCH_S` in the endpoint's environment, and from each
job's `deadline_epoch_s`. A job still running at the deadline is stopped by the supervisor (it kills the
training process `DEADLINE_KILL_GRACE_S` after it); the worker waits until runpod has posted that job's
result, then exits.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Callable

from loraflow_worker.runtime.supervisor import DEADLINE_KILL_GRACE_S, TERM_GRACE_S

DEADLINE_ENV = "LORAFLOW_RUN_DEADLINE_EPOCH_S"
"""Unix time at which the worker exits; set in the endpoint's environment by the control plane."""
RESULT_GRACE_S = DEADLINE_KILL_GRACE_S + TERM_GRACE_S + 60.0
"""How long past the deadline a busy worker waits for its job to end and its result to be posted."""

log = logging.getLogger("loraflow_worker")


class WorkerLifetime:
    """Watches the deadline in a daemon thread and calls `exit(0)` once it has passed and no job is in
    progress (or `RESULT_GRACE_S` later in any case)."""

    def __init__(self, deadline_epoch_s: float | None, *, busy: Callable[[], bool],
                 exit: Callable[[int], None] | None = None, poll_s: float = 1.0):
        self.deadline_epoch_s = deadline_epoch_s
        self.busy = busy
        self.exit = exit or _exit_now
        self.poll_s = poll_s
        self._thread: threading.Thread | None = None

    @classmethod
    def from_env(cls) -> WorkerLifetime:
        """The lifetime of a runpod worker: deadline from the environment, busy while runpod tracks a job."""
        from runpod.serverless.modules.worker_state import JobsProgress

        value = os.environ.get(DEADLINE_ENV)
        # JobsProgress holds a job from its arrival until its result has been posted.
        return cls(float(value) if value else None, busy=lambda: JobsProgress().get_job_count() > 0)

    def use_deadline(self, deadline_epoch_s: float | None) -> None:
        """A job arrived with the run's deadline: that is the one that counts."""
        if deadline_epoch_s is not None:
            self.deadline_epoch_s = deadline_epoch_s

    def start(self) -> None:
        """Start watching; returns at once."""
        self._thread = threading.Thread(target=self._watch, name="loraflow-lifetime", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while True:
            time.sleep(self.poll_s)
            deadline = self.deadline_epoch_s
            now = time.time()
            if deadline is None or now < deadline:
                continue
            if self.busy() and now < deadline + RESULT_GRACE_S:
                continue
            log.warning("the run's deadline (%s) has passed: the worker exits so that it is no longer billed", deadline)
            self.exit(0)
            return


def exit_at_once_when_stopped_idle(exit: Callable[[int], None] | None = None) -> None:
    """Make runpod's worker loop exit at once when the platform stops it (SIGTERM) with no job taken or running.

    runpod's own shutdown only sets an event that its loops read after their current waits, each up to a second
    (the job-take loop's while a job runs, the stop-signal loop's between polls), then leaves Python to unwind its
    imports: 1-2 s in which the stopped worker is still billed, after every run's endpoint delete. An idle worker
    has nothing to finish (runpod counts a job from its arrival until its result has been posted), so it exits
    now; a worker with a job keeps runpod's shutdown, which lets the job end and posts its result. Call before
    `runpod.serverless.start`, whose worker loop makes its `JobScaler` then."""
    from runpod.serverless.modules import rp_scale

    exit_now = exit or _exit_now

    class StopsAtOnceWhenIdle(rp_scale.JobScaler):
        def handle_shutdown(self, signum: int, frame: object) -> None:
            if self.current_occupancy() == 0:
                log.info("stopped (signal %d) with no job: the worker exits at once", signum)
                exit_now(0)
                return
            super().handle_shutdown(signum, frame)

    # runpod's worker loop reads the class from its module when it starts (`rp_scale.JobScaler(config)`).
    rp_scale.JobScaler = StopsAtOnceWhenIdle


def _exit_now(code: int) -> None:
    # runpod's heartbeat pinger is a daemon multiprocessing child; os._exit skips the atexit hook that
    # would stop it, and a pinger left running would tell RunPod the worker is still alive.
    for child in multiprocessing.active_children():
        child.kill()
        child.join(timeout=5)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):  # runpod logs with print(): its last lines must reach the log
        stream.flush()
    os._exit(code)
