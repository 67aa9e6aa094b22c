"""The README's flow commands on a machine without the RunPod key or the worker image: one line that names the fix,
before any flow run starts (no failed run, no traceback in its log). The preflight is the exception by design: it
reports a missing key in its table (tests/test_preflight.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

NO_KEY = "no RunPod API key: set RUNPOD_API_KEY or create a Prefect Secret block named 'loraflow-test-no-such-block'"
NO_IMAGE = "no worker image: build it with `make image`"
COMMANDS = {
    "train": ["flows.train", "deployments/qwen.toml"],
    "preload": ["flows.preload", json.dumps({"models": [{"id": "Qwen/Qwen3-0.6B"}], "data_centers": ["EU-RO-1"]})],
    "volumes": ["flows.volumes", json.dumps({"dry_run": True})],
    "reconcile": ["flows.reconcile", json.dumps({"dry_run": True})],
    "serve": ["flows.serve", "deployments/qwen-serve.toml"],
    "evaluate": ["flows.evaluate", "deployments/qwen-evaluate.toml"],
}


def _run(stack, args: list[str], drop: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "RUNPOD_", "LORAFLOW_", "HF_"))}
    env |= {k: v for k, v in stack.client_env.items() if k != drop}
    env["RUNPOD_API_KEY_BLOCK"] = "loraflow-test-no-such-block"
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def _assert_one_line_and_no_run(done: subprocess.CompletedProcess, expected: str) -> None:
    output = done.stdout + done.stderr
    assert done.returncode == 1, output[-3000:]
    assert "Traceback" not in output and "Beginning flow run" not in output and "flow run " not in done.stdout, output[-3000:]
    assert done.stderr.strip().splitlines()[-1].startswith(expected), output[-3000:]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_without_the_runpod_key_each_flow_command_says_so_in_one_line_and_starts_no_run(local_stack, command):
    _assert_one_line_and_no_run(_run(local_stack, COMMANDS[command], drop="RUNPOD_API_KEY"), NO_KEY)


@pytest.mark.parametrize("command", ["train", "preload", "evaluate"])
def test_without_the_worker_image_a_renting_command_says_so_in_one_line_and_starts_no_run(local_stack, command):
    _assert_one_line_and_no_run(_run(local_stack, COMMANDS[command], drop="LORAFLOW_WORKER_IMAGE"), NO_IMAGE)
