"""The Prefect server restarts while a run trains: the run carries on and completes, and no slot
leaks (the server keeps slot leases in filesystem storage, so they survive the restart)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO, localpod_account
from tests.test_crash_recovery_e2e import flow_env, live_endpoints, running_job, slots_in_use, wait_for
from tests.test_train_e2e import write_run_file

pytestmark = pytest.mark.timeout(600)


def test_run_survives_a_prefect_server_restart_without_leaking(local_stack, tiny_model, tmp_path, figures):
    run_file = write_run_file(tmp_path / "run.toml", name="e2e-restart", model=tiny_model, store=tmp_path / "store",
                              max_steps=400)
    log = (tmp_path / "flow.log").open("wb")
    flow = subprocess.Popen([sys.executable, "-m", "flows.train", str(run_file)], cwd=REPO, env=flow_env(local_stack),
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        endpoints = wait_for(lambda: live_endpoints(local_stack, "loraflow-e2e-restart-") or flow.poll() is not None,
                             120, "the run's endpoint")
        assert flow.poll() is None, (tmp_path / "flow.log").read_text()
        wait_for(lambda: running_job(local_stack, {e["id"] for e in endpoints}), 120, "the job to start training")
        down_s = local_stack.restart_prefect()
        figures(f"Prefect server was down {down_s:.1f} s mid-run")
        assert flow.wait(300) == 0, (tmp_path / "flow.log").read_text()[-5000:]
    finally:
        if flow.poll() is None:
            flow.kill()
    assert (tmp_path / "store" / "runs").exists()
    assert not live_endpoints(local_stack, "loraflow-e2e-restart-")
    assert slots_in_use(local_stack) == 0
    assert [j for j in localpod_account(local_stack)["jobs"] if j["endpointId"] in {e["id"] for e in endpoints}][0]["status"] == "COMPLETED"
