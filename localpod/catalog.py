"""localpod's GPU, CPU and datacenter catalog: the table behind `/v2/catalog/*`, and where a worker may
start.

The table stands in for RunPod's live catalog: the GPU types of the pools loraflow rents, with their memory
and list prices, a few CPU flavors with their vCPU ranges, RAM per vCPU and prices per vCPU, a handful of
datacenters with what each offers (GPU types, CPU flavors, network volume tiers), and the CUDA versions the
hosts of each GPU type run in each datacenter. Serverless GPU prices are RunPod-like figures chosen to
differ from loraflow's static table, so a test can tell which of the two a cost came from.

Hosts' CUDA versions (localpod's assumption, not a RunPod fact: RunPod publishes only the union per GPU
type, `cudaVersions`): the hosts of the Ampere, Ada and Hopper types run CUDA 12.4, 12.6, 12.8, 12.9
and 13.0 in US-KS-2, US-CA-2, EU-RO-1 and EU-CZ-1, but only 12.4, 12.6 and 12.8 in US-TX-3 (older
drivers there); the Blackwell types (RTX 5090, RTX PRO 6000, B200) run 12.8, 12.9 and 13.0 wherever
they are offered. So an endpoint whose image needs CUDA 13 can be served by an RTX 4090 in EU-RO-1 but
not in US-TX-3: placement takes a host that meets the endpoint's `gpu.minCudaVersion` or
`gpu.allowedCudaVersions`, and a worker no host meets is never started (its jobs stay IN_QUEUE).

A CPU endpoint (`cpu: [{id, vcpuCount}]`) has no GPU and no CUDA need: its worker starts in the first
datacenter it allows that offers one of its flavors with stock. EU-CZ-1 offers no CPU flavor, so an
endpoint pinned there by its network volume must run on a GPU.

Neither stock nor the hosts' versions nor the volume tiers in force are here: `FaultBook` (`faults/book.py`) keeps
what `/_localpod/stock` and `/_localpod/cpu-stock` took out, what `/_localpod/cuda` set and what
`/_localpod/volume-types` changed, and the functions below take them as `in_stock(pool, data_center_id)`,
`in_stock(cpu_flavor_id, data_center_id)` and `host_cuda(gpu_type_id, data_center_id)` callables.

Nothing here touches HTTP; `localpod/routes/catalog.py` turns these documents into answers. `serve` puts a real
account's catalog in place of these tables, for the whole process (`python -m localpod --catalog-from DIR`; the
tables come from `recorded_catalog.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

AvailabilityLevel = Literal["NONE", "LOW", "MEDIUM", "HIGH"]
InStock = Callable[[str, str], bool]
"""`in_stock(pool, data_center_id)`: False once `/_localpod/stock` took the pool out there."""
HostCuda = Callable[[str, str], tuple[str, ...]]
"""`host_cuda(gpu_type_id, data_center_id)`: the CUDA versions that type's hosts run there, sorted by version
(empty: none reported, or the type is not offered there)."""

_LEVEL_ORDER: tuple[AvailabilityLevel, ...] = ("NONE", "LOW", "MEDIUM", "HIGH")

POOL_SERVERLESS_USD_PER_HOUR: dict[str, float] = {
    # RunPod quotes one serverless rate per pool (`price.serverless` is "the rate for this GPU's pool").
    "ADA_24": 1.12,
    "ADA_32_PRO": 1.58,
    "AMPERE_80": 2.72,
    "ADA_80_PRO": 4.18,
    "HOPPER_141": 5.58,
    "BLACKWELL_96": 3.02,
    "BLACKWELL_180": 8.64,
}


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


@dataclass(frozen=True)
class CpuTypeRow:
    """One CPU flavor, as `CpuType` describes it: an endpoint picks a flavor and a vCPU count in its range; its
    RAM is the count times `ram_gb_per_vcpu`, its price the count times the per-vCPU figure (USD per hour, as
    `GpuType.price` quotes GPUs)."""

    id: str
    name: str
    group: str
    vcpu_min: int
    vcpu_max: int
    ram_gb_per_vcpu: float
    secure_usd_per_vcpu: float
    serverless_usd_per_vcpu: float

    def memory_gb(self, vcpu_count: int) -> int:
        """`CpuConfig.memory`: RunPod derives it from the flavor's RAM multiplier."""
        return max(1, round(vcpu_count * self.ram_gb_per_vcpu))


CPU_TYPES: tuple[CpuTypeRow, ...] = (
    # RAM per vCPU as RunPod's Flash docs list the flavors (cpu3c-2-4, cpu5c-4-8: 2 GB per vCPU; the general-purpose
    # "g" flavors 4 GB). cpu3c's prices are the schema's own example (0.04 secure, 0.03 serverless per vCPU); the
    # search found no published serverless CPU price list, so cpu3g's and cpu5c's are plausible figures above it.
    CpuTypeRow("cpu3c", "Compute-Optimized", "Gen 3", 2, 32, 2.0, 0.04, 0.03),
    CpuTypeRow("cpu3g", "General Purpose", "Gen 3", 2, 32, 4.0, 0.05, 0.04),
    CpuTypeRow("cpu5c", "Compute-Optimized", "Gen 5", 2, 32, 2.0, 0.06, 0.05),
)

_AMPERE_ADA_HOPPER_CUDA = ("12.4", "12.6", "12.8", "12.9", "13.0")
_OLDER_DRIVERS_CUDA = ("12.4", "12.6", "12.8")  # hosts whose drivers predate CUDA 12.9
_BLACKWELL_CUDA = ("12.8", "12.9", "13.0")  # sm100/sm120 cards need CUDA 12.8 or later


@dataclass(frozen=True)
class GpuTypeRow:
    """One GPU type, as `GpuType` describes it (ids as RunPod spells them); `pool` None: in no serverless pool (a
    pod card only)."""

    id: str
    name: str
    pool: str | None
    memory_gb: int
    secure_usd: float
    community_usd: float
    max_secure: int
    max_community: int
    host_cuda: tuple[str, ...]
    """The CUDA versions its hosts run, in a datacenter that says nothing else (`DataCenterRow.host_cuda`)."""

    @property
    def serverless_usd(self) -> float | None:
        return POOL_SERVERLESS_USD_PER_HOUR.get(self.pool) if self.pool is not None else None


@dataclass(frozen=True)
class DataCenterRow:
    """One datacenter, as `DataCenter` describes it, with the GPU types it offers and their stock level
    while in stock (a pool taken out through `/_localpod/stock` answers NONE instead), the GPU types whose
    hosts here run other CUDA versions than the type's own `host_cuda`, and the CPU flavors it offers and their
    level while in stock (`/_localpod/cpu-stock`). `network_volume_types` is the default offer: the first tier
    is the datacenter's primary one (a volume created without `type` gets it); `/_localpod/volume-types`
    changes it."""

    id: str
    name: str
    country: str
    region: str
    global_network: bool
    network_volume_types: tuple[str, ...]
    compliance: tuple[str, ...]
    offers: dict[str, AvailabilityLevel] = field(default_factory=dict)
    host_cuda: dict[str, tuple[str, ...]] = field(default_factory=dict)
    cpu_offers: dict[str, AvailabilityLevel] = field(default_factory=dict)


_4090, _5090 = "NVIDIA GeForce RTX 4090", "NVIDIA GeForce RTX 5090"
_A100_PCIE, _A100_SXM = "NVIDIA A100 80GB PCIe", "NVIDIA A100-SXM4-80GB"
_H100_SXM, _H100_PCIE, _H100_NVL = "NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H100 NVL"
_H200, _PRO6000, _B200 = "NVIDIA H200", "NVIDIA RTX PRO 6000 Blackwell Server Edition", "NVIDIA B200"

GPU_TYPES: tuple[GpuTypeRow, ...] = (
    GpuTypeRow(_4090, "RTX 4090", "ADA_24", 24, 0.59, 0.34, 8, 8, _AMPERE_ADA_HOPPER_CUDA),
    GpuTypeRow(_5090, "RTX 5090", "ADA_32_PRO", 32, 0.89, 0.69, 8, 8, _BLACKWELL_CUDA),
    GpuTypeRow(_A100_PCIE, "A100 PCIe", "AMPERE_80", 80, 1.64, 1.19, 8, 8, _AMPERE_ADA_HOPPER_CUDA),
    GpuTypeRow(_A100_SXM, "A100 SXM", "AMPERE_80", 80, 1.74, 1.39, 8, 8, _AMPERE_ADA_HOPPER_CUDA),
    # RunPod's SDK maps ADA_80_PRO to the H100 SXM alone; the PCIe and NVL cards are pod cards here (no pool).
    GpuTypeRow(_H100_SXM, "H100 SXM", "ADA_80_PRO", 80, 2.69, 2.39, 8, 8, _AMPERE_ADA_HOPPER_CUDA),
    GpuTypeRow(_H100_PCIE, "H100 PCIe", None, 80, 2.39, 1.99, 8, 4, _AMPERE_ADA_HOPPER_CUDA),
    GpuTypeRow(_H100_NVL, "H100 NVL", None, 94, 2.79, 2.59, 8, 4, _AMPERE_ADA_HOPPER_CUDA),
    GpuTypeRow(_H200, "H200 SXM", "HOPPER_141", 141, 3.59, 3.29, 8, 8, _AMPERE_ADA_HOPPER_CUDA),
    GpuTypeRow(_PRO6000, "RTX PRO 6000", "BLACKWELL_96", 96, 1.84, 1.59, 8, 4, _BLACKWELL_CUDA),
    GpuTypeRow(_B200, "B200", "BLACKWELL_180", 180, 5.98, 5.19, 8, 8, _BLACKWELL_CUDA),
)

_VOLUMES = ("STANDARD", "HIGH_PERFORMANCE")
DATA_CENTERS: tuple[DataCenterRow, ...] = (
    # RunPod observed US-KS-2 to stock no RTX 4090 (shared/runpod-api/README.md).
    DataCenterRow("US-KS-2", "US Kansas 2", "US", "NORTH_AMERICA", True, _VOLUMES, ("SOC_2_TYPE_2", "ISO_IEC_27001"),
                  {_A100_SXM: "HIGH", _H100_SXM: "HIGH", _H100_PCIE: "MEDIUM", _H200: "MEDIUM", _B200: "LOW"},
                  cpu_offers={"cpu3c": "HIGH", "cpu3g": "MEDIUM", "cpu5c": "HIGH"}),
    DataCenterRow("US-CA-2", "US California 2", "US", "NORTH_AMERICA", True, _VOLUMES, ("SOC_2_TYPE_2",),
                  {_4090: "HIGH", _5090: "MEDIUM", _A100_PCIE: "HIGH", _H100_PCIE: "HIGH", _H100_NVL: "MEDIUM",
                   _PRO6000: "HIGH"},
                  cpu_offers={"cpu3c": "MEDIUM", "cpu3g": "HIGH"}),
    DataCenterRow("EU-RO-1", "EU Romania 1", "RO", "EUROPE", True, _VOLUMES, ("GDPR", "ISO_IEC_27001"),
                  {_4090: "HIGH", _5090: "HIGH", _A100_SXM: "MEDIUM", _H100_SXM: "HIGH", _H200: "LOW",
                   _PRO6000: "MEDIUM"},
                  cpu_offers={"cpu3c": "HIGH", "cpu5c": "MEDIUM"}),
    # No CPU serverless here: an endpoint pinned to a volume in EU-CZ-1 runs on a GPU.
    DataCenterRow("EU-CZ-1", "EU Czechia 1", "CZ", "EUROPE", True, ("STANDARD",), ("GDPR",),
                  {_4090: "MEDIUM", _5090: "LOW", _A100_PCIE: "MEDIUM", _H100_NVL: "HIGH", _B200: "MEDIUM"}),
    # Not in RunPod's list of network-volume datacenters: a run with a volume is never placed here. Its Ampere,
    # Ada and Hopper hosts run older drivers (its RTX PRO 6000 hosts are newer machines).
    DataCenterRow("US-TX-3", "US Texas 3", "US", "NORTH_AMERICA", False, (), ("SOC_2_TYPE_2",),
                  {_4090: "HIGH", _A100_PCIE: "LOW", _A100_SXM: "HIGH", _H100_SXM: "MEDIUM", _H200: "HIGH",
                   _PRO6000: "LOW"},
                  dict.fromkeys((_4090, _A100_PCIE, _A100_SXM, _H100_SXM, _H200), _OLDER_DRIVERS_CUDA),
                  cpu_offers={"cpu3c": "HIGH", "cpu3g": "HIGH", "cpu5c": "LOW"}),
)

DATA_CENTER_IDS: tuple[str, ...] = tuple(dc.id for dc in DATA_CENTERS)
_GPU_BY_ID = {g.id: g for g in GPU_TYPES}
_DC_BY_ID = {dc.id: dc for dc in DATA_CENTERS}
_CPU_BY_ID = {c.id: c for c in CPU_TYPES}
CPU_FLAVOR_IDS: tuple[str, ...] = tuple(c.id for c in CPU_TYPES)
KNOWN_POOLS: tuple[str, ...] = tuple(dict.fromkeys(g.pool for g in GPU_TYPES if g.pool is not None))


def gpu_type(type_id: str) -> GpuTypeRow | None:
    return _GPU_BY_ID.get(type_id)


def data_center(data_center_id: str) -> DataCenterRow | None:
    return _DC_BY_ID.get(data_center_id)


def cpu_type(flavor_id: str) -> CpuTypeRow | None:
    return _CPU_BY_ID.get(flavor_id)


def default_volume_types() -> dict[str, tuple[str, ...]]:
    """A fresh copy of the default volume tiers: datacenter id → the tiers it offers, its primary one first."""
    return {dc.id: dc.network_volume_types for dc in DATA_CENTERS}


def offered_in(row: GpuTypeRow) -> list[str]:
    """The datacenters offering this GPU type, in catalog order."""
    return [dc.id for dc in DATA_CENTERS if row.id in dc.offers]


def default_host_cuda(type_id: str, data_center_id: str) -> tuple[str, ...]:
    """The CUDA versions this type's hosts run in this datacenter by default (a `HostCuda`); () where the
    datacenter does not offer the type."""
    row, dc = _GPU_BY_ID.get(type_id), _DC_BY_ID.get(data_center_id)
    if row is None or dc is None or type_id not in dc.offers:
        return ()
    return dc.host_cuda.get(type_id, row.host_cuda)


def default_host_table() -> dict[str, dict[str, tuple[str, ...]]]:
    """A fresh copy of the default hosts: GPU type id → datacenter offering it → its hosts' CUDA versions."""
    return {row.id: {dc_id: default_host_cuda(row.id, dc_id) for dc_id in offered_in(row)} for row in GPU_TYPES}


@dataclass(frozen=True)
class CudaNeed:
    """What an endpoint asks of its hosts' CUDA (`gpu.minCudaVersion` or a non-empty `gpu.allowedCudaVersions`),
    or a catalog query of them (`minCudaVersion`, `cudaVersions`); both None: anything goes."""

    floor: str | None = None
    allowed: frozenset[str] | None = None

    @classmethod
    def of(cls, gpu: dict[str, Any]) -> CudaNeed:
        # RunPod refuses both at once (`routes.endpoints` checks it); an empty allowed list states no constraint.
        allowed = gpu.get("allowedCudaVersions") or None
        return cls(floor=gpu.get("minCudaVersion") or None, allowed=frozenset(allowed) if allowed else None)

    @property
    def any(self) -> bool:
        return self.floor is None and self.allowed is None

    def admits(self, version: str) -> bool:
        if self.allowed is not None and version not in self.allowed:
            return False
        if self.floor is not None:
            floor = cuda_version(self.floor)
            return cuda_version(version)[: len(floor)] >= floor
        return True

    def met_by(self, versions: Iterable[str]) -> bool:
        return self.any or any(self.admits(v) for v in versions)

    def describe(self) -> str:
        """As a log line says it: "CUDA >= 13.0", "CUDA 12.9 or 13.0"."""
        if self.floor is not None:
            return f"CUDA >= {self.floor}"
        return "CUDA " + " or ".join(sorted(self.allowed or (), key=cuda_version))


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
    scoped = [dc for dc in DATA_CENTERS if row.id in dc.offers and query.scoped(dc)]
    usable = {dc.id: query.usable_cuda(host_cuda(row.id, dc.id)) for dc in scoped}
    # Hosts that report no CUDA version (a recorded type without `cudaVersions`) still serve a query without a filter.
    levels = {dc.id: (level_in(dc, row, in_stock) if fits and (usable[dc.id] or query.cuda.any) else "NONE")
              for dc in scoped}
    document["availability"] = best_level(levels.values())
    if document["availability"] != "NONE":  # the schema: omitted entirely when unavailable everywhere
        document["dataCenters"] = [{"id": dc_id, "name": _DC_BY_ID[dc_id].name, "availability": level}
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
            for row in (_GPU_BY_ID[type_id] for type_id in dc.offers)
        ]
    if "CPU_AVAILABILITY" in include and dc.cpu_offers:
        document["cpuAvailability"] = [
            {"id": row.id, "name": row.name, "availability": cpu_level_in(dc, row, cpu_in_stock)}
            for row in (_CPU_BY_ID[flavor_id] for flavor_id in dc.cpu_offers)
        ]
    return document


def cpu_type_document(row: CpuTypeRow, cpu_in_stock: InStock, availability: bool, vcpu_count: int | None = None
                      ) -> dict[str, Any]:
    """The `CpuType` document; with `availability` (include=AVAILABILITY), its level in each datacenter offering it
    under the CPU stock (NONE where `vcpu_count` is outside the flavor's range), `dataCenters` omitted when it is
    available nowhere."""
    document: dict[str, Any] = {
        "id": row.id, "name": row.name, "group": row.group, "vcpu": {"min": row.vcpu_min, "max": row.vcpu_max},
        "ramGbPerVcpu": row.ram_gb_per_vcpu,
        "price": {"securePerVcpu": row.secure_usd_per_vcpu, "serverlessPerVcpu": row.serverless_usd_per_vcpu},
    }
    if not availability:
        return document
    fits = vcpu_count is None or row.vcpu_min <= vcpu_count <= row.vcpu_max
    levels = {dc.id: (cpu_level_in(dc, row, cpu_in_stock) if fits else "NONE")
              for dc in DATA_CENTERS if row.id in dc.cpu_offers}
    document["availability"] = best_level(levels.values())
    if document["availability"] != "NONE":
        document["dataCenters"] = [{"id": dc_id, "name": _DC_BY_ID[dc_id].name, "availability": level}
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
                if config["id"] in _DC_BY_ID[dc_id].cpu_offers and cpu_in_stock(config["id"], dc_id):
                    return WorkerPlacement(data_center_id=dc_id, cpu_flavor_id=config["id"],
                                           vcpu_count=config["vcpuCount"])
        return None
    need = CudaNeed() if ignore_cuda else CudaNeed.of(gpu)
    for dc_id in allowed:
        for pool in gpu.get("pools") or ():
            if not in_stock(pool, dc_id):
                continue
            if pool not in KNOWN_POOLS:
                return WorkerPlacement(data_center_id=dc_id, pool=pool)
            fitting = [g for g in endpoint_gpu_types(gpu, pool, dc_id) if need.met_by(host_cuda(g.id, dc_id))]
            if fitting:
                return WorkerPlacement(data_center_id=dc_id, pool=pool, gpu_type_id=fitting[0].id)
    return None


def allowed_data_centers(spec: dict[str, Any], pinned_to: str | None = None) -> list[str]:
    """The datacenters of the catalog an endpoint allows (its `dataCenterIds` in their order; none listed: all, in
    catalog order), narrowed to `pinned_to` when given."""
    allowed = [dc for dc in (spec.get("dataCenterIds") or DATA_CENTER_IDS) if dc in _DC_BY_ID]
    if pinned_to is not None:  # RunPod starts the workers of an endpoint with a network volume in its datacenter
        allowed = [dc for dc in allowed if dc == pinned_to]
    return allowed


def endpoint_gpu_types(gpu: dict[str, Any], pool: str, data_center_id: str) -> list[GpuTypeRow]:
    """The types of one of an endpoint's pools that a datacenter offers, less the endpoint's `excludedTypes`. A type
    listed at level NONE (a recorded catalog's: offered there, without stock when recorded) is not offered."""
    excluded = {name.strip() for name in gpu.get("excludedTypes") or ()}
    offers = _DC_BY_ID[data_center_id].offers
    return [g for g in GPU_TYPES if g.pool == pool and g.id not in excluded and offers.get(g.id, "NONE") != "NONE"]


def selection_problem(gpu: dict[str, Any]) -> str | None:
    """Why RunPod refuses an endpoint's GPU selection (`gpu.pools` less `gpu.excludedTypes`), or None. RunPod's
    schema: an excluded type that is not a GPU type of one of the pools is rejected (400), surrounding whitespace
    trimmed, and so is a selection that leaves no type. A pool missing from the table holds types localpod does not
    know, so exclusions next to one are taken as they are."""
    pools = list(gpu.get("pools") or ())
    excluded = {name.strip() for name in gpu.get("excludedTypes") or ()}
    if not excluded or any(pool not in KNOWN_POOLS for pool in pools):
        return None
    in_pools = {g.id for g in GPU_TYPES if g.pool in pools}
    strangers = sorted(excluded - in_pools)
    if strangers:
        return (f"gpu.excludedTypes: {', '.join(strangers)} is not a GPU type of the pools {', '.join(pools)} "
                f"(their types: {', '.join(sorted(in_pools))}); GET /v2/catalog/gpus gives each type's pool")
    if in_pools <= excluded:
        return f"gpu.excludedTypes excludes every GPU type of the pools {', '.join(pools)}: keep at least one"
    return None


def cuda_version(text: str) -> tuple[int, ...]:
    """A CUDA version as a comparable tuple. As a `minCudaVersion` floor, "12" admits any 12.x (versions are
    compared on as many parts as the floor has)."""
    return tuple(int(part) for part in text.split("."))


# --- which catalog is served: the tables above, or a recorded one ----------------------------------------


@dataclass(frozen=True)
class CatalogTables:
    """Everything the catalog serves and places by: GPU types, datacenters (with their offers and hosts' CUDA), CPU
    flavors and each pool's serverless price."""

    gpu_types: tuple[GpuTypeRow, ...]
    data_centers: tuple[DataCenterRow, ...]
    cpu_types: tuple[CpuTypeRow, ...]
    pool_serverless_usd_per_hour: dict[str, float]


def served() -> CatalogTables:
    """The tables served now."""
    return CatalogTables(GPU_TYPES, DATA_CENTERS, CPU_TYPES, dict(POOL_SERVERLESS_USD_PER_HOUR))


def serve(tables: CatalogTables) -> CatalogTables:
    """Serve `tables` from now on, in this whole process, and return the tables served until now.

    Every route, rule and placement reads this module's tables, so a process serves one catalog: `python -m localpod
    --catalog-from DIR` calls this once, before the server is made (`localpod/recorded_catalog.py` makes the tables).
    """
    global GPU_TYPES, DATA_CENTERS, CPU_TYPES, POOL_SERVERLESS_USD_PER_HOUR, DATA_CENTER_IDS, CPU_FLAVOR_IDS
    global KNOWN_POOLS, _GPU_BY_ID, _DC_BY_ID, _CPU_BY_ID
    before = served()
    GPU_TYPES, DATA_CENTERS, CPU_TYPES = tables.gpu_types, tables.data_centers, tables.cpu_types
    POOL_SERVERLESS_USD_PER_HOUR = dict(tables.pool_serverless_usd_per_hour)
    DATA_CENTER_IDS = tuple(dc.id for dc in DATA_CENTERS)
    CPU_FLAVOR_IDS = tuple(c.id for c in CPU_TYPES)
    KNOWN_POOLS = tuple(dict.fromkeys(g.pool for g in GPU_TYPES if g.pool is not None))
    _GPU_BY_ID = {g.id: g for g in GPU_TYPES}
    _DC_BY_ID = {dc.id: dc for dc in DATA_CENTERS}
    _CPU_BY_ID = {c.id: c for c in CPU_TYPES}
    return before
