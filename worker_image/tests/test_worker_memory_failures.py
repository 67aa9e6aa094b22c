"""Which memory a failure says ran out (`memory.out_of_memory`): the libraries' texts, exceptions by class, and the
cgroup's OOM-kill counter. The end-to-end failures through the handler are in test_worker_failures.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from loraflow_worker.memory import out_of_memory
from loraflow_worker.memory.out_of_memory import MARKERS, OomKills, exception_memory_kind, memory_kind, read_oom_kills

VLLM_NO_KV_CACHE = ("ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization` "
                    "when initializing the engine")


@pytest.mark.parametrize(("text", "kind"), [
    (VLLM_NO_KV_CACHE, "vllm_kv_cache"),
    ("ValueError: To serve at least one request with the model's max seq len (4096), (0.5 GiB KV cache is needed, "
     "which is larger than the available KV cache memory (0.2 GiB).", "vllm_kv_cache"),
    ("ValueError: Free memory on device cuda:0 (10.2/79.1 GiB) on startup is less than desired GPU memory "
     "utilization (0.3, 23.7 GiB).", "vllm_kv_cache"),
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", "gpu"),
    ("RuntimeError: CUDA error: out of memory", "gpu"),
    ("RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`", "gpu"),
    ("MemoryError", "host_ram"),
    ("numpy._core._exceptions._ArrayMemoryError: Unable to allocate 64.0 GiB for an array", "host_ram"),
    ("RuntimeError: DefaultCPUAllocator: can't allocate memory: you tried to allocate 68719476736 bytes", "host_ram"),
    ("RuntimeError: expected scalar type Float but found BFloat16", None),
])
def test_each_librarys_out_of_memory_text_names_its_memory(text, kind):
    assert memory_kind(text) == kind


def test_vllms_kv_cache_failure_wins_over_a_mention_of_cuda_memory():
    assert memory_kind(f"CUDA out of memory while profiling; retried\n{VLLM_NO_KV_CACHE}") == "vllm_kv_cache"


def test_each_kind_has_one_marker_naming_it():
    assert MARKERS == {"vllm_kv_cache": "out of memory (vLLM KV cache): ", "gpu": "out of memory (GPU): ",
                       "host_ram": "out of memory (host RAM): "}


def test_torch_out_of_memory_error_is_gpu():
    assert exception_memory_kind(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")) == "gpu"


def test_numpys_memory_error_is_host_ram_by_its_class():
    with pytest.raises(MemoryError) as failed:
        np.empty(2**60, dtype=np.uint8)
    assert type(failed.value) is not MemoryError  # numpy's own subclass (_ArrayMemoryError)
    assert exception_memory_kind(failed.value) == "host_ram"


def test_cgroup_v2_oom_kills_and_limit_are_read_from_memory_events(tmp_path, monkeypatch):
    (tmp_path / "memory.events").write_text("low 0\nhigh 0\nmax 7\noom 3\noom_kill 2\noom_group_kill 0\n")
    (tmp_path / "memory.max").write_text("4294967296\n")
    monkeypatch.setattr(out_of_memory, "CGROUP_ROOT", tmp_path)
    assert read_oom_kills() == OomKills(2, f"{tmp_path / 'memory.events'} oom_kill", 4 * 2**30)


def test_cgroup_v1_oom_kills_are_read_from_oom_control_and_no_limit_is_none(tmp_path, monkeypatch):
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 5\n")
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    monkeypatch.setattr(out_of_memory, "CGROUP_ROOT", tmp_path)
    assert read_oom_kills() == OomKills(5, f"{tmp_path / 'memory' / 'memory.oom_control'} oom_kill", None)


def test_no_readable_cgroup_counter_is_none(tmp_path, monkeypatch):
    monkeypatch.setattr(out_of_memory, "CGROUP_ROOT", tmp_path)
    assert read_oom_kills() is None
