"""The GPU classes loraflow can rent on RunPod serverless, and how to ask for exactly one of them.

Prices are static list prices for cost estimates, not quotes; RunPod bills per second of worker time. Pools, and
the cards excluded to pin a class inside its pool, are what RunPod's catalog says when it can be read
(`live_catalog.py`); this table is the fallback.
"""

from __future__ import annotations

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
    usd_per_hour: float = Field(description="Static list price per GPU-hour.")


GPU_CLASSES: dict[str, GpuClass] = {
    g.name: g
    for g in (
        GpuClass(name="RTX 4090", card="NVIDIA GeForce RTX 4090", pool="ADA_24", vram_gb=24, sm=89, min_cuda="12.8",
                 usd_per_hour=0.69),
        GpuClass(name="RTX 5090", card="NVIDIA GeForce RTX 5090", pool="ADA_32_PRO", vram_gb=32, sm=120,
                 min_cuda="13.0", usd_per_hour=0.99),
        GpuClass(name="A100 PCIe", card="NVIDIA A100 80GB PCIe", pool="AMPERE_80", exclude=("NVIDIA A100-SXM4-80GB",),
                 vram_gb=80, sm=80, min_cuda="12.8", usd_per_hour=1.39),
        GpuClass(name="A100 SXM", card="NVIDIA A100-SXM4-80GB", pool="AMPERE_80", exclude=("NVIDIA A100 80GB PCIe",),
                 vram_gb=80, sm=80, min_cuda="12.8", usd_per_hour=1.49),
        # RunPod's SDK maps ADA_80_PRO to the H100 SXM (80GB HBM3) alone, and RunPod refuses (400) an excluded type
        # that is not in the pool: nothing to exclude unless the catalog lists other cards there.
        GpuClass(name="H100", card="NVIDIA H100 80GB HBM3", pool="ADA_80_PRO", vram_gb=80, sm=90, min_cuda="12.8",
                 usd_per_hour=3.29),
        GpuClass(name="H200", card="NVIDIA H200", pool="HOPPER_141", vram_gb=141, sm=90, min_cuda="12.8",
                 usd_per_hour=4.39),
        GpuClass(name="RTX PRO 6000", card="NVIDIA RTX PRO 6000 Blackwell Server Edition", pool="BLACKWELL_96",
                 vram_gb=96, sm=120, min_cuda="13.0", usd_per_hour=2.09),
        GpuClass(name="B200", card="NVIDIA B200", pool="BLACKWELL_180", vram_gb=180, sm=100, min_cuda="13.0",
                 usd_per_hour=5.89),
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
