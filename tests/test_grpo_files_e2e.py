"""End to end: a GRPO run from local files only — a prompt-only JSONL dataset with an extra `answer` column and a
reward function in a local `.py` file — through a real `prefect server start`, localpod and the real worker
training the tiny model on the CPU. The run ships both to its artifact store; the worker imports the reward from
there and hands it the `answer` column, and the run's own worker env and secret (`[worker]`: a judge's URL and key,
the key from a Prefect Secret block), which the reward needs to score at all. The key's value is in no endpoint as
RunPod answers it, no Prefect flow run, task run, log or artifact, and no stored file. A reward file without its
function is refused before any endpoint."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from deployments.local_stack import PREFECT_SERVER_ENV
from tests.conftest import DATASET, REPO, FlowRun, prefect_api, run_train_flow
from tests.test_crash_recovery_e2e import flow_env
from tests.test_train_e2e import flow_run_state, run_endpoints

pytestmark = pytest.mark.timeout(900)

STEPS = 20
JUDGE_URL = "http://judge.example/v1/score"
JUDGE_KEY = "judge-e2e-key-7d41c09b"
JUDGE_KEY_BLOCK = "e2e-judge-key"
MEMBER_TOKEN_BLOCK = "e2e-member-hf-token"
REWARD_SOURCE = f'''
import hashlib
import os

# What a reward calling an LLM judge needs: the run's own env (JUDGE_URL) and secret (JUDGE_KEY). It scores only when
# both reached it, and knows the key by its hash alone: this file is stored with the run.
JUDGE = (os.environ.get("JUDGE_URL") == {JUDGE_URL!r}
         and hashlib.sha256(os.environ.get("JUDGE_KEY", "").encode()).hexdigest() == {hashlib.sha256(JUDGE_KEY.encode()).hexdigest()!r})


def digits_for_numbers(completions, answer, **kwargs):
    """The fraction of digits in the completion, when the reference answer is a number (all of them here)."""
    rewards = []
    for completion, reference in zip(completions, answer):
        text = completion[-1]["content"]
        chars = [ch for ch in text if not ch.isspace()]
        scored = JUDGE and chars and reference.isdigit()
        rewards.append(sum(ch.isdigit() for ch in chars) / len(chars) if scored else 0.0)
    return rewards
'''


def write_prompt_only_dataset(path: Path) -> Path:
    """The shipped chats as prompt-only lines (the user turn), each with a numeric `answer` for the reward."""
    chats = [json.loads(line)["messages"] for line in DATASET.read_text().splitlines() if line.strip()]
    path.write_text("".join(json.dumps({"prompt": chat[:-1], "answer": str(i)}) + "\n" for i, chat in enumerate(chats)))
    return path


def write_grpo_run_file(path: Path, *, name: str, model: Path, store: Path, dataset: Path, reward: str) -> Path:
    path.write_text(f'''
name = "{name}"
algorithm = "grpo"
artifact_store = "file://{store}"
deadline_minutes = 20
[model]
id = "{model}"
[dataset]
local_file = "{dataset}"
[training]
learning_rate = 3e-2
max_steps = {STEPS}
batch_size = 32
seed = 42
[grpo]
num_generations = 4
max_completion_length = 12
rewards = [{{ name = "{reward}" }}]
''')
    return path


def run_watching_endpoints(stack, run_file: Path, label: str, log: Path, timeout_s: float,
                           **settings: str) -> tuple[FlowRun, list[str]]:
    """`python -m flows.train RUN_FILE` against the stack (as `run_train_flow` runs it, `settings` in its environment),
    reading `GET /v2/serverless` as RunPod answers it while the run goes: (the run, every answer that listed an
    endpoint of `label`)."""
    answers, deadline = [], time.monotonic() + timeout_s
    with log.open("wb") as out:  # a file, not a pipe: a pipe nobody reads while the run goes would block it once full
        proc = subprocess.Popen([sys.executable, "-m", "flows.train", str(run_file)], cwd=REPO,
                                env=flow_env(stack, **settings),
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            answer = httpx.get(f"{stack.localpod_url}/v2/serverless", timeout=10, headers={
                "Authorization": f"Bearer {stack.client_env['RUNPOD_API_KEY']}"}).text
            if f'"loraflow-{label}-' in answer:
                answers.append(answer)
            time.sleep(0.5)
    finally:
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    output = log.read_text()
    match = re.search(r"flow run ([0-9a-f-]{36}):", output)
    return FlowRun(proc.returncode, output, match.group(1) if match else None), answers


def prefect_records(stack, flow_run_id: str) -> str:
    """Everything the Prefect server holds of a flow run, as its REST API answers: the flow run (parameters
    included), its task runs, its logs (every page) and its artifacts."""
    # The server records task runs in batches (the local stack's recorder flush interval): let the last one land.
    time.sleep(float(PREFECT_SERVER_ENV["PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL"]) + 0.5)
    runs = {"flow_runs": {"id": {"any_": [flow_run_id]}}}
    texts = [prefect_api(stack, "POST", "/flow_runs/filter", json=runs).text,
             prefect_api(stack, "POST", "/task_runs/filter", json=runs).text,
             prefect_api(stack, "POST", "/artifacts/filter",
                         json={"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}}).text]
    offset = 0
    while True:
        page = prefect_api(stack, "POST", "/logs/filter", json={
            "logs": {"flow_run_id": {"any_": [flow_run_id]}}, "offset": offset, "limit": 200}).json()
        texts.append(json.dumps(page))
        if len(page) < 200:
            return "\n".join(texts)
        offset += 200


def test_grpo_run_with_a_local_reward_file_and_a_prompt_only_dataset_learns_the_reward(local_stack, tiny_model, tmp_path):
    """Also a team server's run: its files inside the inputs folder, its own Hub token, under the operator's cap."""
    from prefect.blocks.system import Secret
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: local_stack.prefect_api_url}):
        Secret(value=JUDGE_KEY).save(JUDGE_KEY_BLOCK, overwrite=True)
        # A token of the member's own: the control plane's (the stack's HF_TOKEN) is refused under the rule.
        Secret(value="hf_e2e_member_token").save(MEMBER_TOKEN_BLOCK, overwrite=True)
    (tmp_path / "my_rewards.py").write_text(REWARD_SOURCE)
    store = tmp_path / "store"
    run_file = write_grpo_run_file(tmp_path / "run.toml", name="e2e-grpo-files", model=tiny_model, store=store,
                                   dataset=write_prompt_only_dataset(tmp_path / "prompts.jsonl"),
                                   reward=f"{tmp_path}/my_rewards.py:digits_for_numbers")
    with run_file.open("a") as toml:
        toml.write(f'[worker]\nenv = {{ JUDGE_URL = "{JUDGE_URL}" }}\nsecrets = {{ JUDGE_KEY = "{JUDGE_KEY_BLOCK}" }}\n')
    text = run_file.read_text()
    run_file.write_text(f'hub_token_secret = "{MEMBER_TOKEN_BLOCK}"\n' + text)

    run, endpoint_answers = run_watching_endpoints(local_stack, run_file, "e2e-grpo-files", tmp_path / "flow.log",
                                                   timeout_s=600, LORAFLOW_INPUTS_DIR=str(tmp_path),
                                                   LORAFLOW_REQUIRE_RUN_TOKEN="1", LORAFLOW_MAX_RUN_USD="5")

    assert run.returncode == 0, run.output[-5000:]
    assert flow_run_state(local_stack, run.flow_run_id)["type"] == "COMPLETED"
    run_dir = store / "runs" / run.flow_run_id
    # Both local files were shipped with the run; the job named the stored reward file.
    assert (run_dir / "rewards" / "my_rewards.py").read_text() == REWARD_SOURCE
    assert (run_dir / "dataset" / "train.jsonl").read_bytes() == (tmp_path / "prompts.jsonl").read_bytes()
    manifest = json.loads((run_dir / "manifest.json").read_text())
    [reward] = manifest["job"]["grpo"]["rewards"]
    assert reward["store_path"] == f"runs/{run.flow_run_id}/rewards/my_rewards.py"
    # The worker read the reward file pinned: the sha256 the control plane committed, checked and recorded.
    reward_sha256 = hashlib.sha256(REWARD_SOURCE.encode()).hexdigest()
    assert manifest["input_sha256"][reward["store_path"]] == reward_sha256
    assert manifest["job"]["inputs"]["sha256"][reward["store_path"]] == reward_sha256
    # The worker imported the reward and gave it the `answer` column: it scored, and the policy learned it.
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["steps"] == STEPS
    rewards = [reward for _, reward in metrics["rewards"]]
    # The reward scores nothing unless the judge's URL and key reached it: learning it shows they both did.
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.25, rewards
    assert (run_dir / "DONE").exists()

    # The endpoint's env held the URL and only a reference to the key's RunPod account secret.
    assert endpoint_answers, "no endpoint of the run was seen while it ran"
    assert not [answer for answer in endpoint_answers if JUDGE_KEY in answer]
    for answer in endpoint_answers:
        for endpoint in json.loads(answer)["endpoints"]:
            if endpoint["name"].startswith("loraflow-e2e-grpo-files-"):
                assert endpoint["env"]["JUDGE_URL"] == JUDGE_URL
                assert re.fullmatch(r"\{\{ RUNPOD_SECRET_loraflow-run-secret-[a-z0-9]+-[0-9a-f]{16} \}\}",
                                    endpoint["env"]["JUDGE_KEY"]), endpoint["env"]
    # Prefect holds the block's name, never the value; no file of the run's store holds it.
    records = prefect_records(local_stack, run.flow_run_id)
    assert JUDGE_KEY_BLOCK in records and JUDGE_KEY not in records
    assert [path for path in store.rglob("*") if path.is_file() and JUDGE_KEY.encode() in path.read_bytes()] == []


def test_a_reward_file_without_its_function_is_refused_before_any_endpoint_is_created(local_stack, tiny_model, tmp_path):
    (tmp_path / "my_rewards.py").write_text(REWARD_SOURCE)
    run_file = write_grpo_run_file(tmp_path / "run.toml", name="e2e-grpo-nofunc", model=tiny_model,
                                   store=tmp_path / "store", dataset=write_prompt_only_dataset(tmp_path / "prompts.jsonl"),
                                   reward=f"{tmp_path}/my_rewards.py:no_such_function")

    run = run_train_flow(local_stack, run_file)

    assert run.returncode == 1
    message = flow_run_state(local_stack, run.flow_run_id)["message"]
    assert "grpo.rewards[0].name" in message and "no top-level function `no_such_function`" in message, message
    assert run_endpoints(local_stack, "e2e-grpo-nofunc") == []
    assert not (tmp_path / "store").exists()  # nothing published either


def test_a_sft_dataset_line_is_refused_for_grpo_naming_the_line_before_any_endpoint(local_stack, tiny_model, tmp_path):
    (tmp_path / "my_rewards.py").write_text(REWARD_SOURCE)
    dataset = write_prompt_only_dataset(tmp_path / "prompts.jsonl")
    with dataset.open("a") as lines:
        lines.write(json.dumps({"text": "no prompt here"}) + "\n")
    run_file = write_grpo_run_file(tmp_path / "run.toml", name="e2e-grpo-baddata", model=tiny_model,
                                   store=tmp_path / "store", dataset=dataset,
                                   reward=f"{tmp_path}/my_rewards.py:digits_for_numbers")

    run = run_train_flow(local_stack, run_file)

    assert run.returncode == 1
    message = flow_run_state(local_stack, run.flow_run_id)["message"]
    assert "dataset.local_file" in message and "line 58: no `messages` or `prompt`" in message, message
    assert run_endpoints(local_stack, "e2e-grpo-baddata") == []
