"""An `evaluate` job: one base model and its adapters asked the same task evaluations and benchmarks on ONE rented GPU
worker (`loraflow_worker.runtime` in mode `evaluate`), so that adapters of different runs, or of the Hub, are
compared on equal terms: the base answers once, and every adapter's scores are against those answers.

Placement, as a serve's (`tasks/placement/serving_fit.py`): the worker answers with vLLM and the adapters as LoRA
requests where it can, so the GPU must hold the base in bf16, a LoRA slot per adapter and one sequence's KV cache;
of the file's GPU classes the cheapest one in stock that does (and whose hosts run the image's CUDA), pinned to a
datacenter whose volume holds the base warm when there is one. The endpoint takes the path every rented job takes
(`tasks/jobs/rented.py`): one slot of the endpoint limit, RunPod's quota waited out, the job watched with the
endpoint's heartbeat, the endpoint deleted whatever happened (confirmed, else a record for the reconciler); it is
named after the flow run (`endpoint_name`), so the flow's crash and cancel hooks and the reconciler find it.
"""

from __future__ import annotations

import time

from loraflow_worker.artifacts import ArtifactNotFound, open_store
from loraflow_worker.contract import ModelSource
from loraflow_worker.contract.evaluate import EvaluatedAdapter, EvaluateInput, EvaluateResult
from prefect import get_run_logger
from pydantic import BaseModel, Field

from tasks.jobs.rented import rented_endpoint, run_job
from tasks.jobs.serve import serving_disk_gb
from tasks.lifecycle.steps import run_cancel_requested
from tasks.placement.cost import check_cost_cap
from tasks.placement.serving_fit import ServingMemory
from tasks.placement.weight_cache import DataCenterCache
from tasks.runpod.catalog import GpuClass
from tasks.runpod.endpoints import build_create_request, endpoint_name
from tasks.runpod.models import CreateEndpoint, JobStatus
from tasks.settings import Settings, make_client
from tasks.storage.artifacts import read_job_result
from tasks.storage.served_adapters import AdapterRefused, ServedAdapter

EVALUATE_LABEL = "eval-{name}"
"""The endpoint's label: `loraflow-eval-<name>-…`."""
EVALUATE_QUEUE_S = 20 * 60
"""How long the job may wait for a GPU worker to start."""
TEARDOWN_MARGIN_S = 300
"""RunPod's execution timeout past the job's own deadline: the worker stores what it has at the deadline."""


class EvaluatePlan(BaseModel):
    """Everything the evaluate flow decided before renting."""

    run_id: str = Field(description="The evaluate flow run's id: its results' folder and its endpoint's name.")
    name: str
    deadline: float = Field(description="Unix time by which the worker must have answered.")
    gpu: GpuClass = Field(description="The GPU class rented, pinned in its pool.")
    usd_per_hour: float
    memory: ServingMemory
    cache: DataCenterCache | None = Field(default=None, description="A volume holding the base warm, attached.")
    job_input: EvaluateInput

    def endpoint_name(self, namespace: str) -> str:
        return endpoint_name(self.run_id, 1, EVALUATE_LABEL.format(name=self.name.lower()), namespace)

    def describe(self) -> str:
        where = f", the base warm in {self.cache.data_center}" if self.cache else ""
        return f"{self.gpu.name} at ${self.usd_per_hour:.2f}/hr{where} ({self.memory.describe()})"


def check_evaluate_cost(gpu: str, usd_per_hour: float, deadline_minutes: int, budget_usd: float | None,
                        cap_usd: float | None) -> float:
    """The evaluation's cost ceiling (the GPU's price × `deadline_minutes`: the worker stops at the deadline), refused
    above the operator's cap (`LORAFLOW_MAX_RUN_USD`) or the file's `budget_usd`, naming the fields that lower it."""
    ceiling = usd_per_hour * deadline_minutes / 60
    what = f"the evaluation ({gpu} at ${usd_per_hour:.2f}/hr × evaluate.deadline_minutes {deadline_minutes})"
    check_cost_cap(ceiling, cap_usd, what, fix="lower evaluate.deadline_minutes or pick a cheaper GPU")
    if budget_usd is not None and ceiling > budget_usd:
        raise ValueError(f"{what} may cost up to ${ceiling:.2f}, above budget_usd ${budget_usd:.2f}: lower "
                         "evaluate.deadline_minutes, pick a cheaper GPU, or raise budget_usd")
    return ceiling


def evaluated_adapter(served: ServedAdapter, *, store_url: str, token: str | None, hub_endpoint: str | None,
                      field: str) -> EvaluatedAdapter:
    """The job's adapter for one checked adapter (`resolve_adapter`): a stored run pinned to the commit and hashes of
    its `result.json` (the worker refuses an adapter that differs), a Hub repo pinned to the commit read, or a local
    folder (local mode)."""
    if served.run_id is not None:
        store = open_store(store_url, token if store_url.startswith("hf://") else None, endpoint=hub_endpoint)
        try:
            result = read_job_result(store, served.run_id)
        except ArtifactNotFound as e:
            raise AdapterRefused(f"{field}: run {served.run_id} has no result.json in {store_url}: only a completed "
                                 "run can be evaluated") from e
        return EvaluatedAdapter(label=served.name, run_id=served.run_id, adapter_revision=result.revision,
                                adapter_sha256=result.adapter_sha256)
    return EvaluatedAdapter(label=served.name, source=ModelSource(id=served.path, revision=served.revision))


def evaluate_request(plan: EvaluatePlan, *, name: str, image: str, env: dict[str, str], image_min_cuda: str | None,
                     execution_timeout_s: int) -> CreateEndpoint:
    """The evaluation's endpoint: one worker on `plan.gpu`, in the warm volume's datacenter when there is one."""
    return build_create_request(
        name=name, gpu=plan.gpu, gpu_count=1, image=image, env=env, cuda_floor=image_min_cuda,
        disk_gb=serving_disk_gb(plan.memory.weights_bytes, base_on_volume=plan.cache is not None),
        execution_timeout_s=execution_timeout_s,
        data_center_ids=[plan.cache.data_center] if plan.cache else None,
        network_volume_id=plan.cache.volume_id if plan.cache else None)


class EvaluateJobFailed(RuntimeError):
    """The evaluate job did not return an `EvaluateResult` (cancelled, no worker in time, failed): its endpoint is
    deleted; the message says why."""


def run_evaluate_job(plan: EvaluatePlan, env: dict[str, str]) -> EvaluateResult:
    """Rent the plan's endpoint, run the job to its end and delete the endpoint whatever happened (see the module
    docstring). Raises `EvaluateJobFailed` when no result came back."""
    logger, settings = get_run_logger(), Settings()
    name = plan.endpoint_name(settings.control_plane_namespace())
    request = evaluate_request(plan, name=name, image=settings.worker_image(), env=env,
                               image_min_cuda=settings.loraflow_image_min_cuda,
                               execution_timeout_s=int(plan.deadline - time.time()) + TEARDOWN_MARGIN_S)
    said: list[str] = []

    def progress(status: JobStatus) -> None:
        message = (status.progress or {}).get("message")
        if message and (not said or said[-1] != message):
            said.append(message)
            logger.info("Evaluate: %s", message)

    logger.info("Renting %s as %s", plan.describe(), name)
    with rented_endpoint(name, plan.run_id, give_up_at=plan.deadline, logger=logger) as rental, \
            make_client(settings) as client:
        outcome = run_job(client, rental, request, plan.job_input, deadline_epoch_s=plan.deadline,
                          queue_s=EVALUATE_QUEUE_S, logger=logger, cancel_requested=run_cancel_requested,
                          on_status=progress)
    if outcome is None:
        raise EvaluateJobFailed("cancelled, or no room in RunPod's worker quota before the deadline: nothing was "
                                "evaluated; the endpoint is deleted")
    if outcome.kind != "completed":
        raise EvaluateJobFailed(f"the evaluate job ended {outcome.kind}: {outcome.error}")
    try:
        return EvaluateResult.model_validate(outcome.output)
    except ValueError as e:
        raise EvaluateJobFailed(f"the evaluate job's output is not an EvaluateResult: {e}") from e
