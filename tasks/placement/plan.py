"""Everything a run attempt needs decided before anything is rented: the model pinned, the endpoint
request, the job input and its limits."""

from __future__ import annotations

import json
import math
from pathlib import Path

from huggingface_hub import HfApi, hf_hub_download, hf_hub_url
from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError
from loraflow_worker.contract import JobInput, ModelSource
from loraflow_worker.memory.model_shape import ModelShape, shape_from_config
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel, Field

from tasks.runpod.catalog import GpuClass, cuda_floor
from tasks.runpod.endpoints import build_create_request, endpoint_name
from tasks.runpod.jobs import WatchLimits
from tasks.runpod.models import RUNPOD_MAX_EXECUTION_TIMEOUT_S, RUNPOD_MAX_JOB_TTL_S, CreateEndpoint, JobPolicy
from tasks.settings import Settings
from tasks.placement.weight_cache import DataCenterCache

REQUIRE_CUDA_ENV = "LORAFLOW_REQUIRE_CUDA"
"""In a training endpoint's env: the worker fails the job within seconds when CUDA cannot start, instead of
training on the host's CPU (localpod's CPU workers lift it, saying so)."""

TEARDOWN_MARGIN_S = 5 * 60
"""RunPod's execution timeout and job TTL sit this far past the run's deadline, so the worker's own
deadline fires first and can save its results."""



def job_limits_s(remaining_s: int) -> tuple[int, int]:
    """The execution timeout and job TTL, in seconds, for a job with `remaining_s` left before the
    run's deadline. A job past its TTL is deleted even while running, so the TTL outlasts both."""
    return remaining_s + TEARDOWN_MARGIN_S, remaining_s + 2 * TEARDOWN_MARGIN_S


def max_deadline_minutes() -> int:
    """The longest run deadline whose execution timeout and job TTL stay within RunPod's maxima."""
    timeout_s, ttl_s = job_limits_s(0)
    return min(RUNPOD_MAX_EXECUTION_TIMEOUT_S - timeout_s, RUNPOD_MAX_JOB_TTL_S - ttl_s) // 60


DISK_MARGIN_GB = 10
"""Container disk a worker needs besides the model's files: the worker image, the dataset, checkpoints
and scratch."""


def _size(n_bytes: int) -> str:
    return f"{n_bytes / 1e9:.1f} GB" if n_bytes >= 100e6 else f"{n_bytes / 1e6:.1f} MB"


def _hub_model_problem(api: HfApi, model_id: str, sha: str, files: list, disk_gb: int | None) -> str | None:
    """Why the worker could not download the model onto its disk, or None. The worker downloads the
    whole snapshot, so every file counts."""
    if not files:
        return f"model.id {model_id!r} has no files at revision {sha}"
    if disk_gb is not None:
        size = sum(f.size or 0 for f in files)
        if size > (disk_gb - DISK_MARGIN_GB) * 1e9:
            return (f"model.id {model_id!r} is {_size(size)} of files, more than compute.disk_gb {disk_gb} GB "
                    f"leaves after {DISK_MARGIN_GB} GB for the worker image, data and checkpoints: set "
                    f"compute.disk_gb to at least {math.ceil(size / 1e9) + DISK_MARGIN_GB}")
    # model_info answers for gated repos too: ask for a file the way the download does.
    names = [f.rfilename for f in files]
    probe = "config.json" if "config.json" in names else names[0]
    try:
        api.get_hf_file_metadata(url=hf_hub_url(model_id, probe, revision=sha, endpoint=api.endpoint))
    except GatedRepoError:
        return (f"model.id {model_id!r} is gated and HF_TOKEN has not been granted access: accept its terms on "
                "the Hub with the token's account, or use another model")
    except RepositoryNotFoundError:
        return f"model.id {model_id!r}: HF_TOKEN cannot download its files (set a token that can read it)"
    return None


def resolve_model(model: ModelSource, settings: Settings | None = None, *, disk_gb: int | None = None) -> ModelSource:
    """A local directory becomes absolute; a Hub id is pinned to the commit its revision names now,
    so every attempt of the run trains the same weights. Unknown repos or revisions, gated models the
    token cannot download, and (given `disk_gb`) models too big for the worker's disk fail here, before
    anything is rented."""
    local = Path(model.id).expanduser()
    if local.is_dir():
        return ModelSource(id=str(local.resolve()), revision=None)
    if model.id.startswith(("/", ".", "~")):
        raise ValueError(f"model.id {model.id!r} looks like a local path but is not a directory")
    settings = settings or Settings()
    api = HfApi(endpoint=settings.hf_endpoint, token=settings.hf_token.get_secret_value() if settings.hf_token else None)
    try:
        info = api.model_info(model.id, revision=model.revision, files_metadata=True)
    except RepositoryNotFoundError as e:
        raise ValueError(f"model.id {model.id!r}: no such model on the Hub, or it is private and HF_TOKEN cannot read it") from e
    except RevisionNotFoundError as e:
        raise ValueError(f"model.revision {model.revision!r} does not exist in {model.id}") from e
    problem = _hub_model_problem(api, model.id, info.sha, list(info.siblings or []), disk_gb)
    if problem:
        raise ValueError(problem)
    return ModelSource(id=model.id, revision=info.sha)


def read_model_config(model: ModelSource, settings: Settings | None = None) -> dict:
    """The model's `config.json` (a resolved source: a local directory, or a Hub id pinned to a commit), for the
    memory plan. Raises OSError or ValueError when it cannot be read."""
    local = Path(model.id)
    if local.is_dir():
        return json.loads((local / "config.json").read_text())
    settings = settings or Settings()
    token = settings.hf_token.get_secret_value() if settings.hf_token else None
    path = hf_hub_download(model.id, "config.json", revision=model.revision, endpoint=settings.hf_endpoint, token=token)
    return json.loads(Path(path).read_text())


def resolve_base(model_id: str, settings: Settings, field: str) -> tuple[ModelSource, dict]:
    """A serve's or evaluation's base model pinned to its commit, and its `config.json`; ValueError naming `field`
    (the form's, e.g. `serve.base_model`) when either cannot be had."""
    try:
        base = resolve_model(ModelSource(id=model_id), settings)
        return base, read_model_config(base, settings)
    except ValueError as e:  # resolve_model names the train form's field
        raise ValueError(str(e).replace("model.revision", f"{field}'s revision").replace("model.id", field)) from e
    except (OSError, HfHubHTTPError) as e:
        raise ValueError(f"{field} {model_id!r}: its config.json cannot be read ({e})") from e


CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")
"""Where a config.json states the model's context; vLLM refuses a MAX_MODEL_LEN above it, at startup."""


def model_context(config: dict) -> int | None:
    """The model's context in tokens, as its `config.json` states it (the smallest stated); None when it states none."""
    return min((config[k] for k in CONTEXT_KEYS if isinstance(config.get(k), int)), default=None)


@task(name="read-model-shape", cache_policy=NO_CACHE)
def read_model_shape_task(model: ModelSource, hub_token_secret: str | None = None) -> ModelShape | None:
    """The model's shape for the memory plan, from its `config.json` alone (a Hub model's weights are not
    downloaded here); None, said in the log, when it cannot be read: the worker plans from the model it loads.
    `hub_token_secret`: the run's token block (`Settings.hub_token`)."""
    try:
        return shape_from_config(read_model_config(model, Settings().with_hub_token(hub_token_secret)))
    except (OSError, ValueError, HfHubHTTPError) as e:
        get_run_logger().warning("%s's config.json could not be read (%s: %s): the GPUs are not checked against the "
                                 "memory plan before renting", model.id, type(e).__name__, str(e)[:300])
        return None


@task(name="resolve-model", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=[5, 20],
      retry_condition_fn=lambda task, run, state: not isinstance(state.data, ValueError))
def resolve_model_task(model: ModelSource, disk_gb: int | None = None,
                       hub_token_secret: str | None = None) -> ModelSource:
    """`resolve_model` with the run's Hub token (`hub_token_secret`: its Secret block, `Settings.hub_token`)."""
    return resolve_model(model, Settings().with_hub_token(hub_token_secret), disk_gb=disk_gb)


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
    worker_env: dict[str, str],
    cache: DataCenterCache | None = None,
    settings: Settings | None = None,
) -> AttemptPlan:
    """`worker_env`: the endpoint's env (`steps.prepare_worker_env`), without the run's deadline. `cache`: a
    datacenter whose volume holds the model warm: the endpoint attaches it, which pins it there."""
    settings = settings or Settings()
    remaining = max(int(deadline_epoch_s - now), 1)
    execution_timeout_s, ttl_s = job_limits_s(remaining)
    name = endpoint_name(job_input.run_id, job_input.attempt, run_label, settings.control_plane_namespace())
    request = build_create_request(
        name=name,
        gpu=gpu,
        gpu_count=gpu_count,
        image=settings.worker_image(),
        # The worker exits by itself at the run's deadline, even if no job ever reaches it; and trains on the
        # GPU or fails at once: a CPU fallback on a RunPod host is a GPU bill for CPU speed.
        env=worker_env | {"LORAFLOW_RUN_DEADLINE_EPOCH_S": f"{deadline_epoch_s:.0f}", REQUIRE_CUDA_ENV: "1"},
        disk_gb=disk_gb,
        execution_timeout_s=execution_timeout_s,
        cuda_floor=cuda_floor(gpu, settings.loraflow_image_min_cuda),
        data_center_ids=[cache.data_center] if cache else None,
        network_volume_id=cache.volume_id if cache else None,
    )
    policy = JobPolicy(execution_timeout=execution_timeout_s * 1000, ttl=ttl_s * 1000)
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
