"""Where a worker of an endpoint may start: the first datacenter it allows that offers one of its GPU types with
stock, on hosts that meet its CUDA need (a CPU endpoint: one of its CPU flavors with stock), and whether RunPod
accepts its GPU selection at all.

A GPU endpoint is placed on a host that meets its `gpu.minCudaVersion` or `gpu.allowedCudaVersions`, and a worker
no host meets is never started (its jobs stay IN_QUEUE). A CPU endpoint (`cpu: [{id, vcpuCount}]`) has no GPU and
no CUDA need: its worker starts in the first datacenter it allows that offers one of its flavors with stock.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from localpod.catalog import tables  # read through the module: `tables.serve` rebinds its tables
from localpod.catalog.cuda import CudaNeed
from localpod.catalog.tables import GpuTypeRow, HostCuda, InStock, default_host_cuda


class WorkerPlacement(BaseModel):
    """Where localpod placed a worker: a datacenter of its catalog with stock of one of the endpoint's pools (a GPU
    endpoint) or of one of its CPU flavors (a CPU endpoint)."""

    # Answered on the wire in camelCase, as the other account models (`localpod.models`).
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True)

    data_center_id: str = Field(description="The datacenter (the worker's RUNPOD_DC_ID), e.g. EU-RO-1.")
    pool: str | None = Field(default=None, description="The GPU pool it runs on; None for a CPU endpoint.")
    gpu_type_id: str | None = Field(
        default=None, description="The GPU type it runs on; None for a CPU endpoint or a pool the catalog lacks."
    )
    cpu_flavor_id: str | None = Field(
        default=None, description="The CPU flavor it runs on (e.g. cpu3c), for a CPU endpoint; None on a GPU."
    )
    vcpu_count: int | None = Field(
        default=None, description="Its vCPUs (the endpoint's `cpu[].vcpuCount` for that flavor); None on a GPU."
    )


def place(
    spec: dict[str, Any], in_stock: InStock, pinned_to: str | None = None, host_cuda: HostCuda = default_host_cuda,
    *, ignore_cuda: bool = False, cpu_in_stock: InStock = lambda flavor_id, data_center_id: True,
) -> WorkerPlacement | None:
    """Where a worker of this endpoint can start now: the first datacenter it allows (its `dataCenterIds`
    in their order; none listed: any, in catalog order) that offers one of its GPU types with stock, on hosts
    that meet its CUDA need (`CudaNeed`). With `pinned_to` (the datacenter of the endpoint's network volume),
    that datacenter only, if it is allowed. `ignore_cuda`: as if the endpoint needed no particular CUDA (to
    tell a CUDA mismatch from a lack of stock).

    A GPU endpoint's types are its pools' types less `excludedTypes`; a pool missing from the table is
    taken as offered everywhere, on hosts that meet any CUDA need (localpod runs every worker on this
    machine). A CPU endpoint (`cpu: [{id, vcpuCount}]`, no CUDA need) is placed in the first allowed datacenter
    that offers one of its flavors with stock (`cpu_in_stock`), its configurations tried in their order. None: no
    allowed datacenter has stock on such hosts (a datacenter localpod does not know has none).
    """
    allowed = allowed_data_centers(spec, pinned_to)
    gpu = spec.get("gpu")
    if not gpu:
        for dc_id in allowed:
            for config in spec.get("cpu") or ():
                if config["id"] in tables.DC_BY_ID[dc_id].cpu_offers and cpu_in_stock(config["id"], dc_id):
                    return WorkerPlacement(data_center_id=dc_id, cpu_flavor_id=config["id"],
                                           vcpu_count=config["vcpuCount"])
        return None
    need = CudaNeed() if ignore_cuda else CudaNeed.of(gpu)
    for dc_id in allowed:
        for pool in gpu.get("pools") or ():
            if not in_stock(pool, dc_id):
                continue
            if pool not in tables.KNOWN_POOLS:
                return WorkerPlacement(data_center_id=dc_id, pool=pool)
            fitting = [g for g in endpoint_gpu_types(gpu, pool, dc_id) if need.met_by(host_cuda(g.id, dc_id))]
            if fitting:
                return WorkerPlacement(data_center_id=dc_id, pool=pool, gpu_type_id=fitting[0].id)
    return None


def allowed_data_centers(spec: dict[str, Any], pinned_to: str | None = None) -> list[str]:
    """The datacenters of the catalog an endpoint allows (its `dataCenterIds` in their order; none listed: all, in
    catalog order), narrowed to `pinned_to` when given."""
    allowed = [dc for dc in (spec.get("dataCenterIds") or tables.DATA_CENTER_IDS) if dc in tables.DC_BY_ID]
    if pinned_to is not None:  # RunPod starts the workers of an endpoint with a network volume in its datacenter
        allowed = [dc for dc in allowed if dc == pinned_to]
    return allowed


def endpoint_gpu_types(gpu: dict[str, Any], pool: str, data_center_id: str) -> list[GpuTypeRow]:
    """The types of one of an endpoint's pools that a datacenter offers, less the endpoint's `excludedTypes`. A type
    listed at level NONE (a recorded catalog's: offered there, without stock when recorded) is not offered."""
    excluded = {name.strip() for name in gpu.get("excludedTypes") or ()}
    offers = tables.DC_BY_ID[data_center_id].offers
    return [g for g in tables.GPU_TYPES
            if g.pool == pool and g.id not in excluded and offers.get(g.id, "NONE") != "NONE"]


def selection_problem(gpu: dict[str, Any]) -> str | None:
    """Why RunPod refuses an endpoint's GPU selection (`gpu.pools` less `gpu.excludedTypes`), or None. RunPod's
    schema: an excluded type that is not a GPU type of one of the pools is rejected (400), surrounding whitespace
    trimmed, and so is a selection that leaves no type. A pool missing from the table holds types localpod does not
    know, so exclusions next to one are taken as they are."""
    pools = list(gpu.get("pools") or ())
    excluded = {name.strip() for name in gpu.get("excludedTypes") or ()}
    if not excluded or any(pool not in tables.KNOWN_POOLS for pool in pools):
        return None
    in_pools = {g.id for g in tables.GPU_TYPES if g.pool in pools}
    strangers = sorted(excluded - in_pools)
    if strangers:
        return (f"gpu.excludedTypes: {', '.join(strangers)} is not a GPU type of the pools {', '.join(pools)} "
                f"(their types: {', '.join(sorted(in_pools))}); GET /v2/catalog/gpus gives each type's pool")
    if in_pools <= excluded:
        return f"gpu.excludedTypes excludes every GPU type of the pools {', '.join(pools)}: keep at least one"
    return None
