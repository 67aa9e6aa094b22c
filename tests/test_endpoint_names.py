"""Endpoint names: recognisable, unique per run and attempt, derivable from the run id alone."""

import pytest

from tasks.runpod.catalog import GPU_CLASSES, resolve_gpu
from tasks.runpod.endpoints import ENDPOINT_PREFIX, MAX_ENDPOINT_NAME, build_create_request, endpoint_name


def test_name_has_prefix_label_run_hash_and_attempt():
    name = endpoint_name("3f1c-run", 2, "my-run")
    assert name.startswith(f"{ENDPOINT_PREFIX}my-run-")
    assert name.endswith("-a2")


def test_names_differ_per_run_and_per_attempt():
    names = {endpoint_name(run, attempt, "x") for run in ("r1", "r2") for attempt in (1, 2)}
    assert len(names) == 4


def test_name_is_stable_for_the_same_run_and_attempt():
    assert endpoint_name("r1", 1, "x") == endpoint_name("r1", 1, "x")


@pytest.mark.parametrize("label", ['evil"; DROP', "ÜBER run!!", "a" * 200, "--", ""])
def test_hostile_or_long_labels_are_sanitised_and_bounded(label):
    name = endpoint_name("run-id", 1, label)
    assert len(name) <= MAX_ENDPOINT_NAME
    assert all(c.isascii() and (c.islower() or c.isdigit() or c == "-") for c in name)
    assert "--" not in name


def test_create_request_pins_one_worker_and_the_card():
    request = build_create_request(name="loraflow-x", gpu=resolve_gpu("h100"), gpu_count=1, image="img", env={},
                                   disk_gb=40, execution_timeout_s=600)
    wire = request.to_wire()
    assert wire["workers"]["max"] == 1
    assert wire["gpu"]["pools"] == ["ADA_80_PRO"]
    assert set(wire["gpu"]["excludedTypes"]) == {"NVIDIA H100 PCIe", "NVIDIA H100 NVL"}
    assert wire["timeout"] == 600_000


def test_catalog_has_the_known_gpus_and_aliases():
    assert {"RTX 4090", "H100", "H200", "B200"} <= set(GPU_CLASSES)
    assert resolve_gpu("4090").pool == "ADA_24"
    with pytest.raises(ValueError, match="known GPUs"):
        resolve_gpu("v100")


def test_endpoint_asks_for_the_higher_of_the_cards_and_the_images_cuda():
    common = dict(name="loraflow-x", gpu_count=1, image="img", env={}, disk_gb=40, execution_timeout_s=600)
    h100 = build_create_request(gpu=resolve_gpu("h100"), image_min_cuda="13.0", **common)
    assert h100.gpu.min_cuda_version == "13.0"
    b200 = build_create_request(gpu=resolve_gpu("b200"), image_min_cuda="12.11", **common)
    assert b200.gpu.min_cuda_version == "13.0"
    assert build_create_request(gpu=resolve_gpu("h100"), image_min_cuda="12.11", **common).gpu.min_cuda_version == "12.11"
