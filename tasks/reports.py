"""What a run shows in the Prefect UI: a markdown summary and a metrics table.

The builders are pure functions (tested without Prefect); `publish_report` only hands their output to
Prefect under stable keys, so the UI shows each run's history side by side.
"""

from __future__ import annotations

from typing import Any

from loraflow_worker.contract import TrainMetrics
from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel, Field

from tasks.runpod.live_catalog import PriceSource


class RunReport(BaseModel):
    """The facts of a finished run that the summary shows."""

    run_name: str
    run_id: str
    model: str
    model_revision: str | None
    gpu: str
    gpu_count: int
    endpoint_name: str
    metrics: TrainMetrics
    cost_ceiling_usd: float
    estimated_cost_usd: float
    adapter_url: str
    store_url: str
    attempts: int = 1
    fast_paths: dict[str, Any] | None = None
    usd_per_hour: float | None = Field(default=None, description="The GPU-hour price the estimate used.")
    price_source: PriceSource | None = Field(default=None, description="Where that price came from.")
    billed_usd: float | None = Field(
        default=None, description="What RunPod billed the run's endpoints (/v2/billing/serverless); None: not read."
    )


def summary_markdown(report: RunReport) -> str:
    m = report.metrics
    loss = (f"{m.first_loss:.4f} → {m.final_loss:.4f}" if m.first_loss is not None and m.final_loss is not None else "n/a")
    rows = [
        ("Model", f"`{report.model}`" + (f" @ `{report.model_revision}`" if report.model_revision else "")),
        ("GPU", f"{report.gpu_count} × {report.gpu}"),
        ("Device (worker)", m.device),
        ("Steps", str(m.steps)),
        ("Loss (first → final)", loss),
        ("Tokens", f"{m.tokens:,}"),
        ("Training wall time", f"{m.wall_seconds:.1f} s"),
        ("Estimated cost", _estimate(report)),
        *([("Billed by RunPod", f"${report.billed_usd:.4f}")] if report.billed_usd is not None else []),
        ("Adapter", report.adapter_url),
        ("Artifact store", report.store_url),
        ("Endpoint", f"`{report.endpoint_name}` (deleted)"),
        ("Attempts", str(report.attempts)),
    ]
    lines = [f"# Run `{report.run_name}` completed", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    if report.fast_paths:
        lines += ["", "## Fast paths", "", "| path | engaged | why |", "|---|---|---|"]
        for name, info in report.fast_paths.items():
            info = info if isinstance(info, dict) else {"engaged": info}
            lines.append(f"| {name} | {'yes' if info.get('engaged') else 'no'} | {info.get('reason', '')} |")
    return "\n".join(lines)


def _estimate(report: RunReport) -> str:
    text = f"${report.estimated_cost_usd:.4f} (ceiling ${report.cost_ceiling_usd:.2f})"
    if report.usd_per_hour is not None and report.price_source is not None:
        text += f" at ${report.usd_per_hour:.2f}/GPU-hour, price source: {report.price_source}"
    return text


def metrics_rows(metrics: TrainMetrics) -> list[dict[str, Any]]:
    return [{"step": step, "loss": round(loss, 6)} for step, loss in metrics.losses]


@task(name="publish-report", cache_policy=NO_CACHE)
def publish_report(report: RunReport, key_prefix: str) -> None:
    create_markdown_artifact(markdown=summary_markdown(report), key=f"{key_prefix}-summary",
                             description=f"Run {report.run_name} summary")
    create_table_artifact(table=metrics_rows(report.metrics), key=f"{key_prefix}-metrics",
                          description=f"Run {report.run_name} training loss by step")
