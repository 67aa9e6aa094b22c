"""The reconciler deletes only this control plane's endpoints that no live, heartbeating run owns, judging
each run by its own heartbeat interval, and refuses a policy that would take a live run for a dead one."""

from datetime import datetime, timedelta, timezone

import pytest

from tasks.lifecycle.liveness import EndpointBeat, HeartbeatIntervals
from tasks.lifecycle.reconcile import EndpointsSeen, LiveRun, RunsSeen, check_silence_threshold, decide
from tasks.runpod.endpoints import endpoint_name, run_hash
from tasks.runpod.models import Endpoint, Health

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=timezone.utc)
OURS = "k7q2mx"
DEFAULTS = HeartbeatIntervals(endpoint_s=60, flow_run_s=180)  # LORAFLOW_HEARTBEAT_SECONDS, Prefect's default


def endpoint(name, minutes_old=10, id="ep"):
    created = (NOW - timedelta(minutes=minutes_old)).isoformat().replace("+00:00", "Z")
    return Endpoint.model_validate({"id": id, "name": name, "workers": {"min": 0, "max": 1}, "createdAt": created})


def ours(run_id="run-1", attempt=1, **kwargs):
    return endpoint(endpoint_name(run_id, attempt, "x", namespace=OURS), **kwargs)


def health(queued=0, running=0):
    return Health.model_validate({"jobs": {"inQueue": queued, "inProgress": running}, "workers": {}})


def run(run_id="run-1", minutes_silent=1, state="Running"):
    last_seen = None if minutes_silent is None else NOW - timedelta(minutes=minutes_silent)
    return LiveRun(id=run_id, state=state, last_seen=last_seen, crashed=state == "Crashed")


def beat(minutes_ago, interval_s=None, flow_run_interval_s=None):
    return EndpointBeat(at=NOW - timedelta(minutes=minutes_ago), interval_s=interval_s,
                        flow_run_interval_s=flow_run_interval_s)


def decide_one(ep, runs=(), h=None, beats=None, error=None, silent=20, idle=45, min_age=2, intervals=DEFAULTS):
    seen = EndpointsSeen(endpoints=[ep], health={ep.id: h} if h else {}, health_errors={ep.id: error} if error else {})
    [finding] = decide(seen, RunsSeen(runs=list(runs), endpoint_beats=beats or {}), OURS, NOW,
                       silent_after_s=silent * 60, idle_grace_s=idle * 60, min_age_s=min_age * 60, intervals=intervals)
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
    beats = {"ep": beat(minutes_ago=1)}
    finding = decide_one(ours(), [run(minutes_silent=30)], health(running=1), beats=beats)
    assert finding.action == "keep"


def test_another_endpoints_heartbeat_does_not_keep_this_one():
    finding = decide_one(ours(), [run(minutes_silent=30)], health(running=1), beats={"other-ep": beat(0)})
    assert finding.action == "delete"


def test_idle_endpoint_past_the_grace_is_deleted_even_if_its_run_lives():
    finding = decide_one(ours(minutes_old=60), [run()], health())
    assert finding.action == "delete" and "idle" in finding.reason


def test_a_health_answer_without_job_counters_leaves_idleness_unjudged():
    unreported = Health.model_validate({"workers": {"idle": 0, "running": 0}})
    finding = decide_one(ours(minutes_old=60), [run()], unreported)
    assert finding.action == "keep" and "did not report its queued and running jobs" in finding.reason
    assert finding.jobs == "? queued, ? running"


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
    assert decide(seen, RunsSeen(runs=[]), OURS, NOW, silent_after_s=60, idle_grace_s=60, min_age_s=0,
                  intervals=DEFAULTS) == []


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
                      min_age_s=0, intervals=DEFAULTS)
    assert [(f.endpoint_id, f.action) for f in findings] == [("a", "keep"), ("b", "delete"), ("c", "keep")]


def test_a_run_with_a_longer_own_endpoint_heartbeat_is_not_judged_silent_early():
    # Its worker sends the endpoint heartbeat every 10 min (LORAFLOW_HEARTBEAT_SECONDS=600): 25 min of silence is
    # less than 3 of its beats, though past the policy's 20 min and 3 × the reconciler's own 60 s.
    slow = {"ep": beat(minutes_ago=25, interval_s=600)}
    assert decide_one(ours(), [run(minutes_silent=60)], health(running=1), beats=slow).action == "keep"
    usual = {"ep": beat(minutes_ago=25, interval_s=60)}
    assert decide_one(ours(), [run(minutes_silent=60)], health(running=1), beats=usual).action == "delete"


def test_a_run_with_a_longer_own_flow_run_heartbeat_is_not_judged_silent_early():
    # Its process sends Prefect's flow-run heartbeat every 15 min (PREFECT_FLOWS_HEARTBEAT_FREQUENCY=900), as its
    # endpoint heartbeat says: 40 min of silence is less than 3 of them.
    says = {"ep": beat(minutes_ago=50, interval_s=60, flow_run_interval_s=900)}
    assert decide_one(ours(), [run(minutes_silent=40)], health(running=1), beats=says).action == "keep"
    # When no heartbeat says, the reconciler's own setting stands in (180 s here): silent after 20 min.
    finding = decide_one(ours(), [run(minutes_silent=40)], health(running=1), beats={"ep": beat(minutes_ago=50)})
    assert finding.action == "delete" and "no heartbeat for 40.0 min" in finding.reason


def test_the_reconcilers_own_intervals_judge_a_run_that_does_not_say():
    # Endpoint heartbeats from before the payload named the interval: the reconciler's LORAFLOW_HEARTBEAT_SECONDS.
    slow_here = HeartbeatIntervals(endpoint_s=600, flow_run_s=180)
    old = {"ep": beat(minutes_ago=25)}
    kept = decide_one(ours(), [run(minutes_silent=60)], health(running=1), beats=old, intervals=slow_here)
    assert kept.action == "keep"
    assert decide_one(ours(), [run(minutes_silent=60)], health(running=1), beats=old).action == "delete"


def test_a_crashed_run_whose_heartbeats_go_on_keeps_its_endpoint():
    # Marked Crashed by the zombie automation while the server was down; its process beats on.
    fresh = {"ep": beat(minutes_ago=1)}
    finding = decide_one(ours(), [run(minutes_silent=None, state="Crashed")], health(running=1), beats=fresh)
    assert (finding.action, finding.run_id) == ("keep", "run-1")
    assert "its run is Crashed, but its heartbeats go on" in finding.reason
    # Its own flow-run heartbeat is as good a sign.
    assert decide_one(ours(), [run(minutes_silent=2, state="Crashed")], health(running=1)).action == "keep"


def test_a_crashed_run_whose_heartbeats_stopped_loses_its_endpoint():
    stale = {"ep": beat(minutes_ago=30)}
    finding = decide_one(ours(), [run(minutes_silent=None, state="Crashed")], health(running=1), beats=stale)
    assert finding.action == "delete" and "no heartbeat for 30.0 min" in finding.reason
    finding = decide_one(ours(), [run(minutes_silent=None, state="Crashed")], health(running=1))
    assert finding.action == "delete" and "no heartbeat of it was found" in finding.reason


def test_a_completed_runs_endpoint_is_deleted_however_fresh_its_heartbeat():
    # Completed, Failed and Cancelled runs are not read at all: their endpoints are orphans.
    finding = decide_one(ours("run-done"), [run()], health(), beats={"ep": beat(minutes_ago=0)})
    assert finding.action == "delete" and "final or missing" in finding.reason


def test_a_silence_threshold_below_three_heartbeats_is_refused_naming_both_figures_and_the_setting():
    with pytest.raises(ValueError) as refused:
        check_silence_threshold(0.25, HeartbeatIntervals(endpoint_s=60, flow_run_s=None))
    assert str(refused.value).startswith("silent_after_minutes=0.25 (15 s) is below 3 × the heartbeat interval in "
                                         "force (3 × 60 s = 180 s, LORAFLOW_HEARTBEAT_SECONDS; Prefect's flow-run "
                                         "heartbeat is off)")
    assert "set it to at least 3 min" in str(refused.value)
    with pytest.raises(ValueError, match=r"\(3 × 180 s = 540 s, PREFECT_FLOWS_HEARTBEAT_FREQUENCY; "
                                         r"LORAFLOW_HEARTBEAT_SECONDS is 60 s\).*at least 9 min"):
        check_silence_threshold(5, DEFAULTS)
    with pytest.raises(ValueError, match=r"\(3 × 60 s = 180 s, LORAFLOW_HEARTBEAT_SECONDS; "
                                         r"PREFECT_FLOWS_HEARTBEAT_FREQUENCY is 30 s\)"):
        check_silence_threshold(2.5, HeartbeatIntervals(endpoint_s=60, flow_run_s=30))


def test_a_silence_threshold_of_three_heartbeats_or_more_passes():
    check_silence_threshold(9, DEFAULTS)
    check_silence_threshold(1.5, HeartbeatIntervals(endpoint_s=10, flow_run_s=30))  # the team stack's


def test_the_reconcilers_own_settings_are_the_intervals_in_force(monkeypatch):
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    from tasks.lifecycle.liveness import intervals_in_force

    monkeypatch.setenv("LORAFLOW_HEARTBEAT_SECONDS", "7")
    with temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: 45}):
        assert intervals_in_force() == HeartbeatIntervals(endpoint_s=7, flow_run_s=45)
