"""localpod's typed boundaries: its server config, the job API and worker protocol payloads, and the
account report.

The control-plane bodies (endpoints) are not here: they are checked against RunPod's own OpenAPI
document (see `schema.py`). Wire names are camelCase, as RunPod sends them.
"""

from __future__ import annotations

import os
import tempfile
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel

from localpod.catalog import tables
from localpod.catalog.placement import WorkerPlacement
from localpod.faults.rules import DeadWorkerJobs
from localpod.paging import DEFAULT_PAGE_SIZE

DEFAULT_OPENAPI_PATH = Path(__file__).resolve().parent / "runpod-api-v2-openapi.json"
"""RunPod's official API v2 schema: an unedited copy of `runpod-api/api-v2-openapi.json` from the
project's shared folder, shipped so a fresh clone runs localpod (a test checks the copy is identical)."""

DEFAULT_QUOTA_REFUSAL_TEXT = "Max workers across all endpoints must not exceed your workers quota ({quota})"
"""RunPod's quota refusal as seen in the wild (`../shared/runpod-api/README.md`); `{quota}` becomes the quota. RunPod
has also answered "Max workers across all endpoints will exceed your worker quota of 10 ... at most 9" (issue 37)."""

DEFAULT_WORKER_PYTHON = Path(__file__).resolve().parent.parent / ".venv-worker" / "bin" / "python"
"""The worker environment's interpreter in this checkout (`make install` builds `.venv-worker` from the
worker image's lock): the control plane's own environment has no training stack."""

WORKER_MODULE = "loraflow_worker.handler"
"""What the default process worker runs (`python -m ...`): the worker image's own command."""

WorkerRuntime = Literal["process", "docker"]

JobStatusName = Literal["IN_QUEUE", "IN_PROGRESS", "COMPLETED", "FAILED", "CANCELLED", "TIMED_OUT"]


class LocalpodConfig(BaseModel):
    """How one localpod server runs: where it listens, its account, and how it runs workers."""

    model_config = ConfigDict(extra="forbid")

    host: str = Field(default="127.0.0.1", description="Interface to listen on.")
    port: int = Field(default=8765, ge=1, le=65535, description="TCP port to listen on; workers call back on it.")
    api_key: str = Field(
        default="localpod", min_length=1, description="The account's API key (`Authorization: Bearer <key>`)."
    )
    worker_quota: int = Field(
        default=30, ge=0, description="Account worker quota: the most `workers.max` summed over all live endpoints."
    )
    quota_refusal_status: Literal[400, 500] = Field(
        default=400,
        description="The status of the quota refusal (`quota_refusal_text`): 400, an "
        "`ErrorResponse`, as an API v2 client recorded; 500 with REST v1's body `{\"error\": \"create endpoint: "
        "...\"}`, as REST v1 answered it. RunPod documents neither.",
    )
    quota_refusal_text: str = Field(
        default=DEFAULT_QUOTA_REFUSAL_TEXT, min_length=1,
        description="The quota refusal's message, `{quota}` replaced by `worker_quota`: RunPod words it more than one "
        "way (`... must not exceed your workers quota (30)`, `... will exceed your worker quota of 10 ...`).",
    )
    page_size: int = Field(
        default=DEFAULT_PAGE_SIZE, ge=1,
        description="Items per page of the endpoint, network volume and secret lists (RunPod: 1000); a request's "
        "`limit` may ask for fewer. Later pages are read with `cursor` = the previous page's "
        "`pagination.nextCursor`.",
    )
    worker_runtime: WorkerRuntime = Field(
        default="process",
        description="process: each worker is a local process running `worker_command`, or, for an endpoint of "
        "RunPod's vLLM worker image (`runpod/worker-v1-vllm:<tag>`), the image's local stand-in "
        "(`localpod/vllm_worker/`) with `worker_python`. docker: each worker is a "
        "container of the endpoint's `image` (its `args`, when set, replace the image's command), given only the "
        "endpoint's env and RunPod's worker variables, on the host network.",
    )
    worker_python: Path = Field(
        default=DEFAULT_WORKER_PYTHON,
        description="process runtime: the worker environment's interpreter; the default `worker_command` is "
        f"`<worker_python> -m {WORKER_MODULE}`, and the vLLM worker image's stand-in runs with it too. Must exist "
        "unless `worker_command` is given (then a vLLM endpoint's jobs fail, naming the missing interpreter).",
    )
    worker_command: list[str] | None = Field(
        default=None,
        min_length=1,
        description="process runtime: the full command that starts one worker process (it must run "
        "`runpod.serverless.start`). Default: built from `worker_python`.",
    )
    docker_command: list[str] = Field(
        default=["docker"], min_length=1, description="docker runtime: the Docker client that runs worker containers."
    )
    worker_mounts: list[Path] = Field(
        default=[],
        description="docker runtime: host folders bind-mounted at the same path in every worker container (a "
        "`file://` artifact store, a local model folder). Each must exist.",
    )
    log_dir: Path = Field(
        default_factory=lambda: Path(tempfile.mkdtemp(prefix="localpod-logs-")),
        description="Folder for the per-worker log files (stdout and stderr of each worker process).",
    )
    volume_dir: Path = Field(
        default_factory=lambda data: data["log_dir"] / "volumes",
        description="Folder holding one folder per network volume (`<volume_dir>/<volume id>`), created with the "
        "volume and removed with it. Default: `volumes` in `log_dir`.",
    )
    volume_create_fails_in: list[str] = Field(
        default=[],
        description="Datacenters where creating a network volume answers 500 and creates nothing, as RunPod was "
        "seen to in US-MO-1 (counted as a status_500 fault). Each must be a datacenter of localpod's catalog that "
        "supports volumes (e.g. EU-CZ-1).",
    )
    openapi_path: Path = Field(default=DEFAULT_OPENAPI_PATH, description="RunPod's API v2 OpenAPI document.")
    long_poll_s: float = Field(
        default=5.0,
        ge=0,
        description="Seconds a worker's job-take or job-stop request is held open when there is nothing to hand out.",
    )
    ping_interval_ms: int = Field(
        # runpod 1.12 sleeps RUNPOD_PING_INTERVAL // 1000 seconds, so under 1000 it pings in a tight loop.
        default=5000, ge=1000, description="Milliseconds between a worker's heartbeat pings (RUNPOD_PING_INTERVAL)."
    )
    kill_grace_s: float = Field(
        default=5.0,
        ge=0,
        description="Seconds between SIGTERM and SIGKILL when localpod stops a worker (docker runtime: between the "
        "SIGTERM and `docker rm -f`).",
    )
    respawn_delay_s: float = Field(
        default=2.0,
        ge=0,
        description="Seconds an endpoint waits before starting another worker after one crashed or could not start.",
    )
    # requeue: RunPod's queue endpoints hand a job whose worker was lost to another worker (/health's `retried`).
    dead_worker_jobs: DeadWorkerJobs = Field(
        default="requeue",
        description="What happens to the job of a worker that dies without a result (a crash, a kill it did not "
        "ask for): requeue, back to the queue, first in line, for another worker of its endpoint (the job keeps its "
        "id and counts as retried); fail, FAILED with the worker's exit code and the last lines of its log.",
    )
    tick_s: float = Field(default=0.1, gt=0, description="Seconds between two passes of the worker supervisor.")
    default_ttl_ms: int = Field(
        default=24 * 3600 * 1000, ge=1, description="A job's TTL when `/run` sets none (RunPod: 24 h from submission)."
    )

    @field_validator("volume_create_fails_in")
    @classmethod
    def _volume_data_centers(cls, names: list[str]) -> list[str]:
        capable = [dc.id for dc in tables.DATA_CENTERS if dc.network_volume_types]
        unknown = [name for name in names if name not in capable]
        if unknown:
            raise ValueError(f"no datacenter with network volumes in localpod's catalog: {unknown}; "
                             f"these have them: {', '.join(capable)}")
        return names

    @model_validator(mode="after")
    def _runtime_settings(self) -> LocalpodConfig:
        if self.worker_runtime == "docker":
            if self.worker_command is not None:
                raise ValueError(
                    "worker_command (--worker-command) applies to the process runtime; a docker worker runs its "
                    "image's command, or the endpoint's `args` when set"
                )
            missing = [str(m) for m in self.worker_mounts if not m.is_absolute() or not m.exists()]
            if missing:
                raise ValueError(f"worker mounts must be existing absolute paths (--worker-mount): {missing}")
            return self
        if self.worker_mounts:
            raise ValueError("worker_mounts (--worker-mount) apply to the docker runtime: process workers see this "
                             "machine's files already")
        if self.worker_command is None:
            if not os.access(self.worker_python, os.X_OK):
                raise ValueError(
                    f"no worker interpreter at {self.worker_python} (--worker-python, env LOCALPOD_WORKER_PYTHON): "
                    "run `make install`, which builds .venv-worker from the worker image's lock, or name an "
                    "interpreter that has the worker's stack, or give the full --worker-command"
                )
            self.worker_command = [str(self.worker_python), "-m", WORKER_MODULE]
        return self

    @property
    def base_url(self) -> str:
        """The URL workers use to call this server back."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{host}:{self.port}"

    def container_name(self, worker_id: str) -> str | None:
        """The container a worker runs in (docker runtime); None for a process worker."""
        return f"localpod-{worker_id}" if self.worker_runtime == "docker" else None


class _Wire(BaseModel):
    # FastAPI answers with aliases (camelCase); direct dumps must pass by_alias=True.
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True)


class JobPolicy(_Wire):
    model_config = ConfigDict(extra="forbid")

    execution_timeout: int | None = Field(
        default=None, ge=1, description="Milliseconds the job may run once started; default: the endpoint's `timeout`."
    )
    ttl: int | None = Field(
        default=None,
        ge=1,
        description="Milliseconds from submission after which the job is deleted, even while running.",
    )


class RunRequest(_Wire):
    """Body of `POST /v2/{endpoint_id}/run`."""

    model_config = ConfigDict(extra="forbid")

    input: dict[str, Any] = Field(description="What the worker's handler receives as `job['input']`.")
    policy: JobPolicy | None = Field(default=None, description="Per-job execution timeout and TTL.")
    webhook: str | None = Field(default=None, description="URL that receives the final job status as a POST.")


class JobRef(_Wire):
    """Answer of `/run`, `/cancel` and `/retry`."""

    id: str = Field(description="The job id.")
    status: JobStatusName = Field(description="The job's status after the call.")


class JobStatus(_Wire):
    """Answer of `GET /v2/{endpoint_id}/status/{job_id}` and `POST /v2/{endpoint_id}/runsync`."""

    id: str = Field(description="The job id.")
    status: JobStatusName = Field(description="Where the job is in its life.")
    delay_time: int = Field(description="Milliseconds the job waited in the queue (so far, while queued).")
    execution_time: int = Field(description="Milliseconds the job has run (so far, while in progress).")
    worker_id: str | None = Field(default=None, description="The worker that took the job.")
    output: Any = Field(default=None, description="Handler output; the latest progress update while IN_PROGRESS.")
    error: str | None = Field(
        default=None, description="Why the job failed; a handler exception arrives as a JSON string."
    )


class StreamChunk(_Wire):
    output: Any = Field(description="One value a generator handler yielded.")


class JobStream(_Wire):
    """Answer of `GET /v2/{endpoint_id}/stream/{job_id}`: the chunks not yet read."""

    id: str = Field(description="The job id.")
    status: JobStatusName = Field(description="The job's status.")
    stream: list[StreamChunk] = Field(description="Chunks posted since the previous read.")


class HealthJobs(_Wire):
    completed: int = Field(description="Jobs completed.")
    failed: int = Field(description="Jobs failed or timed out.")
    in_progress: int = Field(description="Jobs being run by a worker.")
    in_queue: int = Field(description="Jobs waiting for a worker.")
    retried: int = Field(description="Jobs queued again through `/retry`.")


class HealthWorkers(_Wire):
    idle: int = Field(description="Workers up and waiting for a job.")
    initializing: int = Field(description="Workers started that have not called in yet.")
    ready: int = Field(description="Workers able to take a job now (same as idle here).")
    running: int = Field(description="Workers running a job.")
    throttled: int = Field(
        description="Workers wanted but not started: no datacenter the endpoint allows has stock of its GPUs on hosts "
        "that meet its CUDA need (`gpu.minCudaVersion` / `gpu.allowedCudaVersions`)."
    )
    unhealthy: int = Field(description="Workers that reported a failed fitness check.")


class Health(_Wire):
    """Answer of `GET /v2/{endpoint_id}/health`."""

    jobs: HealthJobs
    workers: HealthWorkers


class PurgeQueueResult(_Wire):
    removed: int = Field(description="Queued jobs removed (they end CANCELLED).")
    status: Literal["completed"] = "completed"


class TakenJob(_Wire):
    """What `job-take` hands a worker."""

    id: str = Field(description="The job id.")
    input: dict[str, Any] = Field(description="The job's input.")


class StopSignals(_Wire):
    """What `job-stop` tells a worker."""

    jobs_to_stop: list[str] = Field(description="Ids of jobs the worker must stop now.")


class AccountEndpoint(_Wire):
    id: str = Field(description="Endpoint id.")
    name: str = Field(description="Endpoint name.")
    workers_max: int = Field(description="The endpoint's `workers.max` (its share of the quota).")
    created_at: datetime = Field(description="When it was created.")
    age_seconds: float = Field(description="Seconds it has lived (until deletion for a deleted one).")
    deleted_at: datetime | None = Field(default=None, description="When it was deleted; None while live.")


class AccountJob(_Wire):
    id: str = Field(description="Job id.")
    endpoint_id: str = Field(description="Endpoint the job was submitted to.")
    status: JobStatusName = Field(description="The job's status.")
    created_at: datetime = Field(description="When it was submitted.")
    finished_at: datetime | None = Field(default=None, description="When it reached a final status.")
    worker_id: str | None = Field(default=None, description="The worker that took it.")
    expired: bool = Field(description="Deleted after its TTL: `/status` answers 404 for it.")


class AccountWorker(_Wire):
    id: str = Field(description="Worker (pod) id.")
    endpoint_id: str = Field(description="Endpoint it served.")
    pid: int | None = Field(
        description="Process id (docker runtime: of the `docker run` client); None for a worker localpod did not start."
    )
    container: str | None = Field(default=None, description="Its container's name (docker runtime); None otherwise.")
    started_at: datetime = Field(description="When it was started (or first called in).")
    ended_at: datetime | None = Field(default=None, description="When its process ended; None while alive.")
    exit_code: int | None = Field(
        default=None,
        description="Process exit code; negative = killed by that signal (docker runtime: the container's exit "
        "code, 128 + the signal when killed, e.g. 137 for SIGKILL).",
    )
    log_path: str | None = Field(default=None, description="Its stdout/stderr log file.")
    placement: WorkerPlacement | None = Field(
        default=None, description="Its datacenter and GPU pool; None for a worker localpod did not start."
    )


class AccountVolume(_Wire):
    id: str = Field(description="Network volume id.")
    name: str = Field(description="Its name (names need not be unique).")
    data_center: str = Field(description="The datacenter it lives in, where its endpoints' workers start.")
    size: int = Field(description="Allocated size in GB (localpod enforces no quota on its folder).")
    type: str = Field(default="STANDARD", description="Its storage tier: STANDARD or HIGH_PERFORMANCE.")
    path: str = Field(description="Its folder on this machine: what a worker sees at /runpod-volume.")


class Account(_Wire):
    """`GET /_localpod/account`: what the account holds and has spent, for tests and benchmarks."""

    worker_quota: int = Field(description="The account's worker quota.")
    live_endpoints: list[AccountEndpoint] = Field(description="Endpoints that exist now.")
    endpoints: list[AccountEndpoint] = Field(description="Every endpoint ever created, deleted ones included.")
    peak_live_endpoints: int = Field(description="Most endpoints that were live at the same time.")
    peak_workers_max: int = Field(description="Highest sum of `workers.max` over live endpoints.")
    billed_worker_seconds: float = Field(description="Sum of worker process lifetimes (what RunPod would bill).")
    workers_spawned: int = Field(description="Worker processes started.")
    workers: list[AccountWorker] = Field(description="Every worker, live or ended.")
    out_of_stock_pools: list[str] = Field(
        description="GPU pools kept out of stock in every datacenter through `/_localpod/stock` (pools out in some "
        "datacenters only are listed by `GET /_localpod/stock`)."
    )
    faults_injected: dict[str, int] = Field(
        description="Faults injected so far by kind: the route actions (status_429, status_500, status_400, hang, "
        "drop, act_then_500, unknown_status, create_as_gpu) and worker_crash, worker_hang, worker_preempt, worker_env; "
        "every kind listed."
    )
    jobs: list[AccountJob] = Field(description="Every job submitted.")
    volumes: list[AccountVolume] = Field(default=[], description="Network volumes that exist now.")
