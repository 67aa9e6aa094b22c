"""Benchmarks (`evaluation.benchmarks`): lm-evaluation-harness tasks scored for the base model and for the adapter, a
private task read from a task folder with no Hub, unknown task names refused, and the task list the control plane
checks names against kept equal to the installed harness's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from loraflow_worker.contract.benchmark_tasks import (
    HARNESS_TASKS_FILE,
    harness_task_names,
    task_dir_names,
    unknown_benchmark_tasks,
)
from loraflow_worker.contract.task_evaluation import BenchmarkScore, BenchmarkSettings
from loraflow_worker.evaluation.benchmarks import BenchmarkError, run_benchmarks
from loraflow_worker.evaluation.task_list import installed_harness_tasks, render

CHOICE_TASK = """\
task: colours
dataset_path: json
dataset_kwargs:
  data_files:
    test: data/colours.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
PERPLEXITY_TASK = """\
task: greeting_perplexity
tag: [private_greetings]
dataset_path: json
dataset_kwargs:
  data_files:
    test: data/greetings.jsonl
test_split: test
output_type: loglikelihood
doc_to_text: "{{prompt}}"
doc_to_target: " {{reply}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
"""
COLOURS = [
    {"question": "The sky on a clear day is", "choices": [" blue", " green"], "answer": 0},
    {"question": "Fresh grass is", "choices": [" red", " green"], "answer": 1},
    {"question": "Snow is", "choices": [" white", " black"], "answer": 0},
    {"question": "A ripe banana is", "choices": [" purple", " yellow"], "answer": 1},
    {"question": "Coal is", "choices": [" black", " white"], "answer": 0},
    {"question": "A ripe tomato is", "choices": [" blue", " red"], "answer": 1},
]
GREETINGS = [
    {"prompt": "Hello, how are you?", "reply": "I am fine, thank you."},
    {"prompt": "Good morning!", "reply": "Good morning to you too."},
    {"prompt": "What is your name?", "reply": "My name is Tiny."},
    {"prompt": "Nice to meet you.", "reply": "Nice to meet you as well."},
]


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    """A folder of the harness's own task YAMLs with their data as JSONL files beside them, as a run ships it."""
    folder = tmp_path_factory.mktemp("tasks")
    (folder / "data").mkdir()
    (folder / "colours.yaml").write_text(CHOICE_TASK)
    (folder / "greetings.yaml").write_text(PERPLEXITY_TASK)
    (folder / "data" / "colours.jsonl").write_text("".join(json.dumps(row) + "\n" for row in COLOURS))
    (folder / "data" / "greetings.jsonl").write_text("".join(json.dumps(row) + "\n" for row in GREETINGS))
    return folder


@pytest.fixture(scope="module")
def adapter_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """An adapter of the tiny model whose B matrices are not zero (PEFT's `init_lora_weights=False`), so that it
    changes what the model predicts, as a trained one does."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=64, target_modules="all-linear",
                                                  init_lora_weights=False))
    folder = tmp_path_factory.mktemp("adapter")
    peft_model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def scores(task_dir, tiny_model_dir, adapter_dir) -> list[BenchmarkScore]:
    settings = BenchmarkSettings(tasks=["colours", "private_greetings"], batch_size=4,
                                 task_dir_store_path="runs/r/evaluation/benchmarks")
    lines: list[str] = []
    found = run_benchmarks(settings, tiny_model_dir, adapter_dir, task_dir, device="cpu", report=lines.append)
    assert any("for the adapter (transformers)" in line for line in lines)
    return found


def test_a_private_task_is_scored_for_the_base_and_the_adapter_with_standard_errors(scores):
    colours = next(s for s in scores if s.task == "colours")
    assert colours.metric == "acc"
    assert colours.n == len(COLOURS)
    assert 0.0 <= colours.base <= 1.0 and 0.0 <= colours.adapter <= 1.0
    assert colours.base_stderr is not None and colours.adapter_stderr is not None
    assert colours.delta == pytest.approx(colours.adapter - colours.base)
    assert colours.higher_is_better
    assert colours.name == "benchmark:colours/acc"


def test_the_adapter_changes_the_score_and_lower_is_better_comes_from_the_harness(scores):
    perplexity = next(s for s in scores if s.task == "greeting_perplexity")
    assert perplexity.metric == "perplexity"
    assert perplexity.n == len(GREETINGS)
    assert not perplexity.higher_is_better
    assert perplexity.base > 1.0 and perplexity.adapter > 1.0
    assert perplexity.adapter != pytest.approx(perplexity.base)
    assert perplexity.base_stderr is not None and perplexity.adapter_stderr is not None


def test_an_unknown_task_is_refused_naming_it(task_dir, tiny_model_dir, adapter_dir):
    settings = BenchmarkSettings(tasks=["colours", "no_such_benchmark"])
    with pytest.raises(BenchmarkError, match=r"evaluation\.benchmarks\.tasks: .*no task no_such_benchmark"):
        run_benchmarks(settings, tiny_model_dir, adapter_dir, task_dir, device="cpu")


def test_the_shipped_task_list_is_the_installed_harness_s():
    assert HARNESS_TASKS_FILE.read_text() == render(installed_harness_tasks()), (
        "contract/benchmark_tasks.txt differs from the installed lm-eval's tasks: run "
        "python -m loraflow_worker.evaluation.task_list")


def test_the_control_plane_check_knows_harness_tasks_and_the_task_folder_s(task_dir):
    assert {"hellaswag", "gsm8k", "mmlu"} <= harness_task_names()
    private = task_dir_names(task_dir)
    assert private == {"colours", "greeting_perplexity", "private_greetings"}
    assert unknown_benchmark_tasks(["hellaswag", "colours", "hellaswagg"], private) == ["hellaswagg"]
    assert unknown_benchmark_tasks(["colours"]) == ["colours"]
