"""Where a run's task evaluations and benchmarks are stored with it (`[[evaluation.tasks]]` files, their function
graders' files, `[evaluation.benchmarks] task_dir`), published with the run's other inputs in one commit and pinned
by their hashes as they are (`publish_run_inputs`)."""

from __future__ import annotations

import re
from pathlib import Path

from loraflow_worker.contract import run_prefix


def task_store_path(run_id: str, task: str) -> str:
    """A task's prompts file (`evaluation.tasks[i].local_file`, task names are store-safe)."""
    return f"{run_prefix(run_id)}/dataset/task-{task}.jsonl"


def grader_store_paths(files: list[Path], run_id: str) -> dict[Path, str]:
    """Where each distinct function grader file goes: `runs/<run_id>/graders/<file name>`, numbered when two
    different files share a name."""
    store_paths: dict[Path, str] = {}
    for path in files:
        if path in store_paths:
            continue
        stem = re.sub(r"[^A-Za-z0-9_.-]", "_", path.stem).lstrip(".-") or "grader"
        name, n = f"{stem}.py", 1
        while f"{run_prefix(run_id)}/graders/{name}" in store_paths.values():
            n += 1
            name = f"{stem}-{n}.py"
        store_paths[path] = f"{run_prefix(run_id)}/graders/{name}"
    return store_paths


def task_dir_store_path(run_id: str) -> str:
    """The folder the benchmarks' task folder (`evaluation.benchmarks.task_dir`) is stored as, its files inside."""
    return f"{run_prefix(run_id)}/benchmarks"
