"""The GPU classes loraflow can rent on RunPod serverless, and how to ask for exactly one of them; the limits of
RunPod's serverless CPU workers, which its catalog does not state.

Prices are fallback list prices (RunPod's published serverless rates) for cost estimates when the live catalog has no
price, not quotes; RunPod bills per second of worker time. Pools, and the cards excluded to pin a class inside its
pool, are what RunPod's catalog says when it can be read (`live_catalog.py`); this table is the fallback.
"""

from __future__ import annotations

import re

from pydantic import BaseModel, Field


class GpuClass(BaseModel):
    name: str = Field(description="loraflow's name for the card.")
    card: str = Field(description="RunPod's GPU type id of the card (the `id` of `GET /v2/catalog/gpus`).")
    pool: str = Field(description="RunPod serverless pool id (`gpu.pools`).")
    exclude: tuple[str, ...] = Field(
        default=(), description="GPU type ids to exclude to pin this card inside its pool: the other cards RunPod's "
        "catalog lists in the pool (`live_catalog`), or this table's when the catalog cannot be read.")
    vram_gb: int
    sm: int = Field(description="CUDA compute capability ×10 (sm89 = 89): selects the image build.")
    min_cuda: str = Field(description="Lowest CUDA driver version the worker image needs on this card.")
    usd_per_hour: float = Field(description="Fallback list price per GPU-hour: RunPod's published serverless (flex) "
                                "rate, used when the live catalog has no price.")


# RunPod's published serverless prices, flex workers, per GPU-hour, as issue 37 quotes them (read 2026-12-05): RTX 4090
# 1.12, A100 2.74, H100 4.18, H200 5.58, B200 8.64. Not quoted there, the RTX 5090 and RTX PRO 6000 are this table's
# earlier figures scaled as their nearest quoted card's were: the 5090 by the 4090's 1.12/0.69, the PRO 6000 by the
# B200's 8.64/5.89.
GPU_CLASSES: dict[str, GpuClass] = {
    g.name: g
    for g in (
        GpuClass(name="RTX 4090", card="NVIDIA GeForce RTX 4090", pool="ADA_24", vram_gb=24, sm=89, min_cuda="12.8",
                 usd_per_hour=1.12),
        GpuClass(name="RTX 5090", card="NVIDIA GeForce RTX 5090", pool="ADA_32_PRO", vram_gb=32, sm=120,
                 min_cuda="13.0", usd_per_hour=1.61),
        GpuClass(name="A100 PCIe", card="NVIDIA A100 80GB PCIe", pool="AMPERE_80", exclude=("NVIDIA A100-SXM4-80GB",),
                 vram_gb=80, sm=80, min_cuda="12.8", usd_per_hour=2.74),
        GpuClass(name="A100 SXM", card="NVIDIA A100-SXM4-80GB", pool="AMPERE_80", exclude=("NVIDIA A100 80GB PCIe",),
                 vram_gb=80, sm=80, min_cuda="12.8", usd_per_hour=2.74),
        # RunPod's SDK maps ADA_80_PRO to the H100 SXM (80GB HBM3) alone, and RunPod refuses (400) an excluded type
        # that is not in the pool: nothing to exclude unless the catalog lists other cards there.
        GpuClass(name="H100", card="NVIDIA H100 80GB HBM3", pool="ADA_80_PRO", vram_gb=80, sm=90, min_cuda="12.8",
                 usd_per_hour=4.18),
        GpuClass(name="H200", card="NVIDIA H200", pool="HOPPER_141", vram_gb=141, sm=90, min_cuda="12.8",
                 usd_per_hour=5.58),
        GpuClass(name="RTX PRO 6000", card="NVIDIA RTX PRO 6000 Blackwell Server Edition", pool="BLACKWELL_96",
                 vram_gb=96, sm=120, min_cuda="13.0", usd_per_hour=3.07),
        GpuClass(name="B200", card="NVIDIA B200", pool="BLACKWELL_180", vram_gb=180, sm=100, min_cuda="13.0",
                 usd_per_hour=8.64),
    )
}

_ALIASES = {
    "4090": "RTX 4090",
    "5090": "RTX 5090",
    "a100": "A100 SXM",
    "a100-pcie": "A100 PCIe",
    "a100-sxm": "A100 SXM",
    "h100": "H100",
    "h100-sxm": "H100",
    "h200": "H200",
    "pro6000": "RTX PRO 6000",
    "rtx-pro-6000": "RTX PRO 6000",
    "b200": "B200",
}


def _key(name: str) -> str:
    return name.strip().lower().replace(" ", "-").replace("_", "-")


_BY_KEY = {_key(n): n for n in GPU_CLASSES} | {_key(a): n for a, n in _ALIASES.items()}


def cuda_floor(gpu: GpuClass, image_min_cuda: str) -> str:
    """The lowest host CUDA version a training worker of this class can run on: the card's and the image's."""
    return max(gpu.min_cuda, image_min_cuda, key=cuda_version)


def cuda_version(version: str) -> tuple[int, ...]:
    """A CUDA version as comparable numbers, as RunPod compares them: 12.11 is above 12.2. A floor of "12"
    is (12,), below every 12.x."""
    return tuple(int(part) for part in version.split("."))


def meets_cuda_floor(version: str, floor: str) -> bool:
    """Whether a host on CUDA `version` meets `floor` (compared on as many parts as the floor has)."""
    wanted = cuda_version(floor)
    return cuda_version(version)[: len(wanted)] >= wanted


def resolve_gpu(name: str) -> GpuClass:
    """The GPU class for a name or alias ("h100", "RTX 4090", "4090"); ValueError listing the known ones."""
    canonical = _BY_KEY.get(_key(name))
    if canonical is None:
        known = ", ".join(GPU_CLASSES)
        raise ValueError(f"unknown GPU {name!r}; known GPUs: {known} (aliases: {', '.join(_ALIASES)})")
    return GPU_CLASSES[canonical]


# --- serverless CPU workers --------------------------------------------------------------------------

# RunPod's serverless CPU workers stop at 8 vCPUs (its SDK offers cpu3g-8-32, cpu3c-8-16, cpu5c-8-16; issue 37).
SERVERLESS_CPU_MAX_VCPUS = 8
"""The most vCPUs of a serverless CPU worker. The catalog's `vcpu.max` (32 in the schema's own example) is a flavor's
range with no product named, so it does not raise this."""

# RunPod limits a serverless CPU worker's container disk per vCPU: 10 GB on cpu3c and cpu3g, 15 on cpu5c (issue 37).
SERVERLESS_CPU_DISK_GB_PER_VCPU: dict[str, int] = {"cpu3c": 10, "cpu3g": 10, "cpu5c": 15}
"""GB of container disk a serverless CPU worker may have per vCPU, by flavor (the id an endpoint's `cpu[].id` takes)."""
DEFAULT_CPU_DISK_GB_PER_VCPU = 10
"""The same for a flavor not listed above: the least of the listed, so a new flavor is never given too much disk."""

_LONG_CPU_ID = re.compile(r"(?P<flavor>.+?)-\d+-\d+")


def cpu_flavor_id(catalog_id: str) -> str:
    """The flavor id an endpoint's `cpu[].id` takes (`cpu3c`) for a CPU catalog id in either form: `cpu3c`, or the long
    `cpu3c-2-4` (flavor, vCPUs, GB of RAM) that `GET /v2/catalog/cpus` may answer (the schema's own example)."""
    long_form = _LONG_CPU_ID.fullmatch(catalog_id)
    return long_form.group("flavor") if long_form else catalog_id


def serverless_cpu_disk_gb_per_vcpu(flavor: str) -> int:
    """GB of container disk a serverless worker of the CPU flavor may have per vCPU."""
    return SERVERLESS_CPU_DISK_GB_PER_VCPU.get(cpu_flavor_id(flavor), DEFAULT_CPU_DISK_GB_PER_VCPU)
