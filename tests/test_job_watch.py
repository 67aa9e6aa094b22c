"""Watching a job: outcomes are classified, the loop is bounded, transient reads are tolerated."""

import json

import httpx
import pytest

from tasks.runpod import errors
from tasks.runpod.client import RunpodClient
from tasks.runpod.jobs import MAX_CONSECUTIVE_READ_ERRORS, parse_worker_error, watch_job


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        assert 0 <= seconds <= 2.0, "poll interval must stay bounded"
        self.now += seconds


def scripted_client(answers, seen=None):
    """A real RunpodClient whose transport replays (status code, body) answers in order."""
    answers = list(answers)

    def handler(request):
        if seen is not None:
            seen.append(request)
        if request.url.path.endswith("/cancel/job1"):
            return httpx.Response(200, json={"id": "job1", "status": "CANCELLED"})
        code, body = answers.pop(0) if len(answers) > 1 else answers[0]
        return httpx.Response(code, json=body)

    return RunpodClient("key", transport=httpx.MockTransport(handler))


def watch(client, clock, deadline_in=3600, queue_allowance=600, **kw):
    return watch_job(client, "ep1", "job1", deadline=clock.now + deadline_in, queue_allowance_s=queue_allowance,
                     clock=clock, sleep=clock.sleep, **kw)


def test_completed_job_returns_its_output():
    clock = FakeClock()
    client = scripted_client([
        (200, {"id": "job1", "status": "IN_QUEUE"}),
        (200, {"id": "job1", "status": "IN_PROGRESS", "output": {"step": 1}}),
        (200, {"id": "job1", "status": "COMPLETED", "output": {"ok": True}, "delayTime": 1500, "executionTime": 9000}),
    ])
    outcome = watch(client, clock)
    assert outcome.kind == "completed"
    assert outcome.output == {"ok": True}
    assert outcome.queued_seconds == 1.5 and outcome.running_seconds == 9.0


def test_failed_job_carries_the_workers_message_and_traceback():
    error = json.dumps({"error_type": "ValueError", "error_message": "bad column", "error_traceback": "Traceback..."})
    clock = FakeClock()
    outcome = watch(scripted_client([(200, {"id": "job1", "status": "FAILED", "error": error})]), clock)
    assert outcome.kind == "failed"
    assert outcome.error == "ValueError: bad column"
    assert outcome.traceback == "Traceback..."


def test_runpods_class_repr_error_type_is_shortened():
    error = json.dumps({"error_type": "<class 'loraflow_worker.handler.JobRefused'>", "error_message": "bad"})
    assert parse_worker_error(error) == ("JobRefused: bad", None)


def test_plain_text_worker_error_is_kept_as_is():
    assert parse_worker_error("worker exited with code 137") == ("worker exited with code 137", None)


def test_job_that_never_leaves_the_queue_is_no_capacity_and_cancelled():
    seen = []
    clock = FakeClock()
    outcome = watch(scripted_client([(200, {"id": "job1", "status": "IN_QUEUE"})], seen), clock, queue_allowance=60)
    assert outcome.kind == "no_capacity"
    assert 60 <= outcome.queued_seconds <= 63
    assert any(r.url.path.endswith("/cancel/job1") for r in seen)


def test_deadline_ends_a_running_job_as_timed_out():
    clock = FakeClock()
    outcome = watch(scripted_client([(200, {"id": "job1", "status": "IN_PROGRESS"})]), clock, deadline_in=30)
    assert outcome.kind == "timed_out"
    assert clock.now == pytest.approx(1030.0)


def test_a_few_transient_read_errors_are_tolerated():
    clock = FakeClock()
    client = scripted_client([(503, {"detail": "x"})] * 3 + [(200, {"id": "job1", "status": "COMPLETED"})])
    assert watch(client, clock).kind == "completed"


def test_persistent_read_errors_are_raised():
    clock = FakeClock()
    with pytest.raises(errors.ServerError):
        watch(scripted_client([(503, {"detail": "x"})]), clock)
    assert clock.now - 1000.0 <= 2.0 * MAX_CONSECUTIVE_READ_ERRORS


def test_permanent_read_errors_are_raised_at_once():
    clock = FakeClock()
    with pytest.raises(errors.NotFoundError):
        watch(scripted_client([(404, {"detail": "no such job"})]), clock)
    assert clock.now == 1000.0


def test_progress_is_reported_to_the_callback():
    seen = []
    clock = FakeClock()
    client = scripted_client([
        (200, {"id": "job1", "status": "IN_PROGRESS", "output": {"step": 3, "total_steps": 10}}),
        (200, {"id": "job1", "status": "COMPLETED"}),
    ])
    watch(client, clock, on_status=seen.append)
    assert [s.status for s in seen] == ["IN_PROGRESS", "COMPLETED"]
    assert seen[0].output["step"] == 3
