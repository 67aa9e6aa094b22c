"""The `study` flow: many train runs of one spec, varied by a grid and seeds, under one budget, compared.

    .venv/bin/python -m flows.study deployments/qwen-study.toml
    prefect deployment run study/qwen-lr

A run file with a `[study]` section (`flows/study_spec.py`). Before anything is rented, every child is validated
and the sum of the children's cost ceilings is checked against `study.budget_usd`. Then the children run,
`study.parallel` at a time: each is an ordinary `train` flow run (its own page, name, summary, endpoint, teardown
and `loraflow.run.finished`), tagged `study:<name>`. A child that fails is a row of the comparison, not a failed
study (unless every child fails). At the end: the comparison (a table artifact, a summary with the children's
curves overlaid), the best child named, with `publish_best` its adapter published, and `loraflow.study.finished`.
Cancelling the study cancels its running children (each tears its endpoint down) and starts no more.
"""

# No `from __future__ import annotations` here: Prefect builds the parameter model (the UI form) from
# the flow signature when it loads the entrypoint.
import sys

from loraflow_worker.contract import JobResult
from prefect import flow, get_run_logger, tags, task
from prefect.cache_policies import NO_CACHE
from prefect.futures import PrefectFuture, wait
from prefect.runtime import flow_run
from prefect.states import Cancelled, Completed, Failed, State

from flows.spec import SpecError
from flows.study_spec import Child, StudySpec, child_label, describe_values, expand, load_study_file
from flows.train import train
from flows.train_check import check_local_inputs
from tasks.lifecycle.steps import run_cancel_requested
from tasks.lifecycle.study_children import (
    cancel_children,
    cancel_children_hook,
    child_cost_usd,
    child_minutes,
    flow_run_page,
    study_tags,
)
from tasks.placement.cost import (
    CostCeiling,
    check_study_budget,
    cost_ceiling,
    read_gpu_prices,
)
from tasks.reports import events
from tasks.reports.study import (
    ChildRow,
    StudyReport,
    best_child,
    completed_row,
    overlay_png,
    publish_study_report,
)
from tasks.preflight.server_rules import check_inside_inputs_dir, check_server_rules
from tasks.runpod.catalog import resolve_gpu
from tasks.settings import Settings, startup_problem
from tasks.storage.artifacts import RunResults
from tasks.jobs.merge import MergedModel, merge_run_adapter
from tasks.storage.publish import PublishedModel, publish_run_adapter

POLL_SECONDS = 5.0
"""How often the study looks at its own state (a cancel) and its children while they run."""


def _flow_run_name() -> str:
    spec: StudySpec = flow_run.parameters["spec"]
    return f"{spec.name} study of {spec.study.children()} runs"


@task(name="study-costs", cache_policy=NO_CACHE)
def child_ceilings(children: list[Child]) -> dict[str, CostCeiling]:
    """Each child's cost ceiling (its GPUs' dearest price × GPUs × deadline), from one read of the prices. An upper
    bound of what the child's own check works out: that may leave out GPUs the run does not fit, never add one."""
    names = list(dict.fromkeys(gpu for child in children for gpu in child.spec.compute.gpu))
    offers = {offer.gpu: offer for offer in read_gpu_prices.fn([resolve_gpu(name) for name in names])}
    return {child.spec.name: cost_ceiling([offers[gpu] for gpu in child.spec.compute.gpu],
                                          child.spec.compute.gpu_count, child.spec.deadline_minutes)
            for child in children}


@task(name="study-inputs", cache_policy=NO_CACHE)
def check_children_inputs(children: list[Child]) -> None:
    """This server's rules (`tasks/preflight/server_rules.py`) and the children's local files (dataset, evaluation
    file, rewards), read as each child's own check would, each distinct set once: a file outside the inputs folder,
    a missing file or a bad row refuses the study before any child starts, rather than failing every child that
    names it. `SpecError` names each child whose files are refused, and why."""
    checked: set[str] = set()
    problems = []
    for child in children:
        inputs = child.spec.model_dump_json(include={"algorithm": True, "dataset": True, "evaluation": True,
                                                     "grpo": {"rewards", "tools", "environment"}, "model": True,
                                                     "training": {"chat_template"}, "artifact_store": True,
                                                     "hub_token_secret": True})
        if inputs in checked:
            continue
        checked.add(inputs)
        try:
            check_server_rules(child.spec.local_paths(), artifact_store=child.spec.artifact_store,
                               hub_token_secret=child.spec.hub_token_secret)
            check_local_inputs(child.spec)
        except ValueError as e:
            problems.append(f"  - {child_label(child.index, child.values)}: {e}")
    if problems:
        raise SpecError(f"{len(problems)} child run(s) would be refused for their files, so nothing was started:\n"
                        + "\n".join(problems))


@task(name="study-child", cache_policy=NO_CACHE)
def run_child(child: Child, study_name: str, study_run_id: str, metric: str,
              ceiling: float) -> tuple[ChildRow, JobResult | None]:
    """One child as a `train` flow run of its own, tagged with the study; its row of the comparison, and its
    result (its metrics, and its adapter's hashes for publishing) when it completed. Never raises for the child's own failure: that is the row's state and reason."""
    row = ChildRow(index=child.index, name=child.spec.name, values=describe_values(child.values),
                   state="not started", cost_ceiling_usd=ceiling)
    if run_cancel_requested():  # the study's own state: this task runs in the study's flow run
        return row.model_copy(update={"reason": "the study was cancelled first"}), None
    with tags(*study_tags(study_name, study_run_id)):
        final: State = train(child.spec, return_state=True)
    child_id = str(final.state_details.flow_run_id)
    row = row.model_copy(update={"flow_run_id": child_id, "summary_url": flow_run_page(child_id),
                                 "minutes": child_minutes(child_id), "cost_usd": child_cost_usd(child_id)})
    if final.is_completed():
        results: RunResults = final.result()
        return completed_row(row, results.result.metrics, metric).model_copy(
            update={"state": "completed", "adapter_url": results.adapter_url}), results.result
    state = "cancelled" if final.is_cancelled() else "failed"
    return row.model_copy(update={"state": state, "reason": (final.message or final.name)[:500]}), None


# Each hook reaches the children that have not ended (a study that stops stops them) and the study's own endpoint.
@flow(name="study", log_prints=True, flow_run_name=_flow_run_name, on_cancellation=[cancel_children_hook],
      on_crashed=[cancel_children_hook], on_failure=[cancel_children_hook])
def study(spec: StudySpec, run_file: str | None = None) -> StudyReport | State:
    """Train several LoRA adapters from one run spec, varied by `[study]`'s grid and seeds, at most `parallel` at a
    time, within one budget, and compare them by `metric`: a table of the children, their curves on one plot, the
    best child named (and, with `publish_best`, its adapter published and merged as `[publish]` says). Every child
    is checked, and the children's cost ceilings summed against `budget_usd`, before anything is rented.

    Args:
        spec: The children's common run spec, with the `[study]` section.
        run_file: A TOML run file with a `[study]` section that replaces `spec` (e.g. `deployments/qwen-study.toml`);
            relative paths are resolved from the flow's working directory.
    """
    logger = get_run_logger()
    study_run_id = str(flow_run.id)
    if run_file is not None:
        check_inside_inputs_dir("parameter run_file", run_file, Settings())
        try:
            spec = load_study_file(run_file)
        except SpecError as e:
            raise SpecError(f"parameter run_file: {e}") from e
    settings = spec.study
    children = expand(spec)  # every child valid, or nothing starts
    check_children_inputs(children)
    ceilings = child_ceilings(children)
    ceiling_total = round(sum(c.usd for c in ceilings.values()), 2)
    check_study_budget(ceilings, settings.budget_usd, Settings().loraflow_max_run_usd)
    logger.info("Study %s: %d children (%s), %d at a time, cost ceilings $%.2f in all%s", spec.name, len(children),
                ", ".join(describe_values(c.values) or c.spec.name for c in children), settings.parallel,
                ceiling_total, f" of a ${settings.budget_usd:.2f} budget" if settings.budget_usd else "")

    rows, results, cancelled = _run_children(children, spec, study_run_id, ceilings)
    best = best_child(rows, settings.maximize())
    published, merged = _publish_best(spec, best, results.get(best.name) if best is not None else None)
    report = StudyReport(study=spec.name, metric=settings.metric, maximize=settings.maximize(), rows=rows, best=best,
                         cost_usd=round(sum(r.cost_usd or 0.0 for r in rows), 4), cost_ceiling_usd=ceiling_total,
                         budget_usd=settings.budget_usd,
                         published=published.hub_model_id if published and not published.error else None,
                         publish_error=published.error if published else None,
                         merged=merged.merged_model_id if merged and not merged.error else None,
                         merge_error=merged.error if merged else None)
    publish_study_report(report, overlay_png({name: r.metrics for name, r in results.items()}, settings.metric))
    for row in rows:
        logger.info("%s %s (%s): %s %s", "best" if best and row.index == best.index else "    ", row.name, row.values,
                    row.state, f"{settings.metric} {row.metric:.4g}" if row.metric is not None else row.reason[:200])
    status = "cancelled" if cancelled else "completed" if any(r.state == "completed" for r in rows) else "failed"
    events.study_finished(study_run_id, spec.name, status=status, report=report)
    if cancelled:
        return Cancelled(message=f"Study {spec.name} cancelled: {_counts(rows)}")
    if status == "failed":
        return Failed(message=f"Every child of study {spec.name} failed: "
                      + "; ".join(f"{r.name}: {r.reason[:200]}" for r in rows))
    return Completed(message=f"Study {spec.name}: {_counts(rows)}; best {best.name if best else 'none'}",
                     data=report)


def _publish_best(spec: StudySpec, best: ChildRow | None,
                  result: JobResult | None) -> tuple[PublishedModel | None, MergedModel | None]:
    """With `publish_best`, the best child's adapter published (`publish.hub_model_id`) and merged into its base
    (`publish.merged_model_id`) as one run's would be, checked against the hashes its job returned (`result`); a
    failure is logged and reported, never raised."""
    logger = get_run_logger()
    if best is None or not spec.study.publish_best or spec.publish is None:
        return None, None
    published = merged = None
    if spec.publish.hub_model_id is not None:
        published = publish_run_adapter(spec.artifact_store, best.flow_run_id, best.name, spec.publish.hub_model_id,
                                        spec.publish.private, spec.hub_token_secret, result=result)
        if published.error:
            logger.warning("The best adapter was not published to %s: %s", published.hub_model_id, published.error)
    if spec.publish.merged_model_id is not None:
        merged = merge_run_adapter(spec.artifact_store, best.flow_run_id, best.name, spec.publish.merged_model_id,
                                   private=spec.publish.private, hub_token_secret=spec.hub_token_secret,
                                   adapter_repo=published.hub_model_id if published and not published.error else None,
                                   result=result)
        if merged.error:
            logger.warning("The best adapter was not merged into %s: %s", merged.merged_model_id, merged.error)
    return published, merged


def _run_children(children: list[Child], spec: StudySpec, study_run_id: str, ceilings: dict[str, CostCeiling],
                  ) -> tuple[list[ChildRow], dict[str, JobResult], bool]:
    """Run the children `parallel` at a time, watching the study's own state: a cancel cancels the running children
    (each tears its endpoint down) and starts no more. Returns the rows in the study's order, the completed
    children's results by name, and whether the study was cancelled."""
    logger = get_run_logger()
    pending, running = list(children), {}
    rows: dict[int, ChildRow] = {}
    results: dict[str, JobResult] = {}
    cancelled = False
    while pending or running:
        if not cancelled and run_cancel_requested():
            cancelled = True
            logger.warning("Study cancelled: cancelling its running children, starting no more")
            for child in pending:
                rows[child.index] = ChildRow(index=child.index, name=child.spec.name,
                                             values=describe_values(child.values), state="not started",
                                             reason="the study was cancelled first",
                                             cost_ceiling_usd=ceilings[child.spec.name].usd)
            pending = []
        if cancelled:
            cancel_children(study_run_id)  # again each round: a child that had just started is caught too
        while pending and len(running) < spec.study.parallel:
            child = pending.pop(0)
            future: PrefectFuture = run_child.submit(child, spec.name, study_run_id, spec.study.metric,
                                                     ceilings[child.spec.name].usd)
            running[future] = child
        done, _ = wait(list(running), timeout=POLL_SECONDS)
        for future in done:
            child = running.pop(future)
            try:
                row, child_result = future.result()
            except Exception as e:  # noqa: BLE001 - one child's unreadable outcome is its row, not the study's end
                row, child_result = ChildRow(index=child.index, name=child.spec.name,
                                              values=describe_values(child.values), state="failed",
                                              reason=f"its outcome could not be read: {type(e).__name__}: {e}"[:500],
                                              cost_ceiling_usd=ceilings[child.spec.name].usd), None
            rows[child.index] = row
            if child_result is not None:
                results[row.name] = child_result
            logger.info("Child %d/%d %s (%s) ended %s", child.index, len(children), row.name, row.values, row.state)
    return [rows[c.index] for c in children], results, cancelled


def _counts(rows: list[ChildRow]) -> str:
    counts: dict[str, int] = {}
    for row in rows:
        counts[row.state] = counts.get(row.state, 0) + 1
    return ", ".join(f"{n} {state}" for state, n in counts.items())


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m flows.study RUN_FILE.toml   (a run file with a [study] section)")
    try:
        study_spec = load_study_file(sys.argv[1])
    except SpecError as e:
        sys.exit(str(e))
    if problem := startup_problem(worker_image=True):
        sys.exit(problem)
    final = study(study_spec, return_state=True)
    print(f"flow run {final.state_details.flow_run_id}: {final.name}", flush=True)
    sys.exit(0 if final.is_completed() else 1)
