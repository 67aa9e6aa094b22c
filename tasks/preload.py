"""One datacenter's preload: its volume ensured, an endpoint pinned there with the volume attached, a
`preload` job run on it, the endpoint deleted whatever happened — inside one slot of `runpod-endpoints`.

Plain functions over `RunpodClient`, and one thin Prefect task (`preload_data_center`) that the
`preload` flow submits once per datacenter, so the datacenters run concurrently.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

from loraflow_worker.contract import CONTRACT_VERSION, ModelSource, PreloadResult
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel, Field

from tasks.liveness import beat
from tasks.quota import endpoint_slot, wait_for_runpod_quota
from tasks.runpod.catalog import GPU_CLASSES, GpuClass
from tasks.runpod.client import RunpodClient
from tasks.runpod.endpoints import build_create_request, endpoint_name, ensure_endpoint
from tasks.runpod.jobs import JobOutcome, WatchLimits, watch_job
from tasks.runpod.live_catalog import GpuOffer
from tasks.runpod.models import Endpoint, JobPolicy, RunRequest
from tasks.runpod.steps import make_client, run_cancel_requested
from tasks.runpod.volumes import ensure_volume, volume_name
from tasks.settings import Settings
from tasks.teardown import delete_attempt_endpoints

PRELOAD_DISK_GB = 20
"""Container disk of a preload worker: the weights go to the volume, not to this disk."""

DataCenterStatus = Literal["ok", "partial", "error", "no_capacity"]


class ModelOutcome(BaseModel):
    id: str
    revision: str | None = Field(default=None, description="The commit now on the volume.")
    status: Literal["cached", "downloaded", "failed"]
    size_bytes: int = 0
    bytes_downloaded: int = 0
    seconds: float = 0.0
    error: str | None = None


class DataCenterOutcome(BaseModel):
    """What one datacenter's preload did."""

    data_center: str
    status: DataCenterStatus = Field(description="ok: every model is warm; partial: some failed; error: the "
                                     "preload could not run; no_capacity: no worker started there.")
    gpu: str | None = Field(default=None, description="The GPU class of its preload worker.")
    volume_id: str | None = None
    volume_gb: int | None = None
    models: list[ModelOutcome] = Field(default_factory=list)
    seconds: float = 0.0
    error: str | None = None

    @property
    def bytes_downloaded(self) -> int:
        return sum(m.bytes_downloaded for m in self.models)


def choose_gpu(data_center: str, offers: list[GpuOffer]) -> GpuClass | None:
    """The cheapest of these GPU classes with stock in the datacenter, or None."""
    in_stock = [o for o in offers if data_center in o.in_stock_data_centers()]
    if not in_stock:
        return None
    return GPU_CLASSES[min(in_stock, key=lambda o: (o.usd_per_hour, o.gpu)).gpu]


def outcome_of(data_center: str, gpu: GpuClass, volume_id: str, volume_gb: int, job: JobOutcome,
               seconds: float) -> DataCenterOutcome:
    """A datacenter's outcome from its preload job's."""
    common = dict(data_center=data_center, gpu=gpu.name, volume_id=volume_id, volume_gb=volume_gb, seconds=seconds)
    if job.kind == "no_capacity":
        return DataCenterOutcome(status="no_capacity", error=job.error, **common)
    if job.kind != "completed":
        return DataCenterOutcome(status="error", error=f"{job.kind}: {job.error}", **common)
    try:
        result = PreloadResult.model_validate(job.output)
    except ValueError as e:
        return DataCenterOutcome(status="error", error=f"the preload job's output is not a PreloadResult: {e}", **common)
    models = [ModelOutcome(id=m.id, revision=m.revision, status=m.status, size_bytes=m.size_bytes,
                           bytes_downloaded=m.bytes_downloaded, seconds=m.seconds, error=m.error)
              for m in result.models]
    failed = [m.id for m in models if m.status == "failed"]
    return DataCenterOutcome(status="partial" if failed else "ok", models=models,
                             error=f"not warm: {', '.join(failed)}" if failed else None, **common)


def preload_one(
    client: RunpodClient,
    *,
    run_id: str,
    namespace: str,
    data_center: str,
    gpu: GpuClass,
    models: list[ModelSource],
    volume_gb: int,
    image: str,
    env: dict[str, str],
    deadline_epoch_s: float,
    queue_s: float,
    cancel_requested: Callable[[], bool] = lambda: False,
) -> DataCenterOutcome:
    """Ensure the datacenter's volume, run a preload job on an endpoint pinned there with the volume
    attached, and delete the endpoint (confirmed) whatever happened."""
    started = time.time()
    volume = ensure_volume(client, volume_name(data_center, namespace), data_center, volume_gb)
    remaining = max(int(deadline_epoch_s - started), 60)
    name = endpoint_name(run_id, 1, f"preload-{data_center}", namespace)
    request = build_create_request(
        name=name, gpu=gpu, gpu_count=1, image=image, disk_gb=PRELOAD_DISK_GB,
        env=env | {"LORAFLOW_RUN_DEADLINE_EPOCH_S": f"{deadline_epoch_s:.0f}"},
        # A download needs no CUDA: any host of the GPU will do, whatever its driver.
        execution_timeout_s=remaining + 300, cuda_floor=None,
        data_center_ids=[data_center], network_volume_id=volume.id,
    )
    endpoint: Endpoint | None = None
    try:
        endpoint = wait_for_runpod_quota(lambda: ensure_endpoint(client, request), give_up_at=deadline_epoch_s - 60,
                                         cancel_requested=cancel_requested)
        if endpoint is None:
            return DataCenterOutcome(data_center=data_center, status="error", gpu=gpu.name, volume_id=volume.id,
                                     volume_gb=volume.size, error="cancelled, or no room in RunPod's worker quota "
                                     "before the time budget ran out", seconds=time.time() - started)
        job_input = {"contract_version": CONTRACT_VERSION, "mode": "preload", "run_id": run_id,
                     "models": [m.model_dump(mode="json") for m in models], "deadline_epoch_s": deadline_epoch_s}
        job = client.run(endpoint.id, RunRequest(input=job_input, policy=JobPolicy(
            execution_timeout=(remaining + 300) * 1000, ttl=(remaining + 600) * 1000)))
        watched = endpoint
        # A preload reports no training steps: only the queue allowance and the time budget apply.
        limits = WatchLimits(deadline_epoch_s=deadline_epoch_s, queue_s=queue_s, startup_s=remaining, stall_s=remaining)
        outcome = watch_job(client, endpoint.id, job.id, limits, on_status=lambda s: beat(watched, s.status),
                            cancel_requested=cancel_requested)
    finally:
        delete_attempt_endpoints(client, name, endpoint.id if endpoint is not None else None)
    return outcome_of(data_center, gpu, volume.id, volume.size, outcome, time.time() - started)


@task(name="preload-datacenter", cache_policy=NO_CACHE, task_run_name="preload-{data_center}")
def preload_data_center(data_center: str, gpu_name: str, models: list[ModelSource], volume_gb: int, run_id: str,
                        namespace: str, env: dict[str, str], deadline_epoch_s: float,
                        queue_s: float) -> DataCenterOutcome:
    """One datacenter, holding one slot of the endpoint limit for as long as its endpoint may exist. Never
    raises for the datacenter's own trouble: the sweep reports every datacenter, then decides."""
    logger = get_run_logger()
    settings = Settings()
    gpu = GPU_CLASSES[gpu_name]
    try:
        with endpoint_slot(settings.loraflow_slot_lease_seconds, give_up_at=deadline_epoch_s, logger=logger), \
                make_client(settings) as client:
            outcome = preload_one(client, run_id=run_id, namespace=namespace, data_center=data_center, gpu=gpu,
                                  models=models, volume_gb=volume_gb, image=settings.worker_image(), env=env,
                                  deadline_epoch_s=deadline_epoch_s,
                                  queue_s=queue_s, cancel_requested=run_cancel_requested)
    except Exception as e:  # noqa: BLE001 - one datacenter's failure is reported in the sweep's table
        logger.exception("Preload in %s failed", data_center)
        return DataCenterOutcome(data_center=data_center, status="error", gpu=gpu_name, error=f"{type(e).__name__}: {e}")
    logger.info("Preload in %s: %s (%d bytes downloaded)%s", data_center, outcome.status, outcome.bytes_downloaded,
                f": {outcome.error}" if outcome.error else "")
    return outcome
