"""The shipped deployments are valid runs, and prefect.yaml agrees with the run files."""

import tomllib
from pathlib import Path

import pytest
import yaml

from flows.spec import RunSpec

REPO = Path(__file__).resolve().parent.parent


def test_prefect_yaml_qwen_parameters_match_the_qwen_run_file():
    deployments = {d["name"]: d for d in yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]}
    from_yaml = RunSpec.model_validate(deployments["qwen"]["parameters"]["spec"])
    from_toml = RunSpec.model_validate(tomllib.loads((REPO / "deployments" / "qwen.toml").read_text()))
    assert from_yaml == from_toml


def test_every_deployment_points_at_an_existing_flow():
    for deployment in yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]:
        path, _, name = deployment["entrypoint"].partition(":")
        assert f"def {name}(" in (REPO / path).read_text(), deployment["entrypoint"]


def test_prefect_yaml_reconcile_parameters_are_a_valid_policy():
    from flows.spec import ReconcilePolicy

    deployments = {d["name"]: d for d in yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]}
    policy = ReconcilePolicy.model_validate(deployments["interval"]["parameters"]["policy"])
    assert not policy.dry_run


def test_deployment_entrypoints_load_and_validate_their_parameters():
    # What a Prefect worker does with a deployment run: load the entrypoint, validate the parameters.
    from prefect.flows import load_flow_from_entrypoint

    for deployment in yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]:
        flow = load_flow_from_entrypoint(str(REPO / deployment["entrypoint"]))
        validated = flow.validate_parameters(deployment["parameters"])
        assert set(validated) == set(deployment["parameters"]), deployment["name"]


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
