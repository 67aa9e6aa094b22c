"""The local stand-in for RunPod's official vLLM worker image (`runpod/worker-v1-vllm:<tag>`, v2.24+): what localpod's
process runtime starts for an endpoint of that image, in place of the image.

The real worker (docs/serving.md §1–§7, [W] = runpod-workers/worker-vllm @7a92503) is three files: `main.py`
builds `vllm serve` arguments from the environment (`args_builder.py`), starts `vllm serve` on the loopback, waits for
its `/health` and only then starts the `runpod.serverless` loop, whose `handler.py` proxies each job to vLLM's
OpenAI-compatible server over HTTP. The stand-in keeps that shape, file for file, and replaces only `vllm serve`:
`serve.py` is a small OpenAI-compatible server that parses the `vllm serve` flags the stand-in models and serves the
base model and its LoRA adapters with transformers + PEFT on the CPU (`engine.py`).

The files beside this one run with the worker environment's interpreter as scripts, as the real worker's `src/` does
(`python main.py`, siblings imported by their bare names): they import nothing of localpod, and nothing of the control
plane. This module is what localpod itself reads (with the control plane's interpreter): which image the stand-in
serves and the command that starts it.
"""

from __future__ import annotations

import re
from pathlib import Path

MAIN = Path(__file__).resolve().parent / "main.py"
"""The stand-in worker's entry point (the real image's ENTRYPOINT is `python3 /src/main.py` [W Dockerfile])."""

_IMAGE = re.compile(r"^(?:(?:docker\.io|registry-1\.docker\.io)/)?runpod/worker-v1-vllm(?::[\w.-]+|@sha256:[0-9a-f]{64})?$")
"""`runpod/worker-v1-vllm:<git tag>` (release tags `vX.Y.Z*`, PR builds `dev-<branch>`; there is no `latest`)
[W .github/workflows/release.yml, dev.yml], pinned by digest or untagged, with or without Docker Hub's registry name.
The stand-in copies v2.24 and later; older tags embedded the engine and answer the shorthand input in other shapes."""


def is_vllm_worker_image(image: str | None) -> bool:
    """Whether an endpoint's `image` is RunPod's official vLLM worker."""
    return bool(image) and _IMAGE.match(image.strip()) is not None


def worker_command(python: Path) -> list[str]:
    """The command that starts one stand-in worker with the worker environment's interpreter `python`."""
    return [str(python), str(MAIN)]
