"""A recording of RunPod's answers (`python -m flows.preflight RUN_FILE --record DIR`) holds no secret, and localpod
serves the catalog it holds (`python -m localpod --catalog-from DIR`): GPU types, pools, prices, hosts' CUDA versions,
stock and datacenters as recorded.

The recordings here are written by the preflight's own `Recorder` (the format is the contract between the two) from
answers made of RunPod's official schema examples, or of small documents that each show one derivation; localpod
serves them in-process. tests/test_preflight.py records from the local stack and starts a localpod on the recording.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from localpod import LocalpodConfig, create_app
from localpod.catalog import recorded, tables
from localpod.catalog.documents import best_level
from localpod.catalog.placement import place
from localpod.models import DEFAULT_OPENAPI_PATH
from tasks.preflight.recording import MANIFEST, Recorder, RecordingError, RecordingTransport, scrub
from tests.test_localpod import API_KEY, AUTH, SCHEMAS

SERVERLESS = {"include": "AVAILABILITY", "product": "SERVERLESS"}
RTX_4090 = "NVIDIA GeForce RTX 4090"


def schema_example(route: str) -> dict[str, Any]:
    """The example answer RunPod's schema gives for `GET route`."""
    document = json.loads(DEFAULT_OPENAPI_PATH.read_text())
    [example] = document["paths"][route]["get"]["responses"]["200"]["content"]["application/json"]["examples"].values()
    return example["value"]


def record(folder: Path, answers: list[tuple[str, dict[str, str], dict[str, Any]]]) -> Path:
    """A recording of these (route, query, body) answers, written as the preflight writes one."""
    recorder = Recorder(folder)
    recorder.api_host = "api.runpod.io"
    for route, query, body in answers:
        recorder.keep("control", route, query, 200, body)
    recorder.write_manifest()
    return folder


@pytest.fixture
def serving() -> Iterator[Any]:
    """`serving(folder)` serves the recording in `folder` (in this process) and answers its `RecordedCatalog`; the
    built-in catalog comes back after the test."""
    before = tables.served()

    def serve(folder: Path) -> recorded.RecordedCatalog:
        loaded = recorded.load(folder)
        tables.serve(loaded.tables)
        return loaded

    yield serve
    tables.serve(before)


def pod(tmp_path: Path) -> TestClient:
    config = LocalpodConfig(api_key=API_KEY, log_dir=tmp_path / "logs", worker_command=[sys.executable, "-c", "pass"])
    return TestClient(create_app(config))


def get(client: TestClient, path: str, schema: str, **params: str) -> Any:
    answer = client.get(path, params=params, headers=AUTH)
    assert answer.status_code == 200, answer.text
    assert SCHEMAS.errors(schema, answer.json()) == []
    return answer.json()


# --- the schema's examples, replayed -------------------------------------------------------------------


def test_a_recording_of_the_schemas_examples_is_served_as_recorded(tmp_path, serving):
    gpus, data_centers = schema_example("/v2/catalog/gpus"), schema_example("/v2/catalog/datacenters")
    cpus = schema_example("/v2/catalog/cpus")
    folder = record(tmp_path / "rec", [
        ("/v2/catalog/gpus", SERVERLESS, gpus),
        ("/v2/catalog/datacenters", {"include": "GPU_AVAILABILITY,CPU_AVAILABILITY"}, data_centers),
        ("/v2/catalog/cpus", SERVERLESS, cpus),
        ("/v2/serverless", {}, schema_example("/v2/serverless")),
        ("/v2/network-volumes", {}, schema_example("/v2/network-volumes")),
    ])
    loaded = serving(folder)
    assert "1 GPU types in 1 pools, 1 datacenters, 1 CPU flavors" in loaded.description
    with pod(tmp_path) as client:
        assert get(client, "/v2/catalog/gpus", "ListGpuTypesResponse", **SERVERLESS) == gpus
        assert get(client, "/v2/catalog/datacenters", "ListDataCentersResponse",
                   include="GPU_AVAILABILITY,CPU_AVAILABILITY") == data_centers
        assert get(client, "/v2/catalog/cpus", "ListCpuTypesResponse", **SERVERLESS) == cpus


def test_a_type_whose_hosts_report_no_cuda_version_takes_no_endpoint_with_a_floor(tmp_path, serving):
    # The schema's example GPU lists no cudaVersions: RunPod says to read that as none.
    serving(record(tmp_path / "rec", [("/v2/catalog/gpus", SERVERLESS, schema_example("/v2/catalog/gpus"))]))
    gpu = {"pools": ["ADA_24"]}
    assert place({"gpu": gpu}, lambda pool, dc: True).data_center_id == "US-KS-2"
    assert place({"gpu": {**gpu, "minCudaVersion": "12.8"}}, lambda pool, dc: True) is None


# --- what is derived from the reads --------------------------------------------------------------------


def gpu_doc(levels: dict[str, str], versions: list[str], pool: str = "ADA_24", type_id: str = RTX_4090,
            serverless: float = 1.1) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "id": type_id, "name": type_id.removeprefix("NVIDIA GeForce "), "pool": pool, "manufacturer": "NVIDIA",
        "memory": 24, "secure": True, "community": True, "price": {"secure": 0.44, "community": 0.31,
                                                                   "serverless": serverless},
        "maxCount": {"secure": 8, "community": 4},
        "availability": best_level(levels.values()),
        "cudaVersions": [{"version": v, "available": True} for v in versions],
    }
    if doc["availability"] != "NONE":
        doc["dataCenters"] = [{"id": dc, "name": dc, "availability": level} for dc, level in levels.items()]
    return doc


def levels(document: dict[str, Any]) -> dict[str, str]:
    return {dc["id"]: dc["availability"] for dc in document.get("dataCenters", [])}


def test_a_floor_read_that_finds_no_stock_where_the_unscoped_read_did_puts_that_datacenters_hosts_below_it(
        tmp_path, serving):
    versions = ["12.4", "12.8", "13.0"]
    serving(record(tmp_path / "rec", [
        ("/v2/catalog/gpus", SERVERLESS, {"gpus": [gpu_doc({"US-CA-2": "HIGH", "US-TX-3": "HIGH"}, versions)]}),
        ("/v2/catalog/gpus", {**SERVERLESS, "minCudaVersion": "13.0"},
         {"gpus": [gpu_doc({"US-CA-2": "HIGH", "US-TX-3": "NONE"}, ["13.0"])]}),
    ]))
    assert tables.default_host_table()[RTX_4090] == {"US-CA-2": ("12.4", "12.8", "13.0"), "US-TX-3": ("12.4", "12.8")}
    with pod(tmp_path) as client:
        [unscoped] = get(client, "/v2/catalog/gpus", "ListGpuTypesResponse", **SERVERLESS)["gpus"]
        assert levels(unscoped) == {"US-CA-2": "HIGH", "US-TX-3": "HIGH"}
        [floor] = get(client, "/v2/catalog/gpus", "ListGpuTypesResponse", **SERVERLESS, minCudaVersion="13.0")["gpus"]
        assert levels(floor) == {"US-CA-2": "HIGH", "US-TX-3": "NONE"}
    pinned = {"gpu": {"pools": ["ADA_24"], "minCudaVersion": "13.0"}, "dataCenterIds": ["US-TX-3"]}
    assert place(pinned, lambda pool, dc: True) is None


def test_a_type_without_stock_when_recorded_is_listed_where_offered_but_never_placed(tmp_path, serving):
    data_centers = {"dataCenters": [{
        "id": "EU-RO-1", "name": "EU Romania 1", "region": "EUROPE", "globalNetwork": True,
        "networkVolumeTypes": ["STANDARD"], "compliance": ["GDPR"],
        "gpuAvailability": [{"id": RTX_4090, "name": "RTX 4090", "availability": "LOW"}]}]}
    serving(record(tmp_path / "rec", [
        ("/v2/catalog/gpus", SERVERLESS, {"gpus": [gpu_doc({}, ["12.8"])]}),
        ("/v2/catalog/datacenters", {"include": "GPU_AVAILABILITY"}, data_centers),
    ]))
    with pod(tmp_path) as client:
        [dc] = get(client, "/v2/catalog/datacenters", "ListDataCentersResponse", include="GPU_AVAILABILITY")[
            "dataCenters"]
    # The serverless read, not the datacenter's (which product it counts is not said), decides the stock.
    assert dc["gpuAvailability"] == [{"id": RTX_4090, "name": "RTX 4090", "availability": "NONE"}]
    assert place({"gpu": {"pools": ["ADA_24"]}}, lambda pool, dc: True) is None


def test_a_pool_is_billed_at_its_types_serverless_price_and_a_disagreement_is_noted(tmp_path, serving):
    loaded = serving(record(tmp_path / "rec", [("/v2/catalog/gpus", SERVERLESS, {"gpus": [
        gpu_doc({"US-CA-2": "HIGH"}, ["12.8"], pool="AMPERE_80", type_id="NVIDIA A100 80GB PCIe", serverless=2.7),
        gpu_doc({"US-CA-2": "HIGH"}, ["12.8"], pool="AMPERE_80", type_id="NVIDIA A100-SXM4-80GB", serverless=2.9),
    ]})]))
    assert tables.POOL_SERVERLESS_USD_PER_HOUR == {"AMPERE_80": 2.9}
    assert any("pool AMPERE_80" in note and "[2.7, 2.9]" in note for note in loaded.notes)


def test_datacenters_take_their_country_from_their_id():
    assert [recorded._country(dc) for dc in ("US-KS-2", "EU-RO-1", "EUR-NO-1", "CA-MTL-1", "LOCAL")] == \
        ["US", "RO", "NO", "CA", ""]


def test_a_folder_that_is_not_a_recording_is_refused_naming_the_command_that_makes_one(tmp_path):
    with pytest.raises(recorded.RecordingError, match=r"manifest.json: no such file.*--record DIR"):
        recorded.load(tmp_path)


def test_a_recording_without_a_gpu_catalog_read_is_refused(tmp_path):
    folder = record(tmp_path / "rec", [("/v2/serverless", {}, {"endpoints": []})])
    with pytest.raises(recorded.RecordingError, match="no answer of GET /v2/catalog/gpus"):
        recorded.load(folder)


# --- what a recording keeps out ------------------------------------------------------------------------


def scrubbed(document: Any, *values: str) -> Any:
    def text(value: str) -> str:
        for secret in values:
            value = value.replace(secret, "***")
        return value

    return scrub(document, text)


def test_endpoint_env_values_are_removed_but_secret_references_are_kept():
    env = {"HF_TOKEN": "{{ RUNPOD_SECRET_loraflow-hf-token-ns-0123456789abcdef }}", "MODEL_NAME": "sdxl",
           "MIXED": "x{{ RUNPOD_SECRET_a }}"}
    assert scrubbed({"endpoints": [{"name": "e", "env": env}]}) == {"endpoints": [{"name": "e", "env": {
        "HF_TOKEN": env["HF_TOKEN"], "MODEL_NAME": "***", "MIXED": "***"}}]}


def test_members_named_like_secrets_lose_their_values_and_lists_named_so_are_kept():
    document = {"secrets": [{"name": "loraflow-x", "value": "v", "apiKey": "k", "password": 7, "tokenCount": None}]}
    assert scrubbed(document) == {"secrets": [{"name": "loraflow-x", "value": "v", "apiKey": "***", "password": "***",
                                               "tokenCount": None}]}


def test_a_known_secret_value_and_token_shapes_go_wherever_they_appear(tmp_path):
    body = {"endpoints": [{"name": "run-with-key-sk-live-123", "description": "hf_" + "a" * 34}]}
    served = httpx.MockTransport(lambda request: httpx.Response(200, json=body))
    recorder = Recorder(tmp_path / "rec")
    transport = recorder.transport("https://api.runpod.io/v2", "https://api.runpod.ai/v2",
                                   {"RUNPOD_API_KEY": "sk-live-123"}, inner=served)
    with httpx.Client(transport=transport) as client:
        assert client.get("https://api.runpod.io/v2/serverless", params={"q": "sk-live-123"}).json() == body
    recorder.write_manifest()
    written = "".join(p.read_text() for p in (tmp_path / "rec").iterdir())
    assert "sk-live-123" not in written and "hf_aaa" not in written
    manifest = json.loads((tmp_path / "rec" / MANIFEST).read_text())
    assert manifest["answers"] == [{"file": "001-serverless.json", "api": "control", "route": "/v2/serverless",
                                    "query": {"q": "***"}, "status": 200}]
    assert manifest["api_host"] == "api.runpod.io"


def test_a_recording_sends_no_write(tmp_path):
    sent: list[str] = []
    transport = RecordingTransport(Recorder(tmp_path / "rec"), "https://api.runpod.io/v2", "https://api.runpod.ai/v2",
                                   {}, inner=httpx.MockTransport(lambda r: sent.append(r.method) or httpx.Response(200)))
    with httpx.Client(transport=transport) as client, pytest.raises(RecordingError, match="POST /v2/serverless"):
        client.post("https://api.runpod.io/v2/serverless", json={})
    assert sent == []


def test_a_recording_is_never_mixed_with_what_a_folder_holds(tmp_path):
    (tmp_path / "old.json").write_text("{}")
    with pytest.raises(RecordingError, match="not an empty folder"):
        Recorder(tmp_path)
