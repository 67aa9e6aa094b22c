"""Preload jobs fill the network volume's Hub cache, and training jobs on that volume read it.

The Hub is the control plane's stand-in (`localpod.hub`), started as a server process with the control
plane's interpreter (the worker's has no FastAPI). huggingface_hub reads HF_ENDPOINT when it is imported,
so jobs that talk to it run the handler in a fresh process whose environment names the stand-in, as a
RunPod worker's environment would; the training process of a training job is such a process already.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from huggingface_hub import HfApi
from huggingface_hub.utils import filter_repo_objects

from worker_test_support import hub_stand_in
from loraflow_worker.contract import CONTRACT_VERSION
from loraflow_worker.handler import JobRefused, WORK_DIR_ENV, handler
from loraflow_worker.runtime.model_cache import VOLUME_PATH_ENV, download_ignore_patterns
from loraflow_worker.runtime.preload import NoVolume


REPO_ROOT = Path(__file__).resolve().parents[2]
TOKEN = "hf_test_token_for_the_stand_in"
MODEL = "loraflow-test/tiny-chat"
MISSING = "loraflow-test/no-such-model"
OTHER_RUNTIME_FILES = ("original/consolidated.pth", "model.gguf", "pytorch_model.bin")
"""Put next to the tiny model's `model.safetensors` in the stand-in's repo: a preload must skip them."""
# The handler as RunPod's runtime calls it, in a process of its own; progress lines go to stderr.
RUN_HANDLER = (
    "import json, logging, sys\n"
    "logging.basicConfig(level=logging.INFO, stream=sys.stderr)\n"
    "from loraflow_worker.handler import handler\n"
    "print(json.dumps(handler(json.load(sys.stdin))))\n"
)


@dataclass
class Hub:
    url: str
    sha: str
    """The commit of MODEL's main branch."""

    def downloads(self, repo_id: str) -> int:
        """File GETs the stand-in served for model `repo_id` so far."""
        with urllib.request.urlopen(f"{self.url}/_hub/downloads/model/{repo_id}", timeout=10) as response:
            return json.load(response)["count"]


@dataclass
class Preloads:
    first: dict
    """The output of a preload of MODEL and MISSING onto an empty volume."""
    first_progress: list[dict]
    second: dict
    """The output of a second preload of MODEL onto the same volume."""
    downloads_by_second: int
    """File GETs of MODEL during the second preload."""
    volume: Path


@pytest.fixture(scope="module")
def hub(tmp_path_factory, tiny_model_dir) -> Iterator[Hub]:
    base = tmp_path_factory.mktemp("hub")
    with hub_stand_in(base / "data") as stand_in:
        api = HfApi(endpoint=stand_in.url, token=TOKEN)
        api.create_repo(MODEL)
        repo_files = base / "repo"
        shutil.copytree(tiny_model_dir, repo_files)
        for name in OTHER_RUNTIME_FILES:
            (repo_files / name).parent.mkdir(parents=True, exist_ok=True)
            (repo_files / name).write_bytes(b"not for transformers" * 64)
        api.upload_folder(repo_id=MODEL, folder_path=repo_files, commit_message="tiny model and other runtimes' files")
        yield Hub(url=stand_in.url, sha=api.model_info(MODEL).sha)


@pytest.fixture(scope="module")
def preloads(hub, tmp_path_factory) -> Preloads:
    base = tmp_path_factory.mktemp("preloads")
    volume = base / "volume"
    volume.mkdir()
    first, first_progress = _preload_in_a_worker(hub, volume, base, [{"id": MODEL}, {"id": MISSING}])
    before = hub.downloads(MODEL)
    second, _ = _preload_in_a_worker(hub, volume, base, [{"id": MODEL}])
    return Preloads(first, first_progress, second, hub.downloads(MODEL) - before, volume)


def test_a_preload_downloads_a_model_into_the_volume_hub_cache(preloads, hub):
    result = preloads.first["models"][0]
    assert (result["id"], result["revision"], result["status"]) == (MODEL, hub.sha, "downloaded")
    assert result["bytes_downloaded"] == result["size_bytes"] > 0
    snapshot = preloads.volume / "huggingface" / "hub" / "models--loraflow-test--tiny-chat" / "snapshots" / hub.sha
    assert (snapshot / "model.safetensors").is_file()


def test_a_second_preload_finds_the_model_cached_and_downloads_nothing(preloads):
    result = preloads.second["models"][0]
    assert (result["status"], result["bytes_downloaded"]) == ("cached", 0)
    assert result["size_bytes"] == preloads.first["models"][0]["size_bytes"]
    assert preloads.downloads_by_second == 0


def test_weights_for_other_runtimes_are_never_downloaded(preloads, hub):
    repo = preloads.volume / "huggingface" / "hub" / "models--loraflow-test--tiny-chat"
    kept = {p.relative_to(repo / "snapshots" / hub.sha).as_posix() for p in (repo / "snapshots").rglob("*") if p.is_file()}
    assert "model.safetensors" in kept and not kept & set(OTHER_RUNTIME_FILES)
    assert len(list((repo / "blobs").iterdir())) == len(kept)


def test_a_missing_model_fails_while_the_others_are_cached(preloads):
    statuses = [(m["id"], m["status"]) for m in preloads.first["models"]]
    assert statuses == [(MODEL, "downloaded"), (MISSING, "failed")]
    assert "RepositoryNotFoundError" in preloads.first["models"][1]["error"]


def test_a_preload_reports_one_progress_update_per_model(preloads):
    messages = [update["message"] for update in preloads.first_progress]
    assert [message.split(":")[0] for message in messages] == ["preload 1/2", "preload 2/2"]
    assert MODEL in messages[0] and MISSING in messages[1]


def test_a_preload_says_where_it_ran(preloads):
    assert (preloads.first["run_id"], preloads.first["data_center"], preloads.first["volume_path"]) == (
        "warm-1", "EU-TEST-1", str(preloads.volume))


def test_a_preload_without_a_volume_is_refused_before_downloading(tmp_path, monkeypatch):
    absent = tmp_path / "no-volume"
    monkeypatch.setenv(VOLUME_PATH_ENV, str(absent))
    with pytest.raises(NoVolume, match=re.escape(f"no network volume at {absent}: a preload job needs the endpoint's")):
        handler(_preload_job([{"id": MODEL}]))
    assert not absent.exists()


def test_models_the_deadline_leaves_no_time_for_fail_with_deadline_reached(tmp_path, monkeypatch):
    monkeypatch.setenv(VOLUME_PATH_ENV, str(tmp_path))
    output = handler(_preload_job([{"id": MODEL}, {"id": MISSING}], deadline_epoch_s=time.time() - 1))
    assert [(m["status"], m["error"]) for m in output["models"]] == [("failed", "deadline reached")] * 2
    assert list(tmp_path.iterdir()) == []


def test_remove_others_deletes_the_cached_models_the_job_does_not_list_and_nothing_else(tmp_path, monkeypatch):
    cache = tmp_path / "huggingface" / "hub"
    for folder in ("models--loraflow-test--tiny-chat", "models--old--model", "datasets--some--data", ".locks/models--old--model"):
        (cache / folder / "blobs").mkdir(parents=True)
    monkeypatch.setenv(VOLUME_PATH_ENV, str(tmp_path))
    # A deadline already past: nothing is downloaded, so only the removal can have changed the cache.
    handler(_preload_job([{"id": MODEL}], deadline_epoch_s=time.time() - 1, remove_others=True))
    assert sorted(p.name for p in cache.iterdir()) == [".locks", "datasets--some--data", "models--loraflow-test--tiny-chat"]
    assert list((cache / ".locks").iterdir()) == []


def test_without_remove_others_a_preload_keeps_every_cached_model(tmp_path, monkeypatch):
    other = tmp_path / "huggingface" / "hub" / "models--old--model"
    other.mkdir(parents=True)
    monkeypatch.setenv(VOLUME_PATH_ENV, str(tmp_path))
    handler(_preload_job([{"id": MODEL}], deadline_epoch_s=time.time() - 1))
    assert other.is_dir()


def test_a_local_path_cannot_be_preloaded():
    with pytest.raises(JobRefused, match="`models`: Value error, '/models/tiny' is not a Hub model id"):
        handler(_preload_job([{"id": "/models/tiny"}]))


def test_an_unknown_mode_is_refused_naming_the_modes():
    with pytest.raises(JobRefused, match="`mode`: 'warm' is not a mode; use one of train, preload"):
        handler(_preload_job([{"id": MODEL}], mode="warm"))


def test_a_training_job_on_the_volume_reads_the_preloaded_model_without_downloading_it(
        preloads, hub, make_job, tmp_path, monkeypatch):
    store = tmp_path / "store"
    job = make_job("run-warm", tmp_path, store, model={"id": MODEL}, training={"max_steps": 2, "batch_size": 2})
    before = hub.downloads(MODEL)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    for name, value in _worker_env(hub, preloads.volume, tmp_path).items():
        if os.environ.get(name) != value:
            monkeypatch.setenv(name, value)
    monkeypatch.setenv(WORK_DIR_ENV, str(tmp_path / "work"))
    handler(job)  # the training process inherits this environment
    manifest = json.loads((store / "runs" / "run-warm" / "manifest.json").read_text())
    assert manifest["base_model_revision"] == hub.sha
    assert hub.downloads(MODEL) == before
    assert not (tmp_path / "hf-home" / "hub" / "models--loraflow-test--tiny-chat").exists()


def test_a_repo_without_safetensors_keeps_its_pytorch_weights():
    files = ["config.json", "pytorch_model.bin", "tokenizer.json", "model.gguf"]
    assert list(filter_repo_objects(files, ignore_patterns=download_ignore_patterns(files))) == [
        "config.json", "pytorch_model.bin", "tokenizer.json"]


def test_mistral_consolidated_weights_are_skipped_next_to_transformers_shards():
    files = ["consolidated.safetensors", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
             "model.safetensors.index.json", "params.json", "tokenizer.model.v3"]
    assert "consolidated.safetensors" not in filter_repo_objects(files, ignore_patterns=download_ignore_patterns(files))


def _preload_job(models: list[dict], **fields) -> dict:
    job_input = {"contract_version": CONTRACT_VERSION, "mode": "preload", "run_id": "warm-1", "models": models}
    return {"id": "job-warm-1", "input": {**job_input, **fields}}


def _preload_in_a_worker(hub: Hub, volume: Path, base: Path, models: list[dict]) -> tuple[dict, list[dict]]:
    """The preload job's output and progress updates, from a worker process attached to `volume`."""
    done = subprocess.run([sys.executable, "-c", RUN_HANDLER], input=json.dumps(_preload_job(models)),
                          env={**_worker_env(hub, volume, base), "RUNPOD_DC_ID": "EU-TEST-1"},
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    progress = [json.loads(line.split("progress ", 1)[1]) for line in done.stderr.splitlines()
                if line.startswith("INFO:loraflow_worker:progress ")]
    return json.loads(done.stdout.splitlines()[-1]), progress


def _worker_env(hub: Hub, volume: Path, base: Path) -> dict[str, str]:
    """A worker's environment: the stand-in as the Hub, `volume` attached, its own cache under `base`."""
    env = {name: value for name, value in os.environ.items() if not name.startswith(("HF_", "HUGGING_FACE_"))}
    return {**env, "HF_ENDPOINT": hub.url, "HF_TOKEN": TOKEN, "HF_HOME": str(base / "hf-home"),
            "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", VOLUME_PATH_ENV: str(volume)}
