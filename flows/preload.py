"""The `preload` flow: warm models' weights in a network volume in every chosen datacenter, so that a
training run placed there downloads nothing.

Each datacenter runs concurrently, holding one slot of the `runpod-endpoints` limit: its volume is
ensured (created, or grown to fit), an endpoint pinned there with the volume attached runs a `preload`
job, and the endpoint is deleted. The sweep ends Failed if any datacenter is not ok, after all of them
have finished; the record of what is warm where (`tasks/weight_cache.py`) is written either way.

    .venv/bin/python -m flows.preload '{"models": [{"id": "Qwen/Qwen3-4B"}]}'
    prefect deployment run preload/nightly
"""

# No `from __future__ import annotations` here: Prefect builds the parameter model (the UI form) from
# the flow signature.
import json
import sys
import time

from huggingface_hub import HfApi
from loraflow_worker.contract import ModelSource
from huggingface_hub.utils import filter_repo_objects
from loraflow_worker.model_cache import download_ignore_patterns
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run
from prefect.states import Failed, State
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tasks.image_contract import check_image_contract
from tasks.preload import DataCenterOutcome, choose_gpu, preload_data_center
from tasks.quota import ensure_endpoint_limit
from tasks.runpod.catalog import GPU_CLASSES, resolve_gpu
from tasks.runpod.live_catalog import gpu_offers, read_data_centers
from tasks.runpod.steps import make_client, prepare_worker_env
from tasks.runpod.volumes import volume_size_gb
from tasks.settings import Settings
from tasks.teardown import delete_run_endpoints_hook
from tasks.weight_cache import read_cache, record_preload, write_cache


class PreloadSpec(BaseModel):
    """What to warm, and where."""

    model_config = ConfigDict(extra="forbid")

    models: list[ModelSource] = Field(min_length=1, description="Hub models (`id`, optional `revision`) to keep warm.")
    data_centers: list[str] | None = Field(
        default=None, description="RunPod datacenter ids (e.g. EU-RO-1). Default: every datacenter with network "
        "volumes and stock of a GPU class (of `gpu`, when set).")
    gpu: str | None = Field(default=None, description="GPU class of the preload worker (e.g. 4090). Default: the "
                            "cheapest class in stock in each datacenter.")
    deny_data_centers: list[str] = Field(
        # RunPod was observed to fail volume creation in US-MO-1 (500).
        default=["US-MO-1"], description="Datacenters never used, even when listed in `data_centers`.")
    minutes_per_data_center: int = Field(default=60, ge=5, le=1440, description="Time budget of each datacenter's "
                                         "preload, queueing included.")
    queue_minutes: int = Field(default=10, ge=1, le=240, description="A datacenter whose worker has not started "
                               "after this long is reported as no capacity.")


class SweepPlan(BaseModel):
    """Which datacenters to warm with which GPU, and those left out with why."""

    targets: dict[str, str] = Field(description="Datacenter id → GPU class name.")
    skipped: list[DataCenterOutcome] = Field(description="Datacenters reported without renting anything.")


def plan_sweep(spec: PreloadSpec, data_centers: list, offers: list) -> SweepPlan:
    """Pick the datacenters and each one's GPU from the live catalog (`CatalogDataCenter`s, `GpuOffer`s)."""
    volume_capable = {dc.id for dc in data_centers if dc.supports_network_volumes}
    wanted = spec.data_centers if spec.data_centers is not None else sorted(volume_capable)
    targets: dict[str, str] = {}
    skipped: list[DataCenterOutcome] = []
    for dc in wanted:
        if dc in spec.deny_data_centers:
            continue
        if dc not in volume_capable:
            skipped.append(DataCenterOutcome(data_center=dc, status="error",
                                             error=f"{dc} has no network volumes (volume-capable: "
                                                   f"{', '.join(sorted(volume_capable)) or 'none'})"))
            continue
        gpu = choose_gpu(dc, offers)
        if gpu is None:
            if spec.data_centers is not None:  # asked for by name: say why nothing ran there
                skipped.append(DataCenterOutcome(data_center=dc, status="no_capacity",
                                                 error="RunPod's catalog shows no stock of the GPU there"))
            continue
        targets[dc] = gpu.name
    return SweepPlan(targets=targets, skipped=skipped)


@task(name="size-models", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=[5, 20],
      retry_condition_fn=lambda task, run, state: not isinstance(state.data, ValueError))
def size_models(models: list[ModelSource]) -> list[int]:
    """Bytes of the files a preload keeps of each model; ValueError naming a model the Hub does not have."""
    settings = Settings().with_hub_token()
    api = HfApi(endpoint=settings.hf_endpoint, token=settings.hf_token.get_secret_value() if settings.hf_token else None)
    sizes = []
    for model in models:
        try:
            info = api.model_info(model.id, revision=model.revision, files_metadata=True)
        except Exception as e:  # noqa: BLE001 - the Hub's errors differ by cause; each is the user's to fix
            raise ValueError(f"models: {model.id!r} (revision {model.revision!r}) cannot be read on the Hub: {e}") from e
        siblings = {s.rfilename: s.size or 0 for s in info.siblings or []}
        kept = filter_repo_objects(list(siblings), ignore_patterns=download_ignore_patterns(list(siblings)))
        sizes.append(sum(siblings[name] for name in kept))
    return sizes


@task(name="read-datacenters", cache_policy=NO_CACHE, retries=3, retry_delay_seconds=[2, 10, 30])
def read_catalog(gpu: str | None) -> tuple[list, list]:
    classes = [resolve_gpu(gpu)] if gpu else list(GPU_CLASSES.values())
    with make_client() as client:
        return read_data_centers(client), gpu_offers(client, classes)


def _table(outcomes: list[DataCenterOutcome]) -> list[dict]:
    return [{"datacenter": o.data_center, "status": o.status, "gpu": o.gpu or "", "volume": o.volume_id or "",
             "volume_gb": o.volume_gb or "", "downloaded": ", ".join(m.id for m in o.models if m.status == "downloaded"),
             "already cached": ", ".join(m.id for m in o.models if m.status == "cached"),
             "failed": ", ".join(m.id for m in o.models if m.status == "failed"),
             "MB downloaded": round(o.bytes_downloaded / 1e6, 1), "seconds": round(o.seconds), "error": o.error or ""}
            for o in outcomes]


@flow(name="preload", log_prints=True, on_crashed=[delete_run_endpoints_hook],
      on_cancellation=[delete_run_endpoints_hook], on_failure=[delete_run_endpoints_hook])
def preload(spec: PreloadSpec) -> list[DataCenterOutcome] | State:
    """Warm `spec.models` in a network volume in each datacenter, concurrently; a table of the sweep."""
    logger = get_run_logger()
    run_id = str(flow_run.id)
    settings = Settings()
    # Refused before anything is created when unset, or when the image would refuse this contract's jobs.
    check_image_contract(settings.worker_image())
    sizes = size_models(spec.models)
    volume_gb = volume_size_gb(sizes)
    data_centers, offers = read_catalog(spec.gpu)
    plan = plan_sweep(spec, data_centers, offers)
    logger.info("Preloading %s (%.1f GB, volumes of %d GB) in %s", ", ".join(m.id for m in spec.models),
                sum(sizes) / 1e9, volume_gb, ", ".join(f"{dc} on {gpu}" for dc, gpu in plan.targets.items()) or "nowhere")
    ensure_endpoint_limit()
    env = prepare_worker_env()
    deadline = time.time() + spec.minutes_per_data_center * 60
    futures = [preload_data_center.submit(dc, gpu, spec.models, volume_gb, run_id, settings.control_plane_namespace(),
                                          env, deadline, spec.queue_minutes * 60)
               for dc, gpu in plan.targets.items()]
    outcomes = plan.skipped + [f.result() for f in futures]
    for outcome in outcomes:
        if outcome.volume_id and outcome.status in ("ok", "partial"):
            warm = {m.id: (m.revision, m.size_bytes) for m in outcome.models if m.status != "failed" and m.revision}
            write_cache(record_preload(read_cache(outcome.data_center), outcome.data_center, outcome.volume_id,
                                       outcome.volume_gb or volume_gb, warm))
    create_table_artifact(table=_table(outcomes), key="preload-sweep", description="Weight cache per datacenter")
    not_ok = [o for o in outcomes if o.status != "ok"]
    if not outcomes:
        return Failed(message="no datacenter to preload: none has network volumes and stock of the GPU")
    if not_ok:
        return Failed(message="; ".join(f"{o.data_center}: {o.status} ({o.error})" for o in not_ok))
    return outcomes


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m flows.preload '{\"models\": [{\"id\": \"org/model\"}]}'")
    try:
        preload_spec = PreloadSpec.model_validate(json.loads(sys.argv[1]))
    except (ValueError, ValidationError) as e:
        sys.exit(f"bad preload spec: {e}")
    final = preload(preload_spec, return_state=True)
    print(f"flow run {final.state_details.flow_run_id}: {final.name}", flush=True)
    sys.exit(0 if final.is_completed() else 1)
