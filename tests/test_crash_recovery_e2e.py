"""A flow process killed with SIGKILL mid-training: no `finally`, no hook runs. The reconcile flow
sees its heartbeats stop and deletes its endpoint, and the server's lease repossessor frees its slot,
in bounded time. (What reconcile leaves alone, and live runs it must keep: `test_reconcile_e2e.py`.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO, localpod_account, prefect_api
from tests.test_train_e2e import write_run_file

pytestmark = pytest.mark.timeout(600)

LEASE_S = 60  # the shortest lease Prefect's server accepts
HEARTBEAT_S = 3
FLOW_HEARTBEAT_S = 30  # Prefect's shortest flow-run heartbeat
HEARTBEATS = {"LORAFLOW_HEARTBEAT_SECONDS": HEARTBEAT_S, "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": FLOW_HEARTBEAT_S}
"""The runs' and the reconciler's heartbeat settings here: a reconcile policy may go down to 3 × the longer."""
SILENT_AFTER_S = 3 * FLOW_HEARTBEAT_S


def wait_for(condition, timeout_s, what, interval_s=0.5):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def flow_env(stack, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "RUNPOD_"))} | stack.client_env
    return env | {k: str(v) for k, v in extra.items()}


def reconcile_process(stack, policy_json: str, **env) -> subprocess.CompletedProcess:
    """`python -m flows.reconcile POLICY_JSON` against the stack, `env` on top of its environment."""
    return subprocess.run([sys.executable, "-m", "flows.reconcile", policy_json], cwd=REPO,
                          env=flow_env(stack, **env), capture_output=True, text=True, timeout=180)


def run_reconcile(stack, policy_json: str, **env) -> str:
    proc = reconcile_process(stack, policy_json, **env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


def live_endpoints(stack, prefix: str) -> list[dict]:
    return [e for e in localpod_account(stack)["liveEndpoints"] if e["name"].startswith(prefix)]


def running_job(stack, endpoint_ids: set[str]) -> bool:
    return any(j["endpointId"] in endpoint_ids and j["status"] == "IN_PROGRESS" for j in localpod_account(stack)["jobs"])


def slots_in_use(stack) -> int:
    return prefect_api(stack, "GET", "/v2/concurrency_limits/runpod-endpoints").json()["active_slots"]


def test_sigkilled_flow_leaks_neither_endpoint_nor_slot(local_stack, tiny_model, tmp_path, figures):
    run_file = write_run_file(tmp_path / "run.toml", name="e2e-kill", model=tiny_model, store=tmp_path / "store",
                              max_steps=100_000)
    log = (tmp_path / "flow.log").open("wb")
    flow = subprocess.Popen([sys.executable, "-m", "flows.train", str(run_file)], cwd=REPO,
                            env=flow_env(local_stack, LORAFLOW_SLOT_LEASE_SECONDS=LEASE_S, **HEARTBEATS),
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        endpoints = wait_for(lambda: live_endpoints(local_stack, "loraflow-e2e-kill-") or flow.poll() is not None, 120,
                             "the run's endpoint")
        assert flow.poll() is None, (tmp_path / "flow.log").read_text()
        wait_for(lambda: running_job(local_stack, {e["id"] for e in endpoints}), 120, "the job to start training")
        assert slots_in_use(local_stack) == 1
        killed_at = time.monotonic()
        os.killpg(flow.pid, signal.SIGKILL)
        flow.wait(10)
    finally:
        if flow.poll() is None:
            os.killpg(flow.pid, signal.SIGKILL)

    # Nothing deleted it: the endpoint keeps billing until the reconciler sees the run's heartbeats stop
    # (its state stays Running: no process is left to report the crash). The shortest silence a reconcile
    # accepts here: 3 × the longer heartbeat interval; a sweep sooner keeps the endpoint.
    assert live_endpoints(local_stack, "loraflow-e2e-kill-")
    policy = f'{{"silent_after_minutes": {SILENT_AFTER_S / 60}, "min_age_minutes": 0}}'
    output = run_reconcile(local_stack, policy, **HEARTBEATS)
    assert "kept loraflow-e2e-kill-" in output and "its run is Running" in output, output
    freed: list[float] = []  # the slot's lease runs out meanwhile, whatever the reconciler does

    def slot_freed() -> bool:
        if not freed and slots_in_use(local_stack) == 0:
            freed.append(time.monotonic() - killed_at)
        return bool(freed)

    def reconciled():
        slot_freed()
        if time.monotonic() - killed_at < SILENT_AFTER_S:
            return False  # not silent long enough yet: a sweep would keep it
        run_reconcile(local_stack, policy, **HEARTBEATS)
        return not live_endpoints(local_stack, "loraflow-e2e-kill-")

    wait_for(reconciled, SILENT_AFTER_S + 120, "reconcile to delete the endpoint", interval_s=2)
    endpoint_gone_s = time.monotonic() - killed_at
    wait_for(slot_freed, LEASE_S + 60, "the slot's lease to expire")
    slot_free_s = freed[0]
    figures(f"SIGKILL recovery: endpoint deleted after {endpoint_gone_s:.1f} s, slot freed after {slot_free_s:.1f} s "
          f"(lease {LEASE_S} s, silence threshold {SILENT_AFTER_S} s)")
    assert slot_free_s <= LEASE_S + 45
