"""End to end on the local stack: tools in GRPO. The tiny model is taught the tool-call format by an SFT run; a GRPO
run from that adapter (`lora.init_from`) with `grpo.tools` calls the tool inside the worker (it appends to a ledger
file the run's `[worker] env` names: a side effect this test reads), the tool's answer reaches the reward, and the
summary shows trajectories. The tools file is the user's code: a line planted at its top notes every process that
runs it, and only the worker's ever do, never the control plane's check. A tools file with a function lacking type
hints is refused before any endpoint exists, naming the function."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from loraflow_worker.self_test import tool_use

from tests.conftest import localpod_account, prefect_api, run_train_flow

pytestmark = pytest.mark.timeout(900)


def write_files(tmp_path: Path) -> dict[str, Path]:
    files = {"teach": tool_use.jsonl(tool_use.teaching_rows()), "prompts": tool_use.jsonl(tool_use.prompt_rows()),
             "tools": tool_use.TOOLS_SOURCE, "reward": tool_use.REWARD_SOURCE}
    paths = {"teach": tmp_path / "teach.jsonl", "prompts": tmp_path / "prompts.jsonl", "tools": tmp_path / "tools.py",
             "reward": tmp_path / "reward.py"}
    for name, path in paths.items():
        path.write_text(files[name])
    return paths


def write_teach_run(tmp_path: Path, model: Path, files: dict[str, Path]) -> Path:
    path = tmp_path / "teach.toml"
    path.write_text(f'''
name = "e2e-tools-teach"
artifact_store = "file://{tmp_path / 'store'}"
deadline_minutes = 20
[model]
id = "{model}"
[dataset]
local_file = "{files['teach']}"
[lora]
rank = 8
alpha = 16
[training]
learning_rate = 1e-2
max_steps = 150
batch_size = 4
''')
    return path


def write_tools_run(tmp_path: Path, name: str, model: Path, files: dict[str, Path], init_from: str | None,
                    ledger: Path) -> Path:
    path = tmp_path / f"{name}.toml"
    path.write_text(f'''
name = "{name}"
algorithm = "grpo"
artifact_store = "file://{tmp_path / 'store'}"
deadline_minutes = 20
[model]
id = "{model}"
[dataset]
local_file = "{files['prompts']}"
[lora]
{f'init_from = "{init_from}"' if init_from else ''}
[training]
learning_rate = 1e-3
max_steps = 3
batch_size = 8
[grpo]
num_generations = 4
max_completion_length = 192
temperature = 0.3
tools = "{files['tools']}"
max_tool_calls = 1
rewards = [{{ name = "{files['reward']}:receipt" }}]
[worker]
env = {{ {tool_use.LEDGER_ENV} = "{ledger}" }}
''')
    return path


def test_a_taught_model_calls_its_tool_in_the_worker_and_the_answer_reaches_the_reward(local_stack, tiny_model,
                                                                                         tmp_path):
    files = write_files(tmp_path)
    ran_by = tmp_path / "ran-by.txt"  # a line per process that runs the tools file: its Python environment
    files["tools"].write_text(f"import sys as _sys\nopen({str(ran_by)!r}, 'a').write(_sys.prefix + '\\n')\n"
                              + tool_use.TOOLS_SOURCE)
    teach = run_train_flow(local_stack, write_teach_run(tmp_path, tiny_model, files))
    assert teach.returncode == 0, teach.output
    ledger = tmp_path / "ledger.txt"

    run = run_train_flow(local_stack, write_tools_run(tmp_path, "e2e-tools", tiny_model, files,
                                                      f"runs/{teach.flow_run_id}", ledger))

    assert run.returncode == 0, run.output
    assert set(ledger.read_text().split()) <= set(tool_use.ITEMS) and ledger.read_text(), "the tool never ran"
    # The worker's environment (.venv-worker) imported it; the control plane's (this one) only read it.
    runners = ran_by.read_text().split()
    assert runners and sys.prefix not in runners, runners
    run_dir = tmp_path / "store" / "runs" / run.flow_run_id
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert max(reward for _, reward in metrics["rewards"]) > 0.5, metrics["rewards"]
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["job"]["grpo"]["tools_store_path"] == f"runs/{run.flow_run_id}/tools/tools.py"
    artifacts = prefect_api(local_stack, "POST", "/artifacts/filter",
                            json={"artifacts": {"flow_run_id": {"any_": [run.flow_run_id]}}}).text
    assert "Trajectories at step 3" in artifacts and "`record(item=" in artifacts and "receipt " in artifacts


def test_a_tool_without_type_hints_is_refused_before_any_endpoint_naming_it(local_stack, tiny_model, tmp_path):
    files = write_files(tmp_path)
    files["tools"].write_text(tool_use.TOOLS_SOURCE.replace("def record(item: str) -> str:", "def record(item):"))

    run = run_train_flow(local_stack, write_tools_run(tmp_path, "e2e-tools-bad", tiny_model, files, None,
                                                      tmp_path / "ledger.txt"))

    assert run.returncode == 1
    message = prefect_api(local_stack, "GET", f"/flow_runs/{run.flow_run_id}").json()["state"]["message"]
    assert "grpo.tools" in message and "tool `record` cannot be shown to the model" in message, message
    assert not [e for e in localpod_account(local_stack)["endpoints"] if e["name"].startswith("loraflow-e2e-tools-bad-")]


def test_prompts_that_the_tools_schemas_push_past_the_limit_are_refused_before_any_endpoint(local_stack, tiny_model,
                                                                                           tmp_path):
    files = write_files(tmp_path)
    run_file = write_tools_run(tmp_path, "e2e-tools-long", tiny_model, files, None, tmp_path / "ledger.txt")
    run_file.write_text(run_file.read_text().replace("[grpo]\n", "[grpo]\nmax_prompt_length = 32\n"))

    run = run_train_flow(local_stack, run_file)

    assert run.returncode == 1
    message = prefect_api(local_stack, "GET", f"/flow_runs/{run.flow_run_id}").json()["state"]["message"]
    assert "grpo.max_prompt_length 32 is below the longest prompt" in message, message
    assert re.search(r"\): (\d+) tokens with the tools' schemas", message) and "Raise grpo.max_prompt_length to at least" \
        in message, message
    assert not [e for e in localpod_account(local_stack)["endpoints"] if e["name"].startswith("loraflow-e2e-tools-long-")]
