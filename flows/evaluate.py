"""The `evaluate` flow: a base model and any of its LoRA adapters (stored runs, Hub repos) asked the same task
evaluations and benchmarks on ONE rented GPU worker, and ranked into a leaderboard, best first
([evaluation](../docs/evaluation.md) "Compare adapters").

    RUNPOD_API_KEY=... HF_TOKEN=... .venv/bin/python -m flows.evaluate deployments/qwen-evaluate.toml
    prefect deployment run evaluate/qwen

An evaluate file (the `spec` parameter, `EvaluateSpec`):

    name = "support-bots"
    artifact_store = "hf://datasets/your-org/loraflow-runs"   # results, and where `runs/<id>` adapters are read
    budget_usd = 5
    [evaluate]
    base_model = "Qwen/Qwen3-8B"
    adapters = ["runs/<run id>", "your-org/other-adapter"]    # or { name = "...", source = "..." }
    gpu = ["RTX 4090", "A100 SXM"]
    [[evaluate.tasks]]                                       # as a run's [[evaluation.tasks]]
    name = "refunds"
    local_file = "refunds.jsonl"
    graders = ["contains"]

With `evaluate.openai_base_url` (and `openai_api_key_secret`), nothing is rented: each prompt is asked of the base and
each adapter by model name through that endpoint's OpenAI route, graded here by the built-in graders.

`check_evaluate` refuses, naming the field and the fix, before anything is rented: what this server's rules refuse,
a task file, grader or benchmark a run's `[evaluation]` would be refused for, an adapter that cannot be read, is of
another base or that vLLM would refuse, a GPU list none of whose cards holds the base, a cost ceiling (price ×
`deadline_minutes`) above `budget_usd` or the operator's cap.
"""

# No `from __future__ import annotations` here: Prefect builds the parameter model (the UI form) from
# the flow signature when it loads the entrypoint, and cannot resolve postponed annotations.
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path

from loraflow_worker.artifacts import open_store
from loraflow_worker.contract import ModelSource, run_prefix
from loraflow_worker.contract.evaluate import EvaluateInput, EvaluateResult
from loraflow_worker.contract.task_evaluation import task_prompt
from loraflow_worker.evaluation.vllm_lora import max_lora_rank
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run

from flows.forms.evaluate import SECTION, EvaluateSpec, load_evaluate_file
from flows.forms.run import SpecError
from flows.train_check import check_task_inputs, job_tasks
from tasks.jobs.endpoint_evaluation import (
    EndpointTask,
    check_served_models,
    endpoint_client,
    evaluate_endpoint,
    read_api_key,
    store_endpoint_results,
)
from tasks.jobs.evaluate import EvaluatePlan, check_evaluate_cost, evaluated_adapter, run_evaluate_job
from tasks.jobs.training import existing_volume_ids
from tasks.lifecycle.quota import ensure_endpoint_limit
from tasks.lifecycle.steps import prepare_worker_env
from tasks.lifecycle.teardown import delete_run_endpoints_hook
from tasks.lifecycle.worker_env import read_run_secrets
from tasks.placement.cost import read_gpu_prices
from tasks.placement.image_contract import check_image_contract
from tasks.placement.plan import model_context, resolve_base
from tasks.placement.serving_fit import choose_serving_gpu, serving_memory
from tasks.placement.weight_cache import warm_cache_for
from tasks.preflight.server_rules import check_inside_inputs_dir, check_server_rules
from tasks.preflight.task_files import check_task_lengths_task
from tasks.reports import events
from tasks.reports.leaderboard import Leaderboard, leaderboard
from tasks.reports.summary import tag_run
from tasks.runpod.catalog import cuda_floor, resolve_gpu
from tasks.settings import Settings, startup_problem
from tasks.storage.artifacts import publish_run_inputs
from tasks.storage.run_files import RunFile, read_run_files
from tasks.storage.served_adapters import is_local_path, resolve_adapter

EVALUATE_TAG = "evaluate:{name}"
MAX_MODEL_LEN = 8192
"""The longest prompt + answer the worker's vLLM is sized for (its KV cache), or the base's context where shorter."""


def _flow_run_name() -> str:
    return f"evaluate-{flow_run.parameters['spec'].name}"


# Each hook deletes the run's endpoint by name: the second layer of teardown, after `finally`.
@flow(name="evaluate", log_prints=True, flow_run_name=_flow_run_name, on_crashed=[delete_run_endpoints_hook],
      on_cancellation=[delete_run_endpoints_hook], on_failure=[delete_run_endpoints_hook])
def evaluate(spec: EvaluateSpec, evaluate_file: str | None = None) -> Leaderboard:
    """Compare a base model and its LoRA adapters on the same task evaluations and benchmarks:

    1. check: this server's rules, the task files, graders and benchmarks (as a run's), the base pinned, each adapter
       found, pinned and of the base, the GPU that holds them, the cost against the budget and the operator's cap
       (nothing is rented until this has passed); the task files stored, pinned by their hashes;
    2. rent one GPU worker, ask every task and benchmark of the base and each adapter, delete the worker
       (`tasks/jobs/evaluate.py`); or, with `openai_base_url`, ask the endpoint instead;
    3. the leaderboard: an artifact, its lines printed, a `loraflow.run.evaluated` event per adapter and score.

    Args:
        spec: The evaluation, as a deployment's parameters or an evaluate file give it.
        evaluate_file: A TOML evaluate file (e.g. `deployments/qwen-evaluate.toml`) whose spec replaces `spec`.
    """
    run_id = flow_run.id or str(uuid.uuid4())
    if evaluate_file is not None:
        # Before it is read: a path outside the inputs folder could name the control plane's own files.
        check_inside_inputs_dir("parameter evaluate_file", evaluate_file, Settings())
        spec = load_evaluate_file(evaluate_file)
    if flow_run.id:
        tag_run(run_id, [EVALUATE_TAG.format(name=spec.name)])
    if spec.evaluate.openai_base_url is not None:
        result = ask_endpoint(spec, run_id)
    else:
        plan, env = check_evaluate(spec, run_id)  # nothing is rented until this has passed
        result = rent_and_evaluate(plan, env)
    return report_leaderboard(spec, run_id, result)


@task(name="check-evaluate", cache_policy=NO_CACHE)
def check_evaluate(spec: EvaluateSpec, run_id: str) -> tuple[EvaluatePlan, dict[str, str]]:
    """Everything decided before renting (see the module docstring); a refusal names the field and the fix. Returns
    the plan and the worker's env."""
    logger, settings = get_run_logger(), Settings()
    evaluate = spec.evaluate
    deadline = time.time() + evaluate.deadline_minutes * 60
    local_ok = not settings.workers_are_runpods()
    # Before any of its files is read: whether this server lets the evaluation read them at all.
    check_server_rules(spec.local_paths(), artifact_store=spec.artifact_store, hub_token_secret=spec.hub_token_secret,
                       settings=settings, worker_secrets=spec.worker.secrets)
    if not local_ok and is_local_path(evaluate.base_model):
        raise ValueError(f"evaluate.base_model {evaluate.base_model!r} is a folder of this machine, which RunPod's "
                         "workers cannot read: push the model to the Hub and name its id")
    read_run_secrets(spec.worker.secrets)
    check_image_contract(settings.worker_image())  # a stale image would refuse the job only once a GPU was rented
    hub = settings.with_hub_token(spec.hub_token_secret)
    token = hub.hf_token.get_secret_value() if hub.hf_token else None
    base, config = resolve_base(evaluate.base_model, hub, "evaluate.base_model")
    served = [resolve_adapter(a.source, label, base_model=base.id, store_url=spec.artifact_store, token=token,
                              hub_endpoint=settings.hf_endpoint, local_ok=local_ok, field=f"evaluate.adapters[{i}]")
              for i, (a, label) in enumerate(zip(evaluate.adapters, evaluate.labels(), strict=True))]
    for adapter in served:
        if adapter.run_id is None and adapter.trained_on and adapter.trained_on != base.id \
                and not is_local_path(adapter.trained_on):
            logger.warning("Adapter %s says it was trained on %s, not %s", adapter.name, adapter.trained_on, base.id)
    adapters = [evaluated_adapter(a, store_url=spec.artifact_store, token=token, hub_endpoint=settings.hf_endpoint,
                                  field=f"evaluate.adapters[{i}]") for i, a in enumerate(served)]
    try:
        rank = max_lora_rank([a.rank for a in served])
    except ValueError as e:
        raise ValueError(f"evaluate.adapters: {e}") from e
    context = model_context(config)
    memory = serving_memory(config, max_model_len=min(MAX_MODEL_LEN, context or MAX_MODEL_LEN),
                            max_loras=len(served), max_lora_rank=rank)
    gpus = [resolve_gpu(name) for name in evaluate.gpu]
    image_cuda = settings.loraflow_image_min_cuda
    offers = {o.gpu: o for o in read_gpu_prices(gpus, [cuda_floor(g, image_cuda) for g in gpus])}
    gpu, passed = choose_serving_gpu(gpus, offers, memory, image_cuda, field="evaluate.gpu",
                                     smaller="evaluate fewer adapters")
    for reason in passed:
        logger.info("Not renting %s", reason)
    price = offers[gpu.name].usd_per_hour
    ceiling = check_evaluate_cost(gpu.name, price, evaluate.deadline_minutes, spec.budget_usd,
                                  settings.loraflow_max_run_usd)
    with tempfile.TemporaryDirectory(prefix="loraflow-evaluate-files-") as folder:
        files = read_run_files(evaluate.task_paths(), Path(folder), base_dir=Path.cwd(),
                               inputs_dir=settings.loraflow_inputs_dir)
        stored = _check_and_store_tasks(spec, run_id, base, files, settings)
    tasks, benchmarks = job_tasks(evaluate.tasks, evaluate.benchmarks, run_id)
    cache = None if base.revision is None else warm_cache_for(
        base.id, base.revision, offers[gpu.name].in_stock_data_centers(), existing_volumes=existing_volume_ids,
        logger=logger)
    job_input = EvaluateInput(mode="evaluate", run_id=run_id, artifact_store=spec.artifact_store, base_model=base,
                              adapters=adapters, tasks=tasks, benchmarks=benchmarks, inputs=stored,
                              worker_secret_names=sorted(spec.worker.secrets), deadline_epoch_s=deadline)
    env = prepare_worker_env(spec.hub_token_secret, env=spec.worker.env, secrets=spec.worker.secrets)
    ensure_endpoint_limit()
    plan = EvaluatePlan(run_id=run_id, name=spec.name, deadline=deadline, gpu=gpu, usd_per_hour=price, memory=memory,
                        cache=cache, job_input=job_input)
    logger.info("Evaluating %d adapter(s) of %s on %s, cost ceiling $%.2f", len(adapters), base.id, plan.describe(),
                ceiling)
    return plan, env


def _check_and_store_tasks(spec: EvaluateSpec, run_id: str, base: ModelSource, files: dict[str, RunFile],
                           settings: Settings):
    """The task files, graders and benchmarks' folder checked as a run's are (each task's longest prompt and its
    answer within the base's context), then stored under `runs/<run_id>/` in one commit, pinned by their hashes."""
    evaluate = spec.evaluate
    inputs = check_task_inputs(SECTION, evaluate.tasks, evaluate.benchmarks, files, spec.worker.secrets)
    for task_spec in evaluate.tasks:
        get_run_logger().info("Task %s: %d prompts, graded by %s", task_spec.name, inputs.rows[task_spec.name],
                              ", ".join(g.label for g in task_spec.grader_settings()))
    check_task_lengths_task(base, [(f"{SECTION}.tasks[{i}]", inputs.longest[t.name], t.max_new_tokens)
                                   for i, t in enumerate(evaluate.tasks)], spec.hub_token_secret)
    _, _, stored = publish_run_inputs(spec.artifact_store, run_id, files, [],
                                      settings.store_token(spec.artifact_store, spec.hub_token_secret))
    return stored


@task(name="evaluate-adapters", cache_policy=NO_CACHE)
def rent_and_evaluate(plan: EvaluatePlan, env: dict[str, str]) -> EvaluateResult:
    """The evaluate job on its rented worker, its endpoint deleted whatever happened (`run_evaluate_job`)."""
    return run_evaluate_job(plan, env)


@task(name="ask-endpoint", cache_policy=NO_CACHE)
def ask_endpoint(spec: EvaluateSpec, run_id: str) -> EvaluateResult:
    """`openai_base_url`: the task files checked as a run's, the endpoint's models checked, every prompt asked of
    the base and each adapter there and graded here by the built-in graders (`tasks/jobs/endpoint_evaluation.py`);
    the answers and scores stored under `runs/<run_id>/` as a rented job stores them."""
    logger, settings = get_run_logger(), Settings()
    evaluate = spec.evaluate
    check_server_rules(spec.local_paths(), artifact_store=spec.artifact_store, hub_token_secret=spec.hub_token_secret,
                       settings=settings, worker_secrets=spec.worker.secrets)
    key = read_api_key(evaluate.openai_api_key_secret, settings) if evaluate.openai_api_key_secret else None
    with tempfile.TemporaryDirectory(prefix="loraflow-evaluate-files-") as folder:
        files = read_run_files(evaluate.task_paths(), Path(folder), base_dir=Path.cwd(),
                               inputs_dir=settings.loraflow_inputs_dir)
        inputs = check_task_inputs(SECTION, evaluate.tasks, None, files, spec.worker.secrets)
        tasks = [_endpoint_task(t, files[f"{SECTION}.tasks[{i}].local_file"].copy)
                 for i, t in enumerate(evaluate.tasks)]
    wanted = {"evaluate.base_model": evaluate.base_model} | {
        f"evaluate.adapters[{i}].name": label for i, label in enumerate(evaluate.labels())}
    with endpoint_client(evaluate.openai_base_url, key) as client:
        check_served_models(client, wanted)
        logger.info("Asking %s: %d task(s) of %s and %d adapter(s) (%s)", evaluate.openai_base_url, len(tasks),
                    evaluate.base_model, len(wanted) - 1, ", ".join(f"{t.name}: {inputs.rows[t.name]} prompts"
                                                                    for t in tasks))
        result, answers = evaluate_endpoint(client, run_id, evaluate.base_model, evaluate.labels(), tasks,
                                            say=lambda line: logger.info("Evaluate: %s", line))
    store_url = spec.artifact_store
    store_endpoint_results(open_store(store_url, settings.store_token(store_url, spec.hub_token_secret),
                                      endpoint=settings.hf_endpoint), result, answers)
    logger.info("Answers and scores stored in %s/%s", store_url, run_prefix(run_id))
    return result


def _endpoint_task(task_spec, copy: Path) -> EndpointTask:
    """One task's checked rows (at most `max_samples`), their prompts, graders and sampling."""
    rows = [json.loads(line) for line in copy.read_text(encoding="utf-8").splitlines() if line.strip()]
    rows = rows[:task_spec.max_samples]
    return EndpointTask(name=task_spec.name, rows=rows, prompts=[task_prompt(row, task_spec.name) for row in rows], graders=task_spec.grader_settings(),
                        max_new_tokens=task_spec.max_new_tokens, temperature=task_spec.temperature,
                        top_p=task_spec.top_p)


def report_leaderboard(spec: EvaluateSpec, run_id: str, result: EvaluateResult) -> Leaderboard:
    """The leaderboard, best first: a Markdown artifact on the flow run, its lines printed, and a
    `loraflow.run.evaluated` event per adapter and score."""
    order = [(t.name, g.label) for t in spec.evaluate.tasks for g in t.grader_settings()]
    board = leaderboard(spec.name, result, order)
    for line in board.lines():
        print(line)
    if flow_run.id:
        create_markdown_artifact(markdown=board.markdown(), key=f"evaluate-{spec.name.lower()}-leaderboard"
                                 .replace("_", "-").replace(".", "-"),
                                 description=f"Leaderboard of the evaluation {spec.name}")
        for payload in events.adapter_score_payloads(result):
            events.run_scored(run_id, spec.name, payload)
    return board


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        sys.exit("usage: python -m flows.evaluate EVALUATE_FILE.toml")
    try:
        evaluate_spec = load_evaluate_file(sys.argv[1])
    except SpecError as e:
        sys.exit(str(e))
    # Asking a serving endpoint rents nothing: it needs neither the RunPod key nor the worker image.
    if evaluate_spec.evaluate.openai_base_url is None and (problem := startup_problem(worker_image=True)):
        sys.exit(problem)
    final = evaluate(evaluate_spec, return_state=True)
    print(f"flow run {final.state_details.flow_run_id}: {final.name}", flush=True)
    sys.exit(0 if final.is_completed() else 1)
