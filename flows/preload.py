"""The `preload` flow: warm models' weights in a network volume in each chosen datacenter, so that a
training run placed there downloads nothing — within a storage budget.

Where: the datacenters `data_centers` names (the nightly deployment names them in prefect.yaml); with none
named, those where this control plane's training ran lately (`loraflow.run.placed` events, at most
`max_default_data_centers`), never "every datacenter"; with no such run, nothing, and the table says how to
name them. Each datacenter runs concurrently, holding one slot of the `runpod-endpoints` limit: its volume is
sized to this sweep's models (used when it fits, grown when too small, replaced by a new one when larger by
more than a size step; STANDARD storage always), an endpoint pinned there with the volume attached runs a
`preload` job on the cheapest CPU flavor in stock there (a download needs no GPU; a GPU when no CPU flavor
is), the models no longer swept are removed from the volume, and the endpoint is deleted as a training
attempt's is. A datacenter whose volume would take this control plane's storage over
`max_storage_usd_per_month`, or that offers only high-performance storage, is skipped with a line in the
sweep's table. The sweep ends Failed if any datacenter it ran is not ok, after all of them have finished;
the record of what is warm where (`tasks/placement/weight_cache.py`) is written either way.

    .venv/bin/python -m flows.preload '{"models": [{"id": "Qwen/Qwen3-4B"}], "data_centers": ["EU-RO-1"]}'
    prefect deployment run preload/nightly
"""

# No `from __future__ import annotations` here: Prefect builds the parameter model (the UI form) from
# the flow signature.
import json
import sys
import time

from huggingface_hub import HfApi
from huggingface_hub.utils import filter_repo_objects
from loraflow_worker.contract import ModelSource
from loraflow_worker.runtime.model_cache import download_ignore_patterns
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run
from prefect.states import Completed, Failed, State
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from flows.forms.run import BLOCK_NAME_PATTERN
from tasks.lifecycle.quota import ensure_endpoint_limit
from tasks.lifecycle.steps import prepare_worker_env
from tasks.lifecycle.teardown import delete_run_endpoints_hook
from tasks.placement.cost import check_cost_cap
from tasks.placement.history import recent_training_data_centers
from tasks.placement.image_contract import check_image_contract
from tasks.preflight.server_rules import ServerRuleError, operator_rule_problems
from tasks.runpod.catalog import GPU_CLASSES, resolve_gpu
from tasks.runpod.errors import RunpodError
from tasks.runpod.live_catalog import (
    CatalogCpuType,
    CatalogDataCenter,
    GpuOffer,
    gpu_offers,
    read_cpu_types,
    read_data_centers,
)
from tasks.runpod.models import NetworkVolume
from tasks.runpod.volumes import volume_name, volume_size_gb
from tasks.settings import Settings, make_client, startup_problem
from tasks.jobs.preload import (
    STORAGE_TYPE,
    DataCenterOutcome,
    SweepTarget,
    choose_compute,
    plan_volume,
    preload_data_center,
    retire_volumes,
)
from tasks.placement.prices import documented_usd_per_month
from tasks.placement.weight_cache import read_cache, record_preload, write_cache

HISTORY_DAYS = 14.0
"""How far back training placements count, by default: the volumes flow's `retain_days` default, so that a
volume the sweep keeps warm is one retention would keep too."""


class PreloadSpec(BaseModel):
    """What to warm, where, and for how much storage."""

    model_config = ConfigDict(extra="forbid")

    models: list[ModelSource] = Field(min_length=1, description="Hub models (`id`, optional `revision`) to keep warm. "
                                      "The whole list: models no longer in it are removed from the volumes.")
    data_centers: list[str] | None = Field(
        default=None, description="RunPod datacenter ids (e.g. EU-RO-1) to warm. Default: the datacenters where this "
        "control plane's training ran within `history_days`, at most `max_default_data_centers`, most recent first; "
        "none when no training ran (the sweep then does nothing and says so).")
    max_default_data_centers: int = Field(default=3, ge=1, le=20, description="The most datacenters warmed when "
                                          "`data_centers` is not set.")
    history_days: float = Field(default=HISTORY_DAYS, gt=0, le=3650, description="How far back the training runs "
                                "that choose the default datacenters count (match the volumes flow's `retain_days`).")
    max_storage_usd_per_month: float = Field(
        default=20.0, ge=0, description="The most this control plane's network volumes may cost per month after the "
        "sweep (RunPod bills $0.07/GB-month, standard storage). A datacenter whose volume would take the total over "
        "it is skipped, with the figures in the sweep's table.")
    cpu: bool = Field(default=True, description="Run each preload on the cheapest CPU flavor in stock in the "
                      "datacenter (a download needs no GPU), on a GPU where none is. False: always on a GPU.")
    gpu: str | None = Field(default=None, description="GPU class of a preload worker that runs on a GPU (e.g. 4090). "
                            "Default: the cheapest class in stock in the datacenter.")
    deny_data_centers: list[str] = Field(
        # RunPod was observed to fail volume creation in US-MO-1 (500).
        default=["US-MO-1"], description="Datacenters never used, even when listed in `data_centers`.")
    minutes_per_data_center: int = Field(default=60, ge=5, le=1440, description="Time budget of each datacenter's "
                                         "preload, queueing included.")
    queue_minutes: int = Field(default=10, ge=1, le=240, description="A datacenter whose worker has not started "
                               "after this long is reported as no capacity.")
    hub_token_secret: str | None = Field(
        default=None, max_length=100, pattern=BLOCK_NAME_PATTERN,
        description="Name of a Prefect Secret block holding the Hugging Face token that reads the models (a private "
        "or gated one needs it) and reaches the preload workers. Unset: the HF_TOKEN of the process running the flow "
        "(else its `hf-token` Secret block), which a server with LORAFLOW_REQUIRE_RUN_TOKEN=1 refuses.")


class SweepPlan(BaseModel):
    """Which datacenters to warm, on what and into which volume, and those left out with why."""

    targets: list[SweepTarget] = Field(description="The datacenters to warm, in the order they were chosen.")
    skipped: list[DataCenterOutcome] = Field(description="Datacenters reported without renting anything.")
    chosen_by: str = Field(description="Where the datacenters came from: named in the spec, or training history.")
    storage_usd_per_month: float = Field(description="This control plane's volumes per month after the sweep, as "
                                         "planned (documented prices).")
    nothing_to_do: str | None = Field(default=None, description="Why the sweep warms nothing, and how to change that.")


def plan_sweep(spec: PreloadSpec, data_centers: list[CatalogDataCenter], offers: list[GpuOffer],
               cpu_types: list[CatalogCpuType], *, recent: list[str], volumes: list[NetworkVolume], volume_gb: int,
               recorded: dict[str, str]) -> SweepPlan:
    """Pick the datacenters, each one's worker and volume, within the storage budget. Pure.

    `recent`: where this control plane's training ran, most recent first; `volumes`: this control plane's
    volumes; `volume_gb`: what the models need; `recorded`: datacenter → the volume its weight-cache record
    names. The budget counts every volume of this control plane: a datacenter's volume after the sweep in
    place of what it has now, the others as they are (the volumes flow's retention deletes them).
    """
    catalog = {dc.id: dc for dc in data_centers}
    if spec.data_centers is not None:
        wanted, chosen_by = [dc for dc in spec.data_centers if dc not in spec.deny_data_centers], "named in the spec"
    else:
        usable = [dc for dc in recent if dc not in spec.deny_data_centers and dc in catalog
                  and catalog[dc].supports_network_volumes]
        wanted = usable[:spec.max_default_data_centers]
        chosen_by = (f"where this control plane's training ran in the last {spec.history_days:g} days (at most "
                     f"{spec.max_default_data_centers})")
    ours: dict[str, list[NetworkVolume]] = {}
    for volume in volumes:
        ours.setdefault(volume.data_center, []).append(volume)
    total = sum(documented_usd_per_month(v.size, v.type) for v in volumes)
    if not wanted:
        return SweepPlan(targets=[], skipped=[], chosen_by=chosen_by, storage_usd_per_month=round(total, 2),
                         nothing_to_do=_nothing_to_do(spec, recent))
    targets: list[SweepTarget] = []
    skipped: list[DataCenterOutcome] = []
    for dc in wanted:
        where = catalog.get(dc)
        if where is None or not where.supports_network_volumes:
            capable = sorted(d.id for d in data_centers if d.supports_network_volumes)
            skipped.append(DataCenterOutcome(data_center=dc, status="error", error=f"{dc} has no network volumes "
                                             f"(volume-capable: {', '.join(capable) or 'none'})"))
            continue
        if STORAGE_TYPE not in where.network_volume_types:
            hp = documented_usd_per_month(volume_gb, "HIGH_PERFORMANCE")
            skipped.append(DataCenterOutcome(data_center=dc, status="skipped", error=(
                f"offers only {', '.join(where.network_volume_types)} storage (a {volume_gb} GB volume: ${hp:.2f}"
                f"/month); loraflow's volumes are {STORAGE_TYPE}")))
            continue
        compute = choose_compute(where, cpu_types, offers, cpu=spec.cpu)
        if compute is None:
            skipped.append(DataCenterOutcome(data_center=dc, status="no_capacity", error="RunPod's catalog shows no "
                                             "stock there of a CPU flavor or of the GPU" if spec.cpu else
                                             "RunPod's catalog shows no stock of the GPU there"))
            continue
        volume = plan_volume(ours.get(dc, []), volume_gb, recorded.get(dc))
        cost = documented_usd_per_month(volume.size_gb, volume.volume_type)
        now_here = sum(documented_usd_per_month(v.size, v.type) for v in ours.get(dc, []))
        if total - now_here + cost > spec.max_storage_usd_per_month + 1e-9:
            skipped.append(DataCenterOutcome(data_center=dc, status="skipped", compute=compute.describe(), error=(
                f"over the storage budget: a {volume.size_gb} GB volume here (${cost:.2f}/month) would bring this "
                f"control plane's volumes to ${total - now_here + cost:.2f}/month, over max_storage_usd_per_month "
                f"${spec.max_storage_usd_per_month:.2f}")))
            continue
        total += cost - now_here
        targets.append(SweepTarget(data_center=dc, compute=compute, volume=volume, usd_per_month=cost))
    return SweepPlan(targets=targets, skipped=skipped, chosen_by=chosen_by, storage_usd_per_month=round(total, 2))


def check_preload_rules(spec: PreloadSpec, settings: Settings) -> None:
    """This server's rules for a sweep, as for a run (`tasks/preflight/server_rules.py`): its token block none of the
    server's own, and one named where the server runs nothing on its own token (`LORAFLOW_REQUIRE_RUN_TOKEN=1`).
    `ServerRuleError` naming the field and the fix, before anything is read or rented."""
    if problems := operator_rule_problems([], hub_token_secret=spec.hub_token_secret, settings=settings):
        raise ServerRuleError("the preload sweep is refused by this server's rules, before anything was rented: "
                              + "; ".join(problems))


def sweep_cost_ceiling(plan: SweepPlan, minutes_per_data_center: int) -> float:
    """The most the sweep's workers can be billed: each datacenter's worker at its price for the whole of
    `minutes_per_data_center` (each stops at its deadline, as a training worker does). Storage is the volumes'
    budget (`max_storage_usd_per_month`), not this."""
    return round(sum(t.compute.usd_per_hour for t in plan.targets) * minutes_per_data_center / 60, 2)


def check_sweep_cap(plan: SweepPlan, spec: PreloadSpec, cap_usd: float | None) -> None:
    """Refuse, before anything is rented, a sweep whose cost ceiling (`sweep_cost_ceiling`) passes the operator's
    cap on a run (`LORAFLOW_MAX_RUN_USD`), as a run's is refused."""
    workers = ", ".join(f"{t.data_center} on {t.compute.describe()} at ${t.compute.usd_per_hour:.2f}/hr"
                        for t in plan.targets)
    check_cost_cap(sweep_cost_ceiling(plan, spec.minutes_per_data_center), cap_usd,
                   f"the preload sweep ({workers}; minutes_per_data_center {spec.minutes_per_data_center} each)",
                   fix="lower minutes_per_data_center, name fewer data_centers, or leave cpu true (a download needs "
                   "no GPU)")


def _nothing_to_do(spec: PreloadSpec, recent: list[str]) -> str:
    if spec.data_centers is not None:
        return "every datacenter in data_centers is in deny_data_centers: name others"
    seen = f" (it ran only in {', '.join(recent)}, which have no network volumes or are denied)" if recent else ""
    return (f"no datacenters named, and no training run of this control plane was placed in a datacenter with "
            f"network volumes in the last {spec.history_days:g} days{seen}: name the datacenters to warm in the "
            "spec's data_centers (for the nightly deployment, in prefect.yaml), or run a training first")


@task(name="size-models", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=[5, 20],
      retry_condition_fn=lambda task, run, state: not isinstance(state.data, ValueError))
def size_models(models: list[ModelSource], hub_token_secret: str | None = None) -> list[int]:
    """Bytes of the files a preload keeps of each model, read with the sweep's token (`hub_token_secret`'s block,
    `Settings.hub_token`); ValueError naming a model the Hub does not have, or a token block not the sweep's to use."""
    settings = Settings().with_hub_token(hub_token_secret)
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
def read_catalog(gpu: str | None, cpu: bool) -> tuple[list[CatalogDataCenter], list[GpuOffer], list[CatalogCpuType]]:
    """The datacenters (volume tiers, GPU and CPU stock), the GPU offers, and the CPU flavors; no CPU flavors
    (every preload on a GPU) when RunPod's CPU catalog cannot be read."""
    classes = [resolve_gpu(gpu)] if gpu else list(GPU_CLASSES.values())
    with make_client() as client:
        data_centers, offers = read_data_centers(client, cpus=cpu), gpu_offers(client, classes)
        cpu_types: list[CatalogCpuType] = []
        if cpu:
            try:
                cpu_types = read_cpu_types(client)
            except (RunpodError, ValueError) as e:
                get_run_logger().warning("RunPod's CPU catalog could not be read (%s: %s): every preload runs on a "
                                         "GPU", type(e).__name__, str(e)[:300])
    return data_centers, offers, cpu_types


@task(name="read-volumes", cache_policy=NO_CACHE, retries=3, retry_delay_seconds=[2, 10, 30])
def read_namespace_volumes(namespace: str) -> list[NetworkVolume]:
    """This control plane's cache volumes (named `loraflow-cache-<tag>-<datacenter>`), every datacenter."""
    with make_client() as client:
        return [v for v in client.list_network_volumes() if v.name == volume_name(v.data_center, namespace)]


def sweep_table(outcomes: list[DataCenterOutcome], removed: dict[str, list[str]], plan: SweepPlan,
                storage_after: list[NetworkVolume] | None, budget: float) -> list[dict]:
    """The sweep's table: a row per datacenter, then the storage total."""
    rows = [{"datacenter": o.data_center, "status": o.status, "compute": o.compute or "",
             "volume": o.volume_id or "", "volume_gb": o.volume_gb or "",
             "storage $/month": f"{o.usd_per_month:.2f}" if o.usd_per_month is not None else "",
             "downloaded": ", ".join(m.id for m in o.models if m.status == "downloaded"),
             "already cached": ", ".join(m.id for m in o.models if m.status == "cached"),
             "removed": ", ".join(removed.get(o.data_center, [])),
             "failed": ", ".join(m.id for m in o.models if m.status == "failed"),
             "MB downloaded": round(o.bytes_downloaded / 1e6, 1), "seconds": round(o.seconds), "teardown": o.teardown,
             "note": "; ".join(filter(None, [o.error, *o.notes]))}
            for o in outcomes]
    swept = sum(o.usd_per_month or 0.0 for o in outcomes)
    if storage_after is None:
        total, others = plan.storage_usd_per_month, "its other volumes (as planned: the volumes could not be listed again)"
    else:
        total = sum(documented_usd_per_month(v.size, v.type) for v in storage_after)
        swept_ids = {o.volume_id for o in outcomes if o.volume_id}
        rest = [v for v in storage_after if v.id not in swept_ids]
        others = (f"{len(rest)} other volume(s) of this control plane ${total - swept:.2f}, kept until the volumes "
                  "flow's retention" if rest else "no other volume of this control plane")
    note = (f"this sweep's volumes ${swept:.2f} + {others}; budget max_storage_usd_per_month ${budget:.2f}; "
            f"datacenters {plan.chosen_by}" + (f". {plan.nothing_to_do}" if plan.nothing_to_do else ""))
    blank = dict.fromkeys(rows[0] if rows else ["datacenter", "status", "compute", "volume", "volume_gb",
                                                "storage $/month", "downloaded", "already cached", "removed",
                                                "failed", "MB downloaded", "seconds", "teardown", "note"], "")
    return [*rows, blank | {"datacenter": "total", "storage $/month": f"{total:.2f}", "note": note}]


@flow(name="preload", log_prints=True, on_crashed=[delete_run_endpoints_hook],
      on_cancellation=[delete_run_endpoints_hook], on_failure=[delete_run_endpoints_hook])
def preload(spec: PreloadSpec) -> list[DataCenterOutcome] | State:
    """Warm `spec.models` in a network volume in each chosen datacenter, concurrently, within the storage budget.

    1. Check this server's rules (the token) and the image's contract; size the models; read the catalog (volume
       tiers, GPU and CPU stock), this control plane's volumes and records, and (with no datacenters named) where
       its training ran lately.
    2. Plan: datacenters, each one's worker (CPU first) and volume (used, grown or replaced), within
       `max_storage_usd_per_month`; the workers' cost ceiling within the operator's `LORAFLOW_MAX_RUN_USD`.
    3. Preload each datacenter, one endpoint slot each, the endpoint deleted as a training attempt's is.
    4. Record what is warm where (models no longer swept forgotten); delete the volumes replaced, once
       nothing attaches them.
    5. Publish the sweep's table (artifact `preload-sweep`) with each volume's storage $/month and the total.
    """
    logger = get_run_logger()
    run_id = str(flow_run.id)
    settings = Settings()
    check_preload_rules(spec, settings)
    namespace = settings.control_plane_namespace()
    # Refused before anything is created when unset, or when the image would refuse this contract's jobs.
    check_image_contract(settings.worker_image())
    sizes = size_models(spec.models, spec.hub_token_secret)
    volume_gb = volume_size_gb(sizes)
    data_centers, offers, cpu_types = read_catalog(spec.gpu, spec.cpu)
    volumes = read_namespace_volumes(namespace)
    recent = recent_training_data_centers(spec.history_days) if spec.data_centers is None else []
    records = {dc: read_cache(dc, logger) for dc in {v.data_center for v in volumes} | set(spec.data_centers or recent)}
    plan = plan_sweep(spec, data_centers, offers, cpu_types, recent=recent, volumes=volumes, volume_gb=volume_gb,
                      recorded={dc: r.volume_id for dc, r in records.items() if r is not None})
    if plan.nothing_to_do:
        logger.warning("Nothing to preload: %s", plan.nothing_to_do)
    check_sweep_cap(plan, spec, settings.loraflow_max_run_usd)
    logger.info("Preloading %s (%.1f GB, volumes of %d GB) in %s (datacenters %s); storage after the sweep $%.2f/month "
                "of $%.2f", ", ".join(m.id for m in spec.models), sum(sizes) / 1e9, volume_gb,
                ", ".join(f"{t.data_center} on {t.compute.describe()} ({t.volume.action} volume)" for t in plan.targets)
                or "nowhere", plan.chosen_by, plan.storage_usd_per_month, spec.max_storage_usd_per_month)
    outcomes = list(plan.skipped)
    removed: dict[str, list[str]] = {}
    if plan.targets:
        ensure_endpoint_limit()
        env = prepare_worker_env(spec.hub_token_secret)
        deadline = time.time() + spec.minutes_per_data_center * 60
        futures = [preload_data_center.submit(target, spec.models, run_id, namespace, env, deadline,
                                              spec.queue_minutes * 60) for target in plan.targets]
        ran = [f.result() for f in futures]
        swept = {m.id for m in spec.models}
        retire: dict[str, list[NetworkVolume]] = {}
        for target, outcome in zip(plan.targets, ran, strict=True):
            if outcome.volume_id and outcome.status in ("ok", "partial"):
                previous = records.get(outcome.data_center)
                if previous is not None and previous.volume_id == outcome.volume_id:
                    removed[outcome.data_center] = sorted(set(previous.models) - swept)
                # A fresh record: the volume holds this sweep's models only (the worker removed the others).
                warm = {m.id: (m.revision, m.size_bytes) for m in outcome.models if m.status != "failed" and m.revision}
                write_cache(record_preload(None, outcome.data_center, outcome.volume_id,
                                           outcome.volume_gb or volume_gb, warm))
                retire[outcome.data_center] = target.volume.retire
        retired = retire_volumes([v for vs in retire.values() for v in vs])
        for outcome in ran:
            notes = [retired[v.id] for v in retire.get(outcome.data_center, []) if v.id in retired]
            outcomes.append(outcome.model_copy(update={"notes": [*outcome.notes, *notes]}) if notes else outcome)
    storage_after = read_namespace_volumes(namespace, return_state=True)
    create_table_artifact(table=sweep_table(outcomes, removed, plan,
                                            storage_after.result() if storage_after.is_completed() else None,
                                            spec.max_storage_usd_per_month),
                          key="preload-sweep", description="Weight cache per datacenter, and its storage cost")
    not_ok = [o for o in outcomes if o.status not in ("ok", "skipped")]
    if not_ok:
        return Failed(message="; ".join(f"{o.data_center}: {o.status} ({o.error})" for o in not_ok))
    if not plan.targets:
        return Completed(message=plan.nothing_to_do or "every datacenter was skipped: see the sweep's table")
    return outcomes


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m flows.preload '{\"models\": [{\"id\": \"org/model\"}], \"data_centers\": [\"EU-RO-1\"]}'")
    try:
        preload_spec = PreloadSpec.model_validate(json.loads(sys.argv[1]))
    except (ValueError, ValidationError) as e:
        sys.exit(f"bad preload spec: {e}")
    if problem := startup_problem(worker_image=True):
        sys.exit(problem)
    final = preload(preload_spec, return_state=True)
    print(f"flow run {final.state_details.flow_run_id}: {final.name}", flush=True)
    sys.exit(0 if final.is_completed() else 1)
