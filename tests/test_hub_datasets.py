"""A run's Hub datasets are checked before anything is rented, against the Hub stand-in: the revision and config
exist (configs as the README's `configs:` declares them), the split exists, the revision is pinned to its commit, and
the first rows of a JSONL file convert (`format`, `columns`) into what the algorithm trains on. Each refusal names the
spec field, and for a row the file, the line and the field in it."""

from __future__ import annotations

import json

import pytest
from huggingface_hub import HfApi
from loraflow_worker.contract import SourceFields
from pydantic import SecretStr

from tasks.settings import Settings
from tasks.storage.hub_datasets import check_hub_dataset
from tests.hub_fixture import hub  # noqa: F401

ALPACA = [{"instruction": f"Add {n} and {n}.", "input": "", "output": str(2 * n)} for n in range(30)]
SHAREGPT = [{"conversations": [{"from": "human", "value": f"Say {n}."}, {"from": "gpt", "value": str(n)}]}
            for n in range(5)]
CONFIGS_CARD = """---
configs:
- config_name: easy
  data_files:
  - split: train
    path: easy/train-*.jsonl
- config_name: chats
  data_files: chats/*.jsonl
---
# Two configs
"""


def jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(row) + "\n" for row in rows).encode()


@pytest.fixture(scope="module")
def settings(hub) -> Settings:  # noqa: F811
    return Settings(hf_endpoint=hub.url, hf_token=SecretStr(hub.token))


@pytest.fixture(scope="module")
def repos(hub) -> dict[str, str]:  # noqa: F811
    """`org/configs`: two declared configs; `org/plain`: files only, a `v1` commit then a second with a bad row."""
    api = HfApi(endpoint=hub.url, token=hub.token)
    api.create_repo("org/configs", repo_type="dataset")
    for path, data in {"README.md": CONFIGS_CARD.encode(), "easy/train-0.jsonl": jsonl(ALPACA),
                       "chats/all.jsonl": jsonl(SHAREGPT)}.items():
        api.upload_file(path_or_fileobj=data, path_in_repo=path, repo_id="org/configs", repo_type="dataset")
    api.create_repo("org/plain", repo_type="dataset")
    first = api.upload_file(path_or_fileobj=jsonl(ALPACA), path_in_repo="data/train.jsonl", repo_id="org/plain",
                            repo_type="dataset").oid
    api.upload_file(path_or_fileobj=jsonl(ALPACA[:3] + [{"instruction": "Q", "input": "", "output": 4}]),
                    path_in_repo="data/train.jsonl", repo_id="org/plain", repo_type="dataset")
    return {"plain@v1": first}


def hub_source(hub_id: str, **fields) -> SourceFields:
    return SourceFields(hub_id=hub_id, **fields)


def test_a_declared_config_is_loaded_and_its_first_rows_are_converted_and_checked(repos, settings):
    checked = check_hub_dataset(hub_source("org/configs", config="easy", format="alpaca"), "dataset", "sft",
                                settings)
    assert (checked.config, checked.rows_checked, checked.checked_file) == ("easy", 20, "easy/train-0.jsonl")
    assert checked.trl_format == "prompt-completion"
    assert len(checked.sha) == 40


def test_a_config_of_a_list_of_files_is_its_train_split(repos, settings):
    checked = check_hub_dataset(hub_source("org/configs", config="chats", format="sharegpt"), "dataset.mix[1]",
                                "sft", settings)
    assert (checked.rows_checked, checked.checked_file) == (len(SHAREGPT), "chats/all.jsonl")


def test_a_config_the_dataset_does_not_declare_is_refused_naming_its_configs(repos, settings):
    with pytest.raises(ValueError, match=r"^dataset.mix\[0\].config 'hard' is not a config of org/configs; its configs "
                                         r"\(the README's `configs:`\): easy, chats$"):
        check_hub_dataset(hub_source("org/configs", config="hard"), "dataset.mix[0]", "sft", settings)


def test_no_config_where_there_are_several_without_a_default_is_refused_naming_them(repos, settings):
    with pytest.raises(ValueError, match=r"^dataset.config is empty, and org/configs has several configs and no "
                                         r"default: set dataset.config to one of easy, chats$"):
        check_hub_dataset(hub_source("org/configs"), "dataset", "sft", settings)


def test_a_split_the_config_does_not_have_is_refused_naming_its_splits(repos, settings):
    with pytest.raises(ValueError, match=r"^dataset.split 'test': org/configs has no split 'test'; its splits \(as the "
                                         r"README's config easy declares them\): train$"):
        check_hub_dataset(hub_source("org/configs", config="easy", split="test"), "dataset", "sft", settings)


def test_a_config_of_a_dataset_that_declares_none_is_refused(repos, settings):
    with pytest.raises(ValueError, match=r"^dataset.config 'main': org/plain declares no configs"):
        check_hub_dataset(hub_source("org/plain", config="main", format="alpaca"), "dataset", "sft", settings)


def test_a_revision_is_pinned_to_its_commit_and_its_rows_are_the_ones_checked(repos, settings):
    checked = check_hub_dataset(hub_source("org/plain", revision=repos["plain@v1"], format="alpaca"), "dataset",
                                "sft", settings, first_rows=5)
    assert checked.sha == repos["plain@v1"] and checked.rows_checked == 5


def test_a_bad_row_at_the_default_branch_is_refused_naming_the_source_file_line_and_field(repos, settings):
    with pytest.raises(ValueError, match=r"^dataset \(hub org/plain, split train\), file data/train.jsonl, line 4: "
                                         r"`output`: not text \(a int\) \(format alpaca\)$"):
        check_hub_dataset(hub_source("org/plain", format="alpaca"), "dataset", "sft", settings)


def test_columns_the_rows_do_not_have_are_refused_naming_the_datasets_own_name(repos, settings):
    source = hub_source("org/plain", revision=repos["plain@v1"], format="alpaca", columns={"output": "answer"})
    with pytest.raises(ValueError, match=r"line 1: `answer`: missing or empty \(format alpaca\)$"):
        check_hub_dataset(source, "dataset", "sft", settings)


def test_a_revision_that_does_not_exist_is_refused_naming_the_field(repos, settings):
    with pytest.raises(ValueError,
                       match=r"^dataset.mix\[2\].revision 'v9' is not a branch, tag or commit of org/plain$"):
        check_hub_dataset(hub_source("org/plain", revision="v9"), "dataset.mix[2]", "sft", settings)


def test_a_dataset_that_does_not_exist_is_refused_naming_the_field(repos, settings):
    with pytest.raises(ValueError, match=r"^dataset.hub_id 'org/nothing': no such dataset on the Hub"):
        check_hub_dataset(hub_source("org/nothing"), "dataset", "sft", settings)
