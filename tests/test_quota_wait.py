"""RunPod's own quota error makes a run wait, with bounded backoff, within its deadline."""

from __future__ import annotations

import logging

import pytest

from tasks.lifecycle.quota import QUOTA_WAITS_S, wait_for_runpod_quota
from tasks.runpod import errors

QUOTA_TEXT = ("RunPod answered 400 to POST /v2/serverless: Max workers across all endpoints must not exceed your "
              "workers quota (5)")


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        assert 0 <= seconds <= 5.0, "cancellation is checked at least every 5 s while waiting"
        self.now += seconds


def refusing(times: int, then="endpoint"):
    calls = []

    def create():
        calls.append(1)
        if len(calls) <= times:
            raise errors.QuotaExceededError(QUOTA_TEXT, status=400)
        return then

    return create, calls


# RunPod's other wording of the same refusal (issue 37).
OTHER_QUOTA_TEXT = "Max workers across all endpoints will exceed your worker quota of 10 ... at most 9"


def test_the_quota_number_is_read_from_runpods_text():
    assert errors.QuotaExceededError(QUOTA_TEXT, status=400).quota == 5
    assert errors.QuotaExceededError("quota exceeded", status=400).quota is None


def test_the_quota_number_is_read_from_runpods_other_wording():
    assert errors.QuotaExceededError(OTHER_QUOTA_TEXT, status=400).quota == 10


@pytest.mark.parametrize("text", [QUOTA_TEXT, OTHER_QUOTA_TEXT, OTHER_QUOTA_TEXT.upper(),
                                  "max workers across all endpoints must not exceed your workers quota"])
def test_either_wording_is_runpods_quota_refusal_whatever_its_case(text):
    assert errors.is_quota_refusal(text)


@pytest.mark.parametrize("text", ["gpu pool unknown", "quota exceeded", "workers.max must not exceed 100"])
def test_other_refusals_are_not_the_quota_refusal(text):
    assert not errors.is_quota_refusal(text) and errors.named_quota(text) is None


def test_a_full_quota_is_waited_out_with_bounded_backoff(caplog):
    clock = FakeClock()
    create, calls = refusing(6)
    with caplog.at_level(logging.INFO, logger="loraflow.quota"):
        endpoint = wait_for_runpod_quota(create, give_up_at=clock.now + 3600, cancel_requested=lambda: False,
                                         clock=clock, sleep=clock.sleep)
    assert endpoint == "endpoint" and len(calls) == 7
    waits = list(QUOTA_WAITS_S) + [QUOTA_WAITS_S[-1]] * 2
    assert clock.now - 1000 == sum(waits)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "quota (5) is full" in warnings[0] and "runpod-endpoints" in warnings[0]


def test_the_quota_runpod_names_is_handed_on_once():
    clock = FakeClock()
    create, calls = refusing(3)
    named = []
    wait_for_runpod_quota(create, give_up_at=clock.now + 3600, cancel_requested=lambda: False,
                          on_quota_named=named.append, clock=clock, sleep=clock.sleep)
    assert named == [5]


def test_the_wait_names_the_limit_that_fits_the_quota(caplog):
    clock = FakeClock()
    create, calls = refusing(1)
    with caplog.at_level(logging.WARNING, logger="loraflow.quota"):
        wait_for_runpod_quota(create, give_up_at=clock.now + 3600, cancel_requested=lambda: False,
                              clock=clock, sleep=clock.sleep)
    assert "prefect gcl update runpod-endpoints --limit 5" in caplog.text and "LORAFLOW_WORKER_QUOTA=5" in caplog.text


def test_a_cancel_while_waiting_ends_the_wait():
    clock = FakeClock()
    create, calls = refusing(100)
    result = wait_for_runpod_quota(create, give_up_at=clock.now + 3600, cancel_requested=lambda: clock.now >= 1050,
                                   clock=clock, sleep=clock.sleep)
    assert result is None
    assert 1050 <= clock.now <= 1055


def test_no_wait_goes_past_the_time_left():
    clock = FakeClock()
    create, calls = refusing(100)
    with pytest.raises(errors.QuotaExceededError, match=r"Waited 105 s") as e:
        wait_for_runpod_quota(create, give_up_at=clock.now + 200, cancel_requested=lambda: False,
                              clock=clock, sleep=clock.sleep)
    assert e.value.quota == 5
    assert clock.now - 1000 == 15 + 30 + 60  # the next wait (120 s) would end past 200 s


def test_other_errors_are_not_waited_on():
    clock = FakeClock()

    def create():
        raise errors.BadRequestError("gpu pool unknown", status=400)

    with pytest.raises(errors.BadRequestError, match="gpu pool"):
        wait_for_runpod_quota(create, give_up_at=clock.now + 3600, cancel_requested=lambda: False,
                              clock=clock, sleep=clock.sleep)
    assert clock.now == 1000
