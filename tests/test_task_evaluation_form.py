"""Task evaluations and benchmarks in the run form (`[[evaluation.tasks]]`, `[evaluation.benchmarks]`), seen from
the control plane: the forms a run file takes, each refusal naming its field before anything is rented, a function
grader's file read as text and never imported, and the job naming every file as the run stored and pinned it."""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

import pytest
from loraflow_worker.contract import JobInput, ModelSource

from flows.forms.run import RunSpec, load_run_file
from flows.train_check import EvaluationInputs, check_evaluation_inputs, job_evaluation
from tasks.preflight.task_files import check_task_lengths_task
from tasks.storage.artifacts import publish_run_inputs
from tasks.storage.evaluation_inputs import grader_store_path, task_dir_store_path, task_store_path
from tasks.storage.run_files import RunFile, read_run_files

BASE = {"model": {"id": "org/model"}, "artifact_store": "file:///tmp/store", "dataset": {"hub_id": "org/qa"}}
GRADER = "def grade(prompts, completions, answer, **kwargs):\n    return [1.0 for _ in completions]\n"


def jsonl(path: Path, *rows: dict) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def run(evaluation: dict, **fields) -> RunSpec:
    return RunSpec.model_validate({**BASE, "evaluation": evaluation, **fields})


def task(local_file: Path | str, graders: list, **fields) -> dict:
    return {"name": "capital", "local_file": str(local_file), "graders": graders, **fields}


def read(spec: RunSpec) -> dict[str, RunFile]:
    """The run's files, each read once as the check reads them."""
    return read_run_files(spec.local_paths(), Path(tempfile.mkdtemp(prefix="run-files-")), base_dir=Path.cwd())


def checked(spec: RunSpec) -> EvaluationInputs:
    return check_evaluation_inputs(spec, read(spec))


def refusal(evaluation: dict, **fields) -> str:
    with pytest.raises(ValueError) as refused:
        checked(run(evaluation, **fields))
    return str(refused.value)


def test_a_run_file_with_tasks_and_benchmarks_alone_loads_without_held_out_rows(tmp_path):
    run_file = tmp_path / "run.toml"
    run_file.write_text('artifact_store = "file:///tmp/store"\n[model]\nid = "org/model"\n[dataset]\nhub_id = "o/d"\n'
                        '[[evaluation.tasks]]\nname = "capital"\nlocal_file = "capital.jsonl"\n'
                        'graders = ["contains", "graders.py:grade", { kind = "numeric", tolerance = 0.01 }]\n'
                        'max_new_tokens = 32\n[evaluation.benchmarks]\ntasks = ["hellaswag"]\nlimit = 10\n')
    evaluation = load_run_file(run_file).evaluation
    assert not evaluation.held_out
    assert [(g.kind, g.label) for g in evaluation.tasks[0].grader_settings()] == [
        ("contains", "contains"), ("function", "grade"), ("numeric", "numeric")]
    assert (evaluation.tasks[0].max_new_tokens, evaluation.benchmarks.tasks, evaluation.benchmarks.limit) == (
        32, ["hellaswag"], 10)


def test_an_evaluation_with_neither_rows_nor_tasks_nor_benchmarks_is_refused():
    with pytest.raises(ValueError, match=r"`\[\[evaluation.tasks\]\]` or `\[evaluation.benchmarks\]`"):
        run({"every_steps": 10})


def test_an_unknown_grader_is_refused_listing_the_graders_there_are():
    with pytest.raises(ValueError) as refused:
        run({"tasks": [task("t.jsonl", ["exact"])]})
    assert "evaluation.tasks.0.graders" in str(refused.value)
    assert "unknown grader 'exact': use one of exact_match, contains, regex, numeric, f1" in str(refused.value)


def test_a_judge_named_without_its_settings_is_refused_with_the_table_to_write():
    with pytest.raises(ValueError, match="the `judge` grader needs its settings: write it as a table"):
        run({"tasks": [task("t.jsonl", ["judge"])]})


def test_two_tasks_of_one_name_are_refused():
    with pytest.raises(ValueError, match="two tasks are named capital"):
        run({"tasks": [task("a.jsonl", ["contains"]), task("b.jsonl", ["f1"])]})


def test_a_grader_table_setting_its_store_path_is_refused():
    with pytest.raises(ValueError, match="`store_path` is set by loraflow"):
        run({"tasks": [task("t.jsonl", [{"kind": "function", "function": "g.py:grade", "store_path": "x.py"}])]})


def test_a_row_without_the_answer_a_grader_needs_is_refused_naming_the_line(tmp_path):
    rows = jsonl(tmp_path / "t.jsonl", {"prompt": "Capital of France?", "answer": "Paris"},
                 {"prompt": "Capital of Spain?"})
    assert refusal({"tasks": [task(rows, ["contains"])]}).startswith(
        "evaluation.tasks[0].local_file line 2: no `answer`; the graders contains compare")


def test_rows_without_answers_pass_when_every_grader_is_a_judge_or_a_function(tmp_path):
    rows = jsonl(tmp_path / "t.jsonl", {"messages": [{"role": "user", "content": "Write a haiku."}]})
    (tmp_path / "graders.py").write_text(GRADER.replace("answer, ", ""))
    judge = {"kind": "judge", "judge_model": "m", "judge_base_url": "https://judge/v1", "rubric": "a haiku",
             "judge_api_key_env": "JUDGE_KEY"}
    inputs = checked(run({"tasks": [task(rows, [judge, f"{tmp_path}/graders.py:grade"])]},
                                         worker={"secrets": {"JUDGE_KEY": "judge-key"}}))
    assert inputs.rows == {"capital": 1}


def test_a_row_with_neither_messages_nor_prompt_is_refused_naming_the_line(tmp_path):
    rows = jsonl(tmp_path / "t.jsonl", {"question": "Capital of France?", "answer": "Paris"})
    assert "evaluation.tasks[0].local_file line 1: a row has `messages` (a chat) or `prompt`" in refusal(
        {"tasks": [task(rows, ["exact_match"])]})


def test_a_missing_task_file_is_refused_naming_the_field(tmp_path):
    assert refusal({"tasks": [task(tmp_path / "none.jsonl", ["contains"])]}).startswith(
        "evaluation.tasks[0].local_file")


def test_a_missing_grader_file_is_refused_naming_the_grader(tmp_path):
    rows = jsonl(tmp_path / "t.jsonl", {"prompt": "Hi", "answer": "Hello"})
    assert refusal({"tasks": [task(rows, [f"{tmp_path}/none.py:grade"])]}).startswith(
        "evaluation.tasks[0].graders[0]")


def test_a_non_numeric_answer_for_the_numeric_grader_is_refused(tmp_path):
    rows = jsonl(tmp_path / "t.jsonl", {"prompt": "2+2?", "answer": "four"})
    assert "line 1: `answer` 'four' is not a number" in refusal({"tasks": [task(rows, ["numeric"])]})


def test_a_judges_key_outside_the_worker_secrets_is_refused_naming_the_field(tmp_path):
    rows = jsonl(tmp_path / "t.jsonl", {"prompt": "Hi"})
    judge = {"kind": "judge", "judge_model": "m", "judge_base_url": "https://judge/v1", "rubric": "kind",
             "judge_api_key_env": "OPENAI_API_KEY"}
    assert "evaluation.tasks[0].graders[0].judge_api_key_env `OPENAI_API_KEY` is not one of the run's `[worker] " \
           "secrets`" in refusal({"tasks": [task(rows, [judge])]})


def test_a_grader_file_is_read_and_never_imported(tmp_path):
    rows = jsonl(tmp_path / "t.jsonl", {"prompt": "Hi", "answer": "Hello"})
    marker = tmp_path / "imported"
    (tmp_path / "graders.py").write_text(f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n"
                                         + GRADER)
    checked(run({"tasks": [task(rows, [f"{tmp_path}/graders.py:grade"])]}))
    assert not marker.exists()


def test_a_grader_file_without_its_function_is_refused_naming_the_grader(tmp_path):
    rows = jsonl(tmp_path / "t.jsonl", {"prompt": "Hi", "answer": "Hello"})
    (tmp_path / "graders.py").write_text(GRADER)
    assert "evaluation.tasks[0].graders[1]" in refusal(
        {"tasks": [task(rows, ["contains", f"{tmp_path}/graders.py:score"])]})
    assert "defines no top-level function `score` (its functions: `grade`)" in refusal(
        {"tasks": [task(rows, [f"{tmp_path}/graders.py:score"])]})


@pytest.mark.parametrize(("source", "problem"), [
    ("def grade(completions):\n    return []\n", "it takes no `answer` and no `**kwargs`"),
    ("def grade(prompts, completions, reference, **kwargs):\n    return []\n", "it needs `reference`"),
    ("async def grade(prompts, completions, **kwargs):\n    return []\n", "it is `async def`"),
])
def test_a_grader_the_worker_could_not_call_is_refused_saying_why(tmp_path, source, problem):
    rows = jsonl(tmp_path / "t.jsonl", {"prompt": "Hi", "answer": "Hello"})
    (tmp_path / "graders.py").write_text(source)
    assert problem in refusal({"tasks": [task(rows, [f"{tmp_path}/graders.py:grade"])]})


def test_a_grader_taking_a_task_files_own_column_by_name_passes(tmp_path):
    rows = jsonl(tmp_path / "t.jsonl", {"prompt": "Hi", "answer": "Hello", "lang": "en"})
    (tmp_path / "graders.py").write_text("def grade(prompts, completions, answer, lang):\n    return []\n")
    assert checked(run({"tasks": [task(rows, [f"{tmp_path}/graders.py:grade"])]})).rows == {"capital": 1}


def test_a_benchmark_task_folder_without_yaml_is_refused_naming_the_field(tmp_path):
    (tmp_path / "tasks").mkdir()
    assert refusal({"benchmarks": {"tasks": ["mine"], "task_dir": str(tmp_path / "tasks")}}).startswith(
        "evaluation.benchmarks.task_dir")


def test_a_benchmark_name_that_is_no_harness_name_is_refused():
    with pytest.raises(ValueError, match="is not an lm-evaluation-harness task name"):
        run({"benchmarks": {"tasks": ["hella swag"]}})


def test_a_benchmark_task_the_images_harness_does_not_know_is_refused_before_renting_naming_it():
    from tasks.preflight.task_files import check_benchmark_names

    check_benchmark_names(["hellaswag", "gsm8k", "mine"], private={"mine"})
    with pytest.raises(ValueError) as refused:
        check_benchmark_names(["hellaswag", "hellaswagg"], private={"mine"})
    assert str(refused.value).startswith("evaluation.benchmarks.tasks: 'hellaswagg': no such task, group or tag in "
                                         "the image's lm-evaluation-harness")
    assert "your task folder defines mine" in str(refused.value)


def test_the_job_names_the_stored_task_grader_and_task_folder_files_and_pins_them(tmp_path):
    rows = jsonl(tmp_path / "t.jsonl", {"prompt": "Capital of France?", "answer": "Paris"})
    (tmp_path / "graders.py").write_text(GRADER)
    folder = tmp_path / "harness"
    folder.mkdir()
    (folder / "mine.yaml").write_text("task: mine\ndataset_path: json\nprocess_docs: !function utils.docs\n")
    spec = run({"tasks": [task(rows, ["contains", f"{tmp_path}/graders.py:grade"], max_samples=5)],
                "benchmarks": {"tasks": ["mine"], "task_dir": str(folder), "limit": 3}})
    files = read(spec)
    check_evaluation_inputs(spec, files)
    store = tmp_path / "store"
    _, _, stored = publish_run_inputs(f"file://{store}", "r1", files, [])

    evaluation = job_evaluation(spec, "r1")

    stored_task, = evaluation.tasks
    grader = stored_task.graders[1]
    assert (stored_task.store_path, stored_task.max_samples) == (task_store_path("r1", 0), 5)
    assert (grader.kind, grader.function, grader.store_path) == (
        "function", f"{tmp_path}/graders.py:grade", grader_store_path("r1", 0, 1))
    assert evaluation.benchmarks.task_dir_store_path == task_dir_store_path("r1")
    assert set(stored.sha256) == {stored_task.store_path, grader.store_path, f"{task_dir_store_path('r1')}/mine.yaml"}
    assert (store / grader.store_path).read_text() == GRADER
    JobInput.model_validate({"run_id": "r1", "attempt": 1, "algorithm": "sft", "model": {"id": "org/model"},
                             "dataset": {"hub_id": "org/qa"}, "artifact_store": "file:///tmp/store",
                             "deadline_epoch_s": 0, "evaluation": evaluation.model_dump(mode="json")})


def test_a_tasks_answers_past_the_models_context_are_refused_counting_its_prompt_with_the_models_tokenizer(
        tiny_model):
    prompt = [{"role": "user", "content": "What is the capital of France? " * 20}]
    model = ModelSource(id=str(tiny_model))
    check_task_lengths_task.fn(model, [("evaluation.tasks[0]", prompt, 256)])
    with pytest.raises(ValueError) as refused:
        check_task_lengths_task.fn(model, [("evaluation.tasks[0]", prompt, 1000)])
    assert re.fullmatch(r"evaluation.tasks\[0\]: its longest prompt is (\d+) tokens, and with max_new_tokens 1000 "
                        r"its answers would pass the model's context of 1024 tokens: lower "
                        r"evaluation.tasks\[0\].max_new_tokens to (\d+) or less", str(refused.value))


def test_a_run_lists_its_task_grader_and_task_folder_paths_for_the_servers_rules():
    spec = run({"tasks": [task("tasks/capital.jsonl", ["contains", "graders/mine.py:grade"])],
                "benchmarks": {"tasks": ["mine"], "task_dir": "harness"}})
    assert spec.local_paths() == [("evaluation.tasks[0].local_file", "tasks/capital.jsonl"),
                                  ("evaluation.tasks[0].graders[1]", "graders/mine.py"),
                                  ("evaluation.benchmarks.task_dir", "harness")]


def test_a_link_in_the_benchmarks_task_folder_is_refused(tmp_path):
    folder = tmp_path / "harness"
    folder.mkdir()
    (folder / "mine.yaml").write_text("task: mine\n")
    (folder / "data.json").symlink_to("/etc/hostname")
    assert "data.json is a link" in refusal({"benchmarks": {"tasks": ["mine"], "task_dir": str(folder)}})


def test_a_teammates_task_grader_and_task_folder_outside_the_inputs_folder_are_refused_naming_each_field(
        tmp_path, monkeypatch):
    # On a team server, a run's task files are copied into its store: naming the control plane's own files (a token,
    # a teammate's grader) would publish them. Every such field is held to LORAFLOW_INPUTS_DIR before anything is read.
    from tasks.preflight.server_rules import ServerRuleError, check_server_rules
    from tasks.settings import Settings

    inputs = tmp_path / "inputs"
    inputs.mkdir()
    outside = tmp_path / "control-plane"
    outside.mkdir()
    (outside / "token.jsonl").write_text('{"prompt": "hf_not_yours", "answer": "x"}\n')
    (outside / "grader.py").write_text(GRADER)
    monkeypatch.setenv("LORAFLOW_INPUTS_DIR", str(inputs))
    spec = run({"tasks": [task(outside / "token.jsonl", ["contains", f"{outside}/grader.py:grade"])],
                "benchmarks": {"tasks": ["mine"], "task_dir": str(outside)}})
    with pytest.raises(ServerRuleError) as refused:
        check_server_rules(spec.local_paths(), artifact_store=spec.artifact_store, hub_token_secret="my-token",
                           settings=Settings())
    message = str(refused.value)
    for field in ("evaluation.tasks[0].local_file", "evaluation.tasks[0].graders[1]", "evaluation.benchmarks.task_dir"):
        assert field in message
    assert "hf_not_yours" not in message
