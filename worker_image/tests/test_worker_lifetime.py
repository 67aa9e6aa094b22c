"""The worker process ends itself at the run's deadline, and at once when the platform stops it idle, so an idle
worker is not billed past either."""

from __future__ import annotations

import http.server
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from loraflow_worker.runtime.lifetime import DEADLINE_ENV, WorkerLifetime, exit_at_once_when_stopped_idle


def start_worker(job_server: JobServer, log, **env: str) -> subprocess.Popen[bytes]:
    """The real worker (`python -m loraflow_worker.handler`) polling `job_server`, its output in `log`."""
    env = {
        **os.environ,
        "RUNPOD_WEBHOOK_GET_JOB": f"{job_server.url}/job-take/$ID?gpu=test",
        "RUNPOD_WEBHOOK_POST_OUTPUT": f"{job_server.url}/job-done/$RUNPOD_POD_ID/$ID?gpu=test",
        "RUNPOD_WEBHOOK_PING": f"{job_server.url}/ping/$RUNPOD_POD_ID?gpu=test",
        "RUNPOD_POD_ID": "lifetime-test",
        "RUNPOD_AI_API_KEY": "lifetime-test-key",  # with a key and a pod id, runpod starts its pinger process
        "RUNPOD_PING_INTERVAL": "1000",
        "RUNPOD_SKIP_AUTO_SYSTEM_CHECKS": "true",
        "RUNPOD_SKIP_GPU_CHECK": "true",
        **env,
    }
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "loraflow_worker.handler"], env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


@pytest.mark.timeout(60)
def test_idle_worker_exits_at_the_run_deadline_with_its_pinger(job_server, tmp_path):
    deadline = time.time() + 4
    log = tmp_path / "worker.log"
    worker = start_worker(job_server, log, **{DEADLINE_ENV: str(deadline)})
    try:
        code = worker.wait(timeout=30)
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, 9)
    assert code == 0, log.read_text()[-2000:]
    assert time.time() - deadline < 10
    assert "the run's deadline" in log.read_text()
    time.sleep(0.5)
    with pytest.raises(ProcessLookupError):  # nothing of the worker's process group is left
        os.killpg(worker.pid, 0)


@pytest.mark.timeout(60)
def test_an_idle_worker_the_platform_stops_exits_at_once_with_its_pinger(job_server, tmp_path):
    log = tmp_path / "worker.log"
    worker = start_worker(job_server, log)
    try:
        assert job_server.polled.wait(30), log.read_text()[-2000:]
        time.sleep(1.0)  # into runpod's steady loop: a job-take long-poll, a stop-signal poll and its 1 s pause
        stopped = time.monotonic()
        worker.send_signal(signal.SIGTERM)
        code = worker.wait(timeout=30)
        exit_s = time.monotonic() - stopped
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, 9)
    assert code == 0, log.read_text()[-2000:]
    # runpod's own shutdown waits out its loops' pauses and unwinds the worker's imports: 1-2 s, billed.
    assert exit_s < 0.5, (exit_s, log.read_text()[-2000:])
    assert "with no job: the worker exits at once" in log.read_text()
    time.sleep(0.5)
    with pytest.raises(ProcessLookupError):  # nothing of the worker's process group is left
        os.killpg(worker.pid, 0)


def test_a_worker_stopped_with_a_job_keeps_runpods_shutdown_which_lets_the_job_end():
    from runpod.serverless.modules import rp_scale

    exits: list[int] = []
    plain = rp_scale.JobScaler
    try:
        exit_at_once_when_stopped_idle(exit=exits.append)
        scaler = rp_scale.JobScaler({"handler": lambda job: None})
    finally:
        rp_scale.JobScaler = plain
    scaler.jobs_queue.put_nowait({"id": "job-taken", "input": {}})  # taken, not yet started
    scaler.handle_shutdown(signal.SIGTERM, None)
    assert exits == [] and not scaler.is_alive()  # runpod's loops end once the job's result is posted
    scaler.jobs_queue.get_nowait()
    scaler.handle_shutdown(signal.SIGTERM, None)
    assert exits == [0]


def test_busy_worker_waits_for_its_job_to_end_before_exiting():
    busy = threading.Event()
    busy.set()
    exits: list[int] = []
    lifetime = WorkerLifetime(time.time() - 1, busy=busy.is_set, exit=exits.append, poll_s=0.05)
    lifetime.start()
    time.sleep(0.3)
    assert exits == []
    busy.clear()
    time.sleep(0.3)
    assert exits == [0]


def test_a_jobs_deadline_is_the_one_that_counts():
    exits: list[int] = []
    lifetime = WorkerLifetime(None, busy=lambda: False, exit=exits.append, poll_s=0.05)
    lifetime.start()
    time.sleep(0.2)
    assert exits == []  # no deadline known: the worker keeps polling for a job
    lifetime.use_deadline(time.time() - 1)
    time.sleep(0.3)
    assert exits == [0]


@dataclass
class JobServer:
    url: str
    polled: threading.Event = field(default_factory=threading.Event)
    """Set at the first job-take."""


@pytest.fixture
def job_server() -> Iterator[JobServer]:
    """A RunPod job API with no jobs: job-take answers 204 after a short long-poll, pings answer 200."""
    polled = threading.Event()

    class NoJobs(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if "/job-take/" in self.path:
                polled.set()
                time.sleep(0.2)
                self.send_response(204)
            else:
                self.send_response(200)
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NoJobs)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield JobServer(f"http://127.0.0.1:{server.server_port}", polled)
    finally:
        server.shutdown()
        server.server_close()
