"""Task evaluations after training (`evaluation.tasks`): the built-in graders on crafted answers, a user's grader
function from the run's store, a judge model behind a local OpenAI-compatible server, the paired standard error, and
one run of the tiny model taught a phrase, evaluated base against adapter."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from worker_test_support import train_in_process

from loraflow_worker.artifacts import FileStore
from loraflow_worker.contract import JobInput, Progress, TrainMetrics
from loraflow_worker.contract.task_evaluation import GraderSettings, TaskEvaluation, task_score
from loraflow_worker.dataset.loading import evaluation_split, load_job_dataset
from loraflow_worker.evaluation.after_training import evaluate_after_training, prepare_evaluation
from loraflow_worker.evaluation.function_graders import GraderError, grade_with_function, load_grader_function
from loraflow_worker.evaluation.graders import grade_builtin, normalize_answer
from loraflow_worker.evaluation.judge import grade_with_judge
from loraflow_worker.evaluation.task_rows import TaskRow, read_task_rows
from loraflow_worker.training.run import shared_trainer_args


def _grade(kind: str, answers: list[str], expected: list[object], **settings) -> list[float]:
    return grade_builtin(GraderSettings(kind=kind, **settings), answers, expected)


# --- built-in graders ------------------------------------------------------------------------------------------------

def test_normalisation_is_squads_lowercase_no_punctuation_no_articles_single_spaces():
    assert normalize_answer("  The  Eiffel-Tower, in   PARIS!  ") == "eiffeltower in paris"
    assert normalize_answer("an apple a day") == "apple day"


def test_exact_match_compares_normalised_answers_unless_told_not_to():
    assert _grade("exact_match", ["The Paris.", "Paris is it", "paris"], ["paris"] * 3) == [1.0, 0.0, 1.0]
    assert _grade("exact_match", ["paris", " Paris "], ["Paris"] * 2, normalize=False) == [0.0, 1.0]


def test_exact_match_reads_a_numeric_expected_answer_as_its_text():
    assert _grade("exact_match", ["72", "72.0"], [72, 72.0]) == [1.0, 0.0]


def test_contains_finds_the_expected_answer_anywhere_in_the_answer():
    assert _grade("contains", ["I think it is PARIS, France.", "Lyon"], ["Paris"] * 2) == [1.0, 0.0]
    assert _grade("contains", ["I think it is PARIS"], ["Paris"], normalize=False) == [0.0]


def test_regex_with_a_pattern_compares_its_first_group_with_the_expected_answer():
    answers = ["reasoning... Answer: The Paris", "Answer: Lyon", "no marker here"]
    assert _grade("regex", answers, ["paris"] * 3, pattern=r"Answer:\s*(.+)") == [1.0, 0.0, 0.0]


def test_regex_without_a_pattern_searches_the_expected_answer_as_a_pattern():
    assert _grade("regex", ["order #A-1234 shipped", "order 1234"], [r"#A-\d{4}"] * 2) == [1.0, 0.0]


def test_numeric_takes_the_last_number_and_accepts_it_within_the_tolerance():
    answers = ["3 apples and 4 pears: 7", "about 7.04", "1,234.5 in total", "no number"]
    assert _grade("numeric", answers, [7, 7, "1234.5", 7], tolerance=0.05) == [1.0, 1.0, 1.0, 0.0]
    assert _grade("numeric", ["about 7.04"], [7]) == [0.0]  # the default tolerance is a rounding error's


def test_numeric_reads_a_gsm8k_answer_and_a_pattern_group():
    assert _grade("numeric", ["so 72 it is"], ["She sold 48 + 24 = 72 clips.\n#### 72"]) == [1.0]
    assert _grade("numeric", ["<answer>12</answer> then 99"], [12], pattern=r"<answer>(.*?)</answer>") == [1.0]


@pytest.mark.parametrize(("answer", "expected", "f1"), [
    # As SQuAD v1.1's evaluate-v1.1.py (`f1_score`) computes them: articles go before tokens are counted.
    ("the cat sat on the mat", "the cat sat", 2 * 0.5 * 1.0 / 1.5),
    ("Denver Broncos", "Denver Broncos", 1.0),
    ("the Broncos of Denver", "Denver Broncos", 2 * (2 / 3) * 1.0 / (2 / 3 + 1.0)),
    ("Carolina Panthers", "Denver Broncos", 0.0),
    ("a b b", "b b c", 0.8),
])
def test_f1_is_squads_token_f1(answer, expected, f1):
    assert _grade("f1", [answer], [expected]) == [pytest.approx(f1)]


def test_the_paired_stderr_is_the_stderr_of_the_per_prompt_differences():
    score = task_score("t", "g", base=[0.0, 1.0, 0.0, 1.0], adapter=[1.0, 1.0, 1.0, 1.0])
    # Differences 1, 0, 1, 0: mean 0.5, sample sd sqrt(1/3), stderr sqrt(1/3)/2.
    assert (score.delta, score.delta_stderr) == (pytest.approx(0.5), pytest.approx((1 / 3) ** 0.5 / 2))
    assert (score.base, score.base_stderr, score.adapter, score.adapter_stderr) == \
        (pytest.approx(0.5), pytest.approx((1 / 3) ** 0.5 / 2), 1.0, 0.0)
    # The same prompts answered better by the adapter: pairing removes what the prompts share.
    same = task_score("t", "g", base=[0.2, 0.5, 0.8], adapter=[0.3, 0.6, 0.9])
    assert same.delta == pytest.approx(0.1) and same.delta_stderr == pytest.approx(0.0, abs=1e-12)


# --- a task's rows ---------------------------------------------------------------------------------------------------

def _task(store_root: Path, rows: list[dict], graders: list[dict], **fields) -> TaskEvaluation:
    path = "runs/r/evaluation-inputs/task.jsonl"
    (store_root / path).parent.mkdir(parents=True, exist_ok=True)
    (store_root / path).write_text("".join(json.dumps(row) + "\n" for row in rows))
    return TaskEvaluation(name="task", store_path=path, graders=graders, **fields)


def test_a_chat_row_is_asked_up_to_its_last_user_turn_and_other_columns_go_with_it(tmp_path):
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"},
            {"role": "assistant", "content": "a reply that is not the answer"}]
    task = _task(tmp_path, [{"messages": chat, "answer": "Paris", "level": 2}, {"prompt": "2+2=", "answer": 4}],
                 [{"kind": "exact_match"}], max_samples=5)
    first, second = read_task_rows(task, FileStore(tmp_path))
    assert (first.prompt, first.answer, first.columns, first.chat) == (chat[:2], "Paris", {"level": 2}, True)
    assert (second.prompt, second.answer, second.chat) == ("2+2=", 4, False)


def test_only_the_first_max_samples_rows_are_asked(tmp_path):
    task = _task(tmp_path, [{"prompt": f"q{i}", "answer": str(i)} for i in range(5)], [{"kind": "contains"}],
                 max_samples=3)
    assert [row.prompt for row in read_task_rows(task, FileStore(tmp_path))] == ["q0", "q1", "q2"]


def test_a_row_without_answer_is_refused_naming_the_graders_that_need_one(tmp_path):
    task = _task(tmp_path, [{"prompt": "q", "answer": "a"}, {"prompt": "q2"}], [{"kind": "f1"}])
    with pytest.raises(ValueError, match=r"task `task` .*row 2: no `answer`, which grader\(s\) f1"):
        read_task_rows(task, FileStore(tmp_path))


# --- function graders ------------------------------------------------------------------------------------------------

GRADER_FILE = '''
CALLS = []

def graded(prompts, completions, answer, level, **kwargs):
    CALLS.append(len(prompts))
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [None if t == "?" else float(t == str(a)) * (1.0 if lv is None else 1.0 / lv)
            for t, a, lv in zip(texts, answer, level)]

def too_big(prompts, completions, **kwargs):
    return [2.5 for _ in completions]
'''


def _function_grader(store_root: Path, function: str) -> GraderSettings:
    path = "runs/r/evaluation-inputs/graders.py"
    (store_root / path).parent.mkdir(parents=True, exist_ok=True)
    (store_root / path).write_text(GRADER_FILE)
    return GraderSettings(kind="function", function=f"graders.py:{function}", store_path=path)


def test_a_function_grader_from_the_store_scores_in_batches_with_the_rows_columns(tmp_path, monkeypatch):
    from loraflow_worker.evaluation import function_graders

    monkeypatch.setattr(function_graders, "BATCH_SIZE", 2)
    grader = _function_grader(tmp_path / "store", "graded")
    function = load_grader_function("task", grader, FileStore(tmp_path / "store"), tmp_path / "files")
    rows = [TaskRow("q1", "a", {"level": 2}), TaskRow([{"role": "user", "content": "q2"}], "b", {}),
            TaskRow("q3", "c", {"level": 1})]
    scores, failed = grade_with_function("task", grader, function, rows, ["a", "b", "?"])
    # Row 2 lacks `level`: it gets None, as a dataset column missing from a row does; row 3 is left unscored.
    assert (scores, failed) == ([0.5, 1.0, 0.0], 1)
    assert function.__globals__["CALLS"] == [2, 1]


def test_a_function_grader_score_outside_0_1_is_refused_naming_the_grader(tmp_path):
    grader = _function_grader(tmp_path / "store", "too_big")
    function = load_grader_function("task", grader, FileStore(tmp_path / "store"), tmp_path / "files")
    with pytest.raises(GraderError, match=r"task `task`, grader `too_big` \(graders.py:too_big\) scored row 1 2.5"):
        grade_with_function("task", grader, function, [TaskRow("q", "a")], ["a"])


def test_a_function_grader_naming_a_missing_function_is_refused(tmp_path):
    grader = _function_grader(tmp_path / "store", "absent")
    with pytest.raises(GraderError, match="`absent` does not exist in the file"):
        load_grader_function("task", grader, FileStore(tmp_path / "store"), tmp_path / "files")


# --- the judge -------------------------------------------------------------------------------------------------------

class _Judge(BaseHTTPRequestHandler):
    """An OpenAI-compatible chat completions route: scores 8 when the answer to grade says Paris, replies without a
    score when it says `?`, else 2; it records each request's Authorization header and messages."""

    seen: list[tuple[str | None, list[dict]]] = []

    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append((self.headers.get("Authorization"), body["messages"]))
        graded = body["messages"][-1]["content"].rsplit("Answer to grade:\n", 1)[1]
        reply = "I cannot tell." if graded == "?" else f"Reason: fine.\nScore: {8 if 'Paris' in graded else 2}"
        data = json.dumps({"choices": [{"message": {"role": "assistant", "content": reply}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def judge_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Judge)
    _Judge.seen = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def test_a_judge_scores_from_its_reply_counts_unscored_answers_and_sends_the_key(judge_url, monkeypatch):
    monkeypatch.setenv("JUDGE_KEY", "sk-test-judge")
    grader = GraderSettings(kind="judge", judge_model="judge-1", judge_base_url=judge_url,
                            judge_api_key_env="JUDGE_KEY", rubric="Name the right capital.")
    rows = [TaskRow("Capital of France?", "Paris"), TaskRow("Capital of Italy?", None), TaskRow("Capital?", None)]
    scores, failed = grade_with_judge("task", grader, rows, ["It is Paris.", "Lyon", "?"])
    assert (scores, failed) == ([0.8, 0.2, 0.0], 1)
    assert {auth for auth, _ in _Judge.seen} == {"Bearer sk-test-judge"}
    asked = next(messages[-1]["content"] for _, messages in _Judge.seen if "France" in messages[-1]["content"])
    assert "Name the right capital." in asked and "Expected answer:\nParis" in asked


def test_a_judge_whose_key_variable_is_missing_is_refused_naming_it(judge_url, monkeypatch):
    monkeypatch.delenv("JUDGE_KEY", raising=False)
    grader = GraderSettings(kind="judge", judge_model="judge-1", judge_base_url=judge_url,
                            judge_api_key_env="JUDGE_KEY", rubric="r")
    with pytest.raises(GraderError, match=r"no `JUDGE_KEY` \(`judge_api_key_env`\)"):
        grade_with_judge("task", grader, [TaskRow("q", None)], ["a"])


# --- a run with tasks only -------------------------------------------------------------------------------------------

PHRASE = "The capital of France is Paris."
QUESTIONS = ["What is the capital of Germany?", "What is the capital of Italy?", "What is the capital of Spain?",
             "What is the capital of France?"]


def _phrase_job(model_dir: Path, store_root: Path, run_id: str, **fields) -> dict:
    """SFT rows whose every answer is PHRASE, and a task asking the same questions whose answer is that phrase."""
    dataset, task_file = f"runs/{run_id}/dataset/train.jsonl", f"runs/{run_id}/evaluation-inputs/phrase.jsonl"
    (store_root / dataset).parent.mkdir(parents=True, exist_ok=True)
    (store_root / task_file).parent.mkdir(parents=True, exist_ok=True)
    (store_root / dataset).write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": q}, {"role": "assistant", "content": PHRASE}]}) + "\n" for q in QUESTIONS * 4))
    (store_root / task_file).write_text("".join(json.dumps({"messages": [{"role": "user", "content": q}],
                                                            "answer": "capital of France is Paris"}) + "\n"
                                                for q in QUESTIONS))
    task = {"name": "phrase", "store_path": task_file, "graders": [{"kind": "contains"}, {"kind": "f1"}],
            "max_new_tokens": 16, "samples_kept": 3}
    return {"run_id": run_id, "model": {"id": str(model_dir)}, "dataset": {"store_path": dataset},
            "artifact_store": store_root.as_uri(), "evaluation": {"tasks": [task]}, **fields}


def test_an_evaluation_of_tasks_only_holds_no_rows_out_and_evaluates_nothing_while_training(tiny_model_dir, tmp_path):
    job = JobInput.model_validate(_phrase_job(tiny_model_dir, tmp_path / "store", "r"))
    store = FileStore(tmp_path / "store")
    rows = load_job_dataset(job.dataset, store, tmp_path / "w", job.training.seed).rows
    train, held_out = evaluation_split(rows, job, store, tmp_path / "w")
    assert (len(train), held_out) == (len(QUESTIONS) * 4, None)
    assert "eval_strategy" not in shared_trainer_args(job, tmp_path / "w")


def test_the_task_files_are_pinned_inputs_of_the_run(tiny_model_dir, tmp_path):
    job = JobInput.model_validate(_phrase_job(tiny_model_dir, tmp_path / "store", "r"))
    assert job.input_files()["runs/r/evaluation-inputs/phrase.jsonl"] == "evaluation.tasks[0]"


def test_a_tiny_model_taught_a_phrase_scores_it_for_the_adapter_and_not_for_the_base(tiny_model_dir, tmp_path):
    store_root = tmp_path / "store"
    job = _phrase_job(tiny_model_dir, store_root, "phrase",
                      training={"max_steps": 30, "learning_rate": 2e-2, "batch_size": 8})
    progress: list[Progress] = []
    result = train_in_process({"input": job}, FileStore(store_root), tmp_path / "work", progress)
    run_dir = store_root / "runs" / "phrase"
    stored = TrainMetrics.model_validate_json((run_dir / "metrics.json").read_text())
    assert stored.task_scores == result.metrics.task_scores and stored.evaluation_stopped is None
    assert stored.eval_loss == []  # no held-out rows: nothing evaluated while training
    contains = next(s for s in stored.task_scores if s.metric == "task:phrase/contains")
    assert (contains.n, contains.base, contains.adapter) == (len(QUESTIONS), 0.0, 1.0), contains
    assert (contains.delta, contains.adapter_stderr, contains.delta_stderr) == (1.0, 0.0, 0.0)
    assert contains.answered_by == "transformers"  # no CUDA device here (`test_worker_vllm_answering.py`: vLLM's)
    f1 = next(s for s in stored.task_scores if s.metric == "task:phrase/f1")
    assert f1.adapter > 0.9 and f1.base < 0.3 and f1.delta_stderr >= 0.0, f1
    answers = [json.loads(line) for line in (run_dir / "evaluation" / "phrase.jsonl").read_text().splitlines()]
    assert len(answers) == 3
    assert all(PHRASE in a["adapter"] and PHRASE not in a["base"] for a in answers), answers
    assert answers[0]["scores"]["contains"] == {"base": 0.0, "adapter": 1.0}
    assert answers[0]["answer"] == "capital of France is Paris" and answers[0]["prompt"][0]["role"] == "user"
    assert {(p.step, p.total_steps) for p in progress if p.stage == "evaluating"} == {(30, 30)}
    messages = [p.message for p in progress if p.stage == "evaluating"]
    assert "answering with transformers: no CUDA device" in messages
    assert any(m.startswith("task:phrase/contains: base 0.000 ± 0.000, adapter 1.000 ± 0.000, Δ +1.000 ± 0.000")
               for m in messages), messages


def _untrained_adapter(model_dir: Path, adapter_dir: Path) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir),
                   LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM")).save_pretrained(adapter_dir)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(adapter_dir)
    return adapter_dir


def test_a_deadline_passed_before_the_evaluation_skips_it_and_says_which_tasks_were_not_evaluated(
        tiny_model_dir, tmp_path):
    job = JobInput.model_validate(_phrase_job(tiny_model_dir, tmp_path / "store", "r", deadline_epoch_s=1.0))
    progress: list[Progress] = []
    store = FileStore(tmp_path / "store")
    adapter_dir = _untrained_adapter(tiny_model_dir, tmp_path / "adapter")
    evaluated = evaluate_after_training(job, store, tmp_path / "work", adapter_dir,
                                        prepare_evaluation(job, store, tmp_path / "work"), progress.append, steps=7)
    assert (evaluated.task_scores, evaluated.files) == ([], {})
    assert "deadline passed before the task evaluations began" in evaluated.stopped
    assert "task(s) phrase were not evaluated" in evaluated.stopped
    assert (progress[-1].stage, progress[-1].step, progress[-1].message) == ("evaluating", 7, evaluated.stopped)


def test_a_deadline_that_passes_while_answering_stops_before_the_next_batch(tiny_model_dir, tmp_path):
    from loraflow_worker.evaluation.answering import EvaluationDeadline, loaded_answerer

    job = JobInput.model_validate(_phrase_job(tiny_model_dir, tmp_path / "store", "r", deadline_epoch_s=1.0))
    store = FileStore(tmp_path / "store")
    task = job.evaluation.tasks[0]
    adapter_dir = _untrained_adapter(tiny_model_dir, tmp_path / "adapter")
    with loaded_answerer(tiny_model_dir, {"default": adapter_dir}, base_tokenizer_dir=adapter_dir,
                         deadline_epoch_s=job.deadline_epoch_s) as answerer:
        with pytest.raises(EvaluationDeadline, match="deadline passed while task `phrase` was evaluated"):
            answerer.answer(task, read_task_rows(task, store), adapter="default")


def test_a_grader_that_fails_after_training_leaves_the_run_stored_and_says_why(tiny_model_dir, tmp_path):
    store = FileStore(tmp_path / "store")
    job = _phrase_job(tiny_model_dir, tmp_path / "store", "r")
    grader = _function_grader(tmp_path / "store", "too_big")
    job["evaluation"]["tasks"][0]["graders"].append(grader.model_dump(exclude_none=True))
    job = JobInput.model_validate(job)
    adapter_dir = _untrained_adapter(tiny_model_dir, tmp_path / "adapter")
    evaluated = evaluate_after_training(job, store, tmp_path / "work", adapter_dir,
                                        prepare_evaluation(job, store, tmp_path / "work"), lambda progress: None,
                                        steps=1)
    assert evaluated.stopped.startswith("the task evaluations failed (GraderError: task `phrase`, grader `too_big`")
    assert evaluated.stopped.endswith("the adapter is complete and stored, but task(s) phrase were not evaluated (in full)")


def test_a_task_file_without_its_answers_fails_the_job_before_training(tiny_model_dir, tmp_path):
    store_root = tmp_path / "store"
    job = _phrase_job(tiny_model_dir, store_root, "r")
    (store_root / job["evaluation"]["tasks"][0]["store_path"]).write_text(json.dumps({"prompt": "q"}) + "\n")
    progress: list[Progress] = []
    with pytest.raises(ValueError, match="row 1: no `answer`"):
        train_in_process({"input": job}, FileStore(store_root), tmp_path / "work", progress)
    assert not any(p.stage == "training" for p in progress)


@pytest.mark.parametrize("algorithm", ["dpo", "grpo"])
def test_dpo_and_grpo_runs_evaluate_their_tasks_the_same_way(algorithm, tiny_model_dir, tmp_path):
    store_root = tmp_path / "store"
    job = _phrase_job(tiny_model_dir, store_root, "r", algorithm=algorithm,
                      training={"max_steps": 2, "learning_rate": 1e-2, "batch_size": 4})
    user = [{"role": "user", "content": q} for q in QUESTIONS]
    rows = ([{"prompt": [u], "chosen": [{"role": "assistant", "content": PHRASE}],
              "rejected": [{"role": "assistant", "content": "Berlin."}]} for u in user] if algorithm == "dpo"
            else [{"prompt": [u]} for u in user])
    (store_root / job["dataset"]["store_path"]).write_text("".join(json.dumps(row) + "\n" for row in rows * 2))
    if algorithm == "grpo":
        job["grpo"] = {"num_generations": 4, "max_completion_length": 8, "rewards": [{"name": "digit_fraction"}]}
    result = train_in_process({"input": job}, FileStore(store_root), tmp_path / "work", [])
    assert [(s.metric, s.n) for s in result.metrics.task_scores] == \
        [("task:phrase/contains", len(QUESTIONS)), ("task:phrase/f1", len(QUESTIONS))]
    assert (store_root / "runs" / "r" / "evaluation" / "phrase.jsonl").is_file()
