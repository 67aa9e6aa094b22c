"""A run on the local stack leaves the Prefect events automations match on (`tasks/reports/events.py`), read
back through the events API (`POST /events/filter`), and docs/what-a-run-shows.md's example automation is accepted
by the server and fires for a run that gave up. Which evaluations an attempt's watch announces, from the worker's
progress and its result, is checked without the stack."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from loraflow_worker.contract import TrainMetrics

from tasks.reports.events import (
    ATTEMPT_GIVEN_UP,
    ENDPOINT_CREATED,
    ENDPOINT_DELETED,
    RUN_EVALUATED,
    RUN_FINISHED,
    Evaluation,
    Evaluations,
)
from tests.conftest import REPO, prefect_api, run_train_flow
from tests.test_crash_recovery_e2e import flow_env, wait_for
from tests.test_train_e2e import run_endpoints, write_run_file

pytestmark = pytest.mark.timeout(900)

BLOCK_PLACEHOLDER = "YOUR-NOTIFICATION-BLOCK-ID"
# A webhook nobody listens on: the automation's action is attempted and fails at once, offline.
MAKE_BLOCK = ("from prefect.blocks.notifications import CustomWebhookNotificationBlock as B; "
              "print(B(name='loraflow-test', url='http://127.0.0.1:9/hook', json_data={'text': '{{body}}'})"
              ".save('loraflow-test-alerts', overwrite=True))")


def events(stack, name: str, **filters) -> list[dict]:
    """Stored events called `name` matching `filters` (an `EventFilter`'s fields), oldest first."""
    body = {"filter": {"event": {"name": [name]}, "order": "ASC", **filters}, "limit": 50}
    return prefect_api(stack, "POST", "/events/filter", json=body).json()["events"]


def wait_for_events(stack, name: str, count: int = 1, **filters) -> list[dict]:
    # The server stores events a moment after they arrive.
    return wait_for(lambda: len(found := events(stack, name, **filters)) >= count and found, 60,
                    f"{count} {name} event(s)", interval_s=1)


def related_ids(event: dict) -> set[str]:
    return {r["prefect.resource.id"] for r in event["related"]}


def readme_automation() -> dict:
    blocks = re.findall(r"```json\n(.*?)```", (REPO / "docs" / "what-a-run-shows.md").read_text(), flags=re.S)
    [automation] = [json.loads(b) for b in blocks if '"trigger"' in b]
    return automation


EVALUATION = "[evaluation]\nfraction = 0.2\nevery_steps = 2\n"


@pytest.fixture(scope="module")
def completed_home(tmp_path_factory):
    return tmp_path_factory.mktemp("events-ok")


@pytest.fixture(scope="module")
def completed_run(local_stack, tiny_model, completed_home):
    """4 steps, evaluated before the first, at step 2 and at step 4."""
    run = run_train_flow(local_stack, write_run_file(completed_home / "run.toml", name="e2e-events", model=tiny_model,
                                                     store=completed_home / "store", max_steps=4, extra=EVALUATION))
    assert run.returncode == 0, run.output
    return run.flow_run_id


@pytest.fixture(scope="module")
def readme_automation_id(local_stack):
    block = subprocess.run([sys.executable, "-c", MAKE_BLOCK], cwd=REPO, env=flow_env(local_stack),
                           capture_output=True, text=True, timeout=120)
    assert block.returncode == 0, block.stdout + block.stderr
    block_id = block.stdout.split()[-1]
    automation = json.loads(json.dumps(readme_automation()).replace(BLOCK_PLACEHOLDER, block_id))
    automation_id = prefect_api(local_stack, "POST", "/automations/", json=automation).json()["id"]
    try:
        yield automation_id
    finally:
        prefect_api(local_stack, "DELETE", f"/automations/{automation_id}")
        prefect_api(local_stack, "DELETE", f"/block_documents/{block_id}")


@pytest.fixture(scope="module")
def failed_run(local_stack, readme_automation_id, tmp_path_factory):
    home = tmp_path_factory.mktemp("events-fail")
    not_a_model = home / "not-a-model"
    not_a_model.mkdir()
    run = run_train_flow(local_stack, write_run_file(home / "run.toml", name="e2e-events-fail", model=not_a_model,
                                                     store=home / "store"))
    assert run.returncode == 1, run.output
    return run.flow_run_id


def test_a_run_announces_its_endpoint_created_then_deleted(local_stack, completed_run):
    [endpoint] = run_endpoints(local_stack, "e2e-events")
    resource = {"id": [f"loraflow.endpoint.{endpoint['id']}"]}
    [created] = wait_for_events(local_stack, ENDPOINT_CREATED, resource=resource)
    [deleted] = wait_for_events(local_stack, ENDPOINT_DELETED, resource=resource)
    for event in (created, deleted):
        assert event["resource"]["prefect.resource.name"] == endpoint["name"]
        # The run, as loraflow names it and as Prefect does: the event shows on the flow run's page.
        assert {f"loraflow.run.{completed_run}", f"prefect.flow-run.{completed_run}"} <= related_ids(event)
    assert created["occurred"] < deleted["occurred"]


def test_a_completed_run_announces_its_end_with_its_cost(local_stack, completed_run):
    [finished] = wait_for_events(local_stack, RUN_FINISHED, resource={"id": [f"loraflow.run.{completed_run}"]})
    assert finished["resource"]["loraflow.status"] == "completed"
    assert finished["resource"]["prefect.resource.name"] == "e2e-events"
    payload = finished["payload"]
    assert payload["attempts"] == 1 and payload["cost_usd"] >= 0 and payload["cost_ceiling_usd"] > 0, payload
    assert payload["adapter_url"].endswith(f"runs/{completed_run}/adapter")
    assert f"prefect.flow-run.{completed_run}" in related_ids(finished)


def test_a_run_announces_each_evaluation_once_with_its_step_and_eval_loss(local_stack, completed_run, completed_home):
    stored = TrainMetrics.model_validate_json(
        (completed_home / "store" / "runs" / completed_run / "metrics.json").read_text())
    assert [step for step, _ in stored.eval_loss] == [0, 2, 4]
    evaluated = wait_for_events(local_stack, RUN_EVALUATED, count=3, resource={"id": [f"loraflow.run.{completed_run}"]})
    assert sorted((event["payload"]["step"], event["payload"]["eval_loss"]) for event in evaluated) == stored.eval_loss
    for event in evaluated:
        assert event["resource"]["prefect.resource.name"] == "e2e-events"
        assert event["payload"]["total_steps"] == 4
        assert f"prefect.flow-run.{completed_run}" in related_ids(event)  # shown on the flow run's page


def job_output(eval_loss: list[tuple[int, float]], resumed_from_step: int = 0) -> dict:
    metrics = TrainMetrics(steps=8, losses=[], eval_loss=eval_loss, first_loss=None, final_loss=None, tokens=0,
                           wall_seconds=1.0, device="cpu")
    return {"run_id": "r1", "attempt": 1, "run_prefix": "runs/r1", "adapter_path": "runs/r1/adapter",
            "metrics": metrics.model_dump(mode="json"), "resumed_from_step": resumed_from_step}


def test_each_evaluation_is_announced_once_as_the_progress_shows_it_or_else_from_the_result():
    seen = Evaluations()
    first = {"stage": "training", "step": 0, "total_steps": 8, "eval_step": 0, "eval_loss": 6.9}
    assert seen.from_progress(first) == [Evaluation(0, {"eval_loss": 6.9}, 8)]
    assert seen.from_progress(first | {"step": 1, "loss": 6.4}) == []  # the same evaluation, still the latest
    assert seen.from_progress({"stage": "training", "step": 4, "total_steps": 8, "eval_step": 4,
                               "eval_loss": 3.1}) == [Evaluation(4, {"eval_loss": 3.1}, 8)]
    # Step 2's came and went between two polls, step 8's as the job ended.
    assert seen.from_result(job_output([(0, 6.9), (2, 4.4), (4, 3.1), (6, 2.5), (8, 2.0)])) == [
        Evaluation(2, {"eval_loss": 4.4}, 8), Evaluation(6, {"eval_loss": 2.5}, 8),
        Evaluation(8, {"eval_loss": 2.0}, 8)]


def test_a_resumed_attempt_announces_none_of_the_evaluations_before_its_checkpoint():
    announced = Evaluations().from_result(job_output([(0, 6.9), (2, 4.4), (4, 3.1), (6, 2.5)], resumed_from_step=4))
    assert [evaluation.step for evaluation in announced] == [4, 6]


def test_a_dpo_evaluation_names_its_held_out_accuracy_and_margin_as_metrics_json_does():
    [evaluation] = Evaluations().from_progress({"stage": "training", "step": 8, "eval_step": 8, "eval_loss": 0.5,
                                                "eval_reward_accuracy": 0.75, "eval_reward_margin": 1.5})
    assert evaluation.values == {"eval_loss": 0.5, "eval_reward_accuracies": 0.75, "eval_reward_margins": 1.5}


def test_no_evaluation_is_announced_before_the_worker_evaluates():
    assert Evaluations().from_progress({"stage": "training", "step": 3, "total_steps": 8, "loss": 2.0}) == []


def test_a_completed_run_gives_up_no_attempt(local_stack, completed_run):
    wait_for_events(local_stack, RUN_FINISHED, resource={"id": [f"loraflow.run.{completed_run}"]})
    assert events(local_stack, ATTEMPT_GIVEN_UP, resource={"id": [f"loraflow.run.{completed_run}"]}) == []


def test_a_failed_attempt_is_given_up_naming_its_outcome_and_reason(local_stack, failed_run):
    [given_up] = wait_for_events(local_stack, ATTEMPT_GIVEN_UP, resource={"id": [f"loraflow.run.{failed_run}"]})
    assert given_up["resource"]["loraflow.outcome"] == "failed"
    assert given_up["resource"]["loraflow.retry"] == "false"
    assert given_up["payload"]["reason"] == "failed: not retried"
    assert "not-a-model" in given_up["payload"]["error"]
    [endpoint] = run_endpoints(local_stack, "e2e-events-fail")
    assert f"loraflow.endpoint.{endpoint['id']}" in related_ids(given_up)


def test_a_failed_run_announces_its_end_as_failed(local_stack, failed_run):
    [finished] = wait_for_events(local_stack, RUN_FINISHED, resource={"id": [f"loraflow.run.{failed_run}"]})
    assert finished["resource"]["loraflow.status"] == "failed"
    assert finished["payload"]["attempts"] == 1
    assert "JobFailedError" in finished["payload"]["message"]


def test_the_readme_automation_fires_for_a_run_that_gave_up(local_stack, readme_automation_id, failed_run):
    [given_up] = wait_for_events(local_stack, ATTEMPT_GIVEN_UP, resource={"id": [f"loraflow.run.{failed_run}"]})
    [fired] = wait_for_events(local_stack, "prefect.automation.triggered",
                              resource={"id": [f"prefect.automation.{readme_automation_id}"]})
    assert f"prefect.event.{given_up['id']}" in related_ids(fired)


def test_the_readme_automation_is_what_the_server_stores(local_stack, readme_automation_id):
    stored = prefect_api(local_stack, "GET", f"/automations/{readme_automation_id}").json()
    expected = readme_automation()["trigger"]
    assert stored["trigger"]["expect"] == expected["expect"] and stored["trigger"]["match"] == expected["match"]
