"""Renting only where the worker image runs: each GPU class's hosts' CUDA versions, from RunPod's live
catalog, against the CUDA floor of the image and the card, before anything is rented.

An endpoint whose `minCudaVersion` no host of its GPU offers is never served: its job sits IN_QUEUE until
the attempt gives the GPU up as "no capacity", and the run walks its list to the same end. The catalog's
`cudaVersions` say beforehand which GPU classes have such hosts at all; the stock read with
`minCudaVersion` (`live_catalog.gpu_offers` with floors) says where they are now.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pydantic import BaseModel, Field

from tasks.cost import read_gpu_prices
from tasks.runpod.catalog import GPU_CLASSES, GpuClass, cuda_floor, meets_cuda_floor
from tasks.runpod.live_catalog import GpuOffer


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
