"""Tests that need the built worker image and a Docker engine (`make image-test` runs them).

They run only when `LORAFLOW_IMAGE` names the image, e.g.

    LORAFLOW_IMAGE="$(bash worker_image/build.sh tag)" .venv/bin/python -m pytest tests/image

`pytest tests` (what `make test` runs) leaves this folder out when the variable is unset; asking for the
folder itself without it is a usage error, and naming an image the engine does not have fails every test
here: nothing is skipped. `DOCKER` names the Docker client (default `docker`).
"""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
IMAGE = os.environ.get("LORAFLOW_IMAGE", "")
DOCKER = shlex.split(os.environ.get("DOCKER") or "docker")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if IMAGE:
        return None
    if _asked_for_this_folder(config):
        raise pytest.UsageError(
            "tests/image tests the built worker image: name it with LORAFLOW_IMAGE=<tag> "
            '(`make image-test` does; the tag is `bash worker_image/build.sh tag`), e.g. LORAFLOW_IMAGE="$(bash '
            'worker_image/build.sh tag)" .venv/bin/python -m pytest tests/image'
        )
    return True


@pytest.fixture(scope="session")
def worker_image() -> str:
    """The image `LORAFLOW_IMAGE` names, once the Docker engine is known to have it."""
    try:
        found = subprocess.run([*DOCKER, "image", "inspect", "--format", "{{.Id}}", IMAGE], capture_output=True,
                               text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.fail(f"no Docker client answers `{shlex.join(DOCKER)}` ({e}): install Docker, or set DOCKER",
                    pytrace=False)
    if found.returncode != 0:
        pytest.fail(f"LORAFLOW_IMAGE names {IMAGE}, which the Docker engine does not have "
                    f"({found.stderr.strip()}): build it with `make image`", pytrace=False)
    return IMAGE


def docker(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*DOCKER, *args], capture_output=True, text=True, timeout=120, check=check)


def containers(label: str) -> list[str]:
    """Names of the containers, running or not, that carry `label` (`key=value`)."""
    listed = docker("ps", "--all", "--filter", f"label={label}", "--format", "{{.Names}}").stdout
    return listed.split()


def _asked_for_this_folder(config: pytest.Config) -> bool:
    for arg in config.args:
        path = (config.invocation_params.dir / arg.split("::")[0]).resolve()
        if path == HERE or HERE in path.parents:
            return True
    return False
