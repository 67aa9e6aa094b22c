"""A study's comparison: one row per child run, the best child by the study's metric, the children's curves on one
plot, and the study's summary and table artifacts.

Pure functions over plain data (the rows, each child's `TrainMetrics`), so that the comparison is tested without a
flow; `publish_study_report` writes the artifacts from inside the study flow. A study may have up to 1,000 children:
the table is paged (the best children first, `PAGE_ROWS` a page, each page an artifact of its own) and the plot
draws the best `PLOTTED_BEST` and the median child, as a table or a plot of every child is unreadable long before
that (and a Prefect table artifact past a few hundred rows is slow to open).
"""

from __future__ import annotations

import base64
import io
import re
from typing import TYPE_CHECKING, Literal

from loraflow_worker.contract import TrainMetrics
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from pydantic import BaseModel, Field

if TYPE_CHECKING:
    from matplotlib.figure import Figure

ChildState = Literal["completed", "pruned", "failed", "cancelled", "skipped", "not started"]
"""How a child ended: `pruned` when the study cancelled it for losing (`[study] prune`), `skipped` when the study's
budget had no room left for it, `not started` when the study was cancelled before its turn."""
PAGE_ROWS = 50
"""Rows per page of the study's table (each page one table artifact; the summary shows the first)."""
PLOTTED_BEST = 10
"""The children whose curves the summary's plot overlays, best first; the median child is drawn beside them."""
SERIES_OF_METRIC = {
    "eval_loss": ("eval_loss", "eval loss (held-out)"),
    "eval_reward": ("eval_reward", "eval mean reward (held-out)"),
    "eval_reward_accuracy": ("eval_reward_accuracies", "eval reward accuracy (held-out)"),
    "train_loss": ("losses", "training loss"),
}
"""The study's metric → the `TrainMetrics` series it is the last value of, and how the plot labels it."""
SCORE_METRIC = re.compile(r"^(?P<kind>task|benchmark):(?P<task>[^/\s]+)/(?P<name>[^\s]+)$")
"""A task's or a benchmark's score as a study metric: `task:<task>/<grader>` or `benchmark:<task>/<metric>`, the
adapter's score after training (higher is better)."""


def score_metric(metric: str) -> tuple[str, str, str] | None:
    """(`task` or `benchmark`, the task, the grader or the harness's metric) of a score metric; None for a series'
    metric (`eval_loss`, ...)."""
    matched = SCORE_METRIC.match(metric)
    return (matched["kind"], matched["task"], matched["name"]) if matched else None


def scores(metrics: TrainMetrics) -> dict[str, float]:
    """The adapter's score of each task and grader and each benchmark task and metric, by its metric's name."""
    return {s.metric: s.adapter for s in metrics.task_scores} | {b.name: b.adapter for b in metrics.benchmark_scores}


class ChildRow(BaseModel):
    """One child run as the study's table shows it."""

    index: int = Field(description="Its place in the study, from 1.")
    name: str = Field(description="The child run's name.")
    values: str = Field(description="The values it tried, `field=value, ...`.")
    state: ChildState = Field(description="How it ended.")
    reason: str = Field(default="", description="Why it did not complete; empty when it did.")
    metric: float | None = Field(default=None, description="The study's metric of the adapter the child kept: at its "
                                 "last step, or at `kept_step`.")
    kept_step: int | None = Field(default=None, description="With `training.early_stopping`, the step of the best "
                                  "evaluation, whose adapter the child stored: every figure of the row is at that "
                                  "step. None: the last step's.")
    train_loss: float | None = Field(default=None, description="Training loss at the last logged step.")
    eval_loss: float | None = Field(default=None, description="Held-out loss at the last evaluation (SFT, DPO).")
    train_reward: float | None = Field(default=None, description="GRPO: mean reward at the last logged step.")
    eval_reward: float | None = Field(default=None, description="GRPO: held-out mean reward at the last evaluation.")
    eval_reward_accuracy: float | None = Field(default=None, description="DPO: held-out reward accuracy, last.")
    cost_usd: float | None = Field(default=None, description="What its workers ran, × the GPU's price (its "
                                   "`loraflow.run.finished`); None when unknown.")
    cost_ceiling_usd: float | None = Field(default=None, description="Its cost ceiling, as the study counted it.")
    minutes: float | None = Field(default=None, description="Its flow run's wall time, in minutes.")
    flow_run_id: str | None = Field(default=None, description="The child's flow run; None when it never started.")
    summary_url: str | None = Field(default=None, description="Its flow run's page (the summary is its artifact).")
    adapter_url: str | None = Field(default=None, description="Where its adapter is stored, when it completed.")
    scores: dict[str, float] = Field(
        default_factory=dict, description="The adapter's task and benchmark scores, by metric (`task:<task>/<grader>`, "
        "`benchmark:<task>/<metric>`), after training.")


def last(series: list[tuple[int, float]]) -> float | None:
    return series[-1][1] if series else None


def kept_step(metrics: TrainMetrics) -> int | None:
    """The step whose adapter the child stored: its best evaluation's with `training.early_stopping` (the worker keeps
    that one, as `load_best_model_at_end` does, and records it in `metrics.json`), else None: its last step's."""
    stopping = metrics.early_stopping
    return stopping.best_step if stopping is not None else None


def at_step(series: list[tuple[int, float]], step: int | None) -> float | None:
    """The series' value at `step` (its latest at or before it: a training loss is logged every `logging_steps`),
    its last value when `step` is None."""
    if step is None:
        return last(series)
    return last([(s, v) for s, v in series if s <= step])


def metric_value(metrics: TrainMetrics, metric: str) -> float | None:
    """The study's metric of the adapter the child kept: at its last step, or, when early stopping kept an earlier
    evaluation's adapter, at that step (an evaluation up to `patience` later judged a model that was not stored)."""
    if score_metric(metric) is not None:  # measured once, after training, of the adapter kept
        return scores(metrics).get(metric)
    step = kept_step(metrics)
    if metric == "train_loss":
        return metrics.final_loss if step is None else at_step(metrics.losses, step)
    return at_step(getattr(metrics, SERIES_OF_METRIC[metric][0]), step)


def completed_row(row: ChildRow, metrics: TrainMetrics, metric: str) -> ChildRow:
    """`row` with a completed child's figures filled in from its metrics, each of the adapter it kept."""
    step = kept_step(metrics)
    return row.model_copy(update={
        "metric": metric_value(metrics, metric),
        "train_loss": metrics.final_loss if step is None else at_step(metrics.losses, step),
        "eval_loss": at_step(metrics.eval_loss, step), "train_reward": at_step(metrics.rewards, step),
        "eval_reward": at_step(metrics.eval_reward, step),
        "eval_reward_accuracy": at_step(metrics.eval_reward_accuracies, step), "kept_step": step,
        "scores": scores(metrics)})


def best_child(rows: list[ChildRow], maximize: bool) -> ChildRow | None:
    """The completed child with the lowest metric (the highest when `maximize`); the earlier child on a tie; None
    when no completed child has the metric."""
    scored = [r for r in rows if r.state == "completed" and r.metric is not None]
    if not scored:
        return None
    if maximize:
        return max(scored, key=lambda r: (r.metric, -r.index))
    return min(scored, key=lambda r: (r.metric, r.index))


def ranked(rows: list[ChildRow], maximize: bool) -> list[ChildRow]:
    """The rows in the order the table shows them: the children with the metric, best first (the earlier child on a
    tie), then the others (failed, cancelled, skipped, completed without the metric) in the study's order."""
    scored = [r for r in rows if r.state == "completed" and r.metric is not None]
    scored.sort(key=lambda r: (-r.metric if maximize else r.metric, r.index))
    chosen = {r.index for r in scored}
    return scored + [r for r in rows if r.index not in chosen]


def median_child(rows: list[ChildRow], maximize: bool) -> ChildRow | None:
    """The child in the middle of those with the metric (the better of the two middle ones for an even count);
    None when none has it."""
    scored = [r for r in ranked(rows, maximize) if r.state == "completed" and r.metric is not None]
    return scored[(len(scored) - 1) // 2] if scored else None


def plotted_children(rows: list[ChildRow], maximize: bool, best: int = PLOTTED_BEST) -> dict[int, str]:
    """The children whose curves the plot overlays, child index → its label: the `best` best by the metric, and the
    median child (labelled so) when it is not one of them."""
    scored = [r for r in ranked(rows, maximize) if r.state == "completed" and r.metric is not None]
    chosen = {r.index: r.name for r in scored[:best]}
    median = median_child(rows, maximize)
    if median is not None and median.index not in chosen:
        chosen[median.index] = f"{median.name} (median)"
    return chosen


def page_key(study: str, page: int) -> str:
    """The artifact key of the table's `page` (from 1): `study-<name>-table`, then `study-<name>-table-2`, ..."""
    return f"{study_key(study)}-table" if page == 1 else f"{study_key(study)}-table-{page}"


def table_pages(rows: list[ChildRow], metric: str, best: ChildRow | None, maximize: bool,
                page_rows: int = PAGE_ROWS) -> list[list[dict[str, object]]]:
    """The study's table, ranked (`ranked`), in pages of `page_rows`: one table artifact each."""
    table = table_rows(ranked(rows, maximize), metric, best)
    return [table[start:start + page_rows] for start in range(0, len(table), page_rows)] or [[]]


def table_rows(rows: list[ChildRow], metric: str, best: ChildRow | None) -> list[dict[str, object]]:
    """The rows of the study's table, in the order given: one dict per child, the columns people compare first."""
    def figure(value: float | None, digits: int = 4) -> object:
        return round(value, digits) if value is not None else ""

    def columns(row: ChildRow) -> dict[str, object]:
        figures = {"train loss": row.train_loss, "eval loss": row.eval_loss, "train reward": row.train_reward,
                   "eval reward": row.eval_reward}
        return {
            "child": f"{row.name}{' (best)' if best is not None and row.index == best.index else ''}",
            "values": row.values, "state": row.state, metric: figure(row.metric),
            # The metric's own column is not repeated under its plain name.
            **{name: figure(value) for name, value in figures.items() if name != metric.replace("_", " ")},
            # Every child's task and benchmark scores, each a column, the same columns in every row.
            **{name: figure(row.scores.get(name)) for name in score_names if name != metric},
            "cost (USD)": figure(row.cost_usd), "minutes": figure(row.minutes, 1),
            "reason": row.reason, "summary": row.summary_url or "",
        }

    score_names = list(dict.fromkeys(name for row in rows for name in row.scores))
    return [columns(row) for row in rows]


def overlay_figure(curves: dict[str, list[tuple[int, float]]], label: str) -> Figure | None:
    """Each child's series (child name → (step, value) pairs) on one set of axes; None when no child has two
    points."""
    drawn = {name: points for name, points in curves.items() if len(points) >= 2}
    if not drawn:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    figure = Figure(figsize=(6.4, 3.6), dpi=100, layout="constrained", facecolor="white")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for name, points in drawn.items():
        axes.plot(*zip(*points), linewidth=2, marker="o", markersize=3, label=name)
    axes.set_xlabel("step")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_ylabel(label)
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small")
    return figure


def overlay_png(metrics: dict[str, TrainMetrics], metric: str) -> bytes | None:
    """The children's curves of the study's metric (its series: eval for an eval metric, training for
    `train_loss`) as PNG bytes; None when there is nothing to draw (a task's or benchmark's score has no curve)."""
    if metric not in SERIES_OF_METRIC:
        return None
    series, label = SERIES_OF_METRIC[metric]
    figure = overlay_figure({name: getattr(m, series) for name, m in metrics.items()}, label)
    if figure is None:
        return None
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


class StudyReport(BaseModel):
    """What the study's summary says."""

    study: str = Field(description="The study's name.")
    metric: str = Field(description="What picked the best child.")
    maximize: bool = Field(description="Whether the highest metric is the best.")
    rows: list[ChildRow] = Field(description="One per child, in the study's order.")
    best: ChildRow | None = Field(default=None, description="The best child; None when none completed with the "
                                  "metric.")
    cost_usd: float = Field(description="The children's costs summed (those known).")
    cost_ceiling_usd: float = Field(description="The cost ceilings of the children that started, summed.")
    budget_usd: float | None = Field(default=None, description="The study's budget; None: none.")
    published: str | None = Field(default=None, description="Where the best adapter was published (publish_best).")
    publish_error: str | None = Field(default=None, description="Why publishing the best adapter failed.")
    merged: str | None = Field(default=None, description="Where the best child's merged model was published.")
    merge_error: str | None = Field(default=None, description="Why merging the best adapter failed.")


def study_markdown(report: StudyReport, plot: bytes | None) -> str:
    """The study's summary: the best child, the totals, the table, the overlaid curves."""
    counts: dict[str, int] = {}
    for row in report.rows:
        counts[row.state] = counts.get(row.state, 0) + 1
    direction = "highest" if report.maximize else "lowest"
    best = report.best
    lines = [f"# Study {report.study}", ""]
    if best is not None:
        lines.append(f"**Best child: {best.name}** ({best.values}): {report.metric} {best.metric:.4g}, the "
                     f"{direction} of {sum(1 for r in report.rows if r.metric is not None)}.")
    else:
        lines.append(f"**No best child**: no child completed with a {report.metric}.")
    budget = f" of a ${report.budget_usd:.2f} budget" if report.budget_usd is not None else ""
    cost = f"${report.cost_usd:.4f} (workers' run time × price); ceilings ${report.cost_ceiling_usd:.2f}{budget}"
    lines += ["", f"- Children: {', '.join(f'{n} {state}' for state, n in counts.items())}", f"- Cost: {cost}"]
    if report.published:
        lines.append(f"- Best adapter published to `{report.published}`")
    if report.publish_error:
        lines.append(f"- Best adapter not published: {report.publish_error}")
    if report.merged:
        lines.append(f"- Best adapter merged into its base, published to `{report.merged}`")
    if report.merge_error:
        lines.append(f"- Best adapter not merged: {report.merge_error}")
    shown = ranked(report.rows, report.maximize)[:PAGE_ROWS]
    # Every child's task and benchmark scores beside the study's metric, so what a child gained elsewhere shows.
    others = [name for name in dict.fromkeys(n for row in report.rows for n in row.scores) if name != report.metric]
    lines += ["", f"| child | values | state | {report.metric} | {''.join(f'{n} | ' for n in others)}cost (USD) | "
              "minutes | reason |", "|---|---|---|---|" + "---|" * len(others) + "---|---|---|"]
    for row in shown:
        name = f"[{row.name}]({row.summary_url})" if row.summary_url else row.name
        mark = " **(best)**" if best is not None and row.index == best.index else ""
        metric = f"{row.metric:.4g}" if row.metric is not None else ""
        if row.kept_step is not None and metric:  # early stopping kept an earlier evaluation's adapter
            metric += f" (step {row.kept_step})"
        # A child that never started cost nothing; one that ran without a readable cost is "unknown".
        cost = (f"{row.cost_usd:.4f}" if row.cost_usd is not None
                else "" if row.state in ("skipped", "not started") else "unknown")
        minutes = f"{row.minutes:.1f}" if row.minutes is not None else ""
        shown_scores = "".join(f"{row.scores[n]:.4g} | " if n in row.scores else " | " for n in others)
        lines.append(f"| {name}{mark} | {row.values} | {row.state} | {metric} | {shown_scores}{cost} | {minutes} | "
                     f"{row.reason.replace('|', '/')[:200]} |")
    pages = -(-len(report.rows) // PAGE_ROWS)
    if pages > 1:
        lines += ["", f"The best {PAGE_ROWS} of {len(report.rows)} children; every child, ranked, is in the table "
                  f"artifacts `{page_key(report.study, 1)}` to `{page_key(report.study, pages)}` ({PAGE_ROWS} a page)."]
    if plot is not None:
        image = base64.b64encode(plot).decode()
        lines += ["", f"![{report.metric} of the best children and the median child](data:image/png;base64,{image})"]
    return "\n".join(lines)


def study_key(study: str) -> str:
    """The artifact key of a study's summary (its table's is this plus `-table`)."""
    return f"study-{study}"


def publish_study_report(report: StudyReport, plot: bytes | None) -> None:
    create_markdown_artifact(markdown=study_markdown(report, plot), key=study_key(report.study),
                             description=f"Study {report.study}: its children compared")
    pages = table_pages(report.rows, report.metric, report.best, report.maximize)
    for page, table in enumerate(pages, start=1):
        first = (page - 1) * PAGE_ROWS + 1
        create_table_artifact(table=table, key=page_key(report.study, page),
                              description=f"Study {report.study}: children {first}-{first + len(table) - 1} of "
                              f"{len(report.rows)}, best {report.metric} first (page {page} of {len(pages)})")
