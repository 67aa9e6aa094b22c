"""TRL's conversational dataset formats and reward files on the worker: SFT trains on prompt/completion lines,
GRPO on prompt-only lines whose extra `answer` column reaches a reward that the job ships as a file in the run's
store (`RewardSpec.store_path`), imported from there."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from datasets import Dataset
from transformers import AutoTokenizer

from loraflow_worker.artifacts import FileStore, open_store
from loraflow_worker.contract import JobInput, RewardSpec
from loraflow_worker.training.grpo import prompt_dataset
from loraflow_worker.handler import WORK_DIR_ENV, handler
from loraflow_worker.training.rewards import RewardError, resolve_rewards
from loraflow_worker.training.sft import train_sft
from loraflow_worker.self_test.tiny_model import DEFAULT_CORPUS

CHATS = [json.loads(line)["messages"] for line in DEFAULT_CORPUS.read_text().splitlines() if line.strip()]
REWARD_FILE = "runs/{run_id}/rewards/answer_rewards.py"
REWARD_SOURCE = '''
import json
import os

def digits_when_asked(completions, answer, **kwargs):
    """The digit fraction of the completion; every `answer` the reward was called with is written down."""
    with open(os.environ["ANSWERS_SEEN"], "a") as seen:
        seen.writelines(json.dumps(a) + "\\n" for a in answer)
    texts = [c[-1]["content"] for c in completions]
    return [sum(ch.isdigit() for ch in t) / max(1, len(t)) for t in texts]

def not_a_function():
    pass

not_callable = 3
'''


def store_lines(store_root: Path, store_path: str, rows: list[dict]) -> str:
    (store_root / store_path).parent.mkdir(parents=True, exist_ok=True)
    (store_root / store_path).write_text("".join(json.dumps(row) + "\n" for row in rows))
    return store_path


def test_sft_trains_on_prompt_completion_lines(tiny_model_dir, tmp_path):
    rows = [{"prompt": chat[:-1], "completion": chat[-1:]} for chat in CHATS]
    job = JobInput.model_validate({
        "run_id": "pc", "model": {"id": str(tiny_model_dir)}, "artifact_store": (tmp_path / "store").as_uri(),
        "dataset": {"store_path": store_lines(tmp_path / "store", "runs/pc/dataset/train.jsonl", rows)},
        "training": {"max_steps": 30, "learning_rate": 1e-2, "batch_size": 8, "checkpoint_every_minutes": None},
    })
    outcome = train_sft(job, open_store(job.artifact_store), tmp_path / "work", lambda progress: None)
    assert outcome.metrics.steps == 30
    assert outcome.metrics.final_loss < 0.5 * outcome.metrics.first_loss, outcome.metrics.losses
    assert (outcome.adapter_dir / "adapter_model.safetensors").is_file()


def test_grpo_trains_on_prompt_only_lines_and_the_answer_column_reaches_a_reward_file(
        tiny_model_dir, make_job, tmp_path, monkeypatch):
    store_root = tmp_path / "store"
    answers = [str(n) for n in range(len(CHATS))]
    rows = [{"prompt": chat[:-1], "answer": answer} for chat, answer in zip(CHATS, answers)]
    reward_path = REWARD_FILE.format(run_id="po")
    (store_root / reward_path).parent.mkdir(parents=True)
    (store_root / reward_path).write_text(REWARD_SOURCE)
    monkeypatch.setenv(WORK_DIR_ENV, str(tmp_path / "work"))
    monkeypatch.setenv("ANSWERS_SEEN", str(tmp_path / "answers-seen.jsonl"))  # the training process inherits it
    job = make_job("po", tiny_model_dir, store_root, algorithm="grpo",
                   # Not make_job's `train.jsonl`, which it fills with the shipped chats.
                   dataset={"store_path": store_lines(store_root, "runs/po/dataset/prompt-only.jsonl", rows)},
                   training={"max_steps": 2, "learning_rate": 3e-2, "batch_size": 8},
                   grpo={"num_generations": 4, "max_completion_length": 8,
                         "rewards": [{"name": "rewards/answer_rewards.py:digits_when_asked", "store_path": reward_path}]})

    result = handler(job)

    assert result["metrics"]["steps"] == 2 and len(result["metrics"]["rewards"]) == 2
    seen = [json.loads(line) for line in (tmp_path / "answers-seen.jsonl").read_text().splitlines()]
    assert len(seen) == 2 * 8 and set(seen) <= set(answers)  # 2 steps of 8 completions, each with its prompt's answer


def test_a_reward_file_is_fetched_from_the_store_and_imported(tmp_path):
    store = FileStore(tmp_path / "store")
    store.put({"runs/r/rewards/answer_rewards.py": REWARD_SOURCE.encode()}, message="reward file")
    spec = RewardSpec(name="answer_rewards.py:digits_when_asked", store_path="runs/r/rewards/answer_rewards.py")

    [function], weights = resolve_rewards([spec], store, tmp_path / "reward-files")

    assert function.__name__ == "digits_when_asked" and weights == [1.0]
    assert (tmp_path / "reward-files/runs/r/rewards/answer_rewards.py").read_text() == REWARD_SOURCE


@pytest.mark.parametrize("function, problem", [
    ("missing", "`missing` does not exist in the file"),
    ("not_callable", "`not_callable` is not a function in the file"),
])
def test_a_reward_file_without_the_function_names_the_reward(tmp_path, function, problem):
    store = FileStore(tmp_path / "store")
    store.put({"runs/r/rewards/answer_rewards.py": REWARD_SOURCE.encode()}, message="reward file")
    spec = RewardSpec(name=f"answer_rewards.py:{function}", store_path="runs/r/rewards/answer_rewards.py")
    with pytest.raises(RewardError, match=rf"^reward file `answer_rewards.py:{function}`: {problem}$"):
        resolve_rewards([spec], store, tmp_path / "reward-files")


def test_a_reward_file_that_fails_to_import_names_the_reward_and_the_error(tmp_path):
    store = FileStore(tmp_path / "store")
    store.put({"runs/r/rewards/broken.py": b"import no_such_module_here\n"}, message="reward file")
    spec = RewardSpec(name="rewards/broken.py:score", store_path="runs/r/rewards/broken.py")
    with pytest.raises(RewardError, match=r"^reward file `rewards/broken.py:score`: importing it failed: "
                                          r"ModuleNotFoundError: No module named 'no_such_module_here'"):
        resolve_rewards([spec], store, tmp_path / "reward-files")


def test_a_reward_file_that_was_not_published_is_refused_with_the_fix(tmp_path):
    with pytest.raises(RewardError, match=r"reward file `score.py:score`: it is not in the run's artifact store "
                                          r"\(`store_path` is empty\); start the run with the train flow"):
        resolve_rewards([RewardSpec(name="score.py:score")], FileStore(tmp_path), tmp_path / "reward-files")


def test_grpo_prompts_of_prompt_completion_lines_keep_the_completion_as_the_answer(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = Dataset.from_list([{"prompt": [{"role": "user", "content": "Capital of France?"}],
                               "completion": [{"role": "assistant", "content": "Paris."}]}])
    prompts = prompt_dataset(rows, tokenizer, max_prompt_length=64)
    assert prompts.column_names == ["prompt", "answer"]
    assert prompts[0] == {"prompt": [{"role": "user", "content": "Capital of France?"}], "answer": "Paris."}
