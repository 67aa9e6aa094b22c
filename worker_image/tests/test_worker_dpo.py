"""DPO (`algorithm = "dpo"`): on pairs whose chosen and rejected answers differ in style, the held-out reward accuracy
ends high and the margins rise; the adapter loads with PEFT; the reference is the base (a new adapter) or a frozen
copy of the adapter a run goes on from (its first loss is the sigmoid loss of no preference, log 2); a pair without
`rejected`, or with equal answers, is refused naming the row and the field."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from peft import PeftModel
from transformers import AutoModelForCausalLM
from worker_test_support import CountingStore, train_in_process

from loraflow_worker.artifacts import open_store
from loraflow_worker.contract import JobInput, TrainMetrics
from loraflow_worker.self_test.tiny_model import DEFAULT_CORPUS
from loraflow_worker.training.dpo import train_dpo

TRAINING = {"max_steps": 24, "learning_rate": 2e-2, "batch_size": 8, "logging_steps": 1}
REJECTED = "I do not know, and I will not guess."


def preference_rows(count: int | None = None) -> list[dict]:
    """The shipped chats as pairs: the chat's own answer chosen, a refusal in one fixed style rejected."""
    rows = []
    for line in DEFAULT_CORPUS.read_text(encoding="utf-8").splitlines()[:count]:
        prompt, answer = json.loads(line)["messages"]
        rows.append({"prompt": [prompt], "chosen": [answer], "rejected": [{"role": "assistant", "content": REJECTED}]})
    return rows


def dpo_job(make_job, model_dir: Path, store: Path, run_id: str, rows: list[dict], **overrides) -> dict:
    job = make_job(run_id, model_dir, store, algorithm="dpo", **overrides)
    path = store / job["input"]["dataset"]["store_path"]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return job


@pytest.fixture(scope="module")
def trained(make_job, tiny_model_dir, tmp_path_factory):
    store = CountingStore(tmp_path_factory.mktemp("store"))
    job = dpo_job(make_job, tiny_model_dir, store.root, "run-dpo", preference_rows(),
                  training=TRAINING, evaluation={"fraction": 0.2, "every_steps": 8})
    progress: list = []
    result = train_in_process(job, store, tmp_path_factory.mktemp("work"), progress)
    return store, result, progress


def test_the_held_out_reward_accuracy_ends_high_and_the_margins_rise(trained):
    store, result, _ = trained
    metrics = TrainMetrics.model_validate_json((store.root / "runs/run-dpo/metrics.json").read_text())
    assert [step for step, _ in metrics.eval_reward_accuracies] == [0, 8, 16, 24]
    assert metrics.eval_reward_accuracies[-1][1] >= 0.9, metrics.eval_reward_accuracies
    margins = [margin for _, margin in metrics.eval_reward_margins]
    assert margins[-1] > margins[0] + 1.0, margins
    assert len(metrics.reward_accuracies) == len(metrics.reward_margins) == 24
    assert metrics.final_loss < metrics.first_loss


def test_a_new_adapter_starts_at_the_loss_of_no_preference(trained):
    _, result, _ = trained
    assert result.metrics.first_loss == pytest.approx(math.log(2), abs=1e-3)


def test_the_progress_line_carries_the_reward_accuracy(trained):
    _, _, progress = trained
    accuracies = [update.reward_accuracy for update in progress if update.reward_accuracy is not None]
    assert accuracies and accuracies[-1] >= 0.9


def test_the_dpo_adapter_loads_with_peft(trained, tiny_model_dir):
    store, _, _ = trained
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                                      store.root / "runs/run-dpo/adapter")
    assert model.peft_config["default"].r == JobInput.model_fields["lora"].default_factory().rank


@pytest.fixture(scope="module")
def continued(trained, make_job, tiny_model_dir, tmp_path_factory):
    """`run-dpo-child`: 2 steps going on from `run-dpo`'s adapter, stored beside it."""
    store, _, _ = trained
    job = dpo_job(make_job, tiny_model_dir, store.root, "run-dpo-child", preference_rows(),
                  training={**TRAINING, "max_steps": 2}, lora={"init_from": "runs/run-dpo"})
    return store, train_in_process(job, store, tmp_path_factory.mktemp("work-child"), [])


def test_a_run_going_on_from_an_adapter_is_measured_against_a_frozen_copy_of_it(continued):
    _, result = continued
    # Against the base, the trained adapter would start far below log 2; against itself it starts at log 2.
    assert result.metrics.first_loss == pytest.approx(math.log(2), abs=1e-3)


def test_a_run_going_on_from_an_adapter_stores_only_the_adapter_it_trained(continued, tiny_model_dir):
    # TRL loads the frozen copy beside it as a second adapter, `ref`; the stored folder holds the trained one alone.
    store, _ = continued
    adapter = store.root / "runs/run-dpo-child/adapter"
    assert sorted(path.name for path in adapter.iterdir() if path.is_dir()) == []
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tiny_model_dir)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), adapter)
    assert list(model.peft_config) == ["default"]


def test_a_pair_without_rejected_is_refused_naming_the_row_and_the_field(make_job, tiny_model_dir, tmp_path):
    rows = preference_rows(5)
    del rows[2]["rejected"]
    job = JobInput.model_validate(dpo_job(make_job, tiny_model_dir, tmp_path, "run-missing", rows)["input"])
    with pytest.raises(ValueError, match=r"dataset, row 3: `rejected`: missing or empty"):
        train_dpo(job, open_store(job.artifact_store), tmp_path / "work", lambda progress: None)


def test_a_pair_of_equal_answers_is_refused_naming_the_row(make_job, tiny_model_dir, tmp_path):
    rows = preference_rows(5)
    rows[3]["rejected"] = rows[3]["chosen"]
    job = JobInput.model_validate(dpo_job(make_job, tiny_model_dir, tmp_path, "run-equal", rows)["input"])
    with pytest.raises(ValueError, match=r"dataset, row 4: `rejected`: the same answer as `chosen`"):
        train_dpo(job, open_store(job.artifact_store), tmp_path / "work", lambda progress: None)


def test_a_dpo_section_needs_algorithm_dpo_and_dpo_takes_no_sft_loss_settings(make_job, tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match=r"`dpo` is set but algorithm is 'sft'"):
        JobInput.model_validate(make_job("r", tiny_model_dir, tmp_path, dpo={"beta": 0.2})["input"])
    with pytest.raises(ValueError, match=r"`training.loss_on`: sft only"):
        JobInput.model_validate(make_job("r", tiny_model_dir, tmp_path, algorithm="dpo",
                                         training={"loss_on": "all"})["input"])
    job = JobInput.model_validate(make_job("r", tiny_model_dir, tmp_path, algorithm="dpo",
                                           dpo={"beta": 0.2, "loss_type": "ipo"})["input"])
    assert (job.dpo.beta, job.dpo.loss_type) == (0.2, "ipo")
