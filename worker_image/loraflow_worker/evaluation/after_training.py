"""What the worker evaluates after training, on the same machine, for the adapter the run keeps (the one it stores):
the run's task evaluations (`tasks`), base against adapter. Evaluation counts inside the job's deadline: when it passes,
the evaluation stops where it is, and the run is stored with the scores it has and says why the rest are missing."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from loraflow_worker.artifacts import ArtifactStore
from loraflow_worker.contract import JobInput, Progress, run_prefix
from loraflow_worker.evaluation.evaluated import Evaluated
from loraflow_worker.evaluation.answering import EvaluationDeadline, deadline_passed, loaded_answerer
from loraflow_worker.evaluation.tasks import TaskResults, evaluate_task, prepare_tasks
from loraflow_worker.runtime.model_cache import resolve_base_model

log = logging.getLogger(__name__)


def wants_evaluation(job: JobInput) -> bool:
    return job.evaluation is not None and bool(job.evaluation.tasks)


def evaluate_after_training(job: JobInput, store: ArtifactStore, work_dir: Path, adapter_dir: Path,
                            report: Callable[[Progress], None], steps: int) -> Evaluated:
    """The task evaluations of `job` for the adapter saved in `adapter_dir` (the one the run stores), after `steps`
    optimizer steps of training (which its progress updates carry)."""
    evaluated = Evaluated()
    if not wants_evaluation(job):
        return evaluated

    def say(message: str) -> None:
        report(Progress(stage="evaluating", step=steps, total_steps=steps, message=message))
    prefix = run_prefix(job.run_id)
    prepared = prepare_tasks(job, store, work_dir)
    say(f"task evaluations: {len(prepared)} task(s), the base and the adapter answering each")
    model_path, _ = resolve_base_model(job.model)
    results = TaskResults()
    try:
        if deadline_passed(job):  # loading the model again would eat the grace in which the run must be stored
            raise EvaluationDeadline("the job's deadline passed before the task evaluations began")
        with loaded_answerer(job, model_path, adapter_dir, store) as answerer:
            for task in prepared:
                evaluate_task(task, answerer, prefix, say, results)
    except EvaluationDeadline as e:
        done = {score.task for score in results.scores}
        missing = [task.task.name for task in prepared if task.task.name not in done]
        evaluated.stopped = (f"{e}: the adapter is complete and stored, but task(s) {', '.join(missing)} were not "
                             "evaluated; give the run a longer `deadline_minutes` to evaluate them")
        log.warning(evaluated.stopped)
        say(evaluated.stopped)
    evaluated.task_scores, evaluated.files = results.scores, results.files
    # The run's benchmarks (`evaluation.benchmarks`) are evaluated here too, beside the tasks, into
    # `evaluated.benchmark_scores`.
    return evaluated
