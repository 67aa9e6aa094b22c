"""What the worker evaluates after training, on the same machine, for the adapter the run keeps (the one it stores):
the run's task evaluations (`tasks`), then its benchmarks (`benchmarks`), base against adapter. Evaluation counts
inside the job's deadline: when it passes, the evaluation stops where it is, and the run is stored with the scores it
has and says why the rest are missing."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from loraflow_worker.artifacts import ArtifactStore
from loraflow_worker.contract import JobInput, Progress, run_prefix
from loraflow_worker.evaluation.evaluated import Evaluated
from loraflow_worker.evaluation.answering import EvaluationDeadline, deadline_passed, run_chat_template
from loraflow_worker.evaluation.tasks import AnsweringAdapter, PreparedTask, TaskResults, evaluate_task, prepare_tasks
from loraflow_worker.evaluation.device import evaluation_device
from loraflow_worker.evaluation.vllm_answering import open_answerer
from loraflow_worker.runtime.model_cache import resolve_base_model
from loraflow_worker.training.run import quantization_config

log = logging.getLogger(__name__)


def prepare_evaluation(job: JobInput, store: ArtifactStore, work_dir: Path) -> list[PreparedTask]:
    """Before training: the tasks' rows read and their grader functions imported, so that a task file or grader that
    cannot be used fails the job before its GPU time is spent."""
    return prepare_tasks(job.evaluation.tasks, store, work_dir) if job.evaluation is not None else []


def evaluate_after_training(job: JobInput, store: ArtifactStore, work_dir: Path, adapter_dir: Path,
                            prepared: list[PreparedTask], report: Callable[[Progress], None], steps: int) -> Evaluated:
    """The `prepared` task evaluations of `job`, then its benchmarks, for the adapter saved in `adapter_dir` (the one
    the run stores), after `steps` optimizer steps of training (which their progress updates carry). Whatever stops
    them (the deadline, a grader or benchmark that fails, memory), the run's adapter is stored all the same:
    `Evaluated.stopped` says why tasks are missing, the progress why benchmarks are."""
    evaluated = Evaluated()

    def say(message: str) -> None:
        # Within `Progress.message`'s limit: an error quoted in it may be long.
        report(Progress(stage="evaluating", step=steps, total_steps=steps, message=message[:2000]))

    if prepared:
        _evaluate_tasks(job, store, adapter_dir, prepared, say, evaluated)
    if job.evaluation is not None and job.evaluation.benchmarks is not None:
        # lm-eval takes seconds to import: only for a run that asks for benchmarks.
        from loraflow_worker.evaluation.benchmarks import job_benchmarks

        evaluated.benchmark_scores = job_benchmarks(job, store, adapter_dir, work_dir, say)
    return evaluated


ADAPTER = "default"
"""The PEFT name of the run's one adapter."""


def _evaluate_tasks(job: JobInput, store: ArtifactStore, adapter_dir: Path, prepared: list[PreparedTask],
                    say: Callable[[str], None], evaluated: Evaluated) -> None:
    say(f"task evaluations: {len(prepared)} task(s), the base and the adapter answering each")
    results = TaskResults()
    adapter = AnsweringAdapter(ADAPTER, None, f"{run_prefix(job.run_id)}/evaluation")
    try:
        # Loading the model again would eat the grace in which the run must be stored.
        if deadline_passed(job.deadline_epoch_s):
            raise EvaluationDeadline("the job's deadline passed before the task evaluations began")
        model_path, _ = resolve_base_model(job.model)
        # The base answers with the run's tokenizer and chat template too: as training rendered its chats.
        with open_answerer(model_path, {adapter: adapter_dir}, base_tokenizer_dir=adapter_dir, prepared=prepared,
                           device=evaluation_device(), say=say,
                           chat_template=run_chat_template(job.training.chat_template, store),
                           quantization=quantization_config(job), deadline_epoch_s=job.deadline_epoch_s,
                           seed=job.training.seed) as answerer:
            for task in prepared:
                evaluate_task(task, answerer, [adapter], say, results, job.worker_secret_names)
    except EvaluationDeadline as e:
        evaluated.stopped = (f"{e}: the adapter is complete and stored, but {_missing(prepared, results)}; give the "
                             "run a longer `deadline_minutes` to evaluate them")
    except Exception as e:  # noqa: BLE001 - the trained adapter is stored whatever its evaluation ran into
        log.exception("the task evaluations failed")
        evaluated.stopped = (f"the task evaluations failed ({type(e).__name__}: {e}): the adapter is complete and "
                             f"stored, but {_missing(prepared, results)}")
    if evaluated.stopped:
        log.warning(evaluated.stopped)
        say(evaluated.stopped)
    evaluated.task_scores, evaluated.files = results.scores.get(ADAPTER, []), results.files


def _missing(prepared: list[PreparedTask], results: TaskResults) -> str:
    return f"task(s) {', '.join(results.missing(prepared, ADAPTER))} were not evaluated (in full)"
