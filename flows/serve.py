"""The `serve` flow: a base model and its LoRA adapters on RunPod's official vLLM worker, behind RunPod's OpenAI route,
for `hours` and within `budget_usd`; the flow run lives as long as the endpoint ([serving](../docs/serving.md)).

    RUNPOD_API_KEY=... HF_TOKEN=... .venv/bin/python -m flows.serve deployments/qwen-serve.toml
    prefect deployment run serve/qwen
    .venv/bin/python -m flows.serve --stop support-bot     # delete it before its time

Once the endpoint answers, the run prints `OpenAI base URL: <url>` and `models: <base>, <adapters>`: an OpenAI client
with that base URL and the RunPod key as its API key asks any of those models. Cancelling the run (the UI, the CLI,
`--stop`) deletes the endpoint, as the end of its hours and its budget do.

A serve file (the `spec` parameter, `ServeSpec`):

    name = "support-bot"
    artifact_store = "hf://datasets/your-org/loraflow-runs"   # where `runs/<id>` adapters are read
    hub_token_secret = "alice-hf-token"
    [serve]
    base_model = "Qwen/Qwen3-8B"
    adapters = ["runs/<run id>", "your-org/other-adapter"]    # or { name = "...", source = "..." }
    gpu = ["RTX 4090", "A100 SXM"]
    max_workers = 1
    idle_timeout_s = 60
    hours = 8
    budget_usd = 20
    prompts = ["..."]                                        # optional: what "try it" asks

The check (`check_serve`, below the flow) refuses, naming the field and the fix, what could not be served: a base or
adapter that cannot be read, an adapter vLLM refuses (DoRA, `modules_to_save`, the embeddings or head as targets, a
rank above 512), an adapter of another base, a context longer than the base's, a serve no GPU of its list
holds, one whose cost ceiling (price × max_workers × hours) passes the operator's cap, or whose `max_workers` passes
the endpoint limit.
"""

# No `from __future__ import annotations` here: Prefect builds the parameter model (the UI form) from
# the flow signature when it loads the entrypoint, and cannot resolve postponed annotations.
import sys
import time
import uuid

from loraflow_worker.evaluation.vllm_lora import max_lora_rank
from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run
from prefect.states import Cancelled, State
from pydantic import ValidationError

from flows.forms.run import RunSpec, SpecError, describe_validation_error
from flows.forms.serve import (
    DEFAULT_MAX_MODEL_LEN,
    DEFAULT_PROMPTS,
    MAX_PROMPTS,
    AdapterSpec,
    ServeSettings,
    ServeSpec,
    load_serve_file,
)
from tasks.jobs.serve import (
    SERVE_TAG,
    SERVING_TOKEN_ENV,
    VLLM_IMAGE_MIN_CUDA,
    ServeOutcome,
    ServePlan,
    announcer,
    publish_served_adapters,
    report_serve,
    serve_endpoint,
    serving_disk_gb,
    stop_serve,
)
from tasks.jobs.serve_watch import ServeStartFailed
from tasks.jobs.training import existing_volume_ids
from tasks.lifecycle.quota import ENDPOINT_LIMIT, ensure_endpoint_limit
from tasks.lifecycle.steps import prepare_worker_env
from tasks.lifecycle.teardown import delete_run_endpoints_hook
from tasks.placement.cost import check_cost_cap, read_gpu_prices
from tasks.placement.plan import model_context, resolve_base
from tasks.placement.serving_fit import choose_serving_gpu, serving_memory
from tasks.placement.weight_cache import warm_cache_for
from tasks.preflight.server_rules import ServerRuleError, check_inside_inputs_dir, operator_rule_problems
from tasks.reports.summary import tag_run
from tasks.runpod.catalog import cuda_floor, resolve_gpu
from tasks.runpod.endpoints import serving_endpoint_name
from tasks.settings import Settings, startup_problem
from tasks.storage.publish import PublishedModel
from tasks.storage.served_adapters import (
    is_local_path,
    resolve_adapter,
    run_adapter_refusals,
    run_prompts,
)

def _flow_run_name() -> str:
    return f"serve-{flow_run.parameters['spec'].name}"


# Each hook deletes the run's endpoint by name: the second layer of teardown, after `finally`.
@flow(name="serve", log_prints=True, flow_run_name=_flow_run_name, on_crashed=[delete_run_endpoints_hook],
      on_cancellation=[delete_run_endpoints_hook], on_failure=[delete_run_endpoints_hook])
def serve(spec: ServeSpec, serve_file: str | None = None, adapters: list[str] | None = None) -> ServeOutcome | State:
    """Serve a base model and its LoRA adapters from one RunPod endpoint of RunPod's vLLM worker:

    1. check: the base pinned, each adapter found, held to what vLLM loads and its rank read, the GPU memory estimated, the cheapest GPU of
       `serve.gpu` that holds it, a warm volume, the cost ceiling against the operator's cap (nothing is rented until
       this has passed);
    2. publish the stored runs of an hf:// store to private model repos, where the worker reads them;
    3. the workers' env: the Hub token as a RunPod account secret;
    4. rent: `max_workers` slots → the endpoint → its first answer (the cold start) → "try it" → watched until `hours`,
       `budget_usd` or a cancel → deleted, confirmed (`tasks/jobs/serve.py`);
    5. the summary.

    Args:
        spec: The serve, as a deployment's parameters or a serve file give it.
        serve_file: A TOML serve file (e.g. `deployments/qwen-serve.toml`) whose spec replaces `spec`.
        adapters: Replaces `serve.adapters`: sources (`runs/<run id>`, `<org>/<repo>`), each served under its last
            part, so that `--param 'adapters=["runs/<id>"]'` serves another run without repeating the spec.
    """
    run_id = flow_run.id or str(uuid.uuid4())
    if serve_file is not None:
        # Before it is read: a path outside the inputs folder could name the control plane's own files.
        check_inside_inputs_dir("parameter serve_file", serve_file, Settings())
        spec = load_serve_file(serve_file)
    if adapters is not None:
        spec = ServeSpec.model_validate(spec.model_dump() | {"serve": spec.serve.model_dump() | {"adapters": adapters}})
    if flow_run.id:
        tag_run(run_id, [SERVE_TAG.format(name=spec.name)])
    plan = check_serve(spec, run_id)  # nothing is rented until this has passed
    plan.adapters = publish_served_adapters(plan.adapters, spec.hub_token_secret)
    worker_env = prepare_worker_env(spec.hub_token_secret, token_env=SERVING_TOKEN_ENV)
    try:
        outcome = serve_endpoint(plan, worker_env, announce=announcer(plan))
    except ServeStartFailed as e:
        report_serve(plan, None, error=str(e))
        raise
    report_serve(plan, outcome)
    if outcome.ended == "cancelled":
        return Cancelled(message=f"Serve {spec.name}: {outcome.reason}; its endpoint is deleted")
    return outcome


@task(name="check-serve", cache_policy=NO_CACHE)
def check_serve(spec: ServeSpec, run_id: str) -> ServePlan:
    """Everything decided before renting (see the module docstring); a refusal names the field and the fix."""
    logger, settings = get_run_logger(), Settings()
    serve = spec.serve
    local_ok = not settings.workers_are_runpods()
    local = [(f"serve.adapters[{i}].source", a.source) for i, a in enumerate(serve.adapters) if is_local_path(a.source)]
    if problems := operator_rule_problems(local, hub_token_secret=spec.hub_token_secret, settings=settings):
        raise ServerRuleError("refused by this server's rules, before anything was rented: " + "; ".join(problems))
    if not local_ok and is_local_path(serve.base_model):
        raise ValueError(f"serve.base_model {serve.base_model!r} is a folder of this machine, which RunPod's workers "
                         "cannot read: push the model to the Hub and name its id")
    hub = settings.with_hub_token(spec.hub_token_secret)
    token = hub.hf_token.get_secret_value() if hub.hf_token else None
    base, config = resolve_base(serve.base_model, hub, "serve.base_model")
    context = model_context(config)
    max_model_len = serving_length(serve.max_model_len, context, base=serve.base_model)
    if serve.max_tokens >= max_model_len:
        raise ValueError(f"serve.max_tokens {serve.max_tokens} leaves no room for a prompt within {serve.base_model}'s "
                         f"context of {max_model_len} tokens: lower serve.max_tokens")
    adapters = [resolve_adapter(a.source, a.name, base_model=base.id, store_url=spec.artifact_store, token=token,
                                hub_endpoint=settings.hf_endpoint, local_ok=local_ok,
                                field=f"serve.adapters[{i}]") for i, a in enumerate(serve.adapters)]
    for adapter in adapters:
        if adapter.run_id is None and adapter.trained_on and adapter.trained_on != base.id \
                and not is_local_path(adapter.trained_on):
            logger.warning("Adapter %s says it was trained on %s, not %s: vLLM does not check, and serves it on "
                           "the base it is given", adapter.name, adapter.trained_on, base.id)
    try:
        rank = max_lora_rank([a.rank for a in adapters])
    except ValueError as e:
        raise ValueError(f"serve.adapters: {e}") from e
    memory = serving_memory(config, max_model_len=max_model_len, max_loras=len(adapters), max_lora_rank=rank)
    gpus = [resolve_gpu(name) for name in serve.gpu]
    offers = {o.gpu: o for o in read_gpu_prices(gpus, [cuda_floor(g, VLLM_IMAGE_MIN_CUDA) for g in gpus])}
    gpu, passed = choose_serving_gpu(gpus, offers, memory, VLLM_IMAGE_MIN_CUDA)
    for reason in passed:
        logger.info("Not renting %s", reason)
    price = offers[gpu.name].usd_per_hour
    check_serve_cap(serve, gpu.name, price, settings.loraflow_max_run_usd)
    slots = ensure_endpoint_limit()
    if serve.max_workers > slots:
        raise ValueError(f"serve.max_workers {serve.max_workers} is above the {ENDPOINT_LIMIT} limit's {slots} slots "
                         "(the account's worker quota): the endpoint would never get them; lower serve.max_workers")
    cache = None if base.revision is None else warm_cache_for(
        base.id, base.revision, offers[gpu.name].in_stock_data_centers(), existing_volumes=existing_volume_ids,
        logger=logger)
    prompts = serve.prompts or _run_prompts(spec, adapters, token, settings.hf_endpoint) or DEFAULT_PROMPTS
    expires_at = time.time() + serve.hours * 3600
    logger.info("Serving %s with %d adapter(s) (MAX_LORA_RANK %d) on %s at $%.2f/hr, up to %d worker(s), until %s: "
                "%s%s", base.id, len(adapters), rank, gpu.name, price, serve.max_workers,
                time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(expires_at)), memory.describe(),
                f"; the base is warm in {cache.data_center}" if cache else "")
    return ServePlan(
        run_id=run_id, name=spec.name, expires_at=expires_at, base_model=base.id, base_revision=base.revision,
        endpoint_name=serving_endpoint_name(run_id, spec.name, settings.control_plane_namespace(), expires_at),
        adapters=adapters, max_lora_rank=rank, max_model_len=max_model_len, memory=memory, gpu=gpu,
        usd_per_hour=price, passed_over=passed, cache=cache, max_workers=serve.max_workers,
        idle_timeout_s=serve.idle_timeout_s, budget_usd=serve.budget_usd, prompts=prompts,
        max_tokens=serve.max_tokens, cold_start_s=serve.cold_start_minutes * 60,
        disk_gb=serving_disk_gb(memory.weights_bytes, base_on_volume=cache is not None),
        hub_token_secret=spec.hub_token_secret)


def serving_length(asked: int | None, context: int | None, *, base: str) -> int:
    """`MAX_MODEL_LEN`: as asked, refused above the base's context (vLLM refuses it at startup); when not asked,
    `DEFAULT_MAX_MODEL_LEN` or the base's context where that is shorter."""
    if asked is None:
        return min(DEFAULT_MAX_MODEL_LEN, context or DEFAULT_MAX_MODEL_LEN)
    if context is not None and asked > context:
        raise ValueError(f"serve.max_model_len {asked} is above {base}'s context of {context} tokens, which vLLM "
                         f"refuses at startup: set it to at most {context}, or leave it out")
    return asked


def check_serve_cap(serve: ServeSettings, gpu: str, usd_per_hour: float, cap_usd: float | None) -> None:
    """Refuse a serve whose cost ceiling (price × `max_workers` × `hours`) passes the operator's cap on a run
    (`LORAFLOW_MAX_RUN_USD`), as a run's is refused: its `budget_usd` ends it only once spent."""
    check_cost_cap(usd_per_hour * serve.max_workers * serve.hours, cap_usd,
                   f"the serve ({gpu} at ${usd_per_hour:.2f}/hr × serve.max_workers {serve.max_workers} × serve.hours "
                   f"{serve.hours:g})", fix="lower serve.hours or serve.max_workers")


def serve_trained(spec: RunSpec, run_id: str, name: str, published: PublishedModel | None) -> State | None:
    """`[publish.serve]` of a completed run (or of a study's best child, `run_id` and `name` its own): its adapter
    served on its base by this flow, as a subflow, until the serve ends. The adapter is the run's own, `runs/<id>` of
    its store (from an hf:// store, its private repo `<org>/loraflow-<run id>`, which nothing else writes), never
    `publish.hub_model_id`, which later runs commit to; it answers to `name`. Never raises: the run's adapter is
    stored (and published) already, so an adapter vLLM would refuse, or a serve that cannot start, is a warning of
    the completed run, not its failure. The serve's end state."""
    logger = get_run_logger()
    wanted = spec.publish.serve if spec.publish is not None else None
    if wanted is None:
        return None
    source = f"runs/{run_id}"
    if refused := run_adapter_refusals(spec.lora.model_dump()):
        logger.warning("The adapter is not served (nothing was rented): vLLM refuses it (%s); merge it into the base "
                       "and serve the merged model", "; ".join(refused))
        return None
    length = (spec.grpo.max_prompt_length + spec.grpo.max_completion_length if spec.grpo is not None
              else spec.training.max_seq_length)
    try:
        serve_spec = ServeSpec(
            name=name, artifact_store=spec.artifact_store, hub_token_secret=spec.hub_token_secret,
            serve=ServeSettings(base_model=spec.model.id, adapters=[AdapterSpec(source=source, name=name)],
                                gpu=wanted.gpu or spec.compute.gpu, max_workers=wanted.max_workers,
                                idle_timeout_s=wanted.idle_timeout_s, hours=wanted.hours,
                                budget_usd=wanted.budget_usd or spec.budget_usd,
                                max_model_len=(max_model_len := wanted.max_model_len or max(length, 64)),
                                max_tokens=min(128, max_model_len // 2)))
    except ValidationError as e:
        logger.warning("The adapter is not served: %s", describe_validation_error(e, "publish.serve"))
        return None
    print(f"Serving {name} ({source}) on {spec.model.id} for {wanted.hours:g} h: `python -m flows.serve --stop "
          f"{name}` ends it sooner", flush=True)
    state = serve(serve_spec, return_state=True)
    if not (state.is_completed() or state.is_cancelled()):
        logger.warning("The adapter was not served: %s (the run's adapter is stored%s)", state.message,
                       f" and published to {published.hub_model_id}" if published and not published.error else "")
    return state


def _run_prompts(spec: ServeSpec, adapters: list, token: str | None, hub_endpoint: str | None) -> list[str]:
    """The evaluation prompts of the first adapter run that stored some."""
    for adapter in adapters:
        if adapter.run_id is not None and spec.artifact_store is not None:
            if prompts := run_prompts(spec.artifact_store, adapter.run_id, token, hub_endpoint, MAX_PROMPTS):
                return prompts
    return []


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--stop":
        if problem := startup_problem():
            sys.exit(problem)
        deleted = stop_serve(sys.argv[2])
        print(f"serve {sys.argv[2]}: its runs cancelled; endpoints deleted: {', '.join(deleted) or 'none left'}")
        sys.exit(0)
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        sys.exit("usage: python -m flows.serve SERVE_FILE.toml | python -m flows.serve --stop NAME")
    try:
        serve_spec = load_serve_file(sys.argv[1])
    except SpecError as e:
        sys.exit(str(e))
    if problem := startup_problem():
        sys.exit(problem)
    final = serve(serve_spec, return_state=True)
    print(f"flow run {final.state_details.flow_run_id}: {final.name}", flush=True)
    sys.exit(0 if final.is_completed() else 1)
