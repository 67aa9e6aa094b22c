"""RunPod's OpenAI-compatible route of an endpoint, `/v2/{endpoint_id}/openai/v1/...` (RunPod serves it at
`https://api.runpod.ai/v2/<id>/openai/v1` with the account key as `Authorization: Bearer <key>`, for its vLLM worker:
`/chat/completions`, `/completions`, `/models`) [D serverless/vllm/openai-compatibility.mdx; serving.md §3].

A request becomes a job on the endpoint, `{"openai_route": "/v1/<path>", "openai_input": <the JSON body>}` (a GET,
`/v1/models`: the route alone, which the vLLM worker's handler proxies as a GET) [W src/handler.py], and is held until
the job ends, as `/runsync` holds one (`?wait=` ms, default 300000). Then:
- COMPLETED: the answer is the job's `output[0]`, 200 (the vLLM worker's handler yields the server's JSON once and
  returns the aggregated stream, so `output` is a list);
- FAILED with the vLLM worker's error, `vLLM returned HTTP <code>: <body>`: that status and that body, e.g. vLLM's 404
  `{"error": {"message": "The model `X` does not exist.", "type": "NotFoundError", ...}}` for an unknown model;
- another end (a worker error of its own, a timeout, a cancel): 500, `{"error": {...}}` naming it;
- still not ended after `wait`: 504 naming the job, which goes on (its `/status` says how it ends).
RunPod documents none of the failure answers (serving.md, "Unknown without a real key"): these are localpod's.

A body with `"stream": true` is answered as it is made: the vLLM worker yields the server's event stream as text
slices (serving.md §4), each a stream chunk of the job, and they are sent on as they arrive, one server-sent-events
body (`text/event-stream`), as an OpenAI client streaming from RunPod's route reads it. A job that fails before its
first chunk is answered as above (vLLM's 404 for an unknown model, ...); one that fails after it ends the stream with
an `error` event and `data: [DONE]`.
"""

from __future__ import annotations

import ast
import asyncio
import json
import re
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from localpod.auth import require_api_key
from localpod.models import RunRequest
from localpod.problems import ProblemError
from localpod.routes.faults import route_fault
from localpod.state.account import LocalpodState, get_state
from localpod.state.records import JobRecord

router = APIRouter(prefix="/v2/{endpoint_id}/openai", tags=["openai"], dependencies=[Depends(require_api_key)])

_POLL_S = 0.05
_VLLM_ANSWER = re.compile(r"vLLM returned HTTP (\d{3}): (.*)", re.S)
"""The vLLM worker's framing of a server answer ≥ 400 [W src/handler.py]."""


@router.api_route("/v1/{path:path}", methods=["GET", "POST"])
async def openai_request(
    endpoint_id: str,
    path: str,
    request: Request,
    wait: int = Query(default=300_000, ge=1000, le=3_600_000, description="Milliseconds to wait for the job's end."),
    state: LocalpodState = Depends(get_state),
) -> Response:
    fault = await route_fault(request, "run", endpoint_id=endpoint_id)  # the job API's route faults apply, as to /runsync
    endpoint = state.live_endpoint(endpoint_id)
    if endpoint is None:
        raise ProblemError(404, f"endpoint {endpoint_id} not found")
    job_input: dict[str, Any] = {"openai_route": f"/v1/{path}"}
    if request.method == "POST":
        try:
            body = json.loads(await request.body())
        except ValueError as e:
            return _error(400, "BadRequestError", f"the body is not JSON: {e}")
        if not isinstance(body, dict):
            return _error(400, "BadRequestError", "the body must be a JSON object")
        job_input["openai_input"] = body
    job = state.submit_job(endpoint, RunRequest(input=job_input))
    streaming = job_input.get("openai_input", {}).get("stream") is True
    deadline = time.monotonic() + wait / 1000
    while not job.terminal and not (streaming and job.stream) and time.monotonic() < deadline and not state.closing:
        await asyncio.sleep(_POLL_S)
    if streaming and job.stream:
        fault.after_action()
        return StreamingResponse(_relay(job, state), media_type="text/event-stream")
    fault.after_action()
    if not job.terminal:
        return _error(504, "Timeout", f"job {job.id} is still {job.status} after {wait} ms; it goes on: GET "
                      f"/v2/{endpoint_id}/status/{job.id} says how it ends")
    if job.status == "COMPLETED":
        output = job.output
        return JSONResponse(output[0] if isinstance(output, list) and output else output)
    return _failure(job)


async def _relay(job: JobRecord, state: LocalpodState) -> AsyncIterator[str]:
    """The job's stream chunks (the worker's event-stream text) as they arrive, until it ends."""
    while True:
        ended = job.terminal
        chunks, job.stream = job.stream, []
        for chunk in chunks:
            yield chunk if isinstance(chunk, str) else f"data: {json.dumps(chunk)}\n\n"
        if ended or state.closing:
            break
        await asyncio.sleep(_POLL_S)
    if job.status != "COMPLETED":
        error = {"message": f"job {job.id} ended {job.status}: {job.error or 'no error given'}",
                 "type": "worker_error", "code": 500}
        yield f"data: {json.dumps({'error': error})}\n\ndata: [DONE]\n\n"


def _failure(job: JobRecord) -> JSONResponse:
    """A job that ended otherwise than COMPLETED: vLLM's own status and body when the worker relayed them."""
    worker_error = _parsed(job.error)
    message = worker_error.get("message") if isinstance(worker_error, dict) else None
    if job.status == "FAILED" and isinstance(message, str) and (relayed := _VLLM_ANSWER.fullmatch(message)):
        status, body = int(relayed[1]), relayed[2]
        try:
            return JSONResponse(json.loads(body), status_code=status)
        except ValueError:
            return _error(status, "worker_error", body)
    if isinstance(worker_error, dict):
        return JSONResponse({"error": worker_error}, status_code=500)
    return _error(500, "worker_error", f"job {job.id} ended {job.status}: {job.error or 'no error given'}")


def _parsed(error: str | None) -> Any:
    """A job's `error` as the worker sent it: runpod-python sends `str()` of the yielded error dict (a Python repr), a
    hand-made worker may send JSON; anything else stays the string."""
    if not error:
        return None
    try:
        return json.loads(error)
    except ValueError:
        pass
    try:
        return ast.literal_eval(error)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return error


def _error(status: int, kind: str, message: str, param: str | None = None) -> JSONResponse:
    """An error in the OpenAI shape vLLM answers with."""
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                        status_code=status)
