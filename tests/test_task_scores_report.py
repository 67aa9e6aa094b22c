"""Where people look for task and benchmark scores: the run's summary table (task / grader or benchmark / base /
adapter / Δ ± stderr) with each task's best and worst answers, the scores table, the kept answers read back from the
store, the `loraflow.run.evaluated` payloads and the `loraflow.run.finished` metrics."""

from __future__ import annotations

import json

from loraflow_worker.contract import BenchmarkScore, TrainMetrics, task_score

from tasks.reports.events import final_metrics, score_payloads
from tasks.reports.summary import RunReport, score_rows, summary_markdown
from tasks.storage.artifacts import read_run_results

CAPITAL = task_score("capital", "contains", base=[0.0, 0.0, 1.0, 0.0], adapter=[1.0, 1.0, 1.0, 0.0])
HELLASWAG = BenchmarkScore(task="hellaswag", metric="acc", n=100, base=0.40, base_stderr=0.03, adapter=0.44,
                           adapter_stderr=0.04, delta=0.04)
METRICS = TrainMetrics(steps=4, losses=[(1, 2.0), (4, 1.0)], first_loss=2.0, final_loss=1.0, tokens=10,
                       wall_seconds=1.0, device="cpu", task_scores=[CAPITAL], benchmark_scores=[HELLASWAG])
ANSWERS = [
    {"row": 1, "prompt": [{"role": "user", "content": "Capital of France?"}], "answer": "Paris", "base": "Lyon",
     "adapter": "Paris", "scores": {"contains": {"base": 0.0, "adapter": 1.0}}},
    {"row": 4, "prompt": "Capital of Peru?", "answer": "Lima", "base": "I | do not know", "adapter": "Cusco",
     "scores": {"contains": {"base": 0.0, "adapter": 0.0}}},
]


def report(**fields) -> RunReport:
    return RunReport(**{"metrics": METRICS, **fields}, run_name="demo", run_id="r1", model="tiny",
                     model_revision=None, gpu="RTX 4090", gpu_count=1, endpoint_name="e", cost_ceiling_usd=0.3, estimated_cost_usd=0.01,
                     adapter_url="file:///s/runs/r1/adapter", store_url="file:///s")


def test_the_summary_shows_each_task_and_benchmark_base_against_adapter_with_the_differences_stderr():
    text = summary_markdown(report())
    assert "| task | grader or benchmark | base | adapter | Δ ± stderr |" in text
    assert "| capital | contains | 0.250 | 0.750 | +0.500 ± 0.289 |" in text
    assert "| hellaswag | benchmark acc | 0.400 | 0.440 | +0.040 ± 0.050 |" in text


def test_the_summary_says_what_answered_the_tasks():
    answered = METRICS.model_copy(update={"task_scores": [CAPITAL.model_copy(update={"answered_by": "vllm"})]})
    assert "\n\nAnswered with vLLM (the adapter as a LoRA request)." in summary_markdown(report(metrics=answered))
    assert "Answered with" not in summary_markdown(report())  # a worker that did not say


def test_a_perplexity_in_the_summary_is_three_significant_digits_not_a_row_of_digits():
    perplexity = BenchmarkScore(task="capitals_perplexity", metric="word_perplexity", n=8, base=1.2e27,
                                base_stderr=None, adapter=1.9e22, adapter_stderr=None, delta=1.9e22 - 1.2e27,
                                higher_is_better=False)
    text = summary_markdown(report(metrics=METRICS.model_copy(update={"benchmark_scores": [perplexity]})))
    assert "| capitals_perplexity | benchmark word_perplexity (lower is better) | 1.2e+27 | 1.9e+22 | -1.2e+27 |" in text


def test_the_summary_shows_a_tasks_best_and_worst_answers_and_links_them_all():
    text = summary_markdown(report(task_answers={"capital": ANSWERS},
                                   task_answers_urls={"capital": "file:///s/runs/r1/evaluation/capital.jsonl"}))
    assert "| best | Capital of France? | Paris | Lyon | Paris | contains 0.0 → 1.0 |" in text
    assert "| worst | Capital of Peru? | Lima | I \\| do not know | Cusco | contains 0.0 → 0.0 |" in text
    assert "[evaluation/capital.jsonl](file:///s/runs/r1/evaluation/capital.jsonl)" in text


def test_the_summary_says_why_tasks_were_not_evaluated():
    stopped = ("the job's deadline passed while task `capital` was evaluated: the adapter is complete and stored, but "
               "task(s) capital were not evaluated (in full)")
    text = summary_markdown(report(metrics=METRICS.model_copy(
        update={"task_scores": [], "benchmark_scores": [], "evaluation_stopped": stopped})))
    assert f"Not every task was evaluated: {stopped}." in text
    assert "| task | grader or benchmark |" not in text  # no empty table above the reason: nothing was scored


def test_a_run_without_tasks_or_benchmarks_has_no_scores_section():
    assert "Base against adapter" not in summary_markdown(report(metrics=METRICS.model_copy(
        update={"task_scores": [], "benchmark_scores": []})))


def test_the_scores_table_names_each_row_by_its_study_metric():
    assert [(row["metric"], row["delta"]) for row in score_rows(METRICS)] == [
        ("task:capital/contains", 0.5), ("benchmark:hellaswag/acc", 0.04)]


def test_each_score_is_a_run_evaluated_payload_named_by_its_metric():
    output = {"run_id": "r1", "attempt": 1, "run_prefix": "runs/r1", "adapter_path": "runs/r1/adapter",
              "metrics": METRICS.model_dump(mode="json")}
    task, benchmark = score_payloads(output)
    assert {k: task[k] for k in ("metric", "kind", "task", "grader", "base", "adapter", "delta", "n")} == {
        "metric": "task:capital/contains", "kind": "task", "task": "capital", "grader": "contains", "base": 0.25,
        "adapter": 0.75, "delta": 0.5, "n": 4}
    assert round(task["delta_stderr"], 4) == 0.2887
    assert (benchmark["metric"], benchmark["harness_metric"], benchmark["adapter"]) == (
        "benchmark:hellaswag/acc", "acc", 0.44)


def test_the_finished_events_metrics_carry_the_adapters_scores():
    assert final_metrics(METRICS) == {"steps": 4, "loss": 1.0, "task:capital/contains": 0.75,
                                    "benchmark:hellaswag/acc": 0.44}


def test_a_runs_kept_answers_are_read_back_from_its_store(tmp_path):
    prefix = tmp_path / "runs" / "r1"
    (prefix / "evaluation").mkdir(parents=True)
    (prefix / "evaluation" / "capital.jsonl").write_text("".join(json.dumps(a) + "\n" for a in ANSWERS) + "not json\n")
    (prefix / "result.json").write_text(json.dumps({"run_id": "r1", "attempt": 1, "run_prefix": "runs/r1",
                                                    "adapter_path": "runs/r1/adapter",
                                                    "metrics": METRICS.model_dump(mode="json")}))
    (prefix / "DONE").write_text("")
    results = read_run_results(f"file://{tmp_path}", "r1")
    assert results.task_answers == {"capital": ANSWERS}
    assert results.task_answers_urls["capital"].endswith("runs/r1/evaluation/capital.jsonl")
