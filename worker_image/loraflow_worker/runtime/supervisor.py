"""Running one job's training (or an evaluate job's evaluation, `runtime/evaluate.py`: `run_child`) in a child
process, watching its console, and saying how it ended.

The training runs as `python -m loraflow_worker.training.train_job <work_dir>/job.json` in its own process group,
so a crash (a CUDA fault, a segfault at exit, the kernel's OOM killer) cannot take the worker with it and
a deadline can stop it with everything it started. The supervisor reads its merged stdout/stderr line by
line: marker lines (`LORAFLOW_PROGRESS {json}`) become progress updates; every other line is echoed
(secrets redacted: the environment's and the run's own, `JobInput.worker_secret_names`) and the last
`CONSOLE_TAIL_BYTES` are kept for the failure report.

Whether the job succeeded is decided by the store (`DONE`), not by the exit code; this module only says
what happened to the process and builds the error message when it failed. An out-of-memory failure's message
starts with its kind's marker (`memory.out_of_memory.MARKERS`): from the exception or the console, or, for a
SIGKILL, from the container's cgroup counting an OOM kill while the process ran.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import traceback
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from pydantic import BaseModel, ValidationError

from loraflow_worker.contract import JobInput, Progress
from loraflow_worker.memory.out_of_memory import (
    MARKERS,
    MemoryKind,
    OomKills,
    exception_memory_kind,
    memory_kind,
    read_oom_kills,
)
from loraflow_worker.runtime.environment import child_env
from loraflow_worker.runtime.redaction import redact_secrets

PROGRESS_MARKER = "LORAFLOW_PROGRESS "
"""Prefix of the console lines that carry a `Progress` as JSON."""
SPEC_FILE = "job.json"
"""The validated job input, in the work dir: the training process's only instructions."""
RESULT_FILE = "result.json"
"""Written by a training process that completed: its `JobResult`, the job's output (the store's copy cannot name the
commit that holds it, and anyone who can write the store could change it)."""
ERROR_FILE = "error.json"
"""Written by a training process that failed with an exception: `{type, message, memory_kind}` (memory_kind:
a `memory.out_of_memory.MemoryKind`, or null)."""
CONSOLE_TAIL_BYTES = 64 * 1024
DEADLINE_KILL_GRACE_S = 60.0
"""The training process stops itself at the deadline at the end of a step; this is how long past the
deadline it may take (a long step, saving) before it is killed."""
TERM_GRACE_S = 10.0
"""Between SIGTERM and SIGKILL when a training process is killed."""

_QUOTED_LINES = 10

log = logging.getLogger("loraflow_worker")


class JobFailed(RuntimeError):
    """The job did not complete; the message says why, with secrets removed."""


@dataclass
class ChildExit:
    """How a training process ended."""

    returncode: int
    """Exit code, or minus the signal number that killed it."""
    console_tail: str
    """The last `CONSOLE_TAIL_BYTES` of its console, secrets redacted."""
    error: dict[str, Any] | None
    """Its `error.json`, when it failed with an exception."""
    deadline_killed: bool
    oom_kills_before: OomKills | None = None
    """The container's cgroup OOM-kill counter just before the process started (None: unreadable)."""
    oom_kills_after: OomKills | None = None
    """The same counter once the process had ended."""
    secret_names: tuple[str, ...] = ()
    """The job's own secrets (`JobInput.worker_secret_names`), whose values the failure message never holds."""
    process: str = "training process"
    """Which process it was, as the failure message names it."""

    def failure_message(self) -> str:
        """What went wrong, for the job's error. An out-of-memory failure starts with the marker of its kind
        (`memory.out_of_memory.MARKERS`), so the control plane can tell which memory to add."""
        if self.deadline_killed:
            return (f"deadline reached: the {self.process} was still running {DEADLINE_KILL_GRACE_S:.0f} s after "
                    "the job's deadline and was killed")
        kind: MemoryKind | None = None
        if self.error is not None:
            message = f"{self.error.get('type', 'Error')}: {self.error.get('message', '')}"
            kind = self.error.get("memory_kind")
        else:
            if self.returncode < 0:
                number = -self.returncode
                message = f"the {self.process} was killed by signal {number} ({_signal_name(number)})"
                oom_killed = self._oom_killed()
                if oom_killed is not None:
                    message += f", which the worker did not send; {oom_killed}"
                    kind = "host_ram"
                elif number == signal.SIGKILL:
                    message += " (when nothing else stopped it, that is usually the kernel's out-of-memory killer: host RAM)"
            else:
                message = f"the {self.process} exited with code {self.returncode} without reporting an error"
            last = self.console_tail.splitlines()[-_QUOTED_LINES:]
            if last:
                message += "; its last console lines:\n" + "\n".join(last)
        # The failure's own text before the whole console, which may hold earlier lines of another kind.
        kind = kind or memory_kind(message) or memory_kind(self.console_tail)
        return redact_secrets(MARKERS[kind] + message if kind else message, secret_names=self.secret_names)

    def _oom_killed(self) -> str | None:
        """When the kernel's OOM killer ended the process (a SIGKILL the supervisor did not send while the
        cgroup's OOM-kill counter went up), what the cgroup says; else None."""
        before, after = self.oom_kills_before, self.oom_kills_after
        if self.returncode != -signal.SIGKILL or before is None or after is None or after.count <= before.count:
            return None
        limit = f"; memory limit {after.limit_bytes / 2**30:.1f} GiB" if after.limit_bytes is not None else ""
        return (f"the container's cgroup counted {after.count - before.count} OOM kill(s) while it ran "
                f"({after.counter} {before.count} -> {after.count}{limit}): the kernel's out-of-memory killer ended "
                "it, so give the job a host with more RAM or hold less in memory (dataset, data loader workers)")


def run_training(job: JobInput, work_dir: Path, on_progress: Callable[[Progress], None]) -> ChildExit:
    """Run `job`'s training process in `work_dir` (already empty) until it exits; returns quickly only
    when it does. Kills it (and its process group) once the job's deadline is `DEADLINE_KILL_GRACE_S` past."""
    deadline = job.deadline_epoch_s
    if deadline is not None and time.time() >= deadline:
        raise JobFailed(f"deadline reached before training started: the job's deadline_epoch_s ({deadline}) has passed")
    spec = work_dir / SPEC_FILE
    spec.write_text(job.model_dump_json(indent=2))
    return run_child("loraflow_worker.training.train_job", spec, child_env(job), deadline=deadline,
                     secret_names=job.worker_secret_names, on_progress=on_progress,
                     process="training process", label=f"run {job.run_id} attempt {job.attempt}")


def run_child(module: str, spec: Path, env: dict[str, str], *, deadline: float | None, secret_names: Sequence[str],
              on_progress: Callable[[Progress], None], process: str, label: str) -> ChildExit:
    """Run `python -m <module> <spec>` in the spec's folder with `env` until it exits, its console's progress lines
    sent to `on_progress` and the rest echoed (secrets redacted); kills it (and its process group) once `deadline` is
    `DEADLINE_KILL_GRACE_S` past. `process` names it (`training process`) in the log and the failure message, with
    `label` (the job it runs) in the log."""
    work_dir = spec.parent
    oom_kills_before = read_oom_kills()
    child = subprocess.Popen(
        [sys.executable, "-m", module, str(spec)],
        cwd=work_dir,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=_die_with_parent,
    )
    log.info("%s %d started for %s", process, child.pid, label)
    tail = ConsoleTail(CONSOLE_TAIL_BYTES)
    reader = threading.Thread(target=_read_console, args=(child.stdout, tail, on_progress, secret_names),
                              daemon=True)
    reader.start()
    deadline_killed = False
    try:
        while True:
            try:
                returncode = child.wait(timeout=1.0)
                break
            except subprocess.TimeoutExpired:
                if not deadline_killed and deadline is not None and time.time() > deadline + DEADLINE_KILL_GRACE_S:
                    log.error("%s %d overran the job's deadline; killing it", process, child.pid)
                    deadline_killed = True
                    _stop_group(child)
    finally:
        # Whatever it started (data loader workers, vLLM's engine) must not outlive it and hold the GPU.
        _signal_group(child, signal.SIGKILL)
        if child.poll() is None:
            child.wait()
        reader.join(timeout=10)
    log.info("%s %d exited with %s", process, child.pid, returncode)
    return ChildExit(returncode=returncode, console_tail=tail.text(), error=_read_error(work_dir / ERROR_FILE),
                     deadline_killed=deadline_killed, oom_kills_before=oom_kills_before,
                     oom_kills_after=read_oom_kills(), secret_names=tuple(secret_names),
                     process=process)


class ConsoleTail:
    """The last `limit` bytes of a console, as whole lines where possible."""

    def __init__(self, limit: int):
        self.limit = limit
        self._lines: collections.deque[str] = collections.deque()
        self._size = 0

    def add(self, line: str) -> None:
        self._lines.append(line)
        self._size += len(line.encode())
        while self._size > self.limit and len(self._lines) > 1:
            self._size -= len(self._lines.popleft().encode())

    def text(self) -> str:
        text = "".join(self._lines)
        return text.encode()[-self.limit:].decode(errors="ignore")


def _read_console(stream: IO[bytes], tail: ConsoleTail, on_progress: Callable[[Progress], None],
                  secret_names: Sequence[str] = ()) -> None:
    # Each line is redacted on arrival, so no secret reaches the echo, the tail or a progress message.
    for raw in iter(stream.readline, b""):
        line = redact_secrets(raw.decode(errors="replace"), secret_names=secret_names)
        if line.startswith(PROGRESS_MARKER):
            try:
                progress = Progress.model_validate_json(line[len(PROGRESS_MARKER):])
            except ValidationError:
                pass  # not ours after all: an ordinary line
            else:
                try:
                    on_progress(progress)
                except Exception:  # a failed progress post must not stop the console from being read
                    log.exception("progress update failed")
                continue
        tail.add(line)
        sys.stdout.write(line)
        sys.stdout.flush()
    stream.close()


def _read_error(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


def _stop_group(process: subprocess.Popen[bytes]) -> None:
    _signal_group(process, signal.SIGTERM)
    try:
        process.wait(timeout=TERM_GRACE_S)
    except subprocess.TimeoutExpired:
        _signal_group(process, signal.SIGKILL)


def _signal_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)  # start_new_session made the training process its group's leader


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return "unknown signal"


_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


def _die_with_parent() -> None:
    """Runs in the child before exec: a training process must not outlive a worker that was killed."""
    if _libc is not None:
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def send_progress(progress: Progress) -> None:
    """In a child process: hand `progress` to the supervisor, which reads it from the console."""
    print(PROGRESS_MARKER + progress.model_dump_json(), flush=True)


def child_main(args: list[str], module: str, run: Callable[[Path], BaseModel]) -> int:
    """A child process's entry (`python -m <module> WORK_DIR/job.json`): `run(spec)`'s result written beside the spec
    (`result.json`); on failure the traceback on the console and `error.json` for the supervisor. Its exit code."""
    if len(args) != 1:
        print(f"usage: python -m {module} WORK_DIR/job.json", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec = Path(args[0])
    try:
        (spec.parent / RESULT_FILE).write_text(run(spec).model_dump_json(indent=2))
    except BaseException as exc:  # noqa: BLE001 - every failure must leave its report, even KeyboardInterrupt
        traceback.print_exc()
        report = {"type": type(exc).__name__, "message": str(exc), "memory_kind": exception_memory_kind(exc)}
        (spec.parent / ERROR_FILE).write_text(json.dumps(report))
        return 1
    return 0
