"""Worker processes: start them when an endpoint has work, stop them when idle, deleted or over
time, and notice when they die.

`WorkerSupervisor.run` is the app's one background task (started by the lifespan, not at import).
Each pass reads `LocalpodState` and acts on processes; routes never touch processes themselves.
Workers run in their own process group, so a stop reaches the children a worker forks (runpod's
heartbeat process; the vLLM stand-in's server) too (`processes.py`). With the process runtime, an endpoint of
RunPod's vLLM worker image runs the image's local stand-in (`localpod/vllm_worker/`); every other endpoint runs
`worker_command`.

With the docker runtime each worker is a container of its endpoint's image, run by an attached
`docker run` client (`containers.py`) that is the worker's process: its exit is the container's exit, and a
SIGTERM sent to it reaches the container (the client's signal proxy). What a signal cannot reach is done by name
(`docker rm -f` after the grace, `docker kill` for a crash, `docker pause` for a hang), through Docker
commands started without waiting, so a pass never blocks the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx

from localpod.faults.rules import WorkerFaultRule
from localpod.routes.secrets import resolve_secret_references
from localpod.state.account import LocalpodState
from localpod.state.records import EndpointRecord, JobRecord, WorkerRecord, new_id
from localpod.vllm_worker import is_vllm_worker_image
from localpod.vllm_worker import worker_command as vllm_worker_command
from localpod.volumes import volume_env
from localpod.workers.containers import docker_run_command
from localpod.workers.processes import die_with_parent, log_tail, signal_group, signal_tree

# The package's name, not this module's: what logs and tests have always filtered the supervisor's lines by.
log = logging.getLogger("localpod.workers")

_WEBHOOK_TIMEOUT = httpx.Timeout(10.0, connect=5.0)
_GPU_NAME = "localpod-cpu"  # RunPod puts the worker's GPU name in its protocol URLs' `gpu` query
_DOCKER_RUN_FAILED = 125  # `docker run`'s own failure (no such image, a bad mount), not the container's exit
_DOCKER_TIMEOUT_S = 30  # a Docker command run to completion (only at shutdown)
REQUIRE_CUDA_ENV = "LORAFLOW_REQUIRE_CUDA"  # the control plane sets it to 1: the worker then refuses a CPU


class WorkerSupervisor:
    """Keeps each endpoint's worker processes matched to its queue, within `workers.min`/`max`."""

    def __init__(self, state: LocalpodState) -> None:
        self.state = state
        self.config = state.config
        self._webhook_tasks: set[asyncio.Task[None]] = set()
        self._docker_calls: list[subprocess.Popen[bytes]] = []
        self.instance = secrets.token_hex(6)
        """Labels this server's containers, so shutdown finds every one, even one whose client died early."""

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
        self._docker_calls = [call for call in self._docker_calls if call.poll() is None]
        self._reap()
        self._enforce_deadlines(now)
        self._fire_worker_faults(now)
        self._stop_idle(now)
        self._signal_stopping(now)
        for endpoint in self.state.live_endpoints():
            self._scale(endpoint, now)
        self._send_webhooks()

    async def shutdown(self) -> None:
        """Stop every worker: SIGTERM, then SIGKILL (docker: `docker rm -f`) after the grace; wait until
        all are reaped. With the docker runtime, then remove every container this server labelled."""
        for worker in self.state.live_workers():
            self.state.request_stop(worker, "server shutdown")
        deadline = time.time() + self.config.kill_grace_s + 5
        while self.state.live_workers() and time.time() < deadline:
            self._signal_stopping(time.time())
            self._reap()
            await asyncio.sleep(0.05)
        for worker in self.state.live_workers():  # only a process that ignores SIGKILL gets here
            log.error("worker %s (pid %s) did not exit", worker.id, worker.process and worker.process.pid)
        if self.config.worker_runtime == "docker":
            await asyncio.to_thread(self._remove_containers)
        for task in self._webhook_tasks:
            task.cancel()

    # --- one pass --------------------------------------------------------------------------------

    def _reap(self) -> None:
        for worker in self.state.live_workers():
            if worker.process is None or (code := worker.process.poll()) is None:
                continue
            expected = worker.stopping
            # Its children go with it: runpod's heartbeat process outlives a worker that died abruptly.
            signal_group(worker.process, signal.SIGKILL)
            container = self.config.container_name(worker.id)
            if container is not None:
                # `--rm` removes a container that ran; this also removes one its client created but died before
                # starting (a SIGTERM that came before the client could pass signals on).
                self._docker(["rm", "--force", container])
            tail = log_tail(worker)
            self.state.worker_ended(worker, code, tail)
            shutil.rmtree(self.config.log_dir / "disks" / worker.id, ignore_errors=True)  # the container's disk goes with it
            log.info("worker %s exited with code %s (%s)", worker.id, code, worker.stop_reason or "unexpected")
            endpoint = self.state.live_endpoint(worker.endpoint_id)
            if endpoint is not None and not expected:  # a crash loop must not spin at the tick rate
                endpoint.spawn_not_before = time.time() + self.config.respawn_delay_s
                if container is not None and code == _DOCKER_RUN_FAILED and not worker.contacted:
                    # Docker refused to run it (a missing image, a bad mount): no later try does better.
                    self._fail_queue(endpoint, f"could not start worker container {container} of image "
                                               f"{endpoint.spec.get('image')}: {tail.strip()}")

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
            container = self.config.container_name(worker.id)
            if worker.signalled_at is None:
                log.info("stopping worker %s: %s", worker.id, worker.stop_reason)
                # A docker client passes the SIGTERM on to its container (to a paused one too: the daemon
                # delivers it once the container runs again).
                signal_group(worker.process, signal.SIGTERM)
                if worker.suspended and container is None:  # a stopped process keeps a SIGTERM pending until it runs
                    signal_tree(worker.process, signal.SIGCONT)
                worker.signalled_at = now
            elif not worker.killed and now - worker.signalled_at >= self.config.kill_grace_s:
                if container is not None:  # a SIGKILL would end the client only, and leave the container running
                    self._docker(["rm", "--force", container], worker.log_path)
                else:
                    signal_group(worker.process, signal.SIGKILL)
                worker.killed = True

    def _fire_worker_faults(self, now: float) -> None:
        """Fire each armed worker fault once its job has run its `after_s`, reported its `at_step`, or (neither
        given) sent a progress update."""
        for job in list(self.state.active_jobs.values()):
            armed = job.fault
            worker = self.state.workers.get(job.worker_id) if job.worker_id else None
            if armed is None or worker is None or worker.process is None or job.started_at is None:
                continue
            if armed.removed:
                job.fault = None
                continue
            if not _fault_due(armed.rule, job, now):
                continue
            job.fault = None
            self.state.faults.fired(armed)
            log.info("injecting worker %s on worker %s, job %s", armed.rule.action, worker.id, job.id)
            self._inject(armed.rule, worker, job, now)

    def _inject(self, rule: WorkerFaultRule, worker: WorkerRecord, job: JobRecord, now: float) -> None:
        assert worker.process is not None
        container = self.config.container_name(worker.id)
        action = rule.action
        if action == "crash":  # the reaper then requeues or fails the job: the worker exited without a result
            worker.dead_worker_jobs = rule.dead_worker_jobs
            self._kill(worker, container)
        elif action == "hang":
            # A hung container freezes every process in it, the worker's own children in other sessions too.
            if container is not None:
                self._docker(["pause", container], worker.log_path)
            else:
                signal_tree(worker.process, signal.SIGSTOP)
            worker.suspended = True
        elif action == "preempt":
            self.state.requeue_job(job)
            # An expected end: a new worker may start for the requeued job at once.
            worker.stop_reason, worker.signalled_at, worker.killed = "preempted", now, True
            self._kill(worker, container)

    def _kill(self, worker: WorkerRecord, container: str | None) -> None:
        if container is not None:  # SIGKILL to the container (its client then exits 137)
            self._docker(["kill", container], worker.log_path)
        else:
            assert worker.process is not None
            signal_group(worker.process, signal.SIGKILL)

    def _scale(self, endpoint: EndpointRecord, now: float) -> None:
        if now < endpoint.spawn_not_before:
            return
        wanted = self.state.workers_wanted(endpoint)
        if not wanted:
            return
        # As on RunPod, jobs no worker can be placed for wait IN_QUEUE (throttled): say why once, not every pass.
        reason = self.state.faults.unplaceable_reason(endpoint.spec)
        if reason is not None and reason != endpoint.unplaceable_reason:
            log.warning("no worker can start for endpoint %s (%s): %s; its jobs stay IN_QUEUE", endpoint.id,
                        endpoint.spec["name"], reason)
        endpoint.unplaceable_reason = reason
        if reason is not None:
            return
        for _ in range(wanted):
            if not self._spawn(endpoint):
                return

    def _spawn(self, endpoint: EndpointRecord) -> bool:
        placement = self.state.faults.place(endpoint.spec)
        if placement is None:  # no datacenter it allows has stock on hosts it can use (`_scale` checks first)
            return False
        worker_id, token = _new_worker_id(self.state), secrets.token_urlsafe(24)
        log_path = self.config.log_dir / f"{endpoint.id}-{worker_id}.log"
        # Each RunPod worker is its own container with its own disk: give each local worker its own
        # folder (cwd and TMPDIR), or two workers on this machine would share scratch files.
        disk = self.config.log_dir / "disks" / worker_id
        disk.mkdir(parents=True, exist_ok=True)
        # RunPod tells each worker its datacenter in RUNPOD_DC_ID.
        worker_env = self.runpod_env(endpoint, worker_id, token) | {"TMPDIR": str(disk),
                                                                     "RUNPOD_DC_ID": placement.data_center_id}
        if self.config.worker_runtime == "docker":
            # A RunPod container gets only what RunPod gives it: the client passes these names on from its own
            # environment, which keeps the values off its command line (an endpoint's env may hold a token).
            command = docker_run_command(self.config, endpoint, worker_id, sorted(worker_env), disk, self.instance)
            # Found on this server's PATH: an endpoint's env may set its own PATH.
            command[0] = shutil.which(command[0]) or command[0]
            # A localpod killed outright: the client's SIGTERM reaches the container, whose worker then exits.
            preexec = functools.partial(die_with_parent, signal.SIGTERM)
        else:
            if is_vllm_worker_image(endpoint.spec.get("image")):
                # RunPod's official vLLM worker image: its local stand-in, whatever `worker_command` says (that command
                # stands in for loraflow's own worker image).
                command = vllm_worker_command(self.config.worker_python)
            else:
                assert self.config.worker_command is not None  # the config fills it in for the process runtime
                command = self.config.worker_command
            preexec = functools.partial(die_with_parent, signal.SIGKILL)
        try:
            with open(log_path, "ab") as log_file:
                process = subprocess.Popen(
                    command,
                    env=os.environ | worker_env,
                    cwd=disk,
                    stdin=subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=preexec,
                )
        except OSError as e:
            # A broken worker command would leave jobs queued forever: fail them with the reason.
            endpoint.spawn_not_before = time.time() + self.config.respawn_delay_s
            self._fail_queue(endpoint, f"could not start worker {command}: {e}")
            return False
        self.state.add_worker(endpoint.id, process, worker_id=worker_id, token=token, log_path=log_path)
        self.state.faults.placements[worker_id] = placement
        log.info("started worker %s (pid %s) for endpoint %s in %s, log %s", worker_id, process.pid, endpoint.id,
                 placement.data_center_id, log_path)
        return True

    def _fail_queue(self, endpoint: EndpointRecord, error: str) -> None:
        """No worker can start: fail the endpoint's queued jobs with the reason rather than keep them waiting."""
        for job_id in list(endpoint.queue):
            self.state.finish_job(self.state.jobs[job_id], "FAILED", error=error)
        log.error("%s", error)

    def runpod_env(self, endpoint: EndpointRecord, worker_id: str, token: str) -> dict[str, str]:
        """What RunPod gives a worker: the endpoint's env (and any env fault), and its worker variables.

        An endpoint's `LORAFLOW_REQUIRE_CUDA` is lifted (set to 0), and the log says so: localpod's workers run on
        this machine's CPU, where a worker that requires CUDA would refuse every job. An env fault may still set
        it (a test of the refusal itself)."""
        base = f"{self.config.base_url}/v2/{endpoint.id}"
        # RunPod replaces `{{ RUNPOD_SECRET_<name> }}` in the endpoint's env with the secret's value at boot.
        env, missing = resolve_secret_references(endpoint.spec.get("env", {}),
                                                 {s.name: s.value for s in self.state.secrets.values()})
        if missing:
            log.warning("endpoint %s refers to secrets the account does not have: %s", endpoint.id, ", ".join(missing))
        if env.get(REQUIRE_CUDA_ENV, "0") != "0":
            env[REQUIRE_CUDA_ENV] = "0"
            log.info("%s lifted for worker %s: localpod's workers run on this machine's CPU", REQUIRE_CUDA_ENV,
                     worker_id)
        # runpod 1.12 appends `&job_in_progress=…` / `&isStream=…` to these URLs, so each needs a `?`.
        return {
            **env, **volume_env(self.config, endpoint.spec),  # a process worker is told where its volume is
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

    def _docker(self, args: list[str], log_path: Path | None = None) -> None:
        """Start a Docker command without waiting for it (the next passes reap it); its output goes to the
        worker's log, or nowhere."""
        try:
            with open(log_path, "ab") if log_path is not None else open(os.devnull, "wb") as out:
                call = subprocess.Popen([*self.config.docker_command, *args], stdin=subprocess.DEVNULL, stdout=out,
                                        stderr=subprocess.STDOUT)
        except OSError as e:
            log.error("could not run %s: %s", [*self.config.docker_command, *args], e)
            return
        self._docker_calls.append(call)

    def _remove_containers(self) -> None:
        """Blocking, for shutdown: wait for the Docker commands under way, then remove every container this
        server started that is still there."""
        for call in self._docker_calls:
            with contextlib.suppress(subprocess.TimeoutExpired):
                call.wait(_DOCKER_TIMEOUT_S)
        docker = self.config.docker_command
        try:
            listed = subprocess.run(
                [*docker, "ps", "--all", "--quiet", "--filter", f"label=localpod.instance={self.instance}"],
                capture_output=True, text=True, timeout=_DOCKER_TIMEOUT_S, check=True,
            ).stdout.split()
            if listed:
                log.warning("removing %d leftover worker containers", len(listed))
                subprocess.run([*docker, "rm", "--force", *listed], capture_output=True, timeout=_DOCKER_TIMEOUT_S,
                               check=True)
        except (OSError, subprocess.SubprocessError) as e:
            log.error("could not remove the worker containers labelled localpod.instance=%s: %s", self.instance, e)


async def _post_webhook(url: str, payload: dict[str, object]) -> None:
    try:
        async with httpx.AsyncClient(timeout=_WEBHOOK_TIMEOUT) as client:
            (await client.post(url, json=payload)).raise_for_status()
    except httpx.HTTPError as e:
        log.warning("webhook %s for job %s failed: %s", url, payload.get("id"), e)


def _fault_due(rule: WorkerFaultRule, job: JobRecord, now: float) -> bool:
    """Whether a crash, hang or preempt armed for this running job fires now."""
    assert job.started_at is not None
    if rule.after_s is not None:
        return now - job.started_at >= rule.after_s
    if rule.at_step is not None:
        step = job.output.get("step") if isinstance(job.output, dict) else None
        return isinstance(step, int) and not isinstance(step, bool) and step >= rule.at_step
    return job.progress_updates > 0


def _new_worker_id(state: LocalpodState) -> str:
    worker_id = new_id()
    while worker_id in state.workers:
        worker_id = new_id()
    return worker_id
