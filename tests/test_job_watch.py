"""Watching a job: outcomes are classified, the loop is bounded, transient reads are tolerated."""

import json

import httpx
import pytest

from tasks.runpod import errors
from tasks.runpod.client import RunpodClient
from tasks.runpod.jobs import MAX_CONSECUTIVE_READ_ERRORS, WatchLimits, parse_worker_error, watch_job


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        assert 0 <= seconds <= 2.0, "poll interval must stay bounded"
        self.now += seconds


def scripted_client(answers, seen=None):
    """A real RunpodClient whose transport replays (status code, body) answers in order, the last forever."""
    answers = list(answers)

    def handler(request):
        if seen is not None:
            seen.append(request)
        if request.url.path.endswith("/cancel/job1"):
            return httpx.Response(200, json={"id": "job1", "status": "CANCELLED"})
        code, body = answers.pop(0) if len(answers) > 1 else answers[0]
        return httpx.Response(code, json=body)

    return RunpodClient("key", transport=httpx.MockTransport(handler))


def job(status, **fields):
    return 200, {"id": "job1", "status": status, **fields}


def training(step, loss=1.0):
    return job("IN_PROGRESS", output={"kind": "progress", "stage": "training", "step": step, "total_steps": 100, "loss": loss})


def watch(client, clock, deadline_in=3600, queue=600, startup=300, stall=120, **kw):
    limits = WatchLimits(deadline_epoch_s=clock.now + deadline_in, queue_s=queue, startup_s=startup, stall_s=stall)
    return watch_job(client, "ep1", "job1", limits, clock=clock, sleep=clock.sleep, **kw)


def test_completed_job_returns_its_output():
    clock = FakeClock()
    client = scripted_client([job("IN_QUEUE"), training(1),
                              job("COMPLETED", output={"ok": True}, delayTime=1500, executionTime=9000)])
    outcome = watch(client, clock)
    assert outcome.kind == "completed" and not outcome.retriable
    assert outcome.output == {"ok": True}
    assert outcome.queued_seconds == 1.5 and outcome.running_seconds == 9.0


def test_handler_exception_is_a_code_failure_with_message_and_traceback():
    error = json.dumps({"error_type": "<class 'ValueError'>", "error_message": "bad column", "error_traceback": "Traceback..."})
    outcome = watch(scripted_client([job("FAILED", error=error)]), FakeClock())
    assert outcome.kind == "failed" and not outcome.retriable
    assert outcome.error == "ValueError: bad column"
    assert outcome.traceback == "Traceback..."


def test_out_of_memory_is_its_own_retriable_outcome():
    error = json.dumps({"error_type": "<class 'RuntimeError'>", "error_message": "out of memory: CUDA out of memory. Tried to allocate 2 GiB"})
    outcome = watch(scripted_client([job("FAILED", error=error)]), FakeClock())
    assert outcome.kind == "out_of_memory" and outcome.retriable


def test_worker_dying_without_a_result_is_worker_lost():
    outcome = watch(scripted_client([training(3), job("FAILED", error="worker exited with code -9 without a result")]), FakeClock())
    assert outcome.kind == "worker_lost" and outcome.retriable
    assert outcome.last_step == 3


def test_job_that_never_leaves_the_queue_is_no_capacity_and_cancelled():
    seen = []
    clock = FakeClock()
    outcome = watch(scripted_client([job("IN_QUEUE")], seen), clock, queue=60)
    assert outcome.kind == "no_capacity" and outcome.retriable
    assert 60 <= outcome.queued_seconds <= 63
    assert any(r.url.path.endswith("/cancel/job1") for r in seen)


def test_job_requeued_after_starting_is_preempted():
    outcome = watch(scripted_client([training(5), job("IN_QUEUE")]), FakeClock())
    assert outcome.kind == "preempted" and outcome.retriable


def test_no_first_training_step_within_the_startup_allowance_is_stalled():
    clock = FakeClock()
    loading = job("IN_PROGRESS", output={"kind": "progress", "stage": "loading", "step": 0})
    outcome = watch(scripted_client([loading]), clock, startup=300, stall=60)
    assert outcome.kind == "stalled"
    assert 300 <= clock.now - 1000 <= 303, "the longer startup allowance applies before the first step"


def test_no_progress_after_training_started_is_stalled_after_the_stall_allowance():
    clock = FakeClock()
    outcome = watch(scripted_client([training(1), training(2), training(7)]), clock, stall=60, startup=3000)
    assert outcome.kind == "stalled"
    assert "after step 7" in outcome.error
    assert clock.now - 1000 <= 70


def test_steady_progress_is_not_stalled():
    clock = FakeClock()
    answers = [training(step) for step in range(1, 200)] + [job("COMPLETED")]
    assert watch(scripted_client(answers), clock, stall=5).kind == "completed"


def test_deadline_ends_a_running_job_as_timed_out():
    clock = FakeClock()
    outcome = watch(scripted_client([training(1)]), clock, deadline_in=30)
    assert outcome.kind == "timed_out" and not outcome.retriable
    assert clock.now == pytest.approx(1030.0)


def test_a_few_transient_read_errors_are_tolerated():
    client = scripted_client([(503, {"detail": "x"})] * 3 + [job("COMPLETED")])
    assert watch(client, FakeClock()).kind == "completed"


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
    watch(scripted_client([training(3), job("COMPLETED")]), FakeClock(), on_status=seen.append)
    assert [s.status for s in seen] == ["IN_PROGRESS", "COMPLETED"]
    assert seen[0].output["step"] == 3


def test_runpods_class_repr_error_type_is_shortened():
    error = json.dumps({"error_type": "<class 'loraflow_worker.handler.JobRefused'>", "error_message": "bad"})
    assert parse_worker_error(error) == ("JobRefused: bad", None, True)


def test_plain_text_error_is_kept_as_is_and_not_from_the_handler():
    assert parse_worker_error("worker exited with code 137") == ("worker exited with code 137", None, False)
