"""A shared server's rules for every run, tried as a teammate who wants what is not theirs would try them: a run field
that names the control plane's own files, a run on the control plane's token, a run field that names the control
plane's own Secret blocks, a cost past the operator's cap, a plain variable that names another person's account
secret, a folder store with RunPod's workers. Each is refused before anything is rented, naming the field and the
setting."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from flows.forms.overrides import RunOverrides, apply_overrides
from flows.forms.run import RunSpec, SpecError, WorkerSpec
from tasks.placement.cost import CostCeiling, check_budget, check_study_budget
from tasks.lifecycle.worker_env import RunSecretError, read_run_secrets
from tasks.preflight.server_rules import ServerRuleError, check_server_rules, operator_rule_problems
from tasks.runpod.client import API_URL
from tasks.settings import HubTokenError, Settings

LOCALPOD_URL = "http://127.0.0.1:8765/v2"


def spec(tmp_path: Path, **fields) -> RunSpec:
    return RunSpec.model_validate({"model": {"id": "Qwen/Qwen3-0.6B"}, "dataset": {"hub_id": "trl-lib/Capybara"},
                                   "artifact_store": f"file://{tmp_path}/store", **fields})


def rules(tmp_path: Path, run: RunSpec, **settings) -> None:
    check_server_rules(run.local_paths(), artifact_store=run.artifact_store, hub_token_secret=run.hub_token_secret,
                       settings=Settings(runpod_api_url=LOCALPOD_URL, **settings), base_dir=tmp_path,
                       worker_secrets=run.worker.secrets)


@pytest.fixture
def inputs(tmp_path: Path) -> Path:
    folder = tmp_path / "inputs"
    folder.mkdir()
    (folder / "train.jsonl").write_text("{}\n")
    return folder


def test_a_run_lists_every_file_of_this_machine_it_reads(tmp_path):
    run = spec(tmp_path, algorithm="grpo", dataset={"mix": [{"local_file": "a.jsonl", "fraction": 0.5},
                                                            {"hub_id": "org/b", "fraction": 0.5}]},
               evaluation={"local_file": "eval.jsonl"},
               grpo={"rewards": [{"name": "rewards/mine.py:score"}, {"name": "digit_fraction"}],
                     "tools": "tools.py", "environment": "env/game.py:Game"}, model={"id": "./models/tiny"})
    sft = spec(tmp_path, training={"chat_template": "templates/chat.jinja"})

    assert run.local_paths() == [
        ("dataset.mix[0].local_file", "a.jsonl"), ("evaluation.local_file", "eval.jsonl"),
        ("grpo.rewards[0].name", "rewards/mine.py"), ("grpo.tools", "tools.py"), ("grpo.environment", "env/game.py"),
        ("model.id", "./models/tiny")]
    assert sft.local_paths() == [("training.chat_template", "templates/chat.jinja")]


def test_without_an_inputs_folder_any_path_is_the_runs_own_business(tmp_path):
    rules(tmp_path, spec(tmp_path, dataset={"local_file": "/etc/passwd.jsonl"}))


def test_a_file_inside_the_inputs_folder_is_accepted(tmp_path, inputs):
    rules(tmp_path, spec(tmp_path, dataset={"local_file": str(inputs / "train.jsonl")}), loraflow_inputs_dir=inputs)
    rules(tmp_path, spec(tmp_path, dataset={"local_file": "inputs/train.jsonl"}), loraflow_inputs_dir=inputs)


@pytest.mark.parametrize("path", ["/etc/hostname.jsonl", "inputs/../secrets.jsonl", "~/.ssh/id.jsonl"])
def test_a_file_outside_the_inputs_folder_is_refused_naming_the_field_and_the_folder(tmp_path, inputs, path):
    with pytest.raises(ServerRuleError) as refused:
        rules(tmp_path, spec(tmp_path, dataset={"local_file": path}), loraflow_inputs_dir=inputs)
    message = str(refused.value)
    assert "dataset.local_file" in message and str(inputs) in message and "LORAFLOW_INPUTS_DIR" in message


def test_a_symlink_inside_the_inputs_folder_that_leads_out_of_it_is_refused(tmp_path, inputs):
    (tmp_path / "keys.py").write_text("RUNPOD_API_KEY = 'rpa_x'\n")
    (inputs / "rewards.py").symlink_to(tmp_path / "keys.py")
    run = spec(tmp_path, algorithm="grpo", grpo={"rewards": [{"name": f"{inputs}/rewards.py:score"}]})

    with pytest.raises(ServerRuleError) as refused:
        rules(tmp_path, run, loraflow_inputs_dir=inputs)
    assert "grpo.rewards[0].name" in str(refused.value) and str(tmp_path / "keys.py") in str(refused.value)


def test_every_file_outside_the_folder_is_named_at_once(tmp_path, inputs):
    run = spec(tmp_path, algorithm="grpo", grpo={"rewards": [{"name": "/srv/a.py:f"}], "tools": "/srv/tools.py"},
               evaluation={"local_file": "/srv/eval.jsonl"})
    problems = operator_rule_problems(run.local_paths(), hub_token_secret=None,
                                      settings=Settings(loraflow_inputs_dir=inputs), base_dir=tmp_path)
    assert [p.split(" ", 1)[0] for p in problems] == ["evaluation.local_file", "grpo.rewards[0].name", "grpo.tools"]


def test_a_run_file_outside_the_inputs_folder_is_refused_before_it_is_read(tmp_path, inputs, monkeypatch):
    secret = tmp_path / "control-plane.toml"
    secret.write_text('key = "rpa_not_yours"\n')
    monkeypatch.setenv("LORAFLOW_INPUTS_DIR", str(inputs))

    with pytest.raises(ServerRuleError) as refused:
        apply_overrides(spec(tmp_path), RunOverrides(run_file=str(secret)))
    assert "parameter run_file" in str(refused.value) and "rpa_not_yours" not in str(refused.value)


def test_a_run_without_its_own_token_is_refused_where_the_server_requires_one(tmp_path):
    with pytest.raises(ServerRuleError) as refused:
        rules(tmp_path, spec(tmp_path), loraflow_require_run_token=True)
    assert "hub_token_secret" in str(refused.value) and "LORAFLOW_REQUIRE_RUN_TOKEN=1" in str(refused.value)
    rules(tmp_path, spec(tmp_path, hub_token_secret="alice-hf-token"), loraflow_require_run_token=True)


def test_the_setting_reads_as_an_operator_writes_it(monkeypatch):
    monkeypatch.setenv("LORAFLOW_REQUIRE_RUN_TOKEN", "1")
    monkeypatch.setenv("LORAFLOW_MAX_RUN_USD", "25")
    assert Settings().loraflow_require_run_token and Settings().loraflow_max_run_usd == 25


def test_a_folder_store_and_a_local_model_are_refused_with_runpods_workers(tmp_path):
    (tmp_path / "model").mkdir()
    run = spec(tmp_path, model={"id": str(tmp_path / "model")})
    with pytest.raises(ServerRuleError) as refused:
        check_server_rules(run.local_paths(), artifact_store=run.artifact_store, hub_token_secret=None,
                           settings=Settings(runpod_api_url=API_URL))
    assert "artifact_store" in str(refused.value) and "model.id" in str(refused.value)
    rules(tmp_path, run)  # localpod's workers run on this machine


def test_only_runpods_own_hosts_count_as_runpods_workers():
    assert Settings(runpod_api_url=API_URL).workers_are_runpods()
    assert not Settings(runpod_api_url=LOCALPOD_URL).workers_are_runpods()
    assert not Settings(runpod_api_url="https://api.runpod.io.example.com/v2").workers_are_runpods()


def test_a_run_above_the_operators_cap_is_refused_naming_the_setting_whatever_its_budget():
    with pytest.raises(ValueError, match="LORAFLOW_MAX_RUN_USD") as refused:
        check_budget(40.0, 1000.0, cap_usd=25.0)
    assert "$40.00" in str(refused.value) and "$25.00" in str(refused.value)
    check_budget(20.0, None, cap_usd=25.0)


def test_a_study_child_above_the_operators_cap_refuses_the_study():
    ceilings = {"cheap": CostCeiling(usd=5, gpu="RTX 4090", usd_per_hour=0.7, price_source="catalog"),
                "dear": CostCeiling(usd=60, gpu="H100", usd_per_hour=4.2, price_source="catalog")}
    with pytest.raises(ValueError, match="child dear.*LORAFLOW_MAX_RUN_USD"):
        check_study_budget(ceilings, budget_usd=None, cap_usd=50)


@pytest.mark.parametrize("value", ["{{ RUNPOD_SECRET_loraflow-hf-token-ab12cd-0123456789abcdef }}",
                                   "Bearer {{RUNPOD_SECRET_alice}}", "runpod_secret_alice", "x{{y"])
def test_a_plain_variable_that_names_an_account_secret_is_refused_naming_worker_env(value):
    with pytest.raises(ValidationError) as refused:
        WorkerSpec(env={"JUDGE_URL": value})
    assert "worker.env.JUDGE_URL" in str(refused.value) and "worker.secrets" in str(refused.value)


def test_a_run_file_whose_env_names_an_account_secret_is_refused_naming_the_key(tmp_path):
    from flows.forms.run import load_run_file

    run_file = tmp_path / "run.toml"
    run_file.write_text('artifact_store = "file:///tmp/s"\n[model]\nid = "Qwen/Qwen3-0.6B"\n[dataset]\n'
                        'hub_id = "trl-lib/Capybara"\n[worker]\n'
                        'env = { JUDGE_URL = "{{ RUNPOD_SECRET_loraflow-hf-token-ab12cd-0123456789abcdef }}" }\n')
    with pytest.raises(SpecError, match=r"worker\.env: .*`worker\.env\.JUDGE_URL`"):
        load_run_file(run_file)


def test_the_inputs_folder_is_compared_after_resolving_its_own_symlink(tmp_path, inputs):
    link = tmp_path / "inputs-link"
    os.symlink(inputs, link)
    rules(tmp_path, spec(tmp_path, dataset={"local_file": str(inputs / "train.jsonl")}), loraflow_inputs_dir=link)


# --- the server's own Secret blocks ----------------------------------------------------------------------------------


def test_a_run_naming_the_operators_hub_token_block_is_refused_naming_the_field_where_a_run_token_is_required(
        tmp_path):
    with pytest.raises(ServerRuleError) as refused:
        rules(tmp_path, spec(tmp_path, hub_token_secret="hf-token"), loraflow_require_run_token=True)
    message = str(refused.value)
    assert message.startswith("refused by this server's rules, before anything was rented: hub_token_secret: the "
                              "Prefect Secret block 'hf-token' is this server's own (this control plane's own Hugging "
                              "Face token (HF_TOKEN_BLOCK))"), message
    assert "save your own value in a Secret block of another name" in message


@pytest.mark.parametrize("block, holds", [
    ("runpod-api-key", "the RunPod API key (RUNPOD_API_KEY_BLOCK)"),
    ("loraflow-secret-key-ab12cd", "the key of this server's secret names"),
    ("hf-token", "this control plane's own Hugging Face token (HF_TOKEN_BLOCK)"),
    ("ops-hub-token", "this control plane's own Hugging Face token (HF_TOKEN_BLOCK)"),
])
def test_a_worker_secret_naming_one_of_the_servers_own_blocks_is_refused_naming_the_entry(tmp_path, block, holds):
    run = spec(tmp_path, worker={"secrets": {"JUDGE_KEY": block}})
    with pytest.raises(ServerRuleError) as refused:
        rules(tmp_path, run, hf_token_block="ops-hub-token")  # whatever the operator's other settings
    assert f"worker.secrets.JUDGE_KEY: the Prefect Secret block {block!r} is this server's own ({holds}" in \
        str(refused.value), refused.value


def test_a_run_naming_blocks_of_its_own_passes_and_every_server_block_it_names_is_named_at_once(tmp_path):
    rules(tmp_path, spec(tmp_path, hub_token_secret="alice-hf-token", worker={"secrets": {"JUDGE_KEY": "alice-judge"}}),
          loraflow_require_run_token=True)
    problems = operator_rule_problems([], hub_token_secret="runpod-api-key", settings=Settings(),
                                      worker_secrets={"A_KEY": "alice-judge", "B_KEY": "loraflow-secret-key-x1"})
    assert [p.split(":", 1)[0] for p in problems] == ["hub_token_secret", "worker.secrets.B_KEY"]


def test_the_servers_own_blocks_are_the_ones_its_settings_read():
    settings = Settings(runpod_api_key_block="ops-runpod", hf_token_block="ops-hub")
    assert set(settings.server_blocks()) == {"runpod-api-key", "ops-runpod", "hf-token", "ops-hub",
                                             "loraflow-secret-key-*"}
    assert settings.server_block_problem("hub_token_secret", "loraflow-secret-keys") is None  # no dash: not the family


def test_the_token_read_refuses_a_server_block_before_reading_any_block():
    # Where every token is read (the flows' checks, publish, merge, serve, preload): the rule holds there too, by the
    # name alone, before the block is asked for.
    with pytest.raises(HubTokenError, match=r"^hub_token_secret: the Prefect Secret block 'runpod-api-key' is this "
                                            r"server's own \(the RunPod API key"):
        Settings(runpod_api_url=LOCALPOD_URL).hub_token("runpod-api-key")


def test_the_worker_secrets_read_refuses_a_server_block_before_reading_any_block():
    with pytest.raises(RunSecretError) as refused:
        read_run_secrets({"JUDGE_KEY": "alice-judge", "RP_KEY": "runpod-api-key"})
    assert str(refused.value).startswith("worker.secrets.RP_KEY: the Prefect Secret block 'runpod-api-key' is this "
                                         "server's own (the RunPod API key"), refused.value


def test_preflight_says_which_rules_the_server_holds_runs_and_studies_to(tmp_path, monkeypatch):
    from flows.preflight import judge_server_rules

    monkeypatch.setenv("LORAFLOW_MAX_RUN_USD", "50")
    monkeypatch.setenv("LORAFLOW_MAX_STUDY_USD", "500")
    check = judge_server_rules(spec(tmp_path))
    assert check.status == "ok" and check.found == "at most $50.00 a run; at most $500.00 a study"
    failed = judge_server_rules(spec(tmp_path, worker={"secrets": {"JUDGE_KEY": "runpod-api-key"}}))
    assert failed.status == "FAIL" and failed.found.startswith("worker.secrets.JUDGE_KEY: the Prefect Secret block "
                                                               "'runpod-api-key' is this server's own")
