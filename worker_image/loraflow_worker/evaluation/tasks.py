"""The run's task evaluations: every task of `evaluation.tasks` answered by the base and by the kept adapter, each
grader scoring both, a `TaskScore` per task and grader (the means, their difference and standard errors), and a sample
of the answers for the run's folder (`evaluation/<task>.jsonl`), the adapter's best and worst first."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from loraflow_worker.artifacts import ArtifactStore
from loraflow_worker.contract import JobInput
from loraflow_worker.contract.task_evaluation import GraderSettings, TaskEvaluation, TaskScore, task_score
from loraflow_worker.evaluation.answering import Answerer
from loraflow_worker.evaluation.function_graders import grade_with_function, load_grader_function
from loraflow_worker.evaluation.graders import expected_text, grade_builtin
from loraflow_worker.evaluation.judge import grade_with_judge
from loraflow_worker.evaluation.task_rows import TaskRow, read_task_rows

log = logging.getLogger(__name__)


@dataclass
class PreparedTask:
    """A task read and its graders loaded: what can fail without a model fails here, before answering starts."""

    task: TaskEvaluation
    rows: list[TaskRow]
    functions: dict[str, Callable[..., list[float]]]
    """The `function` graders' functions, by label."""


@dataclass
class TaskResults:
    scores: list[TaskScore] = field(default_factory=list)
    files: dict[str, bytes] = field(default_factory=dict)
    """Store path → the answers sample of each task evaluated."""


def answers_path(prefix: str, task: str) -> str:
    """Where a task's answers sample is stored: `runs/<id>/evaluation/<task>.jsonl`."""
    return f"{prefix}/evaluation/{task}.jsonl"


def prepare_tasks(job: JobInput, store: ArtifactStore, work_dir: Path) -> list[PreparedTask]:
    prepared = []
    for task in job.evaluation.tasks:
        functions = {grader.label: load_grader_function(task.name, grader, store, work_dir / "grader-files")
                     for grader in task.graders if grader.kind == "function"}
        prepared.append(PreparedTask(task, read_task_rows(task, store), functions))
    return prepared


def evaluate_task(prepared: PreparedTask, answerer: Answerer, prefix: str, say: Callable[[str], None],
                  results: TaskResults) -> None:
    """Answer and grade one task, adding its scores and answers sample to `results`; `say` sends a progress
    message."""
    task, rows = prepared.task, prepared.rows
    answers = {}
    for side in ("base", "adapter"):
        def batch_done(done: int, side: str = side) -> None:
            say(f"task `{task.name}`: the {side} answered {done} of {len(rows)} prompts")

        answers[side] = answerer.answer(task, rows, adapter=side == "adapter", batch_done=batch_done)
    per_grader: dict[str, dict[str, list[float]]] = {}
    for grader in task.graders:
        answerer.check_deadline(task)  # a judge's requests take their time too
        scored = {side: grade(prepared, grader, answers[side]) for side in ("base", "adapter")}
        per_grader[grader.label] = {side: scores for side, (scores, _) in scored.items()}
        score = task_score(task.name, grader.label, scored["base"][0], scored["adapter"][0],
                           failed=scored["base"][1] + scored["adapter"][1])
        results.scores.append(score)
        line = score_line(score)
        log.info(line)
        say(line)
    results.files[answers_path(prefix, task.name)] = answers_sample(task, rows, answers, per_grader)


def grade(prepared: PreparedTask, grader: GraderSettings, answers: list[str]) -> tuple[list[float], int]:
    """(a score per answer, how many were left unscored) by `grader`."""
    rows = prepared.rows
    if grader.kind == "function":
        return grade_with_function(prepared.task.name, grader, prepared.functions[grader.label], rows, answers)
    if grader.kind == "judge":
        return grade_with_judge(prepared.task.name, grader, rows, answers)
    return grade_builtin(grader, answers, [row.answer for row in rows]), 0


def score_line(score: TaskScore) -> str:
    """`task:<task>/<grader>: base x ± se, adapter y ± se, Δ d ± se (n prompts)`, the log's line of one score."""
    failed = f", {score.failed} unscored" if score.failed else ""
    return (f"{score.metric}: base {score.base:.3f} ± {score.base_stderr:.3f}, adapter {score.adapter:.3f} ± "
            f"{score.adapter_stderr:.3f}, Δ {score.delta:+.3f} ± {score.delta_stderr:.3f} ({score.n} prompts{failed})")


def answers_sample(task: TaskEvaluation, rows: list[TaskRow], answers: dict[str, list[str]],
                   per_grader: dict[str, dict[str, list[float]]]) -> bytes:
    """`samples_kept` rows of prompt, expected answer, both answers and every grader's scores: the adapter's best
    answers (by its mean over the graders) first, then its worst, worst last."""
    adapter_mean = [sum(scores["adapter"][i] for scores in per_grader.values()) / len(per_grader)
                    for i in range(len(rows))]
    ranked = sorted(range(len(rows)), key=lambda i: -adapter_mean[i])  # stable: ties keep the file's order
    kept = ranked if task.samples_kept >= len(ranked) else \
        ranked[:(task.samples_kept + 1) // 2] + ranked[len(ranked) - task.samples_kept // 2:]
    lines = []
    for i in kept:
        row = rows[i]
        lines.append(json.dumps({
            "row": i + 1, "prompt": row.prompt,
            "answer": expected_text(row.answer) if row.answer is not None else None,
            "base": answers["base"][i], "adapter": answers["adapter"][i],
            "scores": {label: {"base": scores["base"][i], "adapter": scores["adapter"][i]}
                       for label, scores in per_grader.items()},
        }, ensure_ascii=False))
    return ("\n".join(lines) + "\n").encode() if lines else b""
