"""A task's rows: its JSONL file read from the run's store (pinned as every run file is), the first `max_samples`
rows, each a prompt (chat messages up to the last user turn, or text), its expected answer and its other columns."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from loraflow_worker.artifacts import ArtifactStore
from loraflow_worker.contract.task_evaluation import PROMPT_COLUMNS, TaskEvaluation, task_prompt


@dataclass
class TaskRow:
    prompt: str | list[dict[str, Any]]
    """Text, or chat messages ending with the last user turn."""
    answer: Any = None
    """The expected answer (text or number); None where the row has none."""
    columns: dict[str, Any] = field(default_factory=dict)
    """The row's other columns, which function graders get as keyword arguments."""

    @property
    def chat(self) -> bool:
        return isinstance(self.prompt, list)


def read_task_rows(task: TaskEvaluation, store: ArtifactStore) -> list[TaskRow]:
    """The first `task.max_samples` rows of the task's file. ValueError naming the task, row and field when a row has
    no prompt, or no `answer` while one of its graders needs one (the control plane checked the file before renting;
    this says the same of a file it did not check)."""
    rows = []
    needs_answer = [g.label for g in task.graders if g.needs_answer]
    lines = [line for line in store.read_bytes(task.store_path).decode("utf-8").splitlines() if line.strip()]
    for number, line in enumerate(lines[:task.max_samples], start=1):
        where = f"task `{task.name}` ({task.store_path}), row {number}"
        try:
            data = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON ({e})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{where}: a row is a JSON object with `messages` or `prompt`")
        prompt = task_prompt(data, where)
        answer = data.get("answer")
        if answer is None and needs_answer:
            raise ValueError(f"{where}: no `answer`, which grader(s) {', '.join(needs_answer)} compare with: add it")
        columns = {k: v for k, v in data.items() if k not in (*PROMPT_COLUMNS, "answer")}
        rows.append(TaskRow(prompt, answer, columns))
    if not rows:
        raise ValueError(f"task `{task.name}` ({task.store_path}) has no rows")
    return rows
