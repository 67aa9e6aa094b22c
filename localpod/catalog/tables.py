"""The catalog's tables: the GPU types (their pools, memory, prices and hosts' CUDA versions), the CPU flavors, the
datacenters with what each offers, each pool's serverless price, and the lookups and defaults read from them.

The built-in tables stand in for RunPod's live catalog: the GPU types of the pools loraflow rents, with their memory
and list prices, a few CPU flavors with their vCPU ranges, RAM per vCPU and prices per vCPU, a handful of
datacenters with what each offers (GPU types, CPU flavors, network volume tiers), and the CUDA versions the
hosts of each GPU type run in each datacenter. Serverless GPU prices are RunPod-like figures chosen to
differ from loraflow's static table, so a test can tell which of the two a cost came from.

Hosts' CUDA versions (localpod's assumption, not a RunPod fact: RunPod publishes only the union per GPU
type, `cudaVersions`): the hosts of the Ampere, Ada and Hopper types run CUDA 12.4, 12.6, 12.8, 12.9
and 13.0 in US-KS-2, US-CA-2, EU-RO-1 and EU-CZ-1, but only 12.4, 12.6 and 12.8 in US-TX-3 (older
drivers there); the Blackwell types (RTX 5090, RTX PRO 6000, B200) run 12.8, 12.9 and 13.0 wherever
they are offered. So an endpoint whose image needs CUDA 13 can be served by an RTX 4090 in EU-RO-1 but
not in US-TX-3 (`placement.place`).

EU-CZ-1 offers no CPU flavor, so an endpoint pinned there by its network volume must run on a GPU.

Neither stock nor the hosts' versions nor the volume tiers in force are here: `FaultBook` (`faults/book.py`) keeps
what `/_localpod/stock` and `/_localpod/cpu-stock` took out, what `/_localpod/cuda` set and what
`/_localpod/volume-types` changed, and the catalog's functions take them as `in_stock(pool, data_center_id)`,
`in_stock(cpu_flavor_id, data_center_id)` and `host_cuda(gpu_type_id, data_center_id)` callables.

`serve` puts a real account's catalog in place of these tables, for the whole process (`python -m localpod
--catalog-from DIR`; the tables come from `recorded.py`). It rebinds this module's names, so every reader reads
them through the module (`tables.GPU_TYPES`), never as a name imported once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

AvailabilityLevel = Literal["NONE", "LOW", "MEDIUM", "HIGH"]
InStock = Callable[[str, str], bool]
"""`in_stock(pool, data_center_id)`: False once `/_localpod/stock` took the pool out there."""
HostCuda = Callable[[str, str], tuple[str, ...]]
"""`host_cuda(gpu_type_id, data_center_id)`: the CUDA versions that type's hosts run there, sorted by version
(empty: none reported, or the type is not offered there)."""

POOL_SERVERLESS_USD_PER_HOUR: dict[str, float] = {
    # RunPod quotes one serverless rate per pool (`price.serverless` is "the rate for this GPU's pool"). loraflow's
    # fallback table holds RunPod's published rates (1.12, 4.18, 5.58, 8.64 here), so these are about 5 % below them
    # where they would be equal: a test tells a catalog price from a fallback one by its figure.
    "ADA_24": 1.06,
    "ADA_32_PRO": 1.58,
    "AMPERE_80": 2.72,
    "ADA_80_PRO": 3.97,
    "HOPPER_141": 5.30,
    "BLACKWELL_96": 3.02,
    "BLACKWELL_180": 8.21,
}


# RunPod's serverless CPU workers stop at 8 vCPUs (its SDK offers cpu3g-8-32, cpu3c-8-16, cpu5c-8-16; issue 37).
SERVERLESS_CPU_VCPU_MAX = 8
# RunPod limits a serverless CPU worker's container disk per vCPU: 10 GB on cpu3c and cpu3g, 15 on cpu5c (issue 37).
SERVERLESS_CPU_DISK_GB_PER_VCPU = {"cpu3c": 10, "cpu3g": 10, "cpu5c": 15}


@dataclass(frozen=True)
class CpuTypeRow:
    """One CPU flavor, as `CpuType` describes it: an endpoint picks a flavor and a vCPU count in its range; its
    RAM is the count times `ram_gb_per_vcpu`, its price the count times the per-vCPU figure (USD per hour, as
    `GpuType.price` quotes GPUs). Asked with product=SERVERLESS, the catalog answers `serverless_vcpu_max` as its
    most vCPUs (a recording: what RunPod answered); an endpoint's worker has at most `SERVERLESS_CPU_VCPU_MAX` vCPUs
    and `serverless_disk_gb_per_vcpu` GB of container disk per vCPU, whatever the catalog says."""

    id: str
    name: str
    group: str
    vcpu_min: int
    vcpu_max: int
    ram_gb_per_vcpu: float
    secure_usd_per_vcpu: float
    serverless_usd_per_vcpu: float
    serverless_vcpu_max: int = SERVERLESS_CPU_VCPU_MAX
    serverless_disk_gb_per_vcpu: int = min(SERVERLESS_CPU_DISK_GB_PER_VCPU.values())  # a flavor not listed: the least

    def memory_gb(self, vcpu_count: int) -> int:
        """`CpuConfig.memory`: RunPod derives it from the flavor's RAM multiplier."""
        return max(1, round(vcpu_count * self.ram_gb_per_vcpu))

    def vcpu_range(self, serverless: bool) -> tuple[int, int]:
        """The fewest and most vCPUs the catalog answers: for serverless (product=SERVERLESS alone), or the flavor's."""
        return self.vcpu_min, min(self.vcpu_max, self.serverless_vcpu_max) if serverless else self.vcpu_max

    def worker_vcpu_range(self) -> tuple[int, int]:
        """The fewest and most vCPUs of a serverless endpoint's worker of the flavor."""
        return self.vcpu_min, min(self.vcpu_max, SERVERLESS_CPU_VCPU_MAX)


CPU_TYPES: tuple[CpuTypeRow, ...] = (
    # RAM per vCPU as RunPod's Flash docs list the flavors (cpu3c-2-4, cpu5c-4-8: 2 GB per vCPU; the general-purpose
    # "g" flavors 4 GB). cpu3c's prices are the schema's own example (0.04 secure, 0.03 serverless per vCPU); the
    # search found no published serverless CPU price list, so cpu3g's and cpu5c's are plausible figures above it.
    # Asked with product=SERVERLESS, each answers what a serverless worker may be (`serverless_vcpu_max`).
    CpuTypeRow("cpu3c", "Compute-Optimized", "Gen 3", 2, 32, 2.0, 0.04, 0.03,
               serverless_disk_gb_per_vcpu=SERVERLESS_CPU_DISK_GB_PER_VCPU["cpu3c"]),
    CpuTypeRow("cpu3g", "General Purpose", "Gen 3", 2, 32, 4.0, 0.05, 0.04,
               serverless_disk_gb_per_vcpu=SERVERLESS_CPU_DISK_GB_PER_VCPU["cpu3g"]),
    CpuTypeRow("cpu5c", "Compute-Optimized", "Gen 5", 2, 32, 2.0, 0.06, 0.05,
               serverless_disk_gb_per_vcpu=SERVERLESS_CPU_DISK_GB_PER_VCPU["cpu5c"]),
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
GPU_BY_ID = {g.id: g for g in GPU_TYPES}
DC_BY_ID = {dc.id: dc for dc in DATA_CENTERS}
CPU_BY_ID = {c.id: c for c in CPU_TYPES}
CPU_FLAVOR_IDS: tuple[str, ...] = tuple(c.id for c in CPU_TYPES)
KNOWN_POOLS: tuple[str, ...] = tuple(dict.fromkeys(g.pool for g in GPU_TYPES if g.pool is not None))


def gpu_type(type_id: str) -> GpuTypeRow | None:
    return GPU_BY_ID.get(type_id)


def data_center(data_center_id: str) -> DataCenterRow | None:
    return DC_BY_ID.get(data_center_id)


def cpu_type(flavor_id: str) -> CpuTypeRow | None:
    return CPU_BY_ID.get(flavor_id)


def default_volume_types() -> dict[str, tuple[str, ...]]:
    """A fresh copy of the default volume tiers: datacenter id → the tiers it offers, its primary one first."""
    return {dc.id: dc.network_volume_types for dc in DATA_CENTERS}


def offered_in(row: GpuTypeRow) -> list[str]:
    """The datacenters offering this GPU type, in catalog order."""
    return [dc.id for dc in DATA_CENTERS if row.id in dc.offers]


def default_host_cuda(type_id: str, data_center_id: str) -> tuple[str, ...]:
    """The CUDA versions this type's hosts run in this datacenter by default (a `HostCuda`); () where the
    datacenter does not offer the type."""
    row, dc = GPU_BY_ID.get(type_id), DC_BY_ID.get(data_center_id)
    if row is None or dc is None or type_id not in dc.offers:
        return ()
    return dc.host_cuda.get(type_id, row.host_cuda)


def default_host_table() -> dict[str, dict[str, tuple[str, ...]]]:
    """A fresh copy of the default hosts: GPU type id → datacenter offering it → its hosts' CUDA versions."""
    return {row.id: {dc_id: default_host_cuda(row.id, dc_id) for dc_id in offered_in(row)} for row in GPU_TYPES}


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
    --catalog-from DIR` calls this once, before the server is made (`recorded.py` makes the tables).
    """
    global GPU_TYPES, DATA_CENTERS, CPU_TYPES, POOL_SERVERLESS_USD_PER_HOUR, DATA_CENTER_IDS, CPU_FLAVOR_IDS
    global KNOWN_POOLS, GPU_BY_ID, DC_BY_ID, CPU_BY_ID
    before = served()
    GPU_TYPES, DATA_CENTERS, CPU_TYPES = tables.gpu_types, tables.data_centers, tables.cpu_types
    POOL_SERVERLESS_USD_PER_HOUR = dict(tables.pool_serverless_usd_per_hour)
    DATA_CENTER_IDS = tuple(dc.id for dc in DATA_CENTERS)
    CPU_FLAVOR_IDS = tuple(c.id for c in CPU_TYPES)
    KNOWN_POOLS = tuple(dict.fromkeys(g.pool for g in GPU_TYPES if g.pool is not None))
    GPU_BY_ID = {g.id: g for g in GPU_TYPES}
    DC_BY_ID = {dc.id: dc for dc in DATA_CENTERS}
    CPU_BY_ID = {c.id: c for c in CPU_TYPES}
    return before
