"""What a job commits to the artifact store. The Hub allows about 128 commits per hour per repo, shared by every
run that writes to it, and each `put` is one commit: the jobs here train in this process against a store that
counts them."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from worker_test_support import CHECKPOINT_KEY, CountingStore, train_in_process

from loraflow_worker.training.checkpoints import CheckpointTimer, CheckpointUploader, save_settings, stored_checkpoints
from loraflow_worker.contract import JobInput
from loraflow_worker.training.sft import train_sft


@dataclass
class CountedJob:
    store: CountingStore
    prefix: str


@pytest.fixture(scope="module")
def completed_job(tiny_model_dir, make_job, tmp_path_factory) -> CountedJob:
    """`run-n`: 3 SFT steps at the default checkpoint settings."""
    store = CountingStore(tmp_path_factory.mktemp("store"))
    train_in_process(make_job("run-n", tiny_model_dir, store.root, training={"max_steps": 3}), store,
                     tmp_path_factory.mktemp("work"), [])
    return CountedJob(store, "runs/run-n")


def test_a_completed_job_makes_exactly_one_commit(completed_job):
    # No heartbeat, and no checkpoint in a run shorter than checkpoint_every_minutes: only the results.
    assert completed_job.store.commits == ["run run-n attempt 1: adapter, metrics, manifest, result, DONE"]


def test_the_results_commit_holds_everything_with_done_last(completed_job):
    paths = completed_job.store.commit_paths[0]
    prefix = completed_job.prefix
    assert {f"{prefix}/adapter/adapter_model.safetensors", f"{prefix}/metrics.json", f"{prefix}/manifest.json",
            f"{prefix}/result.json"} <= set(paths)
    assert paths[-1] == f"{prefix}/DONE"


def test_the_trainer_saves_a_checkpoint_whenever_the_timer_asks(tiny_model_dir, make_job, tmp_path):
    # No step-based checkpoints, so the Trainer runs with save_strategy "no": the timer alone asks, here at every step.
    store = CountingStore(tmp_path / "store")
    job = JobInput.model_validate(make_job("run-t", tiny_model_dir, store.root, training={"max_steps": 3})["input"])
    assert save_settings(job.training)["save_strategy"] == "no"
    callbacks = [CheckpointUploader(store, "runs/run-t", keep=1, key=CHECKPOINT_KEY, min_interval_s=0), CheckpointTimer(interval_s=0)]
    train_sft(job, store, tmp_path / "work", lambda progress: None, callbacks=callbacks)
    # Steps 1 and 2 stored (step 2's commit deletes step 1's); step 3 ends training, so its save is not stored.
    assert store.commits == ["checkpoint at step 1", "checkpoint at step 2"]
    assert stored_checkpoints(store, "runs/run-t") == {2: True}
