"""The image's build steps as a plain script (no Docker engine here) and its lock. All offline. (The GPU smoke
script's CPU mode is tested in test_worker_gpu_smoke.py.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path


WORKER_IMAGE = Path(__file__).resolve().parents[1]
BUILD = WORKER_IMAGE / "build.sh"
LOCK = WORKER_IMAGE / "requirements-gpu.lock"


def _run(script: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(script), *args], capture_output=True, text=True, timeout=240,
        env={**os.environ, "PYTHON": sys.executable, **env},
    )


def test_check_parses_the_lock_and_installs_the_worker_without_dependencies(tmp_path):
    target = tmp_path / "site"
    done = _run(BUILD, "check", "--target", str(target))
    assert done.returncode == 0, done.stderr
    assert re.search(r"lock ok: \d+ packages pinned with hashes; torch 2\.14\.0, vllm 0\.33\.0, transformers 5\.20\.", done.stdout)
    assert "worker ok:" in done.stdout
    assert (target / "loraflow_worker" / "handler.py").is_file()
    assert not (target / "torch").exists() and not (target / "pydantic").exists()  # --no-deps


def test_the_lock_pins_the_whole_gpu_stack():
    pinned = dict(re.findall(r"^([a-z0-9][a-z0-9._-]*)==(\S+)", LOCK.read_text(), re.MULTILINE))
    for name in ("torch", "vllm", "transformers", "trl", "peft", "accelerate", "datasets", "liger-kernel",
                 "flash-linear-attention", "fla-core", "bitsandbytes", "triton", "runpod", "hatchling"):
        assert name in pinned, name
    assert pinned["trl"] == "1.16.0" and pinned["peft"] == "0.21.0"


def test_check_refuses_a_lock_that_no_longer_matches_its_requirements(tmp_path):
    copy = tmp_path / "worker_image"
    copy.mkdir()
    for name in ("build.sh", "requirements-gpu.lock", "pyproject.toml"):
        (copy / name).write_bytes((WORKER_IMAGE / name).read_bytes())
    (copy / "requirements-gpu.in").write_text((WORKER_IMAGE / "requirements-gpu.in").read_text() + "trl==9.9.9\n")
    done = _run(copy / "build.sh", "check")
    assert done.returncode != 0
    assert "is out of date: " in done.stderr and "asks for `trl==9.9.9`, the lock has 1.16.0" in done.stderr


def test_check_refuses_an_unpinned_lock_entry(tmp_path):
    copy = tmp_path / "worker_image"
    copy.mkdir()
    for name in ("build.sh", "requirements-gpu.in", "pyproject.toml"):
        (copy / name).write_bytes((WORKER_IMAGE / name).read_bytes())
    (copy / "requirements-gpu.lock").write_text(LOCK.read_text() + "numpy>=2\n")
    done = _run(copy / "build.sh", "check")
    assert done.returncode != 0 and "`numpy>=2` is not pinned with ==" in done.stderr


def test_image_tag_names_version_cuda_and_sm_architectures():
    assert _run(BUILD, "tag", TORCH_CUDA_ARCH_LIST="9.0").stdout.strip() == "loraflow-worker:0.1.0-cu130-sm90"
    tag = _run(BUILD, "tag", TORCH_CUDA_ARCH_LIST="8.0;8.9;9.0+PTX", IMAGE_REPO="ghcr.io/acme/lf").stdout.strip()
    assert tag == "ghcr.io/acme/lf:0.1.0-cu130-sm80-89-90"


def test_the_dockerfile_runs_the_build_script_steps_and_starts_the_handler():
    dockerfile = (WORKER_IMAGE / "Dockerfile").read_text()
    build_stage, final_stage = re.split(r"^FROM .*$", dockerfile, flags=re.MULTILINE)[1:]
    steps = lambda stage: re.findall(r"^RUN bash build\.sh (\w+)", stage, re.MULTILINE)  # noqa: E731
    assert steps(build_stage) == ["system", "deps"]
    assert steps(final_stage) == ["system", "worker"]
    assert "bash build.sh verify" in final_stage
    assert 'CMD ["python", "-m", "loraflow_worker.handler"]' in final_stage
    assert "ARG TORCH_CUDA_ARCH_LIST=" in final_stage


def test_the_build_ca_stays_in_the_build_stage():
    dockerfile = (WORKER_IMAGE / "Dockerfile").read_text()
    build_stage, final_stage = re.split(r"^FROM .*$", dockerfile, flags=re.MULTILINE)[1:]
    assert "COPY build-ca/" in build_stage
    # The final stage copies named paths only (never the whole folder, which may hold build-ca/ca.crt).
    copied = re.findall(r"^COPY (?!--from)(.+) \S+$", final_stage, re.MULTILINE)
    assert copied and not [source for source in copied if source.strip() in (".", "build-ca/")], copied
