"""localpod's hold jobs (`--hold-jobs SECONDS`, for the benchmarks): a real `runpod.serverless` worker
holds each job for the time asked, reports progress, and stores a result the flow accepts as complete,
labelled as a hold job; localpod counts the requests each route serves."""

import sys
import time

import httpx
import pytest

from deployments.local_stack import WORKER_PYTHON, free_port, start_service
from localpod.__main__ import _parser, config_from_args
from tasks.storage.artifacts import read_run_results

HOLD_S = 3.0
KEY = "hold-test-key"


@pytest.fixture(scope="module")
def hold_pod(tmp_path_factory):
    logs = tmp_path_factory.mktemp("hold-pod")
    port = free_port()
    service = start_service(
        "localpod",
        [sys.executable, "-m", "localpod", "--port", str(port), "--api-key", KEY, "--log-dir", str(logs),
         "--worker-python", str(WORKER_PYTHON), "--hold-jobs", str(HOLD_S)],
        {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}, f"http://127.0.0.1:{port}", "/_localpod/account",
        logs / "localpod.log",
    )
    try:
        yield service.url
    finally:
        service.stop()


def run_hold_job(url: str, store_url: str, run_id: str) -> tuple[dict, list[dict], float]:
    """Create an endpoint, run one job on it to its end, delete the endpoint: (final status, the
    IN_PROGRESS outputs seen, seconds from submit to the end)."""
    endpoint_body = {"name": f"hold-{run_id}", "type": "QUEUE", "scaling": {"type": "QUEUE_DELAY", "queueDelay": 4},
                     "image": "x", "gpu": {"pools": ["ADA_24"]},
                     "workers": {"min": 0, "max": 1}}
    job_input = {"run_id": run_id, "model": {"id": "/no/model"}, "dataset": {"store_path": "runs/x/train.jsonl"},
                 "training": {"max_steps": 3}, "artifact_store": store_url}
    seen = []
    with httpx.Client(base_url=f"{url}/v2", headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as http:
        endpoint = http.post("/serverless", json=endpoint_body).raise_for_status().json()
        try:
            started = time.monotonic()
            job = http.post(f"/{endpoint['id']}/run", json={"input": job_input}).raise_for_status().json()
            while time.monotonic() - started < 120:
                status = http.get(f"/{endpoint['id']}/status/{job['id']}").raise_for_status().json()
                if status["status"] == "IN_PROGRESS" and status.get("output"):
                    seen.append(status["output"])
                if status["status"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMED_OUT"):
                    return status, seen, time.monotonic() - started
                time.sleep(0.25)
            raise AssertionError(f"job still {status['status']} after 120 s")
        finally:
            http.delete(f"/serverless/{endpoint['id']}")


def test_a_hold_job_holds_its_worker_then_stores_a_complete_result_labelled_as_a_hold_job(hold_pod, tmp_path):
    store_url = f"file://{tmp_path / 'store'}"
    status, progress, took_s = run_hold_job(hold_pod, store_url, "hold-run-1")

    assert status["status"] == "COMPLETED", status
    assert status["executionTime"] >= HOLD_S * 1000
    assert took_s >= HOLD_S
    assert progress and all("hold job" in p["message"] for p in progress)
    assert any(p["stage"] == "training" and p.get("eta_seconds") is not None for p in progress)
    results = read_run_results(store_url, "hold-run-1")  # what the flow's `collect` reads
    assert results.done
    assert results.result.metrics.steps == 3
    assert results.result.metrics.device == "localpod hold job (no training)"
    assert results.manifest == {"hold_job": True, "hold_seconds": HOLD_S}
    assert status["output"]["run_id"] == "hold-run-1"


def test_localpod_counts_the_requests_each_route_served(hold_pod):
    http = httpx.Client(base_url=hold_pod, timeout=10)
    http.delete("/_localpod/requests").raise_for_status()
    for _ in range(3):
        http.get("/v2/nope/health", headers={"Authorization": f"Bearer {KEY}"})

    counts = http.get("/_localpod/requests").raise_for_status().json()

    assert counts["by_route"]["GET /v2/{endpoint_id}/health"] == 3
    assert counts["total"] >= 3


def test_hold_jobs_refuse_a_worker_command_of_their_own():
    parser = _parser()
    args = parser.parse_args(["--hold-jobs", "5", "--worker-command", "python my_handler.py"])

    with pytest.raises(SystemExit):
        config_from_args(args, parser)


def test_hold_jobs_run_the_hold_worker_with_the_worker_interpreter():
    parser = _parser()
    args = parser.parse_args(["--hold-jobs", "5", "--worker-python", str(WORKER_PYTHON)])

    config = config_from_args(args, parser)

    assert config.worker_command[0] == str(WORKER_PYTHON)
    assert config.worker_command[1].endswith("localpod/hold_worker.py")
    assert config.worker_command[2] == "5.0"
