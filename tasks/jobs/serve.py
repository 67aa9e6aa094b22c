"""A serve: a base model and its LoRA adapters on one RunPod serverless endpoint of RunPod's official vLLM worker, for
`hours`, on the path every rented job takes (`tasks/jobs/rented.py`):

1. `max_workers` slots of the `runpod-endpoints` limit, held for as long as the endpoint lives (RunPod counts an
   endpoint's `workers.max` against the account's quota, scaled to zero or not);
2. the endpoint (`serving_request`): the worker image pinned below, `workers.min = 0`, `workers.max = max_workers`,
   the chosen GPU class on hosts that run the image's CUDA, in the datacenter of a volume that holds the base warm
   when there is one (attached, and the worker's Hugging Face cache pointed at it), the adapters by environment
   (`serving_env`), the Hub token as a RunPod account secret; named with its expiry (`serving_endpoint_name`), so the
   reconciler keeps it until then and deletes it after, from its name alone;
3. its first answer (the cold start: `serve_watch.first_answer`, which says what is wrong when the workers crash-loop
   rather than wait), the "try it" prompts, then the watch (`serve_watch.watch_serving`: cancel, expiry, budget, the
   endpoint's heartbeat for the reconciler);
4. the endpoint deleted whatever happened, confirmed.

`ServePlan` holds what the check decided (`flows/serve.py`, `check_serve`); `serve_endpoint` is steps 1-4.
"""

from __future__ import annotations

import math
import re
import shlex
import time
from collections.abc import Callable
from typing import Literal

from prefect import get_client, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.filters import FlowFilter, FlowFilterName, FlowRunFilter, FlowRunFilterState, \
    FlowRunFilterStateType, FlowRunFilterTags
from prefect.client.schemas.objects import StateType
from prefect.states import Cancelling
from pydantic import BaseModel, Field

from tasks.jobs import serve_watch
from tasks.jobs.rented import rented_endpoint
from tasks.lifecycle.quota import remember_named_quota, wait_for_runpod_quota
from tasks.lifecycle.steps import create_endpoint, run_cancel_requested
from tasks.lifecycle.teardown import delete_run_endpoints
from tasks.placement.serving_fit import ServingMemory
from tasks.placement.weight_cache import DataCenterCache
from tasks.reports import events
from tasks.runpod.catalog import GpuClass, cuda_floor
from tasks.runpod.endpoints import build_create_request, delete_endpoint_confirmed, parse_endpoint_name
from tasks.runpod.models import CreateEndpoint, Endpoint, Workers
from tasks.runpod.volumes import volume_name
from tasks.settings import Settings, make_client
from tasks.storage.publish import publish_adapter
from tasks.storage.served_adapters import ServedAdapter

# The vLLM worker's tag, pinned here and nowhere else: v2.25.2 = vLLM 0.27.1, runpod-workers/worker-vllm @7a92503,
# 2026-08-20; v2.24+ runs `vllm serve` and reads LORA_MODULES as one `--lora-modules` argument (serving.md §1, §2).
VLLM_WORKER_IMAGE = "runpod/worker-v1-vllm:v2.25.2"
VLLM_IMAGE_MIN_CUDA = "13.0"  # RunPod's Hub template pins allowedCudaVersions ["13.0"] for v2.19+ (serving.md §1)
SERVING_TOKEN_ENV = "HUGGING_FACE_HUB_TOKEN"
"""The worker's token variable: `HF_TOKEN` also matches vLLM's `--hf-token`, and the worker logs its whole command
line (serving.md §2); huggingface_hub reads `HUGGING_FACE_HUB_TOKEN` when `HF_TOKEN` is unset."""
VOLUME_HF_HOME = "/runpod-volume/huggingface"
"""Where loraflow's preload keeps a volume's Hub cache (`<volume>/huggingface/hub`, `loraflow_worker.runtime.
model_cache`). The image bakes HF_HOME and HUGGINGFACE_HUB_CACHE under /runpod-volume/huggingface-cache (serving.md
§2), and huggingface_hub takes HF_HUB_CACHE over HUGGINGFACE_HUB_CACHE over HF_HOME/hub (its `constants.py`): all
three are set, or the baked cache variable would keep the worker off the warm copy."""
REQUEST_TIMEOUT_S = 600
"""The endpoint's execution timeout per request (`timeout`): a chat answer takes seconds; a stuck one is ended."""
TEMPLATE_DISK_GB = 150
"""The container disk RunPod's own template for this image asks (`containerDiskInGb` of runpod-workers/worker-vllm's
`.runpod/hub.json` at v2.25.2; serving.md §5): the least a serve asks for."""
IMAGE_GB = 30
"""The image unpacked on the worker's disk: vLLM with its CUDA 13 torch and kernels (vllm/vllm-openai's image, which
worker-vllm builds on, is about 12 GB compressed on Docker Hub; unpacked layers take about twice that). An estimate."""
VLLM_CACHES_GB = 10
"""vLLM's own caches, written at every cold start unless a volume keeps them: torch.compile's and CUDA graphs'
(`VLLM_CACHE_ROOT`, worker-vllm's src/compile_cache.py), FlashInfer's JIT kernels, the adapters' downloads."""


def serving_disk_gb(weights_bytes: int, *, base_on_volume: bool) -> int:
    """The endpoint's container disk: the image, vLLM's caches and the base's weights (unless a volume holds them:
    the worker's Hub cache is then the volume's), never less than RunPod's own template asks (`TEMPLATE_DISK_GB`)."""
    weights_gb = 0 if base_on_volume else math.ceil(weights_bytes / 1e9)
    return max(TEMPLATE_DISK_GB, IMAGE_GB + VLLM_CACHES_GB + weights_gb)


class ServePlan(BaseModel):
    """Everything a serve decided before renting (`flows/serve.py` `check_serve`)."""

    run_id: str = Field(description="The serve's flow run id: its endpoint's name carries its hash.")
    name: str = Field(description="The serve's name (`name` of the serve file).")
    endpoint_name: str
    expires_at: float = Field(description="Unix time at which the endpoint is deleted (`hours` after the check).")
    base_model: str = Field(description="A Hub model id, or a local folder (local mode).")
    base_revision: str | None = Field(description="The Hub commit the base is pinned to; None for a folder.")
    adapters: list[ServedAdapter]
    max_lora_rank: int = Field(description="`MAX_LORA_RANK`: the smallest vLLM accepts ≥ every adapter's rank.")
    max_model_len: int
    memory: ServingMemory
    gpu: GpuClass
    usd_per_hour: float = Field(description="The GPU's serverless price per worker-hour.")
    passed_over: list[str] = Field(default_factory=list, description="Why the serve's other GPU classes were not taken.")
    cache: DataCenterCache | None = Field(default=None, description="A volume holding the base warm, attached.")
    max_workers: int
    idle_timeout_s: int
    budget_usd: float
    prompts: list[str]
    max_tokens: int
    cold_start_s: float = Field(description="How long the first request may wait for a worker to answer.")
    disk_gb: int
    hub_token_secret: str | None = Field(default=None, description="The serve's Secret block of its Hub token (the "
                                         "watch reads the adapters' repos with it); None: the flow's HF_TOKEN.")

    @property
    def models(self) -> list[str]:
        """The model names the endpoint answers to: the base (as MODEL_NAME), then each adapter."""
        return [self.base_model, *(a.name for a in self.adapters)]


def lora_env(adapters: list[ServedAdapter]) -> dict[str, str]:
    """The adapters as the worker reads them: one as `LORA_MODULES=name=path`; several as `VLLM_EXTRA_ARGS=
    --lora-modules a=x b=y`, since the worker passes LORA_MODULES as ONE `--lora-modules` argument and a JSON array
    there stops `vllm serve` at startup (serving.md §2)."""
    modules = [f"{a.name}={a.path}" for a in adapters]
    if len(modules) == 1:
        return {"LORA_MODULES": modules[0]}
    return {"VLLM_EXTRA_ARGS": shlex.join(["--lora-modules", *modules])}


def serving_env(plan: ServePlan, worker_env: dict[str, str]) -> dict[str, str]:
    """The endpoint's env: `worker_env` (the Hub's URL and token reference, `prepare_worker_env`), the base and its
    length, LoRA on with a slot per adapter at `MAX_LORA_RANK`, the adapters, the warm volume's cache, and RunPod's
    allowance for a slow start, on both clocks that end one: RunPod marks a worker that starts for longer than 7 min
    unhealthy (`RUNPOD_INIT_TIMEOUT`, serving.md §4), and the worker gives up on `vllm serve` after 1,200 s
    (`VLLM_STARTUP_TIMEOUT`, serving.md §2)."""
    env = worker_env | {"MODEL_NAME": plan.base_model, "MAX_MODEL_LEN": str(plan.max_model_len),
                        "ENABLE_LORA": "true", "MAX_LORAS": str(len(plan.adapters)),
                        "MAX_LORA_RANK": str(plan.max_lora_rank),
                        "RUNPOD_INIT_TIMEOUT": str(math.ceil(plan.cold_start_s)),
                        "VLLM_STARTUP_TIMEOUT": str(math.ceil(plan.cold_start_s))} | lora_env(plan.adapters)
    if plan.base_revision:
        env["MODEL_REVISION"] = plan.base_revision
    if plan.cache is not None:
        hub = f"{VOLUME_HF_HOME}/hub"
        env |= {"HF_HOME": VOLUME_HF_HOME, "HF_HUB_CACHE": hub, "HUGGINGFACE_HUB_CACHE": hub}
    return env


def serving_request(plan: ServePlan, env: dict[str, str]) -> CreateEndpoint:
    """The endpoint: one GPU of the plan's class per worker, up to `max_workers` of them, none kept warm."""
    request = build_create_request(
        name=plan.endpoint_name, gpu=plan.gpu, gpu_count=1, image=VLLM_WORKER_IMAGE, env=env, disk_gb=plan.disk_gb,
        execution_timeout_s=REQUEST_TIMEOUT_S, cuda_floor=cuda_floor(plan.gpu, VLLM_IMAGE_MIN_CUDA),
        data_center_ids=[plan.cache.data_center] if plan.cache else None,
        network_volume_id=plan.cache.volume_id if plan.cache else None)
    # QUEUE_DELAY scaling (the request's default): RunPod refuses idleTimeout on REQUEST_COUNT (serving.md §5).
    return request.model_copy(update={"workers": Workers(min=0, max=plan.max_workers,
                                                          idle_timeout=plan.idle_timeout_s)})


def openai_base_url(endpoint_id: str, settings: Settings | None = None) -> str:
    """`<job API>/<endpoint id>/openai/v1`: RunPod's OpenAI-compatible route (serving.md §3)."""
    return f"{(settings or Settings()).runpod_job_url.rstrip('/')}/{endpoint_id}/openai/v1"


Ending = Literal["expired", "budget", "cancelled", "lost"]


class ServeOutcome(BaseModel):
    """How a serve went."""

    endpoint_name: str
    endpoint_id: str | None = None
    base_url: str | None = Field(default=None, description="The OpenAI base URL, once the endpoint answered.")
    models: list[str] = Field(default_factory=list)
    cold_start_s: float | None = Field(default=None, description="From the first request to its answer.")
    tried: serve_watch.TryReport | None = None
    cost_usd: float | None = Field(default=None, description="Billed (or counted, if more) when the watch ended.")
    ended: Ending | None = None
    reason: str = ""
    deleted: bool = False


@task(name="publish-served-adapters", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=[10, 60])
def publish_served_adapters(adapters: list[ServedAdapter], hub_token_secret: str | None) -> list[ServedAdapter]:
    """Publish each stored run of an hf:// store to its private model repo (`ServedAdapter.path`), where the worker
    reads it; nothing is committed again for a run published there already. The adapters as served: a published one
    at the commit that holds its adapter (`revision`, which the watch holds the repo to)."""
    settings = Settings()
    token = settings.hub_token(hub_token_secret)
    served = []
    for adapter in adapters:
        if adapter.publish_from is None or adapter.run_id is None:
            served.append(adapter)
            continue
        published = publish_adapter(adapter.publish_from, adapter.run_id, adapter.run_id, adapter.path, private=True,
                                    token=token, endpoint=settings.hf_endpoint)
        get_run_logger().info("Run %s's adapter is served from %s%s", adapter.run_id, published.url,
                              " (published there already)" if published.already_published else "")
        commit = (published.commit_url or "").rstrip("/").rpartition("/commit/")[2] or None
        served.append(adapter.model_copy(update={"revision": commit}))
    return served


def serve_endpoint(plan: ServePlan, worker_env: dict[str, str],
                   announce: Callable[[ServeOutcome], None] = lambda outcome: None) -> ServeOutcome:
    """Steps 1-4 of the module docstring. `announce` hears the outcome once the endpoint has answered (its URL and
    models). Raises `serve_watch.ServeStartFailed` (after the teardown) when no worker answered the first request."""
    logger = get_run_logger()
    outcome = ServeOutcome(endpoint_name=plan.endpoint_name)
    request = serving_request(plan, serving_env(plan, worker_env))
    with rented_endpoint(plan.endpoint_name, plan.run_id, give_up_at=plan.expires_at - 60, logger=logger,
                         slots=plan.max_workers) as rental:
        if run_cancel_requested():
            outcome.ended, outcome.reason = "cancelled", "cancelled while it waited for endpoint slots"
            return outcome
        endpoint = wait_for_runpod_quota(lambda: create_endpoint(request), give_up_at=plan.expires_at - 60,
                                         cancel_requested=run_cancel_requested, logger=logger,
                                         on_quota_named=remember_named_quota)
        if endpoint is None:
            outcome.ended, outcome.reason = "cancelled", "cancelled while it waited for room in RunPod's quota"
            return outcome
        rental.endpoint, outcome.endpoint_id = endpoint, endpoint.id
        if plan.cache is not None:
            _volume_used(plan)
        _serve(plan, endpoint, outcome, announce)
    outcome.deleted = rental.deleted
    return outcome


def _serve(plan: ServePlan, endpoint: Endpoint, outcome: ServeOutcome,
           announce: Callable[[ServeOutcome], None]) -> None:
    logger = get_run_logger()
    # The cold-start allowance ends with the serve's own time: an endpoint past its expiry serves nothing.
    allowance_s = max(0.0, min(plan.cold_start_s, plan.expires_at - time.time()))
    first = serve_watch.first_answer_task(endpoint, plan.base_model, plan.prompts[0], plan.max_tokens, allowance_s,
                                          plan.max_lora_rank, plan.gpu.name)
    if first is None:
        outcome.ended, outcome.reason = "cancelled", "cancelled before the endpoint answered"
        return
    outcome.cold_start_s = first
    outcome.base_url, outcome.models = openai_base_url(endpoint.id), plan.models
    logger.info("Endpoint %s answered its first request %.0f s after it was sent", endpoint.name, first)
    announce(outcome)
    outcome.tried = serve_watch.try_it_task(outcome.base_url, plan.models, plan.prompts, plan.max_tokens,
                                            f"{summary_key(plan.name)}-answers")
    outcome.ended, outcome.reason, outcome.cost_usd = serve_watch.watch_serving_task(
        endpoint, plan.expires_at, plan.budget_usd, plan.usd_per_hour,
        {a.name: (a.path, a.revision) for a in plan.adapters if a.revision}, plan.hub_token_secret)


def _volume_used(plan: ServePlan) -> None:
    """`loraflow.volume.used`: the volumes flow keeps a volume a serve reads."""
    assert plan.cache is not None
    try:
        name = volume_name(plan.cache.data_center, Settings().control_plane_namespace())
    except Exception:  # noqa: BLE001 - the name only labels the event
        name = plan.cache.volume_id
    events.volume_used(plan.cache.volume_id, name, plan.cache.data_center, by="serve", run_id=plan.run_id)


def announcer(plan: ServePlan) -> Callable[[ServeOutcome], None]:
    """What the serve says once its endpoint answers: the two lines a user copies into an OpenAI client, and the
    summary so far."""

    def announce(outcome: ServeOutcome) -> None:
        print(f"OpenAI base URL: {outcome.base_url}", flush=True)
        print(f"models: {', '.join(outcome.models)}", flush=True)
        report_serve(plan, outcome)

    return announce


@task(name="report-serve", cache_policy=NO_CACHE)
def report_serve(plan: ServePlan, outcome: ServeOutcome | None, error: str | None = None) -> str:
    """The serve's summary artifact (`summary_key`): where it runs, how to reach it, what it cost, how it ended."""
    where = (f"{plan.cache.data_center}, the base warm on volume {plan.cache.volume_id}" if plan.cache
             else "any datacenter with stock (the base downloaded by each new worker)")
    rows = [("endpoint", f"`{plan.endpoint_name}`" + (f" ({outcome.endpoint_id})" if outcome and outcome.endpoint_id
                                                     else "")),
            ("OpenAI base URL", f"`{outcome.base_url}`" if outcome and outcome.base_url else "not answering yet"),
            ("models", ", ".join(f"`{m}`" for m in plan.models)),
            ("image", f"`{VLLM_WORKER_IMAGE}`, MAX_LORA_RANK {plan.max_lora_rank}, MAX_MODEL_LEN {plan.max_model_len}"),
            ("GPU", f"{plan.gpu.name} at ${plan.usd_per_hour:.2f}/hr per worker, up to {plan.max_workers}, idle "
                    f"{plan.idle_timeout_s} s; memory {plan.memory.describe()}"),
            ("where", where),
            ("expires", serve_watch.utc(plan.expires_at) + f"; budget ${plan.budget_usd:g}")]
    if outcome is not None and outcome.cold_start_s is not None:
        rows.append(("cold start", f"{outcome.cold_start_s:.1f} s from the first request to its answer"))
    if outcome is not None and outcome.tried is not None:
        tried = outcome.tried
        rows.append(("try it", f"{len(tried.answers)} answers, {tried.completion_tokens} tokens in {tried.seconds:.1f} s"
                               f" = {tried.tokens_per_s:.1f} tokens/s (one request at a time)"))
    if outcome is not None and outcome.cost_usd is not None:
        rows.append(("cost", f"${outcome.cost_usd:.4f} when the watch ended"))
    if outcome is not None and outcome.ended is not None:
        rows.append(("ended", f"{outcome.ended}: {outcome.reason}; endpoint "
                              f"{'deleted' if outcome.deleted else 'NOT confirmed deleted (the reconciler retries)'}"))
    if error:
        rows.append(("failed", error))
    markdown = f"## Serve `{plan.name}`\n\n| | |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows)
    create_markdown_artifact(markdown=markdown, key=summary_key(plan.name), description=f"Serve {plan.name}")
    return markdown


SERVE_TAG = "serve:{name}"
"""The tag of a serve's flow run: `--stop NAME` finds the runs by it."""
LIVE_STATES = [StateType.SCHEDULED, StateType.PENDING, StateType.RUNNING, StateType.PAUSED, StateType.CANCELLING]


def stop_serve(name: str, *, wait_s: float = 60.0, sleep: Callable[[float], None] = time.sleep) -> list[str]:
    """`python -m flows.serve --stop NAME`: cancel every live `serve` flow run tagged `serve:NAME` (its watch sees the
    cancel and deletes its endpoint; a worker's runner kills it and its cancellation hook does), wait up to `wait_s`
    for them to end, then delete (confirmed) whatever endpoint of those runs is left, and any serving endpoint of this
    control plane labelled NAME whose run is gone. Returns the endpoint names deleted here."""
    with get_client(sync_client=True) as prefect:
        runs = prefect.read_flow_runs(
            flow_filter=FlowFilter(name=FlowFilterName(any_=["serve"])),
            flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[SERVE_TAG.format(name=name)]),
                                          state=FlowRunFilterState(type=FlowRunFilterStateType(any_=LIVE_STATES))))
        for run in runs:
            prefect.set_flow_run_state(run.id, Cancelling(message=f"stopped with --stop {name}"), force=True)
        deadline = time.monotonic() + wait_s
        while runs and time.monotonic() < deadline and any(
                not (state := prefect.read_flow_run(run.id).state) or not state.is_final() for run in runs):
            sleep(2.0)
    deleted = []
    for run in runs:
        deleted += delete_run_endpoints(str(run.id))
    namespace = Settings().control_plane_namespace()
    with make_client() as client:
        for endpoint in client.list_endpoints():
            parsed = parse_endpoint_name(endpoint.name)
            if parsed and parsed.serving and parsed.namespace == namespace and parsed.label == _label(name):
                delete_endpoint_confirmed(client, endpoint.id)
                deleted.append(endpoint.id)
    return list(dict.fromkeys(deleted))


def _label(name: str) -> str:
    # As `endpoint_name` cleans a label (a long one is cut in the name, and then not matched here: its run is).
    return re.sub(r"-{2,}", "-", re.sub(r"[^a-z0-9-]", "-", name.lower())).strip("-")


def summary_key(name: str) -> str:
    """The serve's summary artifact key: lowercase letters, digits and dashes (Prefect's rule)."""
    return f"serve-{_label(name)}"[:60].strip("-")
