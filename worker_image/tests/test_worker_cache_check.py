"""A base model read from the shared network volume is checked against the Hub's hashes before it is loaded: what
another run rewrote, removed or planted there is put right (or the job stops), and an intact cache costs no download.

The Hub is the control plane's stand-in (`localpod.hub`), run with the control plane's interpreter. It stores every
file in git (never LFS), so the jobs here check git blob sha1s; the LFS case (sha256) is checked on a cache laid out
by hand. huggingface_hub reads HF_ENDPOINT when it is imported, so the model is resolved in a fresh process whose
environment names the stand-in, as a worker's would.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from huggingface_hub import HfApi
from huggingface_hub.hf_api import BlobLfsInfo, RepoSibling

from worker_test_support import hub_stand_in
from loraflow_worker.handler import WORK_DIR_ENV, handler
from loraflow_worker.runtime.cache_check import check_snapshot, file_hash, hub_hash
from loraflow_worker.runtime.model_cache import VOLUME_PATH_ENV

from tests.hub_fixture import HubStandIn

REPO_ROOT = Path(__file__).resolve().parents[2]
TOKEN = "hf_test_token_for_the_stand_in"
MODEL = "loraflow-test/tiny-chat"
SERVED_WRONG = "loraflow-test/served-wrong"
"""A repo whose weight file the stand-in serves with other bytes than the hash it lists."""
REPO_FOLDER = "models--loraflow-test--tiny-chat"
RESOLVE = (
    "import logging, sys\n"
    "logging.basicConfig(level=logging.INFO, stream=sys.stderr)\n"
    "from loraflow_worker.contract import ModelSource\n"
    "from loraflow_worker.runtime.model_cache import resolve_base_model\n"
    "print(resolve_base_model(ModelSource(id=sys.argv[1]))[0])\n"
)


@dataclass
class Hub:
    url: str
    sha: str
    """The commit of MODEL's main branch."""
    weights: bytes
    """MODEL's model.safetensors as the Hub has it."""
    stand_in: HubStandIn

    def downloads(self, repo_id: str) -> int:
        return self.stand_in.downloads("model", repo_id)


@dataclass
class Resolved:
    returncode: int
    snapshot: Path | None
    log: str


@pytest.fixture(scope="module")
def hub(tmp_path_factory, tiny_model_dir) -> Hub:
    base = tmp_path_factory.mktemp("hub")
    with hub_stand_in(base / "data") as stand_in:
        api = HfApi(endpoint=stand_in.url, token=TOKEN)
        api.create_repo(MODEL)
        api.upload_folder(repo_id=MODEL, folder_path=tiny_model_dir, commit_message="tiny model")
        wrong = base / "served-wrong"
        wrong.mkdir()
        (wrong / "config.json").write_text('{"model_type": "qwen3"}')
        (wrong / "model.safetensors").write_bytes(b"weights the Hub lists" * 100)
        api.create_repo(SERVED_WRONG)
        api.upload_folder(repo_id=SERVED_WRONG, folder_path=wrong, commit_message="weights")
        listed = {s.rfilename: s for s in api.model_info(SERVED_WRONG, files_metadata=True).siblings}
        _flip_last_bytes(base / "data" / "blobs" / listed["model.safetensors"].blob_id[:2]
                         / listed["model.safetensors"].blob_id)
        yield Hub(url=stand_in.url, sha=api.model_info(MODEL).sha,
                  weights=(tiny_model_dir / "model.safetensors").read_bytes(), stand_in=stand_in)


@pytest.fixture
def warm_volume(hub, tmp_path) -> Path:
    """A volume whose Hub cache holds MODEL, as a first job on it downloaded it."""
    volume = tmp_path / "volume"
    volume.mkdir()
    assert _resolve(hub, volume, tmp_path, MODEL).returncode == 0
    return volume


def test_an_intact_cache_on_the_volume_costs_no_download(hub, warm_volume, tmp_path):
    before = hub.downloads(MODEL)
    resolved = _resolve(hub, warm_volume, tmp_path, MODEL)
    assert resolved.returncode == 0, resolved.log
    assert hub.downloads(MODEL) == before
    assert f"checked {MODEL}@{hub.sha[:12]} on the volume against the Hub's hashes" in resolved.log
    assert "downloaded again: none; removed: none" in resolved.log


def test_the_check_logs_how_many_bytes_it_hashed_and_how_long_it_took(hub, warm_volume, tmp_path):
    resolved = _resolve(hub, warm_volume, tmp_path, MODEL)
    snapshot_bytes = sum(path.stat().st_size for path in resolved.snapshot.rglob("*") if path.is_file())
    assert f"files, {snapshot_bytes / 1e6:.1f} MB hashed in " in resolved.log


def test_a_rewritten_weight_file_on_the_volume_is_downloaded_again_before_it_is_loaded(hub, warm_volume, tmp_path):
    weights = _snapshot(warm_volume, hub) / "model.safetensors"
    _flip_last_bytes(weights)  # through the snapshot's link, into the blob, as a run writing the volume would
    before = hub.downloads(MODEL)
    resolved = _resolve(hub, warm_volume, tmp_path, MODEL)
    assert resolved.returncode == 0, resolved.log
    assert (resolved.snapshot / "model.safetensors").read_bytes() == hub.weights
    assert hub.downloads(MODEL) == before + 1
    assert "downloaded again: model.safetensors;" in resolved.log


def test_a_rewritten_weight_file_is_logged_with_the_hubs_hash_and_the_volumes(hub, warm_volume, tmp_path):
    weights = _snapshot(warm_volume, hub) / "model.safetensors"
    _flip_last_bytes(weights)
    rewritten = file_hash(weights, "git-sha1")
    resolved = _resolve(hub, warm_volume, tmp_path, MODEL)
    listed = _git_sha1(hub.weights)
    assert (f"model.safetensors of {MODEL}@{hub.sha[:12]} on the volume is not the Hub's: the Hub has git-sha1 "
            f"{listed} ({len(hub.weights)} bytes), the volume holds git-sha1 {rewritten}; removing it and downloading "
            "it again") in resolved.log


def test_a_truncated_weight_file_is_downloaded_again_without_being_hashed(hub, warm_volume, tmp_path):
    weights = _snapshot(warm_volume, hub) / "model.safetensors"
    with open(weights, "r+b") as file:
        file.truncate(100)
    resolved = _resolve(hub, warm_volume, tmp_path, MODEL)
    assert (resolved.snapshot / "model.safetensors").read_bytes() == hub.weights
    assert "the volume holds no file of that size" in resolved.log


def test_a_weight_file_missing_from_the_volume_is_downloaded_again(hub, warm_volume, tmp_path):
    (_snapshot(warm_volume, hub) / "model.safetensors").resolve().unlink()
    resolved = _resolve(hub, warm_volume, tmp_path, MODEL)
    assert resolved.returncode == 0, resolved.log
    assert (resolved.snapshot / "model.safetensors").read_bytes() == hub.weights


def test_a_file_planted_in_the_snapshot_is_removed_before_loading(hub, warm_volume, tmp_path):
    # transformers would load this adapter onto the base model by itself.
    (_snapshot(warm_volume, hub) / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    resolved = _resolve(hub, warm_volume, tmp_path, MODEL)
    assert resolved.returncode == 0, resolved.log
    assert not (resolved.snapshot / "adapter_config.json").exists()
    assert "removed adapter_config.json from " in resolved.log


def test_a_file_that_differs_again_once_downloaded_again_fails_the_job(hub, tmp_path):
    volume = tmp_path / "volume"
    volume.mkdir()
    resolved = _resolve(hub, volume, tmp_path, SERVED_WRONG)
    assert resolved.returncode != 0
    assert f"CachedModelCorrupt: model.safetensors of {SERVED_WRONG}@" in resolved.log
    assert "the job stops rather than load them" in resolved.log


def test_training_on_a_volume_with_a_rewritten_weight_file_trains_on_the_hubs_bytes(
        hub, warm_volume, make_job, tmp_path, monkeypatch):
    _flip_last_bytes(_snapshot(warm_volume, hub) / "model.safetensors")
    store = tmp_path / "store"
    job = make_job("run-checked", tmp_path, store, model={"id": MODEL}, training={"max_steps": 2, "batch_size": 2})
    before = hub.downloads(MODEL)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    for name, value in _worker_env(hub, warm_volume, tmp_path).items():
        if os.environ.get(name) != value:
            monkeypatch.setenv(name, value)
    monkeypatch.setenv(WORK_DIR_ENV, str(tmp_path / "work"))
    handler(job)  # the training process inherits this environment
    manifest = json.loads((store / "runs" / "run-checked" / "manifest.json").read_text())
    assert manifest["base_model_revision"] == hub.sha
    assert hub.downloads(MODEL) == before + 1
    assert (_snapshot(warm_volume, hub) / "model.safetensors").read_bytes() == hub.weights


def test_an_lfs_file_is_checked_by_the_sha256_the_hub_lists(tmp_path):
    data = b"safetensors bytes" * 1000
    sibling = RepoSibling(rfilename="model.safetensors", size=len(data), blob_id="0" * 40,
                          lfs=BlobLfsInfo(size=len(data), sha256=hashlib.sha256(data).hexdigest(), pointer_size=134))
    (tmp_path / "model.safetensors").write_bytes(data)
    want = hub_hash(sibling)
    assert (want.algorithm, want.size) == ("sha256", len(data))
    assert file_hash(tmp_path / "model.safetensors", want.algorithm) == want.hexdigest


def test_a_file_stored_in_git_is_checked_by_its_git_blob_sha1(tmp_path):
    (tmp_path / "hello.txt").write_bytes(b"hello")
    sibling = RepoSibling(rfilename="hello.txt", size=5, blob_id="b6fc4c620b67d95f953a5c1c1230aaab5db5a1b0")
    want = hub_hash(sibling)
    # `printf hello | git hash-object --stdin`
    assert file_hash(tmp_path / "hello.txt", want.algorithm) == want.hexdigest


def test_a_file_larger_than_one_read_is_hashed_whole(tmp_path):
    data = os.urandom(9 * 1024 * 1024 + 1)  # past the 8 MiB read size
    (tmp_path / "big").write_bytes(data)
    assert file_hash(tmp_path / "big", "sha256") == hashlib.sha256(data).hexdigest()
    assert file_hash(tmp_path / "big", "git-sha1") == _git_sha1(data)


def test_an_intact_lfs_snapshot_passes_the_check_untouched(tmp_path):
    data = b"\x00weights" * 4096
    digest = hashlib.sha256(data).hexdigest()
    repo = tmp_path / "hub" / "models--org--model"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / digest).write_bytes(data)
    snapshot = repo / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "model.safetensors").symlink_to(Path("../../blobs") / digest)
    sibling = RepoSibling(rfilename="model.safetensors", size=len(data), blob_id="0" * 40,
                          lfs=BlobLfsInfo(size=len(data), sha256=digest, pointer_size=134))
    check = check_snapshot("org/model", "a" * 40, snapshot, tmp_path / "hub", [sibling])
    assert (check.files, check.bytes_hashed, check.downloaded_again, check.removed) == (1, len(data), [], [])


def _resolve(hub: Hub, volume: Path, base: Path, model: str) -> Resolved:
    """`resolve_base_model` of `model` in a worker process attached to `volume`."""
    done = subprocess.run([sys.executable, "-c", RESOLVE, model], env=_worker_env(hub, volume, base),
                          capture_output=True, text=True, timeout=300, check=False)
    snapshot = Path(done.stdout.splitlines()[-1]) if done.returncode == 0 else None
    return Resolved(done.returncode, snapshot, done.stderr)


def _worker_env(hub: Hub, volume: Path, base: Path) -> dict[str, str]:
    """A worker's environment: the stand-in as the Hub, `volume` attached, its own cache under `base`."""
    env = {name: value for name, value in os.environ.items() if not name.startswith(("HF_", "HUGGING_FACE_"))}
    return {**env, "HF_ENDPOINT": hub.url, "HF_TOKEN": TOKEN, "HF_HOME": str(base / "hf-home"),
            "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", VOLUME_PATH_ENV: str(volume)}


def _snapshot(volume: Path, hub: Hub) -> Path:
    return volume / "huggingface" / "hub" / REPO_FOLDER / "snapshots" / hub.sha


def _flip_last_bytes(path: Path, count: int = 64) -> None:
    """Rewrite the file's last `count` bytes in place (its size unchanged)."""
    with open(path, "r+b") as file:
        file.seek(-count, os.SEEK_END)
        tail = file.read(count)
        file.seek(-count, os.SEEK_END)
        file.write(bytes(b ^ 0xFF for b in tail))


def _git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
