"""Where a run's (or an evaluate flow run's) task evaluations and benchmarks are stored with it: each `[[evaluation.tasks]]` file, each function
grader's file and each file of `[evaluation.benchmarks] task_dir`, published with the run's other files in one commit
and pinned by their hashes as they are (`publish_run_inputs`, by the field each was read for)."""

from __future__ import annotations

import re

from loraflow_worker.contract import run_prefix

SECTIONS = ("evaluation", "evaluate")
"""The sections that hold tasks and benchmarks: a run's `[evaluation]`, an evaluate file's `[evaluate]`."""
TASK_DIR_FIELDS = tuple(f"{section}.benchmarks.task_dir" for section in SECTIONS)
"""The fields of the benchmarks' task folder; each of its files is read as `<field>/<path inside the folder>`."""
_TASK_FILE = re.compile(r"^(?:evaluation|evaluate)\.tasks\[(\d+)\]\.local_file$")
_GRADER_FILE = re.compile(r"^(?:evaluation|evaluate)\.tasks\[(\d+)\]\.graders\[(\d+)\]$")
_TASK_DIR_FILE = re.compile(r"^(?:evaluation|evaluate)\.benchmarks\.task_dir/")


def task_store_path(run_id: str, index: int) -> str:
    """The file of `evaluation.tasks[index]`."""
    return f"{run_prefix(run_id)}/dataset/task-{index}.jsonl"


def grader_store_path(run_id: str, task: int, grader: int) -> str:
    """The file of the function grader `evaluation.tasks[task].graders[grader]`."""
    return f"{run_prefix(run_id)}/graders/task{task}_grader{grader}.py"


def task_dir_store_path(run_id: str) -> str:
    """The folder the benchmarks' task folder is stored as, its files inside."""
    return f"{run_prefix(run_id)}/benchmarks"


def evaluation_store_path(run_id: str, field: str) -> str | None:
    """Where the file read for `field` (a task file, a grader's file, a file of the task folder, of a run's
    `evaluation.` or an evaluate file's `evaluate.`) is stored; None for another field."""
    if matched := _TASK_FILE.match(field):
        return task_store_path(run_id, int(matched[1]))
    if matched := _GRADER_FILE.match(field):
        return grader_store_path(run_id, int(matched[1]), int(matched[2]))
    if matched := _TASK_DIR_FILE.match(field):
        return f"{task_dir_store_path(run_id)}/{field[matched.end():]}"
    return None
