"""Jobs the worker refuses before touching the store or the model, and errors that must not leak secrets."""

from __future__ import annotations

import pytest

from loraflow_worker.contract import CONTRACT_VERSION
from loraflow_worker.handler import JobFailed, JobRefused, handler


def _job(**input_fields) -> dict:
    job_input = {
        "contract_version": CONTRACT_VERSION,
        "run_id": "r1",
        "model": {"id": "/nonexistent/model"},
        "dataset": {"store_path": "runs/r1/dataset/train.jsonl"},
        "artifact_store": "file:///nonexistent/store",
    }
    job_input.update(input_fields)
    return {"id": "job-1", "input": {k: v for k, v in job_input.items() if v is not None}}


def test_wrong_contract_version_is_refused_with_the_fix():
    with pytest.raises(JobRefused) as refused:
        handler(_job(contract_version=CONTRACT_VERSION + 1))
    assert str(refused.value) == (
        f"worker speaks contract version {CONTRACT_VERSION}, job has version {CONTRACT_VERSION + 1}: "
        "deploy a matching worker image"
    )


def test_missing_contract_version_is_refused():
    with pytest.raises(JobRefused, match="job has version none: deploy a matching worker image"):
        handler(_job(contract_version=None))


def test_job_missing_run_id_is_refused_naming_the_field():
    with pytest.raises(JobRefused, match=r"invalid job input: `run_id`: Field required"):
        handler(_job(run_id=None))


def test_invalid_nested_field_is_named_with_its_path():
    with pytest.raises(JobRefused, match=r"`training.learning_rate`: Input should be greater than 0"):
        handler(_job(training={"learning_rate": 0}))


def test_refusal_touches_nothing(tmp_path):
    store = tmp_path / "store"
    with pytest.raises(JobRefused):
        handler(_job(contract_version=CONTRACT_VERSION + 1, artifact_store=store.as_uri()))
    assert not store.exists()


def test_secrets_in_an_error_are_redacted(monkeypatch):
    secret = "hf_abcdefghijklmnopqrstuvwxyz0123"
    monkeypatch.setenv("HF_TOKEN", secret)
    with pytest.raises(JobFailed) as failed:
        handler(_job(contract_version=f"v-{secret}"))
    assert secret not in str(failed.value)
    assert f"JobRefused: worker speaks contract version {CONTRACT_VERSION}, job has version v-***: deploy" in str(failed.value)
    assert failed.value.__cause__ is None and failed.value.__suppress_context__  # no chained original


def test_sft_only_loss_settings_are_refused_for_grpo_naming_them():
    grpo = {"rewards": [{"name": "exact_match", "column": "answer"}], "num_generations": 4}
    with pytest.raises(JobRefused, match=r"`training.loss_on`, `training.chat_template`: sft only"):
        handler(_job(algorithm="grpo", grpo=grpo, training={"loss_on": "all", "chat_template": "qwen3_training"}))


def test_a_chat_template_that_is_neither_a_file_nor_a_trl_template_is_refused_with_the_names():
    with pytest.raises(JobRefused, match=r"'chatml' is neither a `.jinja` file nor one of TRL's training templates: "
                                         r"cohere2_training, .*qwen3_training"):
        handler(_job(training={"chat_template": "chatml"}))
