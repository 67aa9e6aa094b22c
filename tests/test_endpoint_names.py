"""Endpoint names: recognisable, unique per run and attempt, tagged with their control plane, derivable
from the run id alone."""

import httpx
import pytest

from tasks.runpod.catalog import GPU_CLASSES, cuda_floor, resolve_gpu
from tasks.runpod.client import RunpodClient
from tasks.runpod.endpoints import (
    ENDPOINT_PREFIX,
    MAX_ENDPOINT_NAME,
    EndpointName,
    build_create_request,
    endpoint_name,
    parse_endpoint_name,
    run_endpoints,
    run_hash,
)
from tasks.settings import Settings

NS = "k7q2mx"


def test_name_has_prefix_label_run_hash_namespace_and_attempt():
    name = endpoint_name("3f1c-run", 2, "my-run", namespace=NS)
    assert name == f"{ENDPOINT_PREFIX}my-run-{run_hash('3f1c-run')}-{NS}-a2"


def test_names_differ_per_run_attempt_and_control_plane():
    names = {endpoint_name(run, attempt, "x", namespace=ns) for run in ("r1", "r2") for attempt in (1, 2)
             for ns in (NS, "staging")}
    assert len(names) == 8


def test_name_is_stable_for_the_same_run_and_attempt():
    assert endpoint_name("r1", 1, "x", namespace=NS) == endpoint_name("r1", 1, "x", namespace=NS)


@pytest.mark.parametrize("label", ['evil"; DROP', "ÜBER run!!", "a" * 200, "--", ""])
@pytest.mark.parametrize("namespace", ["a", NS, "z" * 8])
def test_hostile_or_long_labels_are_sanitised_and_bounded(label, namespace):
    name = endpoint_name("run-id", 12, label, namespace=namespace)
    assert len(name) <= MAX_ENDPOINT_NAME
    assert all(c.isascii() and (c.islower() or c.isdigit() or c == "-") for c in name)
    assert "--" not in name
    parsed = parse_endpoint_name(name)
    assert parsed is not None and parsed[1:4] == (run_hash("run-id"), namespace, 12) and not parsed.serving


@pytest.mark.parametrize("label", ["my-run", "", "x-0123456789ab", "a1", "qwen35-sft"])
def test_a_name_parses_back_into_its_parts(label):
    name = endpoint_name("run-7", 3, label, namespace=NS)
    assert parse_endpoint_name(name) == EndpointName(label, run_hash("run-7"), NS, 3)


@pytest.mark.parametrize("name", [
    "loraflow-my-run-0123456789ab-a1",  # before control-plane tags: no reconciler may claim it
    "loraflow-qwen35-0123456789ab-a1",  # ... even when its label looks like a tag
    "loraflow-x-0123456789ab-toolongtag-a1",
    "loraflow-x-0123456789ab-UPPER-a1",
    "loraflow-x-0123456789ab-k7q2mx",
    "someone-elses-0123456789ab-k7q2mx-a1",
    "loraflow-x-0123456789a-k7q2mx-a1",
])
def test_other_names_do_not_parse(name):
    assert parse_endpoint_name(name) is None


@pytest.mark.parametrize("namespace", ["", "UPPER", "has-dash", "toolongtag"])
def test_a_bad_namespace_is_refused(namespace):
    with pytest.raises(ValueError, match="namespace"):
        endpoint_name("r1", 1, "x", namespace=namespace)


def test_the_namespace_setting_is_used_and_checked(monkeypatch):
    monkeypatch.setenv("LORAFLOW_NAMESPACE", "staging")
    assert Settings().control_plane_namespace() == "staging"
    monkeypatch.setenv("LORAFLOW_NAMESPACE", "Staging!")
    with pytest.raises(ValueError, match="loraflow_namespace"):
        Settings()


def runpod_listing(names: list[str]) -> RunpodClient:
    """A real client whose transport answers `GET /serverless` with endpoints of these names."""
    listed = [{"id": f"ep{i}", "name": n, "workers": {"min": 0, "max": 1}, "createdAt": "2026-11-30T00:00:00Z"}
              for i, n in enumerate(names)]

    def handler(request: httpx.Request) -> httpx.Response:
        assert (request.method, request.url.path) == ("GET", "/v2/serverless")
        return httpx.Response(200, json={"endpoints": listed})

    return RunpodClient("key", api_url="https://api.test/v2", job_url="https://jobs.test/v2",
                        transport=httpx.MockTransport(handler))


def test_a_runs_endpoints_are_found_by_name_across_attempts_and_tags():
    mine = [endpoint_name("run-1", 1, "x", namespace=NS), endpoint_name("run-1", 2, "x", namespace="other")]
    others = [endpoint_name("run-2", 1, "x", namespace=NS), "someone-elses-inference",
              f"loraflow-x-{run_hash('run-1')}-a1"]
    assert [e.name for e in run_endpoints(runpod_listing(mine + others), "run-1")] == mine


def test_create_request_pins_one_worker_and_the_card():
    request = build_create_request(name="loraflow-x", gpu=resolve_gpu("a100 sxm"), gpu_count=1, image="img", env={},
                                   disk_gb=40, execution_timeout_s=600, cuda_floor="13.0")
    wire = request.to_wire()
    assert wire["workers"]["max"] == 1
    assert wire["gpu"]["pools"] == ["AMPERE_80"]
    assert wire["gpu"]["excludedTypes"] == ["NVIDIA A100 80GB PCIe"]
    assert wire["timeout"] == 600_000


def test_the_static_h100_class_excludes_nothing_from_its_pool_which_holds_the_sxm_alone():
    wire = build_create_request(name="loraflow-x", gpu=resolve_gpu("h100"), gpu_count=1, image="img", env={},
                                disk_gb=40, execution_timeout_s=600, cuda_floor="13.0").to_wire()
    assert wire["gpu"]["pools"] == ["ADA_80_PRO"] and "excludedTypes" not in wire["gpu"]


def test_catalog_has_the_known_gpus_and_aliases():
    assert {"RTX 4090", "H100", "H200", "B200"} <= set(GPU_CLASSES)
    assert resolve_gpu("4090").pool == "ADA_24"
    with pytest.raises(ValueError, match="known GPUs"):
        resolve_gpu("v100")


def test_the_cuda_floor_is_the_higher_of_the_cards_and_the_images():
    assert cuda_floor(resolve_gpu("h100"), "13.0") == "13.0"
    assert cuda_floor(resolve_gpu("b200"), "12.11") == "13.0"
    assert cuda_floor(resolve_gpu("h100"), "12.11") == "12.11"  # compared as numbers: 12.11 > 12.8


def test_endpoint_asks_for_its_cuda_floor_or_none():
    common = dict(name="loraflow-x", gpu=resolve_gpu("h100"), gpu_count=1, image="img", env={}, disk_gb=40,
                  execution_timeout_s=600)
    assert build_create_request(cuda_floor="13.0", **common).gpu.min_cuda_version == "13.0"
    no_floor = build_create_request(cuda_floor=None, **common)
    assert "minCudaVersion" not in no_floor.to_wire()["gpu"]


def test_without_a_worker_image_the_run_is_refused_naming_the_setting(monkeypatch):
    from tasks.settings import Settings

    monkeypatch.delenv("LORAFLOW_WORKER_IMAGE", raising=False)
    with pytest.raises(RuntimeError, match="LORAFLOW_WORKER_IMAGE=<registry>/<repository>:<tag>"):
        Settings().worker_image()


def test_the_worker_image_setting_is_what_endpoints_run(monkeypatch):
    from tasks.settings import Settings

    monkeypatch.setenv("LORAFLOW_WORKER_IMAGE", "registry.example/loraflow-worker:0.1.0-cu130-sm90")
    assert Settings().worker_image() == "registry.example/loraflow-worker:0.1.0-cu130-sm90"
