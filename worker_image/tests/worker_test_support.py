"""Constants and helpers the worker tests share (a module of its own: `conftest` is a name both test
folders use, so tests cannot import from it reliably)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from fault_injection.sitecustomize import CRASH_AT_STEP_ENV, CRASH_KIND_ENV

FAULT_INJECTION_DIR = Path(__file__).resolve().parent / "fault_injection"
"""The test-only fault module's folder (its `sitecustomize` plants the failures): on a training
process's PYTHONPATH, it fails that process as `LORAFLOW_TEST_CRASH_*` say."""
PLANTED_SECRET = "hf_planted_secret_value_123"
"""Set as HF_TOKEN while jobs run: it must never show up in anything the worker stores or returns."""
BASE_TRAINING = {"max_steps": 50, "learning_rate": 1e-2, "batch_size": 8}


def stored_files_containing(root: Path, text: str) -> list[Path]:
    """Every file under `root` whose bytes contain `text`."""
    needle = text.encode()
    return [path for path in root.rglob("*") if path.is_file() and needle in path.read_bytes()]


def plant_fault(env: pytest.MonkeyPatch, kind: str, *, at_step: int | None = None) -> None:
    """Make the training processes of the jobs run while `env` is in force fail the way `kind` says, at
    the end of optimizer step `at_step` (0: before training starts); see `fault_injection/sitecustomize.py`.
    The handler runs in this process; the training process it starts inherits PYTHONPATH and the switches."""
    env.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(FAULT_INJECTION_DIR), os.environ.get("PYTHONPATH")])))
    env.setenv(CRASH_KIND_ENV, kind)
    if at_step is None:
        env.delenv(CRASH_AT_STEP_ENV, raising=False)
    else:
        env.setenv(CRASH_AT_STEP_ENV, str(at_step))
