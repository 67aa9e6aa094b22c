"""Whether CUDA can start here and, when it cannot, why: the first thing a train job does when the worker
must train on the GPU.

The control plane sets `LORAFLOW_REQUIRE_CUDA=1` on every training endpoint: on a RunPod host, a job that
fell back to the CPU would pay for a GPU at CPU speed. With it, a train job whose CUDA cannot start fails
within seconds, before any download and before any training, with an error that starts with
`CUDA unavailable: ` and says what the torch build needs and what the host reports. Unset or `0`: CUDA is
not required, and a job without it trains on the CPU (tests, local demos; localpod's CPU workers set 0 and
log that they did). Any other value is refused. Preload jobs train nothing and never check.

The probe runs in a short process of its own, with the training process's environment:

    python -m loraflow_worker.runtime.cuda_check      # prints the probe as JSON; exit status 0 when CUDA started

so that the handler neither imports torch nor holds a CUDA context beside the training process, CUDA first
starts in the training process once the allocator's settings are in place (`training.fast_paths.gather_facts`), and a
driver that hangs while initialising costs `PROBE_TIMEOUT_S`, not the worker.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field

REQUIRE_CUDA_ENV = "LORAFLOW_REQUIRE_CUDA"
MARKER = "CUDA unavailable: "
"""What starts a train job's error when CUDA is required and cannot start."""
PROBE_TIMEOUT_S = 120.0
"""A healthy host answers in seconds (importing torch is most of it); a driver stuck initialising never does."""
# NVIDIA's CUDA Compatibility guide, "minimum required driver version" per CUDA major version (minor version
# compatibility): a build for CUDA 13.x runs on no driver older than 580, one for 12.x on none older than 525.60.13.
DRIVER_FLOOR_BY_CUDA_MAJOR = {"12": "525.60.13", "13": "580"}
VISIBLE_DEVICES_ENV = ("NVIDIA_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")
"""What the container runtime exposes (NVIDIA_*) and what CUDA then shows this process (CUDA_*)."""

log = logging.getLogger("loraflow_worker")


class CudaUnavailable(RuntimeError):
    """CUDA is required (`LORAFLOW_REQUIRE_CUDA=1`) and cannot start here; the message starts with `MARKER`."""


@dataclass
class CudaProbe:
    """What this host said when CUDA was asked to start."""

    started: bool
    """CUDA initialised and a tensor was placed on GPU 0."""
    torch_version: str | None = None
    torch_cuda: str | None = None
    """`torch.version.cuda`: the CUDA torch is built for; None for a CPU build."""
    device_count: int = 0
    """`torch.cuda.device_count()`."""
    device_name: str | None = None
    failures: list[str] = field(default_factory=list)
    """Why CUDA did not start: torch's warnings while counting devices, the error of `torch.cuda.init()`."""
    nvml_driver: str | None = None
    nvml_cuda: str | None = None
    """The newest CUDA the driver supports, as NVML says."""
    nvml_device_count: int | None = None
    nvml_error: str | None = None
    visible_devices: dict[str, str | None] = field(default_factory=dict)


def cuda_required(env: Mapping[str, str]) -> bool:
    """Whether `env` requires CUDA: `LORAFLOW_REQUIRE_CUDA` is 1; unset or 0: not; anything else: ValueError."""
    value = env.get(REQUIRE_CUDA_ENV)
    if value is None or value == "0":
        return False
    if value == "1":
        return True
    raise ValueError(f"{REQUIRE_CUDA_ENV}={value!r} is neither 1 nor 0: set 1 to train on the GPU or fail at once "
                     "(what the control plane sets on training endpoints), or 0 (or leave it unset) to let a job train "
                     "on the CPU when CUDA is unavailable")


def check_cuda(env: Mapping[str, str]) -> CudaProbe | None:
    """For a train job about to start with `env` (the training process's environment): when `env` requires CUDA,
    probe it and raise `CudaUnavailable` unless it started; otherwise log one line saying it is not required.
    Returns within `PROBE_TIMEOUT_S`; None when CUDA was not required."""
    if not cuda_required(env):
        setting = f"{REQUIRE_CUDA_ENV}=0" if REQUIRE_CUDA_ENV in env else f"{REQUIRE_CUDA_ENV} is unset"
        log.info("%s: CUDA is not required; without it this job trains on the CPU", setting)
        return None
    probe = run_probe(env)
    if not probe.started:
        raise CudaUnavailable(describe_unavailable(probe))
    log.info("CUDA available: %s", describe_available(probe))
    return probe


def run_probe(env: Mapping[str, str]) -> CudaProbe:
    """`probe()` in a process of its own with environment `env`; a probe that hangs or dies is a failed one."""
    command = [sys.executable, "-m", "loraflow_worker.runtime.cuda_check"]
    try:
        done = subprocess.run(command, env=dict(env), stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return CudaProbe(started=False, visible_devices=_visible_devices(env), failures=[
            f"the CUDA probe (`python -m loraflow_worker.runtime.cuda_check`) did not answer within "
            f"{PROBE_TIMEOUT_S:.0f} s: the driver hangs while initialising"])
    try:
        return CudaProbe(**json.loads(done.stdout.strip().splitlines()[-1]))
    except (IndexError, ValueError, TypeError):
        said = " / ".join((done.stderr or done.stdout).strip().splitlines()[-5:])
        return CudaProbe(started=False, visible_devices=_visible_devices(env), failures=[
            f"the CUDA probe (`python -m loraflow_worker.runtime.cuda_check`) exited with {done.returncode} without a "
            f"report{': ' + said if said else ''}"])


def probe() -> CudaProbe:
    """Start CUDA in this process (it keeps the context) and say how that went. Imports torch."""
    import torch

    result = CudaProbe(started=False, torch_version=torch.__version__, torch_cuda=torch.version.cuda,
                       visible_devices=_visible_devices())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # torch says why it counted no device as a warning (a driver too old, ...)
        available = torch.cuda.is_available()
        result.device_count = torch.cuda.device_count()
    failures = [f"{w.category.__name__}: {w.message}" for w in caught]
    try:
        torch.cuda.init()  # raises why CUDA cannot start: no driver, a driver too old, a CPU build, no device
        if available:
            torch.empty(1, device="cuda").add_(1)  # a context and a kernel launch, not just a device count
            torch.cuda.synchronize()
            result.device_name = torch.cuda.get_device_name(0)
            result.started = True
    except Exception as exc:  # noqa: BLE001 - any failure to start is the answer
        failures.append(f"{type(exc).__name__}: {exc}")
    if not result.started and not failures:
        failures.append("torch.cuda.is_available() is False and torch gave no reason")
    result.failures = list(dict.fromkeys(failures))
    _read_nvml(result)
    return result


def describe_unavailable(probe: CudaProbe) -> str:
    """The job's error for a probe whose CUDA did not start: the build's need, the host's report, the fix."""
    floor = driver_floor(probe.torch_cuda)
    sentences = [f"{MARKER}{REQUIRE_CUDA_ENV}=1 and CUDA cannot start on this host, so nothing is trained "
                 "(on the CPU it would pay for a GPU at CPU speed)."]
    if probe.torch_version is not None and probe.torch_cuda is None:
        sentences.append(f"torch {probe.torch_version} is a CPU build (torch.version.cuda is None): "
                         "no driver can help.")
    elif probe.torch_version is not None:
        need = f"an NVIDIA driver >= {floor}" if floor else "a driver this worker has no floor for"
        sentences.append(f"torch {probe.torch_version} is built for CUDA {probe.torch_cuda}, which needs {need}.")
    if probe.nvml_driver is not None:
        nvml = (f"NVML: driver {probe.nvml_driver} (supports CUDA up to {probe.nvml_cuda}), "
                f"{probe.nvml_device_count} device(s)")
    else:
        nvml = f"NVML: unavailable ({probe.nvml_error})"
    visible = ", ".join(f"{name}={value}" if value is not None else f"{name} unset"
                        for name, value in probe.visible_devices.items())
    sentences.append(f"The host reports: torch.cuda.device_count() = {probe.device_count}; "
                     f"why: {'; '.join(probe.failures)}; {nvml}; {visible}.")
    if probe.torch_version is not None and probe.torch_cuda is None:
        fix = "use the image's torch (a CUDA build)"
    elif floor is not None:
        fix = (f"run on a host whose NVIDIA driver is >= {floor} (on RunPod: an endpoint whose minimum CUDA version is "
               f"{probe.torch_cuda}) with a GPU visible to the container")
    else:
        fix = "run on a host whose NVIDIA driver supports the image's CUDA, with a GPU visible to the container"
    sentences.append(f"Fix: {fix}; to train on the CPU on purpose (tests, a local demo), set {REQUIRE_CUDA_ENV}=0.")
    return " ".join(sentences)


def describe_available(probe: CudaProbe) -> str:
    """One line on a probe whose CUDA started."""
    driver = probe.nvml_driver or f"unknown ({probe.nvml_error})"
    return (f"{probe.device_count} device(s), GPU 0 {probe.device_name}; torch {probe.torch_version} built for CUDA "
            f"{probe.torch_cuda}; NVIDIA driver {driver}")


def driver_floor(cuda: str | None) -> str | None:
    """The oldest NVIDIA driver a build for CUDA `cuda` (e.g. "13.0") runs on; None when unknown."""
    return DRIVER_FLOOR_BY_CUDA_MAJOR.get(cuda.split(".")[0]) if cuda else None


def main() -> int:
    result = probe()
    print(json.dumps(dataclasses.asdict(result)), flush=True)
    return 0 if result.started else 1


def _read_nvml(result: CudaProbe) -> None:
    """The driver's own report, which needs no CUDA: its version, the CUDA it supports and its device count."""
    try:
        import pynvml  # nvidia-ml-py (the image's lock); not in the CPU environment
    except ImportError:
        result.nvml_error = "pynvml (nvidia-ml-py) is not installed"
        return
    try:
        pynvml.nvmlInit()
        try:
            result.nvml_driver = pynvml.nvmlSystemGetDriverVersion()
            cuda = pynvml.nvmlSystemGetCudaDriverVersion()  # e.g. 13000 for 13.0
            result.nvml_cuda = f"{cuda // 1000}.{cuda % 1000 // 10}"
            result.nvml_device_count = pynvml.nvmlDeviceGetCount()
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError as exc:
        # "NVML Shared Library Not Found": no libnvidia-ml.so.1 in the container (no driver mounted, or the
        # runtime was not asked for the `utility` capability).
        result.nvml_driver = None  # a driver read before a later call failed is not the whole report
        result.nvml_error = f"{type(exc).__name__}: {exc}"


def _visible_devices(env: Mapping[str, str] | None = None) -> dict[str, str | None]:
    source = os.environ if env is None else env
    return {name: source.get(name) for name in VISIBLE_DEVICES_ENV}


if __name__ == "__main__":
    sys.exit(main())
