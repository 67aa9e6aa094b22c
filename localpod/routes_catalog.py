"""Control plane API v2: the catalog (`/v2/catalog/gpus[/{id}]`, `/v2/catalog/datacenters[/{id}]`) and
serverless billing (`/v2/billing/serverless`).

The catalog comes from localpod's table (`catalog.py`); its availability follows the stock set through
`/_localpod/stock`, per datacenter, and its CUDA versions the hosts' versions set through `/_localpod/cuda`.
Billing is computed from this server's own workers: each started worker's seconds × the serverless price of
the pool it was placed on × the endpoint's `gpu.count`.
Query parameters are checked as RunPod's schema states them (enums against the OpenAPI document's own
component schemas), and every answer is checked against its response schema before it leaves.
"""

from __future__ import annotations

import re
import time
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from localpod import catalog
from localpod.auth import require_api_key
from localpod.problems import ProblemError
from localpod.routes_faults import route_fault
from localpod.state import LocalpodState, get_state

router = APIRouter(prefix="/v2", tags=["catalog", "billing"], dependencies=[Depends(require_api_key)])

_COUNTRY = re.compile(r"^[A-Z]{2}$")
_CUDA_EXACT = re.compile(r"^\d+\.\d+$")
_CUDA_FLOOR = re.compile(r"^\d+(\.\d+)?$")
_AVAILABILITY_ONLY = ("count", "cloud", "countryCodes", "cudaVersions", "minCudaVersion")
_BILLING_WINDOW_DEFAULT = timedelta(days=30)  # RunPod: startTime "defaults to 30 days ago"
_FIXED_BUCKETS = {"hour": timedelta(hours=1), "day": timedelta(days=1), "week": timedelta(weeks=1)}


@router.get("/catalog/gpus")
async def list_gpu_types(request: Request, state: LocalpodState = Depends(get_state)) -> JSONResponse:
    """`ListGpuTypesResponse`. With countryCodes, a GPU type offered in none of those countries drops out."""
    fault = await route_fault(request, "list_gpu_types")
    query = _availability_query(state, request)
    rows = [row for row in catalog.GPU_TYPES if query is None or query.country_codes is None
            or any(row.id in dc.offers and query.scoped(dc) for dc in catalog.DATA_CENTERS)]
    body = {"gpus": [catalog.gpu_type_document(row, state.faults.in_stock, query, state.faults.host_cuda)
                     for row in rows]}
    fault.after_action()
    return _answer(state, "ListGpuTypesResponse", body)


@router.get("/catalog/gpus/{gpu_id}")
async def get_gpu_type(gpu_id: str, request: Request, state: LocalpodState = Depends(get_state)) -> JSONResponse:
    """`GpuType`; 404 only when no such type exists (outside the countries asked for, it answers NONE)."""
    fault = await route_fault(request, "get_gpu_type")
    query = _availability_query(state, request)
    row = catalog.gpu_type(gpu_id)
    if row is None:
        raise ProblemError(404, f"GPU type {gpu_id!r} not found")
    body = catalog.gpu_type_document(row, state.faults.in_stock, query, state.faults.host_cuda)
    fault.after_action()
    return _answer(state, "GpuType", body)


@router.get("/catalog/datacenters")
async def list_data_centers(request: Request, state: LocalpodState = Depends(get_state)) -> JSONResponse:
    """`ListDataCentersResponse`: regions (OR), networkVolumeTypes and compliance (AND), globalNetwork filter."""
    fault = await route_fault(request, "list_data_centers")
    include = _enum_list(state, request, "include", "DataCenterInclude") or []
    regions = _enum_list(state, request, "regions", "DataCenterRegion")
    volume_types = set(_enum_list(state, request, "networkVolumeTypes", "VolumeType") or ())
    compliance = set(_enum_list(state, request, "compliance", "Compliance") or ())
    global_network = _boolean(request, "globalNetwork")
    listed = [
        catalog.data_center_document(dc, state.faults.in_stock, "GPU_AVAILABILITY" in include)
        for dc in catalog.DATA_CENTERS
        if (regions is None or dc.region in regions)
        and volume_types <= set(dc.network_volume_types)
        and compliance <= set(dc.compliance)
        and global_network in (None, dc.global_network)
    ]
    fault.after_action()
    return _answer(state, "ListDataCentersResponse", {"dataCenters": listed})


@router.get("/catalog/datacenters/{data_center_id}")
async def get_data_center(
    data_center_id: str, request: Request, state: LocalpodState = Depends(get_state)
) -> JSONResponse:
    fault = await route_fault(request, "list_data_centers")
    include = _enum_list(state, request, "include", "DataCenterInclude") or []
    dc = catalog.data_center(data_center_id)
    if dc is None:
        raise ProblemError(404, f"data center {data_center_id!r} not found")
    body = catalog.data_center_document(dc, state.faults.in_stock, "GPU_AVAILABILITY" in include)
    fault.after_action()
    return _answer(state, "DataCenter", body)


@router.get("/billing/serverless")
async def serverless_billing(request: Request, state: LocalpodState = Depends(get_state)) -> JSONResponse:
    """`ListServerlessBillingResponse`: one record per endpoint per bucket it was billed in, within the
    bucket-aligned window (startTime/endTime, or the lastN buckets up to the current one)."""
    fault = await route_fault(request, "serverless_billing")
    params = request.query_params
    size = params.get("bucketSize", "day")
    _check_value(state, "bucketSize", size, "BillingBucketSize")
    start, end = _billing_window(params.get("startTime"), params.get("endTime"), params.get("lastN"), size)
    serverless_id = params.get("serverlessId")
    amounts = _billed_amounts(state, start, end, size, serverless_id)
    records = [
        {"startTime": _rfc3339(bucket), "endTime": _rfc3339(_step(bucket, size)), "serverlessId": endpoint_id,
         **_amounts(usd)}
        for (bucket, endpoint_id), usd in sorted(amounts.items())
    ]
    body = {
        "records": records,
        "metadata": {
            "query": {"startTime": _rfc3339(start), "endTime": _rfc3339(end), "bucketSize": size,
                      "serverlessId": serverless_id},
            "recordCount": len(records),
            "uniqueServerlessCount": len({endpoint_id for _, endpoint_id in amounts}),
            "totals": _amounts(sum(amounts.values(), 0.0)),
        },
    }
    fault.after_action()
    return _answer(state, "ListServerlessBillingResponse", body)


# --- query parameters -------------------------------------------------------------------------------


def _availability_query(state: LocalpodState, request: Request) -> catalog.AvailabilityQuery | None:
    """The availability filters of a GPU request, or None without include=AVAILABILITY; 400/422 as RunPod
    answers a parameter out of place or malformed."""
    params = request.query_params
    include = _enum_list(state, request, "include", "CatalogInclude")
    if include is not None and len(include) > 1:
        raise ProblemError(400, "include takes one value (AVAILABILITY)")
    product = _enum_list(state, request, "product", "Product")
    if not include:
        stray = [name for name in ("product", *_AVAILABILITY_ONLY) if name in params]
        if stray:
            raise ProblemError(400, f"{', '.join(stray)} valid only with include=AVAILABILITY")
        return None
    # The same GPU can be scarce for pods and plentiful for serverless, so RunPod makes callers say which.
    if not product:
        raise ProblemError(400, "include=AVAILABILITY requires product (POD, CLUSTER, SERVERLESS)")
    if "cudaVersions" in params and "minCudaVersion" in params:
        raise ProblemError(400, "cudaVersions and minCudaVersion are mutually exclusive")
    if "cloud" in params:
        _check_value(state, "cloud", params["cloud"], "GpuCloudFilter")
    countries = _pattern_list(params.get("countryCodes"), "countryCodes", _COUNTRY)
    versions = _pattern_list(params.get("cudaVersions"), "cudaVersions", _CUDA_EXACT)
    floor = params.get("minCudaVersion")
    if floor is not None and not _CUDA_FLOOR.match(floor):
        raise ProblemError(422, f"minCudaVersion {floor!r} is not a major or major.minor version")
    return catalog.AvailabilityQuery(
        count=_positive_int(params.get("count", "1"), "count"),
        country_codes=frozenset(countries) if countries is not None else None,
        cuda=catalog.CudaNeed(floor=floor, allowed=frozenset(versions) if versions is not None else None),
    )


def _enum_list(state: LocalpodState, request: Request, name: str, schema: str) -> list[str] | None:
    """A comma-separated parameter (style form, explode false) whose items the named schema must accept."""
    raw = request.query_params.get(name)
    if raw is None:
        return None
    items = [item for item in raw.split(",") if item]
    for item in items:
        _check_value(state, name, item, schema)
    return items


def _check_value(state: LocalpodState, name: str, value: str, schema: str) -> None:
    errors = state.schemas.errors(schema, value)
    if errors:
        raise ProblemError(400, f"query parameter {name}: {value!r} does not match {schema}", errors)


def _pattern_list(raw: str | None, name: str, pattern: re.Pattern[str]) -> list[str] | None:
    if raw is None:
        return None
    items = raw.split(",")
    bad = [item for item in items if not pattern.match(item)]
    if bad:  # RunPod: "a malformed entry is a 422"
        raise ProblemError(422, f"{name}: malformed entries {bad}")
    return items


def _positive_int(raw: str, name: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ProblemError(400, f"{name} must be an integer of at least 1, not {raw!r}")
    return value


def _boolean(request: Request, name: str) -> bool | None:
    raw = request.query_params.get(name)
    if raw is None:
        return None
    if raw not in ("true", "false"):
        raise ProblemError(400, f"{name} must be true or false, not {raw!r}")
    return raw == "true"


def _answer(state: LocalpodState, schema: str, body: dict[str, Any]) -> JSONResponse:
    """The answer, once it matches RunPod's response schema: a mismatch is localpod's bug, answered 500."""
    errors = state.schemas.errors(schema, body)
    if errors:
        raise ProblemError(500, f"localpod built an answer that does not match {schema}", errors)
    return JSONResponse(body)


# --- billing ----------------------------------------------------------------------------------------


def _billing_window(
    start_text: str | None, end_text: str | None, last_n_text: str | None, size: str
) -> tuple[datetime, datetime]:
    """The window RunPod resolves: startTime snapped down and endTime snapped up to bucket boundaries
    (defaults: 30 days ago, now), or the lastN buckets ending with the current one."""
    now = datetime.now(UTC)
    try:
        if last_n_text is not None:
            if start_text is not None or end_text is not None:
                raise ProblemError(400, "lastN is mutually exclusive with startTime/endTime")
            current = _floor(now, size)
            return _step(current, size, 1 - _positive_int(last_n_text, "lastN")), _step(current, size)
        start = _floor(_timestamp(start_text, "startTime") if start_text else now - _BILLING_WINDOW_DEFAULT, size)
        end = _timestamp(end_text, "endTime") if end_text else now
        floor = _floor(end, size)
        end = floor if floor == end else _step(floor, size)
    except (OverflowError, ValueError) as e:  # a window reaching past the calendar's years
        raise ProblemError(400, f"billing window out of range: {e}") from e
    if start >= end:
        raise ProblemError(400, f"startTime {_rfc3339(start)} is not before endTime {_rfc3339(end)}")
    return start, end


def _billed_amounts(
    state: LocalpodState, start: datetime, end: datetime, size: str, serverless_id: str | None
) -> dict[tuple[datetime, str], float]:
    """USD per (bucket start, endpoint id). Only workers localpod started bill, as in the account's
    `billed_worker_seconds`; a CPU worker, or a pool without a serverless price, bills nothing here."""
    amounts: dict[tuple[datetime, str], float] = defaultdict(float)
    now = time.time()
    for worker in state.workers.values():
        placement = state.faults.placements.get(worker.id)
        if worker.process is None or placement is None or serverless_id not in (None, worker.endpoint_id):
            continue
        rate = catalog.POOL_SERVERLESS_USD_PER_HOUR.get(placement.pool or "")
        if rate is None:
            continue
        gpus = int((state.endpoints[worker.endpoint_id].spec.get("gpu") or {}).get("count", 1))
        began = max(datetime.fromtimestamp(worker.started_at, UTC), start)
        ended = min(datetime.fromtimestamp(worker.ended_at or now, UTC), end)
        bucket = _floor(began, size)
        while bucket < ended:
            following = _step(bucket, size)
            seconds = (min(ended, following) - max(began, bucket)).total_seconds()
            amounts[(bucket, worker.endpoint_id)] += seconds * rate * gpus / 3600
            bucket = following
    return amounts


def _amounts(usd: float) -> dict[str, float]:
    """`ServerlessBillingAmounts`: localpod bills GPU time only (no disk, CPU or platform fee)."""
    return {"totalAmount": round(usd, 6), "gpuAmount": round(usd, 6), "cpuAmount": 0.0, "diskAmount": 0.0,
            "feeAmount": 0.0}


def _floor(t: datetime, size: str) -> datetime:
    """The start of the bucket holding `t` (weeks start on Monday, UTC)."""
    t = t.replace(minute=0, second=0, microsecond=0)
    if size == "hour":
        return t
    t = t.replace(hour=0)
    if size == "day":
        return t
    if size == "week":
        return t - timedelta(days=t.weekday())
    t = t.replace(day=1)
    return t if size == "month" else t.replace(month=1)


def _step(bucket: datetime, size: str, n: int = 1) -> datetime:
    """The start of the bucket `n` buckets after this one (before it, for a negative `n`)."""
    if size in _FIXED_BUCKETS:
        return bucket + n * _FIXED_BUCKETS[size]
    months = bucket.year * 12 + bucket.month - 1 + n * (12 if size == "year" else 1)
    return bucket.replace(year=months // 12, month=months % 12 + 1)


def _timestamp(text: str, name: str) -> datetime:
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        value = None
    if value is None or value.tzinfo is None:
        raise ProblemError(400, f"{name} must be an RFC 3339 date-time with a time zone, not {text!r}")
    return value.astimezone(UTC)


def _rfc3339(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
