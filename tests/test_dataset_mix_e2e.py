"""End to end on the local stack: a run whose data is a mix of an Alpaca file and a ShareGPT file (the shipped chats,
rewritten in those formats) trains to a falling loss and records what each source gave; a bad row in a mix entry is
refused before any endpoint exists, naming the entry, the line and the field; a Hub subset at a revision (on the
stack's Hub stand-in) mixes with a local file, and the run trains on that commit even after the branch moved on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from huggingface_hub import HfApi

from tests.conftest import DATASET, localpod_account, prefect_api, run_train_flow

pytestmark = pytest.mark.timeout(900)

CHATS = [json.loads(line)["messages"] for line in DATASET.read_text().splitlines() if line.strip()]
SPEAKERS = {"user": "human", "assistant": "gpt", "system": "system"}


def write_files(tmp_path: Path, bad_speaker: bool = False) -> tuple[Path, Path]:
    alpaca = tmp_path / "alpaca.jsonl"
    alpaca.write_text("".join(json.dumps({"question": chat[-2]["content"], "answer": chat[-1]["content"]}) + "\n"
                              for chat in CHATS))
    turns = [[{"from": SPEAKERS[m["role"]], "value": m["content"]} for m in chat] for chat in CHATS]
    if bad_speaker:
        turns[2][-1]["from"] = "bot"
    sharegpt = tmp_path / "sharegpt.jsonl"
    sharegpt.write_text("".join(json.dumps({"conversations": t}) + "\n" for t in turns))
    return alpaca, sharegpt


def write_run_file(tmp_path: Path, name: str, model: Path, alpaca: Path, sharegpt: Path | None = None,
                   hub_source: str = "") -> Path:
    second = f'local_file = "{sharegpt}"' if sharegpt else hub_source
    path = tmp_path / "run.toml"
    path.write_text(f'''
name = "{name}"
artifact_store = "file://{tmp_path / 'store'}"
deadline_minutes = 20
[model]
id = "{model}"
[[dataset.mix]]
local_file = "{alpaca}"
format = "alpaca"
columns = {{instruction = "question", output = "answer"}}
fraction = 0.4
[[dataset.mix]]
{second}
format = "sharegpt"
fraction = 0.6
[lora]
rank = 8
alpha = 16
[training]
learning_rate = 5e-3
max_steps = 30
batch_size = 8
max_seq_length = 128
seed = 7
''')
    return path


def test_a_mix_of_an_alpaca_and_a_sharegpt_file_trains_and_records_each_sources_rows(local_stack, tiny_model,
                                                                                    tmp_path):
    run = run_train_flow(local_stack, write_run_file(tmp_path, "e2e-mix", tiny_model, *write_files(tmp_path)))
    assert run.returncode == 0, run.output

    run_dir = tmp_path / "store" / "runs" / run.flow_run_id
    metrics = json.loads((run_dir / "metrics.json").read_text())
    # On the answers only (the default `loss_on`): the chat template's own tokens, learnt first, do not count.
    assert metrics["final_loss"] < 0.65 * metrics["first_loss"], metrics["losses"]
    alpaca, sharegpt = json.loads((run_dir / "manifest.json").read_text())["dataset_sources"]
    assert (alpaca["source"], alpaca["format"], alpaca["fraction"]) == (
        f"dataset.mix[0] (file runs/{run.flow_run_id}/dataset/mix-0.jsonl)", "alpaca", 0.4)
    assert sharegpt["format"] == "sharegpt" and 0 < alpaca["rows"] and 0 < sharegpt["rows"]
    assert len(CHATS) in (alpaca["rows"], sharegpt["rows"])  # the mix stopped when one of them ran out


def test_a_bad_row_in_a_mix_entry_is_refused_before_any_endpoint_naming_the_entry_line_and_field(
        local_stack, tiny_model, tmp_path):
    run = run_train_flow(local_stack, write_run_file(tmp_path, "e2e-badmix", tiny_model,
                                                     *write_files(tmp_path, bad_speaker=True)))
    assert run.returncode == 1
    message = prefect_api(local_stack, "GET", f"/flow_runs/{run.flow_run_id}").json()["state"]["message"]
    assert "dataset.mix[1].local_file" in message and "line 3: `conversations[1].from`: 'bot'" in message, message
    assert not [e for e in localpod_account(local_stack)["endpoints"] if e["name"].startswith("loraflow-e2e-badmix-")]


def test_a_hub_subset_at_a_revision_mixes_with_a_local_file_and_the_run_is_pinned_to_that_commit(
        local_stack, tiny_model, tmp_path):
    alpaca, sharegpt = write_files(tmp_path)
    api = HfApi(endpoint=local_stack.hub_url, token=local_stack.client_env["HF_TOKEN"])
    api.create_repo("e2e-org/chats", repo_type="dataset", exist_ok=True)
    card = ("---\nconfigs:\n- config_name: sharegpt\n  data_files: sg/*.jsonl\n- config_name: other\n"
            "  data_files: o/*.jsonl\n---\n")
    api.upload_file(path_or_fileobj=card.encode(), path_in_repo="README.md", repo_id="e2e-org/chats",
                    repo_type="dataset")
    good = api.upload_file(path_or_fileobj=str(sharegpt), path_in_repo="sg/chats.jsonl", repo_id="e2e-org/chats",
                           repo_type="dataset").oid
    # The branch moves on to a row no run could train on: the run at the first commit never sees it.
    api.upload_file(path_or_fileobj=b'{"conversations": [{"from": "bot", "value": "?"}]}\n',
                    path_in_repo="sg/chats.jsonl", repo_id="e2e-org/chats", repo_type="dataset")
    hub_source = f'hub_id = "e2e-org/chats"\nconfig = "sharegpt"\nrevision = "{good}"'

    run = run_train_flow(local_stack, write_run_file(tmp_path, "e2e-hubmix", tiny_model, alpaca, hub_source=hub_source))
    assert run.returncode == 0, run.output

    manifest = json.loads((tmp_path / "store" / "runs" / run.flow_run_id / "manifest.json").read_text())
    hub_entry = manifest["job"]["dataset"]["mix"][1]
    assert (hub_entry["hub_id"], hub_entry["config"], hub_entry["revision"]) == ("e2e-org/chats", "sharegpt", good)
    assert manifest["dataset_sources"][1]["source"] == (f"dataset.mix[1] (hub e2e-org/chats, config sharegpt, "
                                                        f"revision {good}, split train)")
    assert manifest["dataset_sources"][1]["rows"] > 0
