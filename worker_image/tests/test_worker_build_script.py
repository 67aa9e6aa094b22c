"""The image's build steps as a plain script (no Docker engine here) and its lock. All offline. (The GPU smoke
script's CPU mode is tested in test_worker_gpu_smoke.py.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from loraflow_worker.contract import CONTRACT_VERSION

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


def test_image_tag_names_version_contract_cuda_and_sm_architectures():
    assert _run(BUILD, "tag", TORCH_CUDA_ARCH_LIST="9.0").stdout.strip() == \
        f"loraflow-worker:0.1.0-contract{CONTRACT_VERSION}-cu130-sm90"
    tag = _run(BUILD, "tag", TORCH_CUDA_ARCH_LIST="8.0;8.9;9.0+PTX", IMAGE_REPO="ghcr.io/acme/lf").stdout.strip()
    assert tag == f"ghcr.io/acme/lf:0.1.0-contract{CONTRACT_VERSION}-cu130-sm80-89-90"


def test_the_control_plane_reads_the_contract_version_from_the_tag():
    # The control plane's pattern (tasks/placement/image_contract.py), on the tag part of the reference.
    tag = _run(BUILD, "tag", IMAGE_REPO="registry.example:5000/lf").stdout.strip().rsplit(":", 1)[1]
    assert re.search(r"(?:^|[-_.:])contract(\d+)(?=$|[-_.])", tag).group(1) == str(CONTRACT_VERSION)


def test_contract_version_is_read_from_the_contract_and_checked():
    assert _run(BUILD, "contract-version").stdout.strip() == str(CONTRACT_VERSION)
    assert _run(BUILD, "contract-version", "--expect", str(CONTRACT_VERSION)).returncode == 0
    wrong = _run(BUILD, "contract-version", "--expect", str(CONTRACT_VERSION + 1))
    assert wrong.returncode != 0
    assert f"the build says contract version '{CONTRACT_VERSION + 1}' and contract/version.py says {CONTRACT_VERSION}" in wrong.stderr


def test_the_image_carries_its_contract_version_as_a_label_checked_against_its_code():
    final_stage = _stages()[1]
    assert "ARG CONTRACT_VERSION\n" in final_stage
    assert "LABEL ai.loraflow.contract-version=${CONTRACT_VERSION}" in final_stage
    assert 'bash build.sh contract-version --expect "${CONTRACT_VERSION}"' in final_stage
    image_sh = (WORKER_IMAGE / "image.sh").read_text()
    assert '--build-arg "CONTRACT_VERSION=$(bash "$HERE/build.sh" contract-version)"' in image_sh


def test_the_image_asks_the_nvidia_runtime_for_gpus_and_sends_no_usage_stats():
    env = dict(re.findall(r"^\s*(?:ENV\s+)?([A-Z_]+)=(\S+?)\s*\\?$", _stages()[1], re.MULTILINE))
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility"
    assert env["VLLM_NO_USAGE_STATS"] == "1" and env["DO_NOT_TRACK"] == "1"


def test_the_image_keeps_fla_on_its_triton_kernels():
    env = dict(re.findall(r"^\s*(?:ENV\s+)?([A-Z_]+)=(\S+?)\s*\\?$", _stages()[1], re.MULTILINE))
    assert env["FLA_TILELANG"] == "0"


def _stages() -> list[str]:
    """The Dockerfile's build stage and final stage."""
    return re.split(r"^FROM .*$", (WORKER_IMAGE / "Dockerfile").read_text(), flags=re.MULTILINE)[1:]


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
