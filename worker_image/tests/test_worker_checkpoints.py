"""Checkpoints in the store: one commit each, pruned, rate-limited, asked for by time, found again on resume.

The Trainer's callbacks are driven directly here with real `TrainerState`s and local checkpoint folders.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import TrainerControl, TrainerState, TrainingArguments

from worker_test_support import Clock, CountingStore

from loraflow_worker.training.checkpoints import (
    COMPLETE,
    CheckpointTimer,
    CheckpointUploader,
    download_latest_checkpoint,
    save_settings,
    stored_checkpoints,
)
from loraflow_worker.contract import TrainingSettings

PREFIX = "runs/r"


@pytest.fixture
def store(tmp_path) -> CountingStore:
    return CountingStore(tmp_path / "store")


@pytest.fixture
def args(tmp_path) -> TrainingArguments:
    return TrainingArguments(output_dir=str(tmp_path / "trainer"), report_to="none", use_cpu=True)


def _save(uploader: CheckpointUploader, args: TrainingArguments, step: int, *, last: bool = False) -> None:
    """What the Trainer does at a save: write checkpoint-<step>, then call on_save (`last`: training stops
    after this step, at its end or at the deadline)."""
    folder = Path(args.output_dir) / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "adapter_model.safetensors").write_bytes(b"weights %d" % step)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    uploader.on_save(args, TrainerState(global_step=step, max_steps=100), TrainerControl(should_training_stop=last))


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


def test_the_save_of_the_last_step_is_not_stored_as_a_checkpoint(store, args):
    # At the end the results are published instead; at the deadline train_job stores it with the partial adapter.
    uploader = CheckpointUploader(store, PREFIX, keep=1)
    _save(uploader, args, 100, last=True)
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


def test_timer_asks_for_a_save_once_the_interval_has_passed_since_training_began(args):
    clock = Clock()
    timer = CheckpointTimer(interval_s=900, clock=clock)
    timer.on_train_begin(args, TrainerState(), TrainerControl())
    clock.now += 899
    early = TrainerControl()
    timer.on_step_end(args, TrainerState(), early)
    clock.now += 1
    due = TrainerControl()
    timer.on_step_end(args, TrainerState(), due)
    assert (early.should_save, due.should_save) == (False, True)


def test_timer_counts_the_interval_again_from_each_save_whatever_asked_for_it(args):
    clock = Clock()
    timer = CheckpointTimer(interval_s=900, clock=clock)
    timer.on_train_begin(args, TrainerState(), TrainerControl())
    clock.now += 600
    timer.on_save(args, TrainerState(), TrainerControl())  # a step-based checkpoint
    clock.now += 600
    control = TrainerControl()
    timer.on_step_end(args, TrainerState(), control)
    assert not control.should_save


def test_checkpoints_are_on_by_default_every_15_minutes_and_not_by_step():
    training = TrainingSettings()
    assert (training.checkpoint_every_minutes, training.checkpoint_every_steps) == (15, None)
    # Time-based saves come from CheckpointTimer's `should_save`, which the Trainer honours under "no".
    assert save_settings(training)["save_strategy"] == "no"
