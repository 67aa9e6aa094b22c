"""Fault injection for the tests: crashes, hangs and out-of-memory errors planted in a job's training
process from outside the worker package, which ships none of this (the image's build leaves `tests/` out).

Python imports `sitecustomize` at start-up from any folder on PYTHONPATH. The worker tests put this
folder there for the jobs they mean to fail (`worker_test_support.plant_fault`); the chaos suite does
the same for the workers of its faulted runs, through localpod's `env` worker fault
(`bench/chaos_scenarios.py`). The worker hands PYTHONPATH on to the training process as it does any
setting that is not a secret. In a handler process (`python -m loraflow_worker.handler`) with the kind
`oom-killer`, it points the worker's cgroup reader at a fake cgroup (`fake_cgroup_root`); in any other
process (pytest, localpod, a handler with another kind) this module only defines names.

In a training process (`python -m loraflow_worker.training.train_job JOB_FILE`):

    LORAFLOW_TEST_CRASH_AT_STEP=N  fail at the end of optimizer step N; 0: at the first import of
                                   transformers, before any training (the job file is already read)
    LORAFLOW_TEST_CRASH_KIND=KIND  how (default kill):
        kill             SIGKILL itself
        oom              raise torch.OutOfMemoryError, as CUDA does
        error            print HF_TOKEN on stdout and stderr, then raise an error that quotes it: what
                         the worker stores and returns must show it redacted
        hang             ignore SIGTERM and sleep an hour: only SIGKILL ends it
        exit-after-done  (no step) train and publish normally, then die of SIGSEGV at interpreter
                         exit, as vLLM can
        cuda-error-oom   print the end of torch's traceback for `RuntimeError: CUDA error: out of memory`
                         and exit with 1, leaving no error report: only the console says what failed
        cublas-alloc     the same for `CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate`
        vllm-kv-cache    the same for vLLM's start-up failure with no memory left for its KV cache
        oom-killer       count an OOM kill in the fake cgroup the handler reads, then SIGKILL itself: what
                         the kernel's out-of-memory killer does (the handler must have the fault module too:
                         `plant_fault` patches a handler in pytest's process itself)

    LORAFLOW_TEST_STEP_SECONDS=S   every optimizer step lasts at least S seconds (a sleep at its end): a job
                                   long enough for a fault from outside (its endpoint deleted) to land
                                   mid-training, whatever this machine's speed

Every crash first prints `LORAFLOW_TEST_CRASH_AT_STEP: crashing (KIND)`. A kind or step this module
does not know ends the training process at once with exit code 2 and a line saying what it accepts,
so a typo in a test cannot pass as a job that never failed.

How: step 0 runs the crash ahead of transformers' own code at its first import; step N wraps
`transformers.trainer.Trainer.__init__` so that every trainer (TRL's SFTTrainer and GRPOTrainer are
Trainers) gets one more callback, which crashes at the end of step N after the worker's own callbacks
ran (a checkpoint of step N is not stored: saving follows the step-end callbacks).

This module shadows any other `sitecustomize` of the interpreter; the worker environments have none.
"""

from __future__ import annotations

import atexit
import functools
import importlib.abc
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

CRASH_AT_STEP_ENV = "LORAFLOW_TEST_CRASH_AT_STEP"
CRASH_KIND_ENV = "LORAFLOW_TEST_CRASH_KIND"
STEP_SECONDS_ENV = "LORAFLOW_TEST_STEP_SECONDS"
KINDS = ("kill", "oom", "error", "hang", "exit-after-done", "cuda-error-oom", "cublas-alloc", "vllm-kv-cache",
         "oom-killer")
TRAINING_MODULE = "loraflow_worker.training.train_job"
"""The training process runs as `python -m TRAINING_MODULE JOB_FILE` (the worker's supervisor starts it)."""
HANDLER_MODULE = "loraflow_worker.handler"
"""The worker runs as `python -m HANDLER_MODULE` (the image's command; localpod's workers)."""
WORK_DIR_ENV = "LORAFLOW_WORK_DIR"
"""`loraflow_worker.handler.WORK_DIR_ENV`: the folder under which the worker keeps its jobs' files."""
# The end of what the training process prints when it dies of these: the console line is all the worker sees.
CONSOLE_FAILURES = {
    # torch: a CUDA call failing with cudaErrorMemoryAllocation (C10_CUDA_CHECK's message).
    "cuda-error-oom": (
        "Traceback (most recent call last):\n"
        '  File "torch/nn/modules/linear.py", line 134, in forward\n'
        "RuntimeError: CUDA error: out of memory\n"
        "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below "
        "might be incorrect.\n"
        "For debugging consider passing CUDA_LAUNCH_BLOCKING=1\n"
        "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n"
    ),
    # torch: cuBLAS cannot allocate its handle (at::cuda::getCurrentCUDABlasHandle).
    "cublas-alloc": (
        "Traceback (most recent call last):\n"
        '  File "torch/nn/modules/linear.py", line 134, in forward\n'
        "RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`\n"
    ),
    # vLLM 0.33: vllm/v1/worker/gpu_worker.py logs the KV cache's share, then
    # vllm/v1/core/kv_cache_planning.py `_check_enough_kv_cache_memory` raises when it is not positive.
    "vllm-kv-cache": (
        "INFO [gpu_worker.py:773] Available KV cache memory: -1.25 GiB\n"
        "Traceback (most recent call last):\n"
        '  File "vllm/v1/core/kv_cache_planning.py", line 57, in _check_enough_kv_cache_memory\n'
        "ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when "
        "initializing the engine (this flag also controls CPU memory reservation on the CPU backend, despite its "
        "name). See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details.\n"
    ),
}


def crash(kind: str) -> None:
    """Fail this process the way `kind` says (`_plant` has refused any kind not in `KINDS`)."""
    print(f"{CRASH_AT_STEP_ENV}: crashing ({kind})", flush=True)
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "exit-after-done":
        os.kill(os.getpid(), signal.SIGSEGV)
    elif kind == "oom":
        import torch

        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (planted by the fault module)")
    elif kind == "error":
        token = os.environ.get("HF_TOKEN", "")
        print(f"HF_TOKEN is {token}", flush=True)
        print(f"HF_TOKEN is {token}", file=sys.stderr, flush=True)
        raise RuntimeError(f"planted failure while holding token {token}")
    elif kind == "hang":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(3600)
    elif kind in CONSOLE_FAILURES:
        sys.stderr.write(CONSOLE_FAILURES[kind])
        sys.stderr.flush()
        os._exit(1)  # no exception in this process, so no error report: the console alone must tell
    elif kind == "oom-killer":
        _count_oom_kill(fake_cgroup_root(os.getppid()))  # the supervisor that reads it is this process's parent
        os.kill(os.getpid(), signal.SIGKILL)


def fake_cgroup_root(handler_pid: int) -> Path:
    """A cgroup v2 folder (`memory.events`, `memory.max`: 8 GiB) for the worker of process `handler_pid` to read
    in place of its own cgroup (`loraflow_worker.memory.out_of_memory.CGROUP_ROOT`), made with no OOM kill counted
    if missing. Both processes find it: it lies under the handler's work folder, which the training process
    inherits."""
    root = Path(os.environ.get(WORK_DIR_ENV) or tempfile.gettempdir()) / f"loraflow-test-cgroup-{handler_pid}"
    if not (root / "memory.events").exists():
        root.mkdir(parents=True, exist_ok=True)
        (root / "memory.max").write_text(f"{8 * 2**30}\n")
        (root / "memory.events").write_text("low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\noom_group_kill 0\n")
    return root


def _count_oom_kill(root: Path) -> None:
    events = dict(line.split() for line in (root / "memory.events").read_text().splitlines())
    for name in ("max", "oom", "oom_kill"):  # what the kernel counts when its OOM killer acts on the cgroup
        events[name] = str(int(events[name]) + 1)
    (root / "memory.events").write_text("".join(f"{name} {value}\n" for name, value in events.items()))


class _OnFirstImport(importlib.abc.MetaPathFinder):
    """Runs `before()` ahead of module `name`'s code and `after(module)` once that code ran, the first
    time the module is imported; the import itself is left to the finders behind this one."""

    def __init__(self, name: str, *, before: Callable[[], None] | None = None,
                 after: Callable[[ModuleType], None] | None = None):
        self.name, self.before, self.after = name, before, after

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        for finder in sys.meta_path:
            spec = None if finder is self else finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        # The loader is this spec's own instance: patching it touches no other import.
        exec_module = spec.loader.exec_module

        def exec_module_hooked(module: ModuleType) -> None:
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            if self.before is not None:
                self.before()
            exec_module(module)
            if self.after is not None:
                self.after(module)

        spec.loader.exec_module = exec_module_hooked
        return spec


def _add_crash_callback(step: int, kind: str) -> Callable[[ModuleType], None]:
    """What to do to `transformers.trainer` once imported: every Trainer crashes at the end of `step`."""

    def crash_at_step(state) -> None:
        if state.global_step == step:
            crash(kind)

    return _add_step_end_callback(crash_at_step)


def _slow_steps(seconds: float) -> Callable[[ModuleType], None]:
    """What to do to `transformers.trainer` once imported: every Trainer's steps last at least `seconds`."""
    return _add_step_end_callback(lambda state: time.sleep(seconds))


def _add_step_end_callback(on_step_end: Callable[[object], None]) -> Callable[[ModuleType], None]:
    """A patch of `transformers.trainer` that gives every Trainer (TRL's SFTTrainer and GRPOTrainer are Trainers)
    one more callback, calling `on_step_end(state)` after the worker's own callbacks ran."""

    def patch(trainer_module: ModuleType) -> None:
        from transformers.trainer_callback import TrainerCallback

        class StepEnd(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                on_step_end(state)

        init = trainer_module.Trainer.__init__

        @functools.wraps(init)
        def init_with_callback(self, *args, **kwargs):
            init(self, *args, **kwargs)
            self.add_callback(StepEnd())

        trainer_module.Trainer.__init__ = init_with_callback

    return patch


def _crash_if_published(job_file: Path) -> None:
    """At interpreter exit: SIGSEGV, unless the job failed (its error report lies beside the job file)."""
    from loraflow_worker.runtime.supervisor import ERROR_FILE

    if not (job_file.parent / ERROR_FILE).exists():
        crash("exit-after-done")


def _job_file() -> Path | None:
    """The job file, when this process is a training process."""
    argv = sys.orig_argv
    for at in range(len(argv) - 2):
        if argv[at] == "-m" and argv[at + 1] == TRAINING_MODULE:
            return Path(argv[at + 2])
    return None


def _handler_process() -> bool:
    argv = sys.orig_argv
    return any(argv[at] == "-m" and argv[at + 1] == HANDLER_MODULE for at in range(len(argv) - 1))


def _read_fake_cgroup(out_of_memory: ModuleType) -> None:
    out_of_memory.CGROUP_ROOT = fake_cgroup_root(os.getpid())


def _plant(job_file: Path) -> None:
    kind = os.environ.get(CRASH_KIND_ENV, "kill")
    step = os.environ.get(CRASH_AT_STEP_ENV, "")
    if kind not in KINDS or not (step.isdigit() or step == ""):
        print(f"{CRASH_KIND_ENV}={kind!r} {CRASH_AT_STEP_ENV}={step!r}: the kind must be one of {', '.join(KINDS)} "
              "and the step a whole number", file=sys.stderr, flush=True)
        os._exit(2)
    if kind == "exit-after-done":
        atexit.register(_crash_if_published, job_file)
    elif step == "0":
        sys.meta_path.insert(0, _OnFirstImport("transformers", before=functools.partial(crash, kind)))
    elif step:
        sys.meta_path.insert(0, _OnFirstImport("transformers.trainer", after=_add_crash_callback(int(step), kind)))


if STEP_SECONDS_ENV in os.environ and _job_file() is not None:
    sys.meta_path.insert(0, _OnFirstImport("transformers.trainer", after=_slow_steps(float(os.environ[STEP_SECONDS_ENV]))))
if (CRASH_AT_STEP_ENV in os.environ or CRASH_KIND_ENV in os.environ) and (_job := _job_file()) is not None:
    _plant(_job)
elif os.environ.get(CRASH_KIND_ENV) == "oom-killer" and _handler_process():
    sys.meta_path.insert(0, _OnFirstImport("loraflow_worker.memory.out_of_memory", after=_read_fake_cgroup))
