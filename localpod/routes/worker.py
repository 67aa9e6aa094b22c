"""The worker protocol that `runpod.serverless.start` (runpod 1.12) speaks, from the URLs localpod
puts in a worker's environment:

- `GET  /v2/{ep}/job-take/{worker}?gpu=…&job_in_progress=0|1` → 200 `{"id","input"}` or 204
- `GET  /v2/{ep}/job-stop/{worker}?gpu=…` → 200 `{"jobsToStop": [...]}` or 204
- `POST /v2/{ep}/job-done/{worker}/{job}?gpu=…&isStream=…` (JSON sent as form-urlencoded)
- `POST /v2/{ep}/job-stream/{worker}/{job}?gpu=…&isStream=…`
- `GET  /v2/{ep}/ping/{worker}?gpu=…&job_id=…&runpod_version=…[&status=unhealthy]`

Workers authenticate with their own key, sent raw (`Authorization: <key>`). A worker someone
started by hand with the account key is served too (registered on its first call).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse

from localpod.auth import keys_match, presented_key
from localpod.models import StopSignals, TakenJob
from localpod.problems import ProblemError
from localpod.state.account import LocalpodState, get_state
from localpod.state.records import JobRecord, WorkerRecord

router = APIRouter(prefix="/v2/{endpoint_id}", tags=["worker protocol"])

_POLL_S = 0.05
_RESEND_STOP_S = 1.0


@router.get("/job-take/{worker_id}")
async def take_job(
    endpoint_id: str, worker_id: str, request: Request, state: LocalpodState = Depends(get_state)
) -> Response:
    """Hand the worker the oldest queued job, holding the request open up to `long_poll_s`."""
    worker = _worker(state, request, endpoint_id, worker_id)
    state.note_contact(worker)
    if worker.job_id is not None and request.query_params.get("job_in_progress") != "1":
        _abandon_held_job(state, worker)
    deadline = time.monotonic() + state.config.long_poll_s
    while worker.live and not worker.stopping and not state.closing:
        job = state.take_job(worker)
        if job is not None:
            return JSONResponse(TakenJob(id=job.id, input=job.input).model_dump(mode="json", by_alias=True))
        if time.monotonic() >= deadline:
            break
        await asyncio.sleep(_POLL_S)
    return Response(status_code=204)


@router.get("/job-stop/{worker_id}")
async def stop_signals(
    endpoint_id: str, worker_id: str, request: Request, state: LocalpodState = Depends(get_state)
) -> Response:
    """Ids of jobs the worker must stop (cancelled or timed out), held open up to `long_poll_s`."""
    worker = _worker(state, request, endpoint_id, worker_id)
    deadline = time.monotonic() + state.config.long_poll_s
    while not (due := _due_stops(worker)) and worker.live and not worker.stopping and not state.closing:
        if time.monotonic() >= deadline:
            break
        await asyncio.sleep(_POLL_S)
    if not due:
        return Response(status_code=204)
    now = time.monotonic()
    worker.pending_stops.update(dict.fromkeys(due, now))
    return JSONResponse(StopSignals(jobs_to_stop=due).model_dump(mode="json", by_alias=True))


@router.post("/job-done/{worker_id}/{job_id}")
async def job_done(
    endpoint_id: str, worker_id: str, job_id: str, request: Request, state: LocalpodState = Depends(get_state)
) -> JSONResponse:
    """`{"output"}` → COMPLETED, `{"error"}` → FAILED, `{"status": "IN_PROGRESS", "output"}` → a
    progress update. A job that already ended keeps its outcome."""
    worker = _worker(state, request, endpoint_id, worker_id)
    job = _job(state, endpoint_id, job_id)
    payload = await _payload(request)
    if job.worker_id != worker.id:  # e.g. a preempted worker's last post about a job queued again since
        return JSONResponse({})
    if payload.get("status") == "IN_PROGRESS":
        state.record_progress(job, payload.get("output"))
        return JSONResponse({})
    if "error" in payload:
        error = payload["error"]
        error = error if isinstance(error, str) else json.dumps(error)
        state.finish_job(job, "FAILED", output=payload.get("output"), error=error)
    else:
        state.finish_job(job, "COMPLETED", output=payload.get("output"))
    if worker.job_id == job.id:  # e.g. a cancelled job whose handler ran to the end anyway
        state.release_worker(worker)
    if payload.get("stopPod"):  # the handler returned `refresh_worker`: RunPod replaces the worker
        state.request_stop(worker, "worker asked to be refreshed")
    return JSONResponse({})


@router.post("/job-stream/{worker_id}/{job_id}")
async def job_stream(
    endpoint_id: str, worker_id: str, job_id: str, request: Request, state: LocalpodState = Depends(get_state)
) -> JSONResponse:
    """One chunk a generator handler yielded; `/stream/{job_id}` hands it to the client."""
    worker = _worker(state, request, endpoint_id, worker_id)
    job = _job(state, endpoint_id, job_id)
    payload = await _payload(request)
    if not job.terminal and job.worker_id == worker.id and "output" in payload:
        job.stream.append(payload["output"])
    return JSONResponse({})


@router.api_route("/ping/{worker_id}", methods=["GET", "POST"])
async def ping(
    endpoint_id: str, worker_id: str, request: Request, state: LocalpodState = Depends(get_state)
) -> JSONResponse:
    worker = _worker(state, request, endpoint_id, worker_id)
    if request.query_params.get("status") == "unhealthy":  # a failed fitness check, sent just before exit
        worker.unhealthy = True
    return JSONResponse({})


def _worker(state: LocalpodState, request: Request, endpoint_id: str, worker_id: str) -> WorkerRecord:
    key = presented_key(request)
    worker = state.workers.get(worker_id)
    if worker is not None and worker.endpoint_id != endpoint_id:
        raise ProblemError(404, f"worker {worker_id} does not serve endpoint {endpoint_id}")
    own_key = worker is not None and worker.token and keys_match(key, worker.token)
    if not own_key and not keys_match(key, state.config.api_key):
        raise ProblemError(
            401,
            "invalid worker key (note: runpod 1.12 workers send ~/.runpod/config.toml's api_key instead of "
            "RUNPOD_AI_API_KEY when that file exists)",
        )
    if worker is not None:
        return worker
    if state.live_endpoint(endpoint_id) is None:
        raise ProblemError(404, f"endpoint {endpoint_id} not found")
    return state.add_worker(endpoint_id, None, worker_id=worker_id)


def _job(state: LocalpodState, endpoint_id: str, job_id: str) -> JobRecord:
    job = state.jobs.get(job_id)
    if job is None or job.endpoint_id != endpoint_id:
        raise ProblemError(404, f"job {job_id} not found on endpoint {endpoint_id}")
    return job


async def _payload(request: Request) -> dict[str, Any]:
    # runpod sends the JSON result with `Content-Type: application/x-www-form-urlencoded`: read it raw.
    try:
        payload = json.loads(await request.body())
    except ValueError as e:
        raise ProblemError(400, f"body is not JSON: {e}") from e
    if not isinstance(payload, dict):
        raise ProblemError(400, "body must be a JSON object")
    return payload


def _abandon_held_job(state: LocalpodState, worker: WorkerRecord) -> None:
    """The worker is free again: whatever it held is over, and a job it never reported has failed."""
    job = state.jobs[worker.job_id] if worker.job_id else None
    if job is not None and not job.terminal:
        state.finish_job(job, "FAILED", error=f"worker {worker.id} asked for a new job without reporting this one")
    state.release_worker(worker)


def _due_stops(worker: WorkerRecord) -> list[str]:
    """Stops never sent, or sent over `_RESEND_STOP_S` ago (a worker re-polls at once after a stop)."""
    now = time.monotonic()
    return [job_id for job_id, sent in worker.pending_stops.items() if now - sent >= _RESEND_STOP_S]
