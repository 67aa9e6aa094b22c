"""A reward of your own in a local file (`path/to/file.py:function`) ships with the run: the control plane checks
it without running it, uploads it to the run's store with the dataset in one commit, and points the reward at
the stored copy (`store_path`) for the worker. A missing file or function is refused naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from loraflow_worker.artifacts import FileStore
from loraflow_worker.contract import RewardSpec
from pydantic import ValidationError

from tasks.storage.artifacts import publish_run_inputs
from tasks.storage.rewards import check_reward_files
from tasks.storage.run_files import RunFile, read_run_files

REWARD_SOURCE = '''
import math

def boxed(completions, answer, **kwargs):
    return [1.0 if f"[{a}]" in c else 0.0 for c, a in zip(completions, answer)]

async def later(completions, **kwargs):
    return [0.0] * len(completions)

shorter = lambda completions, **kwargs: [-len(c) for c in completions]
'''


class CountingStore(FileStore):
    """A FileStore that records its commits' messages (each `put` is one commit on the Hub)."""

    def __init__(self, root: Path):
        super().__init__(root)
        self.commits: list[str] = []

    def put(self, files, *, message, **kwargs):
        self.commits.append(message)
        return super().put(files, message=message, **kwargs)


def read(rewards: list[RewardSpec], run_dir: Path, dataset: Path | None = None) -> dict[str, RunFile]:
    """The run's files as `check` reads them once (relative paths start at `run_dir`)."""
    paths = [(f"grpo.rewards[{i}].name", r.name.rsplit(":", 1)[0]) for i, r in enumerate(rewards) if ":" in r.name]
    if dataset is not None:
        paths.append(("dataset.local_file", str(dataset)))
    return read_run_files(paths, run_dir / ".read", base_dir=run_dir)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    (tmp_path / "rewards").mkdir()
    (tmp_path / "rewards" / "math_rewards.py").write_text(REWARD_SOURCE)
    (tmp_path / "data.jsonl").write_text(json.dumps({"prompt": [{"role": "user", "content": "2+2?"}], "answer": "4"}) + "\n")
    return tmp_path


def test_a_reward_file_is_published_with_the_dataset_in_one_commit_and_rewritten(run_dir, tmp_path, monkeypatch):
    store_root = tmp_path / "store"
    store = CountingStore(store_root)
    monkeypatch.setattr("tasks.storage.artifacts.open_store", lambda url, token=None: store)
    rewards = [RewardSpec(name="rewards/math_rewards.py:boxed", weight=2.0), RewardSpec(name="digit_fraction")]

    dataset_path, published, _ = publish_run_inputs(store_root.as_uri(), "run-1",
                                                    read(rewards, run_dir, run_dir / "data.jsonl"), rewards)

    assert dataset_path == "runs/run-1/dataset/train.jsonl"
    assert published == [
        RewardSpec(name="rewards/math_rewards.py:boxed", weight=2.0, store_path="runs/run-1/rewards/math_rewards.py"),
        RewardSpec(name="digit_fraction"),
    ]
    assert (store_root / "runs/run-1/rewards/math_rewards.py").read_text() == REWARD_SOURCE
    assert (store_root / dataset_path).read_bytes() == (run_dir / "data.jsonl").read_bytes()
    assert store.commits == ["dataset and reward files for run run-1"]


def test_rewards_naming_one_file_share_its_copy_and_different_files_of_one_name_do_not_collide(run_dir, tmp_path):
    (run_dir / "other").mkdir()
    (run_dir / "other" / "math_rewards.py").write_text("def boxed(completions, **kw):\n    return [0.0] * len(completions)\n")
    rewards = [RewardSpec(name="rewards/math_rewards.py:boxed"), RewardSpec(name="rewards/math_rewards.py:shorter"),
               RewardSpec(name=f"{run_dir}/other/math_rewards.py:boxed")]

    _, published, _ = publish_run_inputs((tmp_path / "store").as_uri(), "r", read(rewards, run_dir), rewards)

    assert [r.store_path for r in published] == ["runs/r/rewards/math_rewards.py", "runs/r/rewards/math_rewards.py",
                                                 "runs/r/rewards/math_rewards-2.py"]
    assert "return [0.0]" in (tmp_path / "store/runs/r/rewards/math_rewards-2.py").read_text()


def test_relative_reward_files_start_at_the_base_folder(run_dir):
    rewards = [RewardSpec(name="numeric_match", column="answer"), RewardSpec(name="rewards/math_rewards.py:later")]
    assert {i: file.location for i, file in check_reward_files(rewards, read(rewards, run_dir)).items()} == {
        1: run_dir / "rewards" / "math_rewards.py"}


def test_a_missing_reward_file_is_refused_naming_the_field_before_anything_is_stored(run_dir, tmp_path):
    rewards = [RewardSpec(name="digit_fraction"), RewardSpec(name="rewards/nope.py:boxed")]
    with pytest.raises(ValueError, match=r"^grpo.rewards\[1\].name rewards/nope.py \(.*nope.py\) does not exist"):
        read(rewards, run_dir, run_dir / "data.jsonl")
    assert not (tmp_path / "store").exists()


def test_a_reward_file_without_the_function_is_refused_naming_the_functions_it_has(run_dir):
    rewards = [RewardSpec(name="rewards/math_rewards.py:boxd")]
    with pytest.raises(ValueError, match=r"^grpo.rewards\[0\].name `rewards/math_rewards.py:boxd`: reward file .* defines "
                                         r"no top-level function `boxd` \(its functions: `boxed`, `later`\)"):
        check_reward_files(rewards, read(rewards, run_dir))


def test_a_reward_file_is_parsed_not_run(run_dir):
    (run_dir / "rewards" / "loud.py").write_text("raise SystemExit('ran on the control plane')\ndef score(**kw):\n    pass\n")
    rewards = [RewardSpec(name="rewards/loud.py:score")]
    assert check_reward_files(rewards, read(rewards, run_dir))


def test_a_reward_file_that_is_not_python_is_refused_naming_the_line(run_dir):
    (run_dir / "rewards" / "broken.py").write_text("def score(completions):\n    return [\n")
    rewards = [RewardSpec(name="rewards/broken.py:score")]
    with pytest.raises(ValueError, match=r"grpo.rewards\[0\].name `rewards/broken.py:score`: reward file .* is not valid "
                                         r"Python, line 2"):
        check_reward_files(rewards, read(rewards, run_dir))


def test_the_name_needs_the_py_suffix_and_store_path_is_for_reward_files_only():
    assert RewardSpec(name="rewards.py:score").name == "rewards.py:score"  # a file, not the module `py`
    with pytest.raises(ValidationError, match=r"unknown reward `rewards/math:score`: .* `path/to/file.py:function` for a "
                                              r"reward file"):
        RewardSpec(name="rewards/math:score")
    with pytest.raises(ValidationError, match=r"`store_path` is for reward files .* only: remove it"):
        RewardSpec(name="digit_fraction", store_path="runs/r/rewards/x.py")
    with pytest.raises(ValidationError, match=r"store_path"):
        RewardSpec(name="x.py:score", store_path="../../etc/x.py")

