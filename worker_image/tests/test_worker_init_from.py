"""Starting from an adapter (`lora.init_from`): a run that goes on from an earlier run's stored adapter starts from a
much lower loss than that run did, its adapter has the parent's shape, and an adapter of another base is refused."""

from __future__ import annotations

import json
import shutil

import pytest
from worker_test_support import CountingStore, train_in_process

from loraflow_worker.artifacts import open_store
from loraflow_worker.contract import JobInput
from loraflow_worker.training.sft import train_sft

LORA = {"rank": 8, "alpha": 16}


@pytest.fixture(scope="module")
def parent(make_job, tiny_model_dir, tmp_path_factory):
    """`run-parent`: 30 steps from a new adapter, published to its store as every run is."""
    store = CountingStore(tmp_path_factory.mktemp("store"))
    job = make_job("run-parent", tiny_model_dir, store.root, lora=LORA,
                   training={"max_steps": 30, "learning_rate": 1e-2, "batch_size": 8})
    result = train_in_process(job, store, tmp_path_factory.mktemp("work"), [])
    return store, result.metrics


def test_a_run_from_an_earlier_runs_adapter_starts_from_a_much_lower_loss(make_job, tiny_model_dir, parent,
                                                                           tmp_path):
    store, first = parent
    job = make_job("run-child", tiny_model_dir, store.root, lora={**LORA, "init_from": "runs/run-parent"},
                   training={"max_steps": 5, "learning_rate": 1e-2, "batch_size": 8})
    result = train_in_process(job, store, tmp_path, [])
    assert result.metrics.first_loss < 0.6 * first.first_loss, (result.metrics.first_loss, first.losses)
    stored = json.loads((store.root / "runs/run-child/adapter/adapter_config.json").read_text())
    assert (stored["r"], stored["lora_alpha"]) == (8, 16)
    manifest = json.loads((store.root / "runs/run-child/manifest.json").read_text())
    assert manifest["job"]["lora"]["init_from"] == "runs/run-parent"


def test_an_adapter_of_another_base_model_is_refused_naming_both(make_job, tiny_model_dir, parent, tmp_path):
    store, _ = parent
    other = shutil.copytree(tiny_model_dir, tmp_path / "other-base")
    job = JobInput.model_validate(make_job("run-other", other, store.root, lora={**LORA, "init_from": "runs/run-parent"},
                                           training={"max_steps": 2})["input"])
    with pytest.raises(ValueError, match=rf"lora.init_from 'runs/run-parent' was trained on '{tiny_model_dir}', not "
                                         rf"on model.id '{other}'"):
        train_sft(job, open_store(job.artifact_store), tmp_path / "work", lambda progress: None)


def test_a_run_with_no_adapter_there_is_refused_naming_the_field(make_job, tiny_model_dir, parent, tmp_path):
    store, _ = parent
    job = JobInput.model_validate(make_job("run-none", tiny_model_dir, store.root,
                                           lora={**LORA, "init_from": "runs/no-such-run"},
                                           training={"max_steps": 2})["input"])
    with pytest.raises(ValueError, match=r"lora.init_from 'runs/no-such-run' holds no adapter_config.json"):
        train_sft(job, open_store(job.artifact_store), tmp_path / "work", lambda progress: None)


def test_a_new_adapters_init_with_init_from_is_refused():
    with pytest.raises(ValueError, match=r"`lora.init` 'pissa' initialises a new adapter, but `lora.init_from`"):
        JobInput.model_validate({"run_id": "r", "model": {"id": "m"}, "dataset": {"store_path": "d"},
                                 "artifact_store": "file:///s", "lora": {"init": "pissa", "init_from": "org/adapter"}})
