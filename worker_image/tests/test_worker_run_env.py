"""A run's own worker variables (`JobInput.worker_env_names`) and secrets (`worker_secret_names`) on the worker: the
training process gets exactly the listed ones beside what it always gets, a plain variable that is not the value the
control plane checked (`worker_env_sha256`) refuses the job, and a listed secret's value, whatever its name, leaves the
worker in nothing it returns or stores."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError
from worker_test_support import stored_files_containing

from loraflow_worker.artifacts.pins import sha256_hex
from loraflow_worker.contract import CONTRACT_VERSION, JobInput
from loraflow_worker.runtime.environment import RunEnvRefused, child_env
from loraflow_worker.handler import WORK_DIR_ENV, JobFailed, handler
from loraflow_worker.runtime.redaction import redact_secrets
from loraflow_worker.self_test.tiny_model import DEFAULT_CORPUS

JUDGE_KEY, JUDGE_AUTH, JUDGE_URL = "judge-key-value-0001", "judge-auth-value-0002", "http://judge.example/score"
JOB = dict(run_id="run-1", model={"id": "m"}, dataset={"hub_id": "d"}, artifact_store="hf://datasets/org/artifacts")
WORKER_ENV = {
    "PATH": "/usr/bin",
    "JUDGE_URL": JUDGE_URL,
    "JUDGE_TOKEN_BUDGET": "2000",  # plain, although its name looks like a secret's
    "JUDGE_KEY": JUDGE_KEY,
    "OPENAI_API_KEY": "sk-not-listed-by-the-run",
    "RUNPOD_AI_API_KEY": "runpod-worker-key",
}


def checked(env: dict[str, str]) -> dict:
    """`worker_env_names` and `worker_env_sha256` of a run whose `[worker] env` is `env`, as the control plane sends
    them."""
    return {"worker_env_names": sorted(env), "worker_env_sha256": {name: sha256_hex(value.encode())
                                                                  for name, value in env.items()}}


def test_the_training_process_gets_the_runs_listed_variables_whatever_their_names():
    job = JobInput(**JOB, **checked({"JUDGE_URL": JUDGE_URL, "JUDGE_TOKEN_BUDGET": "2000"}),
                   worker_secret_names=["JUDGE_KEY"])
    env = child_env(job, WORKER_ENV)
    assert {name for name in WORKER_ENV if name in env} == {"PATH", "JUDGE_URL", "JUDGE_TOKEN_BUDGET", "JUDGE_KEY"}
    assert env["JUDGE_KEY"] == JUDGE_KEY


def test_without_the_listing_a_secret_looking_variable_stays_with_the_worker():
    env = child_env(JobInput(**JOB), WORKER_ENV)
    assert "JUDGE_KEY" not in env and "JUDGE_TOKEN_BUDGET" not in env and env["JUDGE_URL"] == JUDGE_URL


def test_a_listed_secret_is_redacted_whatever_its_name_and_length():
    env = {"JUDGE_AUTH": JUDGE_AUTH, "PIN": "4321"}
    text = f"auth {JUDGE_AUTH} pin 4321"
    assert redact_secrets(text, env) == text  # neither name looks like a secret's
    assert redact_secrets(text, env, secret_names=["JUDGE_AUTH", "PIN"]) == "auth *** pin ***"


def test_a_plain_variable_whose_value_is_not_the_checked_one_refuses_the_job_without_showing_it():
    job = JobInput(**JOB, **checked({"JUDGE_URL": JUDGE_URL}))
    with pytest.raises(RunEnvRefused) as refused:
        child_env(job, WORKER_ENV | {"JUDGE_URL": "http://elsewhere.example/steal"})
    assert "`worker.env.JUDGE_URL` holds another value than the one the control plane checked" in str(refused.value)
    assert "elsewhere" not in str(refused.value)


def test_a_plain_variable_holding_a_secret_reference_refuses_the_job_naming_it():
    reference = "{{ RUNPOD_SECRET_someone-elses-key }}"
    job = JobInput(**JOB, **checked({"JUDGE_URL": reference}))  # even when it is the value that was checked
    with pytest.raises(RunEnvRefused, match=r"`worker.env.JUDGE_URL` holds `\{\{` or `RUNPOD_SECRET_`"):
        child_env(job, WORKER_ENV | {"JUDGE_URL": reference})


@pytest.mark.parametrize("value", ["prefix runpod_secret_other", "a {{ b"])
def test_a_secret_reference_is_found_in_any_case_and_anywhere_in_the_value(value):
    job = JobInput(**JOB, **checked({"JUDGE_URL": value}))
    with pytest.raises(RunEnvRefused, match="worker.env.JUDGE_URL"):
        child_env(job, {"JUDGE_URL": value})


def test_a_listed_plain_variable_missing_from_the_worker_refuses_the_job():
    job = JobInput(**JOB, **checked({"JUDGE_URL": JUDGE_URL}))
    with pytest.raises(RunEnvRefused, match="`worker.env.JUDGE_URL` is not set in the worker's environment"):
        child_env(job, {"PATH": "/usr/bin"})


def test_a_job_without_a_hash_for_each_plain_variable_is_refused():
    with pytest.raises(ValidationError) as refused:
        JobInput(**JOB, worker_env_names=["JUDGE_URL", "JUDGE_TOKEN_BUDGET"],
                 worker_env_sha256={"JUDGE_URL": sha256_hex(JUDGE_URL.encode())})
    [error] = refused.value.errors()
    assert error["loc"] == ("worker_env_sha256",) and "give the sha256 of each listed variable" in error["msg"]


def test_the_handler_refuses_a_changed_plain_variable_before_training(tmp_path, monkeypatch):
    store_root = tmp_path / "store"
    monkeypatch.setenv("JUDGE_URL", "http://elsewhere.example/steal")
    monkeypatch.setenv(WORK_DIR_ENV, str(tmp_path / "work"))
    job_input = {**JOB, "contract_version": CONTRACT_VERSION, "artifact_store": store_root.as_uri(),
                 **checked({"JUDGE_URL": JUDGE_URL})}
    with pytest.raises(RunEnvRefused, match="worker.env.JUDGE_URL"):
        handler({"id": "job-1", "input": job_input})
    assert not (tmp_path / "work").exists()  # refused before its work folder was made


@pytest.mark.parametrize("field, name, problem", [
    ("worker_secret_names", "HF_TOKEN", "`HF_TOKEN` cannot be set by a run (loraflow gives the worker the run's "
                                        "Hugging Face token, from `hub_token_secret`): remove it"),
    ("worker_env_names", "RUNPOD_API_KEY", "`RUNPOD_API_KEY` cannot be set by a run (RunPod sets them"),
    ("worker_env_names", "1JUDGE", "`1JUDGE` is not an environment variable name"),
])
def test_a_job_listing_a_name_the_worker_owns_is_refused_naming_it(field, name, problem):
    with pytest.raises(ValidationError) as refused:
        JobInput(**JOB, **{field: [name]})
    [error] = refused.value.errors()
    assert error["loc"] == (field,) and problem in error["msg"]


REWARD_SOURCE = '''
import os

# At import, before any training: what a reward calling a judge could print or raise.
print("judge key", os.environ["JUDGE_KEY"], "auth", os.environ["JUDGE_AUTH"], "at", os.environ["JUDGE_URL"], flush=True)
raise RuntimeError(f"judge refused key {os.environ['JUDGE_KEY']} auth {os.environ['JUDGE_AUTH']}")
'''


def test_a_reward_that_prints_and_raises_the_runs_secrets_leaves_them_in_no_error_or_stored_file(
        tiny_model_dir, make_job, tmp_path, monkeypatch):
    store_root = tmp_path / "store"
    reward_path = "runs/sec/rewards/judge.py"
    (store_root / reward_path).parent.mkdir(parents=True)
    (store_root / reward_path).write_text(REWARD_SOURCE)
    prompts = "".join(json.dumps({"prompt": json.loads(line)["messages"][:-1]}) + "\n"
                      for line in DEFAULT_CORPUS.read_text().splitlines() if line.strip())
    (store_root / "runs/sec/dataset/prompts.jsonl").parent.mkdir(parents=True)
    (store_root / "runs/sec/dataset/prompts.jsonl").write_text(prompts)
    for name, value in (("JUDGE_KEY", JUDGE_KEY), ("JUDGE_AUTH", JUDGE_AUTH), ("JUDGE_URL", JUDGE_URL)):
        monkeypatch.setenv(name, value)  # as RunPod sets the endpoint's env, secrets resolved
    monkeypatch.setenv(WORK_DIR_ENV, str(tmp_path / "work"))
    job = make_job("sec", tiny_model_dir, store_root, algorithm="grpo",
                   dataset={"store_path": "runs/sec/dataset/prompts.jsonl"},
                   training={"max_steps": 1, "batch_size": 4}, **checked({"JUDGE_URL": JUDGE_URL}),
                   worker_secret_names=["JUDGE_KEY", "JUDGE_AUTH"],
                   grpo={"num_generations": 4, "max_completion_length": 4,
                         "rewards": [{"name": "rewards/judge.py:score", "store_path": reward_path}]})

    with pytest.raises(JobFailed) as failed:
        handler(job)

    # The training process had every listed variable (no KeyError), and the error shows the secrets redacted.
    assert "RuntimeError: judge refused key *** auth ***" in str(failed.value), failed.value
    console = (store_root / "runs/sec/console.txt").read_text()
    assert f"judge key *** auth *** at {JUDGE_URL}" in console, console
    assert stored_files_containing(store_root, JUDGE_KEY) == []
    assert stored_files_containing(store_root, JUDGE_AUTH) == []
