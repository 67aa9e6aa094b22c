"""The worker process ends itself at the run's deadline, so an idle worker is not billed past it."""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from loraflow_worker.runtime.lifetime import DEADLINE_ENV, WorkerLifetime


@pytest.mark.timeout(60)
def test_idle_worker_exits_at_the_run_deadline_with_its_pinger(job_server, tmp_path):
    deadline = time.time() + 4
    env = {
        **os.environ,
        DEADLINE_ENV: str(deadline),
        "RUNPOD_WEBHOOK_GET_JOB": f"{job_server}/job-take/$ID?gpu=test",
        "RUNPOD_WEBHOOK_POST_OUTPUT": f"{job_server}/job-done/$RUNPOD_POD_ID/$ID?gpu=test",
        "RUNPOD_WEBHOOK_PING": f"{job_server}/ping/$RUNPOD_POD_ID?gpu=test",
        "RUNPOD_POD_ID": "lifetime-test",
        "RUNPOD_AI_API_KEY": "lifetime-test-key",  # with a key and a pod id, runpod starts its pinger process
        "RUNPOD_PING_INTERVAL": "1000",
        "RUNPOD_SKIP_AUTO_SYSTEM_CHECKS": "true",
        "RUNPOD_SKIP_GPU_CHECK": "true",
    }
    log = tmp_path / "worker.log"
    with open(log, "wb") as out:
        worker = subprocess.Popen([sys.executable, "-m", "loraflow_worker.handler"], env=env, stdout=out,
                                  stderr=subprocess.STDOUT, start_new_session=True)
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


@pytest.fixture
def job_server() -> Iterator[str]:
    """A RunPod job API with no jobs: job-take answers 204 after a short long-poll, pings answer 200."""

    class NoJobs(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if "/job-take/" in self.path:
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
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
