"""A run killed after a checkpoint: the next attempt resumes at the checkpoint and ends where an
uninterrupted run ends (the session's `finished_job`, same data, seed and settings), whatever later checkpoint
someone else who can write the store put beside it."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
from worker_test_support import BASE_TRAINING, PLANTED_SECRET, plant_fault, stored_files_containing

from loraflow_worker.handler import WORK_DIR_ENV, JobFailed, handler


@dataclass
class ResumedRun:
    first_error: str
    console_after_crash: str
    checkpoints_after_crash: list[str]
    result: dict
    progress: list[dict]
    run_dir: Path


@pytest.fixture(scope="module")
def resumed_run(tiny_model_dir, make_job, record_progress, tmp_path_factory) -> ResumedRun:
    store_root = tmp_path_factory.mktemp("store")
    run_dir = store_root / "runs" / "run-k"
    training = {**BASE_TRAINING, "checkpoint_every_steps": 20}
    with pytest.MonkeyPatch.context() as env:
        env.setenv(WORK_DIR_ENV, str(tmp_path_factory.mktemp("work")))
        env.setenv("HF_TOKEN", PLANTED_SECRET)
        with pytest.MonkeyPatch.context() as fault:
            plant_fault(fault, "kill", at_step=25)
            with pytest.raises(JobFailed) as first:
                handler(make_job("run-k", tiny_model_dir, store_root, training=training))
        console = (run_dir / "console.txt").read_text()
        checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
        # A teammate who can write the store plants a later checkpoint of their own making in the run's folder.
        planted = run_dir / "checkpoints" / "step-100000"
        shutil.copytree(run_dir / "checkpoints" / "step-20", planted)
        (planted / "COMPLETE").write_text(json.dumps({"step": 100000}))
        with record_progress() as progress:
            result = handler(make_job("run-k", tiny_model_dir, store_root, training=training, attempt=2))
    return ResumedRun(str(first.value), console, checkpoints, result, progress, run_dir)


def test_killed_attempt_reports_the_signal_and_leaves_its_checkpoint_and_console(resumed_run):
    assert resumed_run.first_error.startswith("the training process was killed by signal 9 (SIGKILL)")
    assert resumed_run.checkpoints_after_crash == ["step-20"]
    assert "checkpoint at step 20 stored" in resumed_run.console_after_crash
    assert resumed_run.console_after_crash.rstrip().endswith("LORAFLOW_TEST_CRASH_AT_STEP: crashing (kill)")


def test_next_attempt_resumes_at_the_checkpoint(resumed_run):
    messages = [u["message"] for u in resumed_run.progress if u["stage"] == "loading"]
    assert "resuming from the checkpoint at step 20" in messages
    first_training = next(u for u in resumed_run.progress if u["stage"] == "training")
    assert first_training["step"] == 21


def test_a_planted_later_checkpoint_is_ignored_and_named(resumed_run):
    messages = " ".join(u["message"] for u in resumed_run.progress if u["stage"] == "loading")
    assert "ignored (not this run's own, or changed since it stored them): step-100000 (its COMPLETE marker is not a " \
           "record of this run" in messages
    assert resumed_run.result["resumed_from_step"] == 20


def test_resumed_run_ends_with_the_losses_of_an_uninterrupted_run(resumed_run, finished_job):
    resumed = resumed_run.result["metrics"]["losses"]
    uninterrupted = finished_job.result["metrics"]["losses"]
    assert [step for step, _ in resumed] == list(range(1, 51))  # the losses from before the checkpoint too
    assert [loss for _, loss in resumed] == pytest.approx([loss for _, loss in uninterrupted], abs=1e-5)
    assert resumed_run.result["attempt"] == 2 and resumed_run.result["metrics"]["steps"] == 50


def test_resumed_run_replaces_the_older_checkpoint(resumed_run):
    # keep_checkpoints=1: step-40 (the resumed attempt's first save) replaced step-20 (and the planted step-100000)
    # in the same commit.
    assert sorted(p.name for p in (resumed_run.run_dir / "checkpoints").iterdir()) == ["step-40"]
    assert (resumed_run.run_dir / "DONE").is_file()


def test_planted_token_is_in_no_stored_file_of_either_attempt(resumed_run):
    assert stored_files_containing(resumed_run.run_dir, PLANTED_SECRET) == []
