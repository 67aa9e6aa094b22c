"""The bodies of localpod's fault, stock, CUDA and volume-type controls (`/_localpod/*`), and the rules they
make: what a test or benchmark asks localpod to do wrong."""


from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from localpod.catalog import tables
from localpod.catalog.cuda import cuda_version

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
RouteAction = Literal["status_429", "status_500", "status_400", "hang", "drop", "act_then_500", "unknown_status",
                      "create_as_gpu", "answer", "create_patched"]
WorkerAction = Literal["crash", "hang", "preempt", "env"]
DeadWorkerJobs = Literal["fail", "requeue"]
"""What happens to the job of a worker that dies without a result: FAILED, or back to the queue for another worker
(`LocalpodConfig.dead_worker_jobs`, a crash fault's own `dead_worker_jobs`)."""

ROUTE_ACTIONS: tuple[RouteAction, ...] = ("status_429", "status_500", "status_400", "hang", "drop", "act_then_500",
                                         "unknown_status", "create_as_gpu", "answer", "create_patched")
WORKER_ACTIONS: tuple[WorkerAction, ...] = ("crash", "hang", "preempt", "env")
_ROUTES_WITHOUT_ENDPOINT = frozenset(
    {"list_endpoints", "list_gpu_types", "get_gpu_type", "list_cpu_types", "get_cpu_type", "list_data_centers",
     "serverless_billing", "network_volume_billing",
     "create_network_volume", "list_network_volumes", "get_network_volume", "patch_network_volume",
     "delete_network_volume"}
)
_CUDA_VERSION = re.compile(r"^\d+\.\d+$")


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
        "status_400: answer 400, the request refused as invalid (as RunPod refuses a selection it does not take); "
        "hang: hold the request hang_s seconds, then carry it out and answer normally (without hang_s: hold it "
        "until the client gives up, and never carry it out); drop: close the connection mid-response (the client "
        "sees a transport error); act_then_500: carry the operation out (e.g. really create the endpoint), then "
        "answer 500; unknown_status (status route only): answer 200 with the job's real status document, its "
        "`status` replaced by job_status (a status the client may not know); create_as_gpu (create_endpoint only): "
        "make the endpoint a CPU create asks for with GPU workers (pool ADA_24) in place of its `cpu`, and answer "
        "that endpoint, as REST v1 was reported to (a GPU create is made as asked); answer: answer status_code with "
        "answer_body as JSON, as given (a shape RunPod answers that localpod does not, e.g. the quota refusal as a 500 "
        "with REST v1's text, or a /health without some counters); create_patched (create_endpoint only): make the "
        "endpoint with create_patch applied to the request as a PATCH would (workers and gpu merged per key), and "
        "answer that endpoint: an endpoint unlike the request. Every action but act_then_500, create_as_gpu, "
        "create_patched and a finite hang leaves the account unchanged."
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
        "instead of its real one, e.g. RUNNING (RunPod's job-states page lists it beside IN_PROGRESS) or PAUSED (a "
        "status no RunPod page lists, which a client cannot know).",
    )
    status_code: int | None = Field(
        default=None, ge=200, le=599, description="answer only, and required there: the status to answer.")
    answer_body: dict[str, Any] | None = Field(
        default=None, description="answer only: the JSON body to answer, as given. Omitted: an ErrorResponse naming "
        "the fault.")
    create_patch: dict[str, Any] | None = Field(
        default=None, description="create_patched only, and required there: the fields the made endpoint differs "
        "in, as a PATCH body, e.g. {\"workers\": {\"max\": 4}}.")
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
        if self.action == "create_as_gpu" and self.route != "create_endpoint":
            raise ValueError(f"create_as_gpu applies to the create_endpoint route only, not to {self.route}")
        if (self.action == "answer") != (self.status_code is not None):
            raise ValueError("answer needs status_code, and status_code applies to answer only")
        if self.answer_body is not None and self.action != "answer":
            raise ValueError(f"answer_body applies to answer only, not to {self.action}")
        if self.action == "create_patched" and (self.route != "create_endpoint" or not self.create_patch):
            raise ValueError("create_patched applies to the create_endpoint route and needs create_patch")
        if self.create_patch is not None and self.action != "create_patched":
            raise ValueError(f"create_patch applies to create_patched only, not to {self.action}")
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
        description="crash: SIGKILL the worker's process group (its job goes back to the queue, or FAILS, as "
        "dead_worker_jobs or the server's --dead-worker-jobs says); "
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
    at_step: int | None = Field(
        default=None,
        ge=0,
        description="crash, hang, preempt: once the job's progress update carries a `step` of at least this (a "
        "training step: loraflow's worker reports `{\"stage\": \"training\", \"step\": N}`). Not with after_s.",
    )
    dead_worker_jobs: DeadWorkerJobs | None = Field(
        default=None,
        description="crash only: what happens to the crashed worker's job, requeue or fail, for this fault. Omitted: "
        "as the server's --dead-worker-jobs says.",
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
        if self.action == "env" and (self.after_s is not None or self.at_step is not None):
            raise ValueError("after_s and at_step apply to crash, hang and preempt, not to env")
        if self.after_s is not None and self.at_step is not None:
            raise ValueError("give after_s or at_step, not both: the fault fires at one moment")
        if self.dead_worker_jobs is not None and self.action != "crash":
            raise ValueError(f"dead_worker_jobs applies to crash only, not to {self.action}")
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
        if value is not None and value not in tables.DATA_CENTER_IDS:
            known = ", ".join(tables.DATA_CENTER_IDS)
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
        if value is not None and tables.cpu_type(value) is None:
            known = ", ".join(tables.CPU_FLAVOR_IDS)
            raise ValueError(f"no CPU flavor {value!r} in localpod's catalog; known: {known}")
        return value

    @field_validator("data_center_id")
    @classmethod
    def _known_data_center(cls, value: str | None) -> str | None:
        if value is not None and value not in tables.DATA_CENTER_IDS:
            known = ", ".join(tables.DATA_CENTER_IDS)
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
        if value not in tables.DATA_CENTER_IDS:
            known = ", ".join(tables.DATA_CENTER_IDS)
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
        if value is not None and tables.gpu_type(value) is None:
            known = ", ".join(g.id for g in tables.GPU_TYPES)
            raise ValueError(f"no GPU type {value!r} in localpod's catalog; known: {known}")
        return value

    @field_validator("pool")
    @classmethod
    def _known_pool(cls, value: str | None) -> str | None:
        if value is not None and value not in tables.KNOWN_POOLS:
            raise ValueError(f"no pool {value!r} in localpod's catalog; known: {', '.join(tables.KNOWN_POOLS)}")
        return value

    @field_validator("data_center_id")
    @classmethod
    def _known_data_center(cls, value: str | None) -> str | None:
        if value is not None and value not in tables.DATA_CENTER_IDS:
            known = ", ".join(tables.DATA_CENTER_IDS)
            raise ValueError(f"no datacenter {value!r} in localpod's catalog; known: {known}")
        return value

    @field_validator("versions")
    @classmethod
    def _major_minor(cls, versions: list[str]) -> list[str]:
        bad = [v for v in versions if not _CUDA_VERSION.match(v)]
        if bad:
            raise ValueError(f"CUDA versions are major.minor, e.g. 12.8; not {bad}")
        return sorted(set(versions), key=cuda_version)

    @model_validator(mode="after")
    def _one_selector(self) -> CudaChange:
        if self.gpu_type_id is not None and self.pool is not None:
            raise ValueError("give gpu_type_id or pool, not both")
        return self

    def gpu_types(self) -> list[tables.GpuTypeRow]:
        return [g for g in tables.GPU_TYPES
                if self.gpu_type_id in (None, g.id) and self.pool in (None, g.pool)]


class HostsCuda(BaseModel):
    """What `POST`, `GET /_localpod/cuda` answer."""

    hosts: dict[str, dict[str, list[str]]] = Field(
        description="GPU type id → datacenter offering it → the CUDA versions its hosts there run, sorted by "
        "version; every type and every datacenter offering it (an empty list: hosts that report none)."
    )
