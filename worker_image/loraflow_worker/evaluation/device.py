"""Where a worker's evaluations run (the GPU when torch sees one), and the GPU memory given back between the models
they load: a trainer's, an answering engine's, each benchmark model's. torch is imported when they are called, not
with this module: the benchmarks' module is read where only the harness's task names are needed."""

from __future__ import annotations

import gc


def evaluation_device() -> str:
    """"cuda" where torch sees a CUDA device, else "cpu"."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def free_gpu_memory() -> None:
    """Collect what nothing refers to any more (a model, an engine's tensors) and hand the GPU's cached blocks back."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
