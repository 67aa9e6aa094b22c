"""End to end on the local stack: a run whose data is a mix of an Alpaca file and a ShareGPT file (the shipped chats,
rewritten in those formats) trains to a falling loss and records what each source gave; a bad row in a mix entry is
refused before any endpoint exists, naming the entry, the line and the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

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


def write_run_file(tmp_path: Path, name: str, model: Path, alpaca: Path, sharegpt: Path) -> Path:
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
local_file = "{sharegpt}"
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
    assert metrics["final_loss"] < 0.5 * metrics["first_loss"], metrics["losses"]
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
