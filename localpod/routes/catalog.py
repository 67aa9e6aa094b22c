"""Control plane API v2: the catalog (`/v2/catalog/gpus[/{id}]`, `/v2/catalog/cpus[/{id}]`,
`/v2/catalog/datacenters[/{id}]`).

The catalog comes from localpod's tables (`localpod.catalog`); its GPU availability follows the stock set through
`/_localpod/stock`, per datacenter, and its CUDA versions the hosts' versions set through `/_localpod/cuda`;
its CPU availability follows `/_localpod/cpu-stock`, and each datacenter's network volume tiers
`/_localpod/volume-types`. Billing is `localpod/routes/billing.py`'s.
Query parameters are checked as RunPod's schema states them (enums against the OpenAPI document's own
component schemas), and every answer is checked against its response schema before it leaves.
"""

from __future__ import annotations

import re
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from localpod.auth import require_api_key
from localpod.billing import positive_int
from localpod.catalog import documents, tables
from localpod.catalog.cuda import CudaNeed
from localpod.problems import ProblemError
from localpod.routes.faults import route_fault
from localpod.state.account import LocalpodState, get_state

router = APIRouter(prefix="/v2", tags=["catalog", "billing"], dependencies=[Depends(require_api_key)])

_COUNTRY = re.compile(r"^[A-Z]{2}$")
_CUDA_EXACT = re.compile(r"^\d+\.\d+$")
_CUDA_FLOOR = re.compile(r"^\d+(\.\d+)?$")
_AVAILABILITY_ONLY = ("count", "cloud", "countryCodes", "cudaVersions", "minCudaVersion")


@router.get("/catalog/gpus")
async def list_gpu_types(request: Request, state: LocalpodState = Depends(get_state)) -> JSONResponse:
    """`ListGpuTypesResponse`. With countryCodes, a GPU type offered in none of those countries drops out."""
    fault = await route_fault(request, "list_gpu_types")
    query = _availability_query(state, request)
    rows = [row for row in tables.GPU_TYPES if query is None or query.country_codes is None
            or any(row.id in dc.offers and query.scoped(dc) for dc in tables.DATA_CENTERS)]
    body = {"gpus": [documents.gpu_type_document(row, state.faults.in_stock, query, state.faults.host_cuda)
                     for row in rows]}
    fault.after_action()
    return _answer(state, "ListGpuTypesResponse", body)


@router.get("/catalog/gpus/{gpu_id}")
async def get_gpu_type(gpu_id: str, request: Request, state: LocalpodState = Depends(get_state)) -> JSONResponse:
    """`GpuType`; 404 only when no such type exists (outside the countries asked for, it answers NONE)."""
    fault = await route_fault(request, "get_gpu_type")
    query = _availability_query(state, request)
    row = tables.gpu_type(gpu_id)
    if row is None:
        raise ProblemError(404, f"GPU type {gpu_id!r} not found")
    body = documents.gpu_type_document(row, state.faults.in_stock, query, state.faults.host_cuda)
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
    tiers = state.faults.volume_types
    listed = [
        documents.data_center_document(dc, state.faults.in_stock, state.faults.cpu_in_stock, tiers[dc.id], include)
        for dc in tables.DATA_CENTERS
        if (regions is None or dc.region in regions)
        and volume_types <= set(tiers[dc.id])
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
    dc = tables.data_center(data_center_id)
    if dc is None:
        raise ProblemError(404, f"data center {data_center_id!r} not found")
    body = documents.data_center_document(dc, state.faults.in_stock, state.faults.cpu_in_stock,
                                          state.faults.volume_types[dc.id], include)
    fault.after_action()
    return _answer(state, "DataCenter", body)


@router.get("/catalog/cpus")
async def list_cpu_types(request: Request, state: LocalpodState = Depends(get_state)) -> JSONResponse:
    """`ListCpuTypesResponse`: every CPU flavor with its vCPU range, RAM per vCPU and prices per vCPU; with
    include=AVAILABILITY (and product), its level per datacenter offering it."""
    fault = await route_fault(request, "list_cpu_types")
    availability, vcpu_count, serverless = _cpu_availability_query(state, request)
    body = {"cpus": [documents.cpu_type_document(row, state.faults.cpu_in_stock, availability, vcpu_count, serverless)
                     for row in tables.CPU_TYPES]}
    fault.after_action()
    return _answer(state, "ListCpuTypesResponse", body)


@router.get("/catalog/cpus/{cpu_id}")
async def get_cpu_type(cpu_id: str, request: Request, state: LocalpodState = Depends(get_state)) -> JSONResponse:
    """`CpuType`; 404 naming the known flavors for an unknown one."""
    fault = await route_fault(request, "get_cpu_type")
    availability, vcpu_count, serverless = _cpu_availability_query(state, request)
    row = tables.cpu_type(cpu_id)
    if row is None:
        raise ProblemError(404, f"CPU type {cpu_id!r} not found; known: {', '.join(tables.CPU_FLAVOR_IDS)}")
    body = documents.cpu_type_document(row, state.faults.cpu_in_stock, availability, vcpu_count, serverless)
    fault.after_action()
    return _answer(state, "CpuType", body)


# --- query parameters -------------------------------------------------------------------------------


def _availability_query(state: LocalpodState, request: Request) -> documents.AvailabilityQuery | None:
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
    return documents.AvailabilityQuery(
        count=positive_int(params.get("count", "1"), "count"),
        country_codes=frozenset(countries) if countries is not None else None,
        cuda=CudaNeed(floor=floor, allowed=frozenset(versions) if versions is not None else None),
    )


def _cpu_availability_query(state: LocalpodState, request: Request) -> tuple[bool, int | None, bool]:
    """(include=AVAILABILITY asked, its vcpuCount, product=SERVERLESS alone: the serverless workers' ranges): product
    is required with include and valid only with it, as is vcpuCount (a power of two, at least 2)."""
    params = request.query_params
    include = _enum_list(state, request, "include", "CatalogInclude")
    if include is not None and len(include) > 1:
        raise ProblemError(400, "include takes one value (AVAILABILITY)")
    product = _enum_list(state, request, "product", "CpuProduct")
    if not include:
        stray = [name for name in ("product", "vcpuCount") if name in params]
        if stray:
            raise ProblemError(400, f"{', '.join(stray)} valid only with include=AVAILABILITY")
        return False, None, False
    if not product:  # CPU stock differs by product too
        raise ProblemError(400, "include=AVAILABILITY requires product (POD, SERVERLESS)")
    serverless = set(product) == {"SERVERLESS"}
    if "vcpuCount" not in params:
        return True, None, serverless
    vcpu_count = positive_int(params["vcpuCount"], "vcpuCount")
    if vcpu_count < 2 or vcpu_count & (vcpu_count - 1):
        raise ProblemError(400, f"vcpuCount must be a power of two of at least 2, not {vcpu_count}")
    return True, vcpu_count, serverless


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
