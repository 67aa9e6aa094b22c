"""Cancelling from the CLI, as a user would (`prefect flow-run cancel`), runs served the Prefect way
(`train.serve`, the same runner a Prefect worker uses): mid-training, and while queued for a slot."""

from __future__ import annotations

import subprocess
import sys
import tomllib

import httpx
import pytest

from tests.conftest import REPO, prefect_api, stop_process_group
from tests.test_crash_recovery_e2e import flow_env, live_endpoints, running_job, slots_in_use, wait_for
from tests.test_train_e2e import write_run_file

pytestmark = pytest.mark.timeout(900)

LEASE_S = 60


@pytest.fixture(scope="module")
def served_train(local_stack, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    env = flow_env(local_stack, LORAFLOW_SLOT_LEASE_SECONDS=LEASE_S, LORAFLOW_HEARTBEAT_SECONDS=5)
    proc = subprocess.Popen([sys.executable, "-c", "from flows.train import train; train.serve(name='e2e')"],
                            cwd=REPO, env=env, stdout=log_path.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)

    def deployment_id():
        response = httpx.get(f"{local_stack.prefect_api_url}/deployments/name/train/e2e", timeout=10)
        return response.json()["id"] if response.status_code == 200 else proc.poll() is not None and "exited"

    try:
        found = wait_for(deployment_id, 120, "the served deployment")
        assert found != "exited", log_path.read_text()
        yield found
    finally:
        stop_process_group(proc)


def start_run(stack, deployment_id: str, run_file) -> str:
    spec = tomllib.loads(run_file.read_text())
    return prefect_api(stack, "POST", f"/deployments/{deployment_id}/create_flow_run",
                       json={"parameters": {"spec": spec}}).json()["id"]


def state_of(stack, flow_run_id: str) -> dict:
    return prefect_api(stack, "GET", f"/flow_runs/{flow_run_id}").json()["state"]


def cancel_from_cli(stack, flow_run_id: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "prefect", "flow-run", "cancel", flow_run_id], cwd=REPO,
                          env=flow_env(stack), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_cancel_mid_training_deletes_the_endpoint_and_frees_the_slot(local_stack, served_train, tiny_model, tmp_path):
    run_file = write_run_file(tmp_path / "run.toml", name="e2e-cancel", model=tiny_model, store=tmp_path / "store",
                              max_steps=100_000)
    run_id = start_run(local_stack, served_train, run_file)
    endpoints = wait_for(lambda: live_endpoints(local_stack, "loraflow-e2e-cancel-"), 180, "the run's endpoint")
    wait_for(lambda: running_job(local_stack, {e["id"] for e in endpoints}), 120, "the job to start training")

    cancel_from_cli(local_stack, run_id)
    wait_for(lambda: state_of(local_stack, run_id)["type"] == "CANCELLED", 120, "the run to be cancelled")
    wait_for(lambda: not live_endpoints(local_stack, "loraflow-e2e-cancel-"), 60, "the endpoint to be deleted")
    wait_for(lambda: slots_in_use(local_stack) == 0, LEASE_S + 30, "the slot to be free")


def test_cancel_while_queued_for_a_slot_creates_nothing_and_leaks_nothing(local_stack, served_train, tiny_model, tmp_path):
    prefect_api(local_stack, "PATCH", "/v2/concurrency_limits/runpod-endpoints", json={"limit": 1})
    holder = queued = None
    try:
        holder = start_run(local_stack, served_train, write_run_file(
            tmp_path / "a.toml", name="e2e-holder", model=tiny_model, store=tmp_path / "store", max_steps=100_000))
        wait_for(lambda: live_endpoints(local_stack, "loraflow-e2e-holder-"), 180, "the holder's endpoint")
        queued = start_run(local_stack, served_train, write_run_file(
            tmp_path / "b.toml", name="e2e-queued", model=tiny_model, store=tmp_path / "store", max_steps=4))
        wait_for(lambda: state_of(local_stack, queued)["type"] == "RUNNING", 120, "the queued run to start")

        def waiting_for_slot():
            logs = prefect_api(local_stack, "POST", "/logs/filter",
                               json={"logs": {"flow_run_id": {"any_": [queued]}}}).json()
            return any("cost ceiling" in log["message"] for log in logs)

        wait_for(waiting_for_slot, 120, "the queued run to reach the slot")
        cancel_from_cli(local_stack, queued)
        wait_for(lambda: state_of(local_stack, queued)["type"] == "CANCELLED", 120, "the queued run to be cancelled")
        cancel_from_cli(local_stack, holder)
        wait_for(lambda: state_of(local_stack, holder)["type"] == "CANCELLED", 120, "the holder to be cancelled")
    finally:
        # Back to what the runs create it with on this stack (LORAFLOW_WORKER_QUOTA = localpod's quota).
        prefect_api(local_stack, "PATCH", "/v2/concurrency_limits/runpod-endpoints",
                    json={"limit": local_stack.worker_quota})
    assert [e for e in httpx.get(f"{local_stack.localpod_url}/_localpod/account").json()["endpoints"]
            if e["name"].startswith("loraflow-e2e-queued-")] == []
    wait_for(lambda: not live_endpoints(local_stack, "loraflow-e2e-holder-"), 60, "the holder's endpoint to be deleted")
    # A run killed at the instant the server granted it the slot holds it until its lease expires.
    wait_for(lambda: slots_in_use(local_stack) == 0, LEASE_S + 30, "every slot to be free")
