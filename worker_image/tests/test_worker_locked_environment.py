"""What ships is what is tested: the worker's tests run under the image's locked library versions.

`.venv-worker` is installed under `cpu-constraints.txt`, generated from the image's `requirements-gpu.lock`
by `cpu_constraints.py`; these tests run in it (`make test` runs the worker's tests with its interpreter).
"""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
from pathlib import Path

from packaging.utils import canonicalize_name

WORKER_IMAGE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(WORKER_IMAGE))
import cpu_constraints  # noqa: E402  (a script beside the lock, not part of the worker package)

TRAINING_STACK = ("transformers", "trl", "peft", "accelerate", "datasets", "huggingface-hub", "liger-kernel", "runpod",
                  "pydantic", "tokenizers", "safetensors", "triton")


def _locked() -> dict[str, str]:
    return cpu_constraints.locked_versions((WORKER_IMAGE / "requirements-gpu.lock").read_text())


def _installed() -> dict[str, str]:
    return {canonicalize_name(d.metadata["Name"]): d.version for d in importlib.metadata.distributions()}


def test_the_constraints_file_is_what_the_lock_generates():
    done = subprocess.run([sys.executable, str(WORKER_IMAGE / "cpu_constraints.py"), "--check"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_the_check_fails_when_the_lock_moves_and_the_constraints_do_not(tmp_path):
    for name in ("cpu_constraints.py", "cpu-constraints.txt", "requirements-gpu.lock"):
        shutil.copy(WORKER_IMAGE / name, tmp_path / name)
    lock = tmp_path / "requirements-gpu.lock"
    lock.write_text(lock.read_text().replace("transformers==5.20.2", "transformers==5.20.3"))
    done = subprocess.run([sys.executable, str(tmp_path / "cpu_constraints.py"), "--check"], capture_output=True, text=True)
    assert done.returncode == 1
    assert "cpu-constraints.txt disagrees with requirements-gpu.lock" in done.stderr


def test_this_environment_has_the_locked_training_stack():
    locked, installed = _locked(), _installed()
    for name in TRAINING_STACK:
        assert installed.get(name) == locked[name], f"{name}: installed {installed.get(name)}, the image's lock has {locked[name]}"


def test_every_installed_package_the_lock_pins_has_the_locked_version_except_torch():
    locked, installed = _locked(), _installed()
    differing = {name: (version, locked[name]) for name, version in installed.items()
                 if name in locked and version != locked[name] and name != "torch"}
    assert not differing, f"installed vs locked: {differing}"
    assert installed["torch"].split("+")[0] == cpu_constraints.CPU_TORCH


def test_no_gpu_only_package_is_installed():
    assert not [name for name in _installed() if cpu_constraints.is_gpu_only(name)]


def test_torch_is_the_cpu_build_the_constraints_pin():
    import torch

    assert _installed()["torch"] == cpu_constraints.CPU_TORCH_BUILD
    assert torch.version.cuda is None, f"torch {torch.__version__} is a CUDA build"
