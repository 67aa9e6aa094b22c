"""The evaluate file (`EvaluateSpec`) and what the `evaluate` flow decides from it without renting: its refusals, each
naming the field; its tasks' files checked and stored as a run's are, under `evaluate.`; the leaderboard's order."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from loraflow_worker.contract.evaluate import AdapterScores, EvaluateResult
from loraflow_worker.contract.task_evaluation import BenchmarkScore, task_score

from flows.forms.evaluate import EvaluateSpec, load_evaluate_file
from flows.forms.run import SpecError
from flows.train_check import check_task_inputs, job_tasks
from tasks.reports.leaderboard import leaderboard
from tasks.storage.artifacts import publish_run_inputs
from tasks.storage.evaluation_inputs import grader_store_path, task_dir_store_path, task_store_path
from tasks.storage.run_files import read_run_files

GRADER = "def grade(prompts, completions, answer, **kwargs):\n    return [1.0 for _ in completions]\n"


def spec(**evaluate) -> EvaluateSpec:
    return EvaluateSpec.model_validate({"name": "bots", "artifact_store": "file:///tmp/store", "evaluate": {
        "base_model": "org/model", "adapters": ["runs/a1", "org/other"],
        "tasks": [{"name": "phrase", "local_file": "phrase.jsonl", "graders": ["contains"]}]} | evaluate})


def refusal(**evaluate) -> str:
    with pytest.raises(ValueError) as refused:
        spec(**evaluate)
    return str(refused.value)


def test_an_evaluate_file_loads_its_adapters_as_a_serve_file_names_them(tmp_path):
    path = tmp_path / "eval.toml"
    path.write_text('name = "bots"\nartifact_store = "file:///tmp/store"\nbudget_usd = 3\n[evaluate]\n'
                    'base_model = "org/model"\nadapters = ["runs/a1", { name = "second", source = "org/other" }]\n'
                    'gpu = ["RTX 4090"]\n[[evaluate.tasks]]\nname = "phrase"\nlocal_file = "p.jsonl"\n'
                    'graders = ["contains", "graders.py:grade"]\n[evaluate.benchmarks]\ntasks = ["hellaswag"]\n')
    loaded = load_evaluate_file(path)
    assert loaded.evaluate.labels() == ["a1", "second"]
    assert [g.label for g in loaded.evaluate.tasks[0].grader_settings()] == ["contains", "grade"]
    assert loaded.evaluate.benchmarks.tasks == ["hellaswag"]


def test_an_unknown_field_is_refused_naming_it(tmp_path):
    path = tmp_path / "eval.toml"
    path.write_text('name = "bots"\nartifact_store = "file:///tmp/store"\n[evaluate]\nbase_model = "org/model"\n'
                    'adapters = ["runs/a1"]\nbenchmark = ["hellaswag"]\n')
    with pytest.raises(SpecError, match=r"evaluate\.benchmark: unknown field"):
        load_evaluate_file(path)


def test_an_evaluation_asking_nothing_is_refused():
    assert "set `[[evaluate.tasks]]` or `[evaluate.benchmarks]`" in refusal(tasks=[])


def test_two_adapters_of_one_name_are_refused():
    assert "the names ['x'] are taken twice" in refusal(adapters=[{"source": "runs/x"}, {"source": "org/x"}])


def test_an_adapter_named_base_is_refused_as_the_base_is_that_row():
    assert "the names ['base'] are taken twice" in refusal(adapters=[{"source": "runs/a1", "name": "base"}])


def test_an_adapter_named_as_the_base_model_is_refused_as_an_endpoint_could_not_tell_them_apart():
    assert "the names ['gpt2'] are taken twice" in refusal(base_model="gpt2", adapters=[{"source": "org/gpt2"}])


def test_an_unknown_gpu_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="evaluate.gpu"):
        spec(gpu=["Voodoo 2"])


def test_an_unknown_grader_is_refused_as_in_a_run():
    assert "unknown grader 'close_enough'" in refusal(
        tasks=[{"name": "phrase", "local_file": "p.jsonl", "graders": ["close_enough"]}])


@pytest.mark.parametrize(("grader", "why"), [
    ("graders.py:grade", "runs your code"),
    ({"kind": "judge", "judge_model": "m", "judge_base_url": "https://api.example.com/v1", "rubric": "r"},
     "asks another model")])
def test_a_grader_that_is_not_built_in_is_refused_with_an_openai_base_url_naming_it(grader, why):
    message = refusal(openai_base_url="https://api.example.com/v1", tasks=[
        {"name": "phrase", "local_file": "p.jsonl", "graders": ["contains", grader]}])
    assert "evaluate.tasks[0].graders[1]" in message and why in message and "openai_base_url" in message


def test_benchmarks_are_refused_with_an_openai_base_url_naming_them():
    message = refusal(openai_base_url="https://api.example.com/v1", benchmarks={"tasks": ["hellaswag"]})
    assert "evaluate.benchmarks: lm-evaluation-harness runs on a rented worker only" in message


def test_an_api_key_without_its_base_url_is_refused():
    assert "openai_api_key_secret is the key of openai_base_url" in refusal(openai_api_key_secret="my-key")


def test_an_api_key_block_of_the_servers_own_is_refused_before_it_is_read_naming_the_field():
    from tasks.jobs.endpoint_evaluation import EndpointRefused, read_api_key
    from tasks.settings import Settings

    with pytest.raises(EndpointRefused, match=r"^evaluate\.openai_api_key_secret: the Prefect Secret block "
                       r"'runpod-api-key' is this server's own"):
        read_api_key("runpod-api-key", Settings())


def test_the_task_files_are_named_under_evaluate_and_stored_where_a_runs_are(tmp_path):
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "Say it", "answer": "blue"}) + "\n")
    (tmp_path / "graders.py").write_text(GRADER)
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "mine.yaml").write_text("task: mine\ndataset_path: json\n")
    evaluation = spec(tasks=[{"name": "phrase", "local_file": str(tmp_path / "p.jsonl"),
                              "graders": ["contains", f"{tmp_path}/graders.py:grade"]}],
                      benchmarks={"tasks": ["mine"], "task_dir": str(tmp_path / "tasks")})
    files = read_run_files(evaluation.evaluate.task_paths(), Path(tempfile.mkdtemp()), base_dir=tmp_path)
    assert sorted(files) == ["evaluate.benchmarks.task_dir/mine.yaml", "evaluate.tasks[0].graders[1]",
                             "evaluate.tasks[0].local_file"]
    inputs = check_task_inputs("evaluate", evaluation.evaluate.tasks, evaluation.evaluate.benchmarks, files, {})
    assert inputs.rows == {"phrase": 1}
    _, _, stored = publish_run_inputs(f"file://{tmp_path}/store", "ev1", files, [])
    tasks, benchmarks = job_tasks(evaluation.evaluate.tasks, evaluation.evaluate.benchmarks, "ev1")
    assert tasks[0].store_path == task_store_path("ev1", 0)
    assert tasks[0].graders[1].store_path == grader_store_path("ev1", 0, 1)
    assert benchmarks.task_dir_store_path == task_dir_store_path("ev1")
    assert set(stored.sha256) == {task_store_path("ev1", 0), grader_store_path("ev1", 0, 1),
                                  f"{task_dir_store_path('ev1')}/mine.yaml"}


def test_a_row_without_the_answer_a_grader_needs_is_refused_naming_the_evaluate_field(tmp_path):
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "Say it"}) + "\n")
    evaluation = spec(tasks=[{"name": "phrase", "local_file": str(tmp_path / "p.jsonl"), "graders": ["contains"]}])
    files = read_run_files(evaluation.evaluate.task_paths(), Path(tempfile.mkdtemp()), base_dir=tmp_path)
    with pytest.raises(ValueError, match=r"evaluate\.tasks\[0\]\.local_file line 1"):
        check_task_inputs("evaluate", evaluation.evaluate.tasks, None, files, {})


def test_a_benchmark_task_the_harness_does_not_know_is_refused_naming_the_evaluate_field():
    evaluation = spec(tasks=[], benchmarks={"tasks": ["hellaswagg"]})
    with pytest.raises(ValueError, match=r"^evaluate\.benchmarks\.tasks: 'hellaswagg': no such task.*define the task "
                       r"in `evaluate\.benchmarks\.task_dir`"):
        check_task_inputs("evaluate", [], evaluation.evaluate.benchmarks, {}, {})


def test_an_evaluation_whose_ceiling_passes_its_budget_or_the_operators_cap_is_refused_naming_the_fields():
    from tasks.jobs.evaluate import check_evaluate_cost

    assert check_evaluate_cost("RTX 4090", 0.6, 30, budget_usd=0.5, cap_usd=None) == pytest.approx(0.3)
    with pytest.raises(ValueError, match=r"may cost up to \$0\.60, above budget_usd \$0\.50: lower "
                       r"evaluate\.deadline_minutes"):
        check_evaluate_cost("RTX 4090", 0.6, 60, budget_usd=0.5, cap_usd=None)
    with pytest.raises(ValueError, match=r"above this server's cap of \$0\.50 per run \(LORAFLOW_MAX_RUN_USD"):
        check_evaluate_cost("RTX 4090", 0.6, 60, budget_usd=None, cap_usd=0.5)


def result(*adapters: tuple[str, list[float]], base: list[float]) -> EvaluateResult:
    return EvaluateResult(run_id="ev1", adapters=[
        AdapterScores(label=label, task_scores=[task_score("phrase", "contains", base, scores),
                                                task_score("phrase", "f1", base, [1 - s for s in scores])])
        for label, scores in adapters])


def test_the_leaderboard_ranks_by_the_first_task_and_grader_best_first_with_the_base_as_a_row():
    board = leaderboard("bots", result(("low", [0, 0, 1, 0]), ("high", [1, 1, 1, 0]), base=[0, 0, 0, 0]),
                        [("phrase", "contains"), ("phrase", "f1")])
    assert board.metric == "task:phrase/contains"
    assert [row.label for row in board.rows] == ["high", "low", "base"]
    assert board.lines()[1].startswith("  1. high: task:phrase/contains 0.750 ± 0.250; task:phrase/f1 0.250")


def test_the_leaderboard_ranks_by_the_grader_the_file_lists_first():
    board = leaderboard("bots", result(("low", [0, 0, 1, 0]), ("high", [1, 1, 1, 0]), base=[0, 0, 0, 0]),
                        [("phrase", "f1"), ("phrase", "contains")])
    assert board.metric == "task:phrase/f1"
    assert [row.label for row in board.rows] == ["low", "high", "base"]


def test_with_no_task_the_leaderboard_ranks_by_the_first_benchmark_in_its_direction():
    def bench(label: str, adapter: float) -> AdapterScores:
        return AdapterScores(label=label, benchmark_scores=[BenchmarkScore(
            task="ppl", metric="perplexity", base=10.0, base_stderr=None, adapter=adapter, adapter_stderr=None,
            delta=adapter - 10.0, higher_is_better=False)])

    board = leaderboard("bots", EvaluateResult(run_id="ev1", adapters=[bench("worse", 12.0), bench("better", 8.0)]))
    assert board.metric == "benchmark:ppl/perplexity" and not board.higher_is_better
    assert [row.label for row in board.rows] == ["better", "base", "worse"]


def test_an_adapter_with_no_ranking_score_is_last_and_the_table_says_why():
    scored = result(("scored", [1, 0]), base=[0, 0])
    scored.adapters.append(AdapterScores(label="unscored"))
    scored.stopped = "the deadline came before unscored's answers"
    board = leaderboard("bots", scored)
    assert [row.label for row in board.rows] == ["scored", "base", "unscored"]
    assert "| 3 | unscored | – | – |" in board.markdown() and "Incomplete: the deadline" in board.markdown()
