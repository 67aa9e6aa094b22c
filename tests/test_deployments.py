"""The shipped deployments are valid runs, and prefect.yaml agrees with the run files."""

import tomllib
from pathlib import Path

import pytest
import yaml

from flows.forms.run import RunSpec
from flows.forms.study import StudySpec, expand

REPO = Path(__file__).resolve().parent.parent


def shipped_deployments() -> dict[str, dict]:
    """prefect.yaml's deployments by their full name, `<flow>/<deployment>` (`train/qwen` and `serve/qwen` differ)."""
    return {f"{d['entrypoint'].partition(':')[2]}/{d['name']}": d
            for d in yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]}


def test_prefect_yaml_qwen_parameters_match_the_qwen_run_file():
    deployments = shipped_deployments()
    from_yaml = RunSpec.model_validate(deployments["train/qwen"]["parameters"]["spec"])
    from_toml = RunSpec.model_validate(tomllib.loads((REPO / "deployments" / "qwen.toml").read_text()))
    assert from_yaml == from_toml


def test_prefect_yaml_grpo_qwen_parameters_match_the_grpo_qwen_run_file():
    deployments = shipped_deployments()
    from_yaml = RunSpec.model_validate(deployments["train/grpo-qwen"]["parameters"]["spec"])
    from_toml = RunSpec.model_validate(tomllib.loads((REPO / "deployments" / "grpo-qwen.toml").read_text()))
    assert from_yaml == from_toml
    assert from_toml.algorithm == "grpo" and from_toml.grpo is not None


def test_prefect_yaml_study_parameters_match_the_study_run_file_and_every_child_is_valid():
    deployments = shipped_deployments()
    from_yaml = StudySpec.model_validate(deployments["study/qwen-lr"]["parameters"]["spec"])
    from_toml = StudySpec.model_validate(tomllib.loads((REPO / "deployments" / "qwen-study.toml").read_text()))
    assert from_yaml == from_toml
    assert len(expand(from_toml)) == 6


def test_prefect_yaml_serve_parameters_match_the_serve_file():
    from flows.forms.serve import ServeSpec

    deployments = shipped_deployments()
    from_yaml = ServeSpec.model_validate(deployments["serve/qwen"]["parameters"]["spec"])
    from_toml = ServeSpec.model_validate(tomllib.loads((REPO / "deployments" / "qwen-serve.toml").read_text()))
    assert from_yaml == from_toml


def test_prefect_yaml_evaluate_parameters_match_the_evaluate_file_and_its_task_file_passes_the_check(tmp_path):
    from flows.forms.evaluate import SECTION, EvaluateSpec
    from flows.train_check import check_task_inputs
    from tasks.storage.run_files import read_run_files

    deployments = shipped_deployments()
    from_yaml = EvaluateSpec.model_validate(deployments["evaluate/qwen"]["parameters"]["spec"])
    from_toml = EvaluateSpec.model_validate(tomllib.loads((REPO / "deployments" / "qwen-evaluate.toml").read_text()))
    assert from_yaml == from_toml
    # A deployment runs in the checkout (the pull step), where the relative task file starts.
    files = read_run_files(from_toml.evaluate.task_paths(), tmp_path, base_dir=REPO)
    assert check_task_inputs(SECTION, from_toml.evaluate.tasks, None, files, {}).rows == {"capitals": 8}


def test_the_grpo_deployments_reward_patterns_find_a_boxed_answer():
    from loraflow_worker.training.rewards import format_reward, normalized_match

    spec = RunSpec.model_validate(tomllib.loads((REPO / "deployments" / "grpo-qwen.toml").read_text()))
    match, boxed, _ = spec.grpo.rewards
    completions = ["so x = 2, hence \\boxed{\\frac{1}{2}}.", "it is 1/2"]
    assert normalized_match(completions, column=match.column, pattern=match.pattern, solution=["\\frac{1}{2}"] * 2) == [1.0, 0.0]
    assert format_reward(completions, pattern=boxed.pattern) == [1.0, 0.0]


def test_the_reward_files_deployments_name_exist_and_define_their_functions(tmp_path):
    from tasks.storage.rewards import check_reward_files
    from tasks.storage.run_files import read_run_files

    for path in (REPO / "deployments").glob("*.toml"):
        data = tomllib.loads(path.read_text())
        if "serve" in data or "evaluate" in data:  # a serve or evaluate file: no rewards
            continue
        spec = (StudySpec if "study" in data else RunSpec).model_validate(data)
        # A deployment runs in the checkout (the pull step), where relative reward files start.
        rewards = spec.grpo.rewards if spec.grpo else []
        paths = [(field, path) for field, path in spec.local_paths() if field.startswith("grpo.rewards")]
        check_reward_files(rewards, read_run_files(paths, tmp_path / path.stem, base_dir=REPO))


def test_every_deployment_points_at_an_existing_flow():
    for deployment in yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]:
        path, _, name = deployment["entrypoint"].partition(":")
        assert f"def {name}(" in (REPO / path).read_text(), deployment["entrypoint"]


def test_prefect_yaml_reconcile_parameters_are_a_valid_policy():
    from flows.reconcile import ReconcilePolicy

    deployments = shipped_deployments()
    policy = ReconcilePolicy.model_validate(deployments["reconcile/interval"]["parameters"]["policy"])
    assert not policy.dry_run


def test_deployment_entrypoints_load_and_validate_their_parameters():
    # What a Prefect worker does with a deployment run: load the entrypoint, validate the parameters.
    from prefect.flows import load_flow_from_entrypoint

    for deployment in yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]:
        flow = load_flow_from_entrypoint(str(REPO / deployment["entrypoint"]))
        validated = flow.validate_parameters(deployment["parameters"])
        assert set(deployment["parameters"]) <= set(validated), deployment["name"]  # the rest: their defaults


def test_the_pull_step_enters_the_checkout_without_any_setting(tmp_path, monkeypatch):
    from prefect.utilities.importtools import import_object

    monkeypatch.delenv("LORAFLOW_HOME", raising=False)
    monkeypatch.chdir(tmp_path)
    [step] = yaml.safe_load((REPO / "prefect.yaml").read_text())["pull"]
    [(name, kwargs)] = step.items()
    outputs = import_object(name)(**kwargs)  # as Prefect's worker runs a pull step
    assert Path.cwd() == REPO and outputs["directory"] == str(REPO)


def test_the_pull_step_refuses_a_loraflow_home_that_is_not_a_checkout_naming_the_variable(tmp_path, monkeypatch):
    from tasks.deploy_steps import set_working_directory_to_checkout

    monkeypatch.setenv("LORAFLOW_HOME", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=f"LORAFLOW_HOME={tmp_path} is not a loraflow checkout"):
        set_working_directory_to_checkout()


def test_prefect_deploy_all_creates_every_deployment_the_nightly_schedule_and_one_reconcile_at_a_time(local_stack):
    import os
    import subprocess
    import sys

    from tests.conftest import prefect_api

    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")} | local_stack.client_env
    prefect = [sys.executable, "-m", "prefect", "--no-prompt"]
    pool = subprocess.run([*prefect, "work-pool", "create", "loraflow", "--type", "process", "--overwrite"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert pool.returncode == 0, pool.stdout + pool.stderr
    try:
        deploy = subprocess.run([*prefect, "deploy", "--all"], cwd=REPO, env=env, capture_output=True, text=True,
                                timeout=300)
        assert deploy.returncode == 0, deploy.stdout[-3000:] + deploy.stderr[-3000:]
        deployments = {d["name"]: d for d in prefect_api(local_stack, "POST", "/deployments/filter", json={}).json()}
        assert {"qwen", "grpo-qwen", "qwen-lr", "interval", "nightly"} <= set(deployments)
        [schedule] = deployments["nightly"]["schedules"]
        assert schedule["schedule"]["cron"] == "0 3 * * *" and schedule["schedule"]["timezone"] == "Europe/Berlin"
        assert schedule["active"]
        assert deployments["interval"]["global_concurrency_limit"]["limit"] == 1
        assert deployments["interval"]["concurrency_options"]["collision_strategy"] == "CANCEL_NEW"
    finally:
        # Their scheduled runs would sit in the shared server for the session's other tests to see.
        shipped = [d["name"] for d in yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]]
        for deployment in prefect_api(local_stack, "POST", "/deployments/filter", json={
                "deployments": {"name": {"any_": shipped}}}).json():
            prefect_api(local_stack, "DELETE", f"/deployments/{deployment['id']}")
