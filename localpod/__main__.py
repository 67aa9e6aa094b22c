"""Run localpod, a RunPod-compatible server for this machine.

    python -m localpod --host 127.0.0.1 --port 8765
    python -m localpod --port 8765 --api-key secret --worker-quota 10 \
        --worker-python .venv-worker/bin/python --log-dir /tmp/localpod-logs
    python -m localpod --port 8765 --worker-runtime docker \
        --worker-mount /srv/loraflow-store --worker-mount /srv/models
    python -m localpod --port 8765 --hold-jobs 8     # benchmarks: jobs hold a worker 8 s, no training

Point a RunPod client at `http://HOST:PORT/v2` for both the control plane and the job API, with
`Authorization: Bearer <api key>`. `GET /_localpod/account` reports endpoints, jobs, workers and
billed worker-seconds. Prints `localpod listening on http://HOST:PORT` once it accepts connections.

GPU hosts: each GPU type's hosts run some CUDA versions per datacenter (the default table is in
`localpod/catalog/tables.py`; `POST /_localpod/cuda` changes it, `DELETE /_localpod/cuda` restores it). A worker
starts only on hosts that meet its endpoint's `gpu.minCudaVersion` / `gpu.allowedCudaVersions`; where none
does, its jobs stay IN_QUEUE and `/health` counts the worker as throttled, as on RunPod.

A real account's catalog: `--catalog-from DIR` serves what `python -m flows.preflight RUN_FILE --record DIR` recorded
from RunPod (GPU types, pools, prices, hosts' CUDA versions, stock, datacenters, CPU flavors when read) in place of
the built-in table; `localpod/catalog/recorded.py` says how each table is derived from the answers.

    python -m localpod --port 8765 --catalog-from recordings/my-account

Answers RunPod shapes more than one way: the quota refusal is a 400 `ErrorResponse`, or with
`--quota-refusal-status 500` (env `LOCALPOD_QUOTA_REFUSAL_STATUS`) REST v1's 500 `{"error": ...}`, worded
`... must not exceed your workers quota (N)` or as `--quota-refusal-text` (env `LOCALPOD_QUOTA_REFUSAL_TEXT`) says,
`{quota}` replaced by the quota; the endpoint, network volume and secret lists come in pages of `--page-size` items
(env `LOCALPOD_PAGE_SIZE`, default 1000 as RunPod) with `pagination.nextCursor`. `POST /_localpod/answer-shapes`
changes each while the server runs.

`LORAFLOW_REQUIRE_CUDA` is lifted: the control plane sets it to 1 in every endpoint's env so a worker on
a RunPod host refuses to train on a CPU, but localpod's workers (processes and containers alike) run on
this machine's CPU, so each is started with `LORAFLOW_REQUIRE_CUDA=0` instead, and the log says so for
every worker it lifts it for.

A worker that dies without a result (a crash, a kill it did not ask for) hands its job back to the queue, first in
line, for another worker of the endpoint, as RunPod's queue endpoints do (`/health` counts it as retried); with
`--dead-worker-jobs fail` (env `LOCALPOD_DEAD_WORKER_JOBS=fail`) the job FAILS instead, its error naming the exit
code and the last lines of the worker's log.

Network volumes (`/v2/network-volumes`) are folders under `--volume-dir` (default: `volumes/` in the log
dir). A worker of an endpoint that attaches one runs in the volume's datacenter and sees the folder: a
docker worker at `/runpod-volume`, as on RunPod; a process worker through `LORAFLOW_VOLUME_PATH`. A volume
created without `type` gets its datacenter's primary tier; `POST /_localpod/volume-types` changes the tiers a
datacenter offers (`DELETE` restores them). Volumes bill by size and time from creation to deletion, as on
RunPod ($0.07/GB-month standard, $0.05 above 1 TB; high-performance $0.14; a month of 30 days), reported by
`GET /v2/billing/network-volumes` (deleted volumes included); `POST /_localpod/clock {"advance_days": N}` lets
storage time pass so their cost accrues without waiting.

CPU serverless: the catalog lists CPU flavors (`/v2/catalog/cpus`, `cpuAvailability` of the datacenters), an
endpoint created with `cpu: [{id, vcpuCount}]` runs its workers in a datacenter offering one of its flavors
(no CUDA need) and bills their vCPUs as `cpuAmount` in `/v2/billing/serverless`; `POST /_localpod/cpu-stock`
takes flavors out of stock, as `/_localpod/stock` does GPU pools. A serverless CPU worker has at most 8 vCPUs (the
catalog says so when asked with product=SERVERLESS) and 10 GB of container disk per vCPU (15 on cpu5c): a create
asking more is refused.

Workers run one of two ways (`--worker-runtime`):

- `process` (the default): each worker is a local process of the worker environment's interpreter,
  `--worker-python` (env `LOCALPOD_WORKER_PYTHON`; default: this checkout's `.venv-worker/bin/python`,
  which `make install` builds from the worker image's lock), running `python -m loraflow_worker.handler`.
  localpod refuses to start when that interpreter is missing. `--worker-command` replaces the whole
  command (e.g. a test's own handler script). Workers get this machine's environment, plus the
  endpoint's `env` and RunPod's worker variables. `--hold-jobs SECONDS` (env `LOCALPOD_HOLD_JOBS`) runs
  `localpod/hold_worker.py` instead, with the same interpreter: a real `runpod.serverless` worker whose
  jobs hold it for that long, report progress and store a result labelled as a hold job, training
  nothing (the benchmarks measure the control plane with it). An endpoint of RunPod's vLLM worker image
  (`runpod/worker-v1-vllm:<tag>`) runs that image's local stand-in whatever the command is
  (`localpod/vllm_worker/`, with the same interpreter: an OpenAI-compatible server of the base model and its
  LoRA adapters on the CPU), and `/v2/<id>/openai/v1/...` answers through it.
- `docker`: each worker is a container of the endpoint's `image`, as the control plane sent it (it must
  exist locally: nothing is pulled; a missing image fails the endpoint's queued jobs with Docker's
  reason). The container runs the image's command, or the endpoint's `args` when set. As on RunPod it
  gets only the endpoint's `env` and RunPod's worker variables (`RUNPOD_*`), nothing of this machine's
  environment; it runs on the host network, so it calls localpod back on `--host`/`--port`; it is named
  `localpod-<worker id>`; its scratch disk (a folder under `--log-dir`) is its TMPDIR. Folders a job
  reads or writes on this machine, a `file://` artifact store and a local model, must be given with
  `--worker-mount PATH` (repeatable; mounted at the same path). A stop sends SIGTERM to the container
  (through the `docker run` client), then `docker rm -f` after `--kill-grace`; worker faults map onto
  Docker (crash and preempt: `docker kill`; hang: `docker pause`). A container that exits is removed,
  and localpod's shutdown removes every container it started. Containers run as the image's user
  (root for the worker image), so files they write into a mounted folder belong to that user.
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
from pydantic import ValidationError

from localpod.catalog import recorded, tables
from localpod.main import create_app
from localpod.models import DEFAULT_WORKER_PYTHON, LocalpodConfig
from localpod.paging import DEFAULT_PAGE_SIZE
from localpod.state.account import LocalpodState

HOLD_WORKER = Path(__file__).resolve().parent / "hold_worker.py"

# A backstop: held worker requests end at once on shutdown (see _Server), others are short.
_GRACEFUL_SHUTDOWN_S = 3
_KEEP_ALIVE_S = 75


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.catalog_from:
        serve_recorded_catalog(Path(args.catalog_from), parser)
    config = config_from_args(args, parser)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    print(f"localpod worker logs in {config.log_dir}", flush=True)
    asyncio.run(_serve(config, args.log_level))


def serve_recorded_catalog(folder: Path, parser: argparse.ArgumentParser) -> None:
    """Serve the catalog recorded in `folder` instead of the built-in one, saying what it holds; a folder that is
    not a recording exits with the parser's error."""
    try:
        loaded = recorded.load(folder)
    except recorded.RecordingError as e:
        parser.error(f"--catalog-from: {e}")
    tables.serve(loaded.tables)
    print(f"localpod serves the {loaded.description}", flush=True)
    for note in loaded.notes:
        print(f"  {note}", flush=True)


def config_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> LocalpodConfig:
    """The server's config from its command line; an inconsistent one exits with the parser's error."""
    fields: dict[str, object] = {
        "host": args.host,
        "port": args.port,
        "api_key": args.api_key,
        "worker_quota": args.worker_quota,
        "quota_refusal_status": args.quota_refusal_status,
        "page_size": args.page_size,
        "kill_grace_s": args.kill_grace,
        "long_poll_s": args.long_poll,
        "worker_runtime": args.worker_runtime,
        "worker_mounts": [Path(m).absolute() for m in args.worker_mount],
        "docker_command": shlex.split(args.docker),
        "volume_create_fails_in": args.volume_create_fails_in,
        "dead_worker_jobs": args.dead_worker_jobs,
    }
    if args.quota_refusal_text is not None:
        fields["quota_refusal_text"] = args.quota_refusal_text
    if args.worker_python:
        fields["worker_python"] = Path(args.worker_python).absolute()
    if args.worker_command:
        fields["worker_command"] = shlex.split(args.worker_command)
    if args.hold_jobs is not None:
        if args.worker_command or args.worker_runtime != "process":
            parser.error("--hold-jobs runs the hold worker as a process: it replaces --worker-command and needs "
                         "--worker-runtime process")
        python = Path(args.worker_python).absolute() if args.worker_python else DEFAULT_WORKER_PYTHON
        if not os.access(python, os.X_OK):
            parser.error(f"--hold-jobs: no worker interpreter at {python} (--worker-python): run `make install`")
        fields["worker_command"] = [str(python), str(HOLD_WORKER), str(args.hold_jobs)]
    if args.log_dir:
        fields["log_dir"] = Path(args.log_dir)
    if args.openapi:
        fields["openapi_path"] = Path(args.openapi)
    if args.volume_dir:
        fields["volume_dir"] = Path(args.volume_dir).absolute()
    try:
        return LocalpodConfig.model_validate(fields)
    except ValidationError as e:
        # Name the setting; a default that could not be made because another setting failed is no error of its own.
        parser.error("; ".join(f"{'.'.join(map(str, error['loc'])) or 'config'}: "
                               f"{error['msg'].removeprefix('Value error, ')}"
                               for error in e.errors() if error["type"] != "default_factory_not_called"))


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
    p.add_argument("--quota-refusal-status", type=int, choices=[400, 500],
                   default=os.environ.get("LOCALPOD_QUOTA_REFUSAL_STATUS") or "400",
                   help="the status of the quota refusal: 400 (an ErrorResponse) or 500 (REST v1's body, as REST v1 "
                   "answered it); default: env LOCALPOD_QUOTA_REFUSAL_STATUS, else 400")
    p.add_argument("--quota-refusal-text", default=os.environ.get("LOCALPOD_QUOTA_REFUSAL_TEXT") or None,
                   metavar="TEXT", help="the quota refusal's message, `{quota}` replaced by the worker quota (RunPod "
                   "words it more than one way); default: env LOCALPOD_QUOTA_REFUSAL_TEXT, else "
                   "'... must not exceed your workers quota ({quota})'")
    # String defaults go through `type`, so a bad environment value is refused as the flag's would be.
    p.add_argument("--page-size", type=int, default=os.environ.get("LOCALPOD_PAGE_SIZE") or str(DEFAULT_PAGE_SIZE),
                   help="items per page of the endpoint, network volume and secret lists (later pages through "
                   f"pagination.nextCursor); default: env LOCALPOD_PAGE_SIZE, else {DEFAULT_PAGE_SIZE} as RunPod")
    p.add_argument("--worker-runtime", choices=["process", "docker"], default="process",
                   help="process: workers are local processes; docker: containers of the endpoint's image")
    p.add_argument("--worker-python", default=os.environ.get("LOCALPOD_WORKER_PYTHON"),
                   help="process runtime: the worker environment's interpreter (default: env LOCALPOD_WORKER_PYTHON, "
                   "else this checkout's .venv-worker/bin/python, built by `make install`)")
    p.add_argument("--worker-command", help="process runtime: the whole command starting one worker (shell-split); "
                   "default: <worker python> -m loraflow_worker.handler")
    p.add_argument("--hold-jobs", type=float, metavar="SECONDS",
                   default=float(os.environ["LOCALPOD_HOLD_JOBS"]) if os.environ.get("LOCALPOD_HOLD_JOBS") else None,
                   help="benchmarks: run localpod/hold_worker.py (with the worker interpreter) instead of the loraflow "
                   "worker; each job holds its worker SECONDS, reports progress and stores a result labelled as a "
                   "hold job, without training (default: env LOCALPOD_HOLD_JOBS, else off)")
    p.add_argument("--worker-mount", action="append", default=[], metavar="PATH",
                   help="docker runtime: a host folder mounted at the same path in every worker container "
                   "(repeatable): a file:// artifact store, a local model")
    p.add_argument("--docker", default="docker", help="docker runtime: the Docker client (shell-split)")
    p.add_argument("--log-dir", help="folder for worker logs (default: a new temp folder)")
    p.add_argument("--volume-dir", help="folder holding each network volume's folder (default: volumes/ in --log-dir)")
    p.add_argument("--volume-create-fails-in", action="append", default=[], metavar="DATACENTER",
                   help="creating a network volume in this datacenter answers 500, as RunPod did in US-MO-1 "
                   "(repeatable; a datacenter of localpod's catalog that supports volumes)")
    p.add_argument("--catalog-from", metavar="DIR", default=os.environ.get("LOCALPOD_CATALOG_FROM"),
                   help="serve the GPU types, pools, prices, hosts' CUDA versions, stock, datacenters and CPU flavors "
                   "recorded in DIR by `python -m flows.preflight RUN_FILE --record DIR` instead of the built-in "
                   "catalog (default: env LOCALPOD_CATALOG_FROM, else the built-in one)")
    p.add_argument("--openapi", help="RunPod's api-v2-openapi.json (default: the unedited copy shipped in localpod/)")
    p.add_argument("--dead-worker-jobs", choices=["requeue", "fail"],
                   default=os.environ.get("LOCALPOD_DEAD_WORKER_JOBS") or "requeue",
                   help="the job of a worker that dies without a result: requeue (back to the queue for another "
                   "worker, as RunPod's queue endpoints do) or fail (FAILED with the exit code and the log's tail); "
                   "default: env LOCALPOD_DEAD_WORKER_JOBS, else requeue")
    p.add_argument("--kill-grace", type=float, default=5.0, help="seconds from SIGTERM to SIGKILL for a worker")
    p.add_argument("--long-poll", type=float, default=5.0, help="seconds a worker's job-take is held open")
    p.add_argument("--log-level", default="warning", help="uvicorn log level (debug also logs each request)")
    return p


if __name__ == "__main__":
    main()
