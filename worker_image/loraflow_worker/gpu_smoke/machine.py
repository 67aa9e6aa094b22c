"""The machine the GPU smoke runs on: its GPU as NVML sees it (what it is, what else uses it, its memory while a run
trains), the library versions installed, and the combinations of GPU, kernels and settings the smoke refuses."""

from __future__ import annotations

import importlib.metadata
import os
import threading
from collections.abc import Mapping

from packaging.version import Version

GIB = 2**30
VERSIONED = ("torch", "transformers", "trl", "peft", "accelerate", "triton", "liger-kernel", "flash-linear-attention",
             "causal-conv1d", "tilelang", "bitsandbytes", "vllm", "nvidia-ml-py")
"""The distributions whose versions the report prints beside the figures ("absent" when not installed)."""


def installed_versions() -> dict[str, str]:
    """The versions of `VERSIONED` installed here (distribution -> version); absent ones are left out."""
    versions = {}
    for name in VERSIONED:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def versions_line(packages: Mapping[str, str], gpu: Mapping | None) -> str:
    """One line with the GPU and the library versions, printed beside the figures."""
    import torch

    libraries = ", ".join(f"{name} {packages.get(name, 'absent')}" for name in VERSIONED if name != "torch")
    machine = "no GPU (CPU check)" if gpu is None else (
        f"{gpu['name']} (sm_{gpu['capability'][0]}{gpu['capability'][1]}, {gpu['total_gib']:.0f} GiB), driver {gpu['driver']}"
        if gpu["name"] else "GPU unknown to NVML")
    return f"machine: {machine}; torch {torch.__version__} (CUDA {torch.version.cuda}), {libraries}"


# fla-org/flash-linear-attention issue 640 (root cause in PR 826) and PR 983: Triton >= 3.4.0, < 3.7.1 miscompiles the
# gated chunk_bwd_dqkwg backward on Hopper (wrong db/dg); fla-core 0.5.2 and later refuse exactly that range on
# Hopper, 0.5.0-0.5.1 refuse all of Triton >= 3.4 there unless TileLang takes the kernel, 0.4.x has no guard.
FLA_HOPPER_BAD_TRITON = (Version("3.4.0"), Version("3.7.1"))
FLA_GUARDED_SINCE = Version("0.5.2")
TILELANG_ENV = "FLA_TILELANG"
"""fla's switch for its TileLang backends (`fla/backends.py`): `0` off, any other value on, unset: each backend's
default (fla-core 0.6.0: on for Hopper with Triton >= 3.4 only)."""


def kernel_problems(capability: tuple[int, int] | None, packages: Mapping[str, str], env: Mapping[str, str]) -> list[str]:
    """Combinations of GPU, kernel packages and settings that train wrongly or fail at the first backward, each
    with its source and the fix. `capability` is the GPU's (major, minor); `packages` distribution -> version."""
    fla = packages.get("flash-linear-attention")
    if fla is None or capability is None:
        return []
    sm = f"sm_{capability[0]}{capability[1]}"
    triton = Version(packages["triton"]) if "triton" in packages else None
    tilelang_takes_it = "tilelang" in packages and env.get(TILELANG_ENV) != "0"
    problems = []
    if capability[0] == 9 and triton is not None and triton >= FLA_HOPPER_BAD_TRITON[0]:
        if triton < FLA_HOPPER_BAD_TRITON[1] and not tilelang_takes_it:
            problems.append(f"flash-linear-attention {fla} with triton {triton} on {sm}: Triton >= 3.4.0, < 3.7.1 "
                            "miscompiles fla's gated backward on Hopper (fla issue 640) and fla refuses it at the first "
                            "backward: use triton >= 3.7.1, or leave flash-linear-attention out")
        elif Version(fla) < FLA_GUARDED_SINCE and not tilelang_takes_it:
            problems.append(f"flash-linear-attention {fla} on {sm} with triton {triton}: releases before 0.5.2 either "
                            "refuse Hopper's gated backward on Triton >= 3.4 or carry no guard against its miscompilation "
                            "(fla issue 640): use flash-linear-attention >= 0.5.2 with triton >= 3.7.1")
    forced = env.get(TILELANG_ENV)
    if capability[0] >= 10 and "tilelang" in packages and forced not in (None, "0"):
        # fla PR 948: on B200 the TileLang chunk_bwd_dqkwg's dq/dk/dg errors were 0.07-0.15 against a bf16 floor of
        # ~6e-4; fla-core 0.6.0 enables it on Hopper only, so only an explicit FLA_TILELANG sends Blackwell there.
        problems.append(f"{TILELANG_ENV}={forced} on {sm} sends fla's gated backward to TileLang, whose gradients are "
                        f"wrong on Blackwell (fla PR 948): unset {TILELANG_ENV} or set it to 0")
    return problems


BUSY_USED_BYTES = 2 * GIB
"""Device memory in use, with no process listed, above which the GPU is reported as possibly shared. An idle GPU
shows a few hundred MiB (the driver's own); NVML does not list the processes of other containers' PID namespaces."""


def read_gpu() -> dict:
    """GPU 0 as NVML sees it, without creating a CUDA context in this process: name, compute capability, total and
    used memory, driver, and the compute processes on it (pid, GiB used or None)."""
    try:
        import pynvml  # nvidia-ml-py (in the image's lock, and on the lent machines)
    except ImportError:
        return {"name": None, "capability": None, "processes": [], "warning": "pynvml (nvidia-ml-py) is not installed: "
                "cannot check that the GPU is idle, nor the kernel combinations; the device's memory peak is not measured"}
    pynvml.nvmlInit()
    try:
        handle = _nvml_handle(pynvml)
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        processes = [(p.pid, None if p.usedGpuMemory is None else round(p.usedGpuMemory / GIB, 2))
                     for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)]
        gpu = {"name": pynvml.nvmlDeviceGetName(handle), "capability": list(pynvml.nvmlDeviceGetCudaComputeCapability(handle)),
               "total_gib": round(memory.total / GIB, 1), "used_gib": round(memory.used / GIB, 2),
               "driver": pynvml.nvmlSystemGetDriverVersion(), "processes": processes, "warning": None}
    finally:
        pynvml.nvmlShutdown()
    if not processes and memory.used > BUSY_USED_BYTES:
        gpu["warning"] = (f"{gpu['used_gib']} GiB of the GPU is in use but NVML lists no process (another container's "
                          "are not listed here): the device peaks below may include someone else's memory")
    return gpu


def gpu_refusal(gpu: Mapping, packages: Mapping[str, str], env: Mapping[str, str], *, allow_busy: bool) -> str | None:
    """Why the smoke must not run on `gpu` (from `read_gpu`) with these packages and settings, or None."""
    others = [(pid, used) for pid, used in gpu["processes"] if pid != os.getpid()]
    if others and not allow_busy:
        listed = ", ".join(f"pid {pid} ({'?' if used is None else used} GiB)" for pid, used in others)
        return (f"the GPU is in use by another process ({listed}, as NVML's nvmlDeviceGetComputeRunningProcesses "
                "lists them): its memory and compute would skew every figure; stop it, or pass --allow-busy-gpu")
    capability = tuple(gpu["capability"]) if gpu["capability"] else None
    problems = kernel_problems(capability, packages, env)
    return "; ".join(problems) if problems else None


class DeviceMemory:
    """The device's used memory as NVML reports it, sampled in a thread while a run trains: its peak less what was
    in use before (the run's whole footprint, the CUDA context and the libraries' own pools included)."""

    INTERVAL_S = 0.05

    def __init__(self, pynvml, handle) -> None:
        self._pynvml, self._handle = pynvml, handle
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self.baseline = self.peak = 0

    @classmethod
    def open(cls) -> DeviceMemory | None:
        """A sampler on the GPU this process uses, or None without pynvml (the report then shows `-`)."""
        try:
            import pynvml
        except ImportError:
            return None
        pynvml.nvmlInit()
        return cls(pynvml, _nvml_handle(pynvml))

    def _used(self) -> int:
        return self._pynvml.nvmlDeviceGetMemoryInfo(self._handle).used

    def start(self) -> None:
        self.baseline = self.peak = self._used()
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(self.INTERVAL_S):
            self.peak = max(self.peak, self._used())

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._used())
        self._pynvml.nvmlShutdown()
        return {"peak_gib": round((self.peak - self.baseline) / GIB, 2), "baseline_gib": round(self.baseline / GIB, 2)}


def _nvml_handle(pynvml):
    """NVML's handle of the GPU CUDA calls device 0: the first of CUDA_VISIBLE_DEVICES when that names one (an index
    in NVML's order, which is CUDA's on a one-GPU machine, or a UUID), else NVML's first."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    if first.startswith(("GPU-", "MIG-")):
        return pynvml.nvmlDeviceGetHandleByUUID(first)
    return pynvml.nvmlDeviceGetHandleByIndex(int(first) if first.isdigit() else 0)
