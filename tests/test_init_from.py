"""`lora.init_from` before renting: a value that names neither a run of the store nor a Hub repo is refused by the
spec, naming the field and the forms it takes; the parent adapter must be there and fit the run's base model; its
shape becomes the run's, and a different shape set in the run is refused naming both."""

from __future__ import annotations

import json

import pytest
from loraflow_worker.contract import LoraSettings, ModelSource
from pydantic import ValidationError

from tasks.settings import Settings
from tasks.storage.init_from import adopt_parent_adapter, read_parent_config
from tasks.storage.publish import CardFacts, model_card
from tests.hub_fixture import hub  # noqa: F401

BASE = ModelSource(id="/models/tiny", revision=None)
CONFIG = {"base_model_name_or_path": "/models/tiny", "r": 8, "lora_alpha": 16, "use_dora": False,
          "use_rslora": False, "target_modules": ["v_proj", "q_proj"], "peft_type": "LORA"}
BAD_VALUES = ["runs/.", "runs/..", "runs/", "runs/../x", "runs/a/b", "runs/.hidden", "org/a..b", "org/a--b",
              "/home/alice/adapter", "adapter"]
FORMS = ("give an earlier run of this run's artifact store, `runs/<flow run id>`, or a PEFT adapter on the Hub, "
         "`<org>/<name>`")


@pytest.mark.parametrize("value", BAD_VALUES)
def test_a_value_naming_neither_a_run_nor_a_hub_repo_is_refused_by_the_run_spec_naming_the_field_and_the_forms(value):
    from flows.forms.run import RunSpec
    from tests.test_spec import minimal

    with pytest.raises(ValidationError) as refused:
        RunSpec.model_validate(minimal(lora={"init_from": value}))
    [error] = refused.value.errors()
    assert error["loc"] == ("lora", "init_from")
    assert error["msg"].startswith(f"Value error, `lora.init_from` {value!r} ") and FORMS in error["msg"]


@pytest.mark.parametrize("value", BAD_VALUES)
def test_the_jobs_lora_section_refuses_the_same_values(value):
    with pytest.raises(ValidationError, match=r"`lora.init_from` .* give an earlier run"):
        LoraSettings(init_from=value)


@pytest.mark.parametrize("value", ["runs/6f1c2d3e-9a7b-4c1d-8e2f-0a1b2c3d4e5f", "acme/qwen3-sft-lora", "a/b.c_d-1"])
def test_a_run_or_a_hub_repo_is_taken(value):
    assert LoraSettings(init_from=value).init_from == value


def test_a_malformed_value_is_refused_before_the_store_is_read(tmp_path):
    with pytest.raises(ValueError, match=r"^`lora.init_from` 'runs/\.' is not one run of the store"):
        read_parent_config("runs/.", tmp_path.as_uri(), Settings())


def test_a_store_that_cannot_be_read_is_refused_naming_the_field_and_the_store():
    with pytest.raises(ValueError, match=r"^lora.init_from 'runs/r1': its adapter_config.json cannot be read from "
                                         r"artifact_store s3://bucket/store: bad store URL"):
        read_parent_config("runs/r1", "s3://bucket/store", Settings())


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


def test_an_adapter_on_the_lm_head_is_refused_naming_its_target_modules():
    # Its shape would become the run's, past `lora.target_modules`' own check; TRL would refuse it on the rented GPU.
    with pytest.raises(ValueError, match=r"lora.init_from 'org/head-adapter''s `target_modules` names lm_head, which "
                                         r"LoRA cannot adapt here .*: start a new adapter"):
        adopt_parent_adapter(LoraSettings(init_from="org/head-adapter"), BASE,
                             {**CONFIG, "target_modules": ["q_proj", "lm_head"]})


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
