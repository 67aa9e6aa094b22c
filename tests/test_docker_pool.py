"""The Docker work pool's prefect file (deployments/docker/prefect.yaml) and the control-plane image it builds
(deployments/docker/Dockerfile), checked without a Docker engine. tests/image/test_docker_pool_e2e.py builds
the image and runs a flow in it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import yaml
from docker.utils.build import exclude_paths
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.conftest import prefect_api

REPO = Path(__file__).resolve().parent.parent
DOCKER_PREFECT_FILE = REPO / "deployments" / "docker" / "prefect.yaml"
DOCKER_POOL = "loraflow-docker"
TRAINING_STACK = {"torch", "trl", "peft", "accelerate", "datasets", "vllm", "runpod"}
"""transformers is not among them: without torch the control plane uses its tokenizers only (the first chats, rendered
before renting)."""


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def step(steps: list[dict], name: str) -> dict:
    [found] = [s[name] for s in steps if name in s]
    return found


def build_context() -> set[str]:
    """What `docker build` (docker-py, as prefect-docker calls it) sends from the repository's root."""
    patterns = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    return set(exclude_paths(str(REPO), patterns, dockerfile="deployments/docker/Dockerfile"))


def test_the_docker_file_deploys_the_same_deployments_as_prefect_yaml():
    process, docker = load(REPO / "prefect.yaml")["deployments"], load(DOCKER_PREFECT_FILE)["deployments"]
    fields = ("name", "entrypoint", "description", "parameters", "schedules")
    assert [{f: d.get(f) for f in fields} for d in docker] == [{f: d.get(f) for f in fields} for d in process]


def test_every_docker_deployment_runs_in_the_image_the_build_step_makes():
    config = load(DOCKER_PREFECT_FILE)
    build = step(config["build"], "prefect_docker.deployments.steps.build_docker_image")
    assert build["id"] == "build-image"
    for deployment in config["deployments"]:
        pool = deployment["work_pool"]
        assert pool["name"] == DOCKER_POOL, deployment["name"]
        assert pool["job_variables"]["image"] == "{{ build-image.image }}", deployment["name"]
    # The flows run from the image's checkout, its WORKDIR.
    workdir = re.findall(r"^WORKDIR (\S+)", (REPO / build["dockerfile"]).read_text(), re.MULTILINE)[-1]
    assert step(config["pull"], "prefect.deployments.steps.set_working_directory")["directory"] == workdir


def test_the_build_context_holds_every_copied_path_and_no_environment():
    dockerfile = REPO / step(load(DOCKER_PREFECT_FILE)["build"], "prefect_docker.deployments.steps.build_docker_image"
                             )["dockerfile"]
    context = build_context()
    sources = [s for line in dockerfile.read_text().splitlines() if line.startswith("COPY ") and "--from" not in line
               for s in line.split()[1:-1]]
    assert sources
    for source in sources:
        matches = list(REPO.glob(source.rstrip("/")))
        assert matches, f"COPY {source}: nothing in the repository"
        for path in matches:
            assert str(path.relative_to(REPO)) in context, f"COPY {source}: {path} is left out by .dockerignore"
    # The two virtual environments (GBs), localpod and the tests stay out.
    assert not {p for p in context if p.split("/")[0] in {".venv", ".venv-worker", "localpod", "tests", ".git"}}


def test_the_control_plane_depends_on_no_training_package():
    # The closure of loraflow's requirements as installed in .venv (the image installs the same, with the same
    # constraints): the training stack stays in the worker image.
    seen: set[str] = set()
    todo = ["loraflow"]
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        for text in metadata.requires(name) or []:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    assert "prefect-docker" in seen and "loraflow-worker" in seen
    assert not seen & TRAINING_STACK


def test_deploying_the_docker_file_without_a_docker_engine_fails_naming_docker_and_creates_nothing(local_stack):
    env = ({k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")} | local_stack.client_env
           | {"DOCKER_HOST": "unix:///nonexistent/docker.sock"})
    prefect = [sys.executable, "-m", "prefect", "--no-prompt"]
    pool = subprocess.run([*prefect, "work-pool", "create", DOCKER_POOL, "--type", "docker", "--overwrite"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)
    assert pool.returncode == 0, pool.stdout + pool.stderr
    try:
        deploy = subprocess.run([*prefect, "deploy", "--prefect-file", str(DOCKER_PREFECT_FILE.relative_to(REPO)),
                                 "--all"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        output = deploy.stdout + deploy.stderr
        assert deploy.returncode != 0, output[-3000:]
        # prefect's docker client names the cause (prefect/utilities/dockerutils.py).
        assert "Docker is not running" in output, output[-3000:]
        created = prefect_api(local_stack, "POST", "/deployments/filter", json={
            "work_pools": {"name": {"any_": [DOCKER_POOL]}}}).json()
        assert created == []
    finally:
        # The build's CA step ran before the build failed; the step after it never did.
        (REPO / "deployments" / "docker" / "build-ca" / "ca.crt").unlink(missing_ok=True)
        prefect_api(local_stack, "DELETE", f"/work_pools/{DOCKER_POOL}")
