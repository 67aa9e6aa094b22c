"""An evaluate run's leaderboard: the base and each adapter, best first, by one score: the first task's first grader
(`task:<name>/<grader>`), or, with no task, the first benchmark's first metric (`benchmark:<task>/<metric>`, in the
harness's direction). The other scores are columns beside it. The base is a row too, so that an adapter below it is
seen to have lost what the base knew. A row with no ranking score (the deadline came first) is last."""

from __future__ import annotations

from loraflow_worker.contract.evaluate import EvaluateResult
from pydantic import BaseModel, Field

BASE_ROW = "base"


class Score(BaseModel):
    """One row's value of one metric."""

    value: float
    stderr: float | None = None

    def shown(self) -> str:
        return f"{self.value:.3f}" + (f" ± {self.stderr:.3f}" if self.stderr is not None else "")


class LeaderboardRow(BaseModel):
    label: str = Field(description="`base`, or the adapter's label.")
    scores: dict[str, Score] = Field(default_factory=dict, description="By metric name.")


class Leaderboard(BaseModel):
    """The rows, best first by `metric`."""

    name: str
    metric: str | None = Field(description="The ranking metric; None when nothing was scored.")
    higher_is_better: bool = True
    metrics: list[str] = Field(description="Every metric, the ranking one first.")
    rows: list[LeaderboardRow]
    stopped: str | None = None

    def lines(self) -> list[str]:
        """The leaderboard as printed lines: rank, row, the ranking score, then the others."""
        head = (f"Leaderboard {self.name}, by {self.metric} ({'higher' if self.higher_is_better else 'lower'} is "
                "better):") if self.metric else f"Leaderboard {self.name}: nothing was scored"
        lines = [head]
        for rank, row in enumerate(self.rows, start=1):
            cells = [f"{metric} {row.scores[metric].shown()}" for metric in self.metrics if metric in row.scores]
            lines.append(f"  {rank}. {row.label}: " + ("; ".join(cells) or "not scored"))
        if self.stopped:
            lines.append(f"  (incomplete: {self.stopped})")
        return lines

    def markdown(self) -> str:
        """The leaderboard as a Markdown table, for the flow run's artifact."""
        out = [f"# Leaderboard: {self.name}", ""]
        if self.metric:
            out += [f"Ranked by `{self.metric}` ({'higher' if self.higher_is_better else 'lower'} is better); "
                    "± is the standard error.", ""]
        out += ["| # | model | " + " | ".join(f"`{m}`" for m in self.metrics) + " |",
                "|---|---|" + "---|" * len(self.metrics)]
        for rank, row in enumerate(self.rows, start=1):
            cells = [row.scores[m].shown() if m in row.scores else "–" for m in self.metrics]
            out.append(f"| {rank} | {'**' + row.label + '**' if row.label == BASE_ROW else row.label} | "
                       + " | ".join(cells) + " |")
        if self.stopped:
            out += ["", f"Incomplete: {self.stopped}"]
        return "\n".join(out) + "\n"


def leaderboard(name: str, result: EvaluateResult, task_order: list[tuple[str, str]] | None = None) -> Leaderboard:
    """Rank `result`'s base and adapters (see the module docstring). `task_order`: (task, grader) as the evaluate file
    lists them, whose first ranks; None: the result's own order."""
    rows = {BASE_ROW: LeaderboardRow(label=BASE_ROW)}
    metrics: list[str] = []
    direction: dict[str, bool] = {}
    for adapter in result.adapters:
        row = rows.setdefault(adapter.label, LeaderboardRow(label=adapter.label))
        for score in adapter.task_scores:
            metrics.append(score.metric)
            direction[score.metric] = True
            row.scores[score.metric] = Score(value=score.adapter, stderr=score.adapter_stderr)
            rows[BASE_ROW].scores.setdefault(score.metric, Score(value=score.base, stderr=score.base_stderr))
        for bench in adapter.benchmark_scores:
            metrics.append(bench.name)
            direction[bench.name] = bench.higher_is_better
            row.scores[bench.name] = Score(value=bench.adapter, stderr=bench.adapter_stderr)
            rows[BASE_ROW].scores.setdefault(bench.name, Score(value=bench.base, stderr=bench.base_stderr))
    metrics = list(dict.fromkeys(metrics))
    wanted = [f"task:{task}/{grader}" for task, grader in task_order or []]
    tasks = [m for m in wanted if m in metrics] + [m for m in metrics if m.startswith("task:") and m not in wanted]
    ordered = tasks + [m for m in metrics if not m.startswith("task:")]
    metric = ordered[0] if ordered else None
    higher = direction.get(metric, True) if metric else True

    def key(row: LeaderboardRow) -> tuple[bool, float]:
        score = row.scores.get(metric) if metric else None
        if score is None:
            return True, 0.0
        return False, -score.value if higher else score.value

    # Python's sort is stable: equal scores keep the base first, then the adapters in the file's order.
    return Leaderboard(name=name, metric=metric, higher_is_better=higher, metrics=ordered,
                       rows=sorted(rows.values(), key=key), stopped=result.stopped)
