"""`LORAFLOW_REQUIRE_CUDA=1`: a train job on a host whose CUDA cannot start fails within seconds and trains
nothing. This machine has no GPU and a CPU build of torch: it is such a host."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from loraflow_worker.runtime import cuda_check
from loraflow_worker.contract import CONTRACT_VERSION
from loraflow_worker.runtime.cuda_check import MARKER, REQUIRE_CUDA_ENV, CudaProbe, CudaUnavailable, check_cuda
from loraflow_worker.handler import WORK_DIR_ENV, handler
from loraflow_worker.runtime.model_cache import VOLUME_PATH_ENV
from loraflow_worker.runtime.preload import NoVolume


@dataclass
class RefusedJob:
    error: CudaUnavailable
    seconds: float
    run_dir: Path
    work_dir: Path
    log: str


@pytest.fixture(scope="module")
def refused_job(tiny_model_dir, make_job, tmp_path_factory) -> RefusedJob:
    """A train job through the handler with CUDA required, on this machine."""
    store_root, work_base = tmp_path_factory.mktemp("store"), tmp_path_factory.mktemp("work")
    records: list[logging.LogRecord] = []

    class _Recorder(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger, recorder = logging.getLogger("loraflow_worker"), _Recorder()
    old_level = logger.level
    logger.addHandler(recorder)
    logger.setLevel(logging.INFO)
    try:
        with pytest.MonkeyPatch.context() as env:
            env.setenv(REQUIRE_CUDA_ENV, "1")
            env.setenv(WORK_DIR_ENV, str(work_base))
            env.setenv("NVIDIA_VISIBLE_DEVICES", "all")
            started = time.monotonic()
            with pytest.raises(CudaUnavailable) as refused:
                handler(make_job("run-cuda", tiny_model_dir, store_root))
            seconds = time.monotonic() - started
    finally:
        logger.removeHandler(recorder)
        logger.setLevel(old_level)
    return RefusedJob(refused.value, seconds, store_root / "runs" / "run-cuda", work_base / "loraflow-job",
                      "\n".join(record.getMessage() for record in records))


def test_required_cuda_that_cannot_start_fails_the_job_with_the_marker(refused_job):
    assert str(refused_job.error).startswith("CUDA unavailable: LORAFLOW_REQUIRE_CUDA=1 and CUDA cannot start")


def test_the_error_names_the_torch_build_and_what_the_host_reports(refused_job):
    message = str(refused_job.error)
    import torch

    assert f"torch {torch.__version__} is a CPU build (torch.version.cuda is None)" in message
    assert "torch.cuda.device_count() = 0" in message
    assert "why: AssertionError: Torch not compiled with CUDA enabled" in message
    assert "NVML: unavailable (pynvml (nvidia-ml-py) is not installed)" in message
    assert "NVIDIA_VISIBLE_DEVICES=all, CUDA_VISIBLE_DEVICES unset" in message


def test_the_error_says_how_to_train_on_the_cpu_on_purpose(refused_job):
    assert str(refused_job.error).endswith(
        f"to train on the CPU on purpose (tests, a local demo), set {REQUIRE_CUDA_ENV}=0.")


def test_required_cuda_that_cannot_start_fails_within_seconds_and_trains_nothing(refused_job):
    assert refused_job.seconds < 30, refused_job.seconds
    assert "training process" not in refused_job.log  # the supervisor never started one
    assert not refused_job.work_dir.exists()  # nor made the job's work folder
    assert sorted(path.name for path in refused_job.run_dir.iterdir()) == ["dataset"]  # no console, no adapter


def test_a_cuda_build_on_an_old_driver_is_told_the_driver_it_needs():
    probe = CudaProbe(started=False, torch_version="2.14.0+cu130", torch_cuda="13.0", device_count=0,
                      failures=["RuntimeError: The NVIDIA driver on your system is too old (found version 12080)."],
                      nvml_driver="570.124.06", nvml_cuda="12.8", nvml_device_count=1,
                      visible_devices={"NVIDIA_VISIBLE_DEVICES": "all", "CUDA_VISIBLE_DEVICES": None})
    message = cuda_check.describe_unavailable(probe)
    assert message.startswith(MARKER)
    assert "torch 2.14.0+cu130 is built for CUDA 13.0, which needs an NVIDIA driver >= 580." in message
    assert "NVML: driver 570.124.06 (supports CUDA up to 12.8), 1 device(s)" in message
    assert ("Fix: run on a host whose NVIDIA driver is >= 580 (on RunPod: an endpoint whose minimum CUDA version "
            "is 13.0) with a GPU visible to the container") in message


def test_cuda_13_builds_need_driver_580():
    assert cuda_check.driver_floor("13.0") == "580"


def test_a_probe_that_does_not_answer_in_time_counts_as_cuda_unavailable(monkeypatch):
    monkeypatch.setattr(cuda_check, "PROBE_TIMEOUT_S", 0.01)
    probe = cuda_check.run_probe(os.environ)
    assert not probe.started
    assert probe.failures == ["the CUDA probe (`python -m loraflow_worker.runtime.cuda_check`) did not answer within 0 s: "
                              "the driver hangs while initialising"]


def test_without_the_requirement_the_worker_logs_that_cuda_is_not_required(monkeypatch, caplog):
    monkeypatch.delenv(REQUIRE_CUDA_ENV, raising=False)
    with caplog.at_level(logging.INFO, logger="loraflow_worker"):
        assert check_cuda(os.environ) is None
    assert [record.getMessage() for record in caplog.records] == [
        f"{REQUIRE_CUDA_ENV} is unset: CUDA is not required; without it this job trains on the CPU"]


def test_a_requirement_of_0_lets_the_job_train_on_the_cpu(monkeypatch, caplog):
    monkeypatch.setenv(REQUIRE_CUDA_ENV, "0")
    with caplog.at_level(logging.INFO, logger="loraflow_worker"):
        assert check_cuda(os.environ) is None
    assert [record.getMessage() for record in caplog.records] == [
        f"{REQUIRE_CUDA_ENV}=0: CUDA is not required; without it this job trains on the CPU"]


def test_a_requirement_other_than_0_or_1_is_refused(tiny_model_dir, make_job, tmp_path, monkeypatch):
    monkeypatch.setenv(REQUIRE_CUDA_ENV, "yes")
    monkeypatch.setenv(WORK_DIR_ENV, str(tmp_path / "work"))
    with pytest.raises(ValueError) as refused:
        handler(make_job("run-yes", tiny_model_dir, tmp_path / "store"))
    assert str(refused.value).startswith(f"{REQUIRE_CUDA_ENV}='yes' is neither 1 nor 0: set 1 to train on the GPU")
    assert not (tmp_path / "work").exists()


def test_preload_jobs_never_check_cuda(tmp_path, monkeypatch):
    # Required and unavailable: a preload still gets as far as its own first check (a volume).
    monkeypatch.setenv(REQUIRE_CUDA_ENV, "1")
    monkeypatch.setenv(VOLUME_PATH_ENV, str(tmp_path / "no-volume"))
    job = {"id": "job-p", "input": {"contract_version": CONTRACT_VERSION, "mode": "preload", "run_id": "preload-1",
                                    "models": [{"id": "loraflow-test/tiny-chat"}]}}
    with pytest.raises(NoVolume):
        handler(job)


def test_self_test_with_required_cuda_on_a_cpu_trains_nothing_and_says_why(tmp_path):
    env = {**os.environ, REQUIRE_CUDA_ENV: "1", "TMPDIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "loraflow_worker.self_test"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "self test: FAILED before any job: CUDA unavailable: " in done.stdout
    assert f"set {REQUIRE_CUDA_ENV}=0" in done.stdout
    assert "job completed" not in done.stdout
    assert list(tmp_path.iterdir()) == []  # not even the tiny model or the store: nothing to train on
