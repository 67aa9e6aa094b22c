"""The in-memory account of one localpod server: its endpoints, jobs, workers and secrets (`records.py`), and
every change of their states.

One `LocalpodState` is built per app by `create_app`; routes and the worker supervisor run on the
same event loop and change it without locks. Nothing here touches processes or sockets: the
supervisor (`localpod.workers`) acts on what this records (a stop request, a queued job).
"""

from __future__ import annotations

import subprocess
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fastapi import Request

from localpod.billing import StorageClock
from localpod.faults.book import FaultBook
from localpod.models import (
    Account,
    AccountEndpoint,
    AccountJob,
    AccountWorker,
    Health,
    HealthJobs,
    HealthWorkers,
    JobStatus,
    LocalpodConfig,
    RunRequest,
)
from localpod.schema import OpenApiSchemas
from localpod.state.records import EndpointRecord, JobRecord, SecretRecord, WorkerRecord, new_id
from localpod.volumes import VolumeBook


class LocalpodState:
    """Everything one server knows. Methods state the transitions; callers hold no other copy."""

    def __init__(self, config: LocalpodConfig, schemas: OpenApiSchemas) -> None:
        self.config = config
        self.schemas = schemas
        self.endpoints: dict[str, EndpointRecord] = {}
        self.jobs: dict[str, JobRecord] = {}
        self.active_jobs: dict[str, JobRecord] = {}
        self.workers: dict[str, WorkerRecord] = {}
        self.secrets: dict[str, SecretRecord] = {}
        self.peak_live_endpoints = 0
        self.peak_workers_max = 0
        self.webhooks_due: list[JobRecord] = []
        self.faults = FaultBook()
        self.storage_clock = StorageClock()
        """The time network volumes are billed by (`/_localpod/clock` moves it forward)."""
        self.volumes = VolumeBook(config, self.faults, self.storage_clock)
        self.closing = False
        """Set when the server starts to shut down: held worker requests then return at once."""

    # --- endpoints -------------------------------------------------------------------------------

    def live_endpoints(self) -> list[EndpointRecord]:
        return [e for e in self.endpoints.values() if e.live]

    def live_endpoint(self, endpoint_id: str) -> EndpointRecord | None:
        endpoint = self.endpoints.get(endpoint_id)
        return endpoint if endpoint is not None and endpoint.live else None

    def workers_max_total(self, excluding: str | None = None) -> int:
        return sum(e.workers_max for e in self.live_endpoints() if e.id != excluding)

    def add_endpoint(self, spec: dict[str, Any]) -> EndpointRecord:
        endpoint = EndpointRecord(id=new_id(), spec=spec, created_at=time.time())
        self.endpoints[endpoint.id] = endpoint
        self.note_peaks()
        return endpoint

    def note_peaks(self) -> None:
        self.peak_live_endpoints = max(self.peak_live_endpoints, len(self.live_endpoints()))
        self.peak_workers_max = max(self.peak_workers_max, self.workers_max_total())

    def delete_endpoint(self, endpoint: EndpointRecord) -> None:
        """Gone at once for the API; its open jobs end CANCELLED and its workers are asked to stop."""
        endpoint.deleted_at = time.time()
        for job in [j for j in self.active_jobs.values() if j.endpoint_id == endpoint.id]:
            self.finish_job(job, "CANCELLED", error="endpoint deleted")
        for worker in self.live_workers(endpoint.id):
            self.request_stop(worker, "endpoint deleted")

    # --- jobs ------------------------------------------------------------------------------------

    def submit_job(self, endpoint: EndpointRecord, request: RunRequest) -> JobRecord:
        policy = request.policy
        job = JobRecord(
            id=f"{uuid.uuid4()}-u1",  # RunPod job ids: a UUID with a region suffix
            endpoint_id=endpoint.id,
            input=request.input,
            created_at=time.time(),
            ttl_ms=policy.ttl if policy and policy.ttl else self.config.default_ttl_ms,
            execution_timeout_ms=policy.execution_timeout if policy else None,
            webhook=request.webhook,
        )
        self.jobs[job.id] = job
        self.active_jobs[job.id] = job
        endpoint.queue.append(job.id)
        return job

    def visible_job(self, endpoint_id: str, job_id: str) -> JobRecord | None:
        """The job as the job API sees it: None when unknown, on another endpoint, or expired."""
        job = self.jobs.get(job_id)
        return job if job is not None and job.endpoint_id == endpoint_id and not job.expired else None

    def take_job(self, worker: WorkerRecord) -> JobRecord | None:
        endpoint = self.live_endpoint(worker.endpoint_id)
        if endpoint is None or not endpoint.queue:
            return None
        job = self.jobs[endpoint.queue.popleft()]
        now = time.time()
        job.status, job.started_at, job.worker_id = "IN_PROGRESS", now, worker.id
        if job.execution_timeout_ms is None:
            job.execution_timeout_ms = int(endpoint.spec["timeout"])
        worker.job_id, worker.idle_since = job.id, None
        if worker.process is not None:  # only a process localpod started can be signalled
            job.fault = self.faults.arm_job_fault(endpoint.spec["name"])
        return job

    def record_progress(self, job: JobRecord, output: Any) -> None:
        # A progress post can race the final result (it is sent from another thread): ignore it late.
        if not job.terminal:
            job.output = output
            job.progress_updates += 1

    def finish_job(self, job: JobRecord, status: str, *, output: Any = None, error: str | None = None) -> None:
        """Move a job to a final status; a job already final keeps its first outcome."""
        if job.terminal:
            return
        if job.status == "IN_QUEUE":
            self.endpoints[job.endpoint_id].queue.remove(job.id)
        job.status, job.finished_at, job.error = status, time.time(), error
        if output is not None:
            job.output = output
        self.active_jobs.pop(job.id, None)
        if job.fault is not None:  # it ended before its fault fired: the next job gets the fault
            self.faults.disarm(job.fault)
            job.fault = None
        worker = self.workers.get(job.worker_id) if job.worker_id else None
        if worker is not None and worker.job_id == job.id:
            if status in ("CANCELLED", "TIMED_OUT") or job.expired:
                worker.pending_stops[job.id] = float("-inf")
            else:
                self.release_worker(worker)
        if job.webhook:
            self.webhooks_due.append(job)

    def retry_job(self, job: JobRecord) -> None:
        """Queue a failed job again under the same id; its TTL still counts from the first submission."""
        job.status, job.started_at, job.finished_at, job.worker_id = "IN_QUEUE", None, None, None
        job.output, job.error, job.stream = None, None, []
        job.retries += 1
        self.active_jobs[job.id] = job
        self.endpoints[job.endpoint_id].queue.append(job.id)

    def requeue_job(self, job: JobRecord) -> None:
        """A preempted job, or a dead worker's: IN_QUEUE again, first in line, for a new worker (its worker is being
        killed, or is gone)."""
        worker = self.workers.get(job.worker_id) if job.worker_id else None
        if worker is not None and worker.job_id == job.id:
            worker.job_id = None
        if job.fault is not None:  # its worker died before the fault fired: the next job gets the fault
            self.faults.disarm(job.fault)
        job.status, job.started_at, job.worker_id, job.output, job.stream = "IN_QUEUE", None, None, None, []
        job.progress_updates, job.fault = 0, None
        self.endpoints[job.endpoint_id].queue.appendleft(job.id)

    def expire_job(self, job: JobRecord) -> None:
        """Past its TTL RunPod deletes a job, even a running one: `/status` answers 404 from now on."""
        job.expired = True
        self.finish_job(job, "FAILED", error=f"job deleted: older than its TTL of {job.ttl_ms} ms")

    def job_status(self, job: JobRecord) -> JobStatus:
        now = time.time()
        started = job.started_at or job.finished_at or now
        return JobStatus(
            id=job.id,
            status=job.status,  # type: ignore[arg-type]
            delay_time=round((started - job.created_at) * 1000),
            execution_time=round(((job.finished_at or now) - job.started_at) * 1000) if job.started_at else 0,
            worker_id=job.worker_id,
            output=job.output,
            error=job.error,
        )

    def release_worker(self, worker: WorkerRecord) -> None:
        """The worker is free: it holds no job and has nothing left to stop."""
        worker.job_id, worker.idle_since = None, time.time()
        worker.pending_stops.clear()

    def workers_wanted(self, endpoint: EndpointRecord) -> int:
        """Workers to start now for this endpoint: one per queued job no free worker can take, and up to
        `workers.min`, within `workers.max`."""
        live = self.live_workers(endpoint.id)
        up = [w for w in live if not w.stopping]
        free = [w for w in up if w.job_id is None]
        wanted = max(len(endpoint.queue) - len(free), endpoint.workers_min - len(up))
        return max(0, min(wanted, endpoint.workers_max - len(live)))

    def throttled_workers(self, endpoint: EndpointRecord) -> int:
        """RunPod's "throttled": workers wanted but not started, since no datacenter the endpoint allows has stock
        of its GPUs on hosts that meet its CUDA need. `/health` and the workers list both report it."""
        wanted = self.workers_wanted(endpoint)
        return wanted if wanted and not self.faults.placeable(endpoint.spec) else 0

    def health(self, endpoint_id: str) -> Health:
        jobs = [j for j in self.jobs.values() if j.endpoint_id == endpoint_id and not j.expired]
        workers = self.live_workers(endpoint_id)
        throttled = self.throttled_workers(self.endpoints[endpoint_id])
        idle = sum(1 for w in workers if w.contacted and not w.stopping and w.job_id is None)

        def count(*statuses: str) -> int:
            return sum(1 for j in jobs if j.status in statuses)

        return Health(
            jobs=HealthJobs(
                completed=count("COMPLETED"),
                failed=count("FAILED", "TIMED_OUT"),
                in_progress=count("IN_PROGRESS"),
                in_queue=count("IN_QUEUE"),
                retried=sum(1 for j in jobs if j.retries),
            ),
            workers=HealthWorkers(
                idle=idle,
                initializing=sum(1 for w in workers if not w.contacted and not w.stopping),
                ready=idle,
                running=sum(1 for w in workers if w.job_id is not None),
                throttled=throttled,
                unhealthy=sum(1 for w in workers if w.unhealthy),
            ),
        )

    # --- workers ---------------------------------------------------------------------------------

    def add_worker(
        self,
        endpoint_id: str,
        process: subprocess.Popen[bytes] | None,
        *,
        worker_id: str | None = None,
        token: str = "",
        log_path: Path | None = None,
    ) -> WorkerRecord:
        worker = WorkerRecord(
            id=worker_id or new_id(),
            endpoint_id=endpoint_id,
            token=token,
            started_at=time.time(),
            process=process,
            endpoint_version=self.endpoints[endpoint_id].version,
            log_path=log_path,
        )
        self.workers[worker.id] = worker
        return worker

    def live_workers(self, endpoint_id: str | None = None) -> list[WorkerRecord]:
        return [w for w in self.workers.values() if w.live and endpoint_id in (None, w.endpoint_id)]

    def note_contact(self, worker: WorkerRecord) -> None:
        if not worker.contacted:
            worker.contacted, worker.idle_since = True, time.time()

    def request_stop(self, worker: WorkerRecord, reason: str) -> None:
        if worker.stop_reason is None:
            worker.stop_reason = reason
        if worker.process is None:  # not ours to signal: count it gone; its next calls get nothing
            self.worker_ended(worker, None, "")

    def worker_ended(self, worker: WorkerRecord, exit_code: int | None, log_tail: str) -> None:
        """Record a worker's end. A job it still held can get no result from it any more: it goes back to the
        queue for another worker, or FAILS, as `dead_worker_jobs` says."""
        worker.ended_at, worker.exit_code = time.time(), exit_code
        job = self.jobs.get(worker.job_id) if worker.job_id else None
        if job is not None and not job.terminal:
            if (worker.dead_worker_jobs or self.config.dead_worker_jobs) == "requeue":
                self.requeue_job(job)
                job.retries += 1  # `/health` counts it under jobs.retried
            else:
                self.finish_job(
                    job,
                    "FAILED",
                    error=f"worker {worker.id} exited with code {exit_code} without a result; "
                    f"last lines of its log:\n{log_tail}",
                )
        worker.job_id = None

    # --- account ---------------------------------------------------------------------------------

    def account(self) -> Account:
        now = time.time()

        def endpoint_row(e: EndpointRecord) -> AccountEndpoint:
            end = e.deleted_at or now
            return AccountEndpoint(
                id=e.id,
                name=e.spec["name"],
                workers_max=e.workers_max,
                created_at=_utc(e.created_at),
                age_seconds=end - e.created_at,
                deleted_at=_utc(e.deleted_at) if e.deleted_at else None,
            )

        return Account(
            worker_quota=self.config.worker_quota,
            live_endpoints=[endpoint_row(e) for e in self.live_endpoints()],
            endpoints=[endpoint_row(e) for e in self.endpoints.values()],
            peak_live_endpoints=self.peak_live_endpoints,
            peak_workers_max=self.peak_workers_max,
            billed_worker_seconds=sum(
                (w.ended_at or now) - w.started_at for w in self.workers.values() if w.process is not None
            ),
            workers_spawned=sum(1 for w in self.workers.values() if w.process is not None),
            out_of_stock_pools=self.faults.stock().out_of_stock,
            faults_injected=self.faults.counts(),
            workers=[
                AccountWorker(
                    id=w.id,
                    endpoint_id=w.endpoint_id,
                    pid=w.process.pid if w.process else None,
                    container=self.config.container_name(w.id) if w.process else None,
                    started_at=_utc(w.started_at),
                    ended_at=_utc(w.ended_at) if w.ended_at else None,
                    exit_code=w.exit_code,
                    log_path=str(w.log_path) if w.log_path else None,
                    placement=self.faults.placements.get(w.id),
                )
                for w in self.workers.values()
            ],
            jobs=[
                AccountJob(
                    id=j.id,
                    endpoint_id=j.endpoint_id,
                    status=j.status,  # type: ignore[arg-type]
                    created_at=_utc(j.created_at),
                    finished_at=_utc(j.finished_at) if j.finished_at else None,
                    worker_id=j.worker_id,
                    expired=j.expired,
                )
                for j in self.jobs.values()
            ],
        )


def get_state(request: Request) -> LocalpodState:
    """FastAPI dependency: the state of the app serving this request."""
    return request.app.state.localpod


def _utc(t: float) -> datetime:
    return datetime.fromtimestamp(t, UTC)
