"""The first phase of a `train` run (`flows/train.py`), `check`: everything a run needs checked and decided before
anything is rented, the checks that do not depend on each other at once: this server's rules, the secrets and tokens,
the image's contract, the GPUs whose hosts run its CUDA and the budget, the local inputs, the model and the Hub
datasets pinned and the first chats masked by the model's tokenizer; then the inputs stored (pinned by their
hashes), the GPUs the memory plan fits, the quota's limit and the workers' env. What it decides is a `CheckedRun`,
and with it the job's input; the phases after it are `flows/train_phases.py`.
"""

# No `from __future__ import annotations`: Prefect reads these tasks' signatures.
import contextvars
import functools
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from loraflow_worker.artifacts.pins import sha256_hex
from loraflow_worker.contract import (
    BenchmarkSettings,
    DatasetSource,
    EvaluationSettings,
    JobInput,
    LoraSettings,
    MemorySettings,
    ModelSource,
    StoredInputs,
    TaskEvaluation,
)
from loraflow_worker.contract.dataset_formats import mixed_format
from loraflow_worker.dataset.packing import packing_problem
from loraflow_worker.memory.model_shape import ModelShape
from loraflow_worker.memory.plan import MemoryPlan, plan_job
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.futures import wait

from flows.forms.run import RunSpec
from flows.forms.run_data import BenchmarkSpec, DatasetSpec, MixEntrySpec, TaskSpec
from tasks.jobs.merge import check_merge_fits
from tasks.lifecycle.quota import ensure_endpoint_limit
from tasks.lifecycle.secret_key import run_checkpoint_key, secret_name_key
from tasks.lifecycle.steps import prepare_worker_env
from tasks.lifecycle.worker_env import read_run_secrets
from tasks.placement.cost import (
    EVAL_SHARE_WARNING,
    CostCeiling,
    check_budget,
    cost_ceiling,
    evaluation_cost,
    read_gpu_prices,
)
from tasks.placement.gpu_fit import catalog_fits, gpus_that_fit, placeable_gpus, pooled_gpus
from tasks.placement.image_contract import check_image_contract
from tasks.placement.plan import read_model_shape_task, resolve_model_task
from tasks.placement.weight_cache import DataCenterCache, read_all_caches
from tasks.reports import events
from tasks.preflight.chats import check_chats_task
from tasks.preflight.server_rules import check_server_rules
from tasks.preflight.task_files import (
    check_benchmark_names,
    check_grader_function,
    check_judge_key,
    check_task_file,
    check_task_lengths_task,
    private_benchmark_tasks,
)
from tasks.preflight.tools import check_tools_task
from tasks.runpod.catalog import GpuClass, cuda_floor, resolve_gpu
from tasks.runpod.live_catalog import GpuOffer
from tasks.settings import Settings
from tasks.storage.artifacts import (
    chat_template_store_path,
    check_chat_template_file,
    check_dataset_jsonl,
    eval_store_path,
    first_row_format,
    mix_store_path,
    publish_run_inputs_task,
    tools_store_path,
)
from tasks.storage.evaluation_inputs import grader_store_path, task_dir_store_path, task_store_path
from tasks.storage.hub_datasets import HubDataset, check_hub_datasets_task
from tasks.storage.init_from import adopt_parent_adapter, read_parent_config
from tasks.storage.publish import check_publish_token
from tasks.storage.rewards import check_reward_files
from tasks.storage.run_files import RunFile, read_run_files

T = TypeVar("T")


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
    warm_records: dict[str, DataCenterCache] | None = None
    """The weight-cache records as read while the run was checked, for its first placement; None: read them then."""

    @property
    def began_at(self) -> float:
        return self.deadline - self.spec.deadline_minutes * 60


@task(name="check", cache_policy=NO_CACHE)
def check(spec: RunSpec, run_id: str, spent: events.RunSpend) -> CheckedRun:
    """Nothing is rented until this has passed. `spent` learns the cost ceiling as soon as it is known, for the run's
    end event even when the budget refuses the run (the flow passes it quoted: Prefect hands the object itself over,
    without looking into it)."""
    deadline = time.time() + spec.deadline_minutes * 60
    settings = Settings()
    gpus = [resolve_gpu(gpu_name) for gpu_name in spec.compute.gpu]
    # Before any of the run's files is read: whether this server lets the run read them at all.
    check_server_rules(spec.local_paths(), artifact_store=spec.artifact_store, hub_token_secret=spec.hub_token_secret,
                       settings=settings, worker_secrets=spec.worker.secrets)
    # Then each is read once, never through a link, into a private folder: every check below reads that copy, and
    # the store receives it, pinned by the hash of that read.
    with tempfile.TemporaryDirectory(prefix="loraflow-run-files-") as folder:
        files = read_run_files(spec.local_paths(), Path(folder), base_dir=Path.cwd(),
                               inputs_dir=settings.loraflow_inputs_dir)
        return _check_read(spec, run_id, spent, files, deadline, gpus, settings)


def _check_read(spec: RunSpec, run_id: str, spent: events.RunSpend, files: dict[str, RunFile], deadline: float,
                gpus: list[GpuClass], settings: Settings) -> CheckedRun:
    """`check`'s body once the run's files are read (`files`, by field)."""
    logger = get_run_logger()
    floors = [cuda_floor(g, settings.loraflow_image_min_cuda) for g in gpus]
    # What needs the network, at once: secret blocks (Prefect), the catalog (RunPod), the model (the Hub).
    template_file = check_chat_template_file(spec.training.chat_template, files)
    # The worker resumes only from checkpoints it signed with this key (none a store writer could plant).
    checkpoint_key = _meanwhile(lambda: run_checkpoint_key(secret_name_key(settings.control_plane_namespace()),
                                                           run_id))
    endpoint_limit = _meanwhile(ensure_endpoint_limit)  # the slot a run takes once checked needs the limit to exist
    warm_records = _meanwhile(_warm_records)  # where the first attempt may find the model warm
    secrets = check_secrets.submit(spec)
    prices = read_gpu_prices.submit(gpus, floors)
    model = resolve_model_task.submit(spec.model, disk_gb=spec.compute.disk_gb, hub_token_secret=spec.hub_token_secret)
    running = [secrets, prices, model]
    if spec.algorithm == "sft":  # the first chats rendered by the model's tokenizer once the model is pinned
        chats = check_chats_task.submit(model, spec.training, _local_chat_files(spec, files),
                                        str(template_file.copy) if template_file else None, spec.hub_token_secret)
        running.append(chats)
    uses_tools = spec.grpo is not None and spec.grpo.uses_tools
    if uses_tools:  # the tools read from their source (never run here), and the model's template rendering them
        tools = check_tools_task.submit(spec.grpo, str(Path.cwd()), model, spec.hub_token_secret,
                                        prompt_files=_local_chat_files(spec, files), read_from=_read_tools(files))
        running.append(tools)
    hub_sources = [(field, source.hub_source()) for field, source in spec.dataset.sources() if source.hub_id]
    if hub_sources:  # the Hub datasets: their revisions pinned, configs and splits found, first rows checked
        hub_datasets = check_hub_datasets_task.submit(hub_sources, spec.algorithm,
                                                      hub_token_secret=spec.hub_token_secret)
        running.append(hub_datasets)
    try:
        check_image_contract(settings.worker_image())  # a stale image would refuse the job only after a GPU was rented
        local_formats, evaluation_inputs = check_local_inputs(spec, files)
        if spec.evaluation is not None and spec.evaluation.tasks:  # each task's answers within the model's context
            lengths = check_task_lengths_task.submit(model, [
                (f"evaluation.tasks[{i}]", evaluation_inputs.longest[t.name], t.max_new_tokens)
                for i, t in enumerate(spec.evaluation.tasks)], spec.hub_token_secret)
            running.append(lengths)
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
        if spec.evaluation is not None and spec.evaluation.tasks:
            lengths.result()  # a task whose answers cannot fit is refused before its inputs are stored
        if uses_tools:
            tools.result()
        tool_files = [field for field in ("tools", "environment") if f"grpo.{field}" in files]
        # The files as they were read and checked (the dataset's, the evaluation file, the chat template, the tools',
        # the reward files and the evaluation tasks'), in one commit, while the model's shape is read.
        rewards = spec.grpo.rewards if spec.grpo is not None else []
        inputs = publish_run_inputs_task.submit(spec.artifact_store, run_id, files, rewards,
                                                hub_token_secret=spec.hub_token_secret)
        shape_read = read_model_shape_task.submit(model_source, hub_token_secret=spec.hub_token_secret)
        running += [inputs, shape_read]
        # The rewards come back pointing at their copies; `stored` pins those copies (their commit and sha256).
        dataset_path, rewards, stored = inputs.result()
        job_input = _job_input(spec, run_id, deadline, model_source, job_dataset(spec, run_id, dataset_path, pinned),
                               rewards, chat_template_path=chat_template_store_path(run_id) if template_file else None,
                               lora=lora, tool_files=tool_files, inputs=stored)
        job_input.checkpoint_key = checkpoint_key.result()
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
        if spec.publish is not None and (serving := spec.publish.serve) is not None:
            logger.info("Then served (publish.serve) for %g h within $%.2f, beside this ceiling: the serve checks its "
                        "own GPU and cost once the run has completed", serving.hours,
                        serving.budget_usd or spec.budget_usd)
        worker_env = prepare_worker_env.submit(spec.hub_token_secret, env=spec.worker.env, secrets=spec.worker.secrets)
        running.append(worker_env)
        endpoint_limit.result()
        return CheckedRun(spec=spec, run_id=run_id, deadline=deadline, model=model_source, job_input=job_input,
                          shape=shape, gpus=gpus, offers=offers, ceiling=ceiling, worker_env=worker_env.result(),
                          warm_records=warm_records.result())
    finally:
        wait(running)  # whatever refused the run, no check outlives this one
        checkpoint_key.exception()
        endpoint_limit.exception()
        warm_records.exception()


def _meanwhile(read: Callable[[], T]) -> Future[T]:
    """`read()` in a thread of its own, in a copy of the run's context, while the checks go on: the checkpoint key
    (two requests to the Prefect server: the namespace and its key block) and the endpoint limit (one, two when it is
    made) were requests the run otherwise waited for after its checks."""
    future: Future[T] = Future()
    context = contextvars.copy_context()

    def run() -> None:
        try:
            future.set_result(context.run(read))
        except BaseException as e:  # noqa: BLE001 - raised where the answer is used
            future.set_exception(e)

    threading.Thread(target=run, name="loraflow-check-read", daemon=True).start()
    return future


def _warm_records() -> dict[str, DataCenterCache] | None:
    """The weight-cache records; None when they cannot be read now (the placement reads them again, and says why
    when that fails too: a record is a hint, never a reason to refuse a run)."""
    try:
        return read_all_caches(get_run_logger())
    except Exception:  # noqa: BLE001 - see above
        return None


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


def _local_chat_files(spec: RunSpec, files: dict[str, RunFile]) -> list[tuple[str, str, dict[str, str]]]:
    """(path of the copy read, format, columns) of each local file of the run's rows: its dataset's (or mix
    entries') and its evaluation file (the chats an SFT run masks, the prompts a tool GRPO run measures)."""
    chat_files = [(str(files[f"{name}.local_file"].copy), source.format, source.columns)
                  for name, source in spec.dataset.sources() if source.local_file is not None]
    if spec.evaluation is not None and spec.evaluation.local_file is not None:
        chat_files.append((str(files["evaluation.local_file"].copy), spec.evaluation.format, spec.evaluation.columns))
    return chat_files


def _read_tools(files: dict[str, RunFile]) -> dict[str, str]:
    """The copies of the tools and environment files that were read, by field, for the tools' check to read."""
    return {field: str(files[field].copy) for field in ("grpo.tools", "grpo.environment") if field in files}


@dataclass(frozen=True)
class EvaluationInputs:
    """What the run's task files hold, as checked."""

    rows: dict[str, int] = field(default_factory=dict)
    """Each task's prompts, by the task's name."""
    longest: dict[str, list[dict]] = field(default_factory=dict)
    """Each task's longest prompt (in characters, as messages), by the task's name."""


def check_evaluation_inputs(spec: RunSpec, files: dict[str, RunFile]) -> EvaluationInputs:
    """The run's task files, graders and benchmarks' task folder (`check_task_inputs` of `[evaluation]`)."""
    if spec.evaluation is None:
        return EvaluationInputs()
    return check_task_inputs("evaluation", spec.evaluation.tasks, spec.evaluation.benchmarks, files,
                             spec.worker.secrets)


def check_task_inputs(section: str, tasks: list[TaskSpec], benchmarks: BenchmarkSpec | None,
                      files: dict[str, RunFile], worker_secrets: dict[str, str]) -> EvaluationInputs:
    """The task files (every row), their graders (a function found in its file, never run here; a judge's key
    among `worker_secrets`) and the benchmarks' task folder of `section` (a run's `evaluation`, an evaluate file's
    `evaluate`), as they were read (`files`, by field); ValueError naming the field."""
    inputs = EvaluationInputs()
    for i, task_spec in enumerate(tasks):
        where, settings = f"{section}.tasks[{i}]", task_spec.grader_settings()
        read = check_task_file(files[f"{where}.local_file"].copy, f"{where}.local_file", settings,
                               shown=task_spec.local_file)
        for j, grader in enumerate(settings):
            if grader.kind == "function":
                check_grader_function(grader.function, files[f"{where}.graders[{j}]"], f"{where}.graders[{j}]",
                                      read.columns)
            check_judge_key(grader, f"{where}.graders[{j}]", worker_secrets)
        inputs.rows[task_spec.name], inputs.longest[task_spec.name] = read.rows, read.longest_prompt
    private = set()
    task_dir = f"{section}.benchmarks.task_dir"
    if benchmarks is not None and benchmarks.task_dir is not None:
        private = private_benchmark_tasks({name[len(task_dir) + 1:]: file.copy for name, file in files.items()
                                           if name.startswith(f"{task_dir}/")}, benchmarks.task_dir, where=task_dir)
    if benchmarks is not None:
        check_benchmark_names(benchmarks.tasks, private, where=f"{section}.benchmarks.tasks")
    return inputs


def check_local_inputs(spec: RunSpec, files: dict[str, RunFile]) -> tuple[dict[str, str | None], EvaluationInputs]:
    """The dataset files and the evaluation file (those that are local: every line converted from its format and
    checked), the reward files and the task evaluations' and benchmarks' files (`check_evaluation_inputs`), as they
    were read (`files`, by field). Returns the TRL format of each local dataset file, by its spec field, and what the
    task files hold."""
    logger = get_run_logger()
    examples = eval_examples = None
    formats = {}
    for name, source in spec.dataset.sources():
        if source.local_file is not None:
            read = files[f"{name}.local_file"]
            examples = check_dataset_jsonl(read.copy, spec.algorithm, f"{name}.local_file", source.format,
                                           source.columns, shown=source.local_file)
            formats[name] = first_row_format(read.copy, source.format, source.columns)
            logger.info("Dataset %s: %d examples (%s)", source.local_file, examples, name)
    if spec.dataset.mix:
        examples = None  # how many a mix draws is known once it is drawn
    eval_file = spec.evaluation.local_file if spec.evaluation is not None else None
    if eval_file is not None:
        eval_examples = check_dataset_jsonl(files["evaluation.local_file"].copy, spec.algorithm,
                                            "evaluation.local_file", spec.evaluation.format, spec.evaluation.columns,
                                            shown=eval_file)
    if spec.evaluation is not None and spec.evaluation.held_out:
        _log_evaluation_cost(spec, examples, eval_examples)
    check_reward_files(spec.grpo.rewards if spec.grpo is not None else [], files)
    evaluation_inputs = check_evaluation_inputs(spec, files)
    for task_spec in spec.evaluation.tasks if spec.evaluation is not None else []:
        logger.info("Task %s: %d prompts, graded by %s (base and adapter, after training)", task_spec.name,
                    evaluation_inputs.rows[task_spec.name], ", ".join(g.label for g in task_spec.grader_settings()))
    return formats, evaluation_inputs


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
               tool_files: list[str] | None = None, inputs: StoredInputs | None = None) -> JobInput:
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
                    extra_packages=spec.extra_packages, evaluation=job_evaluation(spec, run_id),
                    memory=MemorySettings(vllm_colocate=False) if qlora_grpo else None,
                    worker_env_names=sorted(spec.worker.env), worker_secret_names=sorted(spec.worker.secrets),
                    # The worker refuses a value that is not the one checked here (a secret RunPod put in its place).
                    worker_env_sha256={name: sha256_hex(value.encode()) for name, value in spec.worker.env.items()},
                    fast_paths=spec.fast_paths, inputs=inputs)


def job_evaluation(spec: RunSpec, run_id: str) -> EvaluationSettings | None:
    """The job's `evaluation`: the spec's, each local file replaced by the copy `publish_run_inputs_task` stores (the
    evaluation file, the task files, the function graders' files and the benchmarks' task folder)."""
    evaluation = spec.evaluation
    if evaluation is None:
        return None
    tasks, benchmarks = job_tasks(evaluation.tasks, evaluation.benchmarks, run_id)
    common = {"every_steps": evaluation.every_steps, "max_samples": evaluation.max_samples, "tasks": tasks,
              "benchmarks": benchmarks}
    if evaluation.local_file is None:
        return EvaluationSettings(fraction=evaluation.fraction, **common)
    return EvaluationSettings(store_path=eval_store_path(run_id), format=evaluation.format,
                              columns=evaluation.columns, **common)


def job_tasks(tasks: list[TaskSpec], benchmarks: BenchmarkSpec | None,
              run_id: str) -> tuple[list[TaskEvaluation], BenchmarkSettings | None]:
    """The job's tasks and benchmarks: each local file replaced by the copy `publish_run_inputs_task` stores for
    `run_id` (the task files, the function graders' files and the benchmarks' task folder)."""
    job = [TaskEvaluation(
        name=task.name, store_path=task_store_path(run_id, i),
        graders=[grader.model_copy(update={"store_path": grader_store_path(run_id, i, j)})
                 if grader.kind == "function" else grader for j, grader in enumerate(task.grader_settings())],
        **task.model_dump(include={"max_new_tokens", "max_samples", "temperature", "top_p", "samples_kept"}))
        for i, task in enumerate(tasks)]
    if benchmarks is None:
        return job, None
    return job, BenchmarkSettings(**benchmarks.model_dump(exclude={"task_dir"}),
                                  task_dir_store_path=task_dir_store_path(run_id) if benchmarks.task_dir is not None else None)


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
