"""The image carries no test switch: fault injection lives in the test-only `fault_injection` folder,
which acts only where a test puts it on PYTHONPATH, and only in a training process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from worker_test_support import CRASH_AT_STEP_ENV, CRASH_KIND_ENV, FAULT_INJECTION_DIR

PACKAGE = Path(__file__).resolve().parents[1] / "loraflow_worker"
"""The shipped package's sources: the image's wheel packages this folder and nothing else of worker_image/."""


def test_the_shipped_package_mentions_no_test_switch():
    files = [path for path in PACKAGE.rglob("*") if path.is_file() and "__pycache__" not in path.parts]
    assert PACKAGE / "training" / "train_job.py" in files and PACKAGE / "runtime" / "supervisor.py" in files
    assert CRASH_AT_STEP_ENV.startswith("LORAFLOW_TEST_") and CRASH_KIND_ENV.startswith("LORAFLOW_TEST_")
    assert [path.relative_to(PACKAGE) for path in files if b"LORAFLOW_TEST" in path.read_bytes()] == []


def test_the_fault_module_does_nothing_outside_a_training_process(tmp_path):
    # The handler (and localpod, when a chaos run's worker gets it) start with the same PYTHONPATH and switches.
    env = {**os.environ, "PYTHONPATH": str(FAULT_INJECTION_DIR), CRASH_AT_STEP_ENV: "0", CRASH_KIND_ENV: "kill"}
    probe = "import sitecustomize, transformers.trainer; print(sitecustomize.__file__)"
    ran = subprocess.run([sys.executable, "-c", probe], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert Path(ran.stdout.strip()) == FAULT_INJECTION_DIR / "sitecustomize.py"
