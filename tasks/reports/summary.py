"""What a run shows in the Prefect UI: its name and tags, a progress line while it trains, a markdown
summary with its training curve, and a metrics table.

The builders are pure functions (tested without Prefect); the tasks only hand their output to Prefect
(under stable keys, so the UI shows each run's history side by side) or to the run's artifact store.
"""

from __future__ import annotations

import base64
import contextvars
import functools
import json
import re
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import PurePosixPath
from typing import Any, Literal

from loraflow_worker.artifacts import open_store
from loraflow_worker.contract import JobResult, TrackerRun, TrainMetrics, run_prefix
from prefect import get_client, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel, Field, ValidationError

from tasks.reports.curve import curve_measure
from tasks.runpod.live_catalog import PRICE_SOURCE_WORDS, CardsSource, PriceSource
from tasks.settings import Settings

CURVE_FILE = "curve.png"


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
    price_fallback_reason: str | None = Field(
        default=None, description="Why loraflow's fallback list price stood in for RunPod's catalog; None: the "
        "catalog's.")
    ceiling_price_source: PriceSource | None = Field(
        default=None, description="Where the price of the cost ceiling (the one the budget was checked against) came "
        "from; None: not known.")
    cards_from: CardsSource | None = Field(
        default=None, description="Where the GPU class's pool and excluded cards came from: RunPod's catalog, or "
        "loraflow's static table when the catalog could not be read; None: not known.")
    refused: dict[str, str] = Field(
        default_factory=dict, description="GPU class → RunPod's detail, for each class whose endpoint request RunPod "
        "refused (400) before the run moved to the next class.")
    billed_usd: float | None = Field(
        default=None, description="What RunPod billed the run's endpoints (/v2/billing/serverless); None: not read."
    )
    billing_pending: bool = Field(
        default=False, description="RunPod had billed nothing yet, or its billing could not be read, when the "
        "endpoints were deleted: the summary says so, and the reconciler fills the figure in later.")
    algorithm: Literal["sft", "grpo", "dpo"] = Field(
        default="sft", description="`sft` (the curve is the loss), `grpo` (the mean reward) or `dpo` (the reward "
        "accuracy)."
    )
    run_url: str | None = Field(default=None, description="Link to the run's folder in the artifact store.")
    curve_url: str | None = Field(default=None, description="Link to the stored curve PNG; None: not stored.")
    quantization: Literal["none", "4bit"] = Field(default="none", description="`4bit`: QLoRA (the base in 4 bits).")
    trackers: list[TrackerRun] = Field(default_factory=list, description="Where `training.report_to`'s trackers "
                                       "recorded the run's last attempt.")
    tracker_files_urls: dict[str, str] = Field(
        default_factory=dict, description="Tracker → link to its files stored with the run.")
    forced_memory: list[str] = Field(
        default_factory=list, description="Memory settings the last attempt forced after running out of memory.")
    warm_volume: str | None = Field(default=None, description="The network volume the last attempt read the "
                                    "weights from (`<id> in <datacenter>`); None: a cold start.")
    storage_usd_per_month: float | None = Field(
        default=None, description="What that volume costs by the month, whether used or not; None: not known.")
    storage_cost_source: str | None = Field(default=None, description="`billed` or `documented price`.")
    published_model: str | None = Field(
        default=None, description="The Hub model repo the run's `[publish]` names; None: not published by name.")
    published_model_url: str | None = Field(default=None, description="Its page; None when publishing failed.")
    publish_error: str | None = Field(default=None, description="Why publishing failed; None when it did not fail.")
    merged_model: str | None = Field(
        default=None, description="The Hub model repo of the base with the adapter merged (`publish.merged_model_id`); "
        "None: no merge asked for.")
    merged_model_url: str | None = Field(default=None, description="Its page; None when the merge failed.")
    merge_check: str | None = Field(default=None, description="The merged logits against base + adapter's, in words.")
    merge_ran_on: str | None = Field(default=None, description="The CPU worker the merge ran on; None: none rented.")
    merge_error: str | None = Field(default=None, description="Why the merge failed; None when it did not fail.")
    trajectories: list[dict[str, Any]] = Field(
        default_factory=list, description="GRPO: trajectories of the last logging step (prompt, tool calls with their "
        "answers, final answer, reward), secrets redacted on the worker.")
    trajectories_url: str | None = Field(default=None, description="Link to every trajectory kept; None: none.")
    task_answers: dict[str, list[dict[str, Any]]] = Field(
        default_factory=dict, description="Each evaluation task's stored answers (`evaluation/<task>.jsonl`: prompt, "
        "expected answer, the base's and the adapter's answers, each grader's scores), the adapter's best first and "
        "worst last; empty where none were read.")
    task_answers_urls: dict[str, str] = Field(default_factory=dict, description="Task → link to its stored answers.")
    loss: dict[str, Any] | None = Field(
        default=None, description="SFT: which tokens carried the loss (the manifest's `loss`: `loss_on`, `masked_by`, "
        "`chat_template`, `token_share`); None for GRPO or a worker that did not record it.")


def run_title(name: str, model_id: str, algorithm: str, gpu: str) -> str:
    """The flow run's name: `<name>-<model>-<algorithm>-<gpu>`, e.g. `capybara-qwen3-0.6b-sft-rtx-4090`.
    The model is its last path part (a Hub id's name, a local folder's name)."""
    return "-".join(_slug(part) for part in (name, PurePosixPath(model_id.rstrip("/")).name, algorithm, gpu))


def run_tags(model_id: str, algorithm: str, gpus: list[str]) -> list[str]:
    """The flow run's tags, `key:value` so that the UI's tag filter and automations can pick runs by them."""
    return [f"algorithm:{algorithm}", f"model:{PurePosixPath(model_id.rstrip('/')).name}",
            *(f"gpu:{gpu}" for gpu in gpus)]


def progress_description(progress: dict[str, Any]) -> str:
    """One line from a worker progress update (`loraflow_worker.contract.Progress`): stage, step, loss,
    reward (GRPO), the latest eval loss or reward, tokens/s, ETA, message; what is not known yet is left out."""
    step, total = progress.get("step", 0), progress.get("total_steps")
    parts = [f"{progress.get('stage', '?')}: step {step}/{total or '?'}"]
    if isinstance(progress.get("loss"), (int, float)):
        parts.append(f"loss {progress['loss']:.4f}")
    if isinstance(progress.get("reward"), (int, float)):
        parts.append(f"reward {progress['reward']:.3f}")
    if isinstance(progress.get("eval_loss"), (int, float)):
        parts.append(f"eval loss {progress['eval_loss']:.4f}")
    if isinstance(progress.get("eval_reward"), (int, float)):
        parts.append(f"eval reward {progress['eval_reward']:.3f}")
    if isinstance(progress.get("reward_accuracy"), (int, float)):
        parts.append(f"reward accuracy {progress['reward_accuracy']:.0%}")
    if isinstance(progress.get("tokens_per_second"), (int, float)):
        parts.append(f"{progress['tokens_per_second']:,.0f} tokens/s")
    if isinstance(progress.get("eta_seconds"), (int, float)):
        parts.append(f"ETA {_duration(progress['eta_seconds'])}")
    if progress.get("message"):
        parts.append(str(progress["message"]))
    return " · ".join(parts)


def finished_description(job_output: Any) -> str:
    """The progress line of a completed job, from its result (`JobResult`): steps (of those planned, and where it
    stopped, when early stopping ended it), final loss, tokens/s."""
    try:
        metrics = JobResult.model_validate(job_output).metrics
    except ValidationError:
        return "completed"  # the run is judged by what its store holds (`collect`), not by this line
    stopping = metrics.early_stopping
    return progress_description({
        "stage": "completed", "step": metrics.steps, "total_steps": stopping.total_steps if stopping else metrics.steps,
        "loss": metrics.final_loss,
        "reward": metrics.rewards[-1][1] if metrics.rewards else None,
        "eval_loss": metrics.eval_loss[-1][1] if metrics.eval_loss else None,
        "eval_reward": metrics.eval_reward[-1][1] if metrics.eval_reward else None,
        "reward_accuracy": (metrics.eval_reward_accuracies or metrics.reward_accuracies or [(0, None)])[-1][1],
        "tokens_per_second": metrics.tokens / metrics.wall_seconds if metrics.wall_seconds > 0 else None,
        "eta_seconds": 0, "message": stopping.summary() if stopping and stopping.stopped else ""})


def summary_markdown(report: RunReport, curve: bytes | None = None) -> str:
    """The run's summary. `curve` (PNG bytes) is embedded as a data URI: the UI renders it whatever the
    store (a private Hub repo's files need a token the browser does not send)."""
    m = report.metrics
    loss = (f"{m.first_loss:.4f} → {m.final_loss:.4f}" if m.first_loss is not None and m.final_loss is not None else "n/a")
    rewards = f"{m.rewards[0][1]:.4f} → {m.rewards[-1][1]:.4f}" if m.rewards else None
    evaluated = [(label, _start_to_final(series)) for label, series in
                 (("Eval loss, held-out (start → final)", m.eval_loss),
                  ("Eval mean reward, held-out (start → final)", m.eval_reward),
                  ("Eval reward accuracy, held-out pairs (start → final)", m.eval_reward_accuracies),
                  ("Eval reward margin, held-out pairs (start → final)", m.eval_reward_margins)) if series]
    rows = [
        ("Model", f"`{report.model}`" + (f" @ `{report.model_revision}`" if report.model_revision else "")),
        ("GPU", f"{report.gpu_count} × {report.gpu}"),
        *([("Base weights", "4-bit (QLoRA: nf4, double quantization, bf16 compute)")]
          if report.quantization == "4bit" else []),
        *([("Memory settings forced", ", ".join(report.forced_memory) + " (after running out of memory)")]
          if report.forced_memory else []),
        ("Device (worker)", m.device),
        ("Steps", str(m.steps)),
        *([("Early stopping", m.early_stopping.summary())] if m.early_stopping else []),
        ("Loss (first → final)", loss),
        *([("Loss on", _loss_on(report.loss))] if report.loss else []),
        *([("Mean reward (first → final)", rewards)] if rewards else []),
        *evaluated,
        ("Tokens", f"{m.tokens:,}"),
        ("Training wall time", f"{m.wall_seconds:.1f} s"),
        ("Cost before (worst case)", _ceiling(report)),
        ("Estimated cost", _estimate(report)),
        *([("Prices", _prices(report))] if report.price_source is not None else []),
        *([("GPU classes", _cards(report))] if report.cards_from is not None else []),
        *([("Refused by RunPod", _refused(report.refused))] if report.refused else []),
        *([(BILLED_ROW, _billed(report))] if report.billed_usd is not None or report.billing_pending else []),
        ("Adapter", _link(report.adapter_url)),
        *([("Published model", _published(report))] if report.published_model else []),
        *([("Merged model", _merged(report))] if report.merged_model else []),
        *[(TRACKER_LABELS[t.tracker], _tracker(t, report.tracker_files_urls.get(t.tracker))) for t in report.trackers],
        ("Artifact store", _link(report.store_url)),
        *([("This run's files", _link(report.run_url))] if report.run_url else []),
        ("Endpoint", f"`{report.endpoint_name}` (deleted)"),
        ("Attempts", str(report.attempts)),
        ("Weights", _weights(report)),
    ]
    lines = [f"# Run `{report.run_name}` completed", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    if curve is not None:
        measure = curve_measure(report.algorithm)
        what = f"Training and eval {measure}" if evaluated else \
            "Mean reward" if measure == "mean reward" else f"Training {measure}"
        lines += ["", f"## {what} by step", "", f"![{what.lower()} by step](data:image/png;base64,"
                  f"{base64.b64encode(curve).decode()})"]
        if report.curve_url:
            lines += ["", f"Stored as {_link(report.curve_url, CURVE_FILE)}."]
    if m.task_scores or m.benchmark_scores or m.evaluation_stopped:
        lines += ["", *score_lines(m, report.task_answers, report.task_answers_urls)]
    if report.trajectories:
        lines += ["", *trajectory_lines(report.trajectories, report.trajectories_url)]
    if report.fast_paths:
        lines += ["", "## Fast paths", "", "| path | engaged | why |", "|---|---|---|"]
        for name, info in report.fast_paths.items():
            info = info if isinstance(info, dict) else {"engaged": info}
            lines.append(f"| {name} | {'yes' if info.get('engaged') else 'no'} | {info.get('reason', '')} |")
    return "\n".join(lines)


def score_rows(metrics: TrainMetrics) -> list[dict[str, Any]]:
    """One row per task and grader, and per benchmark task and metric: the base's score, the adapter's, their
    difference and its standard error (a benchmark's: the two scores' standard errors combined, as the harness
    reports no paired one), as the summary's table and the run's scores table show them."""
    rows = [{"task": s.task, "scored by": s.grader, "base": s.base, "adapter": s.adapter, "delta": s.delta,
             "delta stderr": s.delta_stderr, "n": s.n, "metric": s.metric} for s in metrics.task_scores]
    for b in metrics.benchmark_scores:
        stderr = (b.base_stderr ** 2 + b.adapter_stderr ** 2) ** 0.5 \
            if b.base_stderr is not None and b.adapter_stderr is not None else None
        rows.append({"task": b.task, "scored by": f"benchmark {b.metric}" + ("" if b.higher_is_better else " (lower "
                     "is better)"), "base": b.base, "adapter": b.adapter, "delta": b.delta, "delta stderr": stderr,
                     "n": b.n, "metric": b.name})
    return [{k: _rounded(v) if isinstance(v, float) else v for k, v in row.items()} for row in rows]


def score_text(value: float, *, sign: bool = False) -> str:
    """A score as the tables show it: three decimals, or three significant digits where that would be a long row of
    digits (a benchmark's perplexity can be 1e27)."""
    plus = "+" if sign else ""
    return f"{value:{plus}.3f}" if abs(value) < 1e4 else f"{value:{plus}.3g}"


ANSWERED_BY = {"vllm": "vLLM (the adapter as a LoRA request)", "transformers": "transformers (the adapter on the base "
               "with PEFT)"}
"""How the summary names what answered a run's tasks (`TaskScore.answered_by`)."""


def score_lines(metrics: TrainMetrics, answers: dict[str, list[dict[str, Any]]],
                answers_urls: dict[str, str]) -> list[str]:
    """The summary's section of task and benchmark scores, base against adapter, and each task's best and worst
    answers of the adapter (from its stored answers, when they were read)."""
    rows = score_rows(metrics)
    lines = ["## Base against adapter"]
    if rows:
        lines += ["", "| task | grader or benchmark | base | adapter | Δ ± stderr |", "|---|---|---|---|---|"]
    for row in rows:
        stderr = f" ± {score_text(row['delta stderr'])}" if row["delta stderr"] is not None else ""
        lines.append(f"| {_cell(row['task'])} | {_cell(row['scored by'])} | {score_text(row['base'])} | "
                     f"{score_text(row['adapter'])} | {score_text(row['delta'], sign=True)}{stderr} |")
    failed = [f"{s.task}/{s.grader}: {s.failed}" for s in metrics.task_scores if s.failed]
    if failed:
        lines += ["", f"Answers a grader could not score (counted 0): {', '.join(failed)}."]
    if answered := sorted({s.answered_by for s in metrics.task_scores if s.answered_by}):
        lines += ["", f"Answered with {' and '.join(ANSWERED_BY[backend] for backend in answered)}."]
    if metrics.evaluation_stopped:  # the worker's deadline or an error cut the task evaluations short
        lines += ["", f"Not every task was evaluated: {metrics.evaluation_stopped}."]
    for task_name in dict.fromkeys(s.task for s in metrics.task_scores):
        kept = answers.get(task_name) or []
        if not kept:
            continue
        lines += ["", f"### {task_name}: the adapter's best and worst answers", "",
                  "| | prompt | expected | base | adapter | scores (base → adapter) |", "|---|---|---|---|---|---|"]
        for label, row in (("best", kept[0]), ("worst", kept[-1])) if len(kept) > 1 else (("only", kept[0]),):
            scores = row.get("scores") if isinstance(row.get("scores"), dict) else {}
            scored = ", ".join(f"{name} {v.get('base')} → {v.get('adapter')}" for name, v in scores.items()
                               if isinstance(v, dict))
            lines.append(f"| {label} | {_answer_cell(row.get('prompt'))} | {_answer_cell(row.get('answer'))} | "
                         f"{_answer_cell(row.get('base'))} | {_answer_cell(row.get('adapter'))} | {_cell(scored)} |")
        if task_name in answers_urls:
            lines += ["", f"All {len(kept)} kept answers: {_link(answers_urls[task_name], f'evaluation/{task_name}.jsonl')}."]
    return lines


def _answer_cell(value: Any) -> str:
    if isinstance(value, list):  # a chat prompt: its last turn is what was asked
        value = value[-1].get("content", "") if value and isinstance(value[-1], dict) else value
    return _cell(_short("" if value is None else str(value), 120))


SHOWN_TRAJECTORIES = 3
"""Trajectories the summary shows (the worker keeps a few per logging step; all are in the stored file)."""


def trajectory_lines(trajectories: list[dict[str, Any]], url: str | None) -> list[str]:
    """A table of the first `SHOWN_TRAJECTORIES` trajectories: prompt, tool calls with their answers, final answer,
    reward."""
    step = trajectories[0].get("step")
    lines = [f"## Trajectories at step {step}", "", "| prompt | tool calls → answers | final answer | reward |",
             "|---|---|---|---|"]
    for record in trajectories[:SHOWN_TRAJECTORIES]:
        calls = "; ".join(f"`{call.get('name')}({_arguments(call.get('arguments'))})` → "
                          f"{_short(str(call['result'])) if 'result' in call else '(no answer)'}"
                          for call in record.get("tool_calls") or []) or "none"
        reward = record.get("reward")
        reward_text = f"{reward:.3g}" if isinstance(reward, (int, float)) else "n/a"
        lines.append(f"| {_cell(_short(str(record.get('prompt', ''))))} | {_cell(calls)} | "
                     f"{_cell(_short(str(record.get('answer', ''))))} | {reward_text} |")
    if url:
        lines += ["", f"Every trajectory kept: {_link(url, 'trajectories.jsonl')}."]
    return lines


def _arguments(arguments: Any) -> str:
    if isinstance(arguments, dict):
        return ", ".join(f"{key}={json.dumps(value)}" for key, value in arguments.items())
    return str(arguments or "")


def _short(text: str, limit: int = 80) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


BILLED_ROW = "Billed by RunPod"
BILLING_PENDING_NOTE = "the reconciler fills this in"
"""Ends the billed row of a summary whose figure RunPod had not settled when the run ended."""


def billed_later(markdown: str, usd: float, at: datetime) -> str | None:
    """The summary `markdown` with its pending billed row (`BILLING_PENDING_NOTE`) replaced by `usd`, as the
    reconciler read it from RunPod at `at`; None when the summary has no pending billed row."""
    pattern = re.compile(rf"^\| {BILLED_ROW} \| [^\n]*{re.escape(BILLING_PENDING_NOTE)} \|$", re.MULTILINE)
    row = f"| {BILLED_ROW} | ${usd:.4f} (billed after the run ended; read by the reconciler {at:%Y-%m-%d %H:%M} UTC) |"
    filled, count = pattern.subn(row, markdown, count=1)
    return filled if count else None


def _billed(report: RunReport) -> str:
    if not report.billing_pending:
        return f"${report.billed_usd:.4f}"
    # RunPod's billing lags behind its workers: nothing billed right after the delete means "not yet".
    if report.billed_usd is None:
        return f"not read yet (RunPod's billing could not be read); {BILLING_PENDING_NOTE}"
    return f"not billed yet; {BILLING_PENDING_NOTE}"


def _published(report: RunReport) -> str:
    if report.publish_error is not None:
        return (f"`{report.published_model}`: **not published** ({_cell(report.publish_error)}); "
                "the run completed anyway")
    if report.published_model_url:
        return _link(report.published_model_url, report.published_model)
    return f"`{report.published_model}`"


def _merged(report: RunReport) -> str:
    where = f" on {report.merge_ran_on}" if report.merge_ran_on else ""
    if report.merge_error is not None:
        return (f"`{report.merged_model}`: **not merged** ({_cell(report.merge_error)}){where}; the run completed "
                "anyway")
    name = (_link(report.merged_model_url, report.merged_model) if report.merged_model_url
            else f"`{report.merged_model}`")
    return f"{name}: logits {_cell(report.merge_check or 'not checked')}; merged{where}"


TRACKER_LABELS = {"wandb": "W&B run", "mlflow": "MLflow run"}


def _tracker(run: TrackerRun, files_url: str | None) -> str:
    if run.url:
        return _link(run.url, run.run_name)
    text = f"`{run.run_name}` (id `{run.run_id}`), recorded locally"
    if files_url:
        text += f": {_link(files_url, 'its files')}"
    return f"{text}; {_cell(run.note)}" if run.note else text


def _cell(text: str) -> str:
    """`text` as part of a table cell, which is one line: newlines folded, pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def _loss_on(loss: dict[str, Any]) -> str:
    share = f"{loss.get('token_share', 0):.0%} of the training tokens"
    what = "the answers" if loss.get("loss_on") == "completion" else "every token"
    how = "; ".join(str(part) for part in (f"masked by {loss.get('masked_by')}", loss.get("chat_template")) if part)
    return f"{what}: {share} ({how})"


def _weights(report: RunReport) -> str:
    if report.warm_volume is None:
        return "downloaded (cold start)"
    text = f"warm, from network volume {report.warm_volume}"
    if report.storage_usd_per_month is not None:
        text += (f"; its storage costs ${report.storage_usd_per_month:.2f}/month whether used or not "
                 f"({report.storage_cost_source})")
    return text


def _ceiling(report: RunReport) -> str:
    text = f"${report.cost_ceiling_usd:.2f}: GPU price × GPUs × deadline"
    if report.ceiling_price_source == "static list price":  # the budget was checked against it: say so
        text += f", at the {PRICE_SOURCE_WORDS['static list price']}"
    return text


def _estimate(report: RunReport) -> str:
    text = f"${report.estimated_cost_usd:.4f} (ceiling ${report.cost_ceiling_usd:.2f})"
    if report.usd_per_hour is not None and report.price_source is not None:
        text += f" at ${report.usd_per_hour:.2f}/GPU-hour, price source: {PRICE_SOURCE_WORDS[report.price_source]}"
    return text


def _prices(report: RunReport) -> str:
    if report.price_source == "catalog":
        return "RunPod's catalog"
    reason = report.price_fallback_reason or "RunPod's catalog was not read"
    return f"{PRICE_SOURCE_WORDS['static list price']} ({_cell(reason)})"


def _cards(report: RunReport) -> str:
    if report.cards_from == "catalog":
        return "pools and cards from RunPod's catalog"
    return "pools and cards from loraflow's static table (RunPod's catalog could not be read)"


def _refused(refused: dict[str, str]) -> str:
    """Each refused class with RunPod's detail; the run moved on to the next class of `compute.gpu`."""
    return "; ".join(f"{gpu}: {_cell(_short(detail, 300))}" for gpu, detail in refused.items())


def _link(url: str, text: str | None = None) -> str:
    return f"[{text or url}]({url})" if re.match(r"^(https?|file)://", url) else url


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m" if hours else f"{minutes}m {secs:02d}s" if minutes else f"{secs}s"


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-.")


def metrics_rows(metrics: TrainMetrics) -> list[dict[str, Any]]:
    """One row per step with a training loss, and per step with an evaluation (`eval_loss` / `eval_reward`
    columns, empty where the step was not evaluated)."""
    losses = dict(metrics.losses)
    evaluations = {name: dict(series) for name, series in (("eval_loss", metrics.eval_loss),
                                                           ("eval_reward", metrics.eval_reward)) if series}
    steps = sorted(set(losses).union(*evaluations.values()))
    return [{"step": step, "loss": _rounded(losses.get(step)),
             **{name: _rounded(series.get(step)) for name, series in evaluations.items()}} for step in steps]


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


def _start_to_final(series: list[tuple[int, float]]) -> str:
    (first_step, first), (last_step, last) = series[0], series[-1]
    return f"{first:.4f} (step {first_step}) → {last:.4f} (step {last_step})"


@task(name="tag-run", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=[2, 10])
def tag_run(flow_run_id: str, tags: list[str]) -> None:
    """Add `tags` to the flow run (kept: the tags it already has, from its deployment or the CLI)."""
    with get_client(sync_client=True) as client:
        current = client.read_flow_run(flow_run_id).tags
        client.update_flow_run(flow_run_id, tags=list(dict.fromkeys([*current, *tags])))


class StoredCurve(BaseModel):
    curve_url: str = Field(description="Link to the stored curve PNG.")
    run_url: str = Field(description="Link to the run's folder in the store.")


@task(name="store-curve", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=[5, 30])
def store_curve(store_url: str, run_id: str, png: bytes, hub_token_secret: str | None = None) -> StoredCurve:
    """Store the curve as `runs/<run_id>/curve.png`, in one commit (the Hub counts commits)."""
    path = f"{run_prefix(run_id)}/{CURVE_FILE}"
    store = open_store(store_url, Settings().store_token(store_url, hub_token_secret))
    store.put({path: png}, message=f"training curve of run {run_id}")
    return StoredCurve(curve_url=store.display_url(path), run_url=store.display_url(run_prefix(run_id)))


def summary_key(key_prefix: str) -> str:
    """The key of a run's summary artifact (`publish_report`)."""
    return f"{key_prefix}-summary"


@task(name="publish-report", cache_policy=NO_CACHE)
def publish_report(report: RunReport, key_prefix: str, curve: bytes | None = None) -> None:
    artifacts = [
        functools.partial(create_markdown_artifact, markdown=summary_markdown(report, curve),
                          key=summary_key(key_prefix), description=f"Run {report.run_name} summary"),
        functools.partial(create_table_artifact, table=metrics_rows(report.metrics), key=f"{key_prefix}-metrics",
                          description=f"Run {report.run_name} training loss by step"),
    ]
    if report.metrics.task_scores or report.metrics.benchmark_scores:
        artifacts.append(functools.partial(
            create_table_artifact, table=score_rows(report.metrics), key=f"{key_prefix}-scores",
            description=f"Run {report.run_name}: tasks and benchmarks, base against adapter"))
    # One request each, made at once (the run's end waits for the slowest, not their sum), each in a copy of this
    # task's context, which links the artifact to the run.
    with ThreadPoolExecutor(len(artifacts), thread_name_prefix="loraflow-report") as pool:
        for made in [pool.submit(contextvars.copy_context().run, create) for create in artifacts]:
            made.result()
