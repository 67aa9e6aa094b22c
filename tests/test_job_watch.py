"""Watching a job: outcomes are classified, the loop is bounded, transient reads are tolerated for a
time budget with bounded backoff, `/health` names why a job stayed queued, and the run's own cancel
stops the job."""

import json

import httpx
import pytest

from tasks.runpod import errors
from tasks.runpod.client import RunpodClient
from tasks.runpod.models import Health
from tasks.runpod.jobs import (
    CANCEL_CHECK_S,
    DEADLINE_SAVE_GRACE_S,
    HEALTH_CHECK_S,
    MAX_POLL_INTERVAL_S,
    MAX_REQUEUES,
    WatchLimits,
    parse_worker_error,
    watch_job,
)


class FakeClock:
    def __init__(self):
        self.now = 1000.0
        self.sleeps = []

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        assert 0 <= seconds <= MAX_POLL_INTERVAL_S, "poll interval must stay bounded"
        self.sleeps.append(seconds)
        self.now += seconds


def scripted_client(answers, seen=None, health=None, clock=None):
    """A real RunpodClient whose transport replays (status code, body[, headers]) `/status` answers in order,
    the last forever, or, with `clock`, a function of the time. `/health` answers `health` (a workers dict;
    None: 404)."""
    answers = list(answers) if clock is None else answers

    def handler(request):
        if seen is not None:
            seen.append(request)
        if request.url.path.endswith("/cancel/job1"):
            return httpx.Response(200, json={"id": "job1", "status": "CANCELLED"})
        if request.url.path.endswith("/health"):
            if health is None:
                return httpx.Response(404, json={"detail": "no health here"})
            return httpx.Response(200, json={"jobs": {"inQueue": 1}, "workers": health})
        answer = answers(clock.now) if clock is not None else answers.pop(0) if len(answers) > 1 else answers[0]
        code, body, *headers = answer
        return httpx.Response(code, json=body, headers=headers[0] if headers else None)

    return RunpodClient("key", transport=httpx.MockTransport(handler))


def paths(seen, suffix):
    return [r for r in seen if r.url.path.endswith(suffix)]


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


def handler_failure(message, error_type="JobFailed"):
    """A FAILED job's error as runpod 1.12's runtime sends a handler exception."""
    return job("FAILED", error=json.dumps({"error_type": f"<class 'loraflow_worker.runtime.supervisor.{error_type}'>",
                                           "error_message": message}))


@pytest.mark.parametrize(
    ("message", "kind", "memory"),
    [
        # The worker's markers, behind the prefix RunPod's runtime adds (`JobFailed: `).
        ("out of memory (GPU): torch.OutOfMemoryError: Tried to allocate 2 GiB", "out_of_memory", "gpu"),
        ("out of memory (vLLM KV cache): ValueError: No available memory for the cache blocks", "out_of_memory",
         "vllm_kv"),
        ("out of memory (host RAM): the kernel's OOM killer ended the training process", "host_out_of_memory", "host"),
        # The libraries' own texts, with no marker (an error that did not pass the worker's supervisor).
        ("RuntimeError: CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported",
         "out_of_memory", "gpu"),
        ("RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`", "out_of_memory",
         "gpu"),
        ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB", "out_of_memory", "gpu"),
        ("ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization`",
         "out_of_memory", "vllm_kv"),
        ("CUDA unavailable: torch 2.14.0 is built for CUDA 13.0 (NVIDIA driver >= 580)", "cuda_unavailable", None),
    ],
)
def test_failures_are_classified_by_their_sign_wherever_it_is_in_the_error(message, kind, memory):
    outcome = watch(scripted_client([training(2), handler_failure(message)]), FakeClock())
    assert (outcome.kind, outcome.memory) == (kind, memory)
    assert outcome.error == f"JobFailed: {message}"


def test_gpu_out_of_memory_and_cuda_unavailable_retry_and_host_out_of_memory_is_its_own_outcome():
    gpu = watch(scripted_client([handler_failure("out of memory (GPU): x")]), FakeClock())
    host = watch(scripted_client([handler_failure("out of memory (host RAM): y")]), FakeClock())
    cuda = watch(scripted_client([handler_failure("CUDA unavailable: z")]), FakeClock())
    assert gpu.retriable and cuda.retriable
    assert host.kind == "host_out_of_memory"


def test_an_ordinary_code_failure_is_not_taken_for_out_of_memory():
    outcome = watch(scripted_client([handler_failure("KeyError: 'messages' (memory of the run)")]), FakeClock())
    assert outcome.kind == "failed" and outcome.memory is None


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


def test_a_job_back_in_the_queue_that_no_worker_takes_again_within_the_queue_allowance_is_preempted():
    clock = FakeClock()
    outcome = watch(scripted_client([training(5), job("IN_QUEUE")]), clock, queue=60)
    assert outcome.kind == "preempted" and outcome.retriable and "within 60 s" in outcome.error
    assert 60 <= clock.now - 1000 <= 66


def test_a_job_handed_to_another_worker_after_its_worker_was_lost_completes_on_the_same_watch():
    requeues = []
    answers = [training(3), job("IN_QUEUE"), job("IN_QUEUE"), job("IN_PROGRESS", output={"stage": "loading"}),
               training(4), job("COMPLETED", output={"ok": True})]
    outcome = watch(scripted_client(answers), FakeClock(), on_requeued=requeues.append)
    assert outcome.kind == "completed" and requeues == [1]


def test_a_job_taken_by_another_worker_between_two_polls_counts_as_requeued():
    requeues = []
    answers = [job("IN_PROGRESS", workerId="w1", output={"stage": "training", "step": 3}),
               job("IN_PROGRESS", workerId="w2", output={"stage": "loading"}),
               job("IN_PROGRESS", workerId="w2", output={"stage": "training", "step": 4}),
               job("COMPLETED", workerId="w2", output={"ok": True})]
    outcome = watch(scripted_client(answers), FakeClock(), on_requeued=requeues.append)
    assert outcome.kind == "completed" and requeues == [1]


def test_the_next_worker_of_a_requeued_job_gets_the_startup_allowance_anew():
    clock = FakeClock()

    def answer(now):  # step 3 at once; back in the queue at 100 s; taken again at 110 s, loading from then on
        if now < 1100:
            return training(3)
        return job("IN_QUEUE") if now < 1110 else job("IN_PROGRESS", output={"stage": "loading"})

    outcome = watch(scripted_client(answer, clock=clock), clock, startup=300, stall=1000)
    assert outcome.kind == "stalled" and "no training step within 300 s" in outcome.error
    assert 1410 <= clock.now <= 1416


def test_a_job_that_keeps_going_back_to_the_queue_is_given_up_as_preempted():
    requeues = []
    answers = [training(1), job("IN_QUEUE")] * (MAX_REQUEUES + 1) + [training(1)]
    outcome = watch(scripted_client(answers), FakeClock(), on_requeued=requeues.append)
    assert outcome.kind == "preempted" and f"{MAX_REQUEUES + 1} times" in outcome.error
    assert requeues == list(range(1, MAX_REQUEUES + 2))


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


def test_task_evaluations_after_training_answering_batch_after_batch_are_not_stalled():
    clock = FakeClock()
    answered = [job("IN_PROGRESS", output={"kind": "progress", "stage": "evaluating", "step": 100,
                                           "message": f"task `t`: the base answered {n} of 800 prompts"})
                for n in range(16, 800, 16)]
    assert watch(scripted_client([training(100), *answered, job("COMPLETED")]), clock, stall=5).kind == "completed"


def test_the_run_deadline_ends_a_running_job_and_is_not_retried():
    clock = FakeClock()
    outcome = watch(scripted_client([training(1)]), clock, deadline_in=30)
    assert outcome.kind == "deadline" and not outcome.retriable
    # A started job is left DEADLINE_SAVE_GRACE_S past the deadline to save what it has and end by itself.
    assert clock.now == pytest.approx(1030.0 + DEADLINE_SAVE_GRACE_S)


def test_a_few_transient_read_errors_are_tolerated():
    client = scripted_client([(503, {"detail": "x"})] * 3 + [job("COMPLETED")])
    assert watch(client, FakeClock()).kind == "completed"


def test_a_long_outage_within_the_budget_costs_nothing_and_backoff_stays_bounded():
    clock = FakeClock()
    seen = []

    def answers(now):  # 90 s of 500s while the job runs, then it is found completed
        return (500, {"detail": "down"}) if now < 1090 else job("COMPLETED", output={"ok": True})

    errors_heard = []
    outcome = watch(scripted_client(answers, seen, clock=clock), clock, stall=120,
                    on_read_error=lambda error, unreadable_s: errors_heard.append(unreadable_s))
    assert outcome.kind == "completed" and outcome.output == {"ok": True}
    # Doubling from the 2 s poll, then capped: few requests during the outage, none farther apart than the cap.
    assert clock.sleeps[:4] == [4.0, 8.0, 16.0, MAX_POLL_INTERVAL_S]
    assert max(clock.sleeps) == MAX_POLL_INTERVAL_S
    assert len(paths(seen, "/status/job1")) <= 8
    assert errors_heard[0] == 0 and 60 < errors_heard[-1] < 90


def test_a_429s_retry_after_is_honoured_up_to_the_cap():
    clock = FakeClock()
    client = scripted_client([(429, {"detail": "slow down"}, {"Retry-After": "11"}),
                              (429, {"detail": "slower"}, {"Retry-After": "3600"}), job("COMPLETED")])
    assert watch(client, clock).kind == "completed"
    assert clock.sleeps == [11.0, MAX_POLL_INTERVAL_S]


def test_unreadable_past_the_budget_gives_the_attempt_up_as_unreachable():
    seen = []
    clock = FakeClock()
    outcome = watch(scripted_client([training(2), (503, {"detail": "x"})], seen), clock, stall=120)
    assert outcome.kind == "unreachable" and outcome.retriable
    assert "transient errors for 1" in outcome.error and "503" in outcome.error
    assert outcome.last_step == 2 and outcome.status == "IN_PROGRESS"
    assert 120 <= clock.now - 1000 <= 120 + MAX_POLL_INTERVAL_S + 2
    assert paths(seen, "/cancel/job1"), "a job given up on is cancelled"


def test_the_budget_is_never_below_a_minute():
    limits = WatchLimits(deadline_epoch_s=0, queue_s=1, startup_s=1, stall_s=5)
    assert limits.read_error_budget_s == 60
    assert limits.model_copy(update={"stall_s": 900}).read_error_budget_s == 900


def test_the_deadline_still_ends_an_unreadable_job():
    clock = FakeClock()
    outcome = watch(scripted_client([(500, {"detail": "x"})]), clock, deadline_in=50, stall=600)
    assert outcome.kind == "deadline"
    assert clock.now == pytest.approx(1050.0)


def test_permanent_read_errors_are_raised_at_once():
    clock = FakeClock()
    with pytest.raises(errors.AuthError):
        watch(scripted_client([(401, {"detail": "bad key"})]), clock)
    assert clock.now == 1000.0


def test_an_endpoint_or_job_that_vanishes_during_the_watch_is_lost_and_retried():
    clock = FakeClock()
    outcome = watch(scripted_client([training(4), (404, {"detail": "endpoint not found"})]), clock)
    assert outcome.kind == "lost" and outcome.retriable
    assert outcome.last_step == 4 and "vanished" in outcome.error


def test_an_unknown_status_is_reported_once_and_treated_as_running():
    unknown = []
    clock = FakeClock()
    answers = [training(1)] + [job("PAUSED")] * 5 + [training(2), job("PAUSED"), job("COMPLETED")]
    outcome = watch(scripted_client(answers), clock, on_unknown_status=unknown.append)
    assert outcome.kind == "completed"
    assert unknown == ["PAUSED"]


def test_a_queued_job_after_unknown_statuses_was_not_preempted():
    clock = FakeClock()
    answers = [job("PAUSED")] * 3 + [job("IN_QUEUE")] * 2 + [training(1), job("COMPLETED")]
    outcome = watch(scripted_client(answers), clock, on_unknown_status=lambda s: None)
    assert outcome.kind == "completed"


def test_a_job_requeued_after_it_was_in_progress_is_waited_for_then_preempted():
    clock = FakeClock()
    outcome = watch(scripted_client([training(1), job("PAUSED"), job("IN_QUEUE")]), clock,
                    on_unknown_status=lambda s: None, queue=60)
    assert outcome.kind == "preempted"


def test_a_job_that_stays_in_an_unknown_status_is_ended_by_the_stall_limits():
    clock = FakeClock()
    outcome = watch(scripted_client([job("PAUSED")]), clock, startup=300, stall=60, on_unknown_status=lambda s: None)
    assert outcome.kind == "stalled"
    assert 300 <= clock.now - 1000 <= 303


def running(step, loss=1.0):
    """RUNNING, as RunPod's job-states page also lists it, with the worker's progress."""
    return job("RUNNING", output={"kind": "progress", "stage": "training", "step": step, "total_steps": 100,
                                  "loss": loss})


def test_running_is_a_known_status_whose_progress_is_read():
    unknown, progress = [], []
    clock = FakeClock()
    answers = [job("IN_QUEUE"), running(1), running(2), running(3), job("COMPLETED")]
    outcome = watch(scripted_client(answers), clock, on_unknown_status=unknown.append,
                    on_status=lambda status: progress.append(status.progress))
    assert outcome.kind == "completed" and unknown == []
    assert outcome.last_step == 3
    assert [p["step"] for p in progress if p] == [1, 2, 3]


def test_a_job_queued_again_after_running_and_never_taken_again_is_preempted():
    outcome = watch(scripted_client([running(1), job("IN_QUEUE")]), FakeClock(), queue=60)
    assert outcome.kind == "preempted" and outcome.last_step == 1


def test_a_running_job_without_progress_is_ended_by_the_stall_limits():
    clock = FakeClock()
    outcome = watch(scripted_client([running(1)]), clock, stall=60)
    assert outcome.kind == "stalled" and "after step 1" in outcome.error


def test_a_cancelled_run_cancels_its_job_within_a_check_interval():
    seen = []
    clock = FakeClock()
    cancelled_at = 1030.0
    outcome = watch(scripted_client([training(1)], seen), clock, cancel_requested=lambda: clock.now >= cancelled_at)
    assert outcome.kind == "run_cancelled" and not outcome.retriable
    assert cancelled_at <= clock.now <= cancelled_at + CANCEL_CHECK_S + 2
    assert paths(seen, "/cancel/job1")


def test_a_cancel_is_seen_even_while_the_status_is_unreadable():
    clock = FakeClock()
    outcome = watch(scripted_client([(502, {"detail": "x"})]), clock, stall=3600,
                    cancel_requested=lambda: clock.now >= 1040)
    assert outcome.kind == "run_cancelled"
    assert clock.now <= 1040 + MAX_POLL_INTERVAL_S


def test_the_run_state_is_not_read_on_every_poll():
    clock = FakeClock()
    checks = []
    answers = [training(step) for step in range(1, 31)] + [job("COMPLETED")]
    watch(scripted_client(answers), clock, cancel_requested=lambda: checks.append(clock.now) or False)
    assert len(checks) <= 60 / CANCEL_CHECK_S + 1


def counters(**nonzero):
    """Every worker counter `/health` can report, 0 unless given."""
    return {name: 0 for name in ("idle", "initializing", "ready", "running", "throttled", "unhealthy")} | nonzero


@pytest.mark.parametrize(
    ("workers", "kind", "cause"),
    [
        (counters(throttled=1), "no_capacity", "workers throttled"),
        (counters(unhealthy=1, initializing=1), "no_capacity", "workers unhealthy"),
        (counters(initializing=1), "image_pull_failed", "image pull failing"),
        (counters(), "no_capacity", "no stock"),
        (None, "no_capacity", "could not be read"),
        # RunPod's official /health example reports only these: an image pull cannot be told from no stock.
        ({"idle": 0, "running": 0}, "no_capacity", "cause unknown: /health did not report the workers' "
                                                   "initializing, throttled, unhealthy"),
        ({"initializing": 1}, "no_capacity", "cause unknown: /health did not report the workers' idle, running"),
    ],
)
def test_a_job_that_stays_queued_is_given_up_with_the_cause_health_shows(workers, kind, cause):
    seen = []
    clock = FakeClock()
    outcome = watch(scripted_client([job("IN_QUEUE")], seen, health=workers), clock, queue=120)
    assert outcome.kind == kind
    assert cause in outcome.error, outcome.error
    # Read now and then while queued, and once more when giving up; not on every poll.
    assert 2 <= len(paths(seen, "/health")) <= 120 / HEALTH_CHECK_S + 2


def test_an_image_that_cannot_be_pulled_is_not_tried_on_another_gpu():
    outcome = watch(scripted_client([job("IN_QUEUE")], [], health=counters(initializing=1)), FakeClock(), queue=120)
    assert not outcome.retriable and "LORAFLOW_WORKER_IMAGE" in outcome.error


def test_a_health_answer_without_a_counter_reads_it_as_not_reported():
    health = Health.model_validate({"jobs": {"completed": 1, "inQueue": 1}, "workers": {"idle": 0, "running": 0}})
    assert health.workers.idle == 0 and health.workers.initializing is None and health.workers.throttled is None
    assert health.jobs.in_queue == 1 and health.jobs.in_progress is None


def test_health_is_not_read_once_the_job_runs():
    seen = []
    watch(scripted_client([training(step) for step in range(1, 40)] + [job("COMPLETED")], seen, health={}), FakeClock())
    assert paths(seen, "/health") == []


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


def test_localpod_can_answer_running_and_its_progress_is_read(tmp_path):
    """RUNNING from a real server: localpod's unknown_status fault answers it over the job's real document."""
    import sys

    from fastapi.testclient import TestClient

    from localpod import LocalpodConfig, create_app
    from tests.test_localpod import AUTH, create_endpoint, post_done, run_job, take_job

    config = LocalpodConfig(api_key="test-key", worker_quota=10, log_dir=tmp_path / "logs",
                            worker_command=[sys.executable, "-c", "raise SystemExit('no workers')"])
    with TestClient(create_app(config)) as pod:
        endpoint_id = create_endpoint(pod)["id"]
        job_id = run_job(pod, endpoint_id)
        take_job(pod, endpoint_id)
        post_done(pod, endpoint_id, job_id, {"status": "IN_PROGRESS", "output": {"stage": "training", "step": 3}})
        assert pod.post("/_localpod/faults", json={"route": "status", "action": "unknown_status",
                                                   "job_status": "RUNNING"}).status_code == 201

        def forward(request: httpx.Request) -> httpx.Response:
            reply = pod.request(request.method, request.url.raw_path.decode(), headers=AUTH)
            return httpx.Response(reply.status_code, headers=reply.headers, content=reply.content)

        client = RunpodClient("test-key", job_url="http://localpod/v2", transport=httpx.MockTransport(forward))
        status = client.status(endpoint_id, job_id)
    assert status.status == "RUNNING" and status.known and status.running
    assert status.progress == {"stage": "training", "step": 3}
