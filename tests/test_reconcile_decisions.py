"""The reconciler deletes only our endpoints that no live, talking run owns."""

from datetime import datetime, timedelta, timezone

from tasks.reconcile import LiveRun, decide
from tasks.runpod.endpoints import endpoint_name
from tasks.runpod.models import Endpoint, Health

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=timezone.utc)


def endpoint(name, minutes_old=10, id="ep"):
    created = (NOW - timedelta(minutes=minutes_old)).isoformat().replace("+00:00", "Z")
    return Endpoint.model_validate({"id": id, "name": name, "workers": {"min": 0, "max": 1}, "createdAt": created})


def health(queued=0, running=0):
    return Health.model_validate({"jobs": {"inQueue": queued, "inProgress": running}, "workers": {}})


def run(run_id="run-1", minutes_silent=1):
    return LiveRun(id=run_id, state="Running", last_seen=NOW - timedelta(minutes=minutes_silent))


def decide_one(ep, runs=(), h=None, silent=20, idle=45, min_age=2):
    [finding] = decide([ep], list(runs), {ep.id: h} if h else {}, NOW, silent * 60, idle * 60, min_age * 60)
    return finding


def test_endpoint_of_a_live_talking_run_is_kept():
    finding = decide_one(endpoint(endpoint_name("run-1", 1, "x")), [run()], health(running=1))
    assert finding.action == "keep" and finding.run_id == "run-1"


def test_endpoint_whose_run_is_final_or_missing_is_deleted():
    finding = decide_one(endpoint(endpoint_name("run-gone", 1, "x")), [run("run-1")])
    assert finding.action == "delete" and "final or missing" in finding.reason


def test_every_attempt_of_a_live_run_is_recognised():
    assert decide_one(endpoint(endpoint_name("run-1", 3, "x")), [run()], health(running=1)).action == "keep"


def test_endpoint_of_a_silent_run_is_deleted():
    finding = decide_one(endpoint(endpoint_name("run-1", 1, "x")), [run(minutes_silent=30)], health(running=1))
    assert finding.action == "delete" and "silent" in finding.reason


def test_idle_endpoint_past_the_grace_is_deleted_even_if_its_run_lives():
    finding = decide_one(endpoint(endpoint_name("run-1", 1, "x"), minutes_old=60), [run()], health())
    assert finding.action == "delete" and "idle" in finding.reason


def test_young_endpoint_is_kept_whatever_its_run():
    assert decide_one(endpoint(endpoint_name("run-gone", 1, "x"), minutes_old=1)).action == "keep"


def test_foreign_endpoints_are_never_touched():
    assert decide([endpoint("my-own-inference", minutes_old=10_000)], [], {}, NOW, 60, 60, 0) == []
