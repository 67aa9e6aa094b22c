"""Training processes that fail: what the job's error says (out of memory by kind: `out_of_memory.MARKERS`),
what the store keeps, what never leaks.

The failures are planted from outside the worker package, by the test-only fault module
(`fault_injection/sitecustomize.py`, see `plant_fault`); step 0 fails before the training stack is
imported, so these are quick.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from fault_injection.sitecustomize import KINDS, fake_cgroup_root
from worker_test_support import (CRASH_AT_STEP_ENV, CRASH_KIND_ENV, FAULT_INJECTION_DIR, PLANTED_SECRET, plant_fault,
                                 stored_files_containing)

from loraflow_worker.runtime import supervisor
from loraflow_worker.memory import out_of_memory
from loraflow_worker.handler import WORK_DIR_ENV, JobFailed, handler
from loraflow_worker.memory.out_of_memory import OomKills
from loraflow_worker.runtime.supervisor import CONSOLE_TAIL_BYTES, ChildExit, ConsoleTail


@dataclass
class FailedJob:
    error: JobFailed
    run_dir: Path


@pytest.fixture(scope="module")
def failed_job(tiny_model_dir, make_job, tmp_path_factory) -> FailedJob:
    """A training process that prints HF_TOKEN and then raises an error quoting it."""
    store_root = tmp_path_factory.mktemp("store")
    with pytest.MonkeyPatch.context() as env:
        env.setenv(WORK_DIR_ENV, str(tmp_path_factory.mktemp("work")))
        env.setenv("HF_TOKEN", PLANTED_SECRET)
        plant_fault(env, "error", at_step=0)
        with pytest.raises(JobFailed) as failed:
            handler(make_job("run-f", tiny_model_dir, store_root))
    return FailedJob(failed.value, store_root / "runs" / "run-f")


def _run_failing(job: dict, work_dir: Path, monkeypatch, step: int, kind: str) -> JobFailed:
    monkeypatch.setenv(WORK_DIR_ENV, str(work_dir))
    plant_fault(monkeypatch, kind, at_step=step)
    with pytest.raises(JobFailed) as failed:
        handler(job)
    return failed.value


def test_error_names_the_training_process_exception(failed_job):
    assert str(failed_job.error) == "RuntimeError: planted failure while holding token ***"


def test_failed_training_stores_its_console_tail_and_no_done(failed_job):
    console = (failed_job.run_dir / "console.txt").read_text()
    assert "Traceback (most recent call last)" in console
    assert "RuntimeError: planted failure while holding token ***" in console
    assert "HF_TOKEN is ***" in console  # printed on stdout and on stderr, both redacted
    assert not (failed_job.run_dir / "DONE").exists()


def test_planted_token_is_in_no_stored_file_and_not_in_the_error(failed_job):
    assert PLANTED_SECRET not in str(failed_job.error)
    assert stored_files_containing(failed_job.run_dir, PLANTED_SECRET) == []


def test_torch_out_of_memory_error_is_gpu_out_of_memory(tiny_model_dir, make_job, tmp_path, monkeypatch):
    error = _run_failing(make_job("run-o", tiny_model_dir, tmp_path / "store"), tmp_path / "work", monkeypatch, 0, "oom")
    assert str(error).startswith("out of memory (GPU): OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB")


def test_cuda_error_out_of_memory_in_the_console_is_gpu_out_of_memory(tiny_model_dir, make_job, tmp_path, monkeypatch):
    error = _run_failing(make_job("run-ce", tiny_model_dir, tmp_path / "store"), tmp_path / "work", monkeypatch, 0,
                         "cuda-error-oom")
    assert str(error).startswith("out of memory (GPU): the training process exited with code 1 without reporting an error")
    assert "RuntimeError: CUDA error: out of memory" in str(error)


def test_cublas_alloc_failure_in_the_console_is_gpu_out_of_memory(tiny_model_dir, make_job, tmp_path, monkeypatch):
    error = _run_failing(make_job("run-cb", tiny_model_dir, tmp_path / "store"), tmp_path / "work", monkeypatch, 0,
                         "cublas-alloc")
    assert str(error).startswith("out of memory (GPU): the training process exited with code 1 without reporting an error")
    assert "CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`" in str(error)


def test_vllm_without_memory_for_its_kv_cache_is_vllm_kv_cache_out_of_memory(tiny_model_dir, make_job, tmp_path,
                                                                             monkeypatch):
    error = _run_failing(make_job("run-kv", tiny_model_dir, tmp_path / "store"), tmp_path / "work", monkeypatch, 0,
                         "vllm-kv-cache")
    assert str(error).startswith("out of memory (vLLM KV cache): the training process exited with code 1")
    assert "ValueError: No available memory for the cache blocks." in str(error)


def test_the_oom_killer_ending_the_training_process_is_host_ram_out_of_memory(tiny_model_dir, make_job, tmp_path,
                                                                              monkeypatch):
    error = _run_failing(make_job("run-ok", tiny_model_dir, tmp_path / "store"), tmp_path / "work", monkeypatch, 0,
                         "oom-killer")
    assert str(error).startswith(
        "out of memory (host RAM): the training process was killed by signal 9 (SIGKILL), which the worker did not "
        "send; the container's cgroup counted 1 OOM kill(s) while it ran ")
    assert "memory.events oom_kill 0 -> 1; memory limit 8.0 GiB): the kernel's out-of-memory killer ended it" in str(error)


def test_the_oom_killer_fault_reaches_a_handler_process_of_its_own(tiny_model_dir, make_job, tmp_path):
    # As localpod runs a chaos run's worker: the fault module, on the handler's PYTHONPATH, fakes its cgroup.
    job = make_job("run-oh", tiny_model_dir, tmp_path / "store")
    env = {**os.environ, "PYTHONPATH": str(FAULT_INJECTION_DIR), CRASH_KIND_ENV: "oom-killer",
           CRASH_AT_STEP_ENV: "0", WORK_DIR_ENV: str(tmp_path / "work")}
    ran = subprocess.run([sys.executable, "-m", "loraflow_worker.handler", "--test_input", json.dumps(job)], env=env,
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert '"error_message": "out of memory (host RAM): the training process was killed by signal 9' in ran.stdout + ran.stderr


def test_killed_training_process_is_reported_with_its_signal(tiny_model_dir, make_job, tmp_path, monkeypatch):
    error = _run_failing(make_job("run-s", tiny_model_dir, tmp_path / "store"), tmp_path / "work", monkeypatch, 0, "kill")
    assert str(error).startswith("the training process was killed by signal 9 (SIGKILL)")
    assert str(error).endswith("its last console lines:\nLORAFLOW_TEST_CRASH_AT_STEP: crashing (kill)")
    assert (tmp_path / "store" / "runs" / "run-s" / "console.txt").is_file()


def test_a_sigkill_without_an_oom_kill_counted_is_not_out_of_memory(tiny_model_dir, make_job, tmp_path, monkeypatch):
    # The fake cgroup of `oom-killer`, read by the worker, while the training process is killed by something else.
    monkeypatch.setenv(WORK_DIR_ENV, str(tmp_path / "work"))
    monkeypatch.setattr(out_of_memory, "CGROUP_ROOT", fake_cgroup_root(os.getpid()))
    error = _run_failing(make_job("run-k", tiny_model_dir, tmp_path / "store"), tmp_path / "work", monkeypatch, 0, "kill")
    assert str(error).startswith("the training process was killed by signal 9 (SIGKILL) (when nothing else stopped it")
    assert "out of memory (" not in str(error)


@pytest.mark.timeout(60)
def test_training_process_that_overruns_the_deadline_is_killed(tiny_model_dir, make_job, tmp_path, monkeypatch):
    monkeypatch.setattr(supervisor, "DEADLINE_KILL_GRACE_S", 1.0)
    monkeypatch.setattr(supervisor, "TERM_GRACE_S", 1.0)
    deadline = time.time() + 2
    job = make_job("run-h", tiny_model_dir, tmp_path / "store", deadline_epoch_s=deadline)
    # `hang` ignores SIGTERM, so the supervisor has to escalate to SIGKILL.
    error = _run_failing(job, tmp_path / "work", monkeypatch, 0, "hang")
    assert str(error).startswith("deadline reached: the training process was still running")
    assert time.time() - deadline < 1.0 + 1.0 + 3.0


def test_crash_after_done_still_completes_the_job(tiny_model_dir, make_job, tmp_path, monkeypatch, caplog):
    # vLLM can segfault at interpreter exit after everything was stored: the artifacts decide.
    monkeypatch.setenv(WORK_DIR_ENV, str(tmp_path / "work"))
    plant_fault(monkeypatch, "exit-after-done")
    with caplog.at_level(logging.INFO, logger="loraflow_worker"):
        result = handler(make_job("run-x", tiny_model_dir, tmp_path / "store", training={"max_steps": 2}))
    assert result["status"] == "completed" and result["metrics"]["steps"] == 2
    assert any(r.getMessage().endswith("exited with -11") for r in caplog.records), caplog.text  # SIGSEGV: it did crash
    assert not (tmp_path / "store" / "runs" / "run-x" / "console.txt").exists()


def test_an_unknown_fault_kind_fails_the_job_saying_what_is_known(tiny_model_dir, make_job, tmp_path, monkeypatch):
    # A typo in a test's fault must not pass as a job that never failed.
    error = _run_failing(make_job("run-u", tiny_model_dir, tmp_path / "store"), tmp_path / "work", monkeypatch, 0, "segv")
    assert str(error).startswith("the training process exited with code 2 without reporting an error")
    assert f"{CRASH_KIND_ENV}='segv'" in str(error) and ", ".join(KINDS) in str(error)


def test_cuda_out_of_memory_in_the_console_marks_a_killed_process_as_gpu_out_of_memory():
    ended = ChildExit(returncode=-6, console_tail="RuntimeError: CUDA error: out of memory\n", error=None,
                      deadline_killed=False)
    assert ended.failure_message().startswith(
        "out of memory (GPU): the training process was killed by signal 6 (SIGABRT)")


def test_a_memory_error_in_the_training_process_is_host_ram_out_of_memory():
    ended = ChildExit(returncode=1, console_tail="MemoryError\n", error={"type": "MemoryError", "message": "",
                                                                        "memory_kind": "host_ram"},
                      deadline_killed=False)
    assert ended.failure_message() == "out of memory (host RAM): MemoryError: "


def test_the_exceptions_own_kind_wins_over_earlier_console_lines():
    ended = ChildExit(returncode=1, console_tail="warning: CUDA out of memory, retrying with a smaller batch\n",
                      error={"type": "ValueError", "memory_kind": "vllm_kv_cache",
                             "message": "No available memory for the cache blocks."}, deadline_killed=False)
    assert ended.failure_message().startswith("out of memory (vLLM KV cache): ValueError: No available memory")


def test_an_oom_kill_counted_during_a_deadline_kill_is_still_the_deadline():
    ended = ChildExit(returncode=-9, console_tail="", error=None, deadline_killed=True,
                      oom_kills_before=OomKills(0, "memory.events oom_kill", None),
                      oom_kills_after=OomKills(1, "memory.events oom_kill", None))
    assert ended.failure_message().startswith("deadline reached: ")


def test_exit_code_without_an_error_report_is_named():
    ended = ChildExit(returncode=3, console_tail="", error=None, deadline_killed=False)
    assert ended.failure_message() == "the training process exited with code 3 without reporting an error"


def test_console_tail_keeps_the_last_64_kb_in_whole_lines():
    tail = ConsoleTail(CONSOLE_TAIL_BYTES)
    for number in range(10_000):
        tail.add(f"line {number:05d} {'x' * 90}\n")
    text = tail.text()
    assert len(text.encode()) <= CONSOLE_TAIL_BYTES
    assert text.startswith("line ") and text.endswith(f"line 09999 {'x' * 90}\n")
