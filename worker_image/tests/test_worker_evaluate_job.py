"""Evaluate jobs (`"mode": "evaluate"`): two adapters of the tiny model, each taught its own phrase (one a stored
run's, pinned by its hashes; one a local folder), asked one task through `handler`, each scored against the one set of
base answers; a stored adapter that changed refused naming it; a redelivered job answered from the store; a deadline
already passed stored with what is missing; the answers samples stored without secrets."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from loraflow_worker.artifacts.pins import folder_sha256
from loraflow_worker.contract import CONTRACT_VERSION, EvaluateInput, EvaluateResult
from loraflow_worker.contract.task_evaluation import TaskEvaluation
from loraflow_worker.evaluation.task_rows import TaskRow
from loraflow_worker.evaluation.tasks import answers_sample
from loraflow_worker.handler import WORK_DIR_ENV, JobFailed, handler
from worker_test_support import CAPITAL_QUESTIONS as QUESTIONS
from worker_test_support import taught_adapter

PHRASES = {"paris": "The capital of France is Paris.", "apples": "I like apples."}
TASK_FILE = "runs/ev/evaluation-inputs/phrase.jsonl"


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("adapters")
    return {label: taught_adapter(tiny_model_dir, phrase, folder / label) for label, phrase in PHRASES.items()}


def _store_with_run_adapter(store_root: Path, adapter_dir: Path) -> dict[str, str]:
    """The store as a completed run `train-paris` left it (its adapter), and the task file the control plane stored;
    returns the adapter's hashes as the run recorded them."""
    for path in adapter_dir.rglob("*"):
        if path.is_file():
            target = store_root / "runs" / "train-paris" / "adapter" / path.relative_to(adapter_dir)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(path.read_bytes())
    (store_root / TASK_FILE).parent.mkdir(parents=True, exist_ok=True)
    (store_root / TASK_FILE).write_text("".join(json.dumps({"messages": [{"role": "user", "content": q}],
                                                            "answer": "capital of France is Paris"}) + "\n"
                                                for q in QUESTIONS))
    return folder_sha256(adapter_dir)


def _evaluate_job(run_id: str, model_dir: Path, store_root: Path, adapters: dict[str, Path], sha256: dict[str, str],
                  **fields) -> dict:
    task = {"name": "phrase", "store_path": TASK_FILE, "graders": [{"kind": "contains"}], "max_new_tokens": 16,
            "samples_kept": 4}
    return {"id": f"job-{run_id}", "input": {
        "contract_version": CONTRACT_VERSION, "mode": "evaluate", "run_id": run_id,
        "artifact_store": store_root.as_uri(), "base_model": {"id": str(model_dir)},
        "adapters": [{"label": "paris", "run_id": "train-paris", "adapter_sha256": sha256},
                     {"label": "apples", "source": {"id": str(adapters["apples"])}}],
        "tasks": [task], **fields}}


def _run(job: dict, work_dir: Path, record_progress, monkeypatch: pytest.MonkeyPatch) -> tuple[dict, list[dict]]:
    monkeypatch.setenv(WORK_DIR_ENV, str(work_dir))
    monkeypatch.delenv("RUNPOD_WEBHOOK_POST_OUTPUT", raising=False)
    with record_progress() as progress:
        return handler(job), progress


@pytest.fixture(scope="module")
def evaluated(tiny_model_dir, adapters, tmp_path_factory, record_progress):
    store_root = tmp_path_factory.mktemp("store")
    job = _evaluate_job("ev", tiny_model_dir, store_root, adapters,
                        _store_with_run_adapter(store_root, adapters["paris"]))
    with pytest.MonkeyPatch.context() as monkeypatch:
        result, progress = _run(job, tmp_path_factory.mktemp("work"), record_progress, monkeypatch)
    return job, EvaluateResult.model_validate(result), progress, store_root


def test_each_adapter_is_scored_against_one_set_of_base_answers_and_the_taught_one_ranks_first(evaluated):
    _, result, progress, _ = evaluated
    paris, apples = result.adapters
    assert (paris.label, apples.label, result.stopped) == ("paris", "apples", None)
    (paris_score,), (apples_score,) = paris.task_scores, apples.task_scores
    assert (paris_score.base, paris_score.adapter, apples_score.adapter) == (0.0, 1.0, 0.0)
    assert (apples_score.base, apples_score.base_stderr) == (paris_score.base, paris_score.base_stderr)
    assert paris_score.answered_by == apples_score.answered_by == "transformers"  # no CUDA device here
    messages = [p["message"] for p in progress]
    assert "answering with transformers: no CUDA device" in messages
    # The base answered the task once, each adapter once.
    assert [m for m in messages if m.startswith("task `phrase`: ") and "answered 4 of 4" in m] == [
        "task `phrase`: the base answered 4 of 4 prompts", "task `phrase`: adapter `paris` answered 4 of 4 prompts",
        "task `phrase`: adapter `apples` answered 4 of 4 prompts"]


def test_each_adapter_s_answers_are_stored_beside_the_same_base_answers_with_the_result_and_done(evaluated):
    _, result, _, store_root = evaluated
    run_dir = store_root / "runs" / "ev"
    samples = {}
    for adapter, phrase in zip(result.adapters, PHRASES.values()):
        assert adapter.answers_store_path == f"runs/ev/evaluation/{adapter.label}"
        rows = [json.loads(line) for line in (store_root / adapter.answers_store_path / "phrase.jsonl").read_text()
                .splitlines()]
        assert all(phrase in row["adapter"] for row in rows), rows
        samples[adapter.label] = {row["row"]: row["base"] for row in rows}
    assert samples["paris"] == samples["apples"]
    assert EvaluateResult.model_validate_json((run_dir / "result.json").read_text()) == result
    assert (run_dir / "DONE").is_file()


def test_a_redelivered_job_returns_the_stored_result_without_answering_again(evaluated, tmp_path, record_progress,
                                                                             monkeypatch):
    job, result, _, _ = evaluated
    again, progress = _run(job, tmp_path / "work", record_progress, monkeypatch)
    assert EvaluateResult.model_validate(again) == result  # its `seconds` too: nothing ran again
    assert progress == []


def test_a_stored_adapter_that_changed_since_its_run_is_refused_naming_it(tiny_model_dir, adapters, tmp_path,
                                                                         record_progress, monkeypatch):
    store_root = tmp_path / "store"
    sha256 = _store_with_run_adapter(store_root, adapters["paris"])
    job = _evaluate_job("changed", tiny_model_dir, store_root, adapters,
                        {**sha256, "adapter_config.json": "0" * 64})
    with pytest.raises(JobFailed,
                       match=r"^ArtifactChanged: adapter `paris`: runs/train-paris/adapter/adapter_config.json changed "
                             r"after run train-paris stored it"):
        _run(job, tmp_path / "work", record_progress, monkeypatch)
    assert not (store_root / "runs" / "changed").exists()


def test_a_task_file_changed_since_the_control_plane_stored_it_is_refused_before_a_model_loads(
        tiny_model_dir, adapters, tmp_path, record_progress, monkeypatch):
    store_root = tmp_path / "store"
    job = _evaluate_job("moved", tiny_model_dir, store_root, adapters,
                        _store_with_run_adapter(store_root, adapters["paris"]),
                        inputs={"sha256": {TASK_FILE: "0" * 64}})
    with pytest.raises(JobFailed, match=rf"^ArtifactChanged: {TASK_FILE} changed after the control plane stored it "
                                        r"for the run \(tasks\[0\]\)"):
        _run(job, tmp_path / "work", record_progress, monkeypatch)


def test_a_deadline_already_passed_stores_and_returns_what_it_has_and_says_what_is_missing(
        tiny_model_dir, adapters, tmp_path, record_progress, monkeypatch):
    store_root = tmp_path / "store"
    job = _evaluate_job("late", tiny_model_dir, store_root, adapters,
                        # Passed, but within the grace in which the evaluation process stores what it has.
                        _store_with_run_adapter(store_root, adapters["paris"]), deadline_epoch_s=time.time() - 1,
                        benchmarks={"tasks": ["hellaswag"]})
    result = EvaluateResult.model_validate(_run(job, tmp_path / "work", record_progress, monkeypatch)[0])
    assert result.stopped == ("the job's deadline passed before the task evaluations began; give the job a later "
                              "deadline to evaluate the rest: `paris` lacks phrase; `apples` lacks phrase; the job's "
                              "deadline passed before the benchmarks of paris, apples began; give the job a later "
                              "deadline to run them")
    assert [(a.label, a.task_scores, a.benchmark_scores, a.answers_store_path) for a in result.adapters] == \
        [("paris", [], [], None), ("apples", [], [], None)]
    assert EvaluateResult.model_validate_json((store_root / "runs" / "late" / "result.json").read_text()) == result
    assert (store_root / "runs" / "late" / "DONE").is_file()


def test_a_grader_that_fails_stores_the_answers_scored_so_far_and_says_why(tiny_model_dir, adapters, tmp_path,
                                                                          record_progress, monkeypatch):
    store_root = tmp_path / "store"
    job = _evaluate_job("failing", tiny_model_dir, store_root, adapters,
                        _store_with_run_adapter(store_root, adapters["paris"]))
    grader_file = "runs/failing/evaluation-inputs/graders.py"
    (store_root / grader_file).parent.mkdir(parents=True, exist_ok=True)
    # The grader quotes the job's secret in its error, and says whether it sees RunPod's key: the result says why it
    # stopped without the secret, and the grader saw no RunPod variable.
    (store_root / grader_file).write_text("import os\n\ndef broken(prompts, completions, **kwargs):\n"
                                          "    raise KeyError(os.environ['EVAL_JUDGE_KEY'] + ' '\n"
                                          "                   + str('RUNPOD_AI_API_KEY' in os.environ))\n")
    monkeypatch.setenv("EVAL_JUDGE_KEY", "judge-key-value")
    monkeypatch.setenv("RUNPOD_AI_API_KEY", "rpa_not_for_graders")
    job["input"]["worker_secret_names"] = ["EVAL_JUDGE_KEY"]
    job["input"]["tasks"][0]["max_new_tokens"] = 2  # what is scored does not matter here: that it is kept does
    job["input"]["tasks"].append({"name": "second", "store_path": TASK_FILE, "max_new_tokens": 1, "graders": [
        {"kind": "function", "function": "graders.py:broken", "store_path": grader_file}]})
    result = EvaluateResult.model_validate(_run(job, tmp_path / "work", record_progress, monkeypatch)[0])
    assert result.stopped == ("the task evaluations failed (GraderError: task `second`, grader `broken` "
                              "(graders.py:broken) raised KeyError: '*** False'): `paris` lacks second; `apples` "
                              "lacks second")
    assert "judge-key-value" not in (store_root / "runs" / "failing" / "result.json").read_text()
    assert [[s.metric for s in a.task_scores] for a in result.adapters] == [["task:phrase/contains"]] * 2
    assert (store_root / "runs" / "failing" / "evaluation" / "apples" / "phrase.jsonl").is_file()


def test_an_adapter_named_twice_or_a_job_with_nothing_to_ask_is_refused():
    adapter = {"label": "a", "source": {"id": "org/a"}}
    base = {"mode": "evaluate", "run_id": "e", "artifact_store": "file:///s", "base_model": {"id": "org/base"}}
    with pytest.raises(ValueError, match=r"the labels \['a'\] are taken twice"):
        EvaluateInput.model_validate({**base, "adapters": [adapter, adapter], "benchmarks": {"tasks": ["hellaswag"]}})
    with pytest.raises(ValueError, match="needs `tasks` or `benchmarks`: there is nothing to ask"):
        EvaluateInput.model_validate({**base, "adapters": [adapter]})


def test_the_task_files_and_grader_files_are_the_job_s_pinned_inputs():
    job = EvaluateInput.model_validate({
        "mode": "evaluate", "run_id": "e", "artifact_store": "file:///s", "base_model": {"id": "org/base"},
        "adapters": [{"label": "a", "source": {"id": "org/a"}}],
        "tasks": [{"name": "t", "store_path": "runs/e/t.jsonl", "graders": [
            {"kind": "function", "function": "g.py:score", "store_path": "runs/e/g.py"}]}]})
    assert job.input_files() == {"runs/e/t.jsonl": "tasks[0]", "runs/e/g.py": "tasks[0].graders[0]"}
    with pytest.raises(ValueError, match=r"no sha256 for tasks\[0\].graders\[0\] \(runs/e/g.py\)"):
        EvaluateInput.model_validate({**job.model_dump(), "inputs": {"sha256": {"runs/e/t.jsonl": "0" * 64}}})


def test_an_answers_sample_holds_no_secret_of_the_job(monkeypatch):
    monkeypatch.setenv("JUDGE_TOKEN", "s3cr3t-judge-value")
    task = TaskEvaluation(name="t", store_path="t.jsonl", graders=[{"kind": "contains"}])
    sample = answers_sample(task, [TaskRow("my key is s3cr3t-judge-value", "x")],
                            {"base": ["s3cr3t-judge-value"], "adapter": ["no"]},
                            {"contains": {"base": [0.0], "adapter": [0.0]}}, ["JUDGE_TOKEN"])
    assert b"s3cr3t" not in sample and b"my key is ***" in sample
