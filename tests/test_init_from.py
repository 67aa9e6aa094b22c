"""`lora.init_from` before renting: the parent adapter must be there and fit the run's base model; its shape becomes
the run's, and a different shape set in the run is refused naming both."""

from __future__ import annotations

import json

import pytest
from loraflow_worker.contract import LoraSettings, ModelSource

from tasks.settings import Settings
from tasks.storage.init_from import adopt_parent_adapter, read_parent_config
from tasks.storage.publish import CardFacts, model_card
from tests.hub_fixture import hub  # noqa: F401

BASE = ModelSource(id="/models/tiny", revision=None)
CONFIG = {"base_model_name_or_path": "/models/tiny", "r": 8, "lora_alpha": 16, "use_dora": False,
          "use_rslora": False, "target_modules": ["v_proj", "q_proj"], "peft_type": "LORA"}


def test_the_parent_adapters_shape_becomes_the_runs():
    lora = adopt_parent_adapter(LoraSettings(init_from="runs/r1"), BASE, CONFIG)
    assert (lora.rank, lora.alpha, lora.target_modules) == (8, 16, ["q_proj", "v_proj"])
    assert lora.init_from == "runs/r1"


def test_a_different_shape_set_in_the_run_is_refused_naming_both():
    with pytest.raises(ValueError, match=r"sets lora.rank 32 \(the adapter has 8\); lora.use_dora True \(the "
                                         r"adapter has False\): remove those settings"):
        adopt_parent_adapter(LoraSettings(init_from="runs/r1", rank=32, use_dora=True), BASE, CONFIG)


def test_an_adapter_of_another_base_is_refused():
    with pytest.raises(ValueError, match=r"was trained on '/models/tiny', not on model.id 'org/other'"):
        adopt_parent_adapter(LoraSettings(init_from="runs/r1"), ModelSource(id="org/other", revision="a" * 40), CONFIG)


def test_an_earlier_runs_adapter_is_read_from_the_store_and_a_missing_one_refused(tmp_path):
    (tmp_path / "runs/r1/adapter").mkdir(parents=True)
    (tmp_path / "runs/r1/adapter/adapter_config.json").write_text(json.dumps(CONFIG))
    assert read_parent_config("runs/r1", tmp_path.as_uri(), Settings()) == CONFIG
    with pytest.raises(ValueError, match=r"lora.init_from 'runs/r2': no adapter there in artifact_store file://"):
        read_parent_config("runs/r2", tmp_path.as_uri(), Settings())


def test_the_model_card_names_the_parent_adapter():
    facts = CardFacts(hub_model_id="acme/child", run_id="r2", run_name="child", base_model="acme/base",
                      base_model_revision=None, algorithm="sft", dataset_hub_id=None, dataset_mix=[],
                      lora={"rank": 8, "init_from": "runs/r1"}, training={}, grpo=None, metrics={}, has_curve=False)
    card = model_card(facts)
    assert "Training went on from the adapter `runs/r1` (an earlier run in the same artifact store" in card
    assert "| lora.init_from | `runs/r1` |" in card


def test_a_hub_adapters_config_is_read_with_the_runs_token_and_a_missing_repo_refused(hub):  # noqa: F811
    from huggingface_hub import HfApi
    from pydantic import SecretStr

    settings = Settings(hf_endpoint=hub.url, hf_token=SecretStr(hub.token))
    api = HfApi(endpoint=hub.url, token=hub.token)
    api.create_repo("acme/parent-lora")
    api.upload_file(repo_id="acme/parent-lora", path_or_fileobj=json.dumps(CONFIG).encode(),
                    path_in_repo="adapter_config.json", commit_message="adapter")
    assert read_parent_config("acme/parent-lora", "file:///unused", settings) == CONFIG
    with pytest.raises(ValueError, match=r"lora.init_from 'acme/no-such-lora': no adapter there in the Hub"):
        read_parent_config("acme/no-such-lora", "file:///unused", settings)
