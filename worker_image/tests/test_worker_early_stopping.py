"""Early stopping (`training.early_stopping`): a run whose held-out loss stops improving stops before its last step
and stores the adapter of its best evaluation; a run that keeps improving trains to the end; an attempt resumed from a
checkpoint keeps the best evaluation from before it; DPO stops on its held-out reward accuracy and GRPO on its
held-out reward, where higher is better; early stopping without an evaluation is refused before anything runs.

Short SFT runs of the tiny model at a constant learning rate, evaluated on a fifth of the data held out: at 0.1 the
held-out loss falls for a few steps and then wanders (the plateau), at 0.01 it falls at every evaluation six steps
apart. A constant rate makes a run's first steps the same whatever its length, so the run trained to exactly the best
evaluation's step is the reference for the adapter an early-stopped run keeps."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_worker_dpo import TRAINING, dpo_job, preference_rows
from worker_test_support import plant_fault, train_in_process

from loraflow_worker.artifacts import FileStore
from loraflow_worker.contract import CONTRACT_VERSION, JobResult, Progress, TrainMetrics
from loraflow_worker.handler import WORK_DIR_ENV, JobFailed, JobRefused, handler
from loraflow_worker.self_test.tiny_model import DEFAULT_CORPUS
from loraflow_worker.training.early_stopping import BEST_ADAPTER_FILE

MAX_STEPS = 30
PLATEAU = {"max_steps": MAX_STEPS, "learning_rate": 0.1, "lr_scheduler": "constant", "batch_size": 8,
           "checkpoint_every_minutes": None}
STOPPING = {"metric": "eval_loss", "patience": 3, "min_delta": 0.05}
EVALUATION = {"fraction": 0.2, "every_steps": 2}


def _job(model_dir: Path, store_root: Path, run_id: str, **fields) -> dict:
    dataset_path = f"runs/{run_id}/dataset/train.jsonl"
    (store_root / dataset_path).parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(DEFAULT_CORPUS, store_root / dataset_path)
    return {"run_id": run_id, "model": {"id": str(model_dir)}, "dataset": {"store_path": dataset_path},
            "artifact_store": store_root.as_uri(), **fields}


def _train(job: dict, store_root: Path, work_dir: Path) -> tuple[JobResult, list[Progress]]:
    progress: list[Progress] = []
    return train_in_process({"input": job}, FileStore(store_root), work_dir, progress), progress


def adapter_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "adapter" / "adapter_model.safetensors")


def stored_metrics(run_dir: Path) -> TrainMetrics:
    return TrainMetrics.model_validate_json((run_dir / "metrics.json").read_text())


@dataclass
class Plateau:
    result: JobResult
    progress: list[Progress]
    run_dir: Path
    trained_to: dict[int, tuple[JobResult, Path]]
    """The same run without early stopping, trained to exactly step N: its result and its folder."""


@pytest.fixture(scope="module")
def plateau(tiny_model_dir, tmp_path_factory) -> Plateau:
    store_root = tmp_path_factory.mktemp("store")
    job = _job(tiny_model_dir, store_root, "plateau", training={**PLATEAU, "early_stopping": STOPPING},
               evaluation=EVALUATION)
    result, progress = _train(job, store_root, tmp_path_factory.mktemp("work"))
    trained_to = {}
    for step in (result.metrics.early_stopping.best_step, result.metrics.steps):
        reference = _job(tiny_model_dir, store_root, f"to-{step}", training={**PLATEAU, "max_steps": step},
                         evaluation=EVALUATION)
        trained_to[step] = (_train(reference, store_root, tmp_path_factory.mktemp("work"))[0],
                            store_root / "runs" / f"to-{step}")
    return Plateau(result, progress, store_root / "runs" / "plateau", trained_to)


def test_a_run_whose_eval_loss_stops_improving_stops_before_its_last_step(plateau):
    stored = stored_metrics(plateau.run_dir)
    stopping = stored.early_stopping
    assert stopping.stopped and stopping.step == stored.steps < MAX_STEPS and stopping.total_steps == MAX_STEPS
    evaluated = dict(stored.eval_loss)
    assert max(evaluated) == stored.steps  # the evaluation that stopped it was the last
    # The best is the last evaluation that improved by more than min_delta; the `patience` after it did not.
    after = [loss for step, loss in stored.eval_loss if step > stopping.best_step]
    assert len(after) == STOPPING["patience"]
    assert all(loss > stopping.best_value - STOPPING["min_delta"] for loss in after), stored.eval_loss
    assert 0 < stopping.best_step < stopping.step and stopping.best_value == evaluated[stopping.best_step]
    assert stopping.reason == "eval_loss did not improve by more than 0.05 for 3 evaluations"
    assert stopping.metric == "eval_loss" and stored == plateau.result.metrics


def test_the_stored_adapter_is_the_best_evaluations(plateau):
    stopping = plateau.result.metrics.early_stopping
    reference, reference_dir = plateau.trained_to[stopping.best_step]
    kept, best = adapter_weights(plateau.run_dir), adapter_weights(reference_dir)
    assert kept.keys() == best.keys()
    for name, tensor in kept.items():
        torch.testing.assert_close(tensor, best[name], rtol=0, atol=1e-6, msg=name)
    # Trained to the best step, the reference evaluated there as the stopped run did.
    assert reference.metrics.eval_loss[-1] == pytest.approx((stopping.best_step, stopping.best_value))


def test_the_adapter_of_the_step_it_stopped_at_is_not_stored(plateau):
    _, last_dir = plateau.trained_to[plateau.result.metrics.steps]
    kept, last = adapter_weights(plateau.run_dir), adapter_weights(last_dir)
    assert any(not torch.allclose(tensor, last[name], rtol=0, atol=1e-4) for name, tensor in kept.items())
    assert not (plateau.run_dir / "adapter" / BEST_ADAPTER_FILE).exists()  # the snapshot is the worker's own


def test_the_run_says_where_it_stopped_and_which_adapter_it_kept(plateau):
    stopping = plateau.result.metrics.early_stopping
    saving = [update for update in plateau.progress if update.stage == "saving"][-1]
    assert saving.message.startswith(
        f"stopped at step {stopping.step} of {MAX_STEPS}: eval_loss did not improve by more than 0.05 for 3 "
        f"evaluations; adapter from step {stopping.best_step} (eval_loss {stopping.best_value:.4f}, the best "
        "evaluation)")


def test_progress_names_each_evaluations_step(plateau):
    evaluated = {update.eval_step: update.eval_loss for update in plateau.progress if update.eval_step is not None}
    assert evaluated == dict(plateau.result.metrics.eval_loss)


def test_a_run_that_keeps_improving_trains_to_the_end(tiny_model_dir, tmp_path):
    store_root = tmp_path / "store"
    job = _job(tiny_model_dir, store_root, "improving",
               training={**PLATEAU, "learning_rate": 0.01, "early_stopping": {"patience": 1}},
               evaluation={"fraction": 0.2, "every_steps": 6})
    result, _ = _train(job, store_root, tmp_path / "work")
    losses = [loss for _, loss in result.metrics.eval_loss]
    assert losses == sorted(losses, reverse=True) and len(losses) == MAX_STEPS // 6 + 1  # better at every evaluation
    stopping = result.metrics.early_stopping
    assert result.metrics.steps == MAX_STEPS and not stopping.stopped and stopping.reason is None
    assert stopping.best_step == MAX_STEPS and stopping.metric == "eval_loss"  # the algorithm's, unnamed


def test_an_attempt_resumed_from_a_checkpoint_keeps_the_best_evaluation_before_it(plateau, tiny_model_dir,
                                                                                  make_job, tmp_path):
    store_root = tmp_path / "store"
    best, stopped = plateau.result.metrics.early_stopping.best_step, plateau.result.metrics.early_stopping.step
    # A checkpoint after the best evaluation, and the first attempt killed before early stopping would stop it.
    checkpoint = best + 2
    assert checkpoint < stopped
    training = {**PLATEAU, "early_stopping": STOPPING, "checkpoint_every_steps": checkpoint}
    with pytest.MonkeyPatch.context() as env:
        env.setenv(WORK_DIR_ENV, str(tmp_path / "work"))
        with pytest.MonkeyPatch.context() as fault:
            plant_fault(fault, "kill", at_step=checkpoint + 1)
            with pytest.raises(JobFailed):
                handler(make_job("resumed", tiny_model_dir, store_root, training=training, evaluation=EVALUATION))
        result = JobResult.model_validate(handler(make_job("resumed", tiny_model_dir, store_root, training=training,
                                                           evaluation=EVALUATION, attempt=2)))
    assert result.metrics.early_stopping == plateau.result.metrics.early_stopping
    kept, uninterrupted = adapter_weights(store_root / "runs" / "resumed"), adapter_weights(plateau.run_dir)
    for name, tensor in kept.items():
        torch.testing.assert_close(tensor, uninterrupted[name], rtol=0, atol=1e-6, msg=name)


def test_early_stopping_without_an_evaluation_is_refused_naming_both(tmp_path):
    job = _job(Path("/nonexistent/model"), tmp_path / "store", "r", training={"early_stopping": {"patience": 2}})
    with pytest.raises(JobRefused) as refused:
        handler({"id": "job-1", "input": {"contract_version": CONTRACT_VERSION, **job}})
    assert "`training.early_stopping`" in str(refused.value) and "held-out rows" in str(refused.value)


def test_early_stopping_with_task_evaluations_alone_is_refused_it_needs_held_out_rows(tmp_path):
    job = _job(Path("/nonexistent/model"), tmp_path / "store", "r", training={"early_stopping": {"patience": 2}},
               evaluation={"tasks": [{"name": "phrase", "store_path": "t.jsonl", "graders": [{"kind": "contains"}]}]})
    with pytest.raises(JobRefused, match="no held-out rows"):
        handler({"id": "job-1", "input": {"contract_version": CONTRACT_VERSION, **job}})


def test_a_metric_the_algorithm_does_not_record_is_refused(tmp_path):
    job = _job(Path("/nonexistent/model"), tmp_path / "store", "r", evaluation={"fraction": 0.1},
               training={"early_stopping": {"metric": "eval_reward"}})
    with pytest.raises(JobRefused, match=r"`training.early_stopping.metric` 'eval_reward' is recorded by grpo runs "
                                         r"only, not by algorithm 'sft': use eval_loss"):
        handler({"id": "job-1", "input": {"contract_version": CONTRACT_VERSION, **job}})


def test_dpo_stops_on_its_held_out_reward_accuracy_where_higher_is_better(make_job, tiny_model_dir, tmp_path):
    store_root = tmp_path / "store"
    job = dpo_job(make_job, tiny_model_dir, store_root, "dpo-stop", preference_rows(),
                  training={**TRAINING, "early_stopping": {"metric": "eval_reward_accuracies", "patience": 1}},
                  evaluation={"fraction": 0.2, "every_steps": 4})
    progress: list[Progress] = []
    result = train_in_process(job, FileStore(store_root), tmp_path / "work", progress)
    accuracies = dict(result.metrics.eval_reward_accuracies)
    stopping = result.metrics.early_stopping
    # The held-out pairs' accuracy rose from none preferred (a new adapter prefers neither answer) to all: a rise
    # counts as the improvement, and nothing beats every pair preferred.
    assert accuracies[0] == 0.0 and stopping.best_value == accuracies[stopping.best_step] == 1.0
    assert stopping.stopped and stopping.step == result.metrics.steps < TRAINING["max_steps"]
    assert max(accuracies) == stopping.step == stopping.best_step + 4
    evaluated = {update.eval_step: update.eval_reward_accuracy for update in progress if update.eval_step is not None}
    assert evaluated == accuracies


def test_grpo_stops_on_its_held_out_reward_and_keeps_the_adapter_it_started_with(tiny_model_dir, tmp_path):
    store_root = tmp_path / "store"
    # No mean reward of a share (`digit_fraction`) can beat another by more than 1: the first evaluation stays the best.
    job = _job(tiny_model_dir, store_root, "grpo-stop", algorithm="grpo",
               training={"max_steps": 4, "learning_rate": 3e-2, "batch_size": 8,
                         "early_stopping": {"patience": 1, "min_delta": 1.0}},
               grpo={"num_generations": 4, "max_completion_length": 12, "rewards": [{"name": "digit_fraction"}]},
               evaluation={"fraction": 0.2, "every_steps": 1, "max_samples": 6})
    result, progress = _train(job, store_root, tmp_path / "work")
    stopping = result.metrics.early_stopping
    assert stopping.metric == "eval_reward" and stopping.stopped and (stopping.best_step, stopping.step) == (0, 1)
    assert result.metrics.steps == 1 and [step for step, _ in result.metrics.eval_reward] == [0, 1]
    # Step 0's adapter is the new one as PEFT made it: its B matrices zero, which one step of training moved.
    kept = adapter_weights(store_root / "runs" / "grpo-stop")
    assert all(not tensor.any() for name, tensor in kept.items() if "lora_B" in name)
    assert {update.eval_step for update in progress if update.eval_reward is not None} == {0, 1}
