"""End to end: a GRPO run from local files only — a prompt-only JSONL dataset with an extra `answer` column and a
reward function in a local `.py` file — through a real `prefect server start`, localpod and the real worker
training the tiny model on the CPU. The run ships both to its artifact store; the worker imports the reward from
there and hands it the `answer` column. A reward file without its function is refused before any endpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import DATASET, run_train_flow
from tests.test_train_e2e import flow_run_state, run_endpoints

pytestmark = pytest.mark.timeout(900)

STEPS = 20
REWARD_SOURCE = '''
def digits_for_numbers(completions, answer, **kwargs):
    """The fraction of digits in the completion, when the reference answer is a number (all of them here)."""
    rewards = []
    for completion, reference in zip(completions, answer):
        text = completion[-1]["content"]
        chars = [ch for ch in text if not ch.isspace()]
        rewards.append(sum(ch.isdigit() for ch in chars) / len(chars) if chars and reference.isdigit() else 0.0)
    return rewards
'''


def write_prompt_only_dataset(path: Path) -> Path:
    """The shipped chats as prompt-only lines (the user turn), each with a numeric `answer` for the reward."""
    chats = [json.loads(line)["messages"] for line in DATASET.read_text().splitlines() if line.strip()]
    path.write_text("".join(json.dumps({"prompt": chat[:-1], "answer": str(i)}) + "\n" for i, chat in enumerate(chats)))
    return path


def write_grpo_run_file(path: Path, *, name: str, model: Path, store: Path, dataset: Path, reward: str) -> Path:
    path.write_text(f'''
name = "{name}"
algorithm = "grpo"
artifact_store = "file://{store}"
deadline_minutes = 20
[model]
id = "{model}"
[dataset]
local_file = "{dataset}"
[training]
learning_rate = 3e-2
max_steps = {STEPS}
batch_size = 32
seed = 42
[grpo]
num_generations = 4
max_completion_length = 12
rewards = [{{ name = "{reward}" }}]
''')
    return path


def test_grpo_run_with_a_local_reward_file_and_a_prompt_only_dataset_learns_the_reward(local_stack, tiny_model, tmp_path):
    (tmp_path / "my_rewards.py").write_text(REWARD_SOURCE)
    store = tmp_path / "store"
    run_file = write_grpo_run_file(tmp_path / "run.toml", name="e2e-grpo-files", model=tiny_model, store=store,
                                   dataset=write_prompt_only_dataset(tmp_path / "prompts.jsonl"),
                                   reward=f"{tmp_path}/my_rewards.py:digits_for_numbers")

    run = run_train_flow(local_stack, run_file, timeout_s=600)

    assert run.returncode == 0, run.output
    assert flow_run_state(local_stack, run.flow_run_id)["type"] == "COMPLETED"
    run_dir = store / "runs" / run.flow_run_id
    # Both local files were shipped with the run; the job named the stored reward file.
    assert (run_dir / "rewards" / "my_rewards.py").read_text() == REWARD_SOURCE
    assert (run_dir / "dataset" / "train.jsonl").read_bytes() == (tmp_path / "prompts.jsonl").read_bytes()
    [reward] = json.loads((run_dir / "manifest.json").read_text())["job"]["grpo"]["rewards"]
    assert reward["store_path"] == f"runs/{run.flow_run_id}/rewards/my_rewards.py"
    # The worker imported the reward and gave it the `answer` column: it scored, and the policy learned it.
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["steps"] == STEPS
    rewards = [reward for _, reward in metrics["rewards"]]
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.25, rewards
    assert (run_dir / "DONE").exists()


def test_a_reward_file_without_its_function_is_refused_before_any_endpoint_is_created(local_stack, tiny_model, tmp_path):
    (tmp_path / "my_rewards.py").write_text(REWARD_SOURCE)
    run_file = write_grpo_run_file(tmp_path / "run.toml", name="e2e-grpo-nofunc", model=tiny_model,
                                   store=tmp_path / "store", dataset=write_prompt_only_dataset(tmp_path / "prompts.jsonl"),
                                   reward=f"{tmp_path}/my_rewards.py:no_such_function")

    run = run_train_flow(local_stack, run_file)

    assert run.returncode == 1
    message = flow_run_state(local_stack, run.flow_run_id)["message"]
    assert "grpo.rewards[0].name" in message and "no top-level function `no_such_function`" in message, message
    assert run_endpoints(local_stack, "e2e-grpo-nofunc") == []
    assert not (tmp_path / "store").exists()  # nothing published either


def test_a_sft_dataset_line_is_refused_for_grpo_naming_the_line_before_any_endpoint(local_stack, tiny_model, tmp_path):
    (tmp_path / "my_rewards.py").write_text(REWARD_SOURCE)
    dataset = write_prompt_only_dataset(tmp_path / "prompts.jsonl")
    with dataset.open("a") as lines:
        lines.write(json.dumps({"text": "no prompt here"}) + "\n")
    run_file = write_grpo_run_file(tmp_path / "run.toml", name="e2e-grpo-baddata", model=tiny_model,
                                   store=tmp_path / "store", dataset=dataset,
                                   reward=f"{tmp_path}/my_rewards.py:digits_for_numbers")

    run = run_train_flow(local_stack, run_file)

    assert run.returncode == 1
    message = flow_run_state(local_stack, run.flow_run_id)["message"]
    assert "dataset.local_file" in message and "line 58: no `messages` or `prompt`" in message, message
    assert run_endpoints(local_stack, "e2e-grpo-baddata") == []
