"""Held-out evaluation (`evaluation` in the job): which rows are held out, the SFT eval loss and the GRPO eval reward
series a run stores in `metrics.json` and sends in its progress, and no evaluation at a deadline's step.

Two short in-process runs of the tiny model (module fixtures): 20 SFT steps evaluated every 10, and 3 GRPO steps
evaluated every 2 on 6 held-out prompts.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from datasets import Dataset
from pydantic import ValidationError
from transformers import TrainerControl, TrainerState, TrainingArguments
from worker_test_support import train_in_process

from loraflow_worker.artifacts import FileStore, open_store
from loraflow_worker.contract import EvaluationSettings, JobInput, JobResult, Progress, TrainMetrics
from loraflow_worker.training.grpo import train_grpo
from loraflow_worker.artifacts.manifest import rows_sha256
from loraflow_worker.self_test.tiny_model import DEFAULT_CORPUS
from loraflow_worker.training.monitor import TrainingMonitor
from loraflow_worker.dataset.loading import evaluation_split, load_job_dataset
from loraflow_worker.training.run import TrainOutcome

SFT_STEPS, SFT_EVERY = 20, 10
GRPO_STEPS, GRPO_EVERY, GRPO_SAMPLES = 3, 2, 6
CORPUS_ROWS = sum(1 for line in DEFAULT_CORPUS.read_text().splitlines() if line.strip())


def _job(model_dir: Path, store_root: Path, run_id: str, **fields) -> dict:
    dataset_path = f"runs/{run_id}/dataset/train.jsonl"
    (store_root / dataset_path).parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(DEFAULT_CORPUS, store_root / dataset_path)
    return {"run_id": run_id, "model": {"id": str(model_dir)}, "dataset": {"store_path": dataset_path},
            "artifact_store": store_root.as_uri(), **fields}


def _split(job: dict, store_root: Path, work_dir: Path) -> tuple[Dataset, Dataset]:
    parsed = JobInput.model_validate(job)
    store = FileStore(store_root)
    return evaluation_split(load_job_dataset(parsed.dataset, store, work_dir, parsed.training.seed).rows, parsed, store,
                            work_dir)


@dataclass
class SftRun:
    result: JobResult
    run_dir: Path
    progress: list[Progress]


@pytest.fixture(scope="module")
def sft_run(tiny_model_dir, tmp_path_factory) -> SftRun:
    store_root, work_dir = tmp_path_factory.mktemp("store"), tmp_path_factory.mktemp("work")
    job = _job(tiny_model_dir, store_root, "sft-eval",
               training={"max_steps": SFT_STEPS, "learning_rate": 1e-2, "batch_size": 8},
               evaluation={"fraction": 0.2, "every_steps": SFT_EVERY})
    progress: list[Progress] = []
    result = train_in_process({"input": job}, FileStore(store_root), work_dir, progress)
    return SftRun(result, store_root / "runs" / "sft-eval", progress)


@dataclass
class GrpoRun:
    job: JobInput
    outcome: TrainOutcome
    progress: list[Progress]


@pytest.fixture(scope="module")
def grpo_run(tiny_model_dir, tmp_path_factory) -> GrpoRun:
    store_root, work_dir = tmp_path_factory.mktemp("store"), tmp_path_factory.mktemp("work")
    job = JobInput.model_validate(_job(
        tiny_model_dir, store_root, "grpo-eval", algorithm="grpo",
        training={"max_steps": GRPO_STEPS, "learning_rate": 3e-2, "batch_size": 8},
        grpo={"num_generations": 4, "max_completion_length": 12, "rewards": [{"name": "digit_fraction"}]},
        evaluation={"fraction": 0.2, "every_steps": GRPO_EVERY, "max_samples": GRPO_SAMPLES}))
    progress: list[Progress] = []
    outcome = train_grpo(job, open_store(job.artifact_store), work_dir, progress.append)
    return GrpoRun(job, outcome, progress)


def test_the_same_seed_holds_the_same_rows_out_and_none_of_them_is_trained_on(tiny_model_dir, tmp_path):
    job = _job(tiny_model_dir, tmp_path / "store", "r", evaluation={"fraction": 0.2})
    train, held_out = _split(job, tmp_path / "store", tmp_path / "w1")
    train_again, held_out_again = _split(job, tmp_path / "store", tmp_path / "w2")
    assert rows_sha256(held_out) == rows_sha256(held_out_again) and rows_sha256(train) == rows_sha256(train_again)
    assert len(held_out) == -(-CORPUS_ROWS * 2 // 10) and len(train) + len(held_out) == CORPUS_ROWS  # ceil(20 %)
    trained = {json.dumps(row, sort_keys=True) for row in train}
    assert not any(json.dumps(row, sort_keys=True) in trained for row in held_out)


def test_another_seed_holds_other_rows_out(tiny_model_dir, tmp_path):
    job = _job(tiny_model_dir, tmp_path / "store", "r", evaluation={"fraction": 0.2})
    _, held_out = _split(job, tmp_path / "store", tmp_path / "w1")
    _, other = _split({**job, "training": {"seed": 7}}, tmp_path / "store", tmp_path / "w2")
    assert rows_sha256(held_out) != rows_sha256(other)


def test_max_samples_caps_the_held_out_rows(tiny_model_dir, tmp_path):
    job = _job(tiny_model_dir, tmp_path / "store", "r", evaluation={"fraction": 0.4, "max_samples": 5})
    train, held_out = _split(job, tmp_path / "store", tmp_path / "w")
    assert len(held_out) == 5
    assert len(train) == CORPUS_ROWS - -(-CORPUS_ROWS * 4 // 10)  # the rows beyond the cap are not trained on either


def test_an_evaluation_file_in_the_store_is_the_held_out_set_and_the_whole_dataset_trains(tiny_model_dir, tmp_path):
    store_root = tmp_path / "store"
    eval_file = store_root / "runs" / "r" / "dataset" / "eval.jsonl"
    eval_file.parent.mkdir(parents=True)
    lines = DEFAULT_CORPUS.read_text().splitlines()[:3]
    eval_file.write_text("\n".join(lines) + "\n")
    job = _job(tiny_model_dir, store_root, "r", evaluation={"store_path": "runs/r/dataset/eval.jsonl"})
    train, held_out = _split(job, store_root, tmp_path / "w")
    assert len(train) == CORPUS_ROWS
    assert [json.dumps(row, sort_keys=True) for row in held_out] == \
        [json.dumps(json.loads(line), sort_keys=True) for line in lines]


def test_an_evaluation_needs_something_to_evaluate_and_at_most_one_held_out_source():
    with pytest.raises(ValidationError, match="give `fraction` .*, `tasks` or `benchmarks`"):
        EvaluationSettings()
    with pytest.raises(ValidationError, match="give one of `fraction` .* not both"):
        EvaluationSettings(fraction=0.1, store_path="runs/r/dataset/eval.jsonl")


def test_a_held_out_share_of_half_or_more_is_refused():
    with pytest.raises(ValidationError, match="fraction"):
        EvaluationSettings(fraction=0.5)


def test_sft_stores_an_eval_loss_series_from_the_start_to_the_last_step_that_falls(sft_run):
    stored = TrainMetrics.model_validate_json((sft_run.run_dir / "metrics.json").read_text())
    assert [step for step, _ in stored.eval_loss] == [0, SFT_EVERY, SFT_STEPS]
    assert stored.eval_loss[-1][1] < 0.75 * stored.eval_loss[0][1], stored.eval_loss
    assert stored.eval_reward == [] and stored.eval_loss == sft_run.result.metrics.eval_loss


def test_sft_progress_carries_the_latest_eval_loss_and_its_step(sft_run):
    evaluated = [update for update in sft_run.progress if update.eval_loss is not None]
    assert evaluated and evaluated[0].step == evaluated[0].eval_step == 0  # the first evaluation goes out at once
    assert evaluated[-1].eval_loss == sft_run.result.metrics.eval_loss[-1][1]
    assert {update.eval_step: update.eval_loss for update in evaluated} == dict(sft_run.result.metrics.eval_loss)


def test_grpo_stores_the_mean_eval_reward_at_the_start_every_n_steps_and_the_end(grpo_run):
    metrics = grpo_run.outcome.metrics
    assert [step for step, _ in metrics.eval_reward] == [0, GRPO_EVERY, GRPO_STEPS]
    assert all(0.0 <= reward <= 1.0 for _, reward in metrics.eval_reward)  # digit_fraction is a share
    assert metrics.eval_loss == []  # GRPO's eval loss says nothing a user needs


def test_grpo_progress_carries_the_latest_eval_reward_and_its_step(grpo_run):
    evaluated = [update for update in grpo_run.progress if update.eval_reward is not None]
    assert evaluated and evaluated[-1].eval_reward == grpo_run.outcome.metrics.eval_reward[-1][1]
    assert {update.eval_step: update.eval_reward for update in evaluated} == dict(grpo_run.outcome.metrics.eval_reward)
    assert all(update.eval_loss is None for update in evaluated)  # GRPO's eval loss is not its evaluation


def test_grpo_trains_on_the_rows_left_after_the_held_out_ones(grpo_run, tmp_path):
    store = open_store(grpo_run.job.artifact_store)
    train, _ = evaluation_split(load_job_dataset(grpo_run.job.dataset, store, tmp_path, grpo_run.job.training.seed).rows,
                                grpo_run.job, store, tmp_path)
    assert len(train) < CORPUS_ROWS and grpo_run.outcome.manifest.dataset_sha256 == rows_sha256(train)


def test_no_evaluation_runs_at_the_step_a_deadline_stops(tmp_path):
    monitor = TrainingMonitor(lambda progress: None, deadline_epoch_s=time.time() - 1, eval_key="eval_loss")
    args = TrainingArguments(output_dir=str(tmp_path), eval_strategy="steps", eval_steps=5, report_to="none")
    state, control = TrainerState(global_step=5, max_steps=10), TrainerControl(should_evaluate=True)
    monitor.on_train_begin(args, state, control)
    monitor.on_step_end(args, state, control)
    assert monitor.deadline_hit and control.should_save and not control.should_evaluate
