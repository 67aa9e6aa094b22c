"""A study judged by what the task needs: `study.metric = "task:<task>/<grader>"` or `"benchmark:<task>/<metric>"`,
higher the better, checked against the children's `[evaluation]`, each child ranked by its adapter's score, and every
child's scores in the study's table."""

from __future__ import annotations

import tomllib

import pytest
from loraflow_worker.contract import BenchmarkScore, TrainMetrics, task_score
from pydantic import ValidationError

from flows.forms.run import SpecError
from flows.forms.study import StudySettings, StudySpec, expand, judging_change
from tasks.reports.study import ChildRow, StudyReport, best_child, completed_row, study_markdown, table_rows

BASE = """
name = "sweep"
artifact_store = "file:///tmp/store"
[model]
id = "Qwen/Qwen3-0.6B"
[dataset]
hub_id = "trl-lib/Capybara"
[[evaluation.tasks]]
name = "capital"
local_file = "capital.jsonl"
graders = ["contains", "f1"]
[evaluation.benchmarks]
tasks = ["hellaswag"]
"""


def study(section: str, base: str = BASE) -> StudySpec:
    return StudySpec.model_validate(tomllib.loads(base + "[study]\n" + section))


def metrics(contains: float, f1: float = 0.5) -> TrainMetrics:
    return TrainMetrics(steps=2, losses=[(2, 1.0)], first_loss=1.0, final_loss=1.0, tokens=1, wall_seconds=1.0,
                        device="cpu", task_scores=[task_score("capital", "contains", [0.0], [contains]),
                                                   task_score("capital", "f1", [0.0], [f1])],
                        benchmark_scores=[BenchmarkScore(task="hellaswag", metric="acc", base=0.3, base_stderr=None,
                                                         adapter=0.31, adapter_stderr=None, delta=0.01)])


def row(index: int) -> ChildRow:
    return ChildRow(index=index, name=f"c{index}", values=f"training.seed={index}", state="completed")


def test_a_task_score_is_a_study_metric_higher_the_better_without_held_out_rows():
    settings = study('seeds = [1, 2]\nmetric = "task:capital/contains"').study
    assert settings.maximize()


def test_a_benchmark_score_is_a_study_metric_higher_the_better():
    assert study('seeds = [1, 2]\nmetric = "benchmark:hellaswag/acc"').study.maximize()


def test_a_task_the_run_does_not_evaluate_is_refused_naming_the_tasks_it_does():
    with pytest.raises(ValidationError, match="names task 'capitals', which no .* is named \\(capital\\)"):
        study('seeds = [1, 2]\nmetric = "task:capitals/contains"')


def test_a_grader_the_task_does_not_have_is_refused_naming_its_graders():
    with pytest.raises(ValidationError, match="task 'capital' has no grader 'exact_match' \\(its graders: contains, f1\\)"):
        study('seeds = [1, 2]\nmetric = "task:capital/exact_match"')


def test_a_benchmark_the_run_does_not_ask_for_is_refused():
    with pytest.raises(ValidationError, match="benchmark task 'gsm8k'.* \\(hellaswag\\)"):
        study('seeds = [1, 2]\nmetric = "benchmark:gsm8k/exact_match"')


def test_a_metric_of_no_known_form_is_refused_naming_the_forms():
    with pytest.raises(ValidationError, match="`task:<task>/<grader>` or `benchmark:<task>/<metric>`"):
        study('seeds = [1, 2]\nmetric = "accuracy"')


def test_a_task_score_minimized_is_refused():
    with pytest.raises(ValidationError, match="higher the better: remove `study.direction`"):
        study('seeds = [1, 2]\nmetric = "task:capital/f1"\ndirection = "minimize"')


def test_pruning_by_a_score_measured_after_training_is_refused():
    with pytest.raises(ValidationError, match="study.prune compares children's held-out evaluations"):
        study('seeds = [1, 2]\nmetric = "task:capital/f1"\nprune = { rule = "median", after_evals = 2 }')


def test_a_grid_child_whose_tasks_lose_the_studys_task_is_refused_naming_the_child():
    spec = study('grid = { "evaluation.tasks" = [[{ name = "capital", local_file = "c.jsonl", graders = ["f1"] }], '
                 '[{ name = "other", local_file = "o.jsonl", graders = ["f1"] }]] }\nmetric = "task:capital/f1"')
    with pytest.raises(SpecError, match="(?s)1 of 2 child run\\(s\\) would be invalid.*child 2 .*names task 'capital'"):
        expand(spec)


def test_the_best_child_has_the_highest_task_score_and_the_table_shows_every_childs_scores():
    rows = [completed_row(row(1), metrics(0.4), "task:capital/contains"),
            completed_row(row(2), metrics(0.9, f1=0.2), "task:capital/contains"),
            completed_row(row(3), metrics(0.6), "task:capital/contains")]
    best = best_child(rows, maximize=True)
    assert (best.index, best.metric) == (2, 0.9)
    table = table_rows(rows, "task:capital/contains", best)
    assert {k: table[1][k] for k in ("child", "task:capital/contains", "task:capital/f1", "benchmark:hellaswag/acc")} \
        == {"child": "c2 (best)", "task:capital/contains": 0.9, "task:capital/f1": 0.2,
            "benchmark:hellaswag/acc": 0.31}
    text = study_markdown(StudyReport(study="sweep", metric="task:capital/contains", maximize=True, rows=rows,
                                      best=best, cost_usd=0.0, cost_ceiling_usd=1.0), None)
    assert "| child | values | state | task:capital/contains | task:capital/f1 | benchmark:hellaswag/acc | cost" \
        in text
    assert "| c2 **(best)** | training.seed=2 | completed | 0.9 | 0.2 | 0.31 |" in text


def test_a_resumed_study_judged_by_a_task_score_reads_its_default_direction_as_maximize():
    now = StudySettings(seeds=[1, 2], metric="task:capital/contains")
    assert judging_change({"metric": "task:capital/contains"}, now) is None
