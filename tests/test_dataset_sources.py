"""Data as people have it, in the control plane: the run form's `format`, `columns`, `config`, `revision` and
`[[dataset.mix]]` are validated, local files in Alpaca or ShareGPT format are converted and checked line by line with
the worker's own conversion before anything is rented (a refusal names the source, the line and the field), mix
files are published with the run, and the job names every source as the worker will load it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from loraflow_worker.contract import JobInput
from loraflow_worker.contract.dataset_formats import mixed_format
from pydantic import ValidationError

from flows.forms.run import RunSpec, SpecError, load_run_file
from flows.train_check import _job_input, job_dataset
from tasks.storage.artifacts import check_dataset_jsonl, first_row_format, mix_store_path, publish_run_inputs
from tasks.storage.hub_datasets import HubDataset
from tasks.storage.run_files import read_run_files

ALPACA = {"instruction": "Add 2 and 2.", "input": "", "output": "4"}
SHAREGPT = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]}
BASE = {"model": {"id": "org/model"}, "artifact_store": "file:///tmp/store"}


def jsonl(path: Path, *rows: dict) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def spec(dataset: dict, **fields) -> RunSpec:
    return RunSpec.model_validate({**BASE, "dataset": dataset, **fields})


def refusal(dataset: dict, **fields) -> str:
    with pytest.raises(ValueError) as refused:
        spec(dataset, **fields)
    return str(refused.value)


def test_a_run_file_with_a_mix_of_an_alpaca_file_and_a_hub_subset_loads(tmp_path):
    run_file = tmp_path / "run.toml"
    run_file.write_text('artifact_store = "file:///tmp/store"\n[model]\nid = "org/model"\n'
                        '[[dataset.mix]]\nlocal_file = "alpaca.jsonl"\nformat = "alpaca"\n'
                        'columns = {instruction = "question", output = "answer"}\nfraction = 0.3\n'
                        '[[dataset.mix]]\nhub_id = "openai/gsm8k"\nconfig = "main"\nrevision = "v1"\nfraction = 0.7\n')
    first, second = load_run_file(run_file).dataset.mix
    assert (first.format, first.columns, first.fraction) == ("alpaca", {"instruction": "question", "output": "answer"},
                                                             0.3)
    assert (second.hub_id, second.config, second.revision, second.split) == ("openai/gsm8k", "main", "v1", "train")


def test_mix_fractions_that_do_not_sum_to_one_are_refused_with_their_sum():
    assert "must sum to 1; these sum to 0.9 (0.3, 0.6)" in refusal(
        {"mix": [{"hub_id": "a/b", "fraction": 0.3}, {"local_file": "x.jsonl", "fraction": 0.6}]})


@pytest.mark.parametrize("fraction", [0.0, 1.5])
def test_a_fraction_outside_zero_to_one_is_refused_naming_the_entry(fraction):
    with pytest.raises(ValidationError) as refused:
        spec({"mix": [{"hub_id": "a/b", "fraction": fraction}, {"hub_id": "c/d", "fraction": 0.5}]})
    assert [e["loc"] for e in refused.value.errors()] == [("dataset", "mix", 0, "fraction")]


def test_a_mix_and_a_top_level_source_together_are_refused():
    assert "`dataset.hub_id` beside `dataset.mix`" in refusal(
        {"hub_id": "a/b", "mix": [{"hub_id": "a/b", "fraction": 0.5}, {"hub_id": "c/d", "fraction": 0.5}]})


def test_a_mix_of_one_source_is_refused():
    assert "a mix needs at least 2 sources" in refusal({"mix": [{"hub_id": "a/b", "fraction": 1.0}]})


def test_columns_the_format_does_not_have_are_refused_naming_its_names():
    assert ("`columns` names `messages`, which format `alpaca` does not have; its names are `instruction`, `input`, "
            "`output`, `system`") in refusal({"hub_id": "a/b", "format": "alpaca", "columns": {"messages": "chat"}})


def test_a_hub_config_or_revision_on_a_local_file_is_refused():
    assert "`config` applies to a Hub dataset (`hub_id`) only" in refusal({"local_file": "x.jsonl", "config": "main"})


def test_an_evaluation_format_without_an_evaluation_file_is_refused():
    assert "`evaluation.format` and `evaluation.columns` describe `evaluation.local_file`" in refusal(
        {"hub_id": "a/b"}, evaluation={"fraction": 0.1, "format": "alpaca"})


def test_an_alpaca_file_is_converted_and_counted(tmp_path):
    assert check_dataset_jsonl(jsonl(tmp_path / "a.jsonl", ALPACA, ALPACA, ALPACA), "sft", data_format="alpaca") == 3


def test_a_sharegpt_file_trains_sft_and_grpo(tmp_path):
    path = jsonl(tmp_path / "s.jsonl", SHAREGPT, SHAREGPT)
    assert check_dataset_jsonl(path, "sft", data_format="sharegpt") == check_dataset_jsonl(
        path, "grpo", data_format="sharegpt") == 2


def test_an_unknown_sharegpt_speaker_is_refused_naming_the_mix_entry_the_line_and_the_field(tmp_path):
    bad = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "bot", "value": "Hello"}]}
    path = jsonl(tmp_path / "s.jsonl", SHAREGPT, bad)
    with pytest.raises(ValueError) as refused:
        check_dataset_jsonl(path, "sft", "dataset.mix[1].local_file", "sharegpt")
    assert str(refused.value).startswith(f"dataset.mix[1].local_file {path}, line 2: `conversations[1].from`: 'bot' "
                                         "is not a speaker loraflow knows; use one of human, user, gpt, assistant, "
                                         "system, tool")


def test_a_missing_mapped_column_is_refused_by_the_datasets_own_name(tmp_path):
    path = jsonl(tmp_path / "qa.jsonl", {"question": "Q?", "reply": "A."})
    with pytest.raises(ValueError, match=r"line 1: `answer`: missing or empty \(format alpaca\)"):
        check_dataset_jsonl(path, "sft", data_format="alpaca", columns={"instruction": "question", "output": "answer"})


def test_a_renamed_messages_column_that_is_not_a_chat_is_named_as_the_dataset_names_it(tmp_path):
    path = jsonl(tmp_path / "c.jsonl", {"conversation": "just text"})
    with pytest.raises(ValueError, match=r"line 1: `conversation` \(as `messages`\) is not a non-empty list"):
        check_dataset_jsonl(path, "sft", columns={"messages": "conversation"})


def test_mix_files_are_published_with_the_dataset_in_one_commit(tmp_path):
    first, second = jsonl(tmp_path / "a.jsonl", ALPACA), jsonl(tmp_path / "s.jsonl", SHAREGPT)
    store = tmp_path / "store"
    files = read_run_files([("dataset.mix[0].local_file", str(first)), ("dataset.mix[2].local_file", str(second))],
                           tmp_path / "read", base_dir=tmp_path)
    dataset_path, _, _ = publish_run_inputs(store.as_uri(), "r1", files, [])
    assert dataset_path is None
    assert (store / mix_store_path("r1", 0)).read_bytes() == first.read_bytes()
    assert (store / mix_store_path("r1", 2)).read_bytes() == second.read_bytes()


def test_the_job_names_each_mix_entry_as_the_worker_loads_it_with_hub_revisions_pinned():
    run = spec({"mix": [
        {"local_file": "a.jsonl", "format": "alpaca", "columns": {"output": "answer"}, "fraction": 0.25},
        {"hub_id": "org/chats", "config": "main", "format": "sharegpt", "split": "train[:100]", "fraction": 0.75}]})
    pinned = {"dataset.mix[1]": HubDataset(field="dataset.mix[1]", sha="c" * 40, config="main", rows_checked=20)}

    job = _job_input(run, "r1", 0.0, run.model, job_dataset(run, "r1", None, pinned), [])

    first, second = JobInput.model_validate(job.model_dump(mode="json")).dataset.mix
    assert (first.store_path, first.format, first.columns, first.fraction) == (
        mix_store_path("r1", 0), "alpaca", {"output": "answer"}, 0.25)
    assert (second.hub_id, second.config, second.revision, second.split, second.format, second.fraction) == (
        "org/chats", "main", "c" * 40, "train[:100]", "sharegpt", 0.75)


def test_a_single_hub_source_is_pinned_and_keeps_its_format_and_columns():
    run = spec({"hub_id": "org/qa", "revision": "main", "format": "alpaca", "columns": {"instruction": "q"}})
    pinned = {"dataset": HubDataset(field="dataset", sha="d" * 40, config=None, rows_checked=0)}
    dataset = job_dataset(run, "r1", None, pinned)
    assert (dataset.hub_id, dataset.revision, dataset.format, dataset.columns, dataset.mix) == (
        "org/qa", "d" * 40, "alpaca", {"instruction": "q"}, [])


def test_an_evaluation_files_format_and_columns_reach_the_job():
    run = spec({"hub_id": "org/qa"}, evaluation={"local_file": "eval.jsonl", "format": "sharegpt",
                                                   "columns": {"conversations": "dialog"}})
    job = _job_input(run, "r1", 0.0, run.model, job_dataset(run, "r1", None, {}), [])
    assert (job.evaluation.format, job.evaluation.columns) == ("sharegpt", {"conversations": "dialog"})


def test_a_run_file_naming_an_unknown_column_is_refused_naming_the_field(tmp_path):
    run_file = tmp_path / "run.toml"
    run_file.write_text('artifact_store = "file:///tmp/store"\n[model]\nid = "m"\n[dataset]\nhub_id = "a/b"\n'
                        'format = "sharegpt"\ncolumns = {speaker = "from"}\n')
    with pytest.raises(SpecError, match=r"dataset: Value error, `columns` names `speaker`, which format `sharegpt` "
                                        r"does not have; its names are `conversations`, `from`, `value`"):
        load_run_file(run_file)


def test_a_mix_spec_survives_the_json_prefect_hands_the_flow():
    run = spec({"mix": [{"local_file": "a.jsonl", "format": "alpaca", "fraction": 0.5},
                        {"hub_id": "org/chats", "fraction": 0.5}]}, evaluation={"fraction": 0.1})
    assert RunSpec.model_validate(run.model_dump(mode="json")) == run


def test_alpaca_and_sharegpt_files_mix_as_messages(tmp_path):
    formats = {"dataset.mix[0]": first_row_format(jsonl(tmp_path / "a.jsonl", ALPACA), "alpaca", {}),
               "dataset.mix[1]": first_row_format(jsonl(tmp_path / "s.jsonl", SHAREGPT), "sharegpt", {})}
    assert formats == {"dataset.mix[0]": "prompt-completion", "dataset.mix[1]": "messages"}
    assert mixed_format(formats) == "messages"


def test_sources_whose_formats_do_not_mix_are_refused_naming_each(tmp_path):
    prompts = jsonl(tmp_path / "p.jsonl", {"prompt": [{"role": "user", "content": "2 + 2?"}], "answer": "4"})
    formats = {"dataset.mix[0]": first_row_format(prompts, "auto", {}),
               "dataset.mix[1]": first_row_format(jsonl(tmp_path / "s.jsonl", SHAREGPT), "sharegpt", {})}
    with pytest.raises(ValueError, match=r"the sources of a mix must be in formats that mix .*: dataset.mix\[0\] is "
                                         r"prompt-only; dataset.mix\[1\] is messages$"):
        mixed_format(formats)
