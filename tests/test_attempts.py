"""The retry policy between attempts."""

import pytest

from tasks.lifecycle.attempts import EveryGpuRefused, decide_next_attempt, next_unrefused
from tasks.runpod.catalog import resolve_gpu
from tasks.runpod.jobs import JobOutcome

GPUS = [resolve_gpu("4090"), resolve_gpu("a100"), resolve_gpu("h200")]


def decide(kind, gpu_index=0, attempt=1, max_attempts=3, seconds_left=3600, gpus=GPUS, earlier=(), refused=()):
    return decide_next_attempt(JobOutcome(kind=kind, job_id="j", status="X"), gpus, gpu_index, attempt, max_attempts,
                               seconds_left, earlier=earlier, refused=refused)


@pytest.mark.parametrize("kind", ["failed", "cancelled", "run_cancelled", "deadline"])
def test_code_failures_cancellations_and_deadlines_are_not_retried(kind):
    assert not decide(kind).retry


def test_no_capacity_walks_the_gpu_list_in_order_and_wraps():
    assert decide("no_capacity", gpu_index=0).gpu_index == 1
    assert decide("no_capacity", gpu_index=2).gpu_index == 0


def test_out_of_memory_moves_to_the_smallest_bigger_gpu():
    decision = decide("out_of_memory", gpu_index=0)
    assert decision.retry and GPUS[decision.gpu_index].name == "A100 SXM"


def test_out_of_memory_on_the_biggest_gpu_fails_with_the_fix():
    decision = decide("out_of_memory", gpu_index=2)
    assert not decision.retry
    assert "batch_size" in decision.reason


@pytest.mark.parametrize("kind", ["stalled", "preempted", "timed_out", "worker_lost", "unreachable", "submit_failed",
                                  "lost"])
def test_infrastructure_failures_retry_on_the_same_gpu(kind):
    decision = decide(kind, gpu_index=1)
    assert decision.retry and decision.gpu_index == 1


def test_attempt_budget_is_respected():
    assert not decide("stalled", attempt=3, max_attempts=3).retry


def test_no_attempt_is_started_too_close_to_the_deadline():
    decision = decide("stalled", seconds_left=60)
    assert not decision.retry and "deadline" in decision.reason


def test_no_capacity_where_the_weights_are_warm_retries_the_same_gpu_cold():
    decision = decide_next_attempt(JobOutcome(kind="no_capacity", job_id="j", status="IN_QUEUE"), GPUS, 1, 1, 3, 3600,
                                   warm_in="EU-RO-1")
    assert decision.retry and decision.cold and decision.gpu_index == 1
    assert "EU-RO-1" in decision.reason


def test_a_cold_retry_still_respects_the_attempt_budget():
    decision = decide_next_attempt(JobOutcome(kind="no_capacity", job_id="j", status="IN_QUEUE"), GPUS, 1, 3, 3, 3600,
                                   warm_in="EU-RO-1")
    assert not decision.retry


def test_a_host_without_cuda_is_retried_once_on_the_same_gpu_then_the_run_fails_naming_the_driver():
    first = decide("cuda_unavailable", gpu_index=1)
    assert first.retry and first.gpu_index == 1
    second = decide("cuda_unavailable", gpu_index=1, attempt=2, earlier=["cuda_unavailable"])
    assert not second.retry
    assert "driver" in second.reason


def test_host_ram_running_out_is_not_moved_to_a_bigger_gpu():
    decision = decide("host_out_of_memory", gpu_index=0)
    assert not decision.retry
    assert "host's RAM" in decision.reason and "batch_size" in decision.reason


# --- GPU classes whose endpoint request RunPod refused ----------------------------------------------------------


def test_a_refused_class_moves_to_the_next_one_not_refused_wrapping_round():
    assert next_unrefused(GPUS, 0, {"RTX 4090"}) == 1
    assert next_unrefused(GPUS, 1, {"RTX 4090", "A100 SXM"}) == 2
    assert next_unrefused(GPUS, 2, {"H200"}) == 0


def test_with_every_class_refused_there_is_no_next_one():
    assert next_unrefused(GPUS, 1, {g.name for g in GPUS}) is None


def test_every_refusal_is_named_when_no_class_is_left():
    message = str(EveryGpuRefused({"H100": "RunPod answered 400: bad pool", "RTX 4090": "RunPod answered 400: no"}))
    assert "H100: RunPod answered 400: bad pool" in message and "RTX 4090: RunPod answered 400: no" in message
    assert "compute.gpu" in message


def test_no_capacity_never_walks_back_to_a_refused_class():
    assert decide("no_capacity", gpu_index=1, refused={"H200"}).gpu_index == 0
    assert decide("no_capacity", gpu_index=1, refused={"H200", "RTX 4090"}).gpu_index == 1


def test_out_of_memory_never_moves_to_a_refused_bigger_class():
    assert GPUS[decide("out_of_memory", gpu_index=0, refused={"A100 SXM"}).gpu_index].name == "H200"
