"""Fault injection: the rules tests and benchmarks set through `/_localpod/faults`,
`/_localpod/worker-faults`, `/_localpod/stock`, `/_localpod/cpu-stock`, `/_localpod/cuda` and
`/_localpod/volume-types`, and which request, job or worker each one hits; and, from the GPU and CPU stock,
the hosts' CUDA versions and the endpoint's network volume, where a worker may start (`FaultBook.place`,
over the catalog of `catalog.py`).

Nothing here touches HTTP or processes. Routes ask `FaultBook.match_route` whether to misbehave
(`routes.faults.route_fault` acts on the answer); the state arms a worker fault on a job when a
worker takes it, and the supervisor (`workers.py`) fires it by signalling the worker's process group.
"""

from __future__ import annotations

import random
import re
import secrets
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from localpod import catalog
from localpod.catalog import WorkerPlacement

RouteName = Literal[
    "create_endpoint",
    "get_endpoint",
    "list_endpoints",
    "delete_endpoint",
    "patch_endpoint",
    "run",
    "status",
    "cancel",
    "health",
    "list_gpu_types",
    "get_gpu_type",
    "list_cpu_types",
    "get_cpu_type",
    "list_data_centers",
    "serverless_billing",
    "network_volume_billing",
    "create_network_volume",
    "list_network_volumes",
    "get_network_volume",
    "patch_network_volume",
    "delete_network_volume",
    "list_endpoint_workers",
]
RouteAction = Literal["status_429", "status_500", "hang", "drop", "act_then_500", "unknown_status"]
WorkerAction = Literal["crash", "hang", "preempt", "env"]

ROUTE_ACTIONS: tuple[RouteAction, ...] = ("status_429", "status_500", "hang", "drop", "act_then_500", "unknown_status")
WORKER_ACTIONS: tuple[WorkerAction, ...] = ("crash", "hang", "preempt", "env")


class RouteFaultRule(BaseModel):
    """Body of `POST /_localpod/faults`: make requests to one operation misbehave.

    Rules are tried in the order they were added; the first that applies decides the answer.
    """

    model_config = ConfigDict(extra="forbid")

    route: RouteName = Field(
        description="The operation: create_endpoint, get_endpoint, list_endpoints, delete_endpoint, patch_endpoint "
        "(the control plane, /v2/serverless); run (/run and /runsync), status, cancel, health (the job API); "
        "list_gpu_types, get_gpu_type, list_cpu_types, get_cpu_type, list_data_centers (/v2/catalog/gpus[/{id}], "
        "/v2/catalog/cpus[/{id}], /v2/catalog/datacenters[/{id}]), serverless_billing (/v2/billing/serverless), "
        "network_volume_billing (/v2/billing/network-volumes); create_network_volume, list_network_volumes, "
        "get_network_volume, patch_network_volume, delete_network_volume (/v2/network-volumes[/{id}]); "
        "list_endpoint_workers (/v2/serverless/{id}/workers)."
    )
    action: RouteAction = Field(
        description="status_429: answer 429 (with Retry-After when retry_after_s is set); status_500: answer 500; "
        "hang: hold the request hang_s seconds, then carry it out and answer normally (without hang_s: hold it "
        "until the client gives up, and never carry it out); drop: close the connection mid-response (the client "
        "sees a transport error); act_then_500: carry the operation out (e.g. really create the endpoint), then "
        "answer 500; unknown_status (status route only): answer 200 with the job's real status document, its "
        "`status` replaced by job_status (a status the client may not know). Every action but act_then_500 and a "
        "finite hang leaves the account unchanged."
    )
    endpoint_name_prefix: str | None = Field(
        default=None,
        description="Only requests about an endpoint whose name starts with this (for create_endpoint: the name in "
        "the body). Omitted: every request to the route. Not allowed with list_endpoints and the catalog, billing "
        "and network-volume routes, which name no endpoint.",
    )
    data_center_id: str | None = Field(
        default=None, description="create_network_volume only: only creates in this datacenter (the body's "
        "`dataCenter`). Omitted: every create.")
    retry_after_s: int | None = Field(
        default=None, ge=0, description="status_429 only: the Retry-After header, in seconds. Omitted: no header."
    )
    hang_s: float | None = Field(
        default=None, ge=0, description="hang only: seconds to hold the request. Omitted: until the client gives up."
    )
    job_status: str | None = Field(
        default=None,
        min_length=1,
        description="unknown_status only, and required there: the `status` the job's status document answers "
        "instead of its real one, e.g. RUNNING (a status RunPod's docs list that loraflow's client does not model).",
    )
    times: int | None = Field(
        default=None,
        ge=1,
        description="Apply to the next this many matching requests, then stop. With probability: the most hits. "
        "When neither times nor probability is given: 1.",
    )
    probability: float | None = Field(
        default=None,
        ge=0,
        le=1,
        description="Apply to each matching request with this probability (until times hits, when times is set).",
    )
    seed: int | None = Field(
        default=None,
        description="probability only: seed of the rule's own random draws, so the same requests meet the same "
        "faults on every run. Omitted: unseeded.",
    )

    @model_validator(mode="after")
    def _consistent(self) -> RouteFaultRule:
        if self.retry_after_s is not None and self.action != "status_429":
            raise ValueError(f"retry_after_s applies to status_429 only, not to {self.action}")
        if self.hang_s is not None and self.action != "hang":
            raise ValueError(f"hang_s applies to hang only, not to {self.action}")
        if self.action == "unknown_status" and (self.job_status is None or self.route != "status"):
            raise ValueError("unknown_status applies to the status route and needs job_status, e.g. \"RUNNING\"")
        if self.job_status is not None and self.action != "unknown_status":
            raise ValueError(f"job_status applies to unknown_status only, not to {self.action}")
        if self.seed is not None and self.probability is None:
            raise ValueError("seed applies to probability rules only: give probability too, or drop seed")
        if self.data_center_id is not None and self.route != "create_network_volume":
            raise ValueError(f"data_center_id applies to create_network_volume only, not to {self.route}")
        if self.endpoint_name_prefix is not None and self.route in _ROUTES_WITHOUT_ENDPOINT:
            raise ValueError(f"{self.route} names no endpoint: drop endpoint_name_prefix")
        if self.times is None and self.probability is None:
            self.times = 1
        return self


class RouteFault(RouteFaultRule):
    """A route fault as listed: its rule, id and how often it has applied."""

    id: str = Field(description="The rule's id, for `DELETE /_localpod/faults/{id}`.")
    hits: int = Field(description="Requests this rule has applied to so far.")
    remaining: int | None = Field(description="Hits left before the rule stops applying; None: no cap (probability).")


class WorkerFaultRule(BaseModel):
    """Body of `POST /_localpod/worker-faults`: make the next jobs' workers fail, or start the next workers
    with extra environment variables."""

    model_config = ConfigDict(extra="forbid")

    action: WorkerAction = Field(
        description="crash: SIGKILL the worker's process group (the job FAILS: the worker exited without a result); "
        "hang: SIGSTOP it (the job stays IN_PROGRESS until it times out or its endpoint is deleted); preempt: "
        "SIGKILL it and queue the job again (IN_QUEUE, for a new worker); env: start the next workers of matching "
        "endpoints with `env` added to their environment (what a variable does is the worker's business)."
    )
    endpoint_name_prefix: str | None = Field(
        default=None, description="Only endpoints whose name starts with this. Omitted: any endpoint."
    )
    after_s: float | None = Field(
        default=None,
        ge=0,
        description="crash, hang, preempt: seconds after the worker took the job. Omitted: as soon as the job's "
        "first progress update arrives.",
    )
    env: dict[str, str] | None = Field(
        default=None, description="env only (and required there): variables added to the worker's environment."
    )
    times: int = Field(
        default=1,
        ge=1,
        description="How many jobs (crash, hang, preempt) or spawned workers (env) get the fault. A job that ends "
        "before its fault fires hands it on to the next job.",
    )

    @model_validator(mode="after")
    def _consistent(self) -> WorkerFaultRule:
        if self.action == "env" and not self.env:
            raise ValueError("env needs `env`: the variables to add, e.g. {\"LORAFLOW_TEST_FAULT\": \"oom\"}")
        if self.action != "env" and self.env is not None:
            raise ValueError(f"`env` applies to the env action only, not to {self.action}")
        if self.action == "env" and self.after_s is not None:
            raise ValueError("after_s applies to crash, hang and preempt, not to env")
        return self


class WorkerFault(WorkerFaultRule):
    """A worker fault as listed: its rule, id and how often it has fired."""

    id: str = Field(description="The rule's id, for `DELETE /_localpod/worker-faults/{id}`.")
    hits: int = Field(description="Times this fault fired (a worker signalled, or a worker started with `env`).")
    remaining: int = Field(description="Jobs or workers still to get it (jobs running with it armed excluded).")


class StockChange(BaseModel):
    """Body of `POST /_localpod/stock`."""

    model_config = ConfigDict(extra="forbid")

    pool: str = Field(min_length=1, description="A GPU pool id as endpoints name it in `gpu.pools`, e.g. ADA_24.")
    available: bool = Field(
        description="false: no worker starts on this pool (in this datacenter, with data_center_id): an endpoint "
        "with no allowed datacenter that has stock of one of its pools keeps its jobs IN_QUEUE, as when RunPod has "
        "no capacity; running workers are not touched. true: in stock again. The catalog's availability follows."
    )
    data_center_id: str | None = Field(
        default=None,
        description="A datacenter of localpod's catalog (`GET /v2/catalog/datacenters`), e.g. EU-RO-1: the change "
        "applies there only. Omitted: in every datacenter.",
    )

    @field_validator("data_center_id")
    @classmethod
    def _known_data_center(cls, value: str | None) -> str | None:
        if value is not None and value not in catalog.DATA_CENTER_IDS:
            known = ", ".join(catalog.DATA_CENTER_IDS)
            raise ValueError(f"no datacenter {value!r} in localpod's catalog; known: {known}")
        return value


class Stock(BaseModel):
    """What `POST`/`GET /_localpod/stock` answer."""

    out_of_stock: list[str] = Field(
        description="GPU pools out of stock in every datacenter now, sorted; every other pool has stock somewhere."
    )
    out_of_stock_by_data_center: dict[str, list[str]] = Field(
        default_factory=dict,
        description="Pools out of stock in some datacenters only: datacenter id → pools, sorted. Omitted when none "
        "(the answer then reads as it did before stock had datacenters).",
    )


class CpuStockChange(BaseModel):
    """Body of `POST /_localpod/cpu-stock`: take CPU flavors out of stock, or put them back."""

    model_config = ConfigDict(extra="forbid")

    cpu_flavor: str | None = Field(
        default=None,
        description="A CPU flavor of localpod's catalog (`GET /v2/catalog/cpus`), e.g. cpu3c. Omitted: every flavor "
        "(so that no CPU endpoint can start, and the catalog offers no CPU anywhere).",
    )
    available: bool = Field(
        description="false: no CPU worker starts on this flavor (in this datacenter, with data_center_id): a CPU "
        "endpoint with no allowed datacenter that has stock of one of its flavors keeps its jobs IN_QUEUE "
        "(throttled), as when RunPod has no capacity; running workers are not touched. true: in stock again. The "
        "catalog's CPU availability follows."
    )
    data_center_id: str | None = Field(
        default=None,
        description="A datacenter of localpod's catalog, e.g. EU-RO-1: the change applies there only. Omitted: in "
        "every datacenter.",
    )

    @field_validator("cpu_flavor")
    @classmethod
    def _known_flavor(cls, value: str | None) -> str | None:
        if value is not None and catalog.cpu_type(value) is None:
            known = ", ".join(catalog.CPU_FLAVOR_IDS)
            raise ValueError(f"no CPU flavor {value!r} in localpod's catalog; known: {known}")
        return value

    @field_validator("data_center_id")
    @classmethod
    def _known_data_center(cls, value: str | None) -> str | None:
        if value is not None and value not in catalog.DATA_CENTER_IDS:
            known = ", ".join(catalog.DATA_CENTER_IDS)
            raise ValueError(f"no datacenter {value!r} in localpod's catalog; known: {known}")
        return value


class CpuStock(BaseModel):
    """What `POST`/`GET /_localpod/cpu-stock` answer."""

    out_of_stock: list[str] = Field(description="CPU flavors out of stock in every datacenter now, sorted.")
    out_of_stock_by_data_center: dict[str, list[str]] = Field(
        description="Flavors out of stock in some datacenters only: datacenter id → flavors, sorted ({} when none)."
    )


VolumeType = Literal["STANDARD", "HIGH_PERFORMANCE"]


class VolumeTypesChange(BaseModel):
    """Body of `POST /_localpod/volume-types`: set the network volume tiers one datacenter offers."""

    model_config = ConfigDict(extra="forbid")

    data_center_id: str = Field(description="A datacenter of localpod's catalog, e.g. EU-RO-1.")
    types: list[VolumeType] = Field(
        description="Exactly the tiers it offers from now on, its primary (default) tier first: e.g. "
        "[\"HIGH_PERFORMANCE\"] for a datacenter that offers only high-performance storage. [] : it supports no "
        "network volumes. Volumes already there are not touched; `GET /v2/catalog/datacenters` and volume creation "
        "follow at once. `DELETE /_localpod/volume-types` restores the catalog's tiers everywhere."
    )

    @field_validator("data_center_id")
    @classmethod
    def _known_data_center(cls, value: str) -> str:
        if value not in catalog.DATA_CENTER_IDS:
            known = ", ".join(catalog.DATA_CENTER_IDS)
            raise ValueError(f"no datacenter {value!r} in localpod's catalog; known: {known}")
        return value

    @field_validator("types")
    @classmethod
    def _once_each(cls, types: list[VolumeType]) -> list[VolumeType]:
        if len(set(types)) != len(types):
            raise ValueError(f"name each tier once, the primary one first; not {types}")
        return types


class VolumeTypes(BaseModel):
    """What `POST`, `GET /_localpod/volume-types` answer."""

    network_volume_types: dict[str, list[str]] = Field(
        description="Every datacenter of the catalog → the network volume tiers it offers now, its primary one first "
        "([] : no volumes)."
    )


class CudaChange(BaseModel):
    """Body of `POST /_localpod/cuda`: set the CUDA versions the hosts of some GPU types run in some datacenters."""

    model_config = ConfigDict(extra="forbid")

    gpu_type_id: str | None = Field(
        default=None,
        min_length=1,
        description="A GPU type of localpod's catalog (`GET /v2/catalog/gpus`), e.g. NVIDIA GeForce RTX 4090. Not "
        "with pool. Neither given: every type.",
    )
    pool: str | None = Field(
        default=None,
        min_length=1,
        description="A GPU pool of localpod's catalog, e.g. ADA_24: every type of that pool. Not with gpu_type_id.",
    )
    data_center_id: str | None = Field(
        default=None,
        description="A datacenter of localpod's catalog, e.g. US-TX-3: the change applies there only. Omitted: in "
        "every datacenter offering the type.",
    )
    versions: list[str] = Field(
        description="Exactly the CUDA versions (`major.minor`, e.g. 12.8) those hosts run from now on. [] : they "
        "report none, so an endpoint with any `gpu.minCudaVersion` or `gpu.allowedCudaVersions` is not placed on "
        "them (one without either still is). Workers already running are not touched; queued jobs are placed "
        "under the new versions at the supervisor's next pass. The catalog's `cudaVersions` follows."
    )

    @field_validator("gpu_type_id")
    @classmethod
    def _known_gpu_type(cls, value: str | None) -> str | None:
        if value is not None and catalog.gpu_type(value) is None:
            known = ", ".join(g.id for g in catalog.GPU_TYPES)
            raise ValueError(f"no GPU type {value!r} in localpod's catalog; known: {known}")
        return value

    @field_validator("pool")
    @classmethod
    def _known_pool(cls, value: str | None) -> str | None:
        if value is not None and value not in catalog.KNOWN_POOLS:
            raise ValueError(f"no pool {value!r} in localpod's catalog; known: {', '.join(catalog.KNOWN_POOLS)}")
        return value

    @field_validator("data_center_id")
    @classmethod
    def _known_data_center(cls, value: str | None) -> str | None:
        if value is not None and value not in catalog.DATA_CENTER_IDS:
            known = ", ".join(catalog.DATA_CENTER_IDS)
            raise ValueError(f"no datacenter {value!r} in localpod's catalog; known: {known}")
        return value

    @field_validator("versions")
    @classmethod
    def _major_minor(cls, versions: list[str]) -> list[str]:
        bad = [v for v in versions if not _CUDA_VERSION.match(v)]
        if bad:
            raise ValueError(f"CUDA versions are major.minor, e.g. 12.8; not {bad}")
        return sorted(set(versions), key=catalog.cuda_version)

    @model_validator(mode="after")
    def _one_selector(self) -> CudaChange:
        if self.gpu_type_id is not None and self.pool is not None:
            raise ValueError("give gpu_type_id or pool, not both")
        return self

    def gpu_types(self) -> list[catalog.GpuTypeRow]:
        return [g for g in catalog.GPU_TYPES
                if self.gpu_type_id in (None, g.id) and self.pool in (None, g.pool)]


class HostsCuda(BaseModel):
    """What `POST`, `GET /_localpod/cuda` answer."""

    hosts: dict[str, dict[str, list[str]]] = Field(
        description="GPU type id → datacenter offering it → the CUDA versions its hosts there run, sorted by "
        "version; every type and every datacenter offering it (an empty list: hosts that report none)."
    )


@dataclass
class _RouteEntry:
    id: str
    rule: RouteFaultRule
    rng: random.Random
    hits: int = 0

    def view(self) -> RouteFault:
        remaining = None if self.rule.times is None else self.rule.times - self.hits
        return RouteFault(**self.rule.model_dump(), id=self.id, hits=self.hits, remaining=remaining)


@dataclass
class ArmedFault:
    """A worker fault reserved for one job; `WorkerSupervisor` fires it."""

    id: str
    rule: WorkerFaultRule
    remaining: int
    hits: int = 0
    removed: bool = False
    """Set when the rule is deleted: a job that had it armed runs on undisturbed."""

    def view(self) -> WorkerFault:
        return WorkerFault(**self.rule.model_dump(), id=self.id, hits=self.hits, remaining=self.remaining)


@dataclass
class FaultBook:
    """Every fault rule of one server, the stock of GPU pools per datacenter, where each worker was placed,
    and counts of what was injected."""

    route_rules: dict[str, _RouteEntry] = field(default_factory=dict)
    worker_rules: dict[str, ArmedFault] = field(default_factory=dict)
    out_of_stock: set[tuple[str, str]] = field(default_factory=set)
    """(pool, datacenter id) pairs taken out of stock."""
    placements: dict[str, WorkerPlacement] = field(default_factory=dict)
    """Worker id → where it was started (`place`); the account and the billing read it."""
    volume_data_centers: dict[str, str] = field(default_factory=dict)
    """Network volume id → its datacenter, kept by `volumes.VolumeBook`; `place` pins endpoints' workers there."""
    hosts: dict[str, dict[str, tuple[str, ...]]] = field(default_factory=catalog.default_host_table)
    """GPU type id → datacenter offering it → the CUDA versions its hosts run there (`/_localpod/cuda`)."""
    cpu_out_of_stock: set[tuple[str, str]] = field(default_factory=set)
    """(CPU flavor id, datacenter id) pairs taken out of stock (`/_localpod/cpu-stock`)."""
    volume_types: dict[str, tuple[str, ...]] = field(default_factory=catalog.default_volume_types)
    """Datacenter id → the network volume tiers it offers, primary first (`/_localpod/volume-types`)."""
    injected: Counter[str] = field(default_factory=Counter)

    # --- route faults ----------------------------------------------------------------------------

    def add_route_fault(self, rule: RouteFaultRule) -> RouteFault:
        entry = _RouteEntry(id=_new_rule_id(), rule=rule, rng=random.Random(rule.seed))
        self.route_rules[entry.id] = entry
        return entry.view()

    def route_faults(self) -> list[RouteFault]:
        return [e.view() for e in self.route_rules.values()]

    def remove_route_fault(self, fault_id: str) -> bool:
        return self.route_rules.pop(fault_id, None) is not None

    def clear_route_faults(self) -> None:
        self.route_rules.clear()

    def match_route(self, route: str, endpoint_name: str | None, data_center: str | None = None) -> RouteFaultRule | None:
        """The rule that applies to this request, counted as a hit; None: answer normally."""
        for entry in self.route_rules.values():
            rule = entry.rule
            if rule.route != route or not _prefix_matches(rule.endpoint_name_prefix, endpoint_name):
                continue
            if rule.data_center_id is not None and rule.data_center_id != data_center:
                continue
            if rule.times is not None and entry.hits >= rule.times:
                continue
            # One draw per matching request: with a seed, the same requests get the same faults.
            if rule.probability is not None and entry.rng.random() >= rule.probability:
                continue
            entry.hits += 1
            self.injected[rule.action] += 1
            return rule
        return None

    # --- worker faults ---------------------------------------------------------------------------

    def add_worker_fault(self, rule: WorkerFaultRule) -> WorkerFault:
        entry = ArmedFault(id=_new_rule_id(), rule=rule, remaining=rule.times)
        self.worker_rules[entry.id] = entry
        return entry.view()

    def worker_faults(self) -> list[WorkerFault]:
        return [e.view() for e in self.worker_rules.values()]

    def remove_worker_fault(self, fault_id: str) -> bool:
        entry = self.worker_rules.pop(fault_id, None)
        if entry is not None:
            entry.removed = True
        return entry is not None

    def clear_worker_faults(self) -> None:
        for fault_id in list(self.worker_rules):
            self.remove_worker_fault(fault_id)

    def arm_job_fault(self, endpoint_name: str) -> ArmedFault | None:
        """Reserve the first crash/hang/preempt fault that matches for a job a worker just took."""
        for entry in self.worker_rules.values():
            if entry.rule.action != "env" and entry.remaining > 0 and _prefix_matches(
                entry.rule.endpoint_name_prefix, endpoint_name
            ):
                entry.remaining -= 1
                return entry
        return None

    def disarm(self, armed: ArmedFault) -> None:
        """The job ended before its fault fired: the next matching job gets it instead."""
        armed.remaining += 1

    def fired(self, armed: ArmedFault) -> None:
        armed.hits += 1
        self.injected[f"worker_{armed.rule.action}"] += 1

    def spawn_env(self, endpoint_name: str) -> dict[str, str]:
        """Variables for a worker about to start: every matching env fault with workers left gives its own."""
        env: dict[str, str] = {}
        for entry in self.worker_rules.values():
            if entry.rule.action == "env" and entry.remaining > 0 and _prefix_matches(
                entry.rule.endpoint_name_prefix, endpoint_name
            ):
                entry.remaining -= 1
                self.fired(entry)
                env.update(entry.rule.env or {})
        return env

    # --- stock -----------------------------------------------------------------------------------

    def set_stock(self, change: StockChange) -> Stock:
        where = [change.data_center_id] if change.data_center_id else catalog.DATA_CENTER_IDS
        pairs = {(change.pool, dc) for dc in where}
        if change.available:
            self.out_of_stock -= pairs
        else:
            self.out_of_stock |= pairs
        return self.stock()

    def stock(self) -> Stock:
        everywhere, by_dc = _stock_view(self.out_of_stock)
        return Stock(out_of_stock=everywhere, out_of_stock_by_data_center=by_dc)

    def in_stock(self, pool: str, data_center_id: str) -> bool:
        return (pool, data_center_id) not in self.out_of_stock

    # --- CPU stock -------------------------------------------------------------------------------

    def set_cpu_stock(self, change: CpuStockChange) -> CpuStock:
        flavors = [change.cpu_flavor] if change.cpu_flavor else catalog.CPU_FLAVOR_IDS
        where = [change.data_center_id] if change.data_center_id else catalog.DATA_CENTER_IDS
        pairs = {(flavor, dc) for flavor in flavors for dc in where}
        if change.available:
            self.cpu_out_of_stock -= pairs
        else:
            self.cpu_out_of_stock |= pairs
        return self.cpu_stock()

    def cpu_stock(self) -> CpuStock:
        everywhere, by_dc = _stock_view(self.cpu_out_of_stock)
        return CpuStock(out_of_stock=everywhere, out_of_stock_by_data_center=by_dc)

    def cpu_in_stock(self, flavor_id: str, data_center_id: str) -> bool:
        return (flavor_id, data_center_id) not in self.cpu_out_of_stock

    # --- network volume tiers --------------------------------------------------------------------

    def set_volume_types(self, change: VolumeTypesChange) -> VolumeTypes:
        self.volume_types[change.data_center_id] = tuple(change.types)
        return self.volume_types_view()

    def reset_volume_types(self) -> None:
        self.volume_types = catalog.default_volume_types()

    def volume_types_view(self) -> VolumeTypes:
        return VolumeTypes(network_volume_types={dc: list(types) for dc, types in self.volume_types.items()})

    # --- hosts' CUDA versions -------------------------------------------------------------------

    def set_host_cuda(self, change: CudaChange) -> HostsCuda:
        for row in change.gpu_types():
            for dc_id in self.hosts[row.id]:
                if change.data_center_id in (None, dc_id):
                    self.hosts[row.id][dc_id] = tuple(change.versions)
        return self.hosts_cuda()

    def reset_host_cuda(self) -> None:
        self.hosts = catalog.default_host_table()

    def hosts_cuda(self) -> HostsCuda:
        return HostsCuda(hosts={type_id: {dc: list(versions) for dc, versions in by_dc.items()}
                                for type_id, by_dc in self.hosts.items()})

    def host_cuda(self, gpu_type_id: str, data_center_id: str) -> tuple[str, ...]:
        """A `catalog.HostCuda`: the versions in force now."""
        return self.hosts.get(gpu_type_id, {}).get(data_center_id, ())

    # --- placement -------------------------------------------------------------------------------

    def place(self, spec: dict[str, Any], *, ignore_cuda: bool = False) -> WorkerPlacement | None:
        """Where a worker of this endpoint would start now (`catalog.place`); None: nowhere it allows has stock on
        hosts that meet its CUDA need. An endpoint attaches one network volume at most
        (`VolumeBook.check_endpoint`): its workers start in its datacenter."""
        return catalog.place(spec, self.in_stock, self._pinned(spec), self.host_cuda, ignore_cuda=ignore_cuda,
                             cpu_in_stock=self.cpu_in_stock)

    def placeable(self, spec: dict[str, Any]) -> bool:
        """Can a worker of this endpoint start? Not when no datacenter it allows has stock of one of its pools
        on hosts that meet its CUDA need (a CPU endpoint: of one of its CPU flavors)."""
        return self.place(spec) is not None

    def unplaceable_reason(self, spec: dict[str, Any]) -> str | None:
        """Why no worker of this endpoint can start now, as the log says it; None when one can."""
        if self.placeable(spec):
            return None
        pinned = self._pinned(spec)
        allowed = catalog.allowed_data_centers(spec, pinned)
        where = ", ".join(allowed) or "no datacenter of localpod's catalog"
        if pinned is not None:
            where += f" (its network volume's datacenter is {pinned})"
        if not spec.get("gpu"):
            flavors = ", ".join(dict.fromkeys(c["id"] for c in spec.get("cpu") or ()))
            return f"no stock of CPU flavor {flavors} in {where}"
        gpu = spec.get("gpu") or {}
        pools = list(gpu.get("pools") or ())
        if self.place(spec, ignore_cuda=True) is None:
            return f"no stock of {', '.join(pools) or 'its GPUs'} in {where}"
        # Stock is not what stops it: name the types it could have and the datacenters that have them in stock.
        stocked = {dc: [g.id for p in pools if self.in_stock(p, dc) for g in catalog.endpoint_gpu_types(gpu, p, dc)]
                   for dc in allowed}
        types = dict.fromkeys(type_id for type_ids in stocked.values() for type_id in type_ids)
        return (f"no host of {', '.join(types)} in {', '.join(dc for dc, ids in stocked.items() if ids)} runs "
                f"{catalog.CudaNeed.of(gpu).describe()}")

    def _pinned(self, spec: dict[str, Any]) -> str | None:
        pins = self.volume_data_centers
        pinned = [pins[v] for v in spec.get("networkVolumes") or () if v in pins]
        return pinned[0] if pinned else None

    def counts(self) -> dict[str, int]:
        """Faults injected so far by kind, every kind listed (0 when none)."""
        kinds = [*ROUTE_ACTIONS, *(f"worker_{a}" for a in WORKER_ACTIONS)]
        return {kind: self.injected[kind] for kind in kinds}


_ROUTES_WITHOUT_ENDPOINT = frozenset(
    {"list_endpoints", "list_gpu_types", "get_gpu_type", "list_cpu_types", "get_cpu_type", "list_data_centers",
     "serverless_billing", "network_volume_billing",
     "create_network_volume", "list_network_volumes", "get_network_volume", "patch_network_volume",
     "delete_network_volume"}
)


_CUDA_VERSION = re.compile(r"^\d+\.\d+$")


def _stock_view(out_of_stock: set[tuple[str, str]]) -> tuple[list[str], dict[str, list[str]]]:
    """(what is out of stock in every datacenter, datacenter → what else is out there) of (pool or flavor,
    datacenter) pairs."""
    everywhere = sorted({item for item, _ in out_of_stock
                         if all((item, dc) in out_of_stock for dc in catalog.DATA_CENTER_IDS)})
    by_dc: dict[str, list[str]] = {}
    for item, dc in sorted(out_of_stock):
        if item not in everywhere:
            by_dc.setdefault(dc, []).append(item)
    return everywhere, dict(sorted(by_dc.items()))


def _prefix_matches(prefix: str | None, name: str | None) -> bool:
    return prefix is None or (isinstance(name, str) and name.startswith(prefix))


def _new_rule_id() -> str:
    return f"fault-{secrets.token_hex(6)}"
