"""The Docker work pool end to end: `prefect deploy --prefect-file deployments/docker/prefect.yaml --all` builds
the control-plane image with prefect-docker's build step and deploys; prefect-docker's worker runs a train
deployment's flow run in a container of that image, against a local stack on this machine (Prefect server and
localpod, whose workers train as local processes of .venv-worker).

Needs a Docker engine and a base for the image: LORAFLOW_CONTROL_PLANE_BASE, else python:3.11-slim-bookworm
when the engine has it, else loraflow-base:bookworm (worker_image/base_image.sh) when it has that, else
python:3.11-slim-bookworm pulled by the build. Run with the rest of tests/image (`make image-test`), or alone
(tests/image is collected only when LORAFLOW_IMAGE is set; this test does not use the worker image):

    LORAFLOW_IMAGE="$(bash worker_image/build.sh tag)" .venv/bin/python -m pytest tests/image/test_docker_pool_e2e.py

The image is tagged loraflow-control-plane:e2e and kept, so the next run builds from the layer cache.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deployments.local_stack import LocalStack
from tests.conftest import DATASET, prefect_api, stop_process_group
from tests.image.conftest import containers, docker
from tests.test_train_e2e import run_endpoints, write_run_file

pytestmark = pytest.mark.timeout(2400)

REPO = Path(__file__).resolve().parents[2]
DOCKER_PREFECT_FILE = "deployments/docker/prefect.yaml"
POOL = "loraflow-docker"
IMAGE = "loraflow-control-plane:e2e"
PUBLIC_BASE = "python:3.11-slim-bookworm"
OFFLINE_BASE = "loraflow-base:bookworm"
DEPLOY_TIMEOUT_S = 1800  # a cold build of the image on a loaded 2-core machine, pip downloads included
RUN_TIMEOUT_S = 900
FINAL_STATES = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def control_plane_base() -> str:
    if base := os.environ.get("LORAFLOW_CONTROL_PLANE_BASE"):
        return base
    for candidate in (PUBLIC_BASE, OFFLINE_BASE):
        if docker("image", "inspect", candidate, check=False).returncode == 0:
            return candidate
    return PUBLIC_BASE


def prefect_cli(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "prefect", "--no-prompt", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def final_state(stack: LocalStack, flow_run_id: str) -> dict:
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while (state := prefect_api(stack, "GET", f"/flow_runs/{flow_run_id}").json()["state"])["type"] not in FINAL_STATES:
        assert time.monotonic() < deadline, f"flow run {flow_run_id} still {state['type']} after {RUN_TIMEOUT_S} s"
        time.sleep(2)
    return state


def test_a_train_deployment_of_the_docker_pool_completes_in_a_container_of_the_built_image(tiny_model: Path,
                                                                                          tmp_path: Path) -> None:
    run_dir = tmp_path / "run"  # the run file, its dataset and the file:// store, mounted at the same path
    store = run_dir / "store"
    store.mkdir(parents=True)
    dataset = shutil.copy(DATASET.resolve(), run_dir / "chat.jsonl")
    run_file = write_run_file(run_dir / "run.toml", name="e2e-docker-pool", model=tiny_model, store=store,
                              max_steps=4, dataset=Path(dataset))

    with LocalStack(tmp_path / "stack") as stack:
        env = ({k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "RUNPOD_", "HF_"))}
               | stack.client_env | {"LORAFLOW_CONTROL_PLANE_BASE": control_plane_base(),
                                    "LORAFLOW_CONTROL_PLANE_TAG": IMAGE.split(":")[1],
                                    "PREFECT_WORKER_QUERY_SECONDS": "2"})
        pool = prefect_cli(env, "work-pool", "create", POOL, "--type", "docker", "--overwrite")
        assert pool.returncode == 0, pool.stdout + pool.stderr
        started = time.monotonic()
        deploy = prefect_cli(env, "deploy", "--prefect-file", DOCKER_PREFECT_FILE, "--all", timeout=DEPLOY_TIMEOUT_S)
        assert deploy.returncode == 0, deploy.stdout[-5000:] + deploy.stderr[-5000:]
        print(f"deploy (image build included): {time.monotonic() - started:.0f} s")
        assert not (REPO / "deployments" / "docker" / "build-ca" / "ca.crt").exists()
        deployment = prefect_api(stack, "GET", "/deployments/name/train/qwen").json()
        assert deployment["work_pool_name"] == POOL
        assert deployment["job_variables"]["image"] == IMAGE
        assert deployment["job_variables"]["env"]["LORAFLOW_WORKER_IMAGE"] == stack.worker_image

        worker_log = tmp_path / "docker-worker.log"
        with worker_log.open("wb") as log:
            worker = subprocess.Popen([sys.executable, "-m", "prefect", "worker", "start", "--pool", POOL, "--type",
                                       "docker"], cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True)
        flow_run_id = None
        try:
            flow_run = prefect_api(stack, "POST", f"/deployments/{deployment['id']}/create_flow_run", json={
                "parameters": {"run_file": str(run_file)},
                "job_variables": {
                    # The container reaches the stack's servers on 127.0.0.1, and sees the run's folders
                    # (the model is read by the flow, the store written) at the paths localpod's workers use.
                    "network_mode": "host",
                    "volumes": [f"{run_dir}:{run_dir}", f"{tiny_model}:{tiny_model}:ro"],
                    "env": {k: stack.client_env[k] for k in ("RUNPOD_API_KEY", "RUNPOD_API_URL", "RUNPOD_JOB_URL",
                                                             "LORAFLOW_WORKER_IMAGE")},
                },
            }).json()
            flow_run_id = flow_run["id"]
            state = final_state(stack, flow_run_id)
            assert state["type"] == "COMPLETED", (state, worker_log.read_text()[-5000:])

            # It ran in a container of the image the build step made (prefect-docker labels its containers).
            [container] = containers(f"io.prefect.flow-run-id={flow_run_id}")
            assert docker("inspect", "--format", "{{.Config.Image}}", container).stdout.strip() == IMAGE
        finally:
            stop_process_group(worker)
            if flow_run_id:
                for container in containers(f"io.prefect.flow-run-id={flow_run_id}"):
                    docker("rm", "-f", container, check=False)

        # The training ran in localpod's workers; the run's endpoint is gone and its results are stored.
        [endpoint] = run_endpoints(stack, "e2e-docker-pool")
        assert endpoint["deletedAt"] is not None
    result_dir = store / "runs" / flow_run_id
    assert (result_dir / "DONE").exists()
    assert json.loads((result_dir / "metrics.json").read_text())["steps"] == 4
