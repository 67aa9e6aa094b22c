"""The reconciler on a shared RunPod account and a busy Prefect server, against the real local stack:
it judges only its own control plane's endpoints, refuses a silence threshold below the heartbeats, tells a
live run from a dead one by heartbeat events (not log lines), reads every live run however many pages they
fill, and every page of RunPod's endpoint list, survives a failing `/health`, and fills in the billed cost RunPod had not given when a run ended."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone

import httpx
import pytest

from bench.chaos_scenarios import FAULT_INJECTION_DIR, STEP_SECONDS
from tasks.lifecycle.liveness import ENDPOINT_HEARTBEAT, ENDPOINT_RESOURCE, FLOW_RUN_RESOURCE, newest_heartbeats
from tasks.lifecycle.pending_billing import pending_billings
from tasks.lifecycle.reconcile import live_flow_runs
from tasks.runpod.endpoints import endpoint_name, parse_endpoint_name, run_hash
from tasks.runpod.live_catalog import READ_TRIES
from tasks.settings import NAMESPACE_VARIABLE, Settings
from tests.conftest import REPO
from tests.test_crash_recovery_e2e import (
    flow_env,
    live_endpoints,
    reconcile_process,
    run_reconcile,
    running_job,
    wait_for,
)
from tests.test_train_e2e import write_run_file

pytestmark = pytest.mark.timeout(900)

LIVE_RUNS = 260  # past the server's default page size of 200


@contextmanager
def prefect_client(stack):
    """Prefect's own sync client on the stack's server (it retries 429 and 503 itself)."""
    from prefect import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: stack.prefect_api_url}), get_client(sync_client=True) as client:
        yield client


def our_namespace(stack) -> str:
    with prefect_client(stack):
        return Settings().control_plane_namespace()


def localpod(stack) -> httpx.Client:
    return httpx.Client(base_url=stack.localpod_url, timeout=30,
                        headers={"Authorization": f"Bearer {stack.client_env['RUNPOD_API_KEY']}"})


def create_endpoint_at_localpod(pod: httpx.Client, name: str) -> str:
    body = {"name": name, "type": "QUEUE", "scaling": {"type": "QUEUE_DELAY", "queueDelay": 4}, "image": "x",
            "gpu": {"pools": ["ADA_24"]}, "workers": {"min": 0, "max": 1}}
    response = pod.post("/v2/serverless", json=body)
    assert response.status_code == 201, response.text
    return response.json()["id"]


NAMESPACE_OF_THIS_PROCESS = "from tasks.settings import Settings; print(Settings().control_plane_namespace())"


def test_the_namespace_is_made_once_per_server_and_an_explicit_one_wins(local_stack, monkeypatch):
    from prefect.client.schemas.actions import VariableCreate, VariableUpdate

    original = our_namespace(local_stack)
    assert our_namespace(local_stack) == original
    with prefect_client(local_stack) as client:
        assert client.read_variable_by_name(NAMESPACE_VARIABLE).value == original
        try:
            # A server without the Variable: processes starting together all end up with the one tag made.
            client.delete_variable_by_name(NAMESPACE_VARIABLE)
            procs = [subprocess.Popen([sys.executable, "-c", NAMESPACE_OF_THIS_PROCESS], cwd=REPO,
                                      env=flow_env(local_stack), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True) for _ in range(3)]
            outputs = [proc.communicate(timeout=120)[0] for proc in procs]
            assert all(proc.returncode == 0 for proc in procs), outputs
            made = client.read_variable_by_name(NAMESPACE_VARIABLE).value
            assert [out.strip().splitlines()[-1] for out in outputs] == [made] * 3

            client.update_variable(VariableUpdate(name=NAMESPACE_VARIABLE, value="Not A Tag"))
            with pytest.raises(RuntimeError, match="fix it, or set LORAFLOW_NAMESPACE"):
                our_namespace(local_stack)
        finally:
            if client.read_variable_by_name(NAMESPACE_VARIABLE) is None:
                client.create_variable(VariableCreate(name=NAMESPACE_VARIABLE, value=original))
            else:
                client.update_variable(VariableUpdate(name=NAMESPACE_VARIABLE, value=original))
    monkeypatch.setenv("LORAFLOW_NAMESPACE", "pinned")
    assert our_namespace(local_stack) == "pinned"


def test_reconcile_judges_only_its_own_control_planes_endpoints(local_stack):
    ours = our_namespace(local_stack)
    other = "zz9plur" if ours != "zz9plur" else "zz9plus"
    names = {
        # Made by another Prefect server on the same account: its run is live there, unknown here.
        "other": endpoint_name(str(uuid.uuid4()), 1, "e2e-other", namespace=other),
        # Named before control-plane tags: nobody can tell whose it is.
        "untagged": f"loraflow-e2e-untagged-{run_hash(str(uuid.uuid4()))}-a1",
        "foreign": "someone-elses-inference",
        # Ours, and no run of ours owns them: orphans.
        "orphan": endpoint_name(str(uuid.uuid4()), 1, "e2e-orphan", namespace=ours),
        "sick": endpoint_name(str(uuid.uuid4()), 1, "e2e-sick", namespace=ours),
    }
    with localpod(local_stack) as pod:
        ids = {key: create_endpoint_at_localpod(pod, name) for key, name in names.items()}
        # Every `/health` of the sick one fails; it used to abort the whole sweep.
        fault = pod.post("/_localpod/faults", json={"route": "health", "action": "status_500", "probability": 1.0,
                                                    "endpoint_name_prefix": "loraflow-e2e-sick-"})
        assert fault.status_code == 201, fault.text

        def alive(key):
            return any(e["id"] == ids[key] for e in live_endpoints(local_stack, ""))

        try:
            # Below 3 × the heartbeat intervals in force (Prefect's default flow-run heartbeat, 180 s): refused,
            # the flow Failed before it read or deleted anything.
            refused = reconcile_process(local_stack, '{"silent_after_minutes": 0.25, "min_age_minutes": 0}')
            output = refused.stdout + refused.stderr
            assert refused.returncode != 0, output
            assert ("silent_after_minutes=0.25 (15 s) is below 3 × the heartbeat interval in force (3 × 180 s = "
                    "540 s, PREFECT_FLOWS_HEARTBEAT_FREQUENCY; LORAFLOW_HEARTBEAT_SECONDS is 60 s)") in output, output
            assert "Finished in state Failed" in output and "set it to at least 9 min" in output, output
            assert all(alive(key) for key in names)

            output = run_reconcile(local_stack, '{"dry_run": true, "min_age_minutes": 0}')
            assert f"would delete (dry run) {names['orphan']}" in output
            assert f"kept {names['other']}: another control plane's (tag {other}; ours is {ours})" in output
            assert all(alive(key) for key in names)

            output = run_reconcile(local_stack, '{"min_age_minutes": 0}')
            assert f"kept {names['untagged']}: no control-plane tag" in output
            assert f"deleted {names['sick']}" in output and "jobs: /health failed: ServerError" in output
            assert not alive("orphan") and not alive("sick")
            assert alive("other") and alive("untagged") and alive("foreign")
        finally:
            pod.delete(f"/_localpod/faults/{fault.json()['id']}")
            for endpoint_id in ids.values():
                pod.delete(f"/v2/serverless/{endpoint_id}")


def test_reconcile_reads_every_page_of_the_endpoint_list(local_stack):
    """RunPod pages its lists (1000 by default); here localpod pages at 2, so the orphan is on the third page."""
    ours = our_namespace(local_stack)
    tag = uuid.uuid4().hex[:6]
    fillers = [f"someone-elses-filler-{tag}-{n}" for n in range(4)]
    orphan = endpoint_name(str(uuid.uuid4()), 1, "e2e-paged-orphan", namespace=ours)
    foreign = f"someone-elses-paged-{tag}"
    with localpod(local_stack) as pod:
        ids = {name: create_endpoint_at_localpod(pod, name) for name in [*fillers, orphan, foreign]}
        try:
            pod.post("/_localpod/answer-shapes", json={"page_size": 2}).raise_for_status()
            first = pod.get("/v2/serverless").json()
            second = pod.get("/v2/serverless", params={"cursor": first["pagination"]["nextCursor"]}).json()
            assert ids[orphan] not in {e["id"] for e in first["endpoints"] + second["endpoints"]}

            output = run_reconcile(local_stack, '{"min_age_minutes": 0}')
            assert f"deleted {orphan}" in output, output
            live = {e["id"] for e in live_endpoints(local_stack, "")}
            assert ids[orphan] not in live and ids[foreign] in live and all(ids[f] in live for f in fillers)
        finally:
            pod.post("/_localpod/answer-shapes", json={"page_size": 1000})
            for endpoint_id in ids.values():
                pod.delete(f"/v2/serverless/{endpoint_id}")


BEATING_FLOW = '''
import sys, time
from prefect import flow
from prefect.runtime import flow_run
from tasks.lifecycle.liveness import beat
from tasks.runpod.models import Endpoint

@flow
def beating(endpoint_id: str):
    endpoint = Endpoint.model_validate({"id": endpoint_id, "name": "loraflow-beat-test",
                                        "workers": {"min": 0, "max": 1}, "createdAt": "2026-11-30T00:00:00Z"})
    assert beat(endpoint, "IN_PROGRESS", interval_s=60) is not None
    assert beat(endpoint, "IN_PROGRESS", interval_s=60) is None  # too soon: one event a minute at most
    time.sleep(3)  # Prefect's own heartbeat thread sends its first beat as the flow starts
    print("FLOW RUN", flow_run.id, flush=True)

beating(sys.argv[1])
'''


def test_heartbeats_come_back_per_run_and_per_endpoint_with_logging_off(local_stack):
    endpoint_id = f"beat{uuid.uuid4().hex[:8]}"
    started = datetime.now(timezone.utc)
    env = flow_env(local_stack, PREFECT_LOGGING_LEVEL="WARNING", PREFECT_LOGGING_TO_API_ENABLED="false")
    proc = subprocess.run([sys.executable, "-c", BEATING_FLOW, endpoint_id], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    flow_run_id = proc.stdout.split("FLOW RUN ")[1].split()[0]

    with prefect_client(local_stack) as client:
        def read():
            beats = newest_heartbeats(client, since=started - timedelta(minutes=1), until=datetime.now(timezone.utc))
            return beats if endpoint_id in beats.endpoints and flow_run_id in beats.flow_runs else None

        beats = wait_for(read, 60, "both heartbeats to be stored", interval_s=1)
        assert started - timedelta(seconds=5) < beats.endpoints[endpoint_id] < datetime.now(timezone.utc)

        from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter

        # limit: the client's default (100) is above what the server accepts (50).
        [event] = client.read_events(EventFilter(event=EventNameFilter(name=[ENDPOINT_HEARTBEAT]),
                                                 resource=EventResourceFilter(id=[ENDPOINT_RESOURCE + endpoint_id])),
                                     limit=50).events
    # Prefect ties it to the run that sent it: it shows on the run's page.
    assert f"{FLOW_RUN_RESOURCE}{flow_run_id}" in {r.id for r in event.related}
    # It says how often it comes, and how often its run's flow-run heartbeat does (Prefect's default here).
    assert event.payload == {"job_status": "IN_PROGRESS", "interval_s": 60, "flow_run_interval_s": 180}


@pytest.fixture(scope="module")
def many_live_runs(local_stack):
    """LIVE_RUNS running flow runs of a throwaway flow, plus a late, an upcoming and a finished one;
    all ended afterwards."""
    from prefect.states import Cancelled

    now = datetime.now(timezone.utc)

    def scheduled(at):
        return {"type": "SCHEDULED", "name": "Scheduled", "state_details": {"scheduled_time": at.isoformat()}}

    with prefect_client(local_stack) as client:
        flow_id = str(client.create_flow_from_name(f"paging-{uuid.uuid4().hex[:8]}"))

        def create(state):
            return client.request("POST", "/flow_runs/", json={"flow_id": flow_id, "state": state}).json()["id"]

        runs = {"running": [create({"type": "RUNNING", "name": "Running"}) for _ in range(LIVE_RUNS)],
                "late": create(scheduled(now - timedelta(hours=1))),
                "upcoming": create(scheduled(now + timedelta(hours=1))),
                "done": create({"type": "COMPLETED", "name": "Completed"})}
        try:
            yield runs
        finally:
            for run_id in runs["running"] + [runs["late"], runs["upcoming"]]:
                client.set_flow_run_state(run_id, Cancelled(), force=True)


def test_every_live_run_is_read_past_the_servers_page_size(local_stack, many_live_runs):
    with prefect_client(local_stack) as client:
        found = {str(r.id) for r in live_flow_runs(client, datetime.now(timezone.utc))}
    assert set(many_live_runs["running"]) <= found
    assert many_live_runs["late"] in found  # due: a run waiting to retry may still hold an endpoint
    assert many_live_runs["upcoming"] not in found and many_live_runs["done"] not in found


class EndingRunsAfterTheFirstPage:
    """A Prefect client through which, as soon as the first page of flow runs is read, some runs of that
    page end (as runs finishing during a sweep do)."""

    def __init__(self, client, ours: set[str], how_many: int):
        self.client, self.ours, self.how_many, self.ended = client, ours, how_many, []

    def read_flow_runs(self, **kwargs):
        from prefect.states import Completed

        page = self.client.read_flow_runs(**kwargs)
        if not self.ended:
            for run in [r for r in page if str(r.id) in self.ours][: self.how_many]:
                self.client.set_flow_run_state(run.id, Completed(), force=True)
                self.ended.append(str(run.id))
        return page


def test_runs_ending_between_pages_hide_no_live_run(local_stack, many_live_runs):
    # Paging by offset would skip one live run for every run that ended after the first page; the
    # skipped runs' endpoints would look orphaned and be deleted mid-training.
    ours = set(many_live_runs["running"])
    with prefect_client(local_stack) as client:
        ending = EndingRunsAfterTheFirstPage(client, ours, how_many=30)
        found = {str(r.id) for r in live_flow_runs(ending, datetime.now(timezone.utc))}
    assert len(ending.ended) == 30
    assert ours - set(ending.ended) <= found


WARNING_ONLY_STEPS = 180
WARNING_ONLY_STEP_S = 1.0
"""The quiet run's steps last at least this long (the fault module's slow-step switch): at least 3 min of training
whatever the machine's speed, and the sweep comes ~105 s after the run starts (2,500 plain steps once ended in 38 s
on a quiet machine)."""
QUIET_HEARTBEATS = {"LORAFLOW_HEARTBEAT_SECONDS": 2, "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": 30}
"""The reconciler's heartbeat settings in the quiet-run test: its threshold may go down to 3 × 30 s."""


def test_a_run_that_logs_only_warnings_keeps_its_endpoint_and_completes(local_stack, tiny_model, tmp_path, figures):
    # Reconcile with a 90 s silence threshold (the least its heartbeat settings allow) once the run has been Running
    # for longer than that without a single INFO log line reaching Prefect: judged by its log, it would look dead.
    # Prefect's own flow-run heartbeat is slowed to 10 min in the run, so what keeps the endpoint is the job watch's
    # endpoint heartbeat. Then RunPod's billing fails as the run reads it: the summary says the cost is pending,
    # and the next sweep fills it in.
    silent_after_s = 3 * QUIET_HEARTBEATS["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"]
    run_file = write_run_file(tmp_path / "run.toml", name="e2e-quiet", model=tiny_model, store=tmp_path / "store",
                              max_steps=WARNING_ONLY_STEPS)
    env = flow_env(local_stack, PREFECT_LOGGING_LEVEL="WARNING", PREFECT_FLOWS_HEARTBEAT_FREQUENCY=600,
                   LORAFLOW_HEARTBEAT_SECONDS=2)
    log_path = tmp_path / "flow.log"
    slow = httpx.post(f"{local_stack.localpod_url}/_localpod/worker-faults", timeout=10, json={
        "action": "env", "endpoint_name_prefix": "loraflow-e2e-quiet-",
        "env": {"PYTHONPATH": str(FAULT_INJECTION_DIR), STEP_SECONDS: str(WARNING_ONLY_STEP_S)}}).raise_for_status()
    billing_fault = None
    flow = subprocess.Popen([sys.executable, "-m", "flows.train", str(run_file)], cwd=REPO, env=env,
                            stdout=log_path.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        endpoints = wait_for(lambda: live_endpoints(local_stack, "loraflow-e2e-quiet-") or flow.poll() is not None,
                             180, "the run's endpoint")
        assert flow.poll() is None, log_path.read_text()
        [endpoint] = endpoints
        wait_for(lambda: running_job(local_stack, {endpoint["id"]}), 180, "the job to start training")
        wanted = parse_endpoint_name(endpoint["name"]).run_hash
        with prefect_client(local_stack) as client:
            run = next(r for r in live_flow_runs(client, datetime.now(timezone.utc)) if run_hash(str(r.id)) == wanted)
            running_since = run.state.timestamp
            wait_for(lambda: datetime.now(timezone.utc) - running_since > timedelta(seconds=silent_after_s + 5),
                     silent_after_s + 10, "the run to outlast the silence threshold")
            logs = client.read_logs(log_filter=_logs_of(run.id))
        # Judged by its log, the run would look dead: nothing below WARNING, nothing recent.
        assert all(log.level >= 30 for log in logs), [log.message for log in logs if log.level < 30]
        assert all(datetime.now(timezone.utc) - log.timestamp > timedelta(seconds=silent_after_s) for log in logs)

        policy = f'{{"silent_after_minutes": {silent_after_s / 60}, "min_age_minutes": 0}}'
        output = run_reconcile(local_stack, policy, **QUIET_HEARTBEATS)
        swept_after_s = (datetime.now(timezone.utc) - running_since).total_seconds()
        assert running_job(local_stack, {endpoint["id"]}), (
            f"the job ended before the sweep ({swept_after_s:.0f} s after Running): raise WARNING_ONLY_STEPS")
        assert f"kept {endpoint['name']}: its run is Running" in output, output
        assert live_endpoints(local_stack, "loraflow-e2e-quiet-")

        # The run's read of RunPod's billing, right after its endpoint is deleted, fails every try.
        billing_fault = httpx.post(f"{local_stack.localpod_url}/_localpod/faults", timeout=10, json={
            "route": "serverless_billing", "action": "status_500", "times": READ_TRIES,
        }).raise_for_status().json()["id"]
        assert flow.wait(600) == 0, log_path.read_text()
    finally:
        if flow.poll() is None:
            os.killpg(flow.pid, signal.SIGKILL)
        httpx.delete(f"{local_stack.localpod_url}/_localpod/worker-faults/{slow.json()['id']}", timeout=10)
        if billing_fault is not None:
            httpx.delete(f"{local_stack.localpod_url}/_localpod/faults/{billing_fault}", timeout=10)
    with prefect_client(local_stack) as client:
        assert client.read_flow_run(run.id).state.type.value == "COMPLETED"
        assert "fills this in" in _summary_of(client, run.id)
        wait_for(lambda: _billing_pending(client, run.id), 60, "the run's billing-pending event")
    assert not live_endpoints(local_stack, "loraflow-e2e-quiet-")

    # The next sweep reads what RunPod billed and writes it into this run's summary, once.
    output = run_reconcile(local_stack, "{}")
    assert f"billed cost of run e2e-quiet ({run.id}): filled in, $" in output, output
    with prefect_client(local_stack) as client:
        summary = _summary_of(client, run.id)
        assert "| Billed by RunPod | $" in summary and "billed after the run ended" in summary, summary
        assert "fills this in" not in summary
        wait_for(lambda: not _billing_pending(client, run.id), 60, "the run's billing-settled event")
    figures(f"Warnings-only run: kept by a reconcile sweep {swept_after_s:.0f} s after it started running "
            f"(silence threshold {silent_after_s} s), then completed; its billed cost filled in by the next sweep")


def _summary_of(client, flow_run_id) -> str:
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    [summary] = client.read_artifacts(artifact_filter=ArtifactFilter(
        flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]),
        key=ArtifactFilterKey(any_=["train-e2e-quiet-summary"])))
    return summary.data


def _billing_pending(client, flow_run_id) -> bool:
    now = datetime.now(timezone.utc)
    return any(p.run_id == str(flow_run_id)
               for p in pending_billings(client, now - timedelta(hours=1), now + timedelta(minutes=1)))


def _logs_of(flow_run_id):
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    return LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]))
