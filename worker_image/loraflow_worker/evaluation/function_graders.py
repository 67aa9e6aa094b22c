"""A task's `function` graders: the user's `file.py:function`, read from the run's store where the control plane
stored (and pinned) it and imported as reward files are (`training.user_files`), called as TRL calls a reward
function: in batches, `fn(prompts=[...], completions=[...], answer=[...], **other_columns) -> list[float]`, with
completions as text for text prompts and `[{"role": "assistant", "content": ...}]` for chat prompts."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loraflow_worker.artifacts import ArtifactStore
from loraflow_worker.contract.task_evaluation import GraderSettings, function_reference
from loraflow_worker.evaluation.task_rows import TaskRow
from loraflow_worker.training.user_files import UserFileError, import_stored_function

BATCH_SIZE = 64
"""Rows per call of a grader function."""


class GraderError(ValueError):
    """A grader cannot score as named: its file or function is missing, or it returned what is not a score."""


def load_grader_function(task: str, grader: GraderSettings, store: ArtifactStore,
                         files_dir: Path) -> Callable[..., list[float]]:
    """The function of a `function` grader, imported from its stored file."""
    name = f"task `{task}`, grader `{grader.label}` ({grader.function})"
    if grader.store_path is None:
        raise GraderError(f"{name}: its file is not in the run's artifact store (`store_path` is empty); start the run "
                          "with the train flow, which stores the file")
    _, attribute = function_reference(grader.function)
    try:
        return import_stored_function(store, grader.store_path, attribute, files_dir)
    except UserFileError as e:
        raise GraderError(f"{name}: {e}") from e


def grade_with_function(task: str, grader: GraderSettings, function: Callable[..., list[float]], rows: list[TaskRow],
                        answers: list[str]) -> tuple[list[float], int]:
    """(one score per answer, how many it left unscored): a None score counts 0 and as unscored. GraderError naming
    the grader when it raises, returns another number of scores, or a score outside [0, 1]."""
    name = f"task `{task}`, grader `{grader.label}` ({grader.function})"
    columns = sorted({column for row in rows for column in row.columns})
    scores: list[float] = []
    failed = 0
    for start in range(0, len(rows), BATCH_SIZE):
        batch, texts = rows[start:start + BATCH_SIZE], answers[start:start + BATCH_SIZE]
        kwargs: dict[str, Any] = {column: [row.columns.get(column) for row in batch] for column in columns}
        try:
            returned = function(
                prompts=[row.prompt for row in batch],
                completions=[[{"role": "assistant", "content": text}] if row.chat else text
                             for row, text in zip(batch, texts)],
                answer=[row.answer for row in batch], **kwargs)
        except Exception as e:  # noqa: BLE001 - the user's function: the error must say which grader failed
            raise GraderError(f"{name} raised {type(e).__name__}: {e}") from e
        returned = list(returned) if returned is not None else []
        if len(returned) != len(batch):
            raise GraderError(f"{name} returned {len(returned)} scores for {len(batch)} answers: return one per "
                              "completion")
        for offset, score in enumerate(returned):
            if score is None:
                scores.append(0.0)
                failed += 1
                continue
            value = float(score)
            if not math.isfinite(value) or not 0.0 <= value <= 1.0:
                raise GraderError(f"{name} scored row {start + offset + 1} {score!r}: a grader's scores are shares in "
                                  "[0, 1]; scale them into it")
            scores.append(value)
    return scores, failed
