"""A job whose deadline passes during training stores what it has: the adapter trained so far and a checkpoint of
its last step, in one commit, without `DONE`. It then fails saying where they are, and the next attempt of the
run resumes from that checkpoint. The attempts train in this process against a store that counts its commits
(the same path through a child process: test_worker_sft_job.py's deadline test)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from transformers import TrainerControl, TrainerState
from worker_test_support import BASE_TRAINING, CountingStore, train_in_process

from loraflow_worker.contract import PartialResult, Progress
from loraflow_worker.training.monitor import DeadlineReached, TrainingMonitor

TRAINING_S = 5.0
"""Deadline of each attempt, from its start: loading takes about a second in a process that has imported the
training stack already, the rest is training."""


@dataclass
class Attempt:
    error: str
    commits: list[str]
    partial: PartialResult
    checkpoints: list[str]
    progress: list[Progress]


@dataclass
class DeadlineRun:
    first: Attempt
    second: Attempt
    run_dir: Path
    store: CountingStore


@pytest.fixture(scope="module")
def deadline_run(tiny_model_dir, make_job, tmp_path_factory) -> DeadlineRun:
    """`run-d`: two attempts of a run far longer than its deadline allows, the second resuming the first."""
    store = CountingStore(tmp_path_factory.mktemp("store"))
    run_dir = store.root / "runs" / "run-d"

    def attempt(number: int) -> Attempt:
        job = make_job("run-d", tiny_model_dir, store.root, training={**BASE_TRAINING, "max_steps": 100_000},
                       attempt=number, deadline_epoch_s=time.time() + TRAINING_S)
        commits_before, progress = len(store.commits), []
        with pytest.raises(DeadlineReached) as stopped:
            train_in_process(job, store, tmp_path_factory.mktemp("work"), progress)
        return Attempt(str(stopped.value), store.commits[commits_before:],
                       PartialResult.model_validate_json((run_dir / "partial" / "result.json").read_text()),
                       sorted(p.name for p in (run_dir / "checkpoints").iterdir()), progress)

    return DeadlineRun(attempt(1), attempt(2), run_dir, store)


def test_the_deadline_save_is_one_commit(deadline_run):
    step = deadline_run.first.partial.step
    assert deadline_run.first.commits == [f"run run-d attempt 1: deadline at step {step}, checkpoint and adapter so far"]


def test_the_deadline_save_holds_a_complete_checkpoint_of_the_last_step(deadline_run):
    first = deadline_run.first
    assert first.partial.step > 0 and first.checkpoints == [f"step-{first.partial.step}"]
    assert first.partial.checkpoint_path == f"runs/run-d/checkpoints/step-{first.partial.step}"
    # The commit's last checkpoint file is its marker; partial/result.json comes after the partial adapter.
    paths = deadline_run.store.commit_paths[0]
    assert {f"{first.partial.checkpoint_path}/{name}" for name in ("optimizer.pt", "trainer_state.json")} <= set(paths)
    assert paths.index(f"{first.partial.checkpoint_path}/COMPLETE") < paths.index("runs/run-d/partial/result.json")
    assert paths[-1] == "runs/run-d/partial/result.json"


def test_the_deadline_save_holds_the_adapter_trained_so_far(deadline_run, tiny_model_dir):
    adapter = deadline_run.run_dir / "partial" / "adapter"
    assert deadline_run.first.partial.adapter_path == "runs/run-d/partial/adapter"
    assert (adapter / "adapter_model.safetensors").is_file() and (adapter / "tokenizer.json").is_file()
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == str(tiny_model_dir)


def test_the_partial_result_says_how_far_training_got_and_why_it_stopped(deadline_run):
    partial = deadline_run.first.partial
    assert (partial.run_id, partial.attempt, partial.total_steps) == ("run-d", 1, 100_000)
    assert partial.loss is not None
    assert partial.stopped_because.startswith(f"deadline reached at step {partial.step} of 100000")


def test_a_run_stopped_by_its_deadline_has_no_done(deadline_run):
    assert not (deadline_run.run_dir / "DONE").exists()
    assert not (deadline_run.run_dir / "result.json").exists()


def test_the_error_names_the_step_where_the_saves_are_and_how_to_resume(deadline_run):
    partial, store = deadline_run.first.partial, deadline_run.store
    error = deadline_run.first.error
    assert error.startswith(f"deadline reached at step {partial.step} of 100000: ")
    assert f"adapter trained so far is stored at {store.display_url(partial.adapter_path)} " in error
    assert f"checkpoint of step {partial.step} at {store.display_url(partial.checkpoint_path)};" in error
    assert error.endswith("retrying the same flow run resumes from that checkpoint.")


def test_the_next_attempt_resumes_from_the_deadline_checkpoint(deadline_run):
    step = deadline_run.first.partial.step
    progress = deadline_run.second.progress
    assert f"resuming from the checkpoint at step {step}" in [p.message for p in progress if p.stage == "loading"]
    assert next(p for p in progress if p.stage == "training").step == step + 1


def test_the_next_deadline_save_replaces_the_previous_checkpoint_and_partial_adapter(deadline_run):
    first, second = deadline_run.first.partial, deadline_run.second.partial
    assert (second.attempt, second.step > first.step) == (2, True)
    assert deadline_run.second.checkpoints == [f"step-{second.step}"]  # keep_checkpoints=1
    assert len(deadline_run.second.commits) == 1


def test_a_passed_deadline_stops_training_after_a_checkpoint_of_the_step():
    monitor = TrainingMonitor(lambda progress: None, deadline_epoch_s=time.time() - 1)
    state, control = TrainerState(global_step=7, max_steps=100), TrainerControl()
    monitor.on_train_begin(None, state, control)
    monitor.on_step_end(None, state, control)
    assert monitor.deadline_hit and control.should_training_stop and control.should_save


def test_a_deadline_that_passes_at_the_last_step_lets_the_run_complete():
    monitor = TrainingMonitor(lambda progress: None, deadline_epoch_s=time.time() - 1)
    state, control = TrainerState(global_step=100, max_steps=100), TrainerControl()
    monitor.on_train_begin(None, state, control)
    control.should_training_stop = True  # DefaultFlowCallback's word at the last step
    monitor.on_step_end(None, state, control)
    assert not monitor.deadline_hit and not control.should_save
