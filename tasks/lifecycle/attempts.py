"""Whether a run gets another attempt after one ended without results, and on which GPU; and which GPU an attempt
moves to when RunPod refuses its endpoint's request (400) for one GPU class."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from loraflow_worker.contract import MemorySettings
from pydantic import BaseModel

from tasks.placement.memory_ladder import MemoryContext, next_rung
from tasks.runpod.catalog import GpuClass
from tasks.runpod.errors import BadRequestError, RunpodError
from tasks.runpod.jobs import JobOutcome

MIN_TIME_FOR_ATTEMPT_S = 5 * 60
"""An attempt with less time than this before the deadline cannot start a worker and train."""
MAX_CUDA_UNAVAILABLE = 1
"""Hosts on which CUDA did not start that a run retries past: one may be a bad host, two are a pattern."""


class GpuClassRefused(RunpodError):
    """RunPod refused (400) the endpoint request of one GPU class: nothing was created, and the run moves to the next
    class of `compute.gpu` (`next_unrefused`) within the same attempt."""

    def __init__(self, gpu: str, refusal: BadRequestError):
        super().__init__(f"RunPod refused an endpoint on {gpu}: {refusal}")
        self.gpu = gpu
        self.detail = str(refusal)


class EveryGpuRefused(RunpodError):
    """RunPod refused the endpoint request of every GPU class of the run: the run fails naming each refusal."""

    def __init__(self, refusals: Mapping[str, str]):
        named = "; ".join(f"{gpu}: {detail}" for gpu, detail in refusals.items())
        super().__init__(f"RunPod refused an endpoint on every GPU class of compute.gpu ({named}). Fix the request "
                         "RunPod names, or add a GPU class it accepts to compute.gpu")
        self.refusals = dict(refusals)


def next_unrefused(gpus: Sequence[GpuClass], gpu_index: int, refused: Collection[str]) -> int | None:
    """The index of the first class after `gpu_index` (wrapping round) that RunPod has not refused; None: none left."""
    for step in range(1, len(gpus) + 1):
        index = (gpu_index + step) % len(gpus)
        if gpus[index].name not in refused:
            return index
    return None


class NextAttempt(BaseModel):
    retry: bool
    gpu_index: int
    reason: str
    cold: bool = False
    """The next attempt leaves the weight cache aside: it runs anywhere and downloads the model."""
    memory: MemorySettings | None = None
    """The memory settings the next attempt forces (the out-of-memory ladder); None: the worker's own plan."""


def decide_next_attempt(
    outcome: JobOutcome, gpus: list[GpuClass], gpu_index: int, attempt: int, max_attempts: int, seconds_left: float,
    warm_in: str | None = None, earlier: Sequence[str] = (), memory: MemoryContext | None = None,
    refused: Collection[str] = (),
) -> NextAttempt:
    """The retry policy: code failures, cancellations and the run's deadline never retry; no capacity walks
    the GPU list; out of memory climbs the ladder of `memory_ladder` (given `memory`: the same GPU with less
    memory asked of it) and then moves to a GPU with more memory; the host's RAM running out climbs its own
    ladder and then fails the run, since another GPU does not cure it; a host whose CUDA did not start is retried
    once on a new endpoint (another host), then the run fails naming the driver; stalls, preemptions, RunPod's
    own timeouts, lost workers, vanished endpoints, failed submits and a job status unreadable past its budget
    retry on the same GPU (resuming from the run's last checkpoint); all within the attempt budget and the run's
    deadline. An attempt pinned to `warm_in` (the datacenter whose volume holds the weights) that found no
    capacity there retries the same GPU anywhere, cold. `earlier`: the outcome kinds of the run's earlier
    attempts. Settings an attempt forced stay forced on the next, unless it moves to a GPU with more memory. A class
    in `refused` (RunPod refused its endpoint request) is never moved to."""
    here = gpus[gpu_index]
    forced = memory.forced if memory is not None else None
    rung = next_rung(outcome.memory, memory, outcome.error) if memory is not None and outcome.kind in _LADDERED else None
    if outcome.kind == "host_out_of_memory" and rung is None:
        return NextAttempt(retry=False, gpu_index=gpu_index,
                           reason="the host's RAM ran out (the kernel's OOM killer), not the GPU's memory, even with "
                                  "the smallest micro-batch: a GPU with more memory does not cure it; lower "
                                  "training.batch_size or max_seq_length, or use a smaller dataset or model")
    if outcome.kind == "cuda_unavailable" and MAX_CUDA_UNAVAILABLE <= list(earlier).count("cuda_unavailable"):
        return NextAttempt(retry=False, gpu_index=gpu_index,
                           reason=f"CUDA did not start on {MAX_CUDA_UNAVAILABLE + 1} hosts of the run: their NVIDIA "
                                  "driver is older than the image's CUDA needs, or the GPUs are not exposed to the "
                                  "container (see the error); try another GPU class, or an image built for an older "
                                  "CUDA with LORAFLOW_IMAGE_MIN_CUDA set to match")
    if not outcome.retriable and rung is None:
        return NextAttempt(retry=False, gpu_index=gpu_index, reason=f"{outcome.kind}: not retried")
    if attempt >= max_attempts:
        return NextAttempt(retry=False, gpu_index=gpu_index,
                           reason=f"{outcome.kind} on attempt {attempt} of {max_attempts}: the attempt budget is spent")
    if seconds_left < MIN_TIME_FOR_ATTEMPT_S:
        return NextAttempt(retry=False, gpu_index=gpu_index,
                           reason=f"{outcome.kind}, and only {seconds_left:.0f} s are left before the run's deadline")
    if rung is not None:
        return NextAttempt(retry=True, gpu_index=gpu_index, memory=rung.memory,
                           reason=f"{outcome.kind} on {here.name}: {rung.reason}")
    if outcome.kind == "no_capacity" and warm_in is not None:
        return NextAttempt(retry=True, gpu_index=gpu_index, cold=True, memory=forced,
                           reason=f"no capacity in {warm_in}, where the weights are warm; next attempt runs anywhere, cold")
    if outcome.kind == "no_capacity":
        following = next_unrefused(gpus, gpu_index, refused)
        following = gpu_index if following is None else following
        return NextAttempt(retry=True, gpu_index=following, memory=forced,
                           reason=f"no capacity for {here.name}; trying {gpus[following].name}")
    if outcome.kind == "out_of_memory":
        bigger = [i for i, g in enumerate(gpus) if g.vram_gb > here.vram_gb and g.name not in refused]
        if not bigger:
            return NextAttempt(retry=False, gpu_index=gpu_index,
                               reason=f"out of memory on {here.name} ({here.vram_gb} GB) and no GPU with more memory "
                                      "in compute.gpu: add one, or lower training.batch_size / max_seq_length, or "
                                      "set lora.quantization = \"4bit\"")
        best = min(bigger, key=lambda i: (gpus[i].vram_gb, i))
        return NextAttempt(retry=True, gpu_index=best,
                           reason=f"out of memory on {here.name}; moving to {gpus[best].name} ({gpus[best].vram_gb} GB)")
    return NextAttempt(retry=True, gpu_index=gpu_index, memory=forced,
                       reason=f"{outcome.kind}; retrying on {here.name}")


_LADDERED = frozenset({"out_of_memory", "host_out_of_memory"})
