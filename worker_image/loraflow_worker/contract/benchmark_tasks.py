"""Which lm-evaluation-harness task names a run may ask for (`evaluation.benchmarks.tasks`), known without the harness.

The control plane has no lm-eval; it refuses an unknown benchmark task before renting with the names the image's
harness knows, shipped beside this module (`benchmark_tasks.txt`, written from the harness's TaskManager by
`python -m loraflow_worker.evaluation.task_list`; a worker test holds it equal to the installed harness's list), and
the names the run's own `task_dir` defines (`task_dir_names`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from functools import cache
from pathlib import Path

HARNESS_TASKS_FILE = Path(__file__).with_name("benchmark_tasks.txt")
"""One name a line: every task, group and tag of the harness's own task folder (TaskManager.all_tasks)."""

# The harness indexes a YAML by its top-level `task:` (a task), `group:` (a group) and `tag:` (a name or a list of
# names shared by several tasks). Read as lines: the harness's YAMLs carry `!function` tags a plain YAML loader
# refuses.
_NAME_LINE = re.compile(r"^(?:task|group|tag):[ \t]*([^\s#\[\]{}]+)[ \t]*(?:#.*)?$")
_TAG_LIST = re.compile(r"^tag:[ \t]*\[(?P<names>[^\]]*)\]")
_TAG_BLOCK = re.compile(r"^tag:[ \t]*(?:#.*)?$")
_LIST_ITEM = re.compile(r"^[ \t]*-[ \t]*([^\s#]+)")


@cache
def harness_task_names() -> frozenset[str]:
    """The task, group and tag names of the image's lm-evaluation-harness."""
    return frozenset(line.strip() for line in HARNESS_TASKS_FILE.read_text().splitlines() if line.strip())


def task_dir_names(folder: Path) -> set[str]:
    """The task, group and tag names the harness's YAML files in `folder` (and below) define."""
    names: set[str] = set()
    for path in sorted([*folder.rglob("*.yaml"), *folder.rglob("*.yml")]):
        lines = path.read_text(errors="replace").splitlines()
        for i, line in enumerate(lines):
            if (matched := _NAME_LINE.match(line)) is not None:
                names.add(matched[1].strip("'\""))
            elif (listed := _TAG_LIST.match(line)) is not None:
                names.update(n.strip().strip("'\"") for n in listed["names"].split(",") if n.strip())
            elif _TAG_BLOCK.match(line):
                for item in lines[i + 1:]:
                    if (entry := _LIST_ITEM.match(item)) is None:
                        break
                    names.add(entry[1].strip("'\""))
    return names


def unknown_benchmark_tasks(names: Iterable[str], private_names: Iterable[str] = ()) -> list[str]:
    """The names among `names` that neither the image's harness nor the run's `task_dir` (`private_names`) defines,
    in the order given."""
    known = harness_task_names() | set(private_names)
    return [name for name in names if name not in known]
