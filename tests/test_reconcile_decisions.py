"""The reconciler deletes only this control plane's endpoints that no live, heartbeating run owns."""

from datetime import datetime, timedelta, timezone

from tasks.reconcile import EndpointsSeen, LiveRun, RunsSeen, decide
from tasks.runpod.endpoints import endpoint_name, run_hash
from tasks.runpod.models import Endpoint, Health

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=timezone.utc)
OURS = "k7q2mx"


def endpoint(name, minutes_old=10, id="ep"):
    created = (NOW - timedelta(minutes=minutes_old)).isoformat().replace("+00:00", "Z")
    return Endpoint.model_validate({"id": id, "name": name, "workers": {"min": 0, "max": 1}, "createdAt": created})


def ours(run_id="run-1", attempt=1, **kwargs):
    return endpoint(endpoint_name(run_id, attempt, "x", namespace=OURS), **kwargs)


def health(queued=0, running=0):
    return Health.model_validate({"jobs": {"inQueue": queued, "inProgress": running}, "workers": {}})


def run(run_id="run-1", minutes_silent=1):
    return LiveRun(id=run_id, state="Running", last_seen=NOW - timedelta(minutes=minutes_silent))


def decide_one(ep, runs=(), h=None, beats=None, error=None, silent=20, idle=45, min_age=2):
    seen = EndpointsSeen(endpoints=[ep], health={ep.id: h} if h else {}, health_errors={ep.id: error} if error else {})
    [finding] = decide(seen, RunsSeen(runs=list(runs), endpoint_beats=beats or {}), OURS, NOW,
                       silent_after_s=silent * 60, idle_grace_s=idle * 60, min_age_s=min_age * 60)
    return finding


def test_endpoint_of_a_live_heartbeating_run_is_kept():
    finding = decide_one(ours(), [run()], health(running=1))
    assert (finding.action, finding.run_id, finding.control_plane) == ("keep", "run-1", "ours")
    assert finding.jobs == "0 queued, 1 running"


def test_endpoint_whose_run_is_final_or_missing_is_deleted():
    finding = decide_one(ours("run-gone"), [run("run-1")])
    assert finding.action == "delete" and "final or missing" in finding.reason


def test_every_attempt_of_a_live_run_is_recognised():
    assert decide_one(ours(attempt=3), [run()], health(running=1)).action == "keep"


def test_endpoint_of_a_silent_run_is_deleted():
    finding = decide_one(ours(), [run(minutes_silent=30)], health(running=1))
    assert finding.action == "delete" and "no heartbeat for 30.0 min" in finding.reason


def test_an_endpoint_heartbeat_keeps_a_run_alive_whose_own_signs_are_old():
    # Prefect's flow-run heartbeat comes every 3 min by default; the watch loop's endpoint heartbeat
    # every minute: either one is a sign of life.
    beats = {"ep": NOW - timedelta(minutes=1)}
    finding = decide_one(ours(), [run(minutes_silent=30)], health(running=1), beats=beats)
    assert finding.action == "keep"


def test_another_endpoints_heartbeat_does_not_keep_this_one():
    finding = decide_one(ours(), [run(minutes_silent=30)], health(running=1), beats={"other-ep": NOW})
    assert finding.action == "delete"


def test_idle_endpoint_past_the_grace_is_deleted_even_if_its_run_lives():
    finding = decide_one(ours(minutes_old=60), [run()], health())
    assert finding.action == "delete" and "idle" in finding.reason


def test_young_endpoint_is_kept_whatever_its_run():
    assert decide_one(ours("run-gone", minutes_old=1)).action == "keep"


def test_another_control_planes_endpoint_is_reported_and_kept_whatever_its_state():
    # No live run here owns it, it is old and idle: exactly what an orphan of ours would look like.
    other = endpoint(endpoint_name("run-elsewhere", 1, "x", namespace="staging"), minutes_old=10_000)
    finding = decide_one(other, [], health())
    assert (finding.action, finding.control_plane) == ("keep", "staging")
    assert "another control plane's" in finding.reason


def test_an_untagged_loraflow_endpoint_is_reported_and_kept():
    legacy = endpoint(f"loraflow-x-{run_hash('run-gone')}-a1", minutes_old=10_000)
    finding = decide_one(legacy)
    assert (finding.action, finding.control_plane) == ("keep", "untagged")


def test_foreign_endpoints_are_not_even_reported():
    seen = EndpointsSeen(endpoints=[endpoint("my-own-inference", minutes_old=10_000)])
    assert decide(seen, RunsSeen(runs=[]), OURS, NOW, silent_after_s=60, idle_grace_s=60, min_age_s=0) == []


def test_a_health_error_is_recorded_and_idleness_is_not_judged():
    finding = decide_one(ours(minutes_old=60), [run()], error="ServerError: 500 from /health")
    assert finding.action == "keep" and finding.jobs == "/health failed: ServerError: 500 from /health"


def test_a_health_error_does_not_save_an_orphan():
    finding = decide_one(ours("run-gone"), [run()], error="ServerError: 500")
    assert finding.action == "delete" and finding.jobs.startswith("/health failed")


def test_one_finding_per_endpoint_in_a_mixed_listing():
    endpoints = [ours("run-1", id="a"), ours("run-gone", id="b"),
                 endpoint(endpoint_name("run-gone", 1, "x", namespace="zz9"), id="c"), endpoint("not-ours", id="d")]
    seen = EndpointsSeen(endpoints=endpoints, health={"a": health(running=1)},
                         health_errors={"b": "RunpodConnectionError: reset"})
    findings = decide(seen, RunsSeen(runs=[run()]), OURS, NOW, silent_after_s=20 * 60, idle_grace_s=45 * 60,
                      min_age_s=0)
    assert [(f.endpoint_id, f.action) for f in findings] == [("a", "keep"), ("b", "delete"), ("c", "keep")]
