"""Checkpoints in the store: one commit each, pruned, rate-limited, asked for by time, found again on resume, and
only the run's own: a resume reads a checkpoint whose record the run signed, at its files' hashes.

The Trainer's callbacks are driven directly here with real `TrainerState`s and local checkpoint folders.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import TrainerControl, TrainerState, TrainingArguments

from worker_test_support import CHECKPOINT_KEY, Clock, CountingStore

from loraflow_worker.training.checkpoints import (
    COMPLETE,
    CheckpointTimer,
    CheckpointUploader,
    download_own_checkpoint,
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
    uploader = CheckpointUploader(store, PREFIX, keep=2, key=CHECKPOINT_KEY, clock=clock)
    for step in (10, 20, 30):
        _save(uploader, args, step)
        clock.now += 61
    assert len(store.commits) == 3
    assert stored_checkpoints(store, PREFIX) == {20: True, 30: True}


def test_checkpoint_sooner_than_the_commit_interval_stays_local(store, args):
    clock = Clock()
    uploader = CheckpointUploader(store, PREFIX, keep=3, key=CHECKPOINT_KEY, clock=clock)
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


def _own(store, args, *steps: int) -> None:
    """Checkpoints the run stored itself, as its uploader stores them."""
    uploader = CheckpointUploader(store, PREFIX, keep=len(steps), key=CHECKPOINT_KEY, min_interval_s=0)
    for step in steps:
        _save(uploader, args, step)


def _plant(store, step: int, marker: bytes = b"{}") -> None:
    """A checkpoint folder someone who can write the store put in the run's folder."""
    store.put({f"{PREFIX}/checkpoints/step-{step}/trainer_state.json": b'{"global_step": %d}' % step,
               f"{PREFIX}/checkpoints/step-{step}/{COMPLETE}": marker}, message="planted")


def test_resume_downloads_the_latest_own_checkpoint_in_the_trainers_layout(store, args, tmp_path):
    _own(store, args, 10, 20)
    store.put({f"{PREFIX}/checkpoints/step-30/trainer_state.json": b"{}"}, message="a write cut short")
    local, ignored = download_own_checkpoint(store, PREFIX, tmp_path / "out", CHECKPOINT_KEY)
    assert local == tmp_path / "out" / "checkpoint-20"
    assert sorted(p.name for p in local.iterdir()) == ["adapter_model.safetensors", "trainer_state.json"]
    assert (local / "adapter_model.safetensors").read_bytes() == b"weights 20"
    assert list(ignored) == ["step-30"]


def test_resume_finds_nothing_in_a_fresh_run(store, tmp_path):
    assert download_own_checkpoint(store, PREFIX, tmp_path / "out", CHECKPOINT_KEY) == (None, {})


def test_a_planted_later_checkpoint_is_ignored_and_named(store, args, tmp_path, caplog):
    _own(store, args, 100)
    _plant(store, 100000)
    local, ignored = download_own_checkpoint(store, PREFIX, tmp_path / "out", CHECKPOINT_KEY)
    assert local == tmp_path / "out" / "checkpoint-100"
    assert list(ignored) == ["step-100000"] and "not a record of this run" in ignored["step-100000"]
    assert "ignoring checkpoint step-100000" in caplog.text


def test_a_planted_checkpoint_with_a_copied_record_is_ignored(store, args, tmp_path):
    # The run's own signed record, copied beside files of someone else's under a later step: the record names
    # another step, and its hashes other files.
    _own(store, args, 100)
    record = store.read_bytes(f"{PREFIX}/checkpoints/step-100/{COMPLETE}")
    _plant(store, 100000, marker=record)
    local, ignored = download_own_checkpoint(store, PREFIX, tmp_path / "out", CHECKPOINT_KEY)
    assert local.name == "checkpoint-100" and "not of this folder" in ignored["step-100000"]


def test_a_record_signed_with_another_key_is_not_the_runs_own(store, args, tmp_path):
    uploader = CheckpointUploader(store, PREFIX, keep=1, key="0" * 64, min_interval_s=0)
    _save(uploader, args, 100)
    local, ignored = download_own_checkpoint(store, PREFIX, tmp_path / "out", CHECKPOINT_KEY)
    assert local is None and "not signed with this run's checkpoint key" in ignored["step-100"]


def test_an_own_checkpoint_whose_file_changed_is_not_resumed_from(store, args, tmp_path, caplog):
    _own(store, args, 10, 20)
    store.put({f"{PREFIX}/checkpoints/step-20/adapter_model.safetensors": b"swapped"}, message="tampered")
    local, ignored = download_own_checkpoint(store, PREFIX, tmp_path / "out", CHECKPOINT_KEY)
    assert local == tmp_path / "out" / "checkpoint-10"  # the older own one, intact
    assert (local / "adapter_model.safetensors").read_bytes() == b"weights 10"
    assert "adapter_model.safetensors changed" in ignored["step-20"]


def test_a_file_added_to_an_own_checkpoint_is_never_loaded(store, args, tmp_path):
    # A pickle beside the run's files would run code in `torch.load` with the run's token.
    _own(store, args, 20)
    store.put({f"{PREFIX}/checkpoints/step-20/rng_state.pth": b"pickle"}, message="planted file")
    local, ignored = download_own_checkpoint(store, PREFIX, tmp_path / "out", CHECKPOINT_KEY)
    assert local is None and "rng_state.pth was added" in ignored["step-20"]


def test_without_a_checkpoint_key_no_checkpoint_is_resumed(store, args, tmp_path):
    _own(store, args, 20)
    local, ignored = download_own_checkpoint(store, PREFIX, tmp_path / "out", None)
    assert local is None and "no checkpoint key" in ignored["step-20"]


def test_pruning_keeps_only_own_checkpoints_and_drops_planted_ones(store, args):
    _own(store, args, 10)
    _plant(store, 15)
    uploader = CheckpointUploader(store, PREFIX, keep=2, key=CHECKPOINT_KEY, min_interval_s=0)
    _save(uploader, args, 20)
    assert stored_checkpoints(store, PREFIX) == {10: True, 20: True}


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
