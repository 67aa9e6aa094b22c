"""localpod's docker runtime with the built worker image: each worker is a container of the endpoint's
image that gets only what RunPod would give it, is stopped and removed by localpod, and runs a real train
flow to completion.

The first tests run a small `runpod.serverless` handler in the image (the endpoint's `args` replace the
image's command, as on RunPod); the last runs the image's own handler under a Prefect flow.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from deployments.local_stack import LocalStack
from localpod.models import Account
from tests.conftest import localpod_account, run_train_flow
from tests.image.conftest import DOCKER, containers, docker
from tests.test_localpod import endpoint_body, start_localpod, stop_localpod, wait_for
from tests.test_train_e2e import flow_run_state, run_endpoints, write_run_file

pytestmark = pytest.mark.timeout(900)

HOST_ONLY = "LOCALPOD_TEST_HOST_ONLY"  # in localpod's environment only: a container must not see it
CONTAINER_START_S = 120  # a cold start of a multi-GB image on a loaded machine

HANDLER = '''
import asyncio, os, pathlib, time
import runpod

async def handler(job):
    job_input = job["input"]
    mode = job_input.get("mode")
    if mode == "env":
        shared = pathlib.Path(job_input["shared"])
        (shared / ("written-by-" + os.environ["RUNPOD_POD_ID"])).write_text("from the container")
        return {"env": dict(os.environ), "read": (shared / "input.txt").read_text(),
                "tmpdir_is_a_folder": os.path.isdir(os.environ["TMPDIR"])}
    if mode == "progress":  # a progress update (worker faults fire on it), then a long wait
        runpod.serverless.progress_update(job, {"step": 1})
        await asyncio.sleep(job_input["seconds"])
        return {"done": True}
    if mode == "block":  # like a training step: blocks the worker loop
        time.sleep(job_input["seconds"])
        return {"blocked": True}
    return {"echo": job_input}

runpod.serverless.start({"handler": handler})
'''


@dataclass
class DockerPod:
    http: httpx.Client
    process: subprocess.Popen[bytes]
    stdout: Path
    shared: Path
    image: str

    def endpoint(self, name: str, image: str | None = None, **env: str) -> str:
        body = endpoint_body(name=name, image=image or self.image, workers={"max": 1, "idleTimeout": 1},
                             args=f"python {self.shared / 'handler.py'}", env=env)
        response = self.http.post("/v2/serverless", json=body)
        assert response.status_code == 201, response.text
        return response.json()["id"]

    def run(self, endpoint_id: str, job_input: dict[str, Any]) -> str:
        return self.http.post(f"/v2/{endpoint_id}/run", json={"input": job_input}).raise_for_status().json()["id"]

    def status(self, endpoint_id: str, job_id: str) -> dict[str, Any]:
        return self.http.get(f"/v2/{endpoint_id}/status/{job_id}").raise_for_status().json()

    def wait_status(self, endpoint_id: str, job_id: str, wanted: str, timeout: float = CONTAINER_START_S
                    ) -> dict[str, Any]:
        return wait_for(lambda: (s := self.status(endpoint_id, job_id))["status"] == wanted and s,
                        f"job {job_id} {wanted}", timeout=timeout)

    def account(self) -> Account:
        return Account.model_validate(self.http.get("/_localpod/account").raise_for_status().json())

    def workers_of(self, endpoint_id: str) -> list[Any]:
        return [w for w in self.account().workers if w.endpoint_id == endpoint_id]


def launch_docker_localpod(tmp: Path, image: str) -> DockerPod:
    """`python -m localpod --worker-runtime docker`, with `tmp/shared` (the handler script and the test's
    files) mounted into every container."""
    shared = tmp / "shared"
    shared.mkdir()
    (shared / "handler.py").write_text(HANDLER)
    runtime = ["--worker-runtime", "docker", "--docker", shlex.join(DOCKER), "--worker-mount", str(shared)]
    http, process, stdout = start_localpod(tmp, runtime, kill_grace=10, long_poll=2,
                                           env=os.environ | {HOST_ONLY: "1"}, timeout_s=60)
    return DockerPod(http, process, stdout, shared, image)


@pytest.fixture(scope="module")
def pod(tmp_path_factory: pytest.TempPathFactory, worker_image: str) -> Iterator[DockerPod]:
    server = launch_docker_localpod(tmp_path_factory.mktemp("docker-localpod"), worker_image)
    try:
        yield server
    finally:
        stop_localpod(server.http, server.process)


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def container_state(name: str) -> dict[str, Any] | None:
    found = docker("inspect", "--format", "{{json .State}}", name, check=False)
    return json.loads(found.stdout) if found.returncode == 0 else None


def image_env(image: str) -> dict[str, str]:
    listed = json.loads(docker("image", "inspect", "--format", "{{json .Config.Env}}", image).stdout)
    return dict(item.split("=", 1) for item in listed)


# --- a handler in the image ------------------------------------------------------------------------


def test_container_gets_only_runpods_environment_and_its_mounts(pod: DockerPod) -> None:
    (pod.shared / "input.txt").write_text("from this machine")
    endpoint_id = pod.endpoint(unique("docker-env"), LORAFLOW_FROM_ENDPOINT="endpoint value")
    status = pod.wait_status(endpoint_id, pod.run(endpoint_id, {"mode": "env", "shared": str(pod.shared)}), "COMPLETED")
    [worker] = pod.workers_of(endpoint_id)
    env = status["output"]["env"]
    # The endpoint's env and RunPod's worker variables, over the image's own ENV; nothing of this machine's.
    assert env["LORAFLOW_FROM_ENDPOINT"] == "endpoint value"
    assert env["RUNPOD_POD_ID"] == worker.id and env["RUNPOD_ENDPOINT_ID"] == endpoint_id
    assert env["RUNPOD_WEBHOOK_GET_JOB"].startswith(f"{pod.http.base_url}/v2/{endpoint_id}/job-take/")
    assert HOST_ONLY not in env
    assert env["PATH"] == image_env(pod.image)["PATH"]
    # A mounted folder is the same folder, both ways; the scratch disk is TMPDIR.
    assert status["output"]["read"] == "from this machine"
    assert (pod.shared / f"written-by-{worker.id}").read_text() == "from the container"
    assert status["output"]["tmpdir_is_a_folder"] and Path(env["TMPDIR"]).name == worker.id
    assert worker.container == f"localpod-{worker.id}"


def test_idle_container_exits_cleanly_and_is_removed(pod: DockerPod) -> None:
    endpoint_id = pod.endpoint(unique("docker-idle"))
    pod.wait_status(endpoint_id, pod.run(endpoint_id, {"mode": "echo"}), "COMPLETED")
    [worker] = wait_for(lambda: [w for w in pod.workers_of(endpoint_id) if w.ended_at], "the idle worker to stop",
                        timeout=60)
    assert worker.exit_code == 0  # the SIGTERM reached the runpod loop inside the container
    wait_for(lambda: not containers(f"localpod.worker={worker.id}"), "its container to be removed", timeout=30)


def test_deleting_the_endpoint_stops_and_removes_a_busy_container(pod: DockerPod) -> None:
    endpoint_id = pod.endpoint(unique("docker-delete"))
    job_id = pod.run(endpoint_id, {"mode": "block", "seconds": 600})
    pod.wait_status(endpoint_id, job_id, "IN_PROGRESS")
    [worker] = pod.workers_of(endpoint_id)
    assert (container_state(worker.container) or {}).get("Running")
    assert pod.http.delete(f"/v2/serverless/{endpoint_id}").status_code == 204
    wait_for(lambda: container_state(worker.container) is None, "the container to be gone", timeout=60)
    assert [j.status for j in pod.account().jobs if j.id == job_id] == ["CANCELLED"]


def test_a_crash_kills_the_container_and_fails_the_job(pod: DockerPod) -> None:
    name = unique("docker-crash")
    endpoint_id = pod.endpoint(name)
    pod.http.post("/_localpod/worker-faults", json={"action": "crash", "endpoint_name_prefix": name,
                                                    "dead_worker_jobs": "fail"}).raise_for_status()
    status = pod.wait_status(endpoint_id, pod.run(endpoint_id, {"mode": "progress", "seconds": 600}), "FAILED")
    assert "exited with code 137 without a result" in status["error"]  # docker kill: SIGKILL inside the container
    [worker] = pod.workers_of(endpoint_id)
    wait_for(lambda: container_state(worker.container) is None, "the killed container to be removed", timeout=30)
    pod.http.delete(f"/v2/serverless/{endpoint_id}")


def test_a_preempted_container_is_killed_and_its_job_runs_again_in_a_new_one(pod: DockerPod) -> None:
    name = unique("docker-preempt")
    endpoint_id = pod.endpoint(name)
    pod.http.post("/_localpod/worker-faults", json={"action": "preempt", "endpoint_name_prefix": name}
                  ).raise_for_status()
    job_id = pod.run(endpoint_id, {"mode": "progress", "seconds": 1})
    status = pod.wait_status(endpoint_id, job_id, "COMPLETED", timeout=2 * CONTAINER_START_S)
    first, second = pod.workers_of(endpoint_id)
    assert status["workerId"] == second.id and first.exit_code == 137  # docker kill: SIGKILL in the container
    wait_for(lambda: container_state(first.container or "") is None, "the preempted container to be removed",
             timeout=30)
    pod.http.delete(f"/v2/serverless/{endpoint_id}")


def test_a_hang_pauses_the_container_until_its_endpoint_is_deleted(pod: DockerPod) -> None:
    name = unique("docker-hang")
    endpoint_id = pod.endpoint(name)
    pod.http.post("/_localpod/worker-faults", json={"action": "hang", "endpoint_name_prefix": name}).raise_for_status()
    job_id = pod.run(endpoint_id, {"mode": "progress", "seconds": 600})
    pod.wait_status(endpoint_id, job_id, "IN_PROGRESS")
    worker = wait_for(lambda: [w for w in pod.workers_of(endpoint_id)], "the worker")[0]
    wait_for(lambda: (container_state(worker.container) or {}).get("Paused"), "the container to be paused")
    assert pod.status(endpoint_id, job_id)["status"] == "IN_PROGRESS"
    assert pod.http.delete(f"/v2/serverless/{endpoint_id}").status_code == 204
    wait_for(lambda: container_state(worker.container) is None, "the paused container to be gone", timeout=60)


def test_a_missing_image_fails_the_queued_job_with_dockers_reason(pod: DockerPod) -> None:
    missing = f"loraflow-no-such-image:{uuid.uuid4().hex[:8]}"
    endpoint_id = pod.endpoint(unique("docker-noimage"), image=missing)
    status = pod.wait_status(endpoint_id, pod.run(endpoint_id, {"mode": "echo"}), "FAILED", timeout=60)
    assert "could not start worker container" in status["error"] and missing in status["error"]
    assert "No such image" in status["error"], status["error"]
    pod.http.delete(f"/v2/serverless/{endpoint_id}")


def test_shutdown_removes_every_container(tmp_path: Path, worker_image: str) -> None:
    server = launch_docker_localpod(tmp_path, worker_image)
    try:
        endpoint_id = server.endpoint(unique("docker-shutdown"))
        server.wait_status(endpoint_id, server.run(endpoint_id, {"mode": "block", "seconds": 600}), "IN_PROGRESS")
        [worker] = server.workers_of(endpoint_id)
    finally:
        stop_localpod(server.http, server.process)
    assert server.process.returncode in (0, -signal.SIGTERM)
    assert container_state(worker.container or "") is None
    assert not containers(f"localpod.endpoint={endpoint_id}")


# --- a train flow, the worker in the image ---------------------------------------------------------


def test_train_flow_runs_its_worker_in_a_container_of_the_image(worker_image: str, tiny_model: Path,
                                                                tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    with LocalStack(tmp_path / "stack", worker_runtime="docker", worker_image=worker_image,
                    worker_mounts=[tiny_model, store], docker=shlex.join(DOCKER)) as stack:
        run = run_train_flow(stack, write_run_file(tmp_path / "run.toml", name="e2e-docker", model=tiny_model,
                                                   store=store, max_steps=8), timeout_s=800)
        assert run.returncode == 0, run.output
        assert flow_run_state(stack, run.flow_run_id)["type"] == "COMPLETED"
        [endpoint] = run_endpoints(stack, "e2e-docker")
        assert endpoint["deletedAt"] is not None
        workers = [w for w in localpod_account(stack)["workers"] if w["endpointId"] == endpoint["id"]]
        assert workers and all(w["container"] == f"localpod-{w['id']}" for w in workers)
        wait_for(lambda: not containers(f"localpod.endpoint={endpoint['id']}"), "the worker container to be removed",
                 timeout=60)

    run_dir = store / "runs" / run.flow_run_id
    assert (run_dir / "DONE").exists()
    assert json.loads((run_dir / "metrics.json").read_text())["steps"] == 8
    # The image carries the GPU lock's vllm, which the worker environment on this machine leaves out: the
    # job ran in the image.
    assert "vllm" in json.loads((run_dir / "manifest.json").read_text())["libraries"]
    assert not containers(f"localpod.endpoint={endpoint['id']}")
