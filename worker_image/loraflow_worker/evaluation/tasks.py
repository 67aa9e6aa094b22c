"""Task evaluations: every task answered by the base and by each adapter, each grader scoring the base's answers once
and every adapter's against them, a `TaskScore` per adapter, task and grader (the means, their difference and
standard errors), and a sample of each adapter's answers for the store (`<folder>/<task>.jsonl`), its best and worst
first. A run evaluates its kept adapter after training (`after_training.py`); an evaluate job compares several
(`runtime/evaluate.py`)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from loraflow_worker.artifacts import ArtifactStore
from loraflow_worker.contract.task_evaluation import GraderSettings, TaskEvaluation, TaskScore, task_score
from loraflow_worker.evaluation.answering import TaskAnswerer
from loraflow_worker.evaluation.function_graders import grade_with_function, load_grader_function
from loraflow_worker.evaluation.graders import expected_text, grade_builtin
from loraflow_worker.evaluation.judge import grade_with_judge
from loraflow_worker.evaluation.task_rows import TaskRow, read_task_rows
from loraflow_worker.runtime.redaction import redact_record

log = logging.getLogger(__name__)


@dataclass
class PreparedTask:
    """A task read and its graders loaded: what can fail without a model fails here, before answering starts."""

    task: TaskEvaluation
    rows: list[TaskRow]
    functions: dict[str, Callable[..., list[float]]]
    """The `function` graders' functions, by label."""


@dataclass(frozen=True)
class AnsweringAdapter:
    """An adapter that answers: its PEFT adapter name, its label in messages (None: the run's one adapter, "the
    adapter"), and the store folder of its answers samples."""

    name: str
    label: str | None
    answers_folder: str

    @property
    def called(self) -> str:
        return "the adapter" if self.label is None else f"adapter `{self.label}`"


@dataclass
class TaskResults:
    scores: dict[str, list[TaskScore]] = field(default_factory=dict)
    """Adapter name → its scores, per task and grader."""
    files: dict[str, bytes] = field(default_factory=dict)
    """Store path → the answers sample of each adapter and task evaluated."""

    def missing(self, prepared: Sequence[PreparedTask], adapter: str) -> list[str]:
        """The tasks that lack some grader's score for `adapter` (those that have some keep them)."""
        scored = [score.task for score in self.scores.get(adapter, [])]
        return [t.task.name for t in prepared if scored.count(t.task.name) < len(t.task.graders)]


def answers_path(folder: str, task: str) -> str:
    """Where a task's answers sample is stored: `<folder>/<task>.jsonl` (a run's: `runs/<id>/evaluation`)."""
    return f"{folder}/{task}.jsonl"


def prepare_tasks(tasks: Sequence[TaskEvaluation], store: ArtifactStore, work_dir: Path) -> list[PreparedTask]:
    """Each task's rows read from `store` (one that reads them at their pins) and its grader functions imported."""
    prepared = []
    for task in tasks:
        functions = {grader.label: load_grader_function(task.name, grader, store, work_dir / "grader-files")
                     for grader in task.graders if grader.kind == "function"}
        prepared.append(PreparedTask(task, read_task_rows(task, store), functions))
    return prepared


def evaluate_task(prepared: PreparedTask, answerer: TaskAnswerer, adapters: Sequence[AnsweringAdapter],
                  say: Callable[[str], None], results: TaskResults, secret_names: Sequence[str] = ()) -> None:
    """Answer and grade one task: the base once, then each adapter in turn, adding each adapter's scores (against the
    base's) and answers sample (secrets of `secret_names` redacted) to `results` as soon as it has them; `say` sends a
    progress message."""
    task, rows = prepared.task, prepared.rows

    def answer(adapter: AnsweringAdapter | None) -> list[str]:
        called = "the base" if adapter is None else adapter.called

        def batch_done(done: int) -> None:
            say(f"task `{task.name}`: {called} answered {done} of {len(rows)} prompts")

        return answerer.answer(task, rows, adapter=None if adapter is None else adapter.name, batch_done=batch_done)

    def graded(answers: list[str]) -> dict[str, tuple[list[float], int]]:
        by_grader = {}
        for grader in task.graders:
            answerer.check_deadline(task)  # a judge's requests take their time too
            by_grader[grader.label] = grade(prepared, grader, answers)
        return by_grader

    base_answers = answer(None)
    base = graded(base_answers)
    for adapter in adapters:
        answers = answer(adapter)
        scored = graded(answers)
        for grader in task.graders:
            (base_scores, base_failed), (scores, failed) = base[grader.label], scored[grader.label]
            score = task_score(task.name, grader.label, base_scores, scores, failed=base_failed + failed,
                               answered_by=answerer.backend)
            results.scores.setdefault(adapter.name, []).append(score)
            line = score_line(score) + ("" if adapter.label is None else f" ({adapter.called})")
            log.info(line)
            say(line)
        per_grader = {label: {"base": base[label][0], "adapter": scored[label][0]} for label in scored}
        results.files[answers_path(adapter.answers_folder, task.name)] = answers_sample(
            task, rows, {"base": base_answers, "adapter": answers}, per_grader, secret_names)


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
                   per_grader: dict[str, dict[str, list[float]]], secret_names: Sequence[str] = ()) -> bytes:
    """`samples_kept` rows of prompt, expected answer, both answers and every grader's scores: the adapter's best
    answers (by its mean over the graders) first, then its worst, worst last; secrets redacted (the environment's and
    those `secret_names` names)."""
    adapter_mean = [sum(scores["adapter"][i] for scores in per_grader.values()) / len(per_grader)
                    for i in range(len(rows))]
    ranked = sorted(range(len(rows)), key=lambda i: -adapter_mean[i])  # stable: ties keep the file's order
    kept = ranked if task.samples_kept >= len(ranked) else \
        ranked[:(task.samples_kept + 1) // 2] + ranked[len(ranked) - task.samples_kept // 2:]
    lines = []
    for i in kept:
        row = rows[i]
        lines.append(json.dumps(redact_record({
            "row": i + 1, "prompt": row.prompt,
            "answer": expected_text(row.answer) if row.answer is not None else None,
            "base": answers["base"][i], "adapter": answers["adapter"][i],
            "scores": {label: {"base": scores["base"][i], "adapter": scores["adapter"][i]}
                       for label, scores in per_grader.items()},
        }, secret_names), ensure_ascii=False))
    return ("\n".join(lines) + "\n").encode() if lines else b""
