"""Tool-using GRPO (`grpo.tools`, `grpo.environment`): the tiny model, taught the tool-call format by an SFT run,
calls a tool inside the training process during GRPO; the tool's answer reaches the reward; a tool that raises
answers with its error; trajectories are stored with secrets redacted; bad tools are refused naming them."""

from __future__ import annotations

import json

import pytest
from worker_test_support import CountingStore, train_in_process

from loraflow_worker.contract import JobInput
from loraflow_worker.self_test import tool_use
from loraflow_worker.training.tools import ToolError, resolve_tools

SECRET = "ledger-secret-value-4711"


def _store_file(store: CountingStore, path: str, text: str) -> str:
    (store.root / path).parent.mkdir(parents=True, exist_ok=True)
    (store.root / path).write_text(text)
    return path


@pytest.fixture(scope="module")
def taught(make_job, tiny_model_dir, tmp_path_factory):
    """`run-teach`: SFT on chats whose answer is a call of `record`, stored as every run is."""
    store = CountingStore(tmp_path_factory.mktemp("store"))
    job = make_job("run-teach", tiny_model_dir, store.root, lora={"rank": 8, "alpha": 16},
                   training={"max_steps": 150, "learning_rate": 1e-2, "batch_size": 4})
    _store_file(store, job["input"]["dataset"]["store_path"], tool_use.jsonl(tool_use.teaching_rows()))
    result = train_in_process(job, store, tmp_path_factory.mktemp("work"), [])
    return store, result


def _tools_job(make_job, tiny_model_dir, store: CountingStore, run_id: str, **grpo) -> dict:
    job = make_job(run_id, tiny_model_dir, store.root, algorithm="grpo", lora={"init_from": "runs/run-teach"},
                   training={"max_steps": 3, "learning_rate": 1e-3, "batch_size": 8, "seed": 1},
                   worker_secret_names=["LEDGER_SECRET"],
                   grpo={"num_generations": 4, "max_completion_length": 192, "temperature": 0.3, "max_tool_calls": 1,
                         "rewards": [{"name": "reward.py:receipt",
                                      "store_path": _store_file(store, f"runs/{run_id}/rewards/reward.py",
                                                                tool_use.REWARD_SOURCE)}],
                         **grpo})
    _store_file(store, job["input"]["dataset"]["store_path"], tool_use.jsonl(tool_use.prompt_rows()))
    return job


@pytest.fixture(scope="module")
def tool_run(taught, make_job, tiny_model_dir, tmp_path_factory):
    """GRPO from the taught adapter with `record` as its tool; the ledger and a run secret in its environment."""
    store, _ = taught
    ledger = tmp_path_factory.mktemp("ledger") / "ledger.txt"
    job = _tools_job(make_job, tiny_model_dir, store, "run-tools", tools="tools.py",
                     tools_store_path=_store_file(store, "runs/run-tools/tools/tools.py", tool_use.TOOLS_SOURCE))
    with pytest.MonkeyPatch.context() as env:
        env.setenv(tool_use.LEDGER_ENV, str(ledger))
        env.setenv("LEDGER_SECRET", SECRET)
        result = train_in_process(job, store, tmp_path_factory.mktemp("work"), [])
    return store, result, ledger


def test_the_taught_model_calls_the_tool_inside_the_training_process(tool_run):
    _, _, ledger = tool_run
    recorded = ledger.read_text().splitlines()
    # Completions are sampled (temperature 0.3): now and then a call carries a garbled argument, which the tool
    # records as it came. The taught calls name the prompts' items.
    named = [item for item in recorded if item in tool_use.ITEMS]
    assert recorded and len(named) >= 0.75 * len(recorded), recorded


def test_the_tools_answer_reaches_the_reward(tool_run):
    _, result, _ = tool_run
    assert max(reward for _, reward in result.metrics.rewards) > 0.5, result.metrics.rewards


def test_trajectories_are_stored_with_the_run_showing_the_call_and_its_answer(tool_run):
    store, _, _ = tool_run
    lines = (store.root / "runs/run-tools/trajectories.jsonl").read_text().splitlines()
    trajectories = [json.loads(line) for line in lines]
    assert {t["step"] for t in trajectories} == {1, 2, 3}
    called = [t for t in trajectories if t["tool_calls"]]
    assert called, trajectories
    call = called[0]["tool_calls"][0]
    assert call["name"] == "record" and call["result"] == "receipt " + call["arguments"]["item"]
    assert called[0]["reward"] == 1.0 and called[0]["prompt"].startswith("Record ")


def test_a_tool_that_raises_answers_with_its_error_and_the_run_goes_on(taught, make_job, tiny_model_dir, tmp_path):
    store, _ = taught
    raising = tool_use.TOOLS_SOURCE.replace('    with open(', f'    raise RuntimeError("ledger closed {SECRET}")\n    with open(')
    job = _tools_job(make_job, tiny_model_dir, store, "run-raising", tools="tools.py",
                     tools_store_path=_store_file(store, "runs/run-raising/tools/tools.py", raising))
    with pytest.MonkeyPatch.context() as env:
        env.setenv("LEDGER_SECRET", SECRET)
        result = train_in_process(job, store, tmp_path, [])
    assert result.metrics.steps == 3
    stored = (store.root / "runs/run-raising/trajectories.jsonl").read_text()
    answers = [call.get("result") for line in stored.splitlines() for call in json.loads(line)["tool_calls"]]
    assert any("ledger closed ***" in str(answer) for answer in answers), answers
    assert SECRET not in stored


def test_an_environment_class_gives_each_completion_its_own_instance(taught, make_job, tiny_model_dir, tmp_path):
    store, _ = taught
    source = tool_use.TOOLS_SOURCE.replace("def record(item: str) -> str:", "class Ledger:\n    def reset(self, **row):\n"
                                           "        self.items = []\n\n    def record(self, item: str) -> str:")
    source = source.replace("\n    ", "\n        ").replace("\nclass Ledger:\n        def reset", "\nclass Ledger:\n    def reset")
    source = source.replace("        def record(self", "    def record(self")
    job = _tools_job(make_job, tiny_model_dir, store, "run-env", environment="ledger.py:Ledger",
                     environment_store_path=_store_file(store, "runs/run-env/tools/ledger.py", source))
    ledger = tmp_path / "ledger.txt"
    with pytest.MonkeyPatch.context() as env:
        env.setenv(tool_use.LEDGER_ENV, str(ledger))
        result = train_in_process(job, store, tmp_path / "work", [])
    assert result.metrics.steps == 3 and ledger.read_text().strip()


def test_a_tool_without_type_hints_is_refused_naming_it(taught, tmp_path):
    store, _ = taught
    source = "def record(item):\n    \"\"\"Record it.\n\n    Args:\n        item: The item.\n    \"\"\"\n    return item\n"
    settings = JobInput.model_validate({
        "run_id": "r", "algorithm": "grpo", "model": {"id": "m"}, "dataset": {"store_path": "d.jsonl"},
        "artifact_store": "file:///s", "training": {"batch_size": 4},
        "grpo": {"num_generations": 4, "rewards": [{"name": "digit_fraction"}], "tools": "tools.py",
                 "tools_store_path": _store_file(store, "runs/r/tools/tools.py", source)}}).grpo
    with pytest.raises(ToolError, match=r"grpo.tools `tools.py`: tool `record` cannot be shown to the model: .*item"):
        resolve_tools(settings, store, tmp_path)


def test_the_taught_system_turn_is_the_one_the_template_renders_for_the_tool(tiny_model_dir):
    from transformers import AutoTokenizer

    namespace: dict = {}
    exec(tool_use.TOOLS_SOURCE, namespace)  # noqa: S102 - the shipped tool's source, to render its schema
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tools=[namespace["record"]],
                                             tokenize=False)
    assert rendered.startswith(f"<|im_start|>system\n{tool_use.TOOLS_TURN}<|im_end|>\n")


def test_a_template_that_does_not_render_tools_is_refused_naming_the_model(tiny_model_dir):
    from transformers import AutoTokenizer

    from loraflow_worker.training.tools import check_tool_template

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + (m['content'] or '') "
                               "+ '<|im_end|>\\n' }}{% endfor %}")
    with pytest.raises(ToolError, match=r"the chat template of org/tiny does not render tools"):
        check_tool_template(tokenizer, "org/tiny")


def test_a_template_whose_tool_calls_cannot_be_read_back_is_refused(tiny_model_dir):
    from transformers import AutoTokenizer

    from loraflow_worker.training.tools import check_tool_template

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.response_template = None
    with pytest.raises(ToolError, match=r"tool calls cannot be read back .* no `response_template`"):
        check_tool_template(tokenizer, "org/tiny")


def test_tools_need_chat_prompts(tiny_model_dir):
    from datasets import Dataset
    from transformers import AutoTokenizer

    from loraflow_worker.training.grpo import prompt_dataset
    from loraflow_worker.training.tools import RunTools

    namespace: dict = {}
    exec(tool_use.TOOLS_SOURCE, namespace)  # noqa: S102
    rows = Dataset.from_list([{"prompt": "Record apple."}])
    with pytest.raises(ValueError, match=r"needs chat prompts"):
        prompt_dataset(rows, AutoTokenizer.from_pretrained(tiny_model_dir), 512, RunTools(tools=[namespace["record"]]))


def test_max_tool_calls_without_tools_is_refused():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=r"`max_tool_calls` is set but there are no tools"):
        JobInput.model_validate({
            "run_id": "r", "algorithm": "grpo", "model": {"id": "m"}, "dataset": {"store_path": "d.jsonl"},
            "artifact_store": "file:///s", "training": {"batch_size": 4},
            "grpo": {"num_generations": 4, "rewards": [{"name": "digit_fraction"}], "max_tool_calls": 2}})


def test_a_trajectory_pairs_each_call_with_its_answer_and_sums_weighted_rewards():
    from loraflow_worker.training.trajectories import trajectory

    completion = [{"role": "assistant", "content": "", "tool_calls": [
                      {"type": "function", "function": {"name": "record", "arguments": {"item": "fig"}}}]},
                  {"role": "tool", "name": "record", "content": "receipt fig"},
                  {"role": "assistant", "content": "Done."}]
    record = trajectory(2, [{"role": "user", "content": "Record fig."}], completion,
                        {"receipt": 1.0, "length": float("nan")}, {"receipt": 0.5, "length": 1.0})
    assert record == {"step": 2, "prompt": "Record fig.", "answer": "Done.", "reward": 0.5,
                      "tool_calls": [{"name": "record", "arguments": {"item": "fig"}, "result": "receipt fig"}],
                      "rewards": {"receipt": 1.0, "length": record["rewards"]["length"]}}
