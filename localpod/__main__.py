"""Run localpod, a RunPod-compatible server for this machine.

    python -m localpod --host 127.0.0.1 --port 8765
    python -m localpod --port 8765 --api-key secret --worker-quota 10 \
        --worker-command "python -m loraflow_worker.handler" --log-dir /tmp/localpod-logs

Point a RunPod client at `http://HOST:PORT/v2` for both the control plane and the job API, with
`Authorization: Bearer <api key>`. `GET /_localpod/account` reports endpoints, jobs, workers and
billed worker-seconds. Prints `localpod listening on http://HOST:PORT` once it accepts connections.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shlex
import sys
from pathlib import Path
from types import FrameType

import uvicorn

from localpod.main import create_app
from localpod.models import LocalpodConfig
from localpod.state import LocalpodState

# A backstop: held worker requests end at once on shutdown (see _Server), others are short.
_GRACEFUL_SHUTDOWN_S = 3
_KEEP_ALIVE_S = 75


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    fields: dict[str, object] = {
        "host": args.host,
        "port": args.port,
        "api_key": args.api_key,
        "worker_quota": args.worker_quota,
        "kill_grace_s": args.kill_grace,
        "long_poll_s": args.long_poll,
    }
    if args.worker_command:
        fields["worker_command"] = shlex.split(args.worker_command)
    if args.log_dir:
        fields["log_dir"] = Path(args.log_dir)
    if args.openapi:
        fields["openapi_path"] = Path(args.openapi)
    config = LocalpodConfig.model_validate(fields)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    print(f"localpod worker logs in {config.log_dir}", flush=True)
    asyncio.run(_serve(config, args.log_level))


class _Server(uvicorn.Server):
    """uvicorn waits for open requests before the app's shutdown runs: tell held worker requests
    to return as soon as a stop signal arrives."""

    def __init__(self, config: uvicorn.Config, state: LocalpodState) -> None:
        super().__init__(config)
        self.localpod_state = state

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.localpod_state.closing = True
        super().handle_exit(sig, frame)


async def _serve(config: LocalpodConfig, log_level: str) -> None:
    app = create_app(config)
    server = _Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level=log_level,
            access_log=log_level == "debug",
            timeout_graceful_shutdown=_GRACEFUL_SHUTDOWN_S,
            # Keep idle connections open longer than aiohttp's 15 s client keep-alive: a server that
            # closes first races the runpod worker's next POST, which then fails with "Server
            # disconnected" and the job's result is lost.
            timeout_keep_alive=_KEEP_ALIVE_S,
        ),
        app.state.localpod,
    )
    serving = asyncio.create_task(server.serve())
    while not server.started and not serving.done():
        await asyncio.sleep(0.05)
    if server.started:
        print(f"localpod listening on http://{config.host}:{config.port}", flush=True)
    await serving
    if not server.started:
        sys.exit(1)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m localpod", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on")
    p.add_argument("--port", type=int, default=8765, help="TCP port to listen on")
    p.add_argument(
        "--api-key",
        default=os.environ.get("LOCALPOD_API_KEY", "localpod"),
        help="the account key (default: env LOCALPOD_API_KEY, else 'localpod')",
    )
    p.add_argument("--worker-quota", type=int, default=30, help="max sum of workers.max over live endpoints")
    p.add_argument("--worker-command", help="command starting one worker (shell-split); default: "
                   "<this python> -m loraflow_worker.handler")
    p.add_argument("--log-dir", help="folder for worker logs (default: a new temp folder)")
    p.add_argument("--openapi", help="RunPod's api-v2-openapi.json (default: the unedited copy shipped in localpod/)")
    p.add_argument("--kill-grace", type=float, default=5.0, help="seconds from SIGTERM to SIGKILL for a worker")
    p.add_argument("--long-poll", type=float, default=5.0, help="seconds a worker's job-take is held open")
    p.add_argument("--log-level", default="warning", help="uvicorn log level (debug also logs each request)")
    return p


if __name__ == "__main__":
    main()
