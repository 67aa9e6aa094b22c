"""Out-of-memory failures, by kind: which memory ran out, recognised from a failure's text or from the
container's cgroup, and the marker that starts the job's error for each.

The control plane searches a failed job's error for these markers (anywhere in it: RunPod's runtime adds
its own prefixes) and reacts by kind: a bigger GPU for `gpu`, vLLM's share for `vllm_kv_cache`, a host with
more RAM for `host_ram`. The supervisor puts exactly one of them at the start of the message
(`runtime.supervisor.ChildExit.failure_message`); everything that decides which is in this module.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

MemoryKind = Literal["vllm_kv_cache", "gpu", "host_ram"]

MARKERS: dict[MemoryKind, str] = {
    "vllm_kv_cache": "out of memory (vLLM KV cache): ",
    "gpu": "out of memory (GPU): ",
    "host_ram": "out of memory (host RAM): ",
}
"""What starts the job's error when the training ran out of that memory."""

# First match wins, so vLLM's KV-cache failures come before the GPU's: vLLM's start-up can also mention CUDA memory.
_TEXTS: tuple[tuple[MemoryKind, re.Pattern[str]], ...] = (
    # vLLM 0.33 `vllm/v1/core/kv_cache_planning.py` (`_check_enough_kv_cache_memory`, the auto-fit of
    # max_model_len): the memory left after the weights and the profiling run holds no KV cache, or too little
    # for one sequence of max_model_len.
    ("vllm_kv_cache", re.compile(r"No available memory for the cache blocks|"
                                 r"KV cache is needed, which is larger than the available KV cache memory|"
                                 r"Cannot auto-fit max_model_len: not enough GPU memory")),
    # vLLM 0.33 `vllm/v1/worker/utils.py` (`request_memory`): the GPU's free memory at start-up is below the share
    # vLLM was given (`gpu_memory_utilization`), colocated training having taken more than planned.
    ("vllm_kv_cache", re.compile(r"on startup is less than desired GPU memory utilization")),
    # PyTorch's caching allocator raises torch.OutOfMemoryError ("CUDA out of memory. Tried to allocate ...").
    ("gpu", re.compile(r"\bOutOfMemoryError\b|CUDA out of memory")),
    # A CUDA runtime call that fails with cudaErrorMemoryAllocation (C10_CUDA_CHECK: "CUDA error: out of memory").
    ("gpu", re.compile(r"CUDA error: out of memory")),
    # cuBLAS without memory for its handle or workspace ("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling
    # `cublasCreate(handle)`").
    ("gpu", re.compile(r"CUBLAS_STATUS_ALLOC_FAILED")),
    # Python's MemoryError (numpy's is `_ArrayMemoryError: Unable to allocate ...`), and PyTorch's CPU allocator
    # ("DefaultCPUAllocator: can't allocate memory").
    ("host_ram", re.compile(r"(?<![A-Za-z])_?(?:Array)?MemoryError\b|DefaultCPUAllocator: can't allocate memory")),
)

CGROUP_ROOT = Path("/sys/fs/cgroup")
"""Where the kernel's cgroup file system is mounted; in a container, the container's own cgroup is there."""
# A cgroup v1 memory limit this high means "no limit" (PAGE_COUNTER_MAX pages; 9223372036854771712 on x86_64).
_V1_NO_LIMIT = 2**62


def memory_kind(text: str) -> MemoryKind | None:
    """Which memory a failure's text (an exception as `Type: message`, a console) says ran out; None when it
    names none."""
    for kind, pattern in _TEXTS:
        if pattern.search(text):
            return kind
    return None


def exception_memory_kind(exc: BaseException) -> MemoryKind | None:
    """`memory_kind` of an exception, by class as well as by text: any MemoryError (numpy's subclass too) is
    host RAM."""
    if isinstance(exc, MemoryError):
        return "host_ram"
    return memory_kind(f"{type(exc).__name__}: {exc}")


@dataclass(frozen=True)
class OomKills:
    """The OOM kills a cgroup counted: the kernel's out-of-memory killer ending a process of this cgroup (or
    of one below it) when the cgroup's memory ran out."""

    count: int
    counter: str
    """The file and field read, e.g. `/sys/fs/cgroup/memory.events oom_kill`."""
    limit_bytes: int | None
    """The cgroup's memory limit; None when it has none or it could not be read."""


def read_oom_kills() -> OomKills | None:
    """This process's cgroup's OOM-kill counter: cgroup v2 `memory.events` (`oom_kill`), else cgroup v1
    `memory/memory.oom_control` (`oom_kill`, kernel 4.13+). None when neither can be read. Returns quickly."""
    own = _own_cgroups()
    # cgroup v2: one hierarchy; memory.events counts the kills in this cgroup and every cgroup below it.
    for folder in _folders(CGROUP_ROOT, own.get("")):
        count = _field(folder / "memory.events", "oom_kill")
        if count is not None:
            limit = _read(folder / "memory.max")
            return OomKills(count, f"{folder / 'memory.events'} oom_kill",
                            int(limit) if limit and limit.isdigit() else None)
    # cgroup v1: the memory controller's own hierarchy.
    for folder in _folders(CGROUP_ROOT / "memory", own.get("memory")):
        count = _field(folder / "memory.oom_control", "oom_kill")
        if count is not None:
            limit = _read(folder / "memory.limit_in_bytes")
            limit_bytes = int(limit) if limit and limit.isdigit() else None
            return OomKills(count, f"{folder / 'memory.oom_control'} oom_kill",
                            limit_bytes if limit_bytes is not None and limit_bytes < _V1_NO_LIMIT else None)
    return None


def _own_cgroups() -> dict[str, str]:
    """Controller -> this process's cgroup path, from /proc/self/cgroup (`ID:CONTROLLERS:PATH`; the v2 line is
    `0::PATH`, keyed ""). In a container with its own cgroup namespace every path is `/`."""
    own: dict[str, str] = {}
    for line in (_read(Path("/proc/self/cgroup")) or "").splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            own[controller.removeprefix("name=")] = path
    return own


def _folders(mount: Path, own_path: str | None) -> list[Path]:
    """This process's cgroup folder under `mount`, then `mount` itself (a container that sees only its own
    cgroup, mounted at the root, without a cgroup namespace)."""
    folders = [mount / own_path.lstrip("/")] if own_path else []
    return folders + [mount] if mount not in folders else folders


def _field(path: Path, name: str) -> int | None:
    """The value of `name` in a flat-keyed cgroup file (`key value` lines)."""
    for line in (_read(path) or "").splitlines():
        key, _, value = line.partition(" ")
        if key == name and value.strip().isdigit():
            return int(value)
    return None


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None
