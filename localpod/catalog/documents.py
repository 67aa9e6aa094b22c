"""The documents the catalog routes answer: `GpuType` (with its availability under a query), `DataCenter` and
`CpuType`, each level of stock as RunPod spells it (NONE, LOW, MEDIUM, HIGH). Nothing here touches HTTP;
`localpod/routes/catalog.py` checks the queries and turns these documents into answers."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from localpod.catalog import tables  # read through the module: `tables.serve` rebinds its tables
from localpod.catalog.cuda import CudaNeed, cuda_version
from localpod.catalog.tables import (
    AvailabilityLevel,
    CpuTypeRow,
    DataCenterRow,
    GpuTypeRow,
    HostCuda,
    InStock,
    default_host_cuda,
)

_LEVEL_ORDER: tuple[AvailabilityLevel, ...] = ("NONE", "LOW", "MEDIUM", "HIGH")


@dataclass(frozen=True)
class AvailabilityQuery:
    """The availability filters of `GET /v2/catalog/gpus` that localpod honours (already validated)."""

    count: int = 1
    country_codes: frozenset[str] | None = None
    cuda: CudaNeed = CudaNeed()
    """`cudaVersions` (as `allowed`) or `minCudaVersion` (as `floor`)."""

    def usable_cuda(self, versions: Iterable[str]) -> list[str]:
        """The hosts' versions that meet the query's `cudaVersions` or `minCudaVersion`."""
        return [v for v in versions if self.cuda.admits(v)]

    def scoped(self, dc: DataCenterRow) -> bool:
        return self.country_codes is None or dc.country in self.country_codes


def gpu_type_document(
    row: GpuTypeRow, in_stock: InStock, query: AvailabilityQuery | None, host_cuda: HostCuda = default_host_cuda
) -> dict[str, Any]:
    """The `GpuType` document; with a query (include=AVAILABILITY), its availability under the stock and the
    hosts' CUDA versions.

    Only the datacenters offering the type within the query's countries count. Its `cudaVersions` is the union of
    its hosts' versions there that meet the query's CUDA filter, each `available` when a datacenter with stock
    has hosts on it. A datacenter whose hosts meet none of the filter answers NONE, as one out of stock does: it
    stays listed while the type is available somewhere (`dataCenters` is omitted when it is available nowhere).
    """
    price: dict[str, float] = {"secure": row.secure_usd, "community": row.community_usd}
    if row.serverless_usd is not None:
        price["serverless"] = row.serverless_usd
    document: dict[str, Any] = {
        "id": row.id, "name": row.name, "pool": row.pool, "manufacturer": "NVIDIA", "memory": row.memory_gb,
        "secure": True, "community": row.community_usd > 0, "price": price,
        "maxCount": {"secure": row.max_secure, "community": row.max_community},
    }
    if query is None:
        return document
    fits = query.count <= row.max_secure
    scoped = [dc for dc in tables.DATA_CENTERS if row.id in dc.offers and query.scoped(dc)]
    usable = {dc.id: query.usable_cuda(host_cuda(row.id, dc.id)) for dc in scoped}
    # Hosts that report no CUDA version (a recorded type without `cudaVersions`) still serve a query without a filter.
    levels = {dc.id: (level_in(dc, row, in_stock) if fits and (usable[dc.id] or query.cuda.any) else "NONE")
              for dc in scoped}
    document["availability"] = best_level(levels.values())
    if document["availability"] != "NONE":  # the schema: omitted entirely when unavailable everywhere
        document["dataCenters"] = [{"id": dc_id, "name": tables.DC_BY_ID[dc_id].name, "availability": level}
                                   for dc_id, level in levels.items()]
    offered = sorted({v for versions in usable.values() for v in versions}, key=cuda_version)
    if offered:  # the schema: absent for a type whose hosts report no (matching) CUDA version
        document["cudaVersions"] = [
            {"version": v, "available": any(levels[dc_id] != "NONE" and v in usable[dc_id] for dc_id in levels)}
            for v in offered
        ]
    return document


def data_center_document(
    dc: DataCenterRow, in_stock: InStock, cpu_in_stock: InStock, volume_types: Iterable[str], include: Iterable[str]
) -> dict[str, Any]:
    """The `DataCenter` document with the volume tiers in force; with include=GPU_AVAILABILITY, each GPU type it
    offers and its level; with include=CPU_AVAILABILITY, each CPU flavor it offers and its level (each list
    omitted where the datacenter offers none, as the schema says)."""
    document: dict[str, Any] = {
        "id": dc.id, "name": dc.name, "region": dc.region, "globalNetwork": dc.global_network,
        "networkVolumeTypes": list(volume_types), "compliance": list(dc.compliance),
    }
    include = set(include)
    if "GPU_AVAILABILITY" in include and dc.offers:
        document["gpuAvailability"] = [
            {"id": row.id, "name": row.name, "availability": level_in(dc, row, in_stock)}
            for row in (tables.GPU_BY_ID[type_id] for type_id in dc.offers)
        ]
    if "CPU_AVAILABILITY" in include and dc.cpu_offers:
        document["cpuAvailability"] = [
            {"id": row.id, "name": row.name, "availability": cpu_level_in(dc, row, cpu_in_stock)}
            for row in (tables.CPU_BY_ID[flavor_id] for flavor_id in dc.cpu_offers)
        ]
    return document


def cpu_type_document(row: CpuTypeRow, cpu_in_stock: InStock, availability: bool, vcpu_count: int | None = None,
                      serverless: bool = False) -> dict[str, Any]:
    """The `CpuType` document; with `availability` (include=AVAILABILITY), its level in each datacenter offering it
    under the CPU stock (NONE where `vcpu_count` is outside the flavor's range), `dataCenters` omitted when it is
    available nowhere. With `serverless` (product=SERVERLESS alone), the range is a serverless worker's."""
    vcpu_min, vcpu_max = row.vcpu_range(serverless)
    document: dict[str, Any] = {
        "id": row.id, "name": row.name, "group": row.group, "vcpu": {"min": vcpu_min, "max": vcpu_max},
        "ramGbPerVcpu": row.ram_gb_per_vcpu,
        "price": {"securePerVcpu": row.secure_usd_per_vcpu, "serverlessPerVcpu": row.serverless_usd_per_vcpu},
    }
    if not availability:
        return document
    fits = vcpu_count is None or vcpu_min <= vcpu_count <= vcpu_max
    levels = {dc.id: (cpu_level_in(dc, row, cpu_in_stock) if fits else "NONE")
              for dc in tables.DATA_CENTERS if row.id in dc.cpu_offers}
    document["availability"] = best_level(levels.values())
    if document["availability"] != "NONE":
        document["dataCenters"] = [{"id": dc_id, "name": tables.DC_BY_ID[dc_id].name, "availability": level}
                                   for dc_id, level in levels.items()]
    return document


def level_in(dc: DataCenterRow, row: GpuTypeRow, in_stock: InStock) -> AvailabilityLevel:
    if row.id not in dc.offers or (row.pool is not None and not in_stock(row.pool, dc.id)):
        return "NONE"
    return dc.offers[row.id]


def cpu_level_in(dc: DataCenterRow, row: CpuTypeRow, cpu_in_stock: InStock) -> AvailabilityLevel:
    if row.id not in dc.cpu_offers or not cpu_in_stock(row.id, dc.id):
        return "NONE"
    return dc.cpu_offers[row.id]


def best_level(levels: Iterable[AvailabilityLevel]) -> AvailabilityLevel:
    return max(levels, key=_LEVEL_ORDER.index, default="NONE")
