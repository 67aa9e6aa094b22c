"""Pinned inputs: a teammate who can write the shared artifact store cannot change someone else's run.

The control plane sends the sha256 of every file it stored for a run, and the commit that holds them
(`JobInput.inputs`). The worker reads the run's files at that commit, and refuses a file rewritten since; the adapter it
stores comes back with its own hashes (`JobResult.adapter_sha256`), which publishing and merging check (the merge's
refusal: test_worker_merge.py). On a `file://`
store the hashes alone protect the run; on the Hub the commit does too (the local Hub stand-in, started with the
control plane's interpreter, plays the Hub here).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from pydantic import ValidationError
from worker_test_support import hub_stand_in, train_in_process

from loraflow_worker.artifacts import ArtifactChanged, FileStore, open_store
from loraflow_worker.artifacts.pins import folder_sha256, sha256_hex
from loraflow_worker.contract import JobInput, JobResult, StoredInputs
from loraflow_worker.handler import WORK_DIR_ENV, JobFailed, handler
from loraflow_worker.self_test.tiny_model import DEFAULT_CORPUS
from loraflow_worker.training.rewards import RewardError
from loraflow_worker.training.user_files import RunFilesStore

from tests.hub_fixture import HubStandIn

REWARD_SOURCE = "def score(completions, **kwargs):\n    return [min(len(str(c)), 50) / 50 for c in completions]\n"
STOLEN_REWARD = "import os\n\ndef score(completions, **kwargs):\n    print(os.environ)\n    return [0.0] * len(completions)\n"


def stored_run(store_root: Path, run_id: str, files: dict[str, bytes]) -> dict:
    """The run's files put in a `file://` store as the control plane stores them; returns the job's `inputs`."""
    revision = FileStore(store_root).put({f"runs/{run_id}/{path}": data for path, data in files.items()},
                                         message=f"inputs of run {run_id}")
    return StoredInputs(revision=revision, sha256={f"runs/{run_id}/{path}": sha256_hex(data)
                                                   for path, data in files.items()}).model_dump()


def grpo_job(run_id: str, model_dir: Path, store_root: Path) -> dict:
    """A one-step GRPO job whose dataset and reward file the control plane stored and pinned."""
    inputs = stored_run(store_root, run_id, {"dataset/train.jsonl": DEFAULT_CORPUS.read_bytes(),
                                             "rewards/score.py": REWARD_SOURCE.encode()})
    return {"input": {
        "run_id": run_id, "algorithm": "grpo", "model": {"id": str(model_dir)},
        "dataset": {"store_path": f"runs/{run_id}/dataset/train.jsonl"},
        "training": {"max_steps": 1, "batch_size": 4, "learning_rate": 1e-2},
        "grpo": {"num_generations": 4, "max_completion_length": 4,
                 "rewards": [{"name": "rewards/score.py:score", "store_path": f"runs/{run_id}/rewards/score.py"}]},
        "artifact_store": store_root.as_uri(), "inputs": inputs}}


@dataclass
class PinnedRun:
    result: JobResult
    run_dir: Path


@pytest.fixture(scope="module")
def pinned_run(tiny_model_dir, tmp_path_factory) -> PinnedRun:
    """`pinned`: one GRPO step with a reward file, its inputs pinned, trained in this process."""
    store_root = tmp_path_factory.mktemp("store")
    job = grpo_job("pinned", tiny_model_dir, store_root)
    result = train_in_process(job, FileStore(store_root), tmp_path_factory.mktemp("work"), [])
    return PinnedRun(result, store_root / "runs" / "pinned")


def test_a_completed_runs_manifest_holds_the_sha256_of_each_file_it_read(pinned_run):
    manifest = json.loads((pinned_run.run_dir / "manifest.json").read_text())
    assert manifest["input_sha256"] == {
        "runs/pinned/dataset/train.jsonl": sha256_hex(DEFAULT_CORPUS.read_bytes()),
        "runs/pinned/rewards/score.py": sha256_hex(REWARD_SOURCE.encode()),
    }


def test_the_result_holds_the_sha256_of_every_adapter_file_it_stored(pinned_run):
    assert pinned_run.result.adapter_sha256 == folder_sha256(pinned_run.run_dir / "adapter")
    assert "adapter_model.safetensors" in pinned_run.result.adapter_sha256
    assert pinned_run.result.revision is None  # a folder has no revisions


def test_the_stored_result_holds_the_same_adapter_hashes(pinned_run):
    stored = JobResult.model_validate_json((pinned_run.run_dir / "result.json").read_text())
    assert stored.adapter_sha256 == pinned_run.result.adapter_sha256


def test_a_reward_file_rewritten_after_the_run_started_refuses_the_job_naming_it(tiny_model_dir, tmp_path):
    job = grpo_job("rewritten", tiny_model_dir, tmp_path / "store")
    reward = tmp_path / "store" / "runs" / "rewritten" / "rewards" / "score.py"
    reward.write_text(STOLEN_REWARD)  # a teammate's write, after the control plane stored the run's files

    with pytest.raises(RewardError) as refused:
        train_in_process(job, FileStore(tmp_path / "store"), tmp_path / "work", [])

    message = str(refused.value)
    assert message.startswith("reward file `rewards/score.py:score`: runs/rewritten/rewards/score.py changed after the "
                              "control plane stored it for the run (grpo.rewards[0])"), message
    assert sha256_hex(REWARD_SOURCE.encode()) in message and sha256_hex(STOLEN_REWARD.encode()) in message
    assert not (tmp_path / "store" / "runs" / "rewritten" / "DONE").exists()


def test_a_dataset_file_rewritten_after_the_run_started_fails_the_job_naming_it(tiny_model_dir, make_job, tmp_path,
                                                                                monkeypatch):
    store_root = tmp_path / "store"
    job = make_job("swapped", tiny_model_dir, store_root, training={"max_steps": 1})  # stores the dataset file
    dataset = store_root / "runs" / "swapped" / "dataset" / "train.jsonl"
    original = dataset.read_bytes()
    job["input"]["inputs"] = {"sha256": {"runs/swapped/dataset/train.jsonl": sha256_hex(original)}}
    dataset.write_bytes(original.splitlines(keepends=True)[0])  # rewritten after the run started
    monkeypatch.setenv(WORK_DIR_ENV, str(tmp_path / "work"))

    with pytest.raises(JobFailed) as failed:
        handler(job)

    assert ("ArtifactChanged: runs/swapped/dataset/train.jsonl changed after the control plane stored it for the run "
            "(dataset)") in str(failed.value), failed.value
    assert sha256_hex(original) in str(failed.value)
    assert not (store_root / "runs" / "swapped" / "DONE").exists()


def test_a_job_naming_a_stored_file_without_its_hash_is_refused_naming_the_field():
    with pytest.raises(ValidationError) as refused:
        JobInput(run_id="r", model={"id": "m"}, dataset={"store_path": "runs/r/dataset/train.jsonl"},
                 evaluation={"store_path": "runs/r/dataset/eval.jsonl"}, artifact_store="file:///s",
                 inputs={"sha256": {"runs/r/dataset/train.jsonl": "0" * 64}})
    [error] = refused.value.errors()
    assert error["loc"] == ("inputs",) and "no sha256 for evaluation (runs/r/dataset/eval.jsonl)" in error["msg"]


# -- on the Hub: the run's files are read at the commit the control plane made ------------------------------------


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> Iterator[HubStandIn]:
    with hub_stand_in(tmp_path_factory.mktemp("hub") / "data") as stand_in:
        yield stand_in


def test_on_the_hub_a_file_rewritten_after_the_run_started_is_read_as_the_control_plane_stored_it(hub, tmp_path):
    store = open_store("hf://datasets/acme/shared-runs", token=hub.token, endpoint=hub.url,
                       cache_dir=tmp_path / "cache")
    reward_path = "runs/h1/rewards/score.py"
    revision = store.put({reward_path: REWARD_SOURCE.encode()}, message="inputs of run h1")
    store.put({reward_path: STOLEN_REWARD.encode()}, message="a teammate's rewrite")
    job = JobInput(run_id="h1", algorithm="grpo", model={"id": "m"}, dataset={"hub_id": "org/prompts"},
                   grpo={"rewards": [{"name": "rewards/score.py:score", "store_path": reward_path}]},
                   artifact_store=store.url,
                   inputs={"revision": revision, "sha256": {reward_path: sha256_hex(REWARD_SOURCE.encode())}})

    assert RunFilesStore(store, job).read_bytes(reward_path) == REWARD_SOURCE.encode()


def test_on_the_hub_a_pin_that_does_not_match_its_commit_is_refused(hub, tmp_path):
    store = open_store("hf://datasets/acme/shared-runs-2", token=hub.token, endpoint=hub.url,
                       cache_dir=tmp_path / "cache")
    path = "runs/h2/dataset/train.jsonl"
    revision = store.put({path: b'{"text": "a"}\n'}, message="inputs of run h2")
    job = JobInput(run_id="h2", model={"id": "m"}, dataset={"store_path": path}, artifact_store=store.url,
                   inputs={"revision": revision, "sha256": {path: sha256_hex(b'{"text": "b"}\n')}})
    with pytest.raises(ArtifactChanged, match=f"{path} changed after the control plane stored it"):
        RunFilesStore(store, job).read_bytes(path)

