"""What the evaluation after training found (light: the training process imports it before the training stack)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from loraflow_worker.contract.task_evaluation import BenchmarkScore, TaskScore


@dataclass
class Evaluated:
    """What the evaluation after training found, for the run's metrics, folder and trackers."""

    task_scores: list[TaskScore] = field(default_factory=list)
    benchmark_scores: list[BenchmarkScore] = field(default_factory=list)
    files: dict[str, bytes] = field(default_factory=dict)
    """Store path → contents (the answers samples), stored in the run's commit."""
    stopped: str | None = None
    """Why some evaluations are missing (the job's deadline), None when all ran."""


def tracker_metrics(evaluated: Evaluated) -> dict[str, float]:
    """The scores as the run's trackers record them: `task/<task>/<grader>/<base|adapter|delta|delta_stderr>` and
    `benchmark/<task>/<metric>/<base|adapter|delta|base_stderr|adapter_stderr>` (a standard error the harness did not
    compute left out), in names MLflow accepts."""
    tasks = {f"task/{s.task}/{s.grader}/{part}": getattr(s, part) for s in evaluated.task_scores
             for part in ("base", "adapter", "delta", "delta_stderr")}
    benchmarks = {f"benchmark/{s.task}/{s.metric}/{part}": getattr(s, part) for s in evaluated.benchmark_scores
                  for part in ("base", "adapter", "delta", "base_stderr", "adapter_stderr")
                  if getattr(s, part) is not None}
    return {_tracker_name(name): value for name, value in (tasks | benchmarks).items()}


def _tracker_name(name: str) -> str:
    # MLflow refuses a metric name with a character outside letters, digits, `_ - . / ` and space (a harness metric
    # under a filter is `exact_match,strict-match`; a few harness task names hold parentheses): each becomes `_`.
    return re.sub(r"[^\w\-./ ]", "_", name)
