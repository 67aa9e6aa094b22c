"""The `docker run` command that makes a worker a container of its endpoint's image, with the docker runtime."""

from __future__ import annotations

import shlex
from pathlib import Path

from localpod.models import LocalpodConfig
from localpod.state.records import EndpointRecord
from localpod.volumes import docker_volume_args


def docker_run_command(
    config: LocalpodConfig, endpoint: EndpointRecord, worker_id: str, env_names: list[str], disk: Path, instance: str
) -> list[str]:
    """`docker run` for one worker: a container of the endpoint's image that passes on the variables named in
    `env_names` from the client's own environment, and nothing else of this machine's environment.

    Host networking lets the worker call localpod back on `config.base_url`; the scratch disk and each
    `worker_mounts` folder appear at their own paths, the endpoint's network volume at /runpod-volume. Attached (no
    `-d`), so the client lives as long as the container and relays its output and signals; `--rm` removes it once it
    exits; `--pull never` makes a missing image fail at once (RunPod pulls; this machine may reach no registry).
    """
    container = config.container_name(worker_id)
    assert container is not None, "docker_run_command needs the docker runtime"
    command = [
        *config.docker_command, "run", "--rm", "--pull", "never", "--sig-proxy=true", "--name", container,
        "--network", "host",
        "--label", f"localpod.instance={instance}", "--label", f"localpod.endpoint={endpoint.id}",
        "--label", f"localpod.worker={worker_id}",
        "--volume", f"{disk}:{disk}",
    ]  # fmt: skip
    for mount in config.worker_mounts:
        command += ["--volume", f"{mount}:{mount}"]
    command += docker_volume_args(config, endpoint.spec)
    for name in env_names:
        command += ["--env", name]
    # RunPod's `args`: what the container runs instead of the image's command.
    return [*command, endpoint.spec["image"], *shlex.split(endpoint.spec.get("args") or "")]
