"""Placement: a GPU class is rented only when some of its hosts run the CUDA its workers need."""

import pytest

from tasks.placement.gpu_fit import (
    NoGpuFits,
    NoGpuInPool,
    NoHostForImage,
    cuda_fits,
    gpus_that_fit,
    placeable_gpus,
    pooled_gpus,
)
from tasks.runpod.catalog import cuda_floor, meets_cuda_floor, resolve_gpu
from tasks.runpod.live_catalog import GpuOffer, static_offer

RTX_4090, H100, B200 = resolve_gpu("4090"), resolve_gpu("h100"), resolve_gpu("b200")


def offer(gpu, versions):
    return GpuOffer(gpu=gpu.name, pool=gpu.pool, usd_per_hour=1.0, source="catalog", cuda_versions=versions)


@pytest.mark.parametrize(("version", "floor", "meets"), [("13.0", "13.0", True), ("12.9", "13.0", False),
                                                         ("12.11", "12.8", True), ("12.4", "12", True),
                                                         ("11.8", "12", False)])
def test_a_host_meets_a_floor_compared_as_numbers(version, floor, meets):
    assert meets_cuda_floor(version, floor) is meets


def test_gpus_whose_hosts_meet_the_floor_are_kept_in_order_and_the_others_named():
    offers = {RTX_4090.name: offer(RTX_4090, ["12.4", "12.8", "13.0"]), H100.name: offer(H100, ["12.4", "12.9"])}
    kept, excluded = placeable_gpus([H100, RTX_4090], offers, ["13.0", "13.0"])
    assert kept == [RTX_4090]
    assert [fit.gpu for fit in excluded] == ["H100"]
    assert "12.4, 12.9" in excluded[0].describe() and ">= 13.0" in excluded[0].describe()


def test_a_run_no_host_can_serve_is_refused_naming_each_gpu_the_versions_the_floor_and_the_fix():
    offers = {RTX_4090.name: offer(RTX_4090, ["12.4", "12.8"]), H100.name: offer(H100, [])}
    alternatives = cuda_fits([B200], {B200.name: offer(B200, ["12.8", "13.0"])}, ["13.0"])
    with pytest.raises(NoHostForImage) as refused:
        placeable_gpus([RTX_4090, H100], offers, ["13.0", "13.0"], alternatives=lambda: alternatives)
    message = str(refused.value)
    assert "RTX 4090: hosts run CUDA 12.4, 12.8; needs >= 13.0" in message
    assert "H100: hosts run CUDA none" in message
    assert "compute.gpu" in message and "B200" in message and "LORAFLOW_IMAGE_MIN_CUDA" in message


def test_an_unreadable_catalog_excludes_nothing():
    offers = {RTX_4090.name: static_offer(RTX_4090, "the catalog could not be read")}
    kept, excluded = placeable_gpus([RTX_4090], offers, [cuda_floor(RTX_4090, "13.0")])
    assert kept == [RTX_4090] and excluded == []


def _plan_on(estimate_gib):
    """A stand-in for the planner (the real one's figures are the worker's tests'): a run needing `estimate_gib`
    with checkpointing on any GPU, of which 90 % is usable."""
    def plan(gpu_memory_bytes):
        class Plan:
            estimate_with_checkpointing_bytes = int(estimate_gib * 2**30)
            usable_bytes = int(gpu_memory_bytes * 0.9)
            fits = estimate_with_checkpointing_bytes <= usable_bytes
        return Plan()
    return plan


def test_gpus_the_run_does_not_fit_are_left_out_in_order():
    kept, excluded = gpus_that_fit([RTX_4090, H100], _plan_on(40))
    assert kept == [H100]
    assert [fit.gpu for fit in excluded] == ["RTX 4090"] and "needs ~40.0 GiB" in excluded[0].describe()


def test_a_run_that_fits_no_gpu_is_refused_naming_the_estimate_the_gpu_that_would_fit_and_qlora():
    with pytest.raises(NoGpuFits) as refused:
        gpus_that_fit([RTX_4090, H100], _plan_on(120), quantized_plan_for=_plan_on(40))
    message = str(refused.value)
    assert "RTX 4090 (24 GiB): needs ~120.0 GiB" in message and "H100 (80 GiB)" in message
    assert "add H200 (141 GiB) to compute.gpu" in message
    assert 'lora.quantization = "4bit"' in message


# --- each class's card in its pool, as RunPod's catalog lists it ------------------------------------------------


def test_a_class_whose_card_is_not_in_its_pool_is_left_out_and_the_others_are_pinned_as_the_catalog_says():
    missing = "GPU class H100: RunPod's catalog does not list its card NVIDIA H100 80GB HBM3 in pool ADA_80_PRO"
    offers = {H100.name: static_offer(H100, missing).model_copy(update={"not_in_pool": missing}),
              RTX_4090.name: offer(RTX_4090, ["12.8"]).model_copy(update={"exclude": ["NVIDIA L4"]})}
    kept, left_out = pooled_gpus([H100, RTX_4090], offers)
    assert [g.name for g in kept] == ["RTX 4090"] and kept[0].exclude == ("NVIDIA L4",)
    assert left_out == [missing]


def test_a_run_none_of_whose_classes_is_in_its_pool_is_refused_naming_each():
    missing = "GPU class H100: RunPod's catalog does not list its card NVIDIA H100 80GB HBM3 in pool ADA_80_PRO"
    offers = {H100.name: static_offer(H100, missing).model_copy(update={"not_in_pool": missing})}
    with pytest.raises(NoGpuInPool, match="GPU class H100.*pool ADA_80_PRO.*compute.gpu"):
        pooled_gpus([H100], offers)
