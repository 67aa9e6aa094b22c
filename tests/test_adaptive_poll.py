"""The job watch's poll interval adapts to what the worker says: fast near the end (the endpoint is
deleted soon after the job ends), slower while the end is far (fewer polls for many runs at once),
the base interval otherwise."""

import httpx

from tasks.runpod.client import RunpodClient
from tasks.runpod.jobs import CANCEL_CHECK_S, FAST_POLL_S, STEADY_POLL_MAX_S, WatchLimits, next_poll_s, watch_job
from tasks.runpod.models import JobStatus

BASE_S = 2.0


def status(state, **progress):
    output = {"kind": "progress", **progress} if progress else None
    return JobStatus.model_validate({"id": "job1", "status": state, "output": output})


def test_a_queued_job_is_polled_at_the_base_interval():
    assert next_poll_s(status("IN_QUEUE"), BASE_S) == BASE_S


def test_a_job_loading_its_model_is_polled_at_the_base_interval():
    assert next_poll_s(status("IN_PROGRESS", stage="loading", eta_seconds=600), BASE_S) == BASE_S


def test_a_training_job_without_an_eta_is_polled_at_the_base_interval():
    assert next_poll_s(status("IN_PROGRESS", stage="training", step=3), BASE_S) == BASE_S


def test_a_job_far_from_its_end_is_polled_at_most_every_steady_maximum():
    assert next_poll_s(status("IN_PROGRESS", stage="training", eta_seconds=3600), BASE_S) == STEADY_POLL_MAX_S
    assert STEADY_POLL_MAX_S <= CANCEL_CHECK_S


def test_a_job_nearing_its_end_is_polled_at_half_its_eta():
    assert next_poll_s(status("IN_PROGRESS", stage="training", eta_seconds=3.0), BASE_S) == 1.5


def test_a_job_about_to_end_is_polled_fast():
    assert next_poll_s(status("IN_PROGRESS", stage="training", eta_seconds=0.1), BASE_S) == FAST_POLL_S


def test_a_saving_job_is_polled_fast():
    assert next_poll_s(status("IN_PROGRESS", stage="saving", step=10, total_steps=10), BASE_S) == FAST_POLL_S


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


def job_ending_at(clock, end, polls):
    """A client whose job trains until `end` (an honest ETA), then is COMPLETED; each poll's time goes to `polls`."""

    def handler(request):
        polls.append(clock.now)
        if clock.now >= end:
            return httpx.Response(200, json={"id": "job1", "status": "COMPLETED", "output": {"ok": True}})
        output = {"kind": "progress", "stage": "training", "step": 1, "total_steps": 10, "eta_seconds": end - clock.now}
        return httpx.Response(200, json={"id": "job1", "status": "IN_PROGRESS", "output": output})

    return RunpodClient("key", transport=httpx.MockTransport(handler))


def watch(clock, client):
    limits = WatchLimits(deadline_epoch_s=clock.now + 3600, queue_s=600, startup_s=300, stall_s=120)
    return watch_job(client, "ep1", "job1", limits, poll_interval_s=BASE_S, clock=clock, sleep=clock.sleep)


def test_the_end_of_a_job_with_an_eta_is_seen_within_the_fast_interval():
    clock, polls = Clock(), []
    end = clock.now + 61.3

    outcome = watch(clock, job_ending_at(clock, end, polls))

    assert outcome.kind == "completed"
    assert polls[-1] - end <= FAST_POLL_S


def test_a_long_job_with_an_eta_is_polled_less_than_at_the_base_interval():
    clock, polls = Clock(), []

    watch(clock, job_ending_at(clock, clock.now + 600, polls))

    assert len(polls) < 600 / BASE_S / 2
