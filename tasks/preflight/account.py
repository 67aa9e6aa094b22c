"""The preflight's checks of the RunPod account: the key's permissions, the worker quota against the
`runpod-endpoints` limit, the worker image, the run's GPUs and cost against the catalog, the CPU worker its merge
would rent, datacenters with volumes."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import httpx
from prefect import get_client
from prefect.exceptions import ObjectNotFound
from pydantic import BaseModel, Field

from huggingface_hub.errors import HfHubHTTPError
from loraflow_worker.contract import ModelSource
from loraflow_worker.memory.model_shape import shape_from_config

from tasks.jobs.merge import MergeRefused, choose_merge_compute, merge_disk_gb
from tasks.lifecycle.quota import (
    ENDPOINT_LIMIT,
    WORKER_QUOTA_ENV,
    configured_worker_quota,
    default_endpoint_slots,
    read_named_quota,
)
from tasks.placement.cost import check_budget, check_cost_cap, cost_ceiling
from tasks.placement.gpu_fit import CudaFit, cuda_fits
from tasks.placement.image_contract import ImageContractError, check_image_contract
from tasks.placement.plan import read_model_config
from tasks.preflight.report import Check
from tasks.runpod import errors
from tasks.runpod.catalog import GPU_CLASSES, GpuClass, cuda_floor
from tasks.runpod.client import API_URL, RunpodClient
from tasks.runpod.endpoints import parse_endpoint_name
from tasks.runpod.live_catalog import (
    CatalogCpuType,
    CatalogDataCenter,
    GpuOffer,
    gpu_offers,
    read_cpu_types,
    read_data_centers,
    static_offer,
)
from tasks.runpod.models import Endpoint, NetworkVolume
from tasks.runpod.volumes import VOLUME_PREFIX, volume_name
from tasks.settings import NAMESPACE_VARIABLE, Settings

QUOTA_TIERS = ("5 on a new account; 10, 20, 30, 40, 50, 60 at balances of $100, $200, $300, $500, $700, $900+")
"""RunPod's worker quota by balance (../shared/runpod-api/README.md, "Account facts"): API v2 does not expose it."""

KEY_SETTINGS_FIX = ("create a RunPod API key (console → Settings → API Keys) and set RUNPOD_API_KEY where the flow "
                    "runs, or save it in a Prefect Secret block named '{block}' (RUNPOD_API_KEY_BLOCK changes the name)")


# --- 1. The RunPod key's permissions -------------------------------------------------------------------


class Permission(BaseModel):
    """One kind of RunPod resource loraflow needs the key to reach."""

    name: str = Field(description="The check's name.")
    what: str = Field(description="What the list call lists, e.g. `endpoints`.")
    needs: str = Field(description="The access the key needs, and why loraflow needs it.")


PERMISSIONS = {
    "endpoints": Permission(
        name="runpod key: endpoints", what="endpoints",
        needs="read/write on Serverless (each run attempt creates, watches and deletes one endpoint)"),
    "secrets": Permission(
        name="runpod key: secrets", what="account secrets",
        needs="read/write on secrets (each run keeps the Hub token in a RunPod account secret that its workers read)"),
    "network volumes": Permission(
        name="runpod key: network volumes", what="network volumes",
        needs="read/write on network volumes (the preload flow creates and grows weight-cache volumes; runs attach "
              "them)"),
}


def open_runpod(settings: Settings, transport: httpx.BaseTransport | None = None,
                ) -> tuple[RunpodClient | None, str | None]:
    """A client with the key where the flow runs, or None and why there is none. `transport`: the one a recording
    reads through (`tasks.preflight.recording`); None: the client's own."""
    try:
        key = settings.api_key()
        return RunpodClient(key, api_url=settings.runpod_api_url, job_url=settings.runpod_job_url,
                            transport=transport), None
    except (RuntimeError, errors.AuthError) as e:  # no key in the environment nor in the Secret block; an empty one
        return None, str(e)


def check_key_can_list(permission: Permission, list_them: Callable[[], Sequence[object]] | None,
                       no_key: str | None, key_block: str) -> Check:
    """Whether the key may list these resources: read access, checked; write access is not (that would change
    the account). `list_them` None: there is no key (`no_key` says why)."""
    name = permission.name
    if list_them is None:
        return Check(name=name, status="FAIL", found=no_key or "no RunPod API key",
                     fix=KEY_SETTINGS_FIX.format(block=key_block))
    not_write = "write access is not checked: checking it would change the account"
    try:
        listed = list_them()
    except errors.AuthError as e:
        # 401: RunPod does not know the key; 403: the key is valid but lacks this permission.
        key = "a valid key (RunPod does not know this one)" if e.status == 401 else "a key"
        return Check(name=name, status="FAIL", found=str(e),
                     fix=f"use {key} with {permission.needs}, set as RUNPOD_API_KEY or in the Secret block "
                     f"'{key_block}'; read access was checked here, {not_write}")
    except errors.TRANSIENT_ERRORS as e:
        return Check(name=name, status="warn", found=f"RunPod could not list {permission.what} now: {e}",
                     fix="run the preflight again in a minute; RunPod's status page says whether it is down")
    except errors.RunpodError as e:
        return Check(name=name, status="FAIL", found=str(e),
                     fix=f"check that RUNPOD_API_URL is RunPod's API v2 ({API_URL}) or localpod's")
    return Check(name=name, status="ok", found=f"may list {permission.what} ({len(listed)}); {not_write}")


# --- 2. Worker quota vs the runpod-endpoints limit -----------------------------------------------------


def read_endpoint_limit(name: str = ENDPOINT_LIMIT) -> int | None:
    """The limit's slots, or None when it does not exist yet. Reads only (`tasks.lifecycle.quota.ensure_endpoint_limit`
    creates it, at a run's start)."""
    with get_client(sync_client=True) as client:
        try:
            return client.read_global_concurrency_limit_by_name(name).limit
        except ObjectNotFound:
            return None


def read_namespace(settings: Settings) -> str | None:
    """This control plane's endpoint-name tag, or None when it has none yet (its first run generates it). Unlike
    `Settings.control_plane_namespace`, never creates the Variable."""
    if settings.loraflow_namespace is not None:
        return settings.loraflow_namespace
    with get_client(sync_client=True) as client:
        variable = client.read_variable_by_name(NAMESPACE_VARIABLE)
    return variable.value if variable is not None and isinstance(variable.value, str) else None


def judge_worker_quota(endpoints: Sequence[Endpoint], limit: int | None, namespace: str | None,
                       worker_quota: int | None, quota_source: str | None = None) -> Check:
    """The limit plus the `workers.max` of the endpoints outside it against the account's quota (`quota_source`:
    where that figure came from, when not from the caller's flag).

    This control plane's endpoints each hold a slot of the limit, so they are inside it; every other endpoint
    (another control plane's, a person's, a server's) counts against RunPod's quota and not against the limit.
    """
    name = "worker quota"
    ours = [e for e in endpoints if (parsed := parse_endpoint_name(e.name)) and parsed.namespace == namespace]
    others = [e for e in endpoints if e not in ours]
    others_max = sum(e.workers.max for e in others)
    created = default_endpoint_slots()
    slots = limit if limit is not None else created
    limit_text = (f"limit {ENDPOINT_LIMIT} = {limit}" if limit is not None else
                  f"limit {ENDPOINT_LIMIT} missing (the first run creates it with {created} slots, "
                  f"{WORKER_QUOTA_ENV} or a new account's quota)")
    other_names = ", ".join(e.name for e in others[:5]) + (", ..." if len(others) > 5 else "")
    found = (f"{limit_text}; this control plane's endpoints: {len(ours)}; other endpoints on the account: "
             f"{len(others)} with workers.max {others_max} in all" + (f" ({other_names})" if others else ""))
    if worker_quota is None:
        return Check(name=name, status="warn", found=f"{found}; the account's worker quota could not be read (RunPod's "
                     "API does not expose it)",
                     fix=f"read the quota in RunPod's console (it is {QUOTA_TIERS}) and run the preflight with "
                     f"--worker-quota N (the deployment: its worker_quota parameter), or set {WORKER_QUOTA_ENV}=N "
                     "where runs start (runs then create the limit at N)")
    if quota_source:
        found = f"{found}; worker quota {worker_quota} from {quota_source}"
    needed = slots + others_max
    fitting = worker_quota - others_max
    verb = "update" if limit is not None else "create"
    if needed <= worker_quota:
        unused = (f"; {fitting - slots} workers of the quota stay unused: prefect gcl {verb} {ENDPOINT_LIMIT} "
                  f"--limit {fitting} uses them" if slots < fitting else "")
        return Check(name=name, status="ok", found=f"{found}; {slots} + {others_max} = {needed} <= worker quota "
                     f"{worker_quota}{unused}")
    if fitting >= 1:
        fix = (f"prefect gcl {verb} {ENDPOINT_LIMIT} --limit {fitting} (the quota {worker_quota} less the "
               f"{others_max} workers other endpoints hold), or raise the account's balance ({QUOTA_TIERS})")
    else:
        fix = (f"the other endpoints alone fill the quota {worker_quota}: delete the ones nobody uses (every "
               f"endpoint's workers.max counts, scaled to zero or not) or raise the account's balance ({QUOTA_TIERS}), "
               f"then size the limit with prefect gcl {verb} {ENDPOINT_LIMIT} --limit M")
    return Check(name=name, status="FAIL", found=f"{found}; {slots} + {others_max} = {needed} > worker quota "
                 f"{worker_quota}: runs would hold slots while RunPod refuses their endpoints", fix=fix)


def check_worker_quota(client: RunpodClient | None, settings: Settings, worker_quota: int | None) -> Check:
    """`judge_worker_quota` on the account's endpoints, the limit and the namespace as they are now; the quota
    given, else `LORAFLOW_WORKER_QUOTA`'s, else the one RunPod named in the latest refusal a run met."""
    source = None
    if worker_quota is None and (worker_quota := configured_worker_quota()) is not None:
        source = WORKER_QUOTA_ENV
    if worker_quota is None and (named := read_named_quota()) is not None:
        worker_quota, at = named
        source = f"RunPod's quota refusal of {at}" if at else "a quota refusal of RunPod's"
    if client is None:
        return Check(name="worker quota", status="warn", found="not checked: no RunPod key to list the account's "
                     "endpoints with", fix="see runpod key: endpoints")
    try:
        endpoints = client.list_endpoints()
    except errors.RunpodError as e:
        return Check(name="worker quota", status="warn", found=f"not checked: the account's endpoints could not be "
                     f"listed ({e})", fix="see runpod key: endpoints")
    return judge_worker_quota(endpoints, read_endpoint_limit(), read_namespace(settings), worker_quota, source)


# --- 3. The worker image -------------------------------------------------------------------------------


def check_worker_image(settings: Settings) -> Check:
    """The image is set, and its tag names this control plane's job contract."""
    name = "worker image"
    try:
        image = settings.worker_image()
    except RuntimeError as e:
        return Check(name=name, status="FAIL", found="LORAFLOW_WORKER_IMAGE is not set", fix=str(e))
    try:
        version = check_image_contract(image)
    except ImageContractError as e:
        return Check(name=name, status="FAIL", found=str(e),
                     fix="`make image`, push it, and set LORAFLOW_WORKER_IMAGE to the pushed tag")
    return Check(name=name, status="ok", found=f"{image} speaks job contract {version}, this control plane's (the "
                 "tag is what is checked: RunPod pulls the image, this machine does not)")


# --- 4. The run's GPUs against the catalog -------------------------------------------------------------


def read_offers(client: RunpodClient | None, gpus: Sequence[GpuClass], floors: Sequence[str]) -> list[GpuOffer]:
    """Each GPU's offer, its stock counted on hosts that meet its floor; the static table when there is no key
    (every offer then says so)."""
    if client is None:
        return [static_offer(g, "no RunPod key to read the catalog with") for g in gpus]
    return gpu_offers(client, gpus, floors)


def judge_gpus(gpus: Sequence[GpuClass], offers: Sequence[GpuOffer], floors: Sequence[str],
               alternatives: Callable[[], list[CudaFit]] = list) -> list[Check]:
    """Per GPU of the run, in order: its card in its pool as RunPod's catalog lists them, its hosts' CUDA against its
    floor, its stock on hosts that meet it, and where its price comes from. A GPU whose card is not in its pool, or
    below its floor, is a warn when another GPU of the run can be rented (the run skips it), a FAIL when none can
    (the run is refused). `alternatives()`: every GPU class's fit, for the fix."""
    by_gpu = {offer.gpu: offer for offer in offers}
    fits = cuda_fits(gpus, by_gpu, floors)
    any_meets = any(fit.meets for gpu, fit in zip(gpus, fits, strict=True) if by_gpu[gpu.name].not_in_pool is None)
    checks: list[Check] = []
    for gpu, fit in zip(gpus, fits, strict=True):
        offer = by_gpu[gpu.name]
        prefix = f"gpu {gpu.name}"
        if offer.not_in_pool is not None:
            checks.append(Check(name=f"{prefix}: pool", status="warn" if any_meets else "FAIL",
                                found=offer.not_in_pool + (": a run skips this GPU" if any_meets else
                                                           ": no GPU of compute.gpu can be rented"),
                                fix=f"drop {gpu.name} from compute.gpu, or bring loraflow's class table "
                                "(tasks/runpod/catalog.py) up to date with RunPod's catalog"))
            continue
        if offer.cards_from == "catalog":
            excluding = f", excluding {', '.join(offer.exclude)}" if offer.exclude else " (nothing else there)"
            checks.append(Check(name=f"{prefix}: pool", status="ok",
                                found=f"{gpu.card} in pool {gpu.pool}{excluding}, per RunPod's catalog"))
        if not fit.known:
            checks.append(Check(name=f"{prefix}: cuda", status="warn", found=fit.describe(),
                                fix="see the price line: once RunPod's catalog answers, the hosts' CUDA is checked"))
        elif fit.meets:
            checks.append(Check(name=f"{prefix}: cuda", status="ok", found=fit.describe()))
        elif any_meets:
            checks.append(Check(name=f"{prefix}: cuda", status="warn", found=f"{fit.describe()}: a run skips this GPU",
                                fix=f"drop {gpu.name} from compute.gpu, or run an image built for its hosts' CUDA and "
                                "set LORAFLOW_IMAGE_MIN_CUDA to that image's floor"))
        else:
            others = [a.gpu for a in alternatives() if a.known and a.meets and a.gpu not in {g.name for g in gpus}]
            instead = f" ({', '.join(others)} per RunPod's catalog now)" if others else ""
            checks.append(Check(name=f"{prefix}: cuda", status="FAIL",
                                found=f"{fit.describe()}, and no GPU of compute.gpu has hosts that run the worker "
                                "image: a run is refused before renting",
                                fix=f"add a GPU whose hosts do to compute.gpu{instead}, or run an image built for the "
                                "hosts' CUDA and set LORAFLOW_IMAGE_MIN_CUDA to its floor"))
        if fit.known and fit.meets:
            stock = offer.in_stock_data_centers()
            if stock:
                checks.append(Check(name=f"{prefix}: stock", status="ok",
                                    found=f"in stock on hosts with CUDA >= {fit.floor} in {', '.join(stock)}"))
            else:
                checks.append(Check(name=f"{prefix}: stock", status="warn",
                                    found=f"no stock now on hosts with CUDA >= {fit.floor} in any datacenter",
                                    fix="stock changes within minutes; a run waits attempts.queue_minutes for it, then "
                                    "tries the next GPU of compute.gpu: keep another GPU in the list"))
        if offer.source == "catalog":
            checks.append(Check(name=f"{prefix}: price", status="ok",
                                found=f"${offer.usd_per_hour:.2f}/GPU-hour from RunPod's catalog"))
        else:
            checks.append(Check(name=f"{prefix}: price", status="warn",
                                found=f"${offer.usd_per_hour:.2f}/GPU-hour, the fallback list price, not the live "
                                f"catalog: {offer.fallback_reason}",
                                fix="budgets and cost ceilings use the fallback list price until RunPod's catalog "
                                "(GET /v2/catalog/gpus) answers: check the key and RUNPOD_API_URL"))
    return checks


def catalog_alternatives(client: RunpodClient | None, image_min_cuda: str) -> list[CudaFit]:
    """Every GPU class loraflow knows against its floor: the GPUs a CUDA FAIL suggests."""
    gpus = list(GPU_CLASSES.values())
    floors = [cuda_floor(g, image_min_cuda) for g in gpus]
    return cuda_fits(gpus, {o.gpu: o for o in read_offers(client, gpus, floors)}, floors)


def judge_cost(gpus: Sequence[GpuClass], offers: Sequence[GpuOffer], floors: Sequence[str], gpu_count: int,
               deadline_minutes: int, budget_usd: float | None, cap_usd: float | None = None) -> Check:
    """The run's cost ceiling over the GPUs it would rent (those whose hosts meet their floor, else all) against
    its budget and the operator's cap (`LORAFLOW_MAX_RUN_USD`), as the train flow refuses it."""
    fits = cuda_fits(gpus, {o.gpu: o for o in offers}, floors)
    kept = [o for o, fit in zip(offers, fits, strict=True) if fit.meets] or list(offers)
    ceiling = cost_ceiling(kept, gpu_count, deadline_minutes)
    try:
        check_cost_cap(ceiling.usd, cap_usd)
    except ValueError as e:
        return Check(name="cost ceiling", status="FAIL", found=f"up to {ceiling.describe()}: {e}",
                     fix="lower deadline_minutes or drop the dearest GPU from compute.gpu")
    try:
        check_budget(ceiling.usd, budget_usd, ceiling.price_source)
    except ValueError:
        return Check(name="cost ceiling", status="FAIL", found=f"up to {ceiling.describe()}, above budget_usd "
                     f"${budget_usd:.2f} (the dearest GPU × GPUs × deadline_minutes): a run is refused before renting",
                     fix="lower deadline_minutes, drop the dearest GPU from compute.gpu, or raise budget_usd")
    budget = f"within budget_usd ${budget_usd:.2f}" if budget_usd is not None else "no budget_usd set"
    return Check(name="cost ceiling", status="ok", found=f"at most {ceiling.describe()}; {budget}")


def judge_merge_worker(parameters: int, cpu_types: Sequence[CatalogCpuType], model: str,
                       merged_model_id: str) -> Check:
    """The serverless CPU worker the run's merge would rent (`choose_merge_compute`, stock aside, as the run's own
    check before renting), or the FAIL that refuses the run."""
    name = "merge worker"
    try:
        compute = choose_merge_compute(parameters, list(cpu_types), None, model=model)
    except MergeRefused as e:
        return Check(name=name, status="FAIL", found=f"publish.merged_model_id: {e}",
                     fix="a run is refused before renting: merge the model elsewhere, or remove "
                     "publish.merged_model_id")
    return Check(name=name, status="ok", found=f"{compute.describe()} with {merge_disk_gb(parameters)} GB of container "
                 f"disk, renting once the run completes to merge {model} ({parameters / 1e9:.1f} B parameters, "
                 f"{compute.needed_ram_gb:g} GB of RAM needed) into {merged_model_id}")


def check_merge_worker(client: RunpodClient | None, model: ModelSource, merged_model_id: str,
                       settings: Settings) -> Check:
    """`judge_merge_worker` on the model's `config.json` and RunPod's CPU catalog; a warn when either cannot be read."""
    name = "merge worker"
    if client is None:
        return Check(name=name, status="warn", found="not checked: no RunPod key", fix="see runpod key: endpoints")
    try:
        parameters = shape_from_config(read_model_config(model, settings)).parameters
    except (OSError, ValueError, HfHubHTTPError) as e:
        return Check(name=name, status="warn", found=f"not checked: {model.id}'s config.json could not be read "
                     f"({type(e).__name__}: {e})", fix="see hub: model")
    try:
        cpu_types = read_cpu_types(client)
    except (errors.RunpodError, ValueError) as e:  # ValueError: a catalog document of another shape
        return Check(name=name, status="warn", found=f"RunPod's CPU catalog not read: {type(e).__name__}: {e}",
                     fix="the run checks it again before renting; see runpod key: endpoints")
    return judge_merge_worker(parameters, cpu_types, model.id, merged_model_id)


# --- 5. Datacenters with volumes -----------------------------------------------------------------------


def judge_data_centers(data_centers: Sequence[CatalogDataCenter], volumes: Sequence[NetworkVolume],
                       namespace: str | None) -> Check:
    """Which datacenters support network volumes, and which volumes of the account are loraflow's weight caches."""
    name = "datacenters with volumes"
    with_volumes = [dc.id for dc in data_centers if dc.supports_network_volumes]
    ours = [v for v in volumes if namespace is not None and v.name == volume_name(v.data_center, namespace)]
    other_caches = [v for v in volumes if v.name.startswith(VOLUME_PREFIX) and v not in ours]
    rest = len(volumes) - len(ours) - len(other_caches)
    caches = ", ".join(f"{v.data_center} ({v.size} GB)" for v in ours) or "none yet (the preload flow makes them)"
    found = (f"network volumes in {', '.join(with_volumes) or 'no datacenter'}; this control plane's weight caches: "
             f"{caches}; other control planes' caches: {len(other_caches)}; other volumes: {rest}")
    if not with_volumes:
        return Check(name=name, status="warn", found=found,
                     fix="no weight cache can be kept: every run downloads its model (a cold start); nothing to do")
    return Check(name=name, status="ok", found=found)


def check_data_centers(client: RunpodClient | None, settings: Settings) -> Check:
    if client is None:
        return Check(name="datacenters with volumes", status="warn", found="not checked: no RunPod key",
                     fix="see runpod key: endpoints")
    try:
        data_centers = read_data_centers(client)
        volumes = client.list_network_volumes()
    except (errors.RunpodError, ValueError) as e:  # ValueError: a catalog document of another shape
        return Check(name="datacenters with volumes", status="warn", found=f"not read: {type(e).__name__}: {e}",
                     fix="runs still place without it (cold); see runpod key: network volumes")
    return judge_data_centers(data_centers, volumes, read_namespace(settings))
