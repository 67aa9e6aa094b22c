"""The phases of a `train` run, each a function the flow calls in order (`flows/train.py`):

1. `check` — everything a run needs checked and decided before anything is rented, the checks that do not
   depend on each other at once: the secrets and tokens, the image's contract, the GPUs whose hosts run its
   CUDA and the budget, the local inputs, the model and the Hub datasets pinned and the first chats masked by the
   model's tokenizer; then the inputs published, the GPUs the memory plan fits, the quota's limit and the workers'
   env.
2. `place` — one attempt's GPU, warm volume and endpoint request.
3. `rent_train_and_tear_down` — the attempt's endpoint under one quota slot: created, its job submitted and
   watched, deleted whatever happened (`tasks/lifecycle/attempt.py`).
4. `retry_or_fail` — after an attempt that stored no results: the next attempt's GPU and settings, or the
   run's failure.
5. `report` — the training curve, the adapter published and the merged model (`[publish]`), the summary, the billed
   cost.

`check`, `place` and `report` are Prefect tasks, so the run's graph shows them with the tasks they run.
"""

# No `from __future__ import annotations`: Prefect reads these tasks' signatures.
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from loraflow_worker.artifacts.pins import sha256_hex
from loraflow_worker.contract import (
    DatasetSource,
    EvaluationSettings,
    JobInput,
    LoraSettings,
    MemorySettings,
    ModelSource,
    StoredInputs,
)
from loraflow_worker.contract.dataset_formats import mixed_format
from loraflow_worker.memory.model_shape import ModelShape
from loraflow_worker.memory.plan import MemoryPlan, plan_job
from loraflow_worker.dataset.packing import packing_problem
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.futures import wait
from prefect.states import Cancelled

from flows.spec import RunSpec
from flows.spec_data import DatasetSpec, MixEntrySpec
from tasks.lifecycle.attempt import existing_volume_ids, run_attempt
from tasks.lifecycle.attempts import EveryGpuRefused, GpuClassRefused, decide_next_attempt, next_unrefused
from tasks.lifecycle.pending_billing import mark_billing_pending
from tasks.lifecycle.quota import ensure_endpoint_limit
from tasks.lifecycle.steps import prepare_worker_env
from tasks.lifecycle.teardown import UndeletedEndpoint
from tasks.lifecycle.worker_env import read_run_secrets
from tasks.placement.cost import (
    EVAL_SHARE_WARNING,
    CostCeiling,
    check_budget,
    cost_ceiling,
    evaluation_cost,
    read_billed_cost,
    read_gpu_prices,
)
from tasks.placement.gpu_fit import GIB, catalog_fits, gpus_that_fit, placeable_gpus, pooled_gpus
from tasks.placement.image_contract import check_image_contract
from tasks.placement.memory_ladder import MemoryContext
from tasks.placement.plan import AttemptPlan, plan_attempt, read_model_shape_task, resolve_model_task
from tasks.reports import events
from tasks.reports.curve import curve_png, load_in_background
from tasks.reports.summary import RunReport, publish_report, store_curve, summary_key
from tasks.runpod.catalog import GpuClass, cuda_floor, resolve_gpu
from tasks.runpod.errors import JobFailedError, RunpodError
from tasks.runpod.jobs import JobOutcome
from tasks.runpod.live_catalog import GpuOffer
from tasks.runpod.volumes import volume_name
from tasks.settings import Settings, make_client
from tasks.preflight.chats import check_chats_task
from tasks.preflight.server_rules import check_server_rules
from tasks.preflight.tools import check_tools_task
from tasks.storage.artifacts import (
    RunResults,
    chat_template_store_path,
    check_chat_template_file,
    check_dataset_jsonl,
    eval_store_path,
    first_row_format,
    mix_store_path,
    publish_run_inputs_task,
    tools_store_path,
)
from tasks.storage.hub_datasets import HubDataset, check_hub_datasets_task
from tasks.storage.init_from import adopt_parent_adapter, read_parent_config
from tasks.storage.merge import MergedModel, check_merge_fits, merge_run_adapter
from tasks.storage.publish import PublishedModel, check_publish_token, publish_run_adapter
from tasks.storage.rewards import check_reward_files
from tasks.storage.volume_inventory import volume_monthly_cost
from tasks.storage.weight_cache import DataCenterCache, WarmVolumeGone, forget, warm_cache_for


@dataclass(frozen=True)
class CheckedRun:
    """What `check` decided: the run as it will be attempted."""

    spec: RunSpec
    run_id: str
    deadline: float
    model: ModelSource
    job_input: JobInput
    shape: ModelShape | None
    gpus: list[GpuClass]
    offers: dict[str, GpuOffer]
    ceiling: CostCeiling
    worker_env: dict[str, str]

    @property
    def began_at(self) -> float:
        return self.deadline - self.spec.deadline_minutes * 60


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


@task(name="check", cache_policy=NO_CACHE)
def check(spec: RunSpec, run_id: str, spent: events.RunSpend) -> CheckedRun:
    """Nothing is rented until this has passed. `spent` learns the cost ceiling as soon as it is known, for the run's
    end event even when the budget refuses the run (the flow passes it quoted: Prefect hands the object itself over,
    without looking into it)."""
    logger = get_run_logger()
    deadline = time.time() + spec.deadline_minutes * 60
    settings = Settings()
    gpus = [resolve_gpu(gpu_name) for gpu_name in spec.compute.gpu]
    floors = [cuda_floor(g, settings.loraflow_image_min_cuda) for g in gpus]
    # Before any of the run's files is read: whether this server lets the run read them at all.
    check_server_rules(spec.local_paths(), artifact_store=spec.artifact_store, hub_token_secret=spec.hub_token_secret,
                       settings=settings)
    # What needs the network, at once: secret blocks (Prefect), the catalog (RunPod), the model (the Hub).
    template_file = check_chat_template_file(spec.training.chat_template)
    secrets = check_secrets.submit(spec)
    prices = read_gpu_prices.submit(gpus, floors)
    model = resolve_model_task.submit(spec.model, disk_gb=spec.compute.disk_gb, hub_token_secret=spec.hub_token_secret)
    eval_file = spec.evaluation.local_file if spec.evaluation is not None else None
    running = [secrets, prices, model]
    if spec.algorithm == "sft":  # the first chats rendered by the model's tokenizer once the model is pinned
        chats = check_chats_task.submit(model, spec.training, _local_chat_files(spec),
                                        str(template_file) if template_file else None, spec.hub_token_secret)
        running.append(chats)
    uses_tools = spec.grpo is not None and spec.grpo.uses_tools
    if uses_tools:  # the tools imported in a process of their own, and the model's template rendering them
        tools = check_tools_task.submit(spec.grpo, str(Path.cwd()), model, spec.hub_token_secret,
                                        worker_env=spec.worker.env)
        running.append(tools)
    hub_sources = [(field, source.hub_source()) for field, source in spec.dataset.sources() if source.hub_id]
    if hub_sources:  # the Hub datasets: their revisions pinned, configs and splits found, first rows checked
        hub_datasets = check_hub_datasets_task.submit(hub_sources, spec.algorithm,
                                                      hub_token_secret=spec.hub_token_secret)
        running.append(hub_datasets)
    try:
        check_image_contract(settings.worker_image())  # a stale image would refuse the job only after a GPU was rented
        local_formats = check_local_inputs(spec)
        offers = {offer.gpu: offer for offer in prices.result()}
        gpus, not_pooled = pooled_gpus(gpus, offers)  # each pinned in its pool as RunPod's catalog lists the cards
        for reason in not_pooled:
            logger.warning("Not renting %s", reason)
        floors = [cuda_floor(g, settings.loraflow_image_min_cuda) for g in gpus]
        gpus, excluded = placeable_gpus(gpus, offers, floors,
                                        alternatives=lambda: catalog_fits(settings.loraflow_image_min_cuda))
        for fit in excluded:
            logger.warning("Not renting %s: no host runs the worker image (%s)", fit.gpu, fit.describe())
        ceiling = cost_ceiling([offers[g.name] for g in gpus], spec.compute.gpu_count, spec.deadline_minutes)
        spent.ceiling_usd = ceiling.usd
        check_budget(ceiling.usd, spec.budget_usd, ceiling.price_source, settings.loraflow_max_run_usd)
        secrets.result()
        model_source = model.result()
        lora = spec.lora  # or the shape of the adapter it goes on training, which must be there and fit the model
        if spec.lora.init_from is not None:
            lora = adopt_parent_adapter(spec.lora, model_source, read_parent_config(
                spec.lora.init_from, spec.artifact_store, settings.with_hub_token(spec.hub_token_secret)))
            logger.info("Starting from the adapter %s: rank %d, alpha %d", spec.lora.init_from, lora.rank, lora.alpha)
        pinned = hub_datasets.result() if hub_sources else {}
        if spec.dataset.mix:  # the sources whose rows were read must mix; the worker judges the others as it mixes
            mixed_format(local_formats | {field: hub.trl_format for field, hub in pinned.items() if hub.trl_format})
        if spec.algorithm == "sft":
            chats.result()  # a run whose loss would be on no answer is refused before its inputs are stored
        tool_files = {}
        if uses_tools:
            found = tools.result()
            tool_files = {field: str(path) for field, path in
                          (("tools", found.tools_file), ("environment", found.environment_file)) if path is not None}
        # The dataset files, the evaluation file, the chat template and the reward files, in one commit, while the
        # model's shape is read.
        rewards = spec.grpo.rewards if spec.grpo is not None else []
        mix_files = {i: entry.local_file for i, entry in enumerate(spec.dataset.mix) if entry.local_file is not None}
        inputs = publish_run_inputs_task.submit(spec.artifact_store, run_id, spec.dataset.local_file, rewards,
                                                str(Path.cwd()), eval_file=eval_file,
                                                hub_token_secret=spec.hub_token_secret, mix_files=mix_files or None,
                                                chat_template_file=str(template_file) if template_file else None,
                                                tool_files=tool_files or None)
        shape_read = read_model_shape_task.submit(model_source, hub_token_secret=spec.hub_token_secret)
        running += [inputs, shape_read]
        # The rewards come back pointing at their copies; `stored` pins those copies (their commit and sha256).
        dataset_path, rewards, stored = inputs.result()
        job_input = _job_input(spec, run_id, deadline, model_source, job_dataset(spec, run_id, dataset_path, pinned),
                               rewards, chat_template_path=chat_template_store_path(run_id) if template_file else None,
                               lora=lora, tool_files=tool_files, inputs=stored)
        shape = shape_read.result()
        if spec.training.packing and shape is not None and (problem := packing_problem(shape.model_type)):
            raise ValueError(problem)  # the image lacks the kernels that keep a hybrid's packed examples apart
        if shape is not None:  # the worker's own memory planner, on each GPU: those the run cannot fit are not rented
            gpus, too_small = gpus_that_fit(gpus, functools.partial(plan_job, job_input, shape),
                                            quantized_plan_for=_quantized_planner(job_input, shape))
            for fit in too_small:
                logger.warning("Not renting %s: the run does not fit it (%s)", fit.gpu, fit.describe())
            ceiling = cost_ceiling([offers[g.name] for g in gpus], spec.compute.gpu_count, spec.deadline_minutes)
            spent.ceiling_usd = ceiling.usd
        if spec.publish is not None and spec.publish.merged_model_id is not None and shape is not None:
            check_merge_fits(shape.parameters, model_source.id)  # a model no CPU worker can merge: refused now
        logger.info("Run %s: %s, GPUs %s, image %s, cost ceiling %s", spec.name, model_source.id, spec.compute.gpu,
                    settings.worker_image(), ceiling.describe())
        worker_env = prepare_worker_env.submit(spec.hub_token_secret, env=spec.worker.env, secrets=spec.worker.secrets)
        running.append(worker_env)
        ensure_endpoint_limit()
        return CheckedRun(spec=spec, run_id=run_id, deadline=deadline, model=model_source, job_input=job_input,
                          shape=shape, gpus=gpus, offers=offers, ceiling=ceiling, worker_env=worker_env.result())
    finally:
        wait(running)  # whatever refused the run, no check outlives this one


@task(name="check-secrets", cache_policy=NO_CACHE)
def check_secrets(spec: RunSpec) -> None:
    """The run's secret blocks can be read: its Hub token's (a token to publish with, under `[publish]`) and its
    workers' (`worker.secrets`: unreadable or too short → refused)."""
    run_token = Settings().hub_token(spec.hub_token_secret)
    if spec.hub_token_secret is None and run_token is not None:
        get_run_logger().warning(
            "hub_token_secret is unset: this run's workers get the control plane's own Hugging Face token (HF_TOKEN or "
            "its `hf-token` block). On a shared server name your own in hub_token_secret; LORAFLOW_REQUIRE_RUN_TOKEN=1 "
            "requires every run to")
    for name, repo in (spec.publish.repos if spec.publish is not None else {}).items():
        check_publish_token(repo, run_token, field=name)
    read_run_secrets(spec.worker.secrets)


def _local_chat_files(spec: RunSpec) -> list[tuple[str, str, dict[str, str]]]:
    """(path, format, columns) of each local file of the run's rows: its dataset's (or mix entries') and its
    evaluation file."""
    files = [(source.local_file, source.format, source.columns) for _, source in spec.dataset.sources()
             if source.local_file is not None]
    if spec.evaluation is not None and spec.evaluation.local_file is not None:
        files.append((spec.evaluation.local_file, spec.evaluation.format, spec.evaluation.columns))
    return files


def check_local_inputs(spec: RunSpec) -> dict[str, str | None]:
    """The dataset files and the evaluation file (those that are local: every line converted from its format and
    checked) and the reward files. Returns the TRL format of each local dataset file, by its spec field."""
    logger = get_run_logger()
    examples = eval_examples = None
    formats = {}
    for name, source in spec.dataset.sources():
        if source.local_file is not None:
            examples = check_dataset_jsonl(Path(source.local_file), spec.algorithm, f"{name}.local_file",
                                           source.format, source.columns)
            formats[name] = first_row_format(Path(source.local_file), source.format, source.columns)
            logger.info("Dataset %s: %d examples (%s)", source.local_file, examples, name)
    if spec.dataset.mix:
        examples = None  # how many a mix draws is known once it is drawn
    eval_file = spec.evaluation.local_file if spec.evaluation is not None else None
    if eval_file is not None:
        eval_examples = check_dataset_jsonl(Path(eval_file), spec.algorithm, "evaluation.local_file",
                                            spec.evaluation.format, spec.evaluation.columns)
    if spec.evaluation is not None:
        _log_evaluation_cost(spec, examples, eval_examples)
    # Relative reward files start where a relative local_file does.
    check_reward_files(spec.grpo.rewards if spec.grpo is not None else [], Path.cwd())
    return formats


def job_dataset(spec: RunSpec, run_id: str, dataset_path: str | None,
                pinned: dict[str, HubDataset]) -> DatasetSource:
    """The job's `dataset`: each local file replaced by its copy in the store (`dataset_path`, or the mix entry's
    `mix_store_path`), each Hub dataset pinned to the commit its check found (`pinned`, by spec field)."""

    def source(field: str, entry: DatasetSpec | MixEntrySpec, store_path: str | None) -> dict:
        fields = {"split": entry.split, "format": entry.format, "columns": entry.columns}
        if entry.hub_id is None:
            return {**fields, "store_path": store_path}
        revision = pinned[field].sha if field in pinned else entry.revision
        return {**fields, "hub_id": entry.hub_id, "config": entry.config, "revision": revision}

    if spec.dataset.mix:
        return DatasetSource(mix=[{**source(f"dataset.mix[{i}]", entry, mix_store_path(run_id, i)),
                                   "fraction": entry.fraction} for i, entry in enumerate(spec.dataset.mix)])
    return DatasetSource(**source("dataset", spec.dataset, dataset_path))


def _job_input(spec: RunSpec, run_id: str, deadline: float, model: ModelSource, dataset: DatasetSource,
               rewards: list, chat_template_path: str | None = None, lora: LoraSettings | None = None,
               tool_files: dict[str, str] | None = None, inputs: StoredInputs | None = None) -> JobInput:
    grpo = None
    if spec.grpo is not None:  # the rewards and tools point at their copies in the store
        grpo = spec.grpo.model_copy(update={"rewards": rewards, **{
            f"{field}_store_path": tools_store_path(run_id, field) for field in tool_files or {}}})
    # QLoRA GRPO generates with the training model: TRL's merge of an adapter into a 4-bit base for vLLM misbehaves.
    qlora_grpo = spec.algorithm == "grpo" and spec.lora.quantization == "4bit"
    # A chat template file is read from its copy in the store (`chat_template_path`), as the dataset is.
    training = spec.training.model_copy(update={"chat_template": chat_template_path}) if chat_template_path \
        else spec.training
    return JobInput(run_id=run_id, attempt=1, algorithm=spec.algorithm, model=model, dataset=dataset, lora=lora or spec.lora,
                    training=training, grpo=grpo, dpo=spec.dpo, artifact_store=spec.artifact_store, deadline_epoch_s=deadline,
                    extra_packages=spec.extra_packages, evaluation=_job_evaluation(spec, run_id),
                    memory=MemorySettings(vllm_colocate=False) if qlora_grpo else None,
                    worker_env_names=sorted(spec.worker.env), worker_secret_names=sorted(spec.worker.secrets),
                    # The worker refuses a value that is not the one checked here (a secret RunPod put in its place).
                    worker_env_sha256={name: sha256_hex(value.encode()) for name, value in spec.worker.env.items()},
                    fast_paths=spec.fast_paths, inputs=inputs)


def _job_evaluation(spec: RunSpec, run_id: str) -> EvaluationSettings | None:
    """The job's `evaluation`: the spec's, its local file replaced by the copy `publish_run_inputs_task` stores."""
    if spec.evaluation is None:
        return None
    if spec.evaluation.local_file is None:
        return EvaluationSettings(fraction=spec.evaluation.fraction, every_steps=spec.evaluation.every_steps,
                                  max_samples=spec.evaluation.max_samples)
    return EvaluationSettings(store_path=eval_store_path(run_id), format=spec.evaluation.format,
                              columns=spec.evaluation.columns, every_steps=spec.evaluation.every_steps,
                              max_samples=spec.evaluation.max_samples)


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


@task(name="place", cache_policy=NO_CACHE)
def place(run: CheckedRun, attempt: int, attempts: Attempts) -> tuple[AttemptPlan, DataCenterCache | None]:
    """The attempt's GPU (the run's list, walked on no capacity), its datacenter when a volume there holds the
    model warm (a record whose volume is gone is cleared here, and the attempt goes cold: a record is a hint),
    and the endpoint it will ask RunPod for."""
    logger = get_run_logger()
    offer = run.offers[run.gpus[attempts.gpu_index].name]
    cache = (warm_cache_for(run.model.id, run.model.revision, offer.in_stock_data_centers(),
                            existing_volumes=existing_volume_ids, logger=logger)
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
    """The attempt's endpoint, from its create to its confirmed delete (`tasks/lifecycle/attempt.py`); when
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
                                         on_submitted=load_in_background)
    except WarmVolumeGone as gone:
        get_run_logger().warning("Attempt %d: %s; its weight-cache record is cleared and the attempt runs cold",
                                 attempt, gone)
        forget(cache, get_run_logger())
        cache, plan = None, plan_for(run, attempt, attempts, None)
        outcome, undeleted = run_attempt(plan, progress_key=progress_key, endpoint_ids=attempts.endpoint_ids,
                                         on_submitted=load_in_background)
    return outcome, undeleted, plan, cache


def cancelled_during(attempt: int, outcome: JobOutcome, undeleted: UndeletedEndpoint | None) -> Cancelled:
    get_run_logger().warning("Attempt %d: %s", attempt, outcome.error)
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
    curve = curve_png(results.result.metrics, spec.algorithm)
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
