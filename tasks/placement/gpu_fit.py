"""Renting only where the run can work: each GPU class's card in its pool as RunPod's live catalog lists it; each
class's hosts' CUDA versions, from the same catalog, against the CUDA floor of the image and the card; and each
class's memory against the run's memory plan (`loraflow_worker.memory.plan`, the worker's own planner); all before
anything is rented.

An endpoint whose `minCudaVersion` no host of its GPU offers is never served: its job sits IN_QUEUE until
the attempt gives the GPU up as "no capacity", and the run walks its list to the same end. The catalog's
`cudaVersions` say beforehand which GPU classes have such hosts at all; the stock read with
`minCudaVersion` (`live_catalog.gpu_offers` with floors) says where they are now.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from loraflow_worker.memory.plan import MemoryPlan
from pydantic import BaseModel, Field

from tasks.placement.cost import read_gpu_prices
from tasks.runpod.catalog import GPU_CLASSES, GpuClass, cuda_floor, meets_cuda_floor
from tasks.runpod.live_catalog import GpuOffer

GIB = 2**30
"""RunPod's catalog gives GPU memory in GB that are GiB (an RTX 4090's 24 GB are 24 GiB)."""


class NoGpuInPool(ValueError):
    """No GPU class of the run has its card in its pool by RunPod's catalog: refused before renting."""


def pooled_gpus(gpus: Sequence[GpuClass], offers: dict[str, GpuOffer]) -> tuple[list[GpuClass], list[str]]:
    """The classes whose card RunPod's catalog lists in their pool, in order, each pinned as its offer says (the other
    cards of the pool excluded), and why each of the others is left out (naming the class and the pool). With the
    catalog unreadable, the static table's classes as they are. When none is left, `NoGpuInPool` names each."""
    kept = [offers[gpu.name].pinned(gpu) for gpu in gpus if offers[gpu.name].not_in_pool is None]
    left_out = [offers[gpu.name].not_in_pool or "" for gpu in gpus if offers[gpu.name].not_in_pool is not None]
    if not kept:
        raise NoGpuInPool(
            "no GPU class of compute.gpu can be rented as RunPod's catalog lists the pools now: " + "; ".join(left_out)
            + ". Fix: add a GPU class whose card is in its pool to compute.gpu, or bring loraflow's class table "
            "(tasks/runpod/catalog.py) up to date with the catalog.")
    return kept, left_out


class NoHostForImage(ValueError):
    """No GPU class of the run has hosts that run the worker image's CUDA: refused before renting."""


class CudaFit(BaseModel):
    """One GPU class's hosts against the CUDA floor its workers need."""

    gpu: str = Field(description="loraflow's name for the GPU class.")
    floor: str = Field(description="The lowest host CUDA version its workers run on (`catalog.cuda_floor`).")
    host_versions: list[str] = Field(description="CUDA versions its hosts run, per RunPod's catalog; empty: none, "
                                     "or unknown when `known` is false.")
    known: bool = Field(description="Whether the catalog said: false when it could not be read (static price).")

    @property
    def meets(self) -> bool:
        """Whether some host meets the floor; an unknown catalog does not exclude the class (RunPod still
        honours the endpoint's floor, and the attempt's queue allowance ends a wait for hosts that never come)."""
        return not self.known or any(meets_cuda_floor(v, self.floor) for v in self.host_versions)

    def describe(self) -> str:
        if not self.known:
            return f"{self.gpu}: hosts' CUDA versions unknown (RunPod's catalog could not be read); needs >= {self.floor}"
        offered = ", ".join(self.host_versions) or "none"
        verdict = "meets" if self.meets else "below"
        return f"{self.gpu}: hosts run CUDA {offered}; needs >= {self.floor} ({verdict})"


def cuda_fits(gpus: Sequence[GpuClass], offers: dict[str, GpuOffer], floors: Sequence[str]) -> list[CudaFit]:
    """Each class's hosts against its floor, in order."""
    return [CudaFit(gpu=gpu.name, floor=floor, host_versions=offers[gpu.name].cuda_versions,
                    known=offers[gpu.name].source == "catalog")
            for gpu, floor in zip(gpus, floors, strict=True)]


def placeable_gpus(
    gpus: Sequence[GpuClass],
    offers: dict[str, GpuOffer],
    floors: Sequence[str],
    alternatives: Callable[[], list[CudaFit]] = list,
) -> tuple[list[GpuClass], list[CudaFit]]:
    """The classes whose hosts meet their floor, in order, and the fits of those left out. When none is left,
    `NoHostForImage` names each class, the versions its hosts run, the floor, and the fix (with the classes
    of `alternatives()` whose hosts would do)."""
    fits = cuda_fits(gpus, offers, floors)
    kept = [gpu for gpu, fit in zip(gpus, fits, strict=True) if fit.meets]
    excluded = [fit for fit in fits if not fit.meets]
    if kept:
        return kept, excluded
    others = [fit.gpu for fit in alternatives() if fit.known and fit.meets and fit.gpu not in {g.name for g in gpus}]
    suggestion = (f"add a GPU whose hosts do to compute.gpu ({', '.join(others)} per RunPod's catalog now)"
                  if others else "add a GPU whose hosts do to compute.gpu")
    raise NoHostForImage(
        "no GPU of compute.gpu has hosts that run the worker image, so an endpoint would wait in RunPod's queue "
        "and never be served: " + "; ".join(fit.describe() for fit in excluded) + ". The floor is the higher of "
        "the card's and the image's (LORAFLOW_IMAGE_MIN_CUDA: the CUDA build of the image's torch). Fix: "
        f"{suggestion}, or run an image built for the hosts' CUDA and set LORAFLOW_IMAGE_MIN_CUDA to its floor."
    )


def catalog_fits(image_min_cuda: str) -> list[CudaFit]:
    """Every GPU class loraflow knows against its floor, from the same (cached) catalog read: the alternatives
    a refusal names."""
    gpus = list(GPU_CLASSES.values())
    offers = {offer.gpu: offer for offer in read_gpu_prices(gpus, log=False)}
    return cuda_fits(gpus, offers, [cuda_floor(gpu, image_min_cuda) for gpu in gpus])


class NoGpuFits(ValueError):
    """The run's memory plan fits no GPU of its list: refused before renting."""


class MemoryFit(BaseModel):
    """One GPU class against the run's memory plan (`loraflow_worker.memory.plan`), gradient checkpointing on."""

    gpu: str = Field(description="loraflow's name for the GPU class.")
    memory_gib: float = Field(description="The GPU's memory, GiB.")
    estimate_gib: float = Field(description="The run's estimated peak GPU memory with gradient checkpointing, GiB.")
    usable_gib: float = Field(description="What the plan may count on of the GPU's memory, GiB.")
    fits: bool

    def describe(self) -> str:
        verdict = "fits" if self.fits else "does not fit"
        return (f"{self.gpu} ({self.memory_gib:.0f} GiB): needs ~{self.estimate_gib:.1f} GiB of {self.usable_gib:.1f} "
                f"GiB usable ({verdict})")


def memory_fit(gpu: GpuClass, plan_for: Callable[[int], MemoryPlan]) -> MemoryFit:
    """`plan_for(gpu_memory_bytes)`: the run's plan on a GPU of that much memory."""
    plan = plan_for(gpu.vram_gb * GIB)
    return MemoryFit(gpu=gpu.name, memory_gib=gpu.vram_gb, estimate_gib=plan.estimate_with_checkpointing_bytes / GIB,
                     usable_gib=plan.usable_bytes / GIB, fits=plan.fits)


def gpus_that_fit(gpus: Sequence[GpuClass], plan_for: Callable[[int], MemoryPlan],
                  quantized_plan_for: Callable[[int], MemoryPlan] | None = None) -> tuple[list[GpuClass], list[MemoryFit]]:
    """The classes on which the run fits even with gradient checkpointing, in order, and the fits of those left out.
    When none is left, `NoGpuFits` names the estimate, each GPU, the smallest GPU class that would fit, and (given
    `quantized_plan_for`, the same run in 4 bits) whether QLoRA would."""
    fits = [memory_fit(gpu, plan_for) for gpu in gpus]
    kept = [gpu for gpu, fit in zip(gpus, fits, strict=True) if fit.fits]
    excluded = [fit for fit in fits if not fit.fits]
    if kept:
        return kept, excluded
    by_size = sorted(GPU_CLASSES.values(), key=lambda g: (g.vram_gb, g.usd_per_hour))
    bigger = next((fit for fit in (memory_fit(g, plan_for) for g in by_size) if fit.fits), None)
    fixes = [f"add {bigger.gpu} ({bigger.memory_gib:.0f} GiB) to compute.gpu" if bigger else
             "no GPU class loraflow rents holds it: lower training.batch_size or max_seq_length"]
    if quantized_plan_for is not None:
        quantized = next((fit for fit in (memory_fit(g, quantized_plan_for) for g in by_size) if fit.fits), None)
        if quantized is not None:
            fixes.append(f'set lora.quantization = "4bit" (QLoRA: ~{quantized.estimate_gib:.1f} GiB, fits {quantized.gpu})')
    fixes.append("lower training.batch_size or max_seq_length")
    raise NoGpuFits(
        "the run fits no GPU of compute.gpu, even with gradient checkpointing, so an attempt would run out of memory: "
        + "; ".join(fit.describe() for fit in excluded) + ". Fix: " + ", or ".join(fixes) + "."
    )
