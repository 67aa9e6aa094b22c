"""End to end on the local stack: a DPO run on pairs whose chosen and rejected answers differ in style, with a share
held out, completes with its held-out reward accuracy high and its margins risen, and its summary says so; a pair
without `rejected` is refused before any endpoint exists, naming the line and the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import DATASET, localpod_account, prefect_api, run_train_flow

pytestmark = pytest.mark.timeout(900)

REJECTED = "I do not know, and I will not guess."


def write_pairs(tmp_path: Path, drop_rejected_at: int | None = None) -> Path:
    rows = []
    for line in DATASET.read_text().splitlines():
        prompt, answer = json.loads(line)["messages"]
        rows.append({"prompt": [prompt], "chosen": [answer], "rejected": [{"role": "assistant", "content": REJECTED}]})
    if drop_rejected_at is not None:
        del rows[drop_rejected_at - 1]["rejected"]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_run_file(tmp_path: Path, name: str, model: Path, pairs: Path) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(f'''
name = "{name}"
algorithm = "dpo"
artifact_store = "file://{tmp_path / 'store'}"
deadline_minutes = 20
[model]
id = "{model}"
[dataset]
local_file = "{pairs}"
[dpo]
beta = 0.1
[training]
learning_rate = 2e-2
max_steps = 24
batch_size = 8
max_seq_length = 128
[evaluation]
fraction = 0.2
every_steps = 8
''')
    return path


def test_a_dpo_run_learns_the_preferred_style_of_its_held_out_pairs(local_stack, tiny_model, tmp_path):
    run = run_train_flow(local_stack, write_run_file(tmp_path, "e2e-dpo", tiny_model, write_pairs(tmp_path)))
    assert run.returncode == 0, run.output

    run_dir = tmp_path / "store" / "runs" / run.flow_run_id
    metrics = json.loads((run_dir / "metrics.json").read_text())
    accuracies = [value for _, value in metrics["eval_reward_accuracies"]]
    margins = [value for _, value in metrics["eval_reward_margins"]]
    assert accuracies[-1] >= 0.9 and margins[-1] > margins[0] + 1.0, (accuracies, margins)
    assert json.loads((run_dir / "adapter" / "adapter_config.json").read_text())["peft_type"] == "LORA"
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert (manifest["job"]["algorithm"], manifest["job"]["dpo"]["beta"]) == ("dpo", 0.1)
    artifacts = prefect_api(local_stack, "POST", "/artifacts/filter",
                            json={"artifacts": {"flow_run_id": {"any_": [run.flow_run_id]}}}).text
    assert "Eval reward accuracy, held-out pairs (start" in artifacts


def test_a_pair_without_rejected_is_refused_before_any_endpoint_naming_the_line_and_field(
        local_stack, tiny_model, tmp_path):
    run = run_train_flow(local_stack, write_run_file(tmp_path, "e2e-dpo-bad", tiny_model,
                                                     write_pairs(tmp_path, drop_rejected_at=3)))
    assert run.returncode == 1
    message = prefect_api(local_stack, "GET", f"/flow_runs/{run.flow_run_id}").json()["state"]["message"]
    assert "dataset.local_file" in message and "line 3: `rejected`: missing or empty" in message, message
    assert not [e for e in localpod_account(local_stack)["endpoints"] if e["name"].startswith("loraflow-e2e-dpo-bad-")]
