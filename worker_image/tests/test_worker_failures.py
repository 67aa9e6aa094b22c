"""Training processes that fail: what the job's error says, what the store keeps, what never leaks.

The failures are planted from outside the worker package, by the test-only fault module
(`fault_injection/sitecustomize.py`, see `plant_fault`); step 0 fails before the training stack is
imported, so these are quick.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from worker_test_support import CRASH_KIND_ENV, PLANTED_SECRET, plant_fault, stored_files_containing

from loraflow_worker import supervisor
from loraflow_worker.handler import WORK_DIR_ENV, JobFailed, handler
from loraflow_worker.supervisor import CONSOLE_TAIL_BYTES, ChildExit, ConsoleTail


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


def test_out_of_memory_is_reported_as_such(tiny_model_dir, make_job, tmp_path, monkeypatch):
    error = _run_failing(make_job("run-o", tiny_model_dir, tmp_path / "store"), tmp_path / "work", monkeypatch, 0, "oom")
    assert str(error).startswith("out of memory: OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB")


def test_killed_training_process_is_reported_with_its_signal(tiny_model_dir, make_job, tmp_path, monkeypatch):
    error = _run_failing(make_job("run-s", tiny_model_dir, tmp_path / "store"), tmp_path / "work", monkeypatch, 0, "kill")
    assert str(error).startswith("the training process was killed by signal 9 (SIGKILL)")
    assert str(error).endswith("its last console lines:\nLORAFLOW_TEST_CRASH_AT_STEP: crashing (kill)")
    assert (tmp_path / "store" / "runs" / "run-s" / "console.txt").is_file()


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
    assert f"{CRASH_KIND_ENV}='segv'" in str(error) and "kill, oom, error, hang, exit-after-done" in str(error)


def test_cuda_out_of_memory_in_the_console_marks_a_killed_process_as_out_of_memory():
    ended = ChildExit(returncode=-6, console_tail="RuntimeError: CUDA error: out of memory\n", error=None,
                      deadline_killed=False)
    assert ended.failure_message().startswith("out of memory: the training process was killed by signal 6 (SIGABRT)")


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
