"""The phases of a `train` run after its check (`flows/train_check.py`), each a function the flow calls in order
(`flows/train.py`):

1. `place` — one attempt's GPU, warm volume and endpoint request.
2. `rent_train_and_tear_down` — the attempt's endpoint under one quota slot: created, its job submitted and
   watched, deleted whatever happened (`tasks/jobs/training.py`).
3. `retry_or_fail` — after an attempt that stored no results: the next attempt's GPU and settings, or the
   run's failure.
4. `report` — the training curve, the adapter published and the merged model (`[publish]`), the summary, the billed
   cost.

`place` and `report` are Prefect tasks, so the run's graph shows them with the tasks they run.
"""

# No `from __future__ import annotations`: Prefect reads these tasks' signatures.
import contextlib
import time
from dataclasses import dataclass, field

from loraflow_worker.contract import JobResult, MemorySettings
from loraflow_worker.memory.plan import plan_job
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.states import Cancelled
from pydantic import ValidationError

from flows.train_check import CheckedRun
from tasks.jobs.merge import MergedModel, merge_run_adapter
from tasks.jobs.training import existing_volume_ids, run_attempt
from tasks.lifecycle.attempts import EveryGpuRefused, GpuClassRefused, decide_next_attempt, next_unrefused
from tasks.lifecycle.pending_billing import mark_billing_pending
from tasks.lifecycle.teardown import UndeletedEndpoint
from tasks.placement.cost import read_billed_cost
from tasks.placement.gpu_fit import GIB
from tasks.placement.memory_ladder import MemoryContext
from tasks.placement.plan import AttemptPlan, plan_attempt
from tasks.placement.weight_cache import DataCenterCache, WarmVolumeGone, forget, warm_cache_for
from tasks.reports import events
from tasks.reports.curve import draw_meanwhile, drawn_curve, load_in_background
from tasks.reports.summary import RunReport, publish_report, store_curve, summary_key
from tasks.runpod.errors import JobFailedError, RunpodError
from tasks.runpod.jobs import JobOutcome
from tasks.runpod.volumes import volume_name
from tasks.settings import Settings, make_client
from tasks.storage.artifacts import RunResults
from tasks.storage.publish import PublishedModel, publish_run_adapter
from tasks.storage.volume_inventory import volume_monthly_cost


@dataclass
class Attempts:
    """What the attempts so far leave to the next: its GPU, the settings it forces, whether it may go warm."""

    forced: MemorySettings | None
    gpu_index: int = 0
    use_cache: bool = True
    endpoint_ids: list[str] = field(default_factory=list)
    earlier: list[str] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)
    """GPU class → RunPod's detail, for each class whose endpoint request RunPod refused (400): never asked again."""

@task(name="place", cache_policy=NO_CACHE)
def place(run: CheckedRun, attempt: int, attempts: Attempts) -> tuple[AttemptPlan, DataCenterCache | None]:
    """The attempt's GPU (the run's list, walked on no capacity), its datacenter when a volume there holds the
    model warm (a record whose volume is gone is cleared here, and the attempt goes cold: a record is a hint),
    and the endpoint it will ask RunPod for."""
    logger = get_run_logger()
    offer = run.offers[run.gpus[attempts.gpu_index].name]
    cache = (warm_cache_for(run.model.id, run.model.revision, offer.in_stock_data_centers(),
                            existing_volumes=existing_volume_ids, logger=logger,
                            records=run.warm_records if attempt == 1 else None)
             if attempts.use_cache else None)
    plan = plan_for(run, attempt, attempts, cache)
    logger.info("Attempt %d on %d × %s: endpoint %s%s%s", attempt, run.spec.compute.gpu_count, plan.gpu.name,
                plan.endpoint_name, f", weights warm in {cache.data_center}" if cache else "",
                f", forcing {attempts.forced.model_dump(exclude_none=True)}" if attempts.forced else "")
    if cache is not None:
        _volume_used(cache, run.run_id)
    return plan, cache


def plan_for(run: CheckedRun, attempt: int, attempts: Attempts, cache: DataCenterCache | None) -> AttemptPlan:
    spec = run.spec
    return plan_attempt(
        job_input=run.job_input.model_copy(update={"attempt": attempt, "memory": attempts.forced}),
        run_label=spec.name, gpu=run.gpus[attempts.gpu_index], gpu_count=spec.compute.gpu_count,
        disk_gb=spec.compute.disk_gb, deadline_epoch_s=run.deadline, now=time.time(),
        queue_s=spec.attempts.queue_minutes * 60, startup_s=spec.attempts.startup_minutes * 60,
        stall_s=spec.attempts.stall_minutes * 60, worker_env=run.worker_env, cache=cache)


def _volume_used(cache: DataCenterCache, run_id: str) -> None:
    """`loraflow.volume.used`: the volumes flow keeps a volume that runs use."""
    try:
        name = volume_name(cache.data_center, Settings().control_plane_namespace())
    except Exception:  # noqa: BLE001 - the name only labels the event
        name = cache.volume_id
    events.volume_used(cache.volume_id, name, cache.data_center, by="train", run_id=run_id)


def rent_train_and_tear_down(
    run: CheckedRun, attempt: int, attempts: Attempts, plan: AttemptPlan, cache: DataCenterCache | None,
) -> tuple[JobOutcome, UndeletedEndpoint | None, AttemptPlan, DataCenterCache | None]:
    """The attempt's endpoint, from its create to its confirmed delete (`tasks/jobs/training.py`); when
    RunPod refused it because its warm volume is gone, nothing was created and the same attempt runs cold; when
    RunPod refused the request of its GPU class (400), the refusal is recorded and the same attempt is placed on the
    next class of `compute.gpu` (`EveryGpuRefused` once none is left). Returns the plan and warm volume the attempt
    ran with."""
    while True:
        try:
            return _rent_train_and_tear_down(run, attempt, attempts, plan, cache)
        except GpuClassRefused as refused:
            attempts.gpu_index = _skip_refused_gpu(run, attempt, attempts, plan, refused)
        plan, cache = place(run, attempt, attempts)


def _skip_refused_gpu(run: CheckedRun, attempt: int, attempts: Attempts, plan: AttemptPlan,
                      refused: GpuClassRefused) -> int:
    """Record RunPod's refusal of a GPU class (the log, `loraflow.attempt.given-up` with outcome `create_refused`,
    the summary) and return the next class's index; raise `EveryGpuRefused` when no class is left."""
    attempts.refused[refused.gpu] = refused.detail
    following = next_unrefused(run.gpus, attempts.gpu_index, attempts.refused)
    reason = (f"RunPod refused the endpoint on {refused.gpu}; trying {run.gpus[following].name}"
              if following is not None else "RunPod refused the endpoint on every GPU class of compute.gpu")
    events.attempt_given_up(run.run_id, run.spec.name, attempt=attempt, outcome="create_refused", reason=reason,
                            retry=following is not None, error=refused.detail, endpoint_name=plan.endpoint_name)
    if following is None:
        raise EveryGpuRefused(attempts.refused) from refused
    get_run_logger().warning("Attempt %d: %s (%s)", attempt, reason, refused.detail)
    return following


def _rent_train_and_tear_down(
    run: CheckedRun, attempt: int, attempts: Attempts, plan: AttemptPlan, cache: DataCenterCache | None,
) -> tuple[JobOutcome, UndeletedEndpoint | None, AttemptPlan, DataCenterCache | None]:
    progress_key = f"train-{run.spec.name}-progress"
    try:
        # What drawing the curve needs is imported while the job runs.
        outcome, undeleted = run_attempt(plan, progress_key=progress_key, endpoint_ids=attempts.endpoint_ids,
                                         on_submitted=load_in_background, run_name=run.spec.name)
    except WarmVolumeGone as gone:
        get_run_logger().warning("Attempt %d: %s; its weight-cache record is cleared and the attempt runs cold",
                                 attempt, gone)
        forget(cache, get_run_logger())
        cache, plan = None, plan_for(run, attempt, attempts, None)
        outcome, undeleted = run_attempt(plan, progress_key=progress_key, endpoint_ids=attempts.endpoint_ids,
                                         on_submitted=load_in_background, run_name=run.spec.name)
    if outcome.kind == "completed":  # its endpoint deleted: the curve is drawn while the results are collected
        with contextlib.suppress(ValidationError):  # `collect` names what is wrong with the job's output
            draw_meanwhile(JobResult.model_validate(outcome.output).metrics, run.spec.algorithm)
    return outcome, undeleted, plan, cache


def cancelled_during(attempt: int, outcome: JobOutcome, undeleted: UndeletedEndpoint | None) -> Cancelled:
    get_run_logger().warning("Attempt %d: %s", attempt, outcome.error)
    if not outcome.job_id:  # cancelled before its endpoint was created: nothing was rented
        return Cancelled(message=f"Cancelled before attempt {attempt} rented an endpoint")
    teardown = "not confirmed deleted (recorded for the reconciler)" if undeleted else "deleted"
    return Cancelled(message=f"Cancelled during attempt {attempt}; its endpoint {teardown}")


def adopt(outcome: JobOutcome, undeleted: UndeletedEndpoint | None, plan: AttemptPlan) -> None:
    """Results stored completely (`DONE`) end the run, whatever the job's status said."""
    logger = get_run_logger()
    if outcome.kind != "completed":
        logger.warning("Job ended %s but its results were stored completely; adopting them", outcome.kind)
    if undeleted is not None:
        logger.warning("The results are stored, so the run completes; endpoint %s is left to the reconciler",
                       plan.endpoint_name)


def retry_or_fail(run: CheckedRun, attempt: int, attempts: Attempts, plan: AttemptPlan,
                  cache: DataCenterCache | None, outcome: JobOutcome, results: RunResults,
                  endpoints_before: int) -> None:
    """After an attempt that stored no results: set up the next attempt (its GPU, the memory settings it forces,
    whether it may go warm), or raise the run's failure (`loraflow.attempt.given-up` either way)."""
    spec = run.spec
    forced = attempts.forced
    memory = MemoryContext(
        forced=forced, batch_size=spec.training.batch_size,
        vllm=spec.algorithm == "grpo" and not (forced is not None and forced.vllm_colocate is False),
        effective_batch=spec.training.batch_size * spec.training.gradient_accumulation_steps,
        vllm_share=(plan_job(plan.job_input, run.shape, plan.gpu.vram_gb * GIB).vllm_gpu_memory_utilization
                    if run.shape is not None else None))
    decision = decide_next_attempt(outcome, run.gpus, attempts.gpu_index, attempt, spec.attempts.max_attempts,
                                   seconds_left=run.deadline - time.time(),
                                   warm_in=cache.data_center if cache else None, earlier=attempts.earlier,
                                   memory=memory, refused=attempts.refused)
    attempts.earlier.append(outcome.kind)
    events.attempt_given_up(run.run_id, spec.name, attempt=attempt, outcome=outcome.kind, reason=decision.reason,
                            retry=decision.retry, error=outcome.error,
                            endpoint_id=(attempts.endpoint_ids[-1] if len(attempts.endpoint_ids) > endpoints_before
                                         else None),
                            endpoint_name=plan.endpoint_name)
    attempts.use_cache = attempts.use_cache and not decision.cold
    if not decision.retry:
        raise run_failed(spec.name, outcome, results, decision.reason)
    get_run_logger().warning("Attempt %d ended %s (%s); %s", attempt, outcome.kind, outcome.error, decision.reason)
    attempts.gpu_index, attempts.forced = decision.gpu_index, decision.memory


def run_failed(run_name: str, outcome: JobOutcome, results: RunResults, reason: str) -> JobFailedError:
    error = outcome.error or f"the job ended {outcome.status} without storing its results"
    trace = f"\n--- worker traceback ---\n{outcome.traceback}" if outcome.traceback else ""
    tail = f"\n--- worker console (last lines) ---\n{results.console_tail}" if results.console_tail else ""
    return JobFailedError(f"run {run_name} {outcome.kind}: {error} [{reason}]{trace}{tail}", job_id=outcome.job_id,
                          status=outcome.status, error=outcome.error, console_tail=results.console_tail)


@task(name="report", cache_policy=NO_CACHE)
def report(run: CheckedRun, plan: AttemptPlan, cache: DataCenterCache | None, results: RunResults, attempt: int,
           endpoint_ids: list[str], estimated_usd: float,
           refused: dict[str, str] | None = None) -> tuple[PublishedModel | None, MergedModel | None]:
    """The training curve stored with the run (one commit: the Hub counts them); with `[publish]`, the adapter and
    its card published (after the curve, so that the card shows it; a failure is reported, not raised), then the
    merged model (`merged_model_id`: merged on a CPU endpoint of its own, its card naming the published adapter
    repo when there is one; a failure is reported, not raised); the summary (with where the GPU classes and prices
    came from, and the classes RunPod refused: `refused`) and the metrics table; RunPod's billed cost, or the run
    marked for the reconciler to fill it in. Returns what was published and merged."""
    logger, spec = get_run_logger(), run.spec
    billed_read = read_billed_cost.submit(endpoint_ids, run.began_at)  # RunPod's billing lags: nothing yet is "pending"
    curve = drawn_curve(results.result.metrics, spec.algorithm)  # drawn while the results were read, most often
    stored = (store_curve(spec.artifact_store, run.run_id, curve, spec.hub_token_secret, return_state=True)
              if curve else None)
    if stored is not None and not stored.is_completed():
        logger.warning("The training curve could not be stored (%s); the summary still shows it",
                       stored.result(raise_on_failure=False))
    curve_links = stored.result() if stored is not None and stored.is_completed() else None
    publish = spec.publish
    published = (publish_run_adapter(spec.artifact_store, run.run_id, spec.name, publish.hub_model_id,
                                     publish.private, spec.hub_token_secret, result=results.result)
                 if publish is not None and publish.hub_model_id is not None else None)
    if published is not None and published.error:
        logger.warning("The adapter was not published to %s: %s", published.hub_model_id, published.error)
    merged = None
    if publish is not None and publish.merged_model_id is not None:
        merged = merge_run_adapter(spec.artifact_store, run.run_id, spec.name, publish.merged_model_id,
                                   private=publish.private, hub_token_secret=spec.hub_token_secret,
                                   adapter_repo=published.hub_model_id if published and not published.error else None,
                                   result=results.result)
    offer, billed = run.offers[plan.gpu.name], billed_read.result()
    summary = RunReport(
        run_name=spec.name, run_id=run.run_id, model=run.model.id, model_revision=run.model.revision,
        gpu=plan.gpu.name, gpu_count=spec.compute.gpu_count, endpoint_name=plan.endpoint_name,
        metrics=results.result.metrics, cost_ceiling_usd=run.ceiling.usd, estimated_cost_usd=round(estimated_usd, 4),
        usd_per_hour=offer.usd_per_hour, price_source=offer.source, price_fallback_reason=offer.fallback_reason,
        ceiling_price_source=run.ceiling.price_source,
        cards_from=offer.cards_from, refused=refused or {},
        billed_usd=billed.usd if billed else None, billing_pending=billed is None or billed.usd <= 0,
        adapter_url=results.adapter_url or "", store_url=spec.artifact_store, attempts=attempt,
        fast_paths=(results.manifest or {}).get("fast_paths"), loss=(results.manifest or {}).get("loss"),
        algorithm=spec.algorithm,
        run_url=curve_links.run_url if curve_links else None,
        curve_url=curve_links.curve_url if curve_links else None, quantization=spec.lora.quantization,
        forced_memory=(results.manifest or {}).get("forced_memory_settings") or [],
        trackers=results.result.trackers, tracker_files_urls=results.tracker_files_urls,
        trajectories=results.trajectories, trajectories_url=results.trajectories_url,
        task_answers=results.task_answers, task_answers_urls=results.task_answers_urls,
        published_model=published.hub_model_id if published else None,
        published_model_url=published.url if published else None,
        publish_error=published.error if published else None,
        merged_model=merged.merged_model_id if merged else None, merged_model_url=merged.url if merged else None,
        merge_check=merged.check_line() if merged else None, merge_ran_on=merged.ran_on if merged else None,
        merge_error=merged.error if merged else None,
        **_storage_fields(cache),
    )
    publish_report(summary, key_prefix=f"train-{spec.name}", curve=curve)
    if summary.billing_pending:  # the reconciler fills the billed figure in (tasks/lifecycle/pending_billing.py)
        mark_billing_pending(run.run_id, spec.name, endpoint_ids, run.began_at, summary_key(f"train-{spec.name}"))
    logger.info("Adapter: %s", results.adapter_url)
    return published, merged


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
