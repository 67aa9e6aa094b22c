"""Worker processes: start them when an endpoint has work, stop them when idle, deleted or over
time, and notice when they die.

`WorkerSupervisor.run` is the app's one background task (started by the lifespan, not at import).
Each pass reads `LocalpodState` and acts on processes; routes never touch processes themselves.
Workers run in their own process group, so a stop reaches the children a worker forks (runpod's
heartbeat process) too.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import secrets
import shutil
import signal
import subprocess
import time

import httpx

from localpod.state import EndpointRecord, JobRecord, LocalpodState, WorkerRecord, new_id

log = logging.getLogger("localpod.workers")

_LOG_TAIL_BYTES = 2048
_WEBHOOK_TIMEOUT = httpx.Timeout(10.0, connect=5.0)
_GPU_NAME = "localpod-cpu"  # RunPod puts the worker's GPU name in its protocol URLs' `gpu` query


class WorkerSupervisor:
    """Keeps each endpoint's worker processes matched to its queue, within `workers.min`/`max`."""

    def __init__(self, state: LocalpodState) -> None:
        self.state = state
        self.config = state.config
        self._webhook_tasks: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        """Supervise until cancelled (the app's lifespan cancels it at shutdown)."""
        while True:
            try:
                self.tick()
            except Exception:  # one bad pass must not end supervision for the whole server
                log.exception("supervisor pass failed")
            await asyncio.sleep(self.config.tick_s)

    def tick(self) -> None:
        """One pass; returns quickly and is safe to call at any time."""
        now = time.time()
        self._reap()
        self._enforce_deadlines(now)
        self._fire_worker_faults(now)
        self._stop_idle(now)
        self._signal_stopping(now)
        for endpoint in self.state.live_endpoints():
            self._scale(endpoint, now)
        self._send_webhooks()

    async def shutdown(self) -> None:
        """Stop every worker: SIGTERM, then SIGKILL after the grace; wait until all are reaped."""
        for worker in self.state.live_workers():
            self.state.request_stop(worker, "server shutdown")
        deadline = time.time() + self.config.kill_grace_s + 5
        while self.state.live_workers() and time.time() < deadline:
            self._signal_stopping(time.time())
            self._reap()
            await asyncio.sleep(0.05)
        for worker in self.state.live_workers():  # only a process that ignores SIGKILL gets here
            log.error("worker %s (pid %s) did not exit", worker.id, worker.process and worker.process.pid)
        for task in self._webhook_tasks:
            task.cancel()

    # --- one pass --------------------------------------------------------------------------------

    def _reap(self) -> None:
        for worker in self.state.live_workers():
            if worker.process is None or (code := worker.process.poll()) is None:
                continue
            expected = worker.stopping
            # Its children go with it: runpod's heartbeat process outlives a worker that died abruptly.
            _signal_group(worker.process, signal.SIGKILL)
            self.state.worker_ended(worker, code, _log_tail(worker))
            shutil.rmtree(self.config.log_dir / "disks" / worker.id, ignore_errors=True)  # the container's disk goes with it
            log.info("worker %s exited with code %s (%s)", worker.id, code, worker.stop_reason or "unexpected")
            endpoint = self.state.live_endpoint(worker.endpoint_id)
            if endpoint is not None and not expected:  # a crash loop must not spin at the tick rate
                endpoint.spawn_not_before = time.time() + self.config.respawn_delay_s

    def _enforce_deadlines(self, now: float) -> None:
        for job in list(self.state.active_jobs.values()):
            worker = self.state.workers.get(job.worker_id) if job.worker_id else None
            if now - job.created_at >= job.ttl_ms / 1000:
                self.state.expire_job(job)
                reason = "job past its TTL"
            elif (
                job.status == "IN_PROGRESS"
                and job.started_at is not None
                and job.execution_timeout_ms
                and now - job.started_at >= job.execution_timeout_ms / 1000
            ):
                self.state.finish_job(
                    job, "TIMED_OUT", error=f"execution timeout of {job.execution_timeout_ms} ms exceeded"
                )
                reason = "job timed out"
            else:
                continue
            # A synchronous handler cannot be cancelled through job-stop: only ending the process frees it.
            if worker is not None and worker.live:
                self.state.request_stop(worker, reason)

    def _stop_idle(self, now: float) -> None:
        for endpoint in self.state.live_endpoints():
            running = [w for w in self.state.live_workers(endpoint.id) if not w.stopping]
            spare = len(running) - endpoint.workers_min
            for worker in running:
                if spare <= 0:
                    break
                if (
                    worker.process is not None
                    and worker.job_id is None
                    and worker.idle_since is not None
                    and now - worker.idle_since > endpoint.idle_timeout_s
                ):
                    self.state.request_stop(worker, "idle timeout")
                    spare -= 1

    def _signal_stopping(self, now: float) -> None:
        for worker in self.state.live_workers():
            if not worker.stopping or worker.process is None:
                continue
            if worker.signalled_at is None:
                log.info("stopping worker %s: %s", worker.id, worker.stop_reason)
                _signal_group(worker.process, signal.SIGTERM)
                if worker.suspended:  # a stopped process keeps a SIGTERM pending until it runs again
                    _signal_tree(worker.process, signal.SIGCONT)
                worker.signalled_at = now
            elif not worker.killed and now - worker.signalled_at >= self.config.kill_grace_s:
                _signal_group(worker.process, signal.SIGKILL)
                worker.killed = True

    def _fire_worker_faults(self, now: float) -> None:
        """Fire each armed worker fault once its job has sent a progress update or run its `after_s`."""
        for job in list(self.state.active_jobs.values()):
            armed = job.fault
            worker = self.state.workers.get(job.worker_id) if job.worker_id else None
            if armed is None or worker is None or worker.process is None or job.started_at is None:
                continue
            if armed.removed:
                job.fault = None
                continue
            after_s = armed.rule.after_s
            if (job.progress_updates == 0) if after_s is None else (now - job.started_at < after_s):
                continue
            job.fault = None
            self.state.faults.fired(armed)
            log.info("injecting worker %s on worker %s, job %s", armed.rule.action, worker.id, job.id)
            self._inject(armed.rule.action, worker, job, now)

    def _inject(self, action: str, worker: WorkerRecord, job: JobRecord, now: float) -> None:
        assert worker.process is not None
        if action == "crash":  # the reaper then fails the job: the worker exited without a result
            _signal_group(worker.process, signal.SIGKILL)
        elif action == "hang":
            # A hung container freezes every process in it, the worker's own children in other sessions too.
            _signal_tree(worker.process, signal.SIGSTOP)
            worker.suspended = True
        elif action == "preempt":
            self.state.requeue_job(job)
            # An expected end: a new worker may start for the requeued job at once.
            worker.stop_reason, worker.signalled_at, worker.killed = "preempted", now, True
            _signal_group(worker.process, signal.SIGKILL)

    def _scale(self, endpoint: EndpointRecord, now: float) -> None:
        if now < endpoint.spawn_not_before or not self.state.faults.placeable(endpoint.spec):
            return
        live = self.state.live_workers(endpoint.id)
        up = [w for w in live if not w.stopping]
        free = [w for w in up if w.job_id is None]
        wanted = max(len(endpoint.queue) - len(free), endpoint.workers_min - len(up))
        for _ in range(min(wanted, endpoint.workers_max - len(live))):
            if not self._spawn(endpoint):
                return

    def _spawn(self, endpoint: EndpointRecord) -> bool:
        worker_id, token = _new_worker_id(self.state), secrets.token_urlsafe(24)
        log_path = self.config.log_dir / f"{endpoint.id}-{worker_id}.log"
        # Each RunPod worker is its own container with its own disk: give each local worker its own
        # folder (cwd and TMPDIR), or two workers on this machine would share scratch files.
        disk = self.config.log_dir / "disks" / worker_id
        disk.mkdir(parents=True, exist_ok=True)
        command = self.config.worker_command
        try:
            with open(log_path, "ab") as log_file:
                process = subprocess.Popen(
                    command,
                    env=self._worker_env(endpoint, worker_id, token) | {"TMPDIR": str(disk)},
                    cwd=disk,
                    stdin=subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=_die_with_parent,
                )
        except OSError as e:
            # A broken worker command would leave jobs queued forever: fail them with the reason.
            endpoint.spawn_not_before = time.time() + self.config.respawn_delay_s
            for job_id in list(endpoint.queue):
                self.state.finish_job(self.state.jobs[job_id], "FAILED", error=f"could not start worker {command}: {e}")
            log.error("could not start worker %s: %s", command, e)
            return False
        self.state.add_worker(endpoint.id, process, worker_id=worker_id, token=token, log_path=log_path)
        log.info("started worker %s (pid %s) for endpoint %s, log %s", worker_id, process.pid, endpoint.id, log_path)
        return True

    def _worker_env(self, endpoint: EndpointRecord, worker_id: str, token: str) -> dict[str, str]:
        base = f"{self.config.base_url}/v2/{endpoint.id}"
        # runpod 1.12 appends `&job_in_progress=…` / `&isStream=…` to these URLs, so each needs a `?`.
        return {
            **os.environ,
            **endpoint.spec.get("env", {}),
            **self.state.faults.spawn_env(endpoint.spec["name"]),
            "RUNPOD_WEBHOOK_GET_JOB": f"{base}/job-take/$ID?gpu={_GPU_NAME}",
            "RUNPOD_WEBHOOK_POST_OUTPUT": f"{base}/job-done/$RUNPOD_POD_ID/$ID?gpu={_GPU_NAME}",
            "RUNPOD_WEBHOOK_POST_STREAM": f"{base}/job-stream/$RUNPOD_POD_ID/$ID?gpu={_GPU_NAME}",
            "RUNPOD_WEBHOOK_PING": f"{base}/ping/$RUNPOD_POD_ID?gpu={_GPU_NAME}",
            "RUNPOD_POD_ID": worker_id,
            "RUNPOD_POD_HOSTNAME": f"localpod-{worker_id}",
            "RUNPOD_AI_API_KEY": token,
            "RUNPOD_ENDPOINT_ID": endpoint.id,
            "RUNPOD_PING_INTERVAL": str(self.config.ping_interval_ms),
            # Offline, the start-up fitness check (a TCP connect to a public DNS server) kills the worker.
            "RUNPOD_SKIP_AUTO_SYSTEM_CHECKS": "true",
            "RUNPOD_SKIP_GPU_CHECK": "true",
            # Unbuffered, so the log tail quoted when a worker dies holds its last words.
            "PYTHONUNBUFFERED": "1",
        }

    def _send_webhooks(self) -> None:
        due, self.state.webhooks_due = self.state.webhooks_due, []
        for job in due:
            payload = self.state.job_status(job).model_dump(mode="json", by_alias=True, exclude_none=True)
            task = asyncio.get_running_loop().create_task(_post_webhook(job.webhook or "", payload))
            self._webhook_tasks.add(task)
            task.add_done_callback(self._webhook_tasks.discard)


async def _post_webhook(url: str, payload: dict[str, object]) -> None:
    try:
        async with httpx.AsyncClient(timeout=_WEBHOOK_TIMEOUT) as client:
            (await client.post(url, json=payload)).raise_for_status()
    except httpx.HTTPError as e:
        log.warning("webhook %s for job %s failed: %s", url, payload.get("id"), e)


def _new_worker_id(state: LocalpodState) -> str:
    worker_id = new_id()
    while worker_id in state.workers:
        worker_id = new_id()
    return worker_id


def _signal_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)  # start_new_session made the worker its group's leader


def _signal_tree(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    """Signal the worker's process group and every descendant, wherever its session."""
    _signal_group(process, sig)
    for pid in _descendants(process.pid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])  # the name field may hold spaces and ')'
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, stack = [], [root]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def _log_tail(worker: WorkerRecord) -> str:
    if worker.log_path is None or not worker.log_path.exists():
        return ""
    with open(worker.log_path, "rb") as f:
        f.seek(max(0, worker.log_path.stat().st_size - _LOG_TAIL_BYTES))
        return f.read().decode("utf-8", errors="replace")


_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_libc = ctypes.CDLL(None, use_errno=True) if os.uname().sysname == "Linux" else None


def _die_with_parent() -> None:
    """Runs in the child before exec: a worker must not outlive a localpod killed with SIGKILL."""
    if _libc is not None:
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
