"""Typed RunPod payloads: the subset of API v2 and the job API that loraflow sends and reads.

Field names follow RunPod's official API v2 schema (camelCase on the wire, snake_case here). Request
models forbid unknown fields, as RunPod's schema does (`unevaluatedProperties: false`); response models
ignore fields we do not use, so a RunPod addition does not break a run.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

from pydantic import AliasGenerator, BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

_wire = AliasGenerator(serialization_alias=to_camel, validation_alias=to_camel)


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", alias_generator=_wire, populate_by_name=True)

    def to_wire(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


class _Response(BaseModel):
    model_config = ConfigDict(extra="ignore", alias_generator=_wire, populate_by_name=True)


class GpuRequest(_Request):
    pools: list[str] = Field(min_length=1, description="Serverless GPU pool ids, e.g. `ADA_24`.")
    excluded_types: list[str] | None = Field(default=None, description="GPU type ids removed from the pools.")
    count: int = Field(default=1, ge=1, description="GPUs per worker.")
    min_cuda_version: str | None = Field(default=None, description="Lowest acceptable CUDA version, `major.minor`.")


class CpuRequest(_Request):
    """One eligible CPU configuration of a CPU endpoint's workers (`CreateCpuConfig`)."""

    id: str = Field(min_length=1, description="CPU flavor id, as `GET /v2/catalog/cpus` lists it (e.g. `cpu5c`).")
    vcpu_count: int = Field(ge=2, description="vCPUs per worker: a power of two within the flavor's range.")


class Workers(_Request):
    min: int = Field(default=0, ge=0, description="Workers kept warm (billed while idle).")
    max: int = Field(default=1, ge=0, description="Worker cap; counts against the account quota even at zero load.")
    idle_timeout: int = Field(default=5, ge=1, le=3600, description="Seconds before an idle worker stops.")


class QueueDelayScaling(_Request):
    type: Literal["QUEUE_DELAY"] = "QUEUE_DELAY"
    queue_delay: float = Field(default=4, ge=0.5, description="Seconds a request may wait before another worker starts.")


class CreateEndpoint(_Request):
    """Body of `POST /v2/serverless`."""

    name: str = Field(min_length=1)
    type: Literal["QUEUE"] = "QUEUE"
    scaling: QueueDelayScaling = Field(default_factory=QueueDelayScaling)
    image: str = Field(min_length=1, description="Worker image reference.")
    env: dict[str, str] = Field(default_factory=dict)
    disk: int | None = Field(default=None, ge=1, description="Container disk in GB.")
    gpu: GpuRequest | None = Field(default=None, description="GPU workers; exactly one of `gpu` and `cpu`.")
    cpu: list[CpuRequest] | None = Field(default=None, min_length=1, description="CPU workers (RunPod's CPU "
                                         "serverless): eligible flavors and vCPU counts; exactly one of `gpu` and `cpu`.")
    workers: Workers = Field(default_factory=Workers)
    timeout: int = Field(description="Per-request execution timeout in milliseconds.")
    flashboot: Literal["OFF", "FLASHBOOT", "PRIORITY_FLASHBOOT"] = "FLASHBOOT"
    data_center_ids: list[str] | None = None
    network_volumes: list[str] | None = None

    @model_validator(mode="after")
    def _one_compute_family(self) -> CreateEndpoint:
        # RunPod refuses a create with both or neither (CreateEndpointRequest: `gpu` or `cpu`).
        if (self.gpu is None) == (self.cpu is None):
            raise ValueError("an endpoint takes exactly one of `gpu` (GPU workers) or `cpu` (CPU workers)")
        return self


class EndpointWorkers(_Response):
    min: int
    max: int
    idle_timeout: int | None = None


class EndpointGpu(_Response):
    """An endpoint's GPU selection as RunPod answers it (`EndpointGpuConfig`)."""

    pools: list[str] = Field(default_factory=list, description="GPU pool ids.")
    excluded_types: list[str] | None = Field(default=None, description="GPU type ids taken out of the pools.")
    min_cuda_version: str | None = Field(default=None, description="Lowest CUDA version of its hosts; None: no floor.")
    allowed_cuda_versions: list[str] | None = Field(default=None, description="CUDA versions its hosts may run; "
                                                    "empty or None: any.")


class EndpointCpu(_Response):
    """One of a CPU endpoint's eligible configurations (`CpuConfig`)."""

    id: str = Field(description="CPU flavor id.")
    vcpu_count: int = Field(description="vCPUs per worker.")


class Endpoint(_Response):
    """A serverless endpoint as `GET /v2/serverless/{id}` returns it."""

    id: str = Field(description="RunPod's endpoint id.")
    name: str = Field(description="The name loraflow gave it (derived from the run).")
    workers: EndpointWorkers
    created_at: str = Field(description="ISO 8601 creation time.")
    image: str | None = None
    timeout: int | None = None
    network_volumes: list[str] = Field(default_factory=list, description="Ids of the network volumes it attaches: "
                                       "`networkVolumes` (API v2), or REST v1's `networkVolumeId` / `networkVolumeIds`. "
                                       "RunPod documents no refusal to delete a volume an endpoint attaches.")
    env: dict[str, str] = Field(default_factory=dict, description="Its workers' environment: plain values and "
                                "`{{ RUNPOD_SECRET_<name> }}` references to account secrets.")
    gpu: EndpointGpu | None = Field(default=None, description="GPU workers' selection; None on a CPU endpoint (or an "
                                    "answer that names none).")
    cpu: list[EndpointCpu] | None = Field(default=None, description="CPU workers' configurations; None on a GPU "
                                          "endpoint (or an answer that names none).")

    @model_validator(mode="before")
    @classmethod
    def _volume_references(cls, data: Any) -> Any:
        # REST v1 named an endpoint's volume `networkVolumeId` (one id); a volume referenced under any of the names
        # is in use, and must not look free to the volumes flow.
        if not isinstance(data, dict) or not ({"networkVolumeId", "networkVolumeIds"} & data.keys()):
            return data
        single = data.get("networkVolumeId")
        ids = [*(data.get("networkVolumes") or ()), *(data.get("networkVolumeIds") or ()), *([single] if single else ())]
        return {**data, "networkVolumes": list(dict.fromkeys(v for v in ids if isinstance(v, str)))}


class Pagination(_Response):
    """Where a list continues (RunPod's newer API docs; absent from the vendored schema)."""

    next_cursor: str | None = Field(default=None, description="The `cursor` of the next page; None on the last.")


class EndpointList(_Response):
    endpoints: list[Endpoint]
    pagination: Pagination | None = Field(default=None, description="Absent or without a cursor on the last page.")


JobStatusName = Literal["IN_QUEUE", "IN_PROGRESS", "RUNNING", "COMPLETED", "FAILED", "CANCELLED", "TIMED_OUT"]
KNOWN_JOB_STATUSES: frozenset[str] = frozenset(get_args(JobStatusName))
TERMINAL_JOB_STATUSES: frozenset[str] = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMED_OUT"})
RUNNING_JOB_STATUSES: frozenset[str] = frozenset({"IN_PROGRESS", "RUNNING"})
"""A worker has the job: RunPod's job-states page lists RUNNING beside IN_PROGRESS."""


RUNPOD_MAX_EXECUTION_TIMEOUT_S = 7 * 24 * 3600
"""RunPod's longest execution timeout (endpoint `timeout`, job `policy.executionTimeout`): 7 days."""
RUNPOD_MAX_JOB_TTL_S = 7 * 24 * 3600
"""RunPod's longest job TTL (`policy.ttl`): 7 days, counted from submission."""


class JobPolicy(_Request):
    execution_timeout: int = Field(ge=5_000, description="Milliseconds the job may run.")
    ttl: int = Field(ge=10_000, description="Milliseconds from submission before RunPod deletes the job, even while running.")


class RunRequest(_Request):
    """Body of `POST /v2/{endpoint_id}/run`."""

    input: dict[str, Any]
    policy: JobPolicy | None = None


class JobStatus(_Response):
    """`/run`, `/status` and `/cancel` answers."""

    id: str
    # Not the Literal: RunPod may send a status its docs do not list yet, and a status this model refused would
    # end the watch of a live job. The watch treats an unknown one as running.
    status: str = Field(description="The job's status: one of `JobStatusName`, or another RunPod may send.")
    delay_time: int | None = Field(default=None, description="Milliseconds the job waited in the queue.")
    execution_time: int | None = Field(default=None, description="Milliseconds the job ran.")
    worker_id: str | None = None
    output: Any = Field(default=None, description="Handler output; a progress dict while IN_PROGRESS or RUNNING.")
    error: str | None = Field(default=None, description="A FAILED job's error; a worker exception arrives as a JSON string.")

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL_JOB_STATUSES

    @property
    def known(self) -> bool:
        return self.status in KNOWN_JOB_STATUSES

    @property
    def running(self) -> bool:
        """A worker has the job (IN_PROGRESS or RUNNING)."""
        return self.status in RUNNING_JOB_STATUSES

    @property
    def progress(self) -> dict[str, Any] | None:
        """The worker's latest progress update while the job runs; None otherwise."""
        return self.output if self.running and isinstance(self.output, dict) else None


# RunPod's official /health example shows only some counters (workers: idle, running): a counter it leaves out is
# None, not reported, and never read as 0.
class HealthJobs(_Response):
    completed: int | None = None
    failed: int | None = None
    in_progress: int | None = None
    in_queue: int | None = None
    retried: int | None = None


class HealthWorkers(_Response):
    idle: int | None = None
    initializing: int | None = None
    ready: int | None = None
    running: int | None = None
    throttled: int | None = None
    unhealthy: int | None = None


class EndpointWorker(_Response):
    """One worker of `GET /v2/serverless/{id}/workers` (`Worker`): where RunPod placed it."""

    id: str
    status: str = Field(description="RUNNING, IDLE, INITIALIZING, THROTTLED or UNHEALTHY (`WorkerStatus`).")
    data_center_id: str | None = Field(default=None, description="Its datacenter; None until it is placed.")
    gpu_type_id: str | None = Field(default=None, description="Its GPU type; None until placed, or on a CPU worker.")


class EndpointWorkerList(_Response):
    workers: list[EndpointWorker]


class Health(_Response):
    """`GET /v2/{endpoint_id}/health`."""

    jobs: HealthJobs = Field(default_factory=HealthJobs, description="Job counters; each None when not reported.")
    workers: HealthWorkers = Field(default_factory=HealthWorkers,
                                   description="Worker counters; each None when not reported.")


class CreateSecret(_Request):
    """Body of `POST /v2/account/secrets` (documented in RunPod's API v2 reference; not in the vendored schema)."""

    name: str = Field(min_length=1, max_length=191, pattern=r"^[a-zA-Z_][a-zA-Z0-9_.\-/]*$",
                      description="Referenced from env as `{{ RUNPOD_SECRET_<name> }}`; immutable.")
    value: str = Field(min_length=1, description="Write-only: RunPod never returns it.")
    description: str | None = Field(default=None, max_length=65535)


class Secret(_Response):
    """An account secret's metadata; its value is never returned."""

    id: str
    name: str
    description: str | None = None
    created_at: str | None = Field(default=None, description="ISO 8601 creation time.")


class CreateNetworkVolume(_Request):
    """Body of `POST /v2/network-volumes`."""

    name: str = Field(min_length=1, description="Not unique at RunPod: loraflow finds its volumes by name and datacenter.")
    size: int = Field(ge=10, le=4096, description="GB; a volume can grow, never shrink.")
    data_center: str = Field(min_length=1, description="Immutable: workers that mount the volume run only there.")
    type: Literal["STANDARD", "HIGH_PERFORMANCE"] | None = Field(
        default=None, description="Storage tier, immutable; None: the datacenter's default (RunPod's schema). "
        "loraflow asks for STANDARD: high-performance storage costs more.")


class UpdateNetworkVolume(_Request):
    """Body of `PATCH /v2/network-volumes/{id}`: a new name, or a larger size (never smaller); at least one."""

    size: int | None = Field(default=None, ge=10, le=4096)
    name: str | None = Field(default=None, min_length=1)


class NetworkVolume(_Response):
    id: str
    name: str
    size: int = Field(description="GB allocated.")
    data_center: str
    type: str | None = Field(default=None, description="Storage tier, `STANDARD` or `HIGH_PERFORMANCE`; immutable.")


class NetworkVolumeList(_Response):
    network_volumes: list[NetworkVolume]
    pagination: Pagination | None = Field(default=None, description="Absent or without a cursor on the last page.")


class NetworkVolumeBillingRecord(_Response):
    """One volume's charge over one time bucket (`GET /v2/billing/network-volumes`)."""

    network_volume_id: str
    start_time: str = Field(description="Start of the bucket, RFC 3339, inclusive.")
    end_time: str = Field(description="End of the bucket, RFC 3339, exclusive.")
    total_amount: float = Field(description="USD for the bucket, standard and high-performance storage together.")
    standard_amount: float = 0.0
    high_performance_amount: float = 0.0


class NetworkVolumeBilling(_Response):
    records: list[NetworkVolumeBillingRecord]
