"""Job API per endpoint: `/v2/{endpoint_id}/run`, `/runsync`, `/status/{job_id}`, `/cancel/{job_id}`,
`/retry/{job_id}`, `/stream/{job_id}`, `/health`, `/purge-queue` (RunPod serves these at
`https://api.runpod.ai/v2`)."""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse

from localpod.auth import require_api_key
from localpod.models import Health, JobRef, JobStatus, JobStream, PurgeQueueResult, RunRequest, StreamChunk
from localpod.problems import ProblemError
from localpod.routes.faults import route_fault
from localpod.state.account import LocalpodState, get_state
from localpod.state.records import EndpointRecord, JobRecord

router = APIRouter(prefix="/v2/{endpoint_id}", tags=["jobs"], dependencies=[Depends(require_api_key)])

_POLL_S = 0.05


@router.post("/run")
async def run_job(
    endpoint_id: str, body: RunRequest, request: Request, state: LocalpodState = Depends(get_state)
) -> JobRef:
    """Queue a job; a worker is started for it if the endpoint has room under `workers.max`.
    Not idempotent: posting twice queues two jobs (as on RunPod)."""
    fault = await route_fault(request, "run", endpoint_id=endpoint_id)
    job = state.submit_job(_endpoint(state, endpoint_id), body)
    fault.after_action()
    return JobRef(id=job.id, status="IN_QUEUE")


@router.post("/runsync", response_model_exclude_none=True)
async def run_job_sync(
    endpoint_id: str,
    body: RunRequest,
    request: Request,
    wait: int = Query(default=90_000, ge=1000, le=300_000, description="Milliseconds to wait for the result."),
    state: LocalpodState = Depends(get_state),
) -> JobStatus:
    """Queue a job and hold the request until it ends or `wait` ms pass; then answer its status.
    Route faults for `run` apply here too."""
    fault = await route_fault(request, "run", endpoint_id=endpoint_id)
    job = state.submit_job(_endpoint(state, endpoint_id), body)
    deadline = time.monotonic() + wait / 1000
    while not job.terminal and time.monotonic() < deadline and not state.closing:
        await asyncio.sleep(_POLL_S)
    fault.after_action()
    return state.job_status(job)


@router.get("/status/{job_id}", response_model=JobStatus, response_model_exclude_none=True)
async def get_job(
    endpoint_id: str, job_id: str, request: Request, state: LocalpodState = Depends(get_state)
) -> JobStatus | JSONResponse:
    fault = await route_fault(request, "status", endpoint_id=endpoint_id)
    status = state.job_status(_job(state, endpoint_id, job_id))
    fault.after_action()
    if fault.job_status is not None:  # an unknown_status fault: the real document, under a status JobStatus lacks
        document = status.model_dump(mode="json", by_alias=True, exclude_none=True)
        return JSONResponse({**document, "status": fault.job_status})
    return status


@router.post("/cancel/{job_id}")
async def cancel_job(
    endpoint_id: str, job_id: str, request: Request, state: LocalpodState = Depends(get_state)
) -> JobRef:
    """CANCELLED unless the job had already ended (then its final status is returned); a running
    job's worker is told through its job-stop channel."""
    fault = await route_fault(request, "cancel", endpoint_id=endpoint_id)
    job = _job(state, endpoint_id, job_id)
    state.finish_job(job, "CANCELLED")
    fault.after_action()
    return JobRef(id=job.id, status=job.status)  # type: ignore[arg-type]


@router.post("/retry/{job_id}")
async def retry_job(endpoint_id: str, job_id: str, state: LocalpodState = Depends(get_state)) -> JobRef:
    """Queue a FAILED or TIMED_OUT job again, same id and input."""
    job = _job(state, endpoint_id, job_id)
    if job.status not in ("FAILED", "TIMED_OUT"):
        raise ProblemError(400, f"job {job_id} is {job.status}; only FAILED or TIMED_OUT jobs can be retried")
    state.retry_job(job)
    return JobRef(id=job.id, status="IN_QUEUE")


@router.get("/stream/{job_id}")
async def stream_job(endpoint_id: str, job_id: str, state: LocalpodState = Depends(get_state)) -> JobStream:
    job = _job(state, endpoint_id, job_id)
    chunks, job.stream = job.stream, []
    stream = [StreamChunk(output=c) for c in chunks]
    return JobStream(id=job.id, status=job.status, stream=stream)  # type: ignore[arg-type]


@router.get("/health")
async def endpoint_health(endpoint_id: str, request: Request, state: LocalpodState = Depends(get_state)) -> Health:
    fault = await route_fault(request, "health", endpoint_id=endpoint_id)
    health = state.health(_endpoint(state, endpoint_id).id)
    fault.after_action()
    return health


@router.post("/purge-queue")
async def purge_queue(endpoint_id: str, state: LocalpodState = Depends(get_state)) -> PurgeQueueResult:
    """Remove every queued job (they end CANCELLED); running jobs are not touched."""
    endpoint = _endpoint(state, endpoint_id)
    queued = [state.jobs[job_id] for job_id in endpoint.queue]
    for job in queued:
        state.finish_job(job, "CANCELLED")
    return PurgeQueueResult(removed=len(queued))


def _endpoint(state: LocalpodState, endpoint_id: str) -> EndpointRecord:
    endpoint = state.live_endpoint(endpoint_id)
    if endpoint is None:
        raise ProblemError(404, f"endpoint {endpoint_id} not found")
    return endpoint


def _job(state: LocalpodState, endpoint_id: str, job_id: str) -> JobRecord:
    _endpoint(state, endpoint_id)
    job = state.visible_job(endpoint_id, job_id)
    if job is None:
        raise ProblemError(404, f"job {job_id} not found on endpoint {endpoint_id}")
    return job
