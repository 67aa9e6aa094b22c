"""RunPod's live catalog as the control plane reads it: the serverless price, CUDA versions and
per-datacenter stock of each of loraflow's GPU classes (`GET /v2/catalog/gpus`), the datacenters
(`GET /v2/catalog/datacenters`), the CPU flavors (`GET /v2/catalog/cpus`), and what RunPod billed an
endpoint (`GET /v2/billing/serverless`).

The catalog also says which cards each serverless pool holds: a class pins its card by excluding the other cards
the catalog lists in its pool (`GpuOffer.exclude`), and a class whose card the catalog does not list in its pool
cannot be rented now (`GpuOffer.not_in_pool`).

The GPU catalog is read at most once per `CATALOG_MAX_AGE_S` per process and API URL. Catalog and billing reads
are tried `READ_TRIES` times on a transient error (429, 5xx, no answer), honouring a 429's Retry-After, within
`READ_RETRY_BUDGET_S` of waits. When the catalog still cannot be read (or answers 404 from an API without it, or
a body of an unexpected shape), each figure falls back to the static table of `catalog.py` and says so: every
`GpuOffer` carries its `source`, and the reason for a fallback.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Literal, TypeVar

from pydantic import AliasGenerator, BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from tasks.runpod import errors
from tasks.runpod.catalog import (
    SERVERLESS_CPU_MAX_VCPUS,
    GpuClass,
    cpu_flavor_id,
    serverless_cpu_disk_gb_per_vcpu,
)
from tasks.runpod.client import RunpodClient

log = logging.getLogger("loraflow.catalog")

PriceSource = Literal["catalog", "static list price"]
PRICE_SOURCE_WORDS: dict[PriceSource, str] = {
    "catalog": "catalog",
    "static list price": "fallback list price, not the live catalog",
}
"""How a cost line names a price's source: a budget checked against the fallback table must say so plainly."""
CardsSource = Literal["catalog", "static table"]
AvailabilityLevel = Literal["NONE", "LOW", "MEDIUM", "HIGH"]

CATALOG_MAX_AGE_S = 300.0
"""How long one read of the GPU catalog serves a process: prices change rarely, stock within minutes."""

READ_TRIES = 3
"""Tries of one catalog or billing read before it counts as unreadable."""
READ_RETRY_BUDGET_S = 20.0
"""The most one read waits between its tries, all waits together (a Retry-After included)."""
READ_FIRST_BACKOFF_S = 1.0
"""The wait after a read's first transient error (without a Retry-After); it doubles after each."""

T = TypeVar("T")
_LEVELS: tuple[AvailabilityLevel, ...] = ("NONE", "LOW", "MEDIUM", "HIGH")
# What "cannot be read" means: any RunPod or transport error, and a body that is not the documented shape
# (pydantic's ValidationError and a JSON decode error are both ValueErrors).
_UNREADABLE = (errors.RunpodError, ValueError)


# --- RunPod's catalog and billing documents (read-only: unknown fields are ignored) ------------------


class _Response(BaseModel):
    model_config = ConfigDict(
        extra="ignore",
        alias_generator=AliasGenerator(serialization_alias=to_camel, validation_alias=to_camel),
        populate_by_name=True,
    )


class CatalogPrice(_Response):
    secure: float | None = Field(default=None, description="Secure-cloud pod price per GPU-hour, USD.")
    community: float | None = Field(default=None, description="Community-cloud pod price per GPU-hour, USD.")
    serverless: float | None = Field(
        default=None,
        description="Serverless list price per GPU-hour of the GPU's pool, USD; absent when the GPU is in no "
        "serverless pool open to the account. Negotiated discounts are not reflected.",
    )


class DataCenterAvailability(_Response):
    id: str = Field(description="Datacenter id, e.g. EU-RO-1.")
    name: str = Field(description="Datacenter name.")
    availability: AvailabilityLevel = Field(description="Stock of this GPU there for the product asked about.")


class CudaVersionAvailability(_Response):
    version: str = Field(description="CUDA version, `major.minor`.")
    available: bool = Field(description="Some machine on this version has free capacity now.")


class CatalogGpuType(_Response):
    """One `GpuType` of `GET /v2/catalog/gpus?include=AVAILABILITY&product=SERVERLESS`."""

    id: str = Field(description="GPU type id, e.g. `NVIDIA GeForce RTX 4090` (what `excludedTypes` names).")
    name: str = Field(description="Display name.")
    pool: str | None = Field(default=None, description="Serverless pool id; None when in no serverless pool.")
    memory: int = Field(description="VRAM in GB.")
    price: CatalogPrice = Field(description="List prices per GPU-hour.")
    availability: AvailabilityLevel | None = Field(default=None, description="Overall serverless stock.")
    data_centers: list[DataCenterAvailability] = Field(
        default_factory=list, description="Stock per datacenter offering it; absent (empty) when out everywhere."
    )
    cuda_versions: list[CudaVersionAvailability] = Field(
        default_factory=list, description="CUDA versions offered with this GPU; absent means none reported."
    )


class _GpuTypeList(_Response):
    gpus: list[CatalogGpuType]


class CatalogResourceAvailability(_Response):
    id: str = Field(description="GPU type id.")
    name: str = Field(description="Display name.")
    availability: AvailabilityLevel = Field(description="Stock of this GPU in the datacenter.")


class CatalogDataCenter(_Response):
    """One `DataCenter` of `GET /v2/catalog/datacenters?include=GPU_AVAILABILITY`."""

    id: str = Field(description="Datacenter id, e.g. EU-RO-1 (what `dataCenterIds` and volumes name).")
    name: str = Field(description="Display name.")
    region: str = Field(description="Continental region, e.g. EUROPE.")
    network_volume_types: list[str] = Field(
        default_factory=list, description="Network volume tiers it supports (STANDARD, HIGH_PERFORMANCE); empty: none."
    )
    gpu_availability: list[CatalogResourceAvailability] = Field(
        default_factory=list, description="Each GPU type it offers and its stock; empty when it offers none."
    )
    cpu_availability: list[CatalogResourceAvailability] = Field(
        default_factory=list, description="Each CPU flavor it offers and its stock (read with `cpus=True`); empty "
        "when it offers none, or when not asked for."
    )

    @property
    def supports_network_volumes(self) -> bool:
        return bool(self.network_volume_types)


class _DataCenterList(_Response):
    data_centers: list[CatalogDataCenter]


class CpuVcpuRange(_Response):
    min: int = Field(description="Fewest vCPUs a worker of the flavor may have.")
    max: int = Field(description="Most vCPUs a worker of the flavor may have.")


class CpuPrice(_Response):
    serverless_per_vcpu: float = Field(description="Serverless price per vCPU-hour, USD.")


class CatalogCpuType(_Response):
    """One `CpuType` of `GET /v2/catalog/cpus`: a CPU flavor, priced per vCPU, and what a serverless worker of it
    may be (`serverless_vcpus`)."""

    id: str = Field(description="Catalog id: the flavor (`cpu5c`) or its long form (`cpu3c-2-4`); `flavor` is the "
                    "one a CPU endpoint's `cpu[].id` takes.")
    name: str = Field(description="Display name.")
    vcpu: CpuVcpuRange
    ram_gb_per_vcpu: float = Field(description="GB of RAM per vCPU.")
    price: CpuPrice

    @property
    def flavor(self) -> str:
        """The id an endpoint's `cpu[].id` takes: `cpu3c` for `cpu3c-2-4`."""
        return cpu_flavor_id(self.id)

    @property
    def serverless_vcpu_max(self) -> int:
        """The most vCPUs of a serverless worker of the flavor: the catalog's `vcpu.max`, at most
        `SERVERLESS_CPU_MAX_VCPUS`."""
        return min(self.vcpu.max, SERVERLESS_CPU_MAX_VCPUS)

    @property
    def disk_gb_per_vcpu(self) -> int:
        """GB of container disk a serverless worker of the flavor may have per vCPU."""
        return serverless_cpu_disk_gb_per_vcpu(self.flavor)

    def serverless_vcpus(self, ram_gb: float, disk_gb: float = 0) -> int | None:
        """The fewest vCPUs of a serverless worker of the flavor with `ram_gb` of RAM and room for `disk_gb` of
        container disk: a power of two (RunPod's rule for `vcpuCount`), at least 2, within `vcpu.min` and
        `serverless_vcpu_max`; None when none is."""
        count = 2
        while count < self.vcpu.min or count * self.ram_gb_per_vcpu < ram_gb or count * self.disk_gb_per_vcpu < disk_gb:
            count *= 2
        return count if count <= self.serverless_vcpu_max else None


class _CpuTypeList(_Response):
    cpus: list[CatalogCpuType]


class ServerlessBillingRecord(_Response):
    """One record of `GET /v2/billing/serverless`: one endpoint in one time bucket."""

    start_time: datetime = Field(description="Start of the bucket.")
    end_time: datetime = Field(description="End of the bucket (exclusive).")
    serverless_id: str = Field(description="The endpoint billed.")
    total_amount: float = Field(description="USD billed for the endpoint in the bucket.")


class _ServerlessBilling(_Response):
    records: list[ServerlessBillingRecord]


# --- what loraflow makes of them ---------------------------------------------------------------------


class GpuOffer(BaseModel):
    """One GPU class as the control plane prices and places it now."""

    gpu: str = Field(description="loraflow's name for the GPU class, e.g. H100.")
    pool: str = Field(description="Its serverless pool id.")
    usd_per_hour: float = Field(description="Serverless price per GPU-hour, USD.")
    source: PriceSource = Field(
        description="catalog: RunPod's live catalog answered; static list price: it could not be read, or listed no "
        "serverless price for the pool, and loraflow's table of tasks/runpod/catalog.py stands in."
    )
    fallback_reason: str | None = Field(
        default=None, description="Why the static price stands in; None with the catalog's price."
    )
    cuda_versions: list[str] = Field(
        default_factory=list,
        description="CUDA versions RunPod offers with this class, lowest first; empty with the static price (unknown).",
    )
    data_centers: dict[str, AvailabilityLevel] = Field(
        default_factory=dict,
        description="Datacenter id → the class's serverless stock there (the best of its GPU types) on hosts that "
        "meet `cuda_floor`; empty with the static price (unknown).",
    )
    cuda_floor: str | None = Field(
        default=None, description="The CUDA floor the stock was read for (`minCudaVersion`); None: any host."
    )
    exclude: list[str] = Field(
        default_factory=list, description="The GPU types the class's endpoints exclude from its pool (`excludedTypes`) "
        "to pin its card: the other cards RunPod's catalog lists in the pool, or the static table's.")
    cards_from: CardsSource = Field(
        default="static table", description="Where the pool's cards, and so `exclude`, came from: RunPod's catalog, or "
        "loraflow's static table when the catalog could not be read.")
    not_in_pool: str | None = Field(
        default=None, description="Why the class cannot be rented now: RunPod's catalog does not list its card in its "
        "pool (both named). None: it can.")

    def pinned(self, gpu: GpuClass) -> GpuClass:
        """The class as its endpoints ask for it now: its pool less this offer's `exclude`."""
        return gpu.model_copy(update={"exclude": tuple(self.exclude)})

    def in_stock_data_centers(self) -> list[str]:
        """Datacenters with stock of this class, best stocked first."""
        ranked = sorted(self.data_centers.items(), key=lambda item: -_LEVELS.index(item[1]))
        return [dc for dc, level in ranked if level != "NONE"]


class LiveCatalog(BaseModel):
    """One read of RunPod's GPU catalog, or the record that it could not be read."""

    gpu_types: list[CatalogGpuType] | None = Field(description="The serverless GPU types; None when unreadable.")
    fallback_reason: str | None = Field(default=None, description="Why the catalog could not be read.")
    read_at: float = Field(description="`time.monotonic()` of the read.")
    min_cuda: str | None = Field(default=None, description="The `minCudaVersion` the read was scoped to; None: none.")

    def offer(self, gpu: GpuClass, stock: LiveCatalog | None = None) -> GpuOffer:
        """The class's price, CUDA versions and stock from the catalog; the static price where it has none. With
        `stock` (a read scoped to a CUDA floor), the per-datacenter stock comes from it: hosts below the floor
        cannot take the class's workers, so their stock is no stock."""
        if self.gpu_types is None:
            return static_offer(gpu, self.fallback_reason or "the catalog could not be read")
        in_pool = [t.id for t in self.gpu_types if t.pool == gpu.pool]
        if gpu.card not in in_pool:
            where = next((t.pool for t in self.gpu_types if t.id == gpu.card), None)
            elsewhere = (f"it lists the card in pool {where}" if where else
                         "it lists the card in no serverless pool" if any(t.id == gpu.card for t in self.gpu_types)
                         else "it does not list the card")
            reason = (f"GPU class {gpu.name}: RunPod's catalog does not list its card {gpu.card} in pool {gpu.pool} "
                      f"({elsewhere}; the pool holds {', '.join(in_pool) or 'no card'})")
            return static_offer(gpu, reason).model_copy(update={"not_in_pool": reason, "cards_from": "catalog"})
        exclude = [card for card in in_pool if card != gpu.card]
        types = [t for t in self.gpu_types if t.id == gpu.card]
        prices = [t.price.serverless for t in types if t.price.serverless is not None]
        if not prices:
            return static_offer(gpu, f"RunPod's catalog lists no serverless price for pool {gpu.pool}").model_copy(
                update={"exclude": exclude, "cards_from": "catalog"})
        stock_types = types if stock is None or stock.gpu_types is None else \
            [t for t in stock.gpu_types if t.id == gpu.card]
        levels: dict[str, AvailabilityLevel] = {}
        for t in stock_types:
            for dc in t.data_centers:
                levels[dc.id] = max(levels.get(dc.id, "NONE"), dc.availability, key=_LEVELS.index)
        versions = {v.version for t in types for v in t.cuda_versions}
        return GpuOffer(gpu=gpu.name, pool=gpu.pool, usd_per_hour=max(prices), source="catalog",
                        cuda_versions=sorted(versions, key=_version_key), data_centers=levels,
                        cuda_floor=stock.min_cuda if stock is not None and stock.gpu_types is not None else None,
                        exclude=exclude, cards_from="catalog")


class BilledAmount(BaseModel):
    """What RunPod billed a set of endpoints, from `/v2/billing/serverless`."""

    usd: float = Field(description="Sum of the endpoints' billed amounts since the time asked for, USD.")
    endpoint_ids: list[str] = Field(description="The endpoints asked about.")


# --- reads -------------------------------------------------------------------------------------------


def read_retried(read: Callable[[], T], what: str, *, tries: int = READ_TRIES, budget_s: float = READ_RETRY_BUDGET_S,
                 sleep: Callable[[float], None] = time.sleep) -> T:
    """`read()`, tried again after a transient error (`errors.is_transient`: 429, 5xx, no answer) up to `tries`
    times: after a 429's Retry-After when it sends one, else after a doubling backoff from 1 s, and never past
    `budget_s` of waits in all. Raises the last error (any other error at once). `what` names the read in the log."""
    waited = 0.0
    for tried in range(1, tries + 1):
        try:
            return read()
        except errors.RunpodError as e:
            delay = READ_FIRST_BACKOFF_S * 2 ** (tried - 1)
            if isinstance(e, errors.RateLimitError) and e.retry_after is not None:
                delay = e.retry_after
            if not errors.is_transient(e) or tried == tries or waited + delay > budget_s:
                raise
            log.info("%s: %s; trying again in %g s (try %d of %d)", what, e, delay, tried + 1, tries)
            sleep(delay)
            waited += delay
    raise AssertionError("unreachable: the last try returns or raises")


def read_gpu_types(client: RunpodClient, min_cuda: str | None = None) -> list[CatalogGpuType]:
    """Every GPU type with its serverless availability; with `min_cuda`, the availability on hosts that run
    at least that CUDA version (RunPod's `minCudaVersion` scopes the stock per datacenter). Raises the
    client's errors once `read_retried` gives up, or ValueError on a body of another shape."""
    params = {"include": "AVAILABILITY", "product": "SERVERLESS"}
    if min_cuda is not None:
        params["minCudaVersion"] = min_cuda
    body = read_retried(lambda: client.catalog_gpus(params), "RunPod's GPU catalog")
    return _GpuTypeList.model_validate(body).gpus


def read_data_centers(client: RunpodClient, *, cpus: bool = False) -> list[CatalogDataCenter]:
    """Every datacenter with its network-volume tiers and GPU stock (and, with `cpus`, its CPU flavors' stock).
    Raises as `read_gpu_types`."""
    params = {"include": "GPU_AVAILABILITY,CPU_AVAILABILITY" if cpus else "GPU_AVAILABILITY"}
    body = read_retried(lambda: client.catalog_data_centers(params), "RunPod's datacenter catalog")
    return _DataCenterList.model_validate(body).data_centers


def read_cpu_types(client: RunpodClient) -> list[CatalogCpuType]:
    """Every CPU flavor with its vCPU range and serverless price per vCPU, as RunPod offers them to serverless.
    Raises as `read_gpu_types`."""
    # `product` is valid only with include=AVAILABILITY, and a 400 without it (the schema's CpuProductFilter).
    params = {"include": "AVAILABILITY", "product": "SERVERLESS"}
    return _CpuTypeList.model_validate(read_retried(lambda: client.catalog_cpus(params), "RunPod's CPU catalog")).cpus


_cache: dict[tuple[str, str | None], LiveCatalog] = {}
_cache_lock = threading.Lock()


def live_catalog(
    client: RunpodClient, *, min_cuda: str | None = None, max_age_s: float = CATALOG_MAX_AGE_S,
    clock: Callable[[], float] = time.monotonic,
) -> LiveCatalog:
    """The GPU catalog (its stock scoped to hosts that run at least `min_cuda`, when given), read at most once
    per `max_age_s` per process, API URL and floor. Never raises: an unreadable catalog comes back with
    `gpu_types=None` and the reason (logged), and is not kept, so the next call reads again."""
    key = (client.api_url, min_cuda)
    with _cache_lock:
        cached = _cache.get(key)
    if cached is not None and clock() - cached.read_at < max_age_s:
        return cached
    try:
        read = LiveCatalog(gpu_types=read_gpu_types(client, min_cuda), read_at=clock(), min_cuda=min_cuda)
    except _UNREADABLE as e:
        reason = f"RunPod's catalog could not be read ({type(e).__name__}: {str(e)[:300]})"
        log.warning("%s; using loraflow's static list prices", reason)
        return LiveCatalog(gpu_types=None, fallback_reason=reason, read_at=clock(), min_cuda=min_cuda)
    with _cache_lock:
        _cache[key] = read
    return read


def clear_catalog_cache() -> None:
    """Forget every cached read (tests; a process that wants fresh prices at once)."""
    with _cache_lock:
        _cache.clear()


def gpu_offers(client: RunpodClient, gpus: Sequence[GpuClass], cuda_floors: Sequence[str | None] | None = None,
               ) -> list[GpuOffer]:
    """Each class's offer, in order, from one (cached) read of the catalog; with `cuda_floors` (one per class,
    None for none), each class's per-datacenter stock counts only hosts that meet its floor (one more read per
    distinct floor)."""
    catalog = live_catalog(client)
    floors = list(cuda_floors) if cuda_floors is not None else [None] * len(gpus)
    if catalog.gpu_types is None:
        return [catalog.offer(gpu) for gpu in gpus]
    return [catalog.offer(gpu, live_catalog(client, min_cuda=floor) if floor is not None else None)
            for gpu, floor in zip(gpus, floors, strict=True)]


def static_offer(gpu: GpuClass, reason: str) -> GpuOffer:
    """The class as loraflow's static table prices and pins it, with why the catalog does not."""
    return GpuOffer(gpu=gpu.name, pool=gpu.pool, usd_per_hour=gpu.usd_per_hour, source="static list price",
                    fallback_reason=reason, exclude=list(gpu.exclude))


def billed_usd(client: RunpodClient, endpoint_ids: Sequence[str], since: datetime) -> BilledAmount | None:
    """What RunPod had billed these endpoints since `since` (timezone-aware) when asked; None when billing
    cannot be read (logged), so a report can leave the figure out instead of failing."""
    total = 0.0
    try:
        for endpoint_id in endpoint_ids:
            params = {"serverlessId": endpoint_id, "startTime": since.isoformat(), "bucketSize": "day"}
            body = read_retried(lambda: client.serverless_billing(params), "RunPod's serverless billing")  # noqa: B023
            total += sum(r.total_amount for r in _ServerlessBilling.model_validate(body).records
                         if r.serverless_id == endpoint_id)
    except _UNREADABLE as e:
        log.warning("RunPod's billing could not be read (%s: %s); the report leaves the billed amount out",
                    type(e).__name__, str(e)[:300])
        return None
    return BilledAmount(usd=round(total, 6), endpoint_ids=list(endpoint_ids))


def _version_key(version: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in version.split("."))
    except ValueError:
        return (0,)
