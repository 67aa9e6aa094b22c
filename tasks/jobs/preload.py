"""One datacenter's preload: its volume right-sized (used, grown, or replaced by a new STANDARD one), an
endpoint pinned there with the volume attached — on the cheapest CPU flavor in stock there, a GPU when no
CPU flavor is — a `preload` job run on it, on the path every rented job takes (`tasks/jobs/rented.py`): the
endpoint deleted whatever happened, confirmed, retried, its slot and a record kept for the reconciler while
unconfirmed.

Plain functions over `RunpodClient` (the choices are pure: `choose_compute`, `plan_volume`), and thin Prefect
tasks: `preload_data_center`, which the `preload` flow submits once per datacenter so the datacenters run
concurrently, and `retire_volumes`, which deletes the volumes a sweep replaced once nothing attaches them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Literal

from loraflow_worker.contract import CONTRACT_VERSION, ModelSource, PreloadInput, PreloadResult
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel, Field

from tasks.jobs.rented import Rental, rented_endpoint, run_job
from tasks.lifecycle.steps import run_cancel_requested
from tasks.placement.prices import documented_usd_per_month
from tasks.reports import events
from tasks.runpod.catalog import GPU_CLASSES, GpuClass, cpu_flavor_id
from tasks.runpod.client import RunpodClient
from tasks.runpod.endpoints import build_cpu_create_request, build_create_request, endpoint_name
from tasks.runpod.errors import RunpodError
from tasks.runpod.jobs import JobOutcome
from tasks.runpod.live_catalog import CatalogCpuType, CatalogDataCenter, GpuOffer
from tasks.runpod.models import CreateEndpoint, CreateNetworkVolume, NetworkVolume
from tasks.runpod.volumes import SIZE_STEP_GB, delete_unattached_volume, volume_name
from tasks.settings import Settings, make_client

PRELOAD_DISK_GB = 20
"""Container disk of a preload worker: the weights go to the volume, not to this disk."""
PRELOAD_MIN_RAM_GB = 4
"""RAM a CPU preload worker gets at least: the Hub client streams files to disk, so a few GB do."""
STORAGE_TYPE = "STANDARD"
"""The storage tier of every volume a sweep creates: high-performance storage costs more, and a download
and a model load once per run gain little from it."""

DataCenterStatus = Literal["ok", "partial", "error", "no_capacity", "skipped"]


class ModelOutcome(BaseModel):
    id: str
    revision: str | None = Field(default=None, description="The commit now on the volume.")
    status: Literal["cached", "downloaded", "failed"]
    size_bytes: int = 0
    bytes_downloaded: int = 0
    seconds: float = 0.0
    error: str | None = None


class Compute(BaseModel):
    """What a datacenter's preload worker runs on."""

    kind: Literal["cpu", "gpu"]
    name: str = Field(description="The CPU flavor id (e.g. cpu3c), or loraflow's GPU class name (e.g. 4090).")
    vcpu_count: int | None = Field(default=None, description="vCPUs of a CPU worker; None for a GPU.")
    usd_per_hour: float = Field(description="The worker's serverless price per hour, USD.")
    exclude: list[str] = Field(
        default_factory=list, description="A GPU: the cards excluded from its pool to pin it (`excludedTypes`), as its "
        "offer says (the other cards RunPod's catalog lists in the pool, or the static table's); empty for a CPU.")

    def describe(self) -> str:
        return f"CPU {self.name} × {self.vcpu_count} vCPU" if self.kind == "cpu" else f"GPU {self.name}"


class VolumePlan(BaseModel):
    """What a sweep does with a datacenter's volume."""

    action: Literal["use", "grow", "create"] = Field(description="use: an existing volume fits; grow: the "
                                                     "existing one is too small; create: none fits (none yet, or "
                                                     "larger than needed by more than a step, or high-performance).")
    volume: NetworkVolume | None = Field(default=None, description="The volume used or grown; None to create.")
    size_gb: int = Field(description="Its size after the sweep.")
    retire: list[NetworkVolume] = Field(default_factory=list, description="This control plane's other volumes in "
                                        "the datacenter: deleted once the new one holds the record and nothing "
                                        "attaches them.")

    @property
    def volume_type(self) -> str:
        return (self.volume.type or STORAGE_TYPE) if self.volume is not None else STORAGE_TYPE


class DataCenterOutcome(BaseModel):
    """What one datacenter's preload did."""

    data_center: str
    status: DataCenterStatus = Field(description="ok: every model is warm; partial: some failed; error: the "
                                     "preload could not run; no_capacity: no worker started there; skipped: left "
                                     "out by the sweep's policy (budget, storage tier), nothing rented.")
    compute: str | None = Field(default=None, description="What its preload worker ran on (`Compute.describe`).")
    volume_id: str | None = None
    volume_gb: int | None = None
    volume_type: str | None = None
    models: list[ModelOutcome] = Field(default_factory=list)
    seconds: float = 0.0
    teardown: str = Field(default="", description="What became of the endpoint: deleted, not confirmed deleted "
                          "(slot and record kept for the reconciler), or empty when none was made.")
    error: str | None = None
    notes: list[str] = Field(default_factory=list, description="What else the sweep did here (volumes replaced, "
                             "retired, deleted).")

    @property
    def bytes_downloaded(self) -> int:
        return sum(m.bytes_downloaded for m in self.models)

    @property
    def usd_per_month(self) -> float | None:
        """The documented monthly price of its volume; None when it has none."""
        if self.volume_gb is None or self.volume_id is None:
            return None
        return documented_usd_per_month(self.volume_gb, self.volume_type)


# --- choices (pure) ------------------------------------------------------------------------------


def choose_gpu(data_center: str, offers: list[GpuOffer]) -> GpuClass | None:
    """The cheapest of these GPU classes with stock in the datacenter, or None."""
    in_stock = [o for o in offers if data_center in o.in_stock_data_centers()]
    if not in_stock:
        return None
    return GPU_CLASSES[min(in_stock, key=lambda o: (o.usd_per_hour, o.gpu)).gpu]


def cpu_worker_vcpus(flavor: CatalogCpuType) -> int | None:
    """The fewest vCPUs a serverless worker of the flavor may have with `PRELOAD_MIN_RAM_GB` of RAM and room for
    `PRELOAD_DISK_GB` of container disk (`CatalogCpuType.serverless_vcpus`); None when none is."""
    return flavor.serverless_vcpus(PRELOAD_MIN_RAM_GB, PRELOAD_DISK_GB)


def choose_cpu(data_center: CatalogDataCenter, cpu_types: list[CatalogCpuType]) -> Compute | None:
    """The cheapest worker of a CPU flavor with stock in the datacenter, or None when it offers none."""
    by_id = {c.flavor: c for c in cpu_types}
    choices = []
    for offered in data_center.cpu_availability:
        flavor = by_id.get(cpu_flavor_id(offered.id))
        vcpus = cpu_worker_vcpus(flavor) if flavor is not None and offered.availability != "NONE" else None
        if flavor is not None and vcpus is not None:
            choices.append(Compute(kind="cpu", name=flavor.flavor, vcpu_count=vcpus,
                                   usd_per_hour=round(flavor.price.serverless_per_vcpu * vcpus, 4)))
    return min(choices, key=lambda c: (c.usd_per_hour, c.name)) if choices else None


def choose_compute(data_center: CatalogDataCenter, cpu_types: list[CatalogCpuType], offers: list[GpuOffer], *,
                   cpu: bool = True) -> Compute | None:
    """A download needs no GPU: the cheapest CPU worker in stock there (`cpu`), else the cheapest GPU in stock
    there; None when neither is."""
    chosen = choose_cpu(data_center, cpu_types) if cpu else None
    if chosen is not None:
        return chosen
    gpu = choose_gpu(data_center.id, offers)
    if gpu is None:
        return None
    chosen_offer = next(o for o in offers if o.gpu == gpu.name)
    return Compute(kind="gpu", name=gpu.name, usd_per_hour=chosen_offer.usd_per_hour, exclude=chosen_offer.exclude)


def plan_volume(existing: list[NetworkVolume], needed_gb: int, recorded_id: str | None) -> VolumePlan:
    """What to do with this control plane's volumes in one datacenter (`existing`) for models that need
    `needed_gb`: use one that fits (at least `needed_gb`, at most a size step more, not high-performance),
    the recorded one first; else grow one too small; else create a new one. Every other volume is retired:
    RunPod cannot shrink a volume, so a smaller need is a new volume and the old one deleted."""
    def rank(v: NetworkVolume) -> tuple[bool, str]:
        return (v.id != recorded_id, v.id)

    standard = [v for v in existing if v.type != "HIGH_PERFORMANCE"]
    fits = sorted((v for v in standard if needed_gb <= v.size <= needed_gb + SIZE_STEP_GB), key=rank)
    small = sorted((v for v in standard if v.size < needed_gb), key=rank)
    if fits:
        return VolumePlan(action="use", volume=fits[0], size_gb=fits[0].size,
                          retire=[v for v in existing if v.id != fits[0].id])
    if small:
        return VolumePlan(action="grow", volume=small[0], size_gb=needed_gb,
                          retire=[v for v in existing if v.id != small[0].id])
    return VolumePlan(action="create", size_gb=needed_gb, retire=list(existing))


def outcome_of(data_center: str, compute: Compute, volume: NetworkVolume, job: JobOutcome,
               seconds: float) -> DataCenterOutcome:
    """A datacenter's outcome from its preload job's."""
    common = dict(data_center=data_center, compute=compute.describe(), volume_id=volume.id, volume_gb=volume.size,
                  volume_type=volume.type or STORAGE_TYPE, seconds=seconds)
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


# --- doing ---------------------------------------------------------------------------------------


def realize_volume(client: RunpodClient, plan: VolumePlan, name: str, data_center: str) -> NetworkVolume:
    """The volume the plan names, grown, or created (STANDARD storage)."""
    if plan.action == "use" and plan.volume is not None:
        return plan.volume
    if plan.action == "grow" and plan.volume is not None:
        return client.grow_network_volume(plan.volume.id, plan.size_gb)
    return client.create_network_volume(CreateNetworkVolume(name=name, size=plan.size_gb, data_center=data_center,
                                                            type=STORAGE_TYPE))


def preload_request(*, name: str, compute: Compute, image: str, env: dict[str, str], execution_timeout_s: int,
                    data_center: str, volume_id: str) -> CreateEndpoint:
    """The preload endpoint: one worker of `compute`, pinned to the datacenter with the volume attached."""
    common = dict(name=name, image=image, disk_gb=PRELOAD_DISK_GB, env=env, execution_timeout_s=execution_timeout_s,
                  data_center_ids=[data_center], network_volume_id=volume_id)
    if compute.kind == "cpu":
        assert compute.vcpu_count is not None
        return build_cpu_create_request(cpu_flavor=compute.name, vcpu_count=compute.vcpu_count, **common)
    # A download needs no CUDA: any host of the GPU will do, whatever its driver.
    gpu = GPU_CLASSES[compute.name].model_copy(update={"exclude": tuple(compute.exclude)})
    return build_create_request(gpu=gpu, gpu_count=1, cuda_floor=None, **common)


def preload_one(
    client: RunpodClient,
    rental: Rental,
    *,
    run_id: str,
    data_center: str,
    compute: Compute,
    volume: NetworkVolume,
    models: list[ModelSource],
    image: str,
    env: dict[str, str],
    deadline_epoch_s: float,
    queue_s: float,
    logger: Any,
    cancel_requested: Callable[[], bool] = lambda: False,
) -> DataCenterOutcome:
    """Run a preload job on an endpoint (`rental`'s) pinned to the datacenter with `volume` attached; the caller's
    `rented_endpoint` deletes it, whatever happened."""
    started = time.time()
    remaining = max(int(deadline_epoch_s - started), 60)
    request = preload_request(name=rental.name, compute=compute, image=image, execution_timeout_s=remaining + 300,
                              env=env | {"LORAFLOW_RUN_DEADLINE_EPOCH_S": f"{deadline_epoch_s:.0f}"},
                              data_center=data_center, volume_id=volume.id)
    # The sweep's list is all the volume should keep: models no longer swept are removed from it.
    job_input = PreloadInput(contract_version=CONTRACT_VERSION, mode="preload", run_id=run_id, models=models,
                             deadline_epoch_s=deadline_epoch_s, remove_others=True)
    outcome = run_job(client, rental, request, job_input, deadline_epoch_s=deadline_epoch_s, queue_s=queue_s,
                      logger=logger, cancel_requested=cancel_requested)
    if outcome is None:
        return DataCenterOutcome(data_center=data_center, status="error", compute=compute.describe(),
                                 volume_id=volume.id, volume_gb=volume.size, volume_type=volume.type or STORAGE_TYPE,
                                 error="cancelled, or no room in RunPod's worker quota before the time budget ran out",
                                 seconds=time.time() - started)
    return outcome_of(data_center, compute, volume, outcome, time.time() - started)


class SweepTarget(BaseModel):
    """One datacenter the sweep warms: on what, and into which volume."""

    data_center: str
    compute: Compute
    volume: VolumePlan
    usd_per_month: float = Field(description="The documented monthly price of its volume after the sweep.")


@task(name="preload-datacenter", cache_policy=NO_CACHE, task_run_name="preload-{target.data_center}")
def preload_data_center(target: SweepTarget, models: list[ModelSource], run_id: str, namespace: str,
                        env: dict[str, str], deadline_epoch_s: float, queue_s: float) -> DataCenterOutcome:
    """One datacenter, on the path every rented job takes (`tasks/jobs/rented.py`): one slot of the endpoint limit
    for as long as its endpoint may exist, the endpoint deleted (confirmed and retried), and when the delete stays
    unconfirmed a slot lease of its own and a record (`UndeletedEndpoint`) outliving the task, for the reconciler.
    Never raises for the datacenter's own trouble: the sweep reports every datacenter, then decides."""
    logger = get_run_logger()
    settings = Settings()
    data_center, compute = target.data_center, target.compute
    name = endpoint_name(run_id, 1, f"preload-{data_center}", namespace)
    rental: Rental | None = None
    volume: NetworkVolume | None = None
    teardown = ""
    try:
        with rented_endpoint(name, run_id, give_up_at=deadline_epoch_s, logger=logger) as rental, \
                make_client(settings) as client:
            volume = realize_volume(client, target.volume, volume_name(data_center, namespace), data_center)
            events.volume_used(volume.id, volume.name, data_center, by="preload", run_id=run_id)
            outcome = preload_one(client, rental, run_id=run_id, data_center=data_center, compute=compute,
                                  volume=volume, models=models, image=settings.worker_image(), env=env,
                                  deadline_epoch_s=deadline_epoch_s, queue_s=queue_s, logger=logger,
                                  cancel_requested=run_cancel_requested)
    except Exception as e:  # noqa: BLE001 - one datacenter's failure is reported in the sweep's table
        logger.exception("Preload in %s failed", data_center)
        outcome = DataCenterOutcome(data_center=data_center, status="error", compute=compute.describe(),
                                    error=f"{type(e).__name__}: {e}")
        if volume is not None:
            outcome = outcome.model_copy(update={"volume_id": volume.id, "volume_gb": volume.size,
                                                 "volume_type": volume.type or STORAGE_TYPE})
    undeleted = rental is not None and rental.undeleted is not None
    if undeleted:
        teardown = "not confirmed deleted: its slot and record are kept for the reconciler"
    elif rental is not None and rental.endpoint is not None:
        teardown = "deleted"
    outcome = outcome.model_copy(update={"teardown": teardown})
    if outcome.status in ("error", "no_capacity") and volume is not None and target.volume.action == "create" \
            and not undeleted:
        outcome = _drop_unused_new_volume(outcome, volume, logger)
    logger.info("Preload in %s on %s: %s (%d bytes downloaded)%s", data_center, compute.describe(), outcome.status,
                outcome.bytes_downloaded, f": {outcome.error}" if outcome.error else "")
    return outcome


def _drop_unused_new_volume(outcome: DataCenterOutcome, volume: NetworkVolume, logger) -> DataCenterOutcome:
    """A volume this sweep created where nothing could be preloaded bills for nothing: deleted again, unless an
    endpoint references it by now (its own endpoint is proved gone)."""
    try:
        with make_client() as client:
            users = delete_unattached_volume(client, volume.id)
    except RunpodError as e:
        logger.warning("The new volume %s in %s holds nothing and could not be deleted (%s); the volumes flow's "
                       "retention will", volume.id, outcome.data_center, e)
        return outcome.model_copy(update={"notes": [*outcome.notes, f"new volume {volume.id} holds nothing; its "
                                                    f"delete failed ({type(e).__name__}), left to the volumes flow"]})
    if users:
        logger.warning("The new volume %s in %s holds nothing but %s attaches it: kept, left to the volumes flow",
                       volume.id, outcome.data_center, ", ".join(users))
        return outcome.model_copy(update={"notes": [*outcome.notes, f"new volume {volume.id} holds nothing; attached "
                                                    f"to {', '.join(users)}: kept, left to the volumes flow"]})
    return outcome.model_copy(update={"volume_id": None, "volume_gb": None, "volume_type": None,
                                      "notes": [*outcome.notes, f"new volume {volume.id} held nothing: deleted"]})


@task(name="retire-volumes", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=[5, 20])
def retire_volumes(volumes: list[NetworkVolume]) -> dict[str, str]:
    """Delete volumes a sweep replaced (the record now names the new one); volume id → what became of it. A
    volume an endpoint still attaches, as the account's endpoints are listed right before its delete, is left to the
    volumes flow's retention (RunPod would delete it, and the endpoint's workers could not start)."""
    if not volumes:
        return {}
    results: dict[str, str] = {}
    with make_client() as client:
        for volume in volumes:
            label = f"old volume {volume.id} ({volume.size} GB)"
            try:
                users = delete_unattached_volume(client, volume.id)
                results[volume.id] = (f"{label} is attached to {', '.join(users)}: left to the volumes flow's "
                                      "retention") if users else f"{label} replaced: deleted"
            except RunpodError as e:
                results[volume.id] = f"{label} replaced, its delete failed ({type(e).__name__}: {str(e)[:200]}): " \
                                     "left to the volumes flow's retention"
    get_run_logger().info("Retired volumes: %s", "; ".join(results.values()))
    return results
