"""`/_localpod/faults`, `/_localpod/worker-faults`, `/_localpod/stock`, `/_localpod/cpu-stock`, `/_localpod/cuda`,
`/_localpod/volume-types` and `/_localpod/clock`: fault injection and test controls for tests and benchmarks
(not RunPod's API, so no key, like the account), and `route_fault`, the hook the control-plane and job-API
routes call to misbehave as a rule says.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass

from fastapi import APIRouter, Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.types import Receive, Scope, Send

from localpod.billing import ClockAdvance, ClockReading
from localpod.faults.rules import (
    CpuStock,
    CpuStockChange,
    CudaChange,
    HostsCuda,
    RouteFault,
    RouteFaultRule,
    Stock,
    StockChange,
    VolumeTypes,
    VolumeTypesChange,
    WorkerFault,
    WorkerFaultRule,
)
from localpod.problems import ProblemError, problem_response
from localpod.state.account import LocalpodState, get_state

log = logging.getLogger("localpod.faults")
router = APIRouter(prefix="/_localpod", tags=["localpod faults"])

_POLL_S = 0.05


@router.post("/faults", status_code=201)
async def add_route_fault(rule: RouteFaultRule, state: LocalpodState = Depends(get_state)) -> RouteFault:
    return state.faults.add_route_fault(rule)


@router.get("/faults")
async def list_route_faults(state: LocalpodState = Depends(get_state)) -> list[RouteFault]:
    return state.faults.route_faults()


@router.delete("/faults", status_code=204)
async def clear_route_faults(state: LocalpodState = Depends(get_state)) -> Response:
    state.faults.clear_route_faults()
    return Response(status_code=204)


@router.delete("/faults/{fault_id}", status_code=204)
async def remove_route_fault(fault_id: str, state: LocalpodState = Depends(get_state)) -> Response:
    if not state.faults.remove_route_fault(fault_id):
        raise ProblemError(404, f"route fault {fault_id} not found")
    return Response(status_code=204)


@router.post("/worker-faults", status_code=201)
async def add_worker_fault(rule: WorkerFaultRule, state: LocalpodState = Depends(get_state)) -> WorkerFault:
    return state.faults.add_worker_fault(rule)


@router.get("/worker-faults")
async def list_worker_faults(state: LocalpodState = Depends(get_state)) -> list[WorkerFault]:
    return state.faults.worker_faults()


@router.delete("/worker-faults", status_code=204)
async def clear_worker_faults(state: LocalpodState = Depends(get_state)) -> Response:
    """Jobs that had a fault armed run on undisturbed."""
    state.faults.clear_worker_faults()
    return Response(status_code=204)


@router.delete("/worker-faults/{fault_id}", status_code=204)
async def remove_worker_fault(fault_id: str, state: LocalpodState = Depends(get_state)) -> Response:
    if not state.faults.remove_worker_fault(fault_id):
        raise ProblemError(404, f"worker fault {fault_id} not found")
    return Response(status_code=204)


# Defaults excluded: with no pool out in only some datacenters, the answer reads as it did before stock had
# datacenters (`{"out_of_stock": [...]}`).
@router.post("/stock", response_model_exclude_defaults=True)
async def set_stock(change: StockChange, state: LocalpodState = Depends(get_state)) -> Stock:
    """Take a GPU pool out of stock, or put it back, in one datacenter or in all of them."""
    return state.faults.set_stock(change)


@router.get("/stock", response_model_exclude_defaults=True)
async def get_stock(state: LocalpodState = Depends(get_state)) -> Stock:
    return state.faults.stock()


@router.post("/cpu-stock")
async def set_cpu_stock(change: CpuStockChange, state: LocalpodState = Depends(get_state)) -> CpuStock:
    """Take a CPU flavor (or every flavor) out of stock, or put it back, in one datacenter or in all of them."""
    return state.faults.set_cpu_stock(change)


@router.get("/cpu-stock")
async def get_cpu_stock(state: LocalpodState = Depends(get_state)) -> CpuStock:
    return state.faults.cpu_stock()


@router.post("/volume-types")
async def set_volume_types(change: VolumeTypesChange, state: LocalpodState = Depends(get_state)) -> VolumeTypes:
    """Set the network volume tiers one datacenter offers, its primary one first."""
    return state.faults.set_volume_types(change)


@router.get("/volume-types")
async def get_volume_types(state: LocalpodState = Depends(get_state)) -> VolumeTypes:
    return state.faults.volume_types_view()


@router.delete("/volume-types", status_code=204)
async def reset_volume_types(state: LocalpodState = Depends(get_state)) -> Response:
    """Back to the catalog's tiers (`localpod.catalog.tables`) in every datacenter."""
    state.faults.reset_volume_types()
    return Response(status_code=204)


@router.post("/clock")
async def advance_clock(change: ClockAdvance, state: LocalpodState = Depends(get_state)) -> ClockReading:
    """Let storage time pass: network volumes are billed as if `advance_days` went by (workers keep real time)."""
    return state.storage_clock.advance(change)


@router.get("/clock")
async def get_clock(state: LocalpodState = Depends(get_state)) -> ClockReading:
    return state.storage_clock.reading()


# The body is read by hand so that every refusal is a 422 naming the field (FastAPI's own body validation
# answers 400 in this app, as RunPod does for its schemas); the schema is still published.
@router.post(
    "/cuda",
    openapi_extra={"requestBody": {"required": True,
                                   "content": {"application/json": {"schema": CudaChange.model_json_schema()}}}},
)
async def set_host_cuda(request: Request, state: LocalpodState = Depends(get_state)) -> HostsCuda:
    """Set the CUDA versions the hosts of a GPU type (or of every type of a pool, or of every type) run in one
    datacenter or in every one offering it. 422 for an unknown type, pool or datacenter, a version that is not
    major.minor, or gpu_type_id and pool together."""
    try:
        change = CudaChange.model_validate(json.loads(await request.body()))
    except ValueError as e:  # json's and pydantic's errors alike
        errors = ([f"${''.join(f'.{part}' for part in error['loc'])}: {error['msg'].removeprefix('Value error, ')}"
                   for error in e.errors()] if isinstance(e, ValidationError) else [f"$: not JSON: {e}"])
        raise ProblemError(422, "; ".join(errors), errors) from e
    return state.faults.set_host_cuda(change)


@router.get("/cuda")
async def get_host_cuda(state: LocalpodState = Depends(get_state)) -> HostsCuda:
    return state.faults.hosts_cuda()


@router.delete("/cuda", status_code=204)
async def reset_host_cuda(state: LocalpodState = Depends(get_state)) -> Response:
    """Back to the catalog's default hosts (`localpod.catalog.tables`)."""
    state.faults.reset_host_cuda()
    return Response(status_code=204)


# --- the hook in the control-plane and job-API routes ----------------------------------------------


@dataclass(frozen=True)
class RouteFaultHit:
    """What `route_fault` let through: nothing, an act_then_500 to answer once the operation is done, an
    unknown_status's job status to answer in place of the real one, or a create to carry out with GPU workers or
    with a patch applied."""

    route: str
    act_then_500: bool
    job_status: str | None = None
    create_as_gpu: bool = False
    create_patch: dict | None = None

    def after_action(self) -> None:
        """Call once the operation took effect: an act_then_500 rule answers 500 now."""
        if self.act_then_500:
            raise InjectedAnswer(
                problem_response(500, f"localpod fault injection: {self.route} was carried out, then answered 500")
            )


async def route_fault(
    request: Request, route: str, *, endpoint_id: str | None = None, endpoint_name: str | None = None,
    data_center: str | None = None,
) -> RouteFaultHit:
    """Apply the first route fault rule that matches this request, before the operation runs.

    Raises `InjectedAnswer` for status_429, status_500, status_400, answer and drop; holds the request for hang, then
    applies the first other rule that matches (a held request is answered as it would have been); an
    unknown_status comes back in the hit, for the status route to answer. Name the endpoint by id (any endpoint ever created)
    or, for a create, by the name in the body; a volume create by its body's datacenter.
    """
    state = get_state(request)
    if endpoint_id is not None:
        endpoint = state.endpoints.get(endpoint_id)
        endpoint_name = endpoint.spec["name"] if endpoint is not None else None
    rule = state.faults.match_route(route, endpoint_name, data_center)
    if rule is not None and rule.action == "hang":
        log.info("injecting hang on %s (endpoint %s)", route, endpoint_name)
        await _hang(request, state, rule.hang_s)
        # A slow answer is still whatever answer the other rules make it: a hang delays, it does not decide.
        rule = state.faults.match_route(route, endpoint_name, data_center, hangs=False)
    if rule is None:
        return RouteFaultHit(route, act_then_500=False)
    log.info("injecting %s on %s (endpoint %s)", rule.action, route, endpoint_name)
    if rule.action == "status_429":
        response = problem_response(429, f"localpod fault injection: {route} rate limited")
        if rule.retry_after_s is not None:
            response.headers["Retry-After"] = str(rule.retry_after_s)
        raise InjectedAnswer(response)
    if rule.action == "status_500":
        raise InjectedAnswer(problem_response(500, f"localpod fault injection: {route} failed"))
    if rule.action == "status_400":
        raise InjectedAnswer(problem_response(400, f"localpod fault injection: {route} refused as invalid"))
    if rule.action == "answer":
        assert rule.status_code is not None  # the rule's validator requires it
        if rule.answer_body is None:
            raise InjectedAnswer(problem_response(rule.status_code, f"localpod fault injection: {route} answered "
                                                                    f"{rule.status_code}"))
        raise InjectedAnswer(JSONResponse(rule.answer_body, status_code=rule.status_code))
    if rule.action == "drop":
        raise InjectedAnswer(_CutResponse())
    return RouteFaultHit(route, act_then_500=rule.action == "act_then_500", job_status=rule.job_status,
                         create_as_gpu=rule.action == "create_as_gpu", create_patch=rule.create_patch)


class InjectedAnswer(Exception):
    """Raised by `route_fault`: answer with this response instead of the operation's."""

    def __init__(self, response: Response) -> None:
        super().__init__("injected fault")
        self.response = response


def install_fault_answers(app: FastAPI) -> None:
    """Answer `InjectedAnswer`s, and keep uvicorn from logging a traceback for each injected drop."""

    async def on_injected(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, InjectedAnswer)
        return exc.response

    app.add_exception_handler(InjectedAnswer, on_injected)
    server_log = logging.getLogger("uvicorn.error")
    if _quiet_drops not in server_log.filters:
        server_log.addFilter(_quiet_drops)


class ConnectionDropped(Exception):
    """Raised mid-response by an injected drop: uvicorn then closes the connection; an in-process
    `TestClient` raises it to the caller instead."""


class _CutResponse(Response):
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # ASGI servers close the connection when the app fails after the response started (uvicorn:
        # transport.close()); a Content-Length never met makes httpx raise RemoteProtocolError.
        headers = [(b"content-type", b"application/json"), (b"content-length", b"64")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        raise ConnectionDropped("localpod fault injection: connection dropped")


def _quiet_drops(record: logging.LogRecord) -> bool:
    return not (record.exc_info and isinstance(record.exc_info[1], ConnectionDropped))


async def _hang(request: Request, state: LocalpodState, seconds: float | None) -> None:
    """Hold the request `seconds`, then let it go on; without `seconds`, until the client leaves."""
    deadline = None if seconds is None else time.monotonic() + seconds
    while not state.closing:
        if deadline is not None and time.monotonic() >= deadline:
            return
        if deadline is None and await request.is_disconnected():
            break
        await asyncio.sleep(_POLL_S)
    if deadline is None:  # nobody is listening any more (or the server is stopping): carry nothing out
        raise InjectedAnswer(problem_response(503, "localpod fault injection: request held until the client left"))
