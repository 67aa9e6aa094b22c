"""Checkpoints and heartbeats in the store: one commit each, pruned, rate-limited, found again on resume.

The Trainer's callbacks are driven directly here with real `TrainerState`s and local checkpoint folders.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import TrainerControl, TrainerState, TrainingArguments

from loraflow_worker.artifacts import FileStore
from loraflow_worker.checkpoints import COMPLETE, CheckpointUploader, download_latest_checkpoint, stored_checkpoints
from loraflow_worker.heartbeat import Heartbeat

PREFIX = "runs/r"


class CountingStore(FileStore):
    """A FileStore that counts its commits (each `put` is one commit on the Hub)."""

    def __init__(self, root: Path):
        super().__init__(root)
        self.commits: list[str] = []

    def put(self, files, *, message, delete_prefixes=()):
        self.commits.append(message)
        super().put(files, message=message, delete_prefixes=delete_prefixes)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def store(tmp_path) -> CountingStore:
    return CountingStore(tmp_path / "store")


@pytest.fixture
def args(tmp_path) -> TrainingArguments:
    return TrainingArguments(output_dir=str(tmp_path / "trainer"), report_to="none", use_cpu=True)


def _save(uploader: CheckpointUploader, args: TrainingArguments, step: int, max_steps: int = 100) -> None:
    """What the Trainer does at a save: write checkpoint-<step>, then call on_save."""
    folder = Path(args.output_dir) / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "adapter_model.safetensors").write_bytes(b"weights %d" % step)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    uploader.on_save(args, TrainerState(global_step=step, max_steps=max_steps), TrainerControl())


def test_each_checkpoint_is_one_commit_holding_its_files_and_marker(store, args):
    uploader = CheckpointUploader(store, PREFIX, keep=1)
    _save(uploader, args, 10)
    assert store.commits == ["checkpoint at step 10"]
    assert store.list_files(f"{PREFIX}/checkpoints") == [
        f"{PREFIX}/checkpoints/step-10/{COMPLETE}",
        f"{PREFIX}/checkpoints/step-10/adapter_model.safetensors",
        f"{PREFIX}/checkpoints/step-10/trainer_state.json",
    ]


def test_older_checkpoints_beyond_keep_are_deleted_in_the_same_commit(store, args):
    clock = Clock()
    uploader = CheckpointUploader(store, PREFIX, keep=2, clock=clock)
    for step in (10, 20, 30):
        _save(uploader, args, step)
        clock.now += 61
    assert len(store.commits) == 3
    assert stored_checkpoints(store, PREFIX) == {20: True, 30: True}


def test_checkpoint_sooner_than_the_commit_interval_stays_local(store, args):
    clock = Clock()
    uploader = CheckpointUploader(store, PREFIX, keep=3, clock=clock)
    _save(uploader, args, 10)
    clock.now += 30
    _save(uploader, args, 20)
    clock.now += 31
    _save(uploader, args, 30)
    assert uploader.uploaded == [10, 30]
    assert sorted(stored_checkpoints(store, PREFIX)) == [10, 30]


def test_checkpoint_at_the_last_step_is_not_stored(store, args):
    uploader = CheckpointUploader(store, PREFIX, keep=1)
    _save(uploader, args, 100, max_steps=100)
    assert store.commits == [] and stored_checkpoints(store, PREFIX) == {}


def test_resume_downloads_the_latest_complete_checkpoint_in_the_trainers_layout(store, tmp_path):
    for step, complete in ((10, True), (20, True), (30, False)):  # step 30: a FileStore write cut short
        files = {f"{PREFIX}/checkpoints/step-{step}/trainer_state.json": b'{"global_step": %d}' % step}
        if complete:
            files[f"{PREFIX}/checkpoints/step-{step}/{COMPLETE}"] = b"{}"
        store.put(files, message="setup")
    local = download_latest_checkpoint(store, PREFIX, tmp_path / "out")
    assert local == tmp_path / "out" / "checkpoint-20"
    assert sorted(p.name for p in local.iterdir()) == ["trainer_state.json"]


def test_resume_finds_nothing_in_a_fresh_run(store, tmp_path):
    assert download_latest_checkpoint(store, PREFIX, tmp_path / "out") is None


def test_next_checkpoint_removes_an_incomplete_leftover(store, args):
    store.put({f"{PREFIX}/checkpoints/step-5/optimizer.pt": b"partial"}, message="setup")
    _save(CheckpointUploader(store, PREFIX, keep=1), args, 10)
    assert stored_checkpoints(store, PREFIX) == {10: True}


def test_heartbeat_is_written_at_the_start_and_then_once_per_interval(store, args):
    clock = Clock()
    heartbeat = Heartbeat(store, PREFIX, attempt=2, interval_s=300, clock=clock)
    state = TrainerState(global_step=0, max_steps=100)
    heartbeat.on_train_begin(args, state, TrainerControl())
    for step in range(1, 11):
        clock.now += 40
        state.global_step = step
        state.log_history.append({"step": step, "loss": 5.0 - step / 10})
        heartbeat.on_step_end(args, state, TrainerControl())
    assert store.commits == ["heartbeat at step 0", "heartbeat at step 8"]
    beat = store.read_json(f"{PREFIX}/heartbeat.json")
    assert (beat["attempt"], beat["step"], beat["total_steps"], beat["loss"]) == (2, 8, 100, 4.2)
