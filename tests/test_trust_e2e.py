"""End to end, as a teammate who wants what is not theirs would try it on a shared server: `python -m flows.train`
against the embedded stack (a real Prefect server and localpod), with the operator's settings a team server sets.
Each attempt is refused before any endpoint exists, naming the field and the setting, and nothing is stored.

(The run that these settings let through, a GRPO run whose reward file lies inside the inputs folder and whose
manifest pins that file's sha256, is `tests/test_grpo_files_e2e.py`.)"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import DATASET, REPO, FlowRun
from tests.test_crash_recovery_e2e import flow_env
from tests.test_train_e2e import flow_run_state, run_endpoints, write_run_file

pytestmark = pytest.mark.timeout(600)

# The name of an account secret loraflow made for someone else's Hub token, as every run's log shows such names.
ANOTHER_PERSONS_SECRET = "loraflow-hf-token-ab12cd-0123456789abcdef"


def run_with(stack, run_file: Path, **settings: str) -> FlowRun:
    """`python -m flows.train RUN_FILE` against the stack, with the operator's `settings` in its environment."""
    proc = subprocess.run([sys.executable, "-m", "flows.train", str(run_file)], cwd=REPO,
                          env=flow_env(stack, **settings), capture_output=True, text=True, timeout=300)
    match = re.search(r"flow run ([0-9a-f-]{36}):", proc.stdout + proc.stderr)
    return FlowRun(proc.returncode, proc.stdout + proc.stderr, match.group(1) if match else None)


def test_a_plain_variable_that_names_another_persons_secret_is_refused_before_any_endpoint(local_stack, tiny_model,
                                                                                         tmp_path):
    run_file = write_run_file(tmp_path / "run.toml", name="e2e-steal-secret", model=tiny_model,
                              store=tmp_path / "store", extra="[worker]\nenv = { JUDGE_URL = "
                              f'"https://judge.example/?key={{{{ RUNPOD_SECRET_{ANOTHER_PERSONS_SECRET} }}}}" }}\n')

    run = run_with(local_stack, run_file)

    assert run.returncode != 0
    assert "worker.env" in run.output and "`worker.env.JUDGE_URL`" in run.output, run.output[-3000:]
    assert run_endpoints(local_stack, "e2e-steal-secret") == []
    assert not (tmp_path / "store").exists()


def test_a_file_outside_the_inputs_folder_and_a_run_on_the_servers_token_are_refused_naming_both(local_stack,
                                                                                                tiny_model, tmp_path):
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    outside = shutil.copy(DATASET, tmp_path / "control-plane-notes.jsonl")
    run_file = write_run_file(tmp_path / "run.toml", name="e2e-outside", model=tiny_model, store=tmp_path / "store",
                              dataset=Path(outside))

    run = run_with(local_stack, run_file, LORAFLOW_INPUTS_DIR=inputs, LORAFLOW_REQUIRE_RUN_TOKEN="1")

    assert run.returncode == 1, run.output[-3000:]
    message = flow_run_state(local_stack, run.flow_run_id)["message"]
    assert "dataset.local_file" in message and f"inputs folder {inputs}" in message, message
    assert "LORAFLOW_INPUTS_DIR" in message and "LORAFLOW_REQUIRE_RUN_TOKEN=1" in message, message
    assert run_endpoints(local_stack, "e2e-outside") == []
    assert not (tmp_path / "store").exists()  # the file was never copied anywhere


def test_a_run_above_the_operators_cap_is_refused_naming_the_setting(local_stack, tiny_model, tmp_path):
    run_file = write_run_file(tmp_path / "run.toml", name="e2e-over-cap", model=tiny_model, store=tmp_path / "store")

    run = run_with(local_stack, run_file, LORAFLOW_MAX_RUN_USD="0.01")

    assert run.returncode == 1, run.output[-3000:]
    message = flow_run_state(local_stack, run.flow_run_id)["message"]
    assert "LORAFLOW_MAX_RUN_USD" in message and "$0.01" in message, message
    assert run_endpoints(local_stack, "e2e-over-cap") == []


def test_a_run_naming_the_servers_own_token_and_key_blocks_is_refused_naming_both_fields(local_stack, tiny_model,
                                                                                       tmp_path):
    run_file = write_run_file(tmp_path / "run.toml", name="e2e-server-blocks", model=tiny_model,
                              store=tmp_path / "store", extra='[worker]\nsecrets = { JUDGE_KEY = "runpod-api-key" }\n')
    run_file.write_text('hub_token_secret = "hf-token"\n' + run_file.read_text())

    run = run_with(local_stack, run_file, LORAFLOW_REQUIRE_RUN_TOKEN="1")

    assert run.returncode == 1, run.output[-3000:]
    message = flow_run_state(local_stack, run.flow_run_id)["message"]
    assert "hub_token_secret: the Prefect Secret block 'hf-token' is this server's own" in message, message
    assert "worker.secrets.JUDGE_KEY: the Prefect Secret block 'runpod-api-key' is this server's own" in message
    assert run_endpoints(local_stack, "e2e-server-blocks") == []
    assert not (tmp_path / "store").exists()
