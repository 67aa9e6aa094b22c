"""`prefect deployment run train/<deployment> --param ...` as a user types it, against a deployment served
the Prefect way (`train.serve`, the runner a Prefect worker uses) on the local stack: each flat parameter
changes one field of the deployment's spec, an invalid one fails the run before anything is rented,
naming the parameter, and the run is readable at a glance (name, tags, progress, summary with its curve).
The forms used here are the ones docs/running-on-runpod.md shows."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib

import httpx
import pytest

from flows.forms.overrides import RunOverrides
from tasks.reports.summary import run_title
from tests.conftest import DATASET, REPO, prefect_api, stop_process_group
from tests.test_crash_recovery_e2e import flow_env, wait_for
from tests.test_train_e2e import run_endpoints, write_run_file

pytestmark = pytest.mark.timeout(900)

DEPLOYMENT = "e2e-cli"
SERVE = "import json, sys; from flows.train import train; train.serve(name=sys.argv[1], parameters={'spec': json.loads(sys.argv[2])})"


def test_the_run_form_describes_each_override_as_the_overrides_model_does():
    from flows.train import train

    # Prefect takes a flow parameter's description from the docstring's `Args:` (a pydantic `Field` default
    # would reach the flow body as a `FieldInfo` in Prefect 3.9): the two texts must not drift apart.
    properties = train.parameters.model_dump()["properties"]
    assert [name for name, prop in properties.items() if not prop.get("description")] == []
    assert {name: " ".join(properties[name]["description"].split()) for name in RunOverrides.model_fields} == {
        name: field.description for name, field in RunOverrides.model_fields.items()}


@pytest.fixture(scope="module")
def served(local_stack, tiny_model, tmp_path_factory):
    """`train/e2e-cli`, whose parameters are a 40-step run of the tiny model; yields its folder."""
    home = tmp_path_factory.mktemp("cli")
    spec = tomllib.loads(write_run_file(home / "deployment.toml", name="e2e-cli", model=tiny_model,
                                        store=home / "store", max_steps=40).read_text())
    log_path = home / "serve.log"
    proc = subprocess.Popen([sys.executable, "-c", SERVE, DEPLOYMENT, json.dumps(spec)], cwd=REPO,
                            env=flow_env(local_stack), stdout=log_path.open("wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)

    def deployed():
        response = httpx.get(f"{local_stack.prefect_api_url}/deployments/name/train/{DEPLOYMENT}", timeout=10)
        return response.status_code == 200 or (proc.poll() is not None and "exited")

    try:
        assert wait_for(deployed, 120, "the served deployment") is True, log_path.read_text()
        yield home
    finally:
        stop_process_group(proc)


def deployment_run(stack, *params: str) -> str:
    """`prefect deployment run train/e2e-cli --param P ...`; returns the flow run's id once it has ended."""
    argv = [sys.executable, "-m", "prefect", "deployment", "run", f"train/{DEPLOYMENT}"]
    for param in params:
        argv += ["--param", param]
    proc = subprocess.run(argv, cwd=REPO, env=flow_env(stack), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    flow_run_id = re.search(r"UUID: ([0-9a-f-]{36})", proc.stdout).group(1)
    wait_for(lambda: flow_run(stack, flow_run_id)["state"]["type"] in {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"},
             600, "the run to end", interval_s=2)
    return flow_run_id


def flow_run(stack, flow_run_id: str) -> dict:
    return prefect_api(stack, "GET", f"/flow_runs/{flow_run_id}").json()


def artifacts(stack, flow_run_id: str) -> dict[str, dict]:
    return {a["key"]: a for a in prefect_api(stack, "POST", "/artifacts/filter", json={
        "artifacts": {"flow_run_id": {"any_": [flow_run_id]}}}).json()}


@pytest.fixture(scope="module")
def five_steps(local_stack, served):
    """The docs' first form: `--param max_steps=5`."""
    return deployment_run(local_stack, "max_steps=5")


def test_max_steps_param_runs_the_deployment_spec_for_that_many_steps(local_stack, served, five_steps):
    assert flow_run(local_stack, five_steps)["state"]["type"] == "COMPLETED"
    metrics = json.loads((served / "store" / "runs" / five_steps / "metrics.json").read_text())
    assert metrics["steps"] == 5


def test_the_run_is_named_and_tagged_after_what_it_trains(local_stack, tiny_model, five_steps):
    run = flow_run(local_stack, five_steps)
    assert run["name"] == run_title("e2e-cli", tiny_model.name, "sft", "RTX 4090")
    assert {"algorithm:sft", f"model:{tiny_model.name}", "gpu:RTX 4090"} <= set(run["tags"])


def test_the_progress_artifact_shows_step_loss_throughput_and_eta(local_stack, five_steps):
    progress = artifacts(local_stack, five_steps)["train-e2e-cli-progress"]
    assert progress["data"] == 100.0
    assert re.fullmatch(r"completed: step 5/5 · loss \d+\.\d{4} · [\d,]+ tokens/s · ETA 0s", progress["description"]), progress


def test_the_summary_shows_the_loss_curve_stored_with_the_run_and_links_the_run(local_stack, served, five_steps):
    summary = artifacts(local_stack, five_steps)["train-e2e-cli-summary"]["data"]
    curve = served / "store" / "runs" / five_steps / "curve.png"
    assert curve.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "![training loss by step](data:image/png;base64," in summary
    assert f"[curve.png]({curve.as_uri()})" in summary
    assert f"({(served / 'store' / 'runs' / five_steps).as_uri()})" in summary
    assert "| Cost before (worst case) |" in summary and "| Estimated cost |" in summary


def test_every_other_override_form_lands_in_its_field(local_stack, served, tiny_model):
    run_file = write_run_file(served / "other.toml", name="e2e-from-file", model=served / "no-such-model",
                              store=served / "store", max_steps=40, dataset=served / "no-such.jsonl")
    run_id = deployment_run(local_stack, f"run_file={run_file}", "name=e2e-cli-all", f"model={tiny_model}",
                            f"dataset={DATASET}", 'gpu=["4090"]', "max_steps=3", "learning_rate=0.01")
    run = flow_run(local_stack, run_id)
    assert run["state"]["type"] == "COMPLETED", run["state"]
    assert json.loads((served / "store" / "runs" / run_id / "metrics.json").read_text())["steps"] == 3
    assert run["name"] == run_title("e2e-cli-all", tiny_model.name, "sft", "RTX 4090")
    assert run_endpoints(local_stack, "e2e-from-file") == [] and len(run_endpoints(local_stack, "e2e-cli-all")) == 1


def test_an_invalid_override_fails_the_run_naming_the_parameter_before_anything_is_rented(local_stack, served):
    run_id = deployment_run(local_stack, "name=e2e-cli-bad", "max_steps=0")
    state = flow_run(local_stack, run_id)["state"]
    assert state["type"] == "FAILED"
    assert "parameter max_steps=0 (training.max_steps)" in state["message"], state["message"]
    assert run_endpoints(local_stack, "e2e-cli-bad") == []
