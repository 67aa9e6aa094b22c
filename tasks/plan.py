"""Everything a run attempt needs decided before anything is rented: the model pinned, the endpoint
request, the job input and its limits."""

from __future__ import annotations

from pathlib import Path

from huggingface_hub import HfApi
from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError
from loraflow_worker.contract import JobInput, ModelSource
from prefect import task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel, Field

from tasks.runpod.catalog import GpuClass
from tasks.runpod.endpoints import build_create_request, endpoint_name
from tasks.runpod.jobs import WatchLimits
from tasks.runpod.models import CreateEndpoint, JobPolicy
from tasks.settings import Settings

TEARDOWN_MARGIN_S = 5 * 60
"""RunPod's execution timeout and job TTL sit this far past the run's deadline, so the worker's own
deadline fires first and can save its results."""


def resolve_model(model: ModelSource, settings: Settings | None = None) -> ModelSource:
    """A local directory becomes absolute; a Hub id is pinned to the commit its revision names now,
    so every attempt of the run trains the same weights. Unknown repos or revisions fail here, before
    anything is rented."""
    local = Path(model.id).expanduser()
    if local.is_dir():
        return ModelSource(id=str(local.resolve()), revision=None)
    if model.id.startswith(("/", ".", "~")):
        raise ValueError(f"model.id {model.id!r} looks like a local path but is not a directory")
    settings = settings or Settings()
    api = HfApi(endpoint=settings.hf_endpoint, token=settings.hf_token.get_secret_value() if settings.hf_token else None)
    try:
        info = api.model_info(model.id, revision=model.revision)
    except RepositoryNotFoundError as e:
        raise ValueError(f"model.id {model.id!r}: no such model on the Hub, or it is private and HF_TOKEN cannot read it") from e
    except RevisionNotFoundError as e:
        raise ValueError(f"model.revision {model.revision!r} does not exist in {model.id}") from e
    return ModelSource(id=model.id, revision=info.sha)


@task(name="resolve-model", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=[5, 20],
      retry_condition_fn=lambda task, run, state: not isinstance(state.data, ValueError))
def resolve_model_task(model: ModelSource) -> ModelSource:
    return resolve_model(model)


class AttemptPlan(BaseModel):
    """One attempt of a run: which endpoint, which job, which limits."""

    run_id: str
    attempt: int
    endpoint_name: str
    gpu: GpuClass
    create_request: CreateEndpoint
    job_input: JobInput
    policy: JobPolicy
    limits: WatchLimits = Field(description="When the control plane gives up on this attempt.")


def plan_attempt(
    *,
    job_input: JobInput,
    run_label: str,
    gpu: GpuClass,
    gpu_count: int,
    disk_gb: int,
    deadline_epoch_s: float,
    now: float,
    queue_s: float,
    startup_s: float,
    stall_s: float,
    settings: Settings | None = None,
) -> AttemptPlan:
    settings = settings or Settings()
    remaining = max(int(deadline_epoch_s - now), 1)
    name = endpoint_name(job_input.run_id, job_input.attempt, run_label)
    request = build_create_request(
        name=name,
        gpu=gpu,
        gpu_count=gpu_count,
        image=settings.loraflow_worker_image,
        # The worker exits by itself at the run's deadline, even if no job ever reaches it.
        env=settings.worker_env() | {"LORAFLOW_RUN_DEADLINE_EPOCH_S": f"{deadline_epoch_s:.0f}"},
        disk_gb=disk_gb,
        execution_timeout_s=remaining + TEARDOWN_MARGIN_S,
        image_min_cuda=settings.loraflow_image_min_cuda,
    )
    # A job past its TTL is deleted even while running: the TTL must outlast the whole run.
    policy = JobPolicy(execution_timeout=(remaining + TEARDOWN_MARGIN_S) * 1000, ttl=(remaining + 2 * TEARDOWN_MARGIN_S) * 1000)
    return AttemptPlan(
        run_id=job_input.run_id,
        attempt=job_input.attempt,
        endpoint_name=name,
        gpu=gpu,
        create_request=request,
        job_input=job_input,
        policy=policy,
        limits=WatchLimits(deadline_epoch_s=deadline_epoch_s, queue_s=queue_s, startup_s=startup_s, stall_s=stall_s),
    )
