"""The run's own watch against the real local stack (Prefect server, localpod, the real worker), with
runs started as plain scripts (`python -m flows.train`), which no runner or worker watches:

- a cancel through the Prefect API, as the UI's button sends it, stops the job, deletes the endpoint
  and ends the run Cancelled;
- 40 s of 500s from the job's status costs no attempt;
- RunPod's own quota error makes the run wait, not fail;
- a slot kept for an endpoint whose delete is unconfirmed outlives its attempt until it is settled, and
  such a delete does not fail a run whose results are stored.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tasks.runpod.endpoints import run_hash
from tests.conftest import REPO, localpod_account, prefect_api
from tests.test_crash_recovery_e2e import flow_env, live_endpoints, running_job, slots_in_use, wait_for
from tests.test_train_e2e import write_run_file

pytestmark = pytest.mark.timeout(900)


@contextmanager
def script_run(stack, run_file: Path, log_path: Path):
    """`python -m flows.train RUN_FILE` in the background, killed (with its process group) if still running."""
    process = subprocess.Popen([sys.executable, "-m", "flows.train", str(run_file)], cwd=REPO, env=flow_env(stack),
                               stdout=log_path.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield process
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(30)


def localpod(stack) -> httpx.Client:
    return httpx.Client(base_url=stack.localpod_url, timeout=30,
                        headers={"Authorization": f"Bearer {stack.client_env['RUNPOD_API_KEY']}"})


def leave_nothing_behind(stack, pod: httpx.Client, prefix: str, fault_id: str, records: list) -> None:
    """A delete-fault test's cleanup: its fault, its endpoints (`prefix`), and its undeleted records' slots and
    variables, so that none is left to the tests that follow."""
    pod.delete(f"/_localpod/faults/{fault_id}")
    for endpoint in live_endpoints(stack, prefix):
        pod.delete(f"/v2/serverless/{endpoint['id']}")
    for record in records:
        if record.lease_id is not None:
            prefect_api(stack, "POST", "/v2/concurrency_limits/decrement-with-lease", json={"lease_id": record.lease_id})
        httpx.delete(f"{stack.prefect_api_url}/variables/name/{record.variable_name}", timeout=30)


def flow_run_of(stack, endpoint_name: str) -> str:
    """The flow run whose run hash the endpoint's name carries (among the latest started)."""
    runs = prefect_api(stack, "POST", "/flow_runs/filter", json={"sort": "START_TIME_DESC", "limit": 50}).json()
    owners = [r["id"] for r in runs if f"-{run_hash(r['id'])}-" in endpoint_name]
    assert len(owners) == 1, (endpoint_name, [r["id"] for r in runs])
    return owners[0]


def state_of(stack, flow_run_id: str) -> dict:
    return prefect_api(stack, "GET", f"/flow_runs/{flow_run_id}").json()["state"]


def endpoints_named(stack, prefix: str) -> list[dict]:
    return [e for e in localpod_account(stack)["endpoints"] if e["name"].startswith(prefix)]


def first_endpoint(stack, prefix: str, process: subprocess.Popen, log_path: Path) -> dict:
    found = wait_for(lambda: live_endpoints(stack, prefix) or process.poll() is not None, 180, "the run's endpoint")
    assert process.poll() is None, log_path.read_text()
    return found[0]


def test_a_script_run_cancelled_through_the_api_stops_its_job_and_ends_cancelled(local_stack, tiny_model, tmp_path):
    prefix = "loraflow-e2e-apicancel-"
    run_file = write_run_file(tmp_path / "run.toml", name="e2e-apicancel", model=tiny_model, store=tmp_path / "store",
                              max_steps=100_000)
    log_path = tmp_path / "flow.log"
    with script_run(local_stack, run_file, log_path) as process:
        endpoint = first_endpoint(local_stack, prefix, process, log_path)
        wait_for(lambda: running_job(local_stack, {endpoint["id"]}), 120, "the job to start training")
        run_id = flow_run_of(local_stack, endpoint["name"])

        # What the UI's Cancel button sends: the run goes to CANCELLING; only the run itself can act on it.
        prefect_api(local_stack, "POST", f"/flow_runs/{run_id}/set_state",
                    json={"state": {"type": "CANCELLING", "name": "Cancelling", "message": "cancelled in the UI"}})
        wait_for(lambda: not live_endpoints(local_stack, prefix), 60, "the endpoint to be deleted")
        wait_for(lambda: state_of(local_stack, run_id)["type"] == "CANCELLED", 60, "the run to end Cancelled")
        assert process.wait(60) == 1, log_path.read_text()

    jobs = [j for j in localpod_account(local_stack)["jobs"] if j["endpointId"] == endpoint["id"]]
    assert [j["status"] for j in jobs] == ["CANCELLED"], jobs
    wait_for(lambda: all(w["endedAt"] for w in localpod_account(local_stack)["workers"]
                         if w["endpointId"] == endpoint["id"]), 60, "the worker to stop")
    assert len(endpoints_named(local_stack, prefix)) == 1, "a cancel starts no new attempt"
    assert slots_in_use(local_stack) == 0


def test_forty_seconds_of_status_errors_cost_no_attempt(local_stack, tiny_model, tmp_path):
    prefix = "loraflow-e2e-outage-"
    run_file = write_run_file(tmp_path / "run.toml", name="e2e-outage", model=tiny_model, store=tmp_path / "store",
                              max_steps=60)
    log_path = tmp_path / "flow.log"
    pod = localpod(local_stack)
    with script_run(local_stack, run_file, log_path) as process:
        endpoint = first_endpoint(local_stack, prefix, process, log_path)
        wait_for(lambda: any(j["endpointId"] == endpoint["id"] for j in localpod_account(local_stack)["jobs"]), 120,
                 "the job to be submitted")
        rule = pod.post("/_localpod/faults", json={"route": "status", "action": "status_500", "probability": 1.0,
                                                   "endpoint_name_prefix": prefix})
        assert rule.status_code == 201, rule.text
        try:
            time.sleep(40)
            hits = next(f["hits"] for f in pod.get("/_localpod/faults").json() if f["id"] == rule.json()["id"])
        finally:
            pod.delete(f"/_localpod/faults/{rule.json()['id']}")
        assert process.wait(300) == 0, log_path.read_text()[-5000:]

    output = log_path.read_text()
    # The watch met the outage (backoff: a few polls, not one per 2 s) and carried on.
    assert 3 <= hits <= 12, hits
    assert "status unreadable" in output
    assert len(endpoints_named(local_stack, prefix)) == 1, "the outage cost no attempt"
    assert state_of(local_stack, flow_run_of(local_stack, endpoint["name"]))["type"] == "COMPLETED"


# RunPod documents no status for its quota refusal: an API v2 client recorded 400, REST v1 answered 500. Its
# wording varies too: "... will exceed your worker quota of 10 ..." was once taken as a refused GPU class (issue 37).
@pytest.mark.parametrize(("refusal_status", "refusal_text"), [
    (400, None), (500, None),
    (400, "Max workers across all endpoints will exceed your worker quota of {quota}; set workers.max lower"),
], ids=["400", "500", "400-other-wording"])
def test_runpods_quota_error_makes_the_run_wait_then_go_on(local_stack, tiny_model, tmp_path, refusal_status,
                                                            refusal_text):
    name = f"e2e-quotawait{refusal_status}{'w' if refusal_text else ''}"
    prefix = f"loraflow-{name}-"
    pod = localpod(local_stack)
    default_text = pod.get("/_localpod/answer-shapes").json()["quota_refusal_text"]
    pod.post("/_localpod/answer-shapes", json={"quota_refusal_status": refusal_status,
                                               "quota_refusal_text": refusal_text or default_text}).raise_for_status()
    account = localpod_account(local_stack)
    room = account["workerQuota"] - sum(e["workersMax"] for e in account["liveEndpoints"])
    body = {"name": f"someone-elses-{uuid.uuid4().hex[:6]}", "type": "QUEUE", "image": "x",
            "scaling": {"type": "QUEUE_DELAY", "queueDelay": 4}, "gpu": {"pools": ["ADA_24"]},
            "workers": {"min": 0, "max": room}}
    blocker = pod.post("/v2/serverless", json=body)
    assert blocker.status_code == 201, blocker.text
    run_file = write_run_file(tmp_path / "run.toml", name=name, model=tiny_model,
                              store=tmp_path / "store", max_steps=4)
    log_path = tmp_path / "flow.log"
    try:
        with script_run(local_stack, run_file, log_path) as process:
            wait_for(lambda: "Waiting 15 s for room in RunPod's worker quota" in log_path.read_text()
                     or process.poll() is not None, 240, "the run to meet RunPod's quota error")
            assert process.poll() is None, log_path.read_text()[-5000:]
            assert endpoints_named(local_stack, prefix) == []
            pod.delete(f"/v2/serverless/{blocker.json()['id']}").raise_for_status()
            assert process.wait(300) == 0, log_path.read_text()[-5000:]
    finally:
        pod.delete(f"/v2/serverless/{blocker.json()['id']}")
        pod.post("/_localpod/answer-shapes", json={"quota_refusal_status": 400, "quota_refusal_text": default_text})
    output = log_path.read_text()
    assert "worker quota (30) is full" in output and "prefect gcl update runpod-endpoints --limit 30" in output
    # Kept for the preflight, which reads it when it is given no quota.
    named = prefect_api(local_stack, "GET", "/variables/name/runpod-named-worker-quota").json()["value"]
    assert named["quota"] == 30
    assert len(endpoints_named(local_stack, prefix)) == 1, "waiting for the quota costs no attempt"
    assert slots_in_use(local_stack) == 0


def test_a_slot_kept_for_an_undeleted_endpoint_lasts_until_the_endpoint_is_proved_gone(local_stack):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from tasks.lifecycle.quota import ensure_endpoint_limit, take_slot_lease
    from tasks.lifecycle.teardown import (
        UndeletedEndpoint,
        keep_undeleted_record,
        settle_undeleted_endpoint,
        undeleted_endpoints,
    )
    from tasks.runpod.client import RunpodClient

    name = f"loraflow-e2e-undeleted-{uuid.uuid4().hex[:12]}-a1"
    pod = localpod(local_stack)
    created = pod.post("/v2/serverless", json={
        "name": name, "type": "QUEUE", "image": "x", "scaling": {"type": "QUEUE_DELAY", "queueDelay": 4},
        "gpu": {"pools": ["ADA_24"]}, "workers": {"min": 0, "max": 1}})
    assert created.status_code == 201, created.text
    client = RunpodClient(local_stack.client_env["RUNPOD_API_KEY"], api_url=local_stack.client_env["RUNPOD_API_URL"],
                          job_url=local_stack.client_env["RUNPOD_JOB_URL"])
    with temporary_settings({PREFECT_API_URL: local_stack.prefect_api_url}), client:
        ensure_endpoint_limit()
        before = slots_in_use(local_stack)
        lease_id = take_slot_lease()
        record = UndeletedEndpoint(endpoint_name=name, endpoint_id=created.json()["id"], run_id=str(uuid.uuid4()),
                                   lease_id=lease_id, error="delete answered 500")
        try:
            assert lease_id is not None and slots_in_use(local_stack) == before + 1
            keep_undeleted_record(record)
            assert [r.endpoint_id for r in undeleted_endpoints() if r.endpoint_name == name] == [record.endpoint_id]

            # Deletes still failing: the endpoint keeps its slot (lease renewed) and its record.
            rule = pod.post("/_localpod/faults", json={"route": "delete_endpoint", "action": "status_500",
                                                       "probability": 1.0, "endpoint_name_prefix": name}).json()
            try:
                assert settle_undeleted_endpoint(client, record) is False
            finally:
                pod.delete(f"/_localpod/faults/{rule['id']}")
            kept = [r for r in undeleted_endpoints() if r.endpoint_name == name]
            assert len(kept) == 1 and "500" in kept[0].error
            assert slots_in_use(local_stack) == before + 1 and live_endpoints(local_stack, name)

            # Proved gone: the slot is free and the record dropped.
            assert settle_undeleted_endpoint(client, kept[0]) is True
            assert not live_endpoints(local_stack, name)
            assert slots_in_use(local_stack) == before
            assert [r for r in undeleted_endpoints() if r.endpoint_name == name] == []
        finally:  # whatever failed above, leave no endpoint, slot or record to the tests that follow
            pod.delete(f"/v2/serverless/{created.json()['id']}")
            if lease_id is not None:
                prefect_api(local_stack, "POST", "/v2/concurrency_limits/decrement-with-lease",
                            json={"lease_id": lease_id})
            httpx.delete(f"{local_stack.prefect_api_url}/variables/name/{record.variable_name}", timeout=30)


def test_a_run_whose_endpoint_cannot_be_deleted_completes_and_keeps_its_slot(local_stack, tiny_model, tmp_path,
                                                                             monkeypatch):
    """In this process, so the delete task's retries can be cut to one (its ~6 min schedule is the
    production one); everything else is the real flow against the stack."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    import flows.train as train_module
    import tasks.jobs.rented as rented
    from flows.reconcile import ReconcilePolicy, reconcile
    from flows.forms.run import load_run_file
    from tasks.lifecycle.teardown import undeleted_endpoints
    from tasks.runpod.client import RunpodClient

    prefix = "loraflow-e2e-nodelete-"
    # The path every rented job takes deletes its endpoint (tasks/jobs/rented.py).
    monkeypatch.setattr(rented, "delete_endpoint", rented.delete_endpoint.with_options(retries=1, retry_delay_seconds=[0]))
    for key, value in local_stack.client_env.items():
        if not key.startswith("PREFECT_"):
            monkeypatch.setenv(key, value)
    spec = load_run_file(write_run_file(tmp_path / "run.toml", name="e2e-nodelete", model=tiny_model,
                                        store=tmp_path / "store", max_steps=4))
    pod = localpod(local_stack)
    rule = pod.post("/_localpod/faults", json={"route": "delete_endpoint", "action": "status_500", "probability": 1.0,
                                               "endpoint_name_prefix": prefix}).json()
    client = RunpodClient(local_stack.client_env["RUNPOD_API_KEY"], api_url=local_stack.client_env["RUNPOD_API_URL"],
                          job_url=local_stack.client_env["RUNPOD_JOB_URL"])
    records = []
    with temporary_settings({PREFECT_API_URL: local_stack.prefect_api_url}), client:
        try:
            state = train_module.train(spec, return_state=True)
            assert state.is_completed(), state.message
            records = [r for r in undeleted_endpoints() if r.endpoint_name.startswith(prefix)]
            assert len(records) == 1 and records[0].lease_id is not None, records
            assert "500" in records[0].error
            # The endpoint still lives, so it still holds a slot, after its run ended.
            assert [e["id"] for e in live_endpoints(local_stack, prefix)] == [records[0].endpoint_id]
            assert slots_in_use(local_stack) == 1

            pod.delete(f"/_localpod/faults/{rule['id']}")
            # The reconciler retries the record's delete; a dry run only reports it.
            reconcile(ReconcilePolicy(dry_run=True))
            assert [e["id"] for e in live_endpoints(local_stack, prefix)] == [records[0].endpoint_id]
            reconcile(ReconcilePolicy(min_age_minutes=24 * 60))  # settles records; deletes no other endpoint
            assert not live_endpoints(local_stack, prefix) and slots_in_use(local_stack) == 0
            assert [r for r in undeleted_endpoints() if r.endpoint_name.startswith(prefix)] == []
        finally:  # whatever failed above, leave no fault, endpoint, slot or record to the tests that follow
            leave_nothing_behind(local_stack, pod, prefix, rule["id"], records)


@contextmanager
def _own_limit(local_stack, slots: int):
    """A limit of `slots` slots of this test's own, on the stack's server, with the client pointed at it."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from tasks.lifecycle.quota import ensure_endpoint_limit

    name = f"test-slots-{uuid.uuid4().hex[:8]}"
    with temporary_settings({PREFECT_API_URL: local_stack.prefect_api_url}):
        ensure_endpoint_limit(name, slots=slots)
        yield name


def _slot_given_back_meanwhile(name: str, gate) -> None:
    """Take a slot of `name`, and give it back meanwhile once `gate` is set."""
    from contextlib import ExitStack

    from tasks.lifecycle.quota import endpoint_slot, release_meanwhile

    held = ExitStack()
    held.enter_context(endpoint_slot(60, name=name, give_up_at=time.time() + 60))
    release_meanwhile(lambda: (gate.wait(30), held.close()))


def test_a_slot_given_back_meanwhile_is_free_once_the_flow_has_waited_for_it(local_stack):
    import threading

    from tasks.lifecycle.quota import slots_in_use as active_slots
    from tasks.lifecycle.quota import wait_for_slot_releases

    gate = threading.Event()
    with _own_limit(local_stack, slots=2) as name:
        _slot_given_back_meanwhile(name, gate)
        assert active_slots(name) == 1  # held until the release has run
        gate.set()
        wait_for_slot_releases()
        assert active_slots(name) == 0


def test_a_slot_is_taken_only_once_the_slots_this_process_gives_back_meanwhile_are(local_stack):
    import contextvars
    import threading

    from tasks.lifecycle.quota import endpoint_slot
    from tasks.lifecycle.quota import slots_in_use as active_slots

    gate, taken = threading.Event(), threading.Event()
    with _own_limit(local_stack, slots=2) as name:  # room for both: only the wait for the release holds the second
        _slot_given_back_meanwhile(name, gate)

        def take() -> None:
            with endpoint_slot(60, name=name, give_up_at=time.time() + 60):
                taken.set()

        # In a copy of this context: the thread asks the server this test's settings name.
        taker = threading.Thread(target=contextvars.copy_context().run, args=(take,))
        taker.start()
        try:
            assert not taken.wait(1.0), "a slot was taken while this process was still giving one back"
        finally:
            gate.set()
            taker.join(60)
        assert taken.is_set() and active_slots(name) == 0


def test_a_slot_that_cannot_be_given_back_meanwhile_is_a_warning_and_its_lease_runs_out(local_stack, caplog):
    from tasks.lifecycle.quota import release_meanwhile, wait_for_slot_releases

    def failing() -> None:
        raise httpx.ConnectError("the Prefect server is gone")

    with caplog.at_level("WARNING", logger="loraflow.quota"):
        release_meanwhile(failing)
        wait_for_slot_releases()
    assert "could not be given back (ConnectError: the Prefect server is gone)" in caplog.text
