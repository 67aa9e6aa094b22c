"""A worker process as the operating system sees it: signals to its process group and to every descendant
(wherever its session), the tail of its log, and its death with localpod."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess

from localpod.state.records import WorkerRecord

_LOG_TAIL_BYTES = 2048


def signal_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)  # start_new_session made the worker its group's leader


def signal_tree(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    """Signal the worker's process group and every descendant, wherever its session."""
    signal_group(process, sig)
    for pid in _descendants(process.pid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])  # the name field may hold spaces and ')'
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, stack = [], [root]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def log_tail(worker: WorkerRecord) -> str:
    if worker.log_path is None or not worker.log_path.exists():
        return ""
    with open(worker.log_path, "rb") as f:
        f.seek(max(0, worker.log_path.stat().st_size - _LOG_TAIL_BYTES))
        return f.read().decode("utf-8", errors="replace")


_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_libc = ctypes.CDLL(None, use_errno=True) if os.uname().sysname == "Linux" else None


def die_with_parent(sig: signal.Signals) -> None:
    """Runs in the child before exec: a worker must not outlive a localpod killed with SIGKILL."""
    if _libc is not None:
        _libc.prctl(_PR_SET_PDEATHSIG, sig)
