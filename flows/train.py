"""The `train` flow: one LoRA fine-tuning run on a RunPod serverless GPU.

Run it on the embedded local stack (Prefect server + localpod + tiny model, no cloud account):

    make demo

or against RunPod, from a run file or a deployment:

    RUNPOD_API_KEY=... HF_TOKEN=... .venv/bin/python -m flows.train deployments/qwen.toml
    prefect deployment run train/qwen
    prefect deployment run train/qwen --param max_steps=5 --param 'gpu=["h100"]'   # single fields changed
"""

# No `from __future__ import annotations` here: Prefect builds the parameter model (the UI form) from
# the flow signature when it loads the entrypoint, and cannot resolve postponed annotations.
import functools
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from loraflow_worker.contract import DatasetSource, EvaluationSettings, JobInput, MemorySettings
from loraflow_worker.memory_plan import MemoryPlan, ModelShape, plan_job
from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from prefect.states import Cancelled, State
from pydantic import ValidationError

from flows.spec import RunOverrides, RunSpec, SpecError, apply_overrides, load_run_file
from tasks.lifecycle.attempts import MIN_TIME_FOR_ATTEMPT_S, decide_next_attempt
from tasks.lifecycle.pending_billing import mark_billing_pending
from tasks.lifecycle.quota import endpoint_slot, ensure_endpoint_limit, wait_for_runpod_quota
from tasks.lifecycle.steps import (
    create_endpoint,
    delete_endpoint,
    prepare_worker_env,
    run_cancel_requested,
    submit_job,
    wait_for_job,
)
from tasks.lifecycle.teardown import (
    UndeletedEndpoint,
    delete_run_endpoints_hook,
    keep_undeleted_endpoint,
    take_slot_for_undeleted,
)
from tasks.lifecycle.worker_env import read_run_secrets
from tasks.placement.cost import (
    EVAL_SHARE_WARNING,
    check_budget,
    cost_ceiling,
    evaluation_cost,
    read_billed_cost,
    read_gpu_prices,
)
from tasks.placement.gpu_fit import GIB, catalog_fits, gpus_that_fit, placeable_gpus
from tasks.placement.image_contract import check_image_contract
from tasks.placement.memory_ladder import MemoryContext
from tasks.placement.plan import AttemptPlan, plan_attempt, read_model_shape_task, resolve_model_task
from tasks.reports.curve import curve_png
from tasks.reports import events
from tasks.reports.summary import (
    RunReport,
    publish_report,
    run_tags,
    run_title,
    store_curve,
    summary_key,
    tag_run,
)
from tasks.runpod.catalog import cuda_floor, resolve_gpu
from tasks.runpod.errors import (
    BadRequestError,
    JobFailedError,
    NotFoundError,
    RunpodError,
    is_transient,
)
from tasks.runpod.jobs import JobOutcome
from tasks.runpod.models import Endpoint
from tasks.runpod.volumes import volume_name
from tasks.settings import Settings, make_client
from tasks.storage.artifacts import RunResults, check_dataset_jsonl, collect, eval_store_path, publish_run_inputs_task
from tasks.storage.publish import check_publish_token, publish_run_adapter
from tasks.storage.rewards import check_reward_files
from tasks.storage.volume_inventory import volume_monthly_cost
from tasks.storage.weight_cache import DataCenterCache, WarmVolumeGone, forget, gone_volume, warm_cache_for


def _flow_run_name() -> str:
    # Prefect calls this once the parameters are validated, before the body runs: the name describes the
    # run the overrides make. When they are invalid the body fails on them, naming them; the name is only
    # a label, so it falls back to the spec as given.
    parameters = flow_run.parameters
    spec: RunSpec = parameters["spec"]
    try:
        overrides = RunOverrides.model_validate({k: parameters.get(k) for k in RunOverrides.model_fields})
        spec = apply_overrides(spec, overrides)
    except (SpecError, ValidationError):
        pass
    return run_title(spec.name, spec.model.id, spec.algorithm, spec.compute.gpu[0])


# Each hook deletes the run's endpoints by name: the second layer of teardown, after `finally`.
@flow(name="train", log_prints=True, flow_run_name=_flow_run_name, on_crashed=[delete_run_endpoints_hook],
      on_cancellation=[delete_run_endpoints_hook], on_failure=[delete_run_endpoints_hook])
def train(
    spec: RunSpec,
    run_file: str | None = None,
    name: str | None = None,
    model: str | None = None,
    dataset: str | None = None,
    gpu: list[str] | None = None,
    max_steps: int | None = None,
    learning_rate: float | None = None,
    hub_token_secret: str | None = None,
) -> RunResults | State:
    """Fine-tune a LoRA adapter on a RunPod serverless GPU.

    0. Apply the overrides to the spec (each names itself when invalid); name and tag the run.
    1. Prepare: check the run's secret blocks and the image's contract, keep the GPUs whose hosts run its CUDA,
       check the budget, pin the model, publish a local dataset, build the job, keep the GPUs the memory plan fits,
       and store the run's secrets as RunPod account secrets its endpoints' env refers to.
    2. For each attempt (a new endpoint each time, resuming from the last checkpoint):
       a. take one slot of the `runpod-endpoints` limit (the account's endpoint quota);
       b. create the attempt's endpoint (looked up by name first; RunPod's own quota error waits);
       c. submit the job once;
       d. wait for it, mirroring progress into the UI, and classify how it ended; a cancel of this
          run (UI, CLI, API) cancels the job, however the run was started;
       e. delete the endpoint, confirmed, whatever happened; an unconfirmed delete keeps a slot and a
          record for the reconciler, and never changes how the attempt ended;
       f. collect: results stored completely (`DONE`) end the run, whatever the job's status said;
          otherwise retry or fail, per the outcome (`loraflow.attempt.given-up`).
    3. Store the training curve; with `[publish]`, publish the adapter and a model card to its Hub model repo
       (one commit; a failure is reported, the run still completes); publish the report.

    A cancelled run ends Cancelled once its endpoint is deleted. Every end sends `loraflow.run.finished`.

    Args:
        spec: The run, as a deployment's parameters or a run file give it. The parameters below change
            single fields of it, so that `--param max_steps=5` works where `--param spec=...` would have
            to repeat the whole spec.
        run_file: A TOML run file (e.g. `deployments/qwen.toml`) whose spec replaces `spec` before the other
            overrides apply. Relative paths are resolved from the flow's working directory.
        name: Replaces the spec's `name` (the run's label).
        model: Replaces the base model: a Hub model id (`Qwen/Qwen3-0.6B`, default branch) or a local model
            directory (local mode).
        dataset: Replaces the training data: a local JSONL file (a path ending in `.jsonl` or `.json`, or
            starting with `/`, `./`, `../` or `~`) or else a Hub dataset id (its `train` split).
        gpu: Replaces `compute.gpu`: GPU classes in the order to try them, e.g. `["h100", "a100 sxm"]`.
        max_steps: Replaces `training.max_steps` (optimizer steps).
        learning_rate: Replaces `training.learning_rate`.
        hub_token_secret: Replaces `hub_token_secret`: the Prefect Secret block holding your Hugging Face token,
            for this run.
    """
    logger = get_run_logger()
    run_id = flow_run.id or str(uuid.uuid4())
    spent = events.RunSpend()  # what `loraflow.run.finished` reports, however the run ends
    try:
        # 0. Overrides, name and tags.
        spec = apply_overrides(spec, RunOverrides(run_file=run_file, name=name, model=model, dataset=dataset,
                                                  gpu=gpu, max_steps=max_steps, learning_rate=learning_rate,
                                                  hub_token_secret=hub_token_secret))
        deadline = time.time() + spec.deadline_minutes * 60
        tag_run(run_id, run_tags(spec.model.id, spec.algorithm, spec.compute.gpu))

        # 1. Prepare: nothing is rented until this has passed.
        gpus = [resolve_gpu(gpu_name) for gpu_name in spec.compute.gpu]
        settings = Settings()
        run_token = settings.hub_token(spec.hub_token_secret)  # the run's token block, if named: unreadable → refused
        if spec.publish is not None:
            check_publish_token(spec.publish.hub_model_id, run_token)
        read_run_secrets(spec.worker.secrets)  # the run's own secret blocks: unreadable or too short → refused
        image = settings.worker_image()
        check_image_contract(image)  # a stale image would refuse the job only after a GPU was rented
        floors = [cuda_floor(g, settings.loraflow_image_min_cuda) for g in gpus]
        # RunPod's catalog (else the static table): prices, the hosts' CUDA, and stock on hosts that meet the floor.
        offers = {offer.gpu: offer for offer in read_gpu_prices(gpus, floors)}
        gpus, excluded = placeable_gpus(gpus, offers, floors,
                                        alternatives=lambda: catalog_fits(settings.loraflow_image_min_cuda))
        for fit in excluded:
            logger.warning("Not renting %s: no host runs the worker image (%s)", fit.gpu, fit.describe())
        ceiling = cost_ceiling([offers[g.name] for g in gpus], spec.compute.gpu_count, spec.deadline_minutes)
        spent.ceiling_usd = ceiling.usd
        check_budget(ceiling.usd, spec.budget_usd, ceiling.price_source)
        examples = eval_examples = None
        if spec.dataset.local_file is not None:
            examples = check_dataset_jsonl(Path(spec.dataset.local_file), spec.algorithm)
            logger.info("Dataset %s: %d examples", spec.dataset.local_file, examples)
        eval_file = spec.evaluation.local_file if spec.evaluation is not None else None
        if eval_file is not None:
            eval_examples = check_dataset_jsonl(Path(eval_file), spec.algorithm, "evaluation.local_file")
        if spec.evaluation is not None:
            _log_evaluation_cost(spec, examples, eval_examples)
        rewards = spec.grpo.rewards if spec.grpo is not None else []
        check_reward_files(rewards, Path.cwd())  # relative reward files start where a relative local_file does
        model_source = resolve_model_task(spec.model, disk_gb=spec.compute.disk_gb,
                                          hub_token_secret=spec.hub_token_secret)
        # The dataset file, the evaluation file and the reward files, in one commit; the rewards come back pointing
        # at their copies.
        dataset_path, rewards = publish_run_inputs_task(spec.artifact_store, run_id, spec.dataset.local_file,
                                                        rewards, str(Path.cwd()), eval_file=eval_file,
                                                        hub_token_secret=spec.hub_token_secret)
        if dataset_path is not None:
            dataset_source = DatasetSource(store_path=dataset_path)
        else:
            dataset_source = DatasetSource(hub_id=spec.dataset.hub_id, split=spec.dataset.split)
        grpo = spec.grpo.model_copy(update={"rewards": rewards}) if spec.grpo is not None else None
        # QLoRA GRPO generates with the training model: TRL's merge of an adapter into a 4-bit base for vLLM misbehaves.
        qlora_grpo = spec.algorithm == "grpo" and spec.lora.quantization == "4bit"
        job_input = JobInput(run_id=run_id, attempt=1, algorithm=spec.algorithm, model=model_source,
                             dataset=dataset_source, lora=spec.lora, training=spec.training, grpo=grpo,
                             artifact_store=spec.artifact_store, deadline_epoch_s=deadline,
                             extra_packages=spec.extra_packages, evaluation=_job_evaluation(spec, run_id),
                             memory=MemorySettings(vllm_colocate=False) if qlora_grpo else None,
                             worker_env_names=sorted(spec.worker.env), worker_secret_names=sorted(spec.worker.secrets),
                             fast_paths=spec.fast_paths)
        # The worker's own memory planner, on each GPU of the list: those the run cannot fit are not rented.
        shape = read_model_shape_task(model_source, hub_token_secret=spec.hub_token_secret)
        if shape is not None:
            gpus, too_small = gpus_that_fit(gpus, functools.partial(plan_job, job_input, shape),
                                            quantized_plan_for=_quantized_planner(job_input, shape))
            for fit in too_small:
                logger.warning("Not renting %s: the run does not fit it (%s)", fit.gpu, fit.describe())
            ceiling = cost_ceiling([offers[g.name] for g in gpus], spec.compute.gpu_count, spec.deadline_minutes)
            spent.ceiling_usd = ceiling.usd
        logger.info("Run %s: %s, GPUs %s, image %s, cost ceiling %s", spec.name, model_source.id, spec.compute.gpu,
                    image, ceiling.describe())
        ensure_endpoint_limit()
        worker_env = prepare_worker_env(spec.hub_token_secret, env=spec.worker.env, secrets=spec.worker.secrets)

        # 2. Attempts.
        gpu_index, endpoint_ids, use_cache, earlier, forced = 0, [], True, [], job_input.memory
        for attempt in range(1, spec.attempts.max_attempts + 1):
            if run_cancel_requested():
                return spent.finish(run_id, spec.name, "cancelled",
                                    Cancelled(message=f"Cancelled before attempt {attempt}"))
            offer = offers[gpus[gpu_index].name]
            # A record whose volume is gone is cleared here, and the attempt goes cold (a record is a hint).
            cache = (warm_cache_for(model_source.id, model_source.revision, offer.in_stock_data_centers(),
                                    existing_volumes=_existing_volume_ids, logger=logger)
                     if use_cache else None)
            attempt_input = job_input.model_copy(update={"attempt": attempt, "memory": forced})
            make_plan = functools.partial(
                plan_attempt, job_input=attempt_input, run_label=spec.name, gpu=gpus[gpu_index],
                gpu_count=spec.compute.gpu_count, disk_gb=spec.compute.disk_gb, deadline_epoch_s=deadline,
                queue_s=spec.attempts.queue_minutes * 60, startup_s=spec.attempts.startup_minutes * 60,
                stall_s=spec.attempts.stall_minutes * 60, worker_env=worker_env)
            plan = make_plan(now=time.time(), cache=cache)
            logger.info("Attempt %d on %d × %s: endpoint %s%s%s", attempt, spec.compute.gpu_count, plan.gpu.name,
                        plan.endpoint_name, f", weights warm in {cache.data_center}" if cache else "",
                        f", forcing {forced.model_dump(exclude_none=True)}" if forced else "")
            spent.attempts, endpoints_before = attempt, len(endpoint_ids)
            if cache is not None:
                _volume_used(cache, run_id)
            try:
                outcome, undeleted = run_attempt(plan, progress_key=f"train-{spec.name}-progress",
                                                 endpoint_ids=endpoint_ids)
            except WarmVolumeGone as gone:
                # Nothing was created: the same attempt, cold.
                logger.warning("Attempt %d: %s; its weight-cache record is cleared and the attempt runs cold",
                               attempt, gone)
                forget(cache, logger)
                cache = None
                plan = make_plan(now=time.time(), cache=None)
                outcome, undeleted = run_attempt(plan, progress_key=f"train-{spec.name}-progress",
                                                 endpoint_ids=endpoint_ids)
            spent.usd += offer.usd_per_hour * spec.compute.gpu_count * outcome.running_seconds / 3600
            if outcome.kind == "run_cancelled":
                logger.warning("Attempt %d: %s", attempt, outcome.error)
                teardown = "not confirmed deleted (recorded for the reconciler)" if undeleted else "deleted"
                return spent.finish(run_id, spec.name, "cancelled",
                                    Cancelled(message=f"Cancelled during attempt {attempt}; its endpoint {teardown}"))
            results = collect(spec.artifact_store, run_id, spec.hub_token_secret)
            if results.done:
                if outcome.kind != "completed":
                    logger.warning("Job ended %s but its results were stored completely; adopting them", outcome.kind)
                if undeleted is not None:
                    logger.warning("The results are stored, so the run completes; endpoint %s is left to the "
                                   "reconciler", plan.endpoint_name)
                break
            memory = MemoryContext(
                forced=forced, batch_size=spec.training.batch_size,
                vllm=spec.algorithm == "grpo" and not (forced is not None and forced.vllm_colocate is False),
                effective_batch=spec.training.batch_size * spec.training.gradient_accumulation_steps,
                vllm_share=(plan_job(attempt_input, shape, plan.gpu.vram_gb * GIB).vllm_gpu_memory_utilization
                            if shape is not None else None))
            decision = decide_next_attempt(outcome, gpus, gpu_index, attempt, spec.attempts.max_attempts,
                                           seconds_left=deadline - time.time(),
                                           warm_in=cache.data_center if cache else None, earlier=earlier, memory=memory)
            earlier.append(outcome.kind)
            events.attempt_given_up(run_id, spec.name, attempt=attempt, outcome=outcome.kind, reason=decision.reason,
                                    retry=decision.retry, error=outcome.error,
                                    endpoint_id=endpoint_ids[-1] if len(endpoint_ids) > endpoints_before else None,
                                    endpoint_name=plan.endpoint_name)
            use_cache = use_cache and not decision.cold
            if not decision.retry:
                raise run_failed(spec.name, outcome, results, decision.reason)
            logger.warning("Attempt %d ended %s (%s); %s", attempt, outcome.kind, outcome.error, decision.reason)
            gpu_index, forced = decision.gpu_index, decision.memory

        # 3. Report, with the training curve, stored with the run (one commit: the Hub counts them).
        assert results.result is not None
        curve = curve_png(results.result.metrics, spec.algorithm)
        stored = (store_curve(spec.artifact_store, run_id, curve, spec.hub_token_secret, return_state=True)
                  if curve else None)
        if stored is not None and not stored.is_completed():
            logger.warning("The training curve could not be stored (%s); the summary still shows it",
                           stored.result(raise_on_failure=False))
        curve_links = stored.result() if stored is not None and stored.is_completed() else None
        # The adapter by name (`[publish]`), after the curve so that the card shows it; a failure is reported, not raised.
        published = (publish_run_adapter(spec.artifact_store, run_id, spec.name, spec.publish.hub_model_id,
                                         spec.publish.private, spec.hub_token_secret)
                     if spec.publish is not None else None)
        if published is not None and published.error:
            logger.warning("The adapter was not published to %s: %s", published.hub_model_id, published.error)
        offer = offers[plan.gpu.name]
        run_began_s = deadline - spec.deadline_minutes * 60
        billed = read_billed_cost(endpoint_ids, run_began_s)  # RunPod's billing lags: nothing yet is "pending"
        report = RunReport(
            run_name=spec.name, run_id=run_id, model=model_source.id, model_revision=model_source.revision,
            gpu=plan.gpu.name, gpu_count=spec.compute.gpu_count, endpoint_name=plan.endpoint_name,
            metrics=results.result.metrics, cost_ceiling_usd=ceiling.usd, estimated_cost_usd=round(spent.usd, 4),
            usd_per_hour=offer.usd_per_hour, price_source=offer.source,
            billed_usd=billed.usd if billed else None, billing_pending=billed is None or billed.usd <= 0,
            adapter_url=results.adapter_url or "", store_url=spec.artifact_store, attempts=attempt,
            fast_paths=(results.manifest or {}).get("fast_paths"), algorithm=spec.algorithm,
            run_url=curve_links.run_url if curve_links else None,
            curve_url=curve_links.curve_url if curve_links else None, quantization=spec.lora.quantization,
            forced_memory=(results.manifest or {}).get("forced_memory_settings") or [],
            trackers=results.result.trackers, tracker_files_urls=results.tracker_files_urls,
            published_model=published.hub_model_id if published else None,
            published_model_url=published.url if published else None,
            publish_error=published.error if published else None,
            **_storage_fields(cache),
        )
        publish_report(report, key_prefix=f"train-{spec.name}", curve=curve)
        if report.billing_pending:  # the reconciler fills the billed figure in (tasks/lifecycle/pending_billing.py)
            mark_billing_pending(run_id, spec.name, endpoint_ids, run_began_s, summary_key(f"train-{spec.name}"))
        logger.info("Adapter: %s", results.adapter_url)
        return spent.finish(run_id, spec.name, "completed", results, adapter_url=results.adapter_url,
                            metrics=results.result.metrics,
                            published_model=published.hub_model_id if published else None,
                            publish_error=published.error if published else None)
    except BaseException as e:
        # Every failure ends here: refused before renting (0 attempts), out of attempts, or an error.
        spent.finish(run_id, spec.name, "cancelled" if run_cancel_requested() else "failed", None,
                     message=f"{type(e).__name__}: {e}")
        raise


def _existing_volume_ids() -> set[str] | None:
    """The ids of the account's network volumes now; None (trust the records) when they cannot be listed."""
    try:
        with make_client() as client:
            return {v.id for v in client.list_network_volumes()}
    except RunpodError as e:
        get_run_logger().warning("The network volumes could not be listed (%s): warm records are not checked", e)
        return None


def _volume_exists(volume_id: str) -> bool:
    """Whether the volume exists; True when that cannot be told (the refusal then stands as the error)."""
    existing = _existing_volume_ids()
    return existing is None or volume_id in existing


def _storage_fields(cache: DataCenterCache | None) -> dict:
    """The summary's storage line: the warm volume the last attempt used and its $/month (never fails the run)."""
    if cache is None:
        return {}
    fields: dict = {"warm_volume": f"{cache.volume_id} in {cache.data_center}"}
    try:
        with make_client() as client:
            cost = volume_monthly_cost(client, cache.volume_id)
    except RunpodError as e:
        get_run_logger().warning("The warm volume's storage cost could not be read: %s", e)
        cost = None
    if cost is not None:
        fields |= {"storage_usd_per_month": round(cost[0], 2), "storage_cost_source": cost[1]}
    return fields


def _volume_used(cache: DataCenterCache, run_id: str) -> None:
    """`loraflow.volume.used`: the volumes flow keeps a volume that runs use."""
    try:
        name = volume_name(cache.data_center, Settings().control_plane_namespace())
    except Exception:  # noqa: BLE001 - the name only labels the event
        name = cache.volume_id
    events.volume_used(cache.volume_id, name, cache.data_center, by="train", run_id=run_id)


def _job_evaluation(spec: RunSpec, run_id: str) -> EvaluationSettings | None:
    """The job's `evaluation`: the spec's, its local file replaced by the copy `publish_run_inputs_task` stores."""
    if spec.evaluation is None:
        return None
    return EvaluationSettings(
        fraction=spec.evaluation.fraction, every_steps=spec.evaluation.every_steps,
        max_samples=spec.evaluation.max_samples,
        store_path=eval_store_path(run_id) if spec.evaluation.local_file is not None else None)


def _log_evaluation_cost(spec: RunSpec, examples: int | None, eval_examples: int | None) -> None:
    """Say what the run's evaluation adds to its work; warn when that is a large share (it shortens the training
    the deadline allows)."""
    evaluation, logger = spec.evaluation, get_run_logger()
    cost = evaluation_cost(spec.algorithm, spec.training, every_steps=evaluation.every_steps,
                           max_samples=evaluation.max_samples, fraction=evaluation.fraction,
                           dataset_examples=examples, eval_file_examples=eval_examples)
    if cost is None:
        logger.info("Evaluation every %d steps on at most %d examples (its share of the run is not known before it: "
                    "epochs over a Hub dataset)", evaluation.every_steps, evaluation.max_samples)
    elif cost.share > EVAL_SHARE_WARNING:
        logger.warning("Evaluation: %s: more than %.0f%%; raise evaluation.every_steps or lower "
                       "evaluation.max_samples to leave the deadline to training", cost.describe(),
                       EVAL_SHARE_WARNING * 100)
    else:
        logger.info("Evaluation: %s", cost.describe())


def _quantized_planner(job_input: JobInput, shape: ModelShape) -> Callable[[int], MemoryPlan] | None:
    """The same run's plan in 4 bits (QLoRA), for a refusal to suggest; None when it already is."""
    if job_input.lora.quantization == "4bit":
        return None
    quantized = job_input.model_copy(update={"lora": job_input.lora.model_copy(update={"quantization": "4bit"})})
    return functools.partial(plan_job, quantized, shape)


def run_attempt(plan: AttemptPlan, progress_key: str,
                endpoint_ids: list[str] | None = None) -> tuple[JobOutcome, UndeletedEndpoint | None]:
    """One endpoint's life, inside one quota slot: create → submit → wait → delete (always). The id of the
    endpoint it created is appended to `endpoint_ids`.

    The slot is the endpoint. When the delete stays unconfirmed after its retries, a slot lease of its
    own and a record (`UndeletedEndpoint`, returned) outlive the attempt, for the reconciler; the
    attempt's outcome, or the error it raised, is kept as it was.
    """
    created: list[Endpoint] = []
    undeleted: UndeletedEndpoint | None = None
    try:
        with endpoint_slot(Settings().loraflow_slot_lease_seconds, logger=get_run_logger(),
                           give_up_at=plan.limits.deadline_epoch_s - MIN_TIME_FOR_ATTEMPT_S):
            try:
                outcome = _create_submit_wait(plan, progress_key, created)
            finally:
                endpoint_id = created[0].id if created else None
                if endpoint_id is not None and endpoint_ids is not None:
                    endpoint_ids.append(endpoint_id)
                deleted = delete_endpoint(plan.endpoint_name, endpoint_id, return_state=True)
                if not deleted.is_completed():
                    # Taken while this attempt still holds its slot, when the limit has room: the endpoint
                    # is never without one.
                    undeleted = UndeletedEndpoint(endpoint_name=plan.endpoint_name, endpoint_id=endpoint_id,
                                                  run_id=plan.run_id, lease_id=take_slot_for_undeleted(0.0),
                                                  error=str(deleted.result(raise_on_failure=False))[:500])
    finally:
        if undeleted is not None:
            keep_undeleted_endpoint(undeleted, get_run_logger())
    return outcome, undeleted


def _create_submit_wait(plan: AttemptPlan, progress_key: str, created: list[Endpoint]) -> JobOutcome:
    if run_cancel_requested():  # cancelled while it waited for the slot: create nothing
        return JobOutcome(kind="run_cancelled", job_id="", status="UNKNOWN",
                          error="the run was cancelled while it waited for an endpoint slot")
    try:
        endpoint = wait_for_runpod_quota(lambda: create_endpoint(plan.create_request),
                                         give_up_at=plan.limits.deadline_epoch_s - MIN_TIME_FOR_ATTEMPT_S,
                                         cancel_requested=run_cancel_requested, logger=get_run_logger())
    except (BadRequestError, NotFoundError) as refused:
        # RunPod refuses (4xx) an endpoint whose network volume is gone: a stale warm record, not a failed run.
        gone = gone_volume(refused, plan.create_request.network_volumes, _volume_exists)
        if gone is None:
            raise
        raise gone from refused
    if endpoint is None:
        return JobOutcome(kind="run_cancelled", job_id="", status="UNKNOWN",
                          error="the run was cancelled while it waited for room in RunPod's worker quota")
    created.append(endpoint)
    submitted = submit_job(endpoint, plan.job_input.model_dump(mode="json"), plan.policy, return_state=True)
    if not submitted.is_completed():
        # `/run` is not idempotent: rather than POST again (maybe starting a second job), give this
        # endpoint up (deleted by the caller, with any job it got) and let a new attempt start clean.
        error = submitted.result(raise_on_failure=False)
        if isinstance(error, NotFoundError):  # the endpoint vanished between its create and the submit
            return JobOutcome(kind="lost", job_id="", status="UNKNOWN",
                              error=f"the endpoint vanished before its job was submitted ({error})")
        if not is_transient(error):
            raise error
        return JobOutcome(kind="submit_failed", job_id="", status="UNKNOWN", error=str(error))
    return wait_for_job(endpoint, submitted.result(), plan.limits, progress_key=progress_key)


def run_failed(run_name: str, outcome: JobOutcome, results: RunResults, reason: str) -> JobFailedError:
    error = outcome.error or f"the job ended {outcome.status} without storing its results"
    trace = f"\n--- worker traceback ---\n{outcome.traceback}" if outcome.traceback else ""
    tail = f"\n--- worker console (last lines) ---\n{results.console_tail}" if results.console_tail else ""
    return JobFailedError(f"run {run_name} {outcome.kind}: {error} [{reason}]{trace}{tail}", job_id=outcome.job_id,
                          status=outcome.status, error=outcome.error, console_tail=results.console_tail)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m flows.train RUN_FILE.toml")
    try:
        run_spec = load_run_file(sys.argv[1])
    except SpecError as e:
        sys.exit(str(e))
    final = train(run_spec, return_state=True)
    print(f"flow run {final.state_details.flow_run_id}: {final.name}", flush=True)
    sys.exit(0 if final.is_completed() else 1)
