"""The stand-in's RunPod handler: each job goes to the local OpenAI-compatible server (`serve.py`) over HTTP, in the
shapes RunPod's vLLM worker v2.24+ accepts and answers [W src/handler.py; serving.md §3].

A job's `input` is one of:
1. `{"openai_route": "/v1/...", "openai_input": {...}}`: what RunPod's `/openai/v1/...` route hands the worker; POSTed
   to that route; a route without a body (`/v1/models`) is a GET;
2. `{"route": "/v1/...", "body": {...}, "method"?}`: any route of the server (a body POSTs, none GETs);
3. `{"messages": [...] | "prompt": "...", "sampling_params": {...}, "stream"?}`: `/v1/chat/completions` (messages) or
   `/v1/completions` (prompt), `sampling_params` merged into the body (its `model` picks an adapter).
A body without `model` gets the served base name. The handler is an async generator and `main.py` starts the loop with
`return_aggregate_stream`, so a job's `output` is a list whose first item is the server's JSON answer; a body with
`"stream": true` is answered by the server with server-sent events, and the handler yields their text as it reads it
(`iter_any`: slices as they arrive, not aligned to events), each slice a stream chunk of the job (`/stream/<job>`,
and RunPod's OpenAI route) and an item of its `output` [W src/handler.py; serving.md §4].

A server answer ≥ 400 is yielded as `{"error": {"message": "vLLM returned HTTP <code>: <body>", "type":
"worker_error", "code": null}}`; runpod-python turns a yielded dict with `error` into a FAILED job whose `error` is
`str()` of the inner dict [P runpod/serverless/modules/rp_job.py]. localpod's OpenAI route reads the status and body
back from that message.
"""

from __future__ import annotations

import codecs
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

log = logging.getLogger("vllm_standin.handler")

CHAT, COMPLETIONS, MODELS = "/v1/chat/completions", "/v1/completions", "/v1/models"
TIMEOUT = aiohttp.ClientTimeout(total=float(os.environ.get("REQUEST_TIMEOUT", "3600")))  # the real default [W]

base_url = "http://127.0.0.1:8000"
"""The server's URL; `main.py` sets it to the port it chose."""
server_process: Any = None
"""The server process (`main.py` sets it): a job that finds it dead fails at once instead of waiting."""
_default_model: str | None = None


def request_of(job_input: dict[str, Any]) -> tuple[str, str, dict[str, Any] | None]:
    """(route, method, body) for a job's input, in the three shapes above."""
    if job_input.get("openai_input"):
        return job_input.get("openai_route") or CHAT, "POST", job_input["openai_input"]
    if job_input.get("openai_route"):
        return job_input["openai_route"], "GET", None
    if job_input.get("route"):
        body = job_input.get("body")
        return job_input["route"], (job_input.get("method") or ("POST" if body else "GET")).upper(), body
    messages, prompt = job_input.get("messages"), job_input.get("prompt")
    if messages is None and prompt is None:
        raise ValueError("Job input must contain one of: openai_input (+openai_route), route (+body), or "
                         "prompt/messages.")
    body = {**(job_input.get("sampling_params") or {}), "stream": bool(job_input.get("stream", False))}
    if messages is not None:
        return CHAT, "POST", body | {"messages": messages}
    return COMPLETIONS, "POST", body | {"prompt": prompt}


def worker_error(message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "worker_error", "code": None}}


async def handler(job: dict[str, Any]) -> AsyncIterator[Any]:
    try:
        route, method, body = request_of(job.get("input") or {})
    except ValueError as e:
        yield worker_error(str(e))
        return
    if server_process is not None and server_process.poll() is not None:
        yield worker_error("vLLM server process is not running; worker is unhealthy")
        return
    async with aiohttp.ClientSession(timeout=TIMEOUT, headers={"Content-Type": "application/json"}) as session:
        if method != "GET" and body is not None and "model" not in body:
            model = await default_model(session)
            if model:
                body = {**body, "model": model}
        try:
            async with session.request(method, f"{base_url}{route}", json=body) as response:
                if response.status >= 400:
                    detail = await response.text()
                    log.error("vLLM %s %s returned HTTP %s: %s", method, route, response.status, detail)
                    yield worker_error(f"vLLM returned HTTP {response.status}: {detail}")
                    return
                if "text/event-stream" in response.headers.get("Content-Type", ""):
                    text = codecs.getincrementaldecoder("utf-8")()  # a slice may end inside a character
                    async for data in response.content.iter_any():
                        if piece := text.decode(data):
                            yield piece
                    return
                yield await response.json(content_type=None)
        except aiohttp.ClientError as e:
            log.exception("request to the server failed")
            yield worker_error(f"Request to vLLM failed: {e}")


async def default_model(session: aiohttp.ClientSession) -> str | None:
    """The served base name: `SERVED_MODEL_NAME` or `OPENAI_SERVED_MODEL_NAME_OVERRIDE` (its first name), else the
    first card of `/v1/models`, else `MODEL_NAME`; remembered once found [W src/handler.py _default_model]."""
    global _default_model
    if _default_model is None:
        served = os.environ.get("SERVED_MODEL_NAME") or os.environ.get("OPENAI_SERVED_MODEL_NAME_OVERRIDE")
        if served:
            _default_model = served.split(",")[0].strip()
        else:
            try:
                async with session.get(f"{base_url}{MODELS}") as response:
                    cards = (await response.json(content_type=None)).get("data") or [{}]
                    _default_model = cards[0].get("id")
            except (aiohttp.ClientError, ValueError, AttributeError) as e:
                log.warning("could not read the served model's name from %s: %s", MODELS, e)
    return _default_model or os.environ.get("MODEL_NAME")
