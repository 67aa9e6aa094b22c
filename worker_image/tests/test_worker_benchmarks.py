"""Benchmarks (`evaluation.benchmarks`): lm-evaluation-harness tasks scored for the base model and for the adapter, a
private task read from a task folder with no Hub, unknown task names refused, and the task list the control plane
checks names against kept equal to the installed harness's."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from loraflow_worker.artifacts import FileStore
from loraflow_worker.contract import JobResult, Progress
from loraflow_worker.contract.benchmark_tasks import (
    HARNESS_TASKS_FILE,
    harness_task_names,
    task_dir_names,
    unknown_benchmark_tasks,
)
from loraflow_worker.contract.task_evaluation import BenchmarkScore, BenchmarkSettings
from loraflow_worker.evaluation.benchmarks import BenchmarkError, benchmark_scores, run_benchmarks
from loraflow_worker.evaluation.task_list import installed_harness_tasks, render
from worker_test_support import CHOICE_TASK, COLOURS, train_in_process

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


@dataclass
class BenchmarkedRun:
    result: JobResult
    run_dir: Path


@pytest.fixture(scope="module")
def benchmarked_run(task_dir, tiny_model_dir, make_job, tmp_path_factory) -> BenchmarkedRun:
    """A short SFT job whose `evaluation` holds only benchmarks: the private tasks of `task_dir`, stored with the run as
    the control plane stores them."""
    store_root, work_dir = tmp_path_factory.mktemp("store"), tmp_path_factory.mktemp("work")
    shutil.copytree(task_dir, store_root / "runs" / "bench" / "evaluation" / "benchmarks")
    job = make_job("bench", tiny_model_dir, store_root,
                            training={"max_steps": 5, "learning_rate": 1e-2, "batch_size": 8},
                            evaluation={"benchmarks": {"tasks": ["colours", "private_greetings"], "batch_size": 4,
                                                       "task_dir_store_path": "runs/bench/evaluation/benchmarks"}})
    result = train_in_process(job, FileStore(store_root), work_dir, [])
    return BenchmarkedRun(result, store_root / "runs" / "bench")


@pytest.fixture(scope="module")
def scores(benchmarked_run) -> list[BenchmarkScore]:
    return benchmarked_run.result.metrics.benchmark_scores


def test_a_private_task_is_scored_for_the_base_and_the_adapter_with_standard_errors(scores):
    colours = next(s for s in scores if s.task == "colours")
    assert colours.metric == "acc"
    assert colours.n == len(COLOURS)
    assert 0.0 <= colours.base <= 1.0 and 0.0 <= colours.adapter <= 1.0
    assert colours.base_stderr is not None and colours.adapter_stderr is not None
    assert colours.delta == pytest.approx(colours.adapter - colours.base)
    assert colours.higher_is_better
    assert colours.name == "benchmark:colours/acc"


def test_the_trained_adapter_changes_the_score_and_lower_is_better_comes_from_the_harness(scores):
    perplexity = next(s for s in scores if s.task == "greeting_perplexity")
    assert perplexity.metric == "perplexity"
    assert perplexity.n == len(GREETINGS)
    assert not perplexity.higher_is_better
    assert perplexity.base > 1.0 and perplexity.adapter > 1.0
    assert perplexity.adapter != pytest.approx(perplexity.base)
    assert perplexity.base_stderr is not None and perplexity.adapter_stderr is not None


def test_the_scores_are_stored_in_the_run_s_metrics(benchmarked_run, scores):
    stored = json.loads((benchmarked_run.run_dir / "metrics.json").read_text())
    assert [BenchmarkScore.model_validate(row) for row in stored["benchmark_scores"]] == scores


def test_a_benchmark_that_fails_leaves_the_trained_adapter_stored_and_says_why(tiny_model_dir, make_job, tmp_path):
    store_root = tmp_path / "store"
    tasks = store_root / "runs" / "broken" / "evaluation" / "benchmarks"
    tasks.mkdir(parents=True)
    (tasks / "colours.yaml").write_text(CHOICE_TASK)  # its data file was never shipped
    job = make_job("broken", tiny_model_dir, store_root, training={"max_steps": 2, "batch_size": 8},
                   evaluation={"benchmarks": {"tasks": ["colours"],
                                              "task_dir_store_path": "runs/broken/evaluation/benchmarks"}})
    progress: list[Progress] = []
    result = train_in_process(job, FileStore(store_root), tmp_path / "work", progress)
    assert result.metrics.benchmark_scores == []
    assert (store_root / "runs" / "broken" / "adapter" / "adapter_model.safetensors").is_file()
    assert any("benchmarks failed, the adapter is stored without their scores" in (p.message or "") for p in progress)


def test_several_adapters_are_each_scored_against_the_base_scored_once(benchmarked_run, scores, task_dir,
                                                                      tiny_model_dir):
    adapter = benchmarked_run.run_dir / "adapter"
    said: list[str] = []
    settings = BenchmarkSettings(tasks=["private_greetings"], batch_size=4)
    first, second = run_benchmarks(settings, tiny_model_dir, [adapter, adapter], task_dir, device="cpu",
                                   report=said.append)
    ran = next(s for s in scores if s.task == "greeting_perplexity")
    assert [(s.task, s.base, s.adapter) for s in first] == [(s.task, s.base, s.adapter) for s in second] == \
        [("greeting_perplexity", pytest.approx(ran.base), pytest.approx(ran.adapter))]
    assert [m for m in said if m.startswith("benchmarks: ")] == [
        "benchmarks: private_greetings for the base model (transformers)",
        "benchmarks: private_greetings for adapter 1 of 2 (transformers)",
        "benchmarks: private_greetings for adapter 2 of 2 (transformers)"]


def test_no_benchmark_model_is_begun_once_the_deadline_has_passed(task_dir, tmp_path):
    settings = BenchmarkSettings(tasks=["private_greetings"])
    assert run_benchmarks(settings, tmp_path / "no-model", [tmp_path / "a", tmp_path / "b"], task_dir, device="cpu",
                          deadline_epoch_s=1.0) == [None, None]


def test_an_unknown_task_is_refused_naming_it_before_a_model_loads(task_dir, tmp_path):
    settings = BenchmarkSettings(tasks=["colours", "no_such_benchmark"])
    with pytest.raises(BenchmarkError, match=r"evaluation\.benchmarks\.tasks: .*no task no_such_benchmark"):
        run_benchmarks(settings, tmp_path / "no-model", [tmp_path / "no-adapter"], task_dir, device="cpu")


def test_a_metric_under_several_filters_keeps_the_harness_s_name_and_stderr_n_a_is_none():
    def result(strict: float, flexible: float) -> dict:
        return {"results": {"gsm8k": {"alias": "gsm8k", "exact_match,strict-match": strict,
                                      "exact_match_stderr,strict-match": 0.1, "exact_match,flexible-extract": flexible,
                                      "exact_match_stderr,flexible-extract": "N/A"}},
                "higher_is_better": {"gsm8k": {"exact_match": True}},
                "n-samples": {"gsm8k": {"original": 1319, "effective": 20}}}

    rows = benchmark_scores(result(0.1, 0.2), result(0.3, 0.2))
    assert [(r.metric, r.n, r.delta, r.base_stderr) for r in rows] == [
        ("exact_match,strict-match", 20, pytest.approx(0.2), 0.1),
        ("exact_match,flexible-extract", 20, pytest.approx(0.0), None)]


def test_the_shipped_task_list_is_the_installed_harness_s():
    assert HARNESS_TASKS_FILE.read_text() == render(installed_harness_tasks()), (
        "contract/benchmark_tasks.txt differs from the installed lm-eval's tasks: run "
        "python -m loraflow_worker.evaluation.task_list")


def test_every_harness_task_name_is_a_valid_benchmark_task():
    names = sorted(harness_task_names())
    for start in range(0, len(names), 50):
        BenchmarkSettings(tasks=names[start:start + 50])


def test_task_folder_names_come_from_tasks_groups_and_tags_in_either_list_form(tmp_path):
    (tmp_path / "suite").mkdir()
    (tmp_path / "suite" / "group.yaml").write_text("group: my_suite  # both\ntask:\n  - colours\n  - arc_easy\n")
    (tmp_path / "tagged.yml").write_text("task: tagged_task\ntag:\n  - tag_one\n  - 'tag_two'\ndataset_path: json\n")
    assert task_dir_names(tmp_path) == {"my_suite", "tagged_task", "tag_one", "tag_two"}


def test_the_control_plane_check_knows_harness_tasks_and_the_task_folder_s(task_dir):
    assert {"hellaswag", "gsm8k", "mmlu"} <= harness_task_names()
    private = task_dir_names(task_dir)
    assert private == {"colours", "greeting_perplexity", "private_greetings"}
    assert unknown_benchmark_tasks(["hellaswag", "colours", "hellaswagg"], private) == ["hellaswagg"]
    assert unknown_benchmark_tasks(["colours"]) == ["colours"]


def test_an_adapter_vllm_refuses_is_benchmarked_with_transformers_saying_why(tmp_path):
    from loraflow_worker.evaluation.benchmarks import vllm_refused_adapter

    def adapter(name: str, **config) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "adapter_config.json").write_text(json.dumps(
            {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]} | config))
        return folder

    plain, dora = adapter("plain"), adapter("dora", use_dora=True)
    assert vllm_refused_adapter([plain]) is None
    assert vllm_refused_adapter([plain, dora]) == "adapter 2 uses DoRA (`use_dora`)"
    assert vllm_refused_adapter([dora]) == "the adapter uses DoRA (`use_dora`)"
