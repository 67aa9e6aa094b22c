"""A completed run's adapter merged into its base model and published as a plain Hub model repo (`[publish]
merged_model_id`), by a `merge` job (`loraflow_worker.runtime.merge`) on a RunPod CPU endpoint of its own.

Why a CPU endpoint, not the training worker before its teardown: the merge and the upload (16 GB for an 8B model)
are CPU- and network-bound, and on the training worker they would bill minutes at the GPU's rate (~20-50× a CPU
worker's); a study knows its best child only after every child's worker is gone, and a merge job on its own endpoint
can merge any stored adapter, later. The cost: the CPU worker downloads the base again.

Sizing (`choose_merge_compute`): the worker holds the base in bf16 (parameters × 2 bytes, the parameters counted from
the model's `config.json`), the adapter merged into it in place, and one safetensors shard being written; it needs
`merge_ram_gb` of RAM, and `merge_disk_gb` of container disk. Of RunPod's CPU flavors (read as it offers them to
serverless) with stock somewhere, each at the fewest vCPUs (a power of two) whose RAM (vCPUs × the flavor's RAM per
vCPU) and container-disk limit (vCPUs × the flavor's GB per vCPU) hold that, the cheapest per hour is rented. A
serverless CPU worker has at most 8 vCPUs, whatever the catalog's range (`SERVERLESS_CPU_MAX_VCPUS`), so a model over
about 11 B parameters fits none: it is refused before the run's training is rented (`check_merge_fits`), naming its
needs and the largest serverless worker of each flavor.

The endpoint is named as every loraflow endpoint (`endpoint_name`), after the flow run that runs the merge with the
label `merge-<run name>`, so that flow's crash and cancel hooks (`delete_run_endpoints_hook`) and the reconciler
find it without memory. It takes the path every rented job takes (`tasks/jobs/rented.py`): one slot of the
`runpod-endpoints` limit from before its create until its delete is confirmed, deleted whatever happened (an
unconfirmed delete keeps a slot and a record for the reconciler).

`merge_run_adapter` is the one entry a flow calls, for any completed stored run (the train flow for its own run,
the study flow for its best child); it never raises: a failed merge is `MergedModel.error`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any, Literal

from loraflow_worker.artifacts import ArtifactNotFound, open_store
from loraflow_worker.contract import (
    CONTRACT_VERSION,
    JobResult,
    LogitsCheck,
    MergeInput,
    MergeResult,
    ModelSource,
    run_prefix,
)
from loraflow_worker.memory.model_shape import shape_from_config
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run
from pydantic import BaseModel, Field

from tasks.jobs.rented import rented_endpoint, run_job
from tasks.lifecycle.steps import prepare_worker_env, run_cancel_requested
from tasks.placement.cost import check_cost_cap
from tasks.placement.image_contract import check_image_contract
from tasks.placement.plan import read_model_config
from tasks.runpod.catalog import SERVERLESS_CPU_MAX_VCPUS, cpu_flavor_id
from tasks.runpod.endpoints import build_cpu_create_request, endpoint_name
from tasks.runpod.errors import RunpodError
from tasks.runpod.jobs import JobOutcome
from tasks.runpod.live_catalog import CatalogCpuType, read_cpu_types, read_data_centers
from tasks.runpod.models import CreateEndpoint, JobStatus
from tasks.settings import Settings, make_client
from tasks.storage.artifacts import read_job_result

BF16_BYTES = 2
MERGE_RAM_FACTOR = 1.2
"""RAM per byte of bf16 weights: the weights once (the merge is in place; the adapter is small), and a fifth more for
the allocator's slack and the logits on the probe inputs."""
MERGE_RAM_OVERHEAD_GB = 4.0
"""RAM on top: the safetensors shard being written, held in memory once more (`MAX_SHARD_SIZE`, 2 GB), and the
Python process with torch, transformers and the tokenizer."""
MERGE_DISK_FACTOR = 3
"""Container disk per byte of bf16 weights: the base as downloaded (up to twice that, for fp32 checkpoints) and the
merged model saved for the upload."""
MERGE_DISK_OVERHEAD_GB = 10
MERGE_DEADLINE_S = 3 * 3600
"""How long a merge may take, queueing included: an 8B model is a download and an upload of 16 GB each."""
MERGE_QUEUE_S = 30 * 60
"""How long the merge job may wait for a CPU worker to start."""
MERGE_LABEL = "merge-{run_name}"


class MergeRefused(ValueError):
    """The merge cannot run as asked (the model too large for every serverless CPU worker, no CPU flavor in stock, no
    stored run): nothing was rented. The message says what to change."""


class MergeCompute(BaseModel):
    """The CPU worker a merge runs on."""

    flavor: str = Field(description="RunPod's CPU flavor id as an endpoint's `cpu[].id` takes it, e.g. `cpu3g`.")
    vcpu_count: int = Field(description="vCPUs of the worker (a power of two, at most `SERVERLESS_CPU_MAX_VCPUS`).")
    ram_gb: float = Field(description="Its RAM: vCPUs × the flavor's RAM per vCPU.")
    usd_per_hour: float = Field(description="Its serverless price per hour, USD.")
    needed_ram_gb: float = Field(description="The RAM the merge needs (`merge_ram_gb`).")

    def describe(self) -> str:
        return f"CPU {self.flavor} × {self.vcpu_count} vCPU ({self.ram_gb:g} GB RAM, ${self.usd_per_hour:.3f}/hr)"


class MergedModel(BaseModel):
    """Where a run's merged model was published, the logits check, where the merge ran; or why it failed."""

    merged_model_id: str = Field(description="The Hub model repo, `<org>/<name>`.")
    url: str | None = Field(default=None, description="The repo's page; None when the merge failed.")
    commit_url: str | None = Field(default=None, description="The commit that holds this run's merged model.")
    already_merged: bool = Field(default=False, description="The repo had this run's merge already (a retry).")
    logits_check: LogitsCheck | None = Field(
        default=None, description="The merged model's logits against base + adapter's, as the merge job checked them; "
        "None when the job did not get that far.")
    ran_on: str | None = Field(default=None, description="The CPU worker it ran on (`MergeCompute.describe`); None "
                               "when nothing was rented.")
    endpoint_name: str | None = Field(default=None, description="The merge's endpoint (deleted afterwards).")
    seconds: float | None = Field(default=None, description="Seconds the merge job ran on its worker.")
    error: str | None = Field(default=None, description="Why the merge failed; None when it succeeded.")

    def check_line(self) -> str:
        """The logits check in a few words, e.g. `max |Δlogit| 0.0031 ≤ 0.094 over 3 inputs`."""
        check = self.logits_check
        if check is None:
            return "not checked"
        effect = (f" (the adapter moves them by up to {check.adapter_effect:.3g})"
                  if check.adapter_effect is not None else "")
        return f"max |Δlogit| {check.max_abs_difference:.3g} ≤ {check.tolerance:.3g} over {check.inputs} inputs{effect}"


def merge_ram_gb(parameters: int) -> float:
    """GB of RAM a merge of a model of `parameters` needs (see the module docstring)."""
    return parameters * BF16_BYTES / 1e9 * MERGE_RAM_FACTOR + MERGE_RAM_OVERHEAD_GB


def merge_disk_gb(parameters: int) -> int:
    """GB of container disk a merge of a model of `parameters` needs."""
    return math.ceil(parameters * BF16_BYTES / 1e9 * MERGE_DISK_FACTOR) + MERGE_DISK_OVERHEAD_GB


def choose_merge_compute(parameters: int, cpu_types: list[CatalogCpuType], in_stock: set[str] | None = None,
                         model: str = "the model") -> MergeCompute:
    """The cheapest serverless CPU worker that holds the merge of a model of `parameters`: of each flavor (those whose
    flavor id is in `in_stock`, when given), the fewest vCPUs (`CatalogCpuType.serverless_vcpus`) whose RAM is
    `merge_ram_gb` and whose container-disk limit is `merge_disk_gb`. Raises `MergeRefused` naming the model's needs
    and the largest serverless worker of each flavor on offer when none holds it."""
    needed = merge_ram_gb(parameters)
    disk = merge_disk_gb(parameters)
    offered = [f for f in cpu_types if in_stock is None or f.flavor in in_stock]
    choices = []
    for flavor in offered:
        vcpus = flavor.serverless_vcpus(needed, disk)
        if vcpus is not None:
            choices.append(MergeCompute(flavor=flavor.flavor, vcpu_count=vcpus, ram_gb=vcpus * flavor.ram_gb_per_vcpu,
                                        usd_per_hour=round(flavor.price.serverless_per_vcpu * vcpus, 4),
                                        needed_ram_gb=round(needed, 1)))
    if choices:
        return min(choices, key=lambda c: (c.usd_per_hour, c.flavor))
    if not offered:
        raise MergeRefused(f"no CPU flavor of RunPod's catalog is in stock in any datacenter: the merge of {model} "
                           "cannot run now; merge the stored run later (`merge_run_adapter`)")
    largest = "; ".join(f"{f.flavor} × {f.serverless_vcpu_max} vCPU: {f.serverless_vcpu_max * f.ram_gb_per_vcpu:g} GB "
                        f"RAM, {f.serverless_vcpu_max * f.disk_gb_per_vcpu} GB disk" for f in offered)
    raise MergeRefused(
        f"the merge of {model} ({parameters / 1e9:.1f} B parameters, {parameters * BF16_BYTES / 1e9:.1f} GB in bf16) "
        f"needs {needed:.0f} GB of RAM and {disk} GB of container disk; a serverless CPU worker has at most "
        f"{SERVERLESS_CPU_MAX_VCPUS} vCPUs, and the largest of each flavor on offer holds less ({largest}): merge it "
        "elsewhere, or remove publish.merged_model_id")


def check_merge_fits(parameters: int, model: str) -> None:
    """Before renting the run: a model no serverless CPU worker can merge is refused (`MergeRefused`, naming
    `publish.merged_model_id`), with the limits the merge itself sizes by (`choose_merge_compute`), whatever the stock,
    which may change before the run ends. A catalog that cannot be read leaves the question to the merge itself."""
    try:
        with make_client() as client:
            cpu_types = read_cpu_types(client)
    except RunpodError as e:
        get_run_logger().warning("RunPod's CPU catalog could not be read (%s): whether a CPU worker can merge %s is "
                                 "known only when the merge runs", e, model)
        return
    try:
        choose_merge_compute(parameters, cpu_types, None, model=model)
    except MergeRefused as e:
        raise MergeRefused(f"publish.merged_model_id: {e}") from None


def merge_request(*, name: str, compute: MergeCompute, image: str, env: dict[str, str], disk_gb: int,
                  execution_timeout_s: int) -> CreateEndpoint:
    """The merge's endpoint: one worker of `compute`, in any datacenter (a merge needs no volume)."""
    return build_cpu_create_request(name=name, cpu_flavor=compute.flavor, vcpu_count=compute.vcpu_count, image=image,
                                    env=env, disk_gb=disk_gb, execution_timeout_s=execution_timeout_s)


def read_merge_source(store: Any, run_id: str) -> tuple[ModelSource, Literal["none", "4bit"]]:
    """The base model (id and revision) and the run's `lora.quantization`, from the run's stored manifest. Raises
    `MergeRefused` when the run stored no manifest or no adapter (it did not complete)."""
    prefix = run_prefix(run_id)
    try:
        manifest = store.read_json(f"{prefix}/manifest.json")
    except ArtifactNotFound as e:
        raise MergeRefused(f"run {run_id} has no manifest in {store.url}: only a completed run can be merged") from e
    if not store.exists(f"{prefix}/adapter/adapter_config.json"):
        raise MergeRefused(f"run {run_id} has no adapter in {store.url}: only a completed run can be merged")
    job = manifest.get("job") if isinstance(manifest.get("job"), dict) else {}
    lora = job.get("lora") if isinstance(job.get("lora"), dict) else {}
    base = ModelSource(id=str(manifest["base_model_id"]), revision=manifest.get("base_model_revision"))
    return base, "4bit" if lora.get("quantization") == "4bit" else "none"


def merge_progress_logger(logger: Any) -> Callable[[JobStatus], None]:
    """An `on_status` that logs each new progress message of the merge worker once."""
    said: list[str] = []

    def on_status(status: JobStatus) -> None:
        message = (status.progress or {}).get("message")
        if message and (not said or said[-1] != message):
            said.append(message)
            logger.info("Merge: %s", message)

    return on_status


def merged_of(merged_model_id: str, outcome: JobOutcome | None, compute: MergeCompute, name: str) -> MergedModel:
    """A `MergedModel` from the merge job's outcome."""
    where = {"merged_model_id": merged_model_id, "ran_on": compute.describe(), "endpoint_name": name}
    if outcome is None:
        return MergedModel(error="cancelled, or no room in RunPod's worker quota before the merge's time budget ran "
                           "out", **where)
    if outcome.kind != "completed":
        return MergedModel(error=f"the merge job ended {outcome.kind}: {outcome.error}", **where)
    try:
        result = MergeResult.model_validate(outcome.output)
    except ValueError as e:
        return MergedModel(error=f"the merge job's output is not a MergeResult: {e}", **where)
    return MergedModel(url=result.url, commit_url=result.commit_url, already_merged=result.already_merged,
                       logits_check=result.logits_check, seconds=result.seconds, **where)


@task(name="merge-adapter", cache_policy=NO_CACHE)
def merge_adapter_task(store_url: str, run_id: str, run_name: str, merged_model_id: str, private: bool,
                       hub_token_secret: str | None = None, adapter_repo: str | None = None,
                       result: JobResult | None = None) -> MergedModel:
    """Merge run `run_id`'s stored adapter into its base and publish it to `merged_model_id` (see the module
    docstring): the worker sized, its endpoint rented under one slot of the endpoint limit, the job watched, the
    endpoint deleted (confirmed) whatever happened. The job pins the adapter to `result`'s commit and hashes (None:
    the run's stored `result.json`), and the worker refuses one that differs. Raises `MergeRefused` before renting;
    a job that failed is `MergedModel.error`."""
    logger = get_run_logger()
    settings = Settings()
    token = settings.hub_token(hub_token_secret)
    store = open_store(store_url, token if store_url.startswith("hf://") else None, endpoint=settings.hf_endpoint)
    base, quantization = read_merge_source(store, run_id)
    if result is None:
        try:
            result = read_job_result(store, run_id)
        except ArtifactNotFound as e:
            raise MergeRefused(f"run {run_id} has no result.json in {store.url}: only a completed run can be "
                               "merged") from e
    parameters = shape_from_config(read_model_config(base, settings.with_hub_token(hub_token_secret))).parameters
    image = settings.worker_image()
    check_image_contract(image)  # a stale image would refuse the job only once the worker has started
    with make_client(settings) as client:
        cpu_types = read_cpu_types(client)
        in_stock = {cpu_flavor_id(offered.id) for dc in read_data_centers(client, cpus=True)
                    for offered in dc.cpu_availability if offered.availability != "NONE"}
    compute = choose_merge_compute(parameters, cpu_types, in_stock, model=base.id)
    try:
        check_cost_cap(compute.usd_per_hour * MERGE_DEADLINE_S / 3600, settings.loraflow_max_run_usd,
                       f"the merge of run {run_name} ({compute.describe()} for up to {MERGE_DEADLINE_S // 3600} h)")
    except ValueError as e:
        raise MergeRefused(str(e)) from None
    owner = flow_run.id or run_id  # the flow run doing the merge: its hooks and the reconciler know it by name
    name = endpoint_name(owner, 1, MERGE_LABEL.format(run_name=run_name), settings.control_plane_namespace())
    logger.info("Merging run %s into %s (%.1f B parameters): renting %s as %s", run_name, base.id, parameters / 1e9,
                compute.describe(), name)
    deadline = time.time() + MERGE_DEADLINE_S
    job_input = MergeInput(contract_version=CONTRACT_VERSION, mode="merge", run_id=run_id, run_name=run_name,
                           artifact_store=store_url, base_model=base, quantization=quantization,
                           merged_model_id=merged_model_id, private=private, adapter_repo=adapter_repo,
                           adapter_revision=result.revision, adapter_sha256=result.adapter_sha256,
                           deadline_epoch_s=deadline)
    env = prepare_worker_env(hub_token_secret)
    request = merge_request(name=name, compute=compute, image=image, env=env, disk_gb=merge_disk_gb(parameters),
                            execution_timeout_s=MERGE_DEADLINE_S + 300)
    with rented_endpoint(name, owner, give_up_at=deadline, logger=logger) as rental, make_client(settings) as client:
        outcome = run_job(client, rental, request, job_input, deadline_epoch_s=deadline, queue_s=MERGE_QUEUE_S,
                          logger=logger, cancel_requested=run_cancel_requested,
                          on_status=merge_progress_logger(logger))
    merged = merged_of(merged_model_id, outcome, compute, name)
    if merged.error:
        logger.warning("The merged model was not published to %s: %s", merged_model_id, merged.error)
    else:
        logger.info("Merged model: %s (%s)%s", merged.url, merged.check_line(),
                    " — this run's merge was there already" if merged.already_merged else "")
    return merged


def merge_run_adapter(store_url: str, run_id: str, run_name: str, merged_model_id: str, *, private: bool = True,
                      hub_token_secret: str | None = None, adapter_repo: str | None = None,
                      result: JobResult | None = None) -> MergedModel:
    """Merge a completed stored run's adapter into its base and publish it as the Hub model repo `merged_model_id`,
    from inside a flow; never raises.

    `store_url`: the run's artifact store; `run_id`, `run_name`: the run (its id names its files, its name labels the
    card and the endpoint); `private`: create the repo private; `hub_token_secret`: the Prefect Secret block of the
    Hub token the worker writes with (None: the flow's `HF_TOKEN`); `adapter_repo`: the run's published adapter
    repo, for the card (None: the card names the adapter's URL in the store); `result`: the run's result (the
    flow's `RunResults.result`, from the job's own output), whose commit and hashes pin the adapter the worker merges
    (None: the run's stored `result.json`). The base model and its revision come from the run's stored manifest. A
    failure, before renting or of the job, comes back as `MergedModel.error`."""
    state = merge_adapter_task(store_url, run_id, run_name, merged_model_id, private, hub_token_secret, adapter_repo,
                               result, return_state=True)
    if state.is_completed():
        return state.result()
    error = state.result(raise_on_failure=False)
    return MergedModel(merged_model_id=merged_model_id, error=f"{type(error).__name__}: {error}")
