"""The stand-in worker's entry point, as RunPod's vLLM worker's `main.py` [W src/main.py; serving.md §2, §4]: build the
`vllm serve` arguments from the environment, start the server (here `serve.py`, not vLLM) on the loopback, wait for its
`/health`, and only then start the `runpod.serverless` loop, so no job is taken before the model and every adapter
are loaded: jobs wait IN_QUEUE meanwhile.

    .venv-worker/bin/python localpod/vllm_worker/main.py      # RUNPOD_* and the endpoint's env set by localpod

A server that dies during startup (a bad flag, an adapter over `MAX_LORA_RANK`, an unreadable adapter path, a JSON
array in `LORA_MODULES`, ...) ends the worker with exit code 1, every time it is started: localpod then shows the
endpoint's workers ending one after the other with code 1 while its jobs stay IN_QUEUE, as a crash-looping worker
on RunPod.

Departures: the real server listens on 127.0.0.1:`VLLM_PORT` (8000); localpod's process workers share this
machine's network, so each stand-in serves on a free loopback port. The image's environment defaults are applied
when unset: `HF_HOME`/`HUGGINGFACE_HUB_CACHE` under `/runpod-volume/huggingface-cache/hub` [W Dockerfile], where
`/runpod-volume` is the endpoint's network volume folder when localpod gives one (`LORAFLOW_VOLUME_PATH`), else
`runpod-volume/` in the worker's own disk (its working folder). The real worker takes up to `MAX_CONCURRENCY` (30)
jobs at once and vLLM batches them; localpod runs one job per worker, so the stand-in takes one at a time.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import FrameType

from args_builder import build_args, redacted

log = logging.getLogger("vllm_standin.main")

SERVE = Path(__file__).resolve().parent / "serve.py"
STARTUP_TIMEOUT_S = float(os.environ.get("VLLM_STARTUP_TIMEOUT", "1200"))  # the real default [W src/main.py]
HEALTH_POLL_S = 0.25  # the real worker polls every 2 s; a local start is seconds long

server: subprocess.Popen[bytes] | None = None


def apply_image_env() -> None:
    """The image's `ENV` defaults, where the environment does not set them [W Dockerfile]."""
    volume = os.environ.get("LORAFLOW_VOLUME_PATH") or str(Path.cwd() / "runpod-volume")
    cache = f"{volume}/huggingface-cache"
    for name, value in {"HF_HOME": f"{cache}/hub", "HUGGINGFACE_HUB_CACHE": f"{cache}/hub",
                        "HF_DATASETS_CACHE": f"{cache}/datasets", "TOKENIZERS_PARALLELISM": "false"}.items():
        os.environ.setdefault(name, value)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int) -> subprocess.Popen[bytes]:
    argv = [sys.executable, str(SERVE), "--host", "127.0.0.1", "--port", str(port), *build_args()]
    # The real worker logs its whole command, HF_TOKEN included when set (serving.md §2); this one never shows it.
    log.info("Starting vLLM (localpod stand-in): %s", " ".join(redacted(argv)))
    return subprocess.Popen(argv)  # its output is the worker's: it lands in the worker's log


def wait_for_health(process: subprocess.Popen[bytes], port: int) -> None:
    """Until `/health` answers 200; raises when the server exits first or the startup timeout passes."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"vLLM serve exited during startup with code {process.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as response:
                if response.status == 200:
                    log.info("vLLM is healthy")
                    return
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        time.sleep(HEALTH_POLL_S)
    raise RuntimeError(f"vLLM did not become healthy within {STARTUP_TIMEOUT_S:.0f}s")


def forward_signal(signum: int, _frame: FrameType | None) -> None:
    if server is not None and server.poll() is None:
        server.send_signal(signum)
    sys.exit(128 + signum)


def main() -> None:
    global server
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    apply_image_env()
    if not (os.environ.get("MODEL_NAME") or os.environ.get("MODEL")):
        log.warning("MODEL_NAME is not set; `vllm serve` will fail without a --model argument")
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward_signal)
    port = free_port()
    try:
        server = start_server(port)
        wait_for_health(server, port)
    except (RuntimeError, ValueError) as e:  # ValueError: an environment value the arguments refuse
        log.error("%s", e)
        if server is not None and server.poll() is None:
            server.terminate()
        sys.exit(1)

    import handler
    import runpod

    handler.base_url, handler.server_process = f"http://127.0.0.1:{port}", server
    # No concurrency_modifier: one job at a time (see above); the real worker returns MAX_CONCURRENCY.
    runpod.serverless.start({"handler": handler.handler, "return_aggregate_stream": True})


if __name__ == "__main__":
    main()
