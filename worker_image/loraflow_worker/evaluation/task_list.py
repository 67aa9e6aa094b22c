"""Write the harness's task names for the control plane (`contract/benchmark_tasks.txt`).

    python -m loraflow_worker.evaluation.task_list           # rewrite the file from the installed lm-eval
    python -m loraflow_worker.evaluation.task_list --check   # exit 1 when the file and the harness disagree

Run after changing lm-eval's version in the lock.
"""

from __future__ import annotations

import sys

from loraflow_worker.contract.benchmark_tasks import HARNESS_TASKS_FILE


def installed_harness_tasks() -> list[str]:
    """Every task, group and tag name of the installed harness's own task folder, sorted."""
    from lm_eval.tasks import TaskManager

    return sorted(TaskManager().all_tasks)


def render(names: list[str]) -> str:
    return "".join(f"{name}\n" for name in names)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    text = render(installed_harness_tasks())
    if args == ["--check"]:
        if HARNESS_TASKS_FILE.read_text() != text:
            print(f"{HARNESS_TASKS_FILE.name} is out of date with the installed lm-eval: run "
                  "python -m loraflow_worker.evaluation.task_list", file=sys.stderr)
            return 1
        return 0
    HARNESS_TASKS_FILE.write_text(text)
    print(f"wrote {HARNESS_TASKS_FILE} ({text.count(chr(10))} names)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
