"""Control plane API v2: `/v2/serverless` (create, list, get, update, delete endpoints, and list an
endpoint's workers).

Every body is checked against RunPod's own schema (`CreateEndpointRequest`, `UpdateEndpointRequest`),
then against the rules the schema cannot say (one of gpu/cpu, CPU flavors of the catalog at vCPU counts they
offer, the account's worker quota, one network volume that exists, excluded GPU types that are types of the listed pools). Answers are `Endpoint` documents with RunPod's defaults filled in; the workers list is
checked against `ListEndpointWorkersResponse` before it leaves.
"""

from __future__ import annotations

import copy
import json
import time
from collections import Counter
from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse

from localpod.auth import require_api_key
from localpod.catalog import tables
from localpod.catalog.placement import selection_problem
from localpod.paging import page
from localpod.problems import PlainError, ProblemError
from localpod.routes.faults import route_fault
from localpod.state.account import LocalpodState, get_state
from localpod.state.records import EndpointRecord, WorkerRecord, iso

router = APIRouter(prefix="/v2/serverless", tags=["endpoints"], dependencies=[Depends(require_api_key)])

# Defaults RunPod's API v2 applies to an omitted field (from CreateEndpointRequest's `default`s).
_WORKERS_DEFAULTS = {"min": 0, "max": 3, "idleTimeout": 10}
_DEFAULT_TIMEOUT_MS = 300_000
_DEFAULT_FLASHBOOT = "OFF"


@router.post("", status_code=201)
async def create_endpoint(request: Request, state: LocalpodState = Depends(get_state)) -> JSONResponse:
    body = await _json_body(request)
    name = body.get("name") if isinstance(body, dict) else None
    fault = await route_fault(request, "create_endpoint", endpoint_name=name)
    state.schemas.check_request("CreateEndpointRequest", body)
    if fault.create_as_gpu and "cpu" in body:  # REST v1's reported slip: a CPU request made a GPU endpoint
        body = {**{k: v for k, v in body.items() if k != "cpu"}, "gpu": {"pools": ["ADA_24"]}}
    spec = _spec_from_create(body)
    if fault.create_patch is not None:  # an endpoint unlike the request, as the create_patched fault says
        spec = _spec_after_update(spec, fault.create_patch)
    state.volumes.check_endpoint(spec)
    _check_quota(state, spec["workers"]["max"], excluding=None)
    endpoint = state.add_endpoint(spec)
    fault.after_action()
    return JSONResponse(endpoint_document(endpoint, str(request.base_url)), status_code=201)


@router.get("")
async def list_endpoints(request: Request, state: LocalpodState = Depends(get_state)) -> JSONResponse:
    fault = await route_fault(request, "list_endpoints")
    base = str(request.base_url)
    endpoints, more = page(state.live_endpoints(), request, state.config.page_size)
    listed = {"endpoints": [endpoint_document(e, base) for e in endpoints], **more}
    fault.after_action()
    return JSONResponse(listed)


@router.get("/{endpoint_id}")
async def get_endpoint(endpoint_id: str, request: Request, state: LocalpodState = Depends(get_state)) -> JSONResponse:
    fault = await route_fault(request, "get_endpoint", endpoint_id=endpoint_id)
    document = endpoint_document(_live(state, endpoint_id), str(request.base_url))
    fault.after_action()
    return JSONResponse(document)


@router.patch("/{endpoint_id}")
async def update_endpoint(
    endpoint_id: str, request: Request, state: LocalpodState = Depends(get_state)
) -> JSONResponse:
    fault = await route_fault(request, "patch_endpoint", endpoint_id=endpoint_id)
    endpoint = _live(state, endpoint_id)
    body = await _json_body(request)
    state.schemas.check_request("UpdateEndpointRequest", body)
    spec = _spec_after_update(endpoint.spec, body)
    state.volumes.check_endpoint(spec)
    _check_quota(state, spec["workers"]["max"], excluding=endpoint.id)
    endpoint.spec = spec
    endpoint.version += 1  # workers started before now run a stale configuration
    state.note_peaks()
    fault.after_action()
    return JSONResponse(endpoint_document(endpoint, str(request.base_url)))


@router.delete("/{endpoint_id}", status_code=204)
async def delete_endpoint(endpoint_id: str, request: Request, state: LocalpodState = Depends(get_state)) -> Response:
    """Gone at once (a GET answers 404); its workers are stopped and its open jobs cancelled."""
    fault = await route_fault(request, "delete_endpoint", endpoint_id=endpoint_id)
    state.delete_endpoint(_live(state, endpoint_id))
    fault.after_action()
    return Response(status_code=204)


@router.get("/{endpoint_id}/workers")
async def list_endpoint_workers(
    endpoint_id: str, request: Request, state: LocalpodState = Depends(get_state)
) -> JSONResponse:
    """`ListEndpointWorkersResponse` (RunPod's listEndpointWorkers): the endpoint's active workers and a summary by
    status. Workers localpod wants but cannot place (no stock, or no host that meets the endpoint's CUDA need) are
    listed as THROTTLED entries, unplaced (no datacenter, GPU type or start), as many as `/health` counts: the
    schema's summary is a roll-up of the list (`running + idle + initializing + throttled + unhealthy == total ==
    len(workers)`)."""
    fault = await route_fault(request, "list_endpoint_workers", endpoint_id=endpoint_id)
    endpoint = _live(state, endpoint_id)
    # A worker told to stop without a job is being scaled down: RunPod lists active workers only.
    active = [w for w in state.live_workers(endpoint.id) if not w.stopping or w.job_id is not None]
    workers = [_worker_document(state, endpoint, w) for w in active]
    workers += [_throttled_document(endpoint, n) for n in range(1, state.throttled_workers(endpoint) + 1)]
    by_status = Counter(w["status"] for w in workers)
    summary = {name.lower(): by_status[name] for name in ("RUNNING", "IDLE", "INITIALIZING", "THROTTLED", "UNHEALTHY")}
    body = {"workers": workers, "summary": {**summary, "total": len(workers)}, "endpointVersion": endpoint.version}
    errors = state.schemas.errors("ListEndpointWorkersResponse", body)
    if errors:
        raise ProblemError(500, "localpod built an answer that does not match ListEndpointWorkersResponse", errors)
    fault.after_action()
    return JSONResponse(body)


def endpoint_document(endpoint: EndpointRecord, base_url: str) -> dict[str, Any]:
    """The `Endpoint` schema's document for one endpoint; request URLs point at this server."""
    jobs = f"{base_url.rstrip('/')}/v2/{endpoint.id}"
    return {
        "id": endpoint.id,
        **copy.deepcopy(endpoint.spec),
        "requestUrls": {
            "run": f"{jobs}/run",
            "runSync": f"{jobs}/runsync",
            "status": f"{jobs}/status/{{job_id}}",
            "stream": f"{jobs}/stream/{{job_id}}",
            "cancel": f"{jobs}/cancel/{{job_id}}",
            "retry": f"{jobs}/retry/{{job_id}}",
            "purgeQueue": f"{jobs}/purge-queue",
            "health": f"{jobs}/health",
        },
        "createdAt": iso(endpoint.created_at),
    }


def _worker_document(state: LocalpodState, endpoint: EndpointRecord, worker: WorkerRecord) -> dict[str, Any]:
    """A `Worker`: RUNNING with a job, UNHEALTHY after a failed fitness check, INITIALIZING until it first calls
    in, IDLE otherwise. A worker someone ran by hand has no placement (no datacenter or GPU type)."""
    if worker.unhealthy:
        status = "UNHEALTHY"
    elif worker.job_id is not None:
        status = "RUNNING"
    elif not worker.contacted:
        status = "INITIALIZING"
    else:
        status = "IDLE"
    placement = state.faults.placements.get(worker.id)
    return {
        "id": worker.id,
        "status": status,
        "isStale": worker.endpoint_version != endpoint.version,
        "version": worker.endpoint_version,
        "gpuCount": _gpu_count(endpoint),
        "image": endpoint.spec.get("image"),
        "uptimeSeconds": int(time.time() - worker.started_at),
        "gpuTypeId": placement.gpu_type_id if placement else None,
        "dataCenterId": placement.data_center_id if placement else None,
        "startedAt": iso(worker.started_at),
    }


def _throttled_document(endpoint: EndpointRecord, n: int) -> dict[str, Any]:
    """A `Worker` waiting on capacity: never placed nor started. Its id names the endpoint and its place in line."""
    return {
        "id": f"throttled-{endpoint.id}-{n}",
        "status": "THROTTLED",
        "isStale": False,
        "version": endpoint.version,
        "gpuCount": _gpu_count(endpoint),
        "image": endpoint.spec.get("image"),
        "uptimeSeconds": None,
        "gpuTypeId": None,
        "dataCenterId": None,
        "startedAt": None,
    }


def _gpu_count(endpoint: EndpointRecord) -> int:
    gpu = endpoint.spec.get("gpu")
    return int(gpu.get("count", 1)) if gpu else 0  # a CPU worker has no GPU


def _live(state: LocalpodState, endpoint_id: str) -> EndpointRecord:
    endpoint = state.live_endpoint(endpoint_id)
    if endpoint is None:
        raise ProblemError(404, f"endpoint {endpoint_id} not found")
    return endpoint


async def _json_body(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except ValueError as e:
        raise ProblemError(400, f"request body is not valid JSON: {e}") from e


def _check_quota(state: LocalpodState, workers_max: int, excluding: str | None) -> None:
    quota = state.config.worker_quota
    if state.workers_max_total(excluding=excluding) + workers_max <= quota:
        return
    # RunPod's own wording (one of them), which callers recognise whatever the status.
    text = state.config.quota_refusal_text.replace("{quota}", str(quota))
    if state.config.quota_refusal_status == 500:
        # REST v1's answer to the same refusal: a 500 whose body wraps the GraphQL error.
        raise PlainError(500, {"error": f"create endpoint: graphql: {text}"})
    raise ProblemError(400, text)


def _spec_from_create(body: dict[str, Any]) -> dict[str, Any]:
    if "templateId" in body:
        raise ProblemError(404, f"template {body['templateId']} not found (localpod has no templates; send `image`)")
    if body["type"] != "QUEUE":
        raise ProblemError(400, "localpod runs QUEUE endpoints only")
    if ("gpu" in body) == ("cpu" in body):
        raise ProblemError(400, "specify exactly one of `gpu` or `cpu`")
    spec = copy.deepcopy(body)
    spec["workers"] = {**_WORKERS_DEFAULTS, **body.get("workers", {})}
    spec.setdefault("env", {})
    spec.setdefault("timeout", _DEFAULT_TIMEOUT_MS)
    spec.setdefault("flashboot", _DEFAULT_FLASHBOOT)
    spec.setdefault("dataCenterIds", [])
    spec.setdefault("networkVolumes", [])
    if "gpu" in spec:
        spec["gpu"] = {"count": 1, "allowedCudaVersions": [], "minCudaVersion": None, **spec["gpu"]}
    else:
        spec["cpu"] = _cpu_configs(spec["cpu"])
    _check_consistent(spec)
    return spec


def _spec_after_update(old: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """PATCH semantics: only the fields sent change; `workers` and `gpu` merge per key."""
    if "templateId" in patch:
        raise ProblemError(404, f"template {patch['templateId']} not found (localpod has no templates)")
    if ("gpu" in patch and "gpu" not in old) or ("cpu" in patch and "cpu" not in old):
        raise ProblemError(400, "an endpoint's compute family (gpu or cpu) cannot change")
    spec = copy.deepcopy(old)
    for key, value in patch.items():
        if key == "workers":
            spec["workers"] = {**spec["workers"], **value}
        elif key == "gpu":
            spec["gpu"] = _gpu_after_update(spec["gpu"], value)
        elif key == "cpu":
            spec["cpu"] = _cpu_configs(value)
        else:
            spec[key] = copy.deepcopy(value)
    _check_consistent(spec)
    return spec


def _cpu_configs(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`CpuConfig`s: each flavor must be in the catalog and its vCPU count a power of two in a serverless worker's
    range of the flavor (`BaseCpuConfig.vcpuCount`); its memory is derived from the flavor's RAM multiplier, as RunPod
    does."""
    documents = []
    for n, config in enumerate(configs):
        flavor = tables.cpu_type(config["id"])
        if flavor is None:
            raise ProblemError(400, f"cpu[{n}].id: no CPU flavor {config['id']!r}; GET /v2/catalog/cpus lists them: "
                                    f"{', '.join(tables.CPU_FLAVOR_IDS)}")
        count = config["vcpuCount"]
        least, most = flavor.worker_vcpu_range()
        if count & (count - 1) or not least <= count <= most:
            raise ProblemError(400, f"cpu[{n}].vcpuCount: {count} is not valid for a serverless {flavor.id} worker: "
                                    f"give a power of two from {least} to {most}")
        documents.append({**config, "memory": flavor.memory_gb(count)})
    return documents


def _gpu_after_update(old: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    gpu = dict(old)
    if "pools" in patch:  # pools and excludedTypes are one selection: sending pools replaces both
        gpu.pop("excludedTypes", None)
    gpu.update(patch)
    if gpu.get("minCudaVersion") == "":  # an explicit "" clears the floor
        gpu["minCudaVersion"] = None
    return gpu


def _check_consistent(spec: dict[str, Any]) -> None:
    workers = spec["workers"]
    if workers["min"] > workers["max"]:
        raise ProblemError(400, f"workers.min ({workers['min']}) must not exceed workers.max ({workers['max']})")
    disk = spec.get("disk")
    for n, config in enumerate(spec.get("cpu") or ()):
        flavor = tables.cpu_type(config["id"])
        if disk is None or flavor is None:  # no disk asked: RunPod's default; an unknown flavor: refused before
            continue
        limit = config["vcpuCount"] * flavor.serverless_disk_gb_per_vcpu
        if disk > limit:
            raise ProblemError(400, f"disk: {disk} GB is more than a serverless {flavor.id} worker of "
                                    f"{config['vcpuCount']} vCPUs may have (cpu[{n}]: "
                                    f"{flavor.serverless_disk_gb_per_vcpu} GB per vCPU, {limit} GB): give more vCPUs "
                                    "or less disk")
    gpu = spec.get("gpu")
    if gpu and gpu.get("allowedCudaVersions") and gpu.get("minCudaVersion"):
        raise ProblemError(400, "gpu.allowedCudaVersions (non-empty) and gpu.minCudaVersion are mutually exclusive")
    if gpu and (problem := selection_problem(gpu)):
        raise ProblemError(400, problem)
