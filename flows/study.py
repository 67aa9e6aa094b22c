"""The `study` flow: many train runs of one spec, varied by a grid and seeds or picked by Optuna, under one budget,
compared.

    .venv/bin/python -m flows.study deployments/qwen-study.toml
    .venv/bin/python -m flows.study deployments/qwen-study.toml --resume <study flow run id>
    prefect deployment run study/qwen-lr

A run file with a `[study]` section (`flows/forms/study.py`). Before anything is rented, every child is validated
(with `search = "tpe"`, the children at the space's corners, and the Optuna storage opened: `flows/study_search.py`),
and refused: a child whose cost ceiling alone passes `study.budget_usd`, a study whose whole spend passes the
operator's `LORAFLOW_MAX_STUDY_USD`, a `parallel` above the account's worker quota, a `deployment` that does not
exist. Then the children run (`flows/study_run.py`), `study.parallel` at a time, each starting only when the budget
has room for its ceiling: each is an ordinary `train` flow run (its own page, name, summary, endpoint, teardown and
`loraflow.run.finished`), tagged `study:<name>`, a run of `study.deployment` on the team's workers or a subflow in
this process. A child that fails is a row of the comparison, not a failed
study (unless every child fails); with `prune`, a child losing to the others' median is cancelled as it runs
(`tasks/lifecycle/study_pruning.py`). At the end: the comparison (a paged table, a summary with the best children's
curves overlaid), the best child named, with `publish_best` its adapter published, and `loraflow.study.finished`.
Cancelling the study cancels its running children (each tears its endpoint down) and starts no more. A study
started again in its own flow run (`--resume`, a Prefect retry) adopts what completed or still runs.
"""

# No `from __future__ import annotations` here: Prefect builds the parameter model (the UI form) from
# the flow signature when it loads the entrypoint.
import argparse
import sys
import tempfile
from pathlib import Path

from loraflow_worker.contract import JobResult
from prefect import flow, get_client, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import FlowRun
from prefect.exceptions import ObjectNotFound
from prefect.flow_engine import run_flow
from prefect.runtime import flow_run
from prefect.states import Cancelled, Completed, Failed, Pending, State

from flows.serve import serve_trained
from flows.forms.run import SpecError
from flows.study_run import rebuild_trials, run_children
from flows.study_search import Search, space_corners
from flows.forms.study import (
    Child,
    StudySettings,
    StudySpec,
    child_label,
    describe_values,
    expand,
    judging_change,
    load_study_file,
)
from flows.train_check import check_local_inputs
from tasks.lifecycle.quota import WORKER_QUOTA_ENV, worker_quota_in_force
from tasks.lifecycle.study_children import cancel_children_hook
from tasks.placement.cost import (
    CostCeiling,
    check_study_budget,
    check_study_cap,
    cost_ceiling,
    read_gpu_prices,
    worst_case_cost_usd,
)
from tasks.reports import events
from tasks.reports.study import (
    ChildRow,
    StudyReport,
    best_child,
    overlay_png,
    plotted_children,
    publish_study_report,
)
from tasks.preflight.server_rules import check_inside_inputs_dir, check_server_rules
from tasks.runpod.catalog import resolve_gpu
from tasks.runpod.live_catalog import GpuOffer
from tasks.settings import Settings, startup_problem
from tasks.storage.artifacts import read_run_results
from tasks.jobs.merge import MergedModel, merge_run_adapter
from tasks.storage.publish import PublishedModel, publish_run_adapter
from tasks.storage.run_files import read_run_files


def _flow_run_name() -> str:
    spec: StudySpec = flow_run.parameters["spec"]
    return f"{spec.name} study of {spec.study.children()} runs"


@task(name="study-costs", cache_policy=NO_CACHE)
def gpu_offers(children: list[Child]) -> dict[str, GpuOffer]:
    """The prices of every GPU the children name, from one read (a search's children name those of its corners)."""
    names = list(dict.fromkeys(gpu for child in children for gpu in child.spec.compute.gpu))
    return {offer.gpu: offer for offer in read_gpu_prices.fn([resolve_gpu(name) for name in names])}


def child_ceiling(child: Child, offers: dict[str, GpuOffer]) -> CostCeiling:
    """The child's cost ceiling (its GPUs' dearest price × GPUs × deadline). An upper bound of what the child's own
    check works out: that may leave out GPUs the run does not fit, never add one. A GPU `offers` lacks is read."""
    missing = [gpu for gpu in child.spec.compute.gpu if gpu not in offers]
    if missing:
        offers |= {offer.gpu: offer for offer in read_gpu_prices.fn([resolve_gpu(name) for name in missing])}
    return cost_ceiling([offers[gpu] for gpu in child.spec.compute.gpu], child.spec.compute.gpu_count,
                        child.spec.deadline_minutes)


def children_ceilings_usd(spec: StudySpec, checked: list[Child], offers: dict[str, GpuOffer]) -> list[float]:
    """The cost ceiling of each child the whole study may start: a grid's children (`checked`) each; a search's
    `study.trials` children each at the most any of them may cost, the dearest GPU, the most GPUs and the longest
    deadline among its corners (`checked`: every value Optuna may pick lies between theirs)."""
    if spec.study.search != "tpe":
        return [child_ceiling(child, offers).usd for child in checked]
    for child in checked:
        child_ceiling(child, offers)  # reads the price of any GPU `offers` lacks
    most = worst_case_cost_usd([offers[gpu] for child in checked for gpu in child.spec.compute.gpu],
                               max(child.spec.compute.gpu_count for child in checked),
                               max(child.spec.deadline_minutes for child in checked))
    return [most] * spec.study.children()


@task(name="study-inputs", cache_policy=NO_CACHE)
def check_children_inputs(children: list[Child]) -> None:
    """This server's rules (`tasks/preflight/server_rules.py`) and the children's local files (dataset, evaluation,
    task and grader files, rewards), read as each child's own check would, each distinct set once: a file outside the
    inputs folder, a missing file or a bad row refuses the study before any child starts, rather than failing every
    child that names it. `SpecError` names each child whose files are refused, and why."""
    checked: set[str] = set()
    problems = []
    for child in children:
        inputs = child.spec.model_dump_json(include={"algorithm": True, "dataset": True, "evaluation": True,
                                                     "grpo": {"rewards", "tools", "environment"}, "model": True,
                                                     "training": {"chat_template"}, "artifact_store": True,
                                                     "hub_token_secret": True, "worker": {"secrets"}})
        if inputs in checked:
            continue
        checked.add(inputs)
        try:
            check_server_rules(child.spec.local_paths(), artifact_store=child.spec.artifact_store,
                               hub_token_secret=child.spec.hub_token_secret, worker_secrets=child.spec.worker.secrets)
            with tempfile.TemporaryDirectory(prefix="loraflow-run-files-") as folder:
                check_local_inputs(child.spec, read_run_files(child.spec.local_paths(), Path(folder),
                                                              base_dir=Path.cwd(),
                                                              inputs_dir=Settings().loraflow_inputs_dir))
        except ValueError as e:
            problems.append(f"  - {child_label(child.index, child.values)}: {e}")
    if problems:
        raise SpecError(f"{len(problems)} child run(s) would be refused for their files, so nothing was started:\n"
                        + "\n".join(problems))


@task(name="study-room", cache_policy=NO_CACHE)
def check_study_room(settings: StudySettings) -> None:
    """Before anything is rented: `parallel` within the account's worker quota (children past it would only wait
    for a slot, each holding a worker's process), and `deployment`, when set, a deployment this server has.
    `SpecError` names the field and the fix."""
    quota, source = worker_quota_in_force()
    if settings.parallel > quota:
        raise SpecError(f"study.parallel {settings.parallel} is above the account's worker quota {quota} ({source}): "
                        f"at most {quota} children can hold an endpoint at once. Lower study.parallel to {quota} or "
                        f"less, or, if the account's quota is higher, set {WORKER_QUOTA_ENV} to it (and the "
                        "runpod-endpoints limit: prefect gcl update runpod-endpoints --limit N)")
    if settings.deployment is None:
        return
    with get_client(sync_client=True) as client:
        try:
            client.read_deployment_by_name(settings.deployment)
        except ObjectNotFound:
            raise SpecError(f"study.deployment {settings.deployment!r} is not a deployment of this Prefect server: "
                            "deploy the train flow under that name (prefect deploy, see docs/team.md), or remove "
                            "study.deployment to run the children in the study's own process") from None


@task(name="study-search", cache_policy=NO_CACHE)
def open_search(spec: StudySpec, study_run_id: str) -> Search:
    """The study's Optuna study, created or (resumed) loaded, with the trials its children ran and it lacks rebuilt,
    before anything is rented: `SpecError` names `LORAFLOW_OPTUNA_STORAGE` when its storage cannot be opened, and
    both when a resume changes the study's metric or direction."""
    search = Search(spec, study_run_id)
    rebuild_trials(search, study_run_id)
    return search


# Each hook reaches the children that have not ended (a cancelled study cancels them; one that crashed or failed
# leaves its deployment children running, for a resume to adopt) and the study's own endpoint.
@flow(name="study", log_prints=True, flow_run_name=_flow_run_name, on_cancellation=[cancel_children_hook],
      on_crashed=[cancel_children_hook], on_failure=[cancel_children_hook])
def study(spec: StudySpec, run_file: str | None = None) -> StudyReport | State:
    """Train several LoRA adapters from one run spec, varied by `[study]`'s grid and seeds (or picked by Optuna from
    its `space`, `search = "tpe"`), at most `parallel` at a time, within one budget, the losers cancelled as they
    train (`prune`), and compare them by `metric`: a table of the children, the best ones' curves on one plot, the
    best child named (and, with `publish_best`, its adapter published and merged as `[publish]` says). Every child
    is checked before anything is rented; the budget is kept as children start. Started again in the same flow run
    (a retry), the study adopts the children that completed, were pruned or still run, and starts the rest.

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
    # Every child valid, or nothing starts; a search's values all lie between its corners'.
    checked = space_corners(spec) if settings.search == "tpe" else expand(spec)
    check_children_inputs(checked)
    offers = gpu_offers(checked)
    check_study_budget({c.spec.name: child_ceiling(c, offers) for c in checked}, settings.budget_usd,
                       Settings().loraflow_max_run_usd)
    check_study_cap(children_ceilings_usd(spec, checked, offers), settings.budget_usd,
                    Settings().loraflow_max_study_usd)
    check_study_room(settings)
    search = open_search(spec, study_run_id) if settings.search == "tpe" else None
    children = [c for _, _, c in search.asked() if c is not None] if search is not None else checked
    if search is not None:
        what = (f"a TPE search of {settings.trials} trials over {', '.join(settings.space)} (Optuna study "
                f"{search.name} in {search.storage_shown}; optuna-dashboard {search.storage_shown})")
    else:
        shown = ", ".join(describe_values(c.values) or c.spec.name for c in children[:20])
        what = f"{len(children)} children ({shown}{', ...' if len(children) > 20 else ''})"
    logger.info("Study %s, flow run %s: %s, %d at a time, %s%s%s; should this process stop, `python -m flows.study "
                "RUN_FILE --resume %s` (or a retry of this flow run) adopts what ran", spec.name, study_run_id, what,
                settings.parallel, f"as runs of {settings.deployment}" if settings.deployment else "in this process",
                f", within a ${settings.budget_usd:.2f} budget" if settings.budget_usd else "",
                f", pruning by the {settings.prune.rule} rule after {settings.prune.after_evals} evaluation(s)"
                if settings.prune else "", study_run_id)

    outcome = run_children(children, spec, study_run_id, lambda child: child_ceiling(child, offers).usd, search)
    rows = outcome.rows
    best = best_child(rows, settings.maximize())
    published, merged = _publish_best(spec, best, outcome.pins.get(best.index) if best is not None else None)
    report = StudyReport(study=spec.name, metric=settings.metric, maximize=settings.maximize(), rows=rows, best=best,
                         cost_usd=round(sum(r.cost_usd or 0.0 for r in rows), 4),
                         cost_ceiling_usd=round(sum(r.cost_ceiling_usd or 0.0 for r in rows if r.flow_run_id), 2),
                         budget_usd=settings.budget_usd,
                         published=published.hub_model_id if published and not published.error else None,
                         publish_error=published.error if published else None,
                         merged=merged.merged_model_id if merged and not merged.error else None,
                         merge_error=merged.error if merged else None)
    publish_study_report(report, overlay_png(_plotted_metrics(spec, rows), settings.metric))
    for row in rows:
        logger.info("%s %s (%s): %s %s", "best" if best and row.index == best.index else "    ", row.name, row.values,
                    row.state, f"{settings.metric} {row.metric:.4g}" if row.metric is not None
                    else row.reason.removeprefix(f"{row.state} ")[:200])
    cancelled = outcome.cancelled
    status = "cancelled" if cancelled else "completed" if any(r.state == "completed" for r in rows) else "failed"
    events.study_finished(study_run_id, spec.name, status=status, report=report)
    if cancelled:
        return Cancelled(message=f"Study {spec.name} cancelled: {_counts(rows)}")
    if status == "failed":
        return Failed(message=f"No child of study {spec.name} completed: "
                      + "; ".join(f"{r.name}: {r.reason[:200]}" for r in rows[:20]))
    if best is not None and spec.study.publish_best:  # `[publish.serve]`, when it has one
        # The best child's own spec (its base, its lengths), with the study's `[publish]`; a search's later children
        # were asked as it ran, and share the study's base.
        child = next((c.spec for c in children if c.index == best.index), None)
        serve_trained(child.model_copy(update={"publish": spec.publish}) if child else spec, best.flow_run_id,
                      best.name, published)
    return Completed(message=f"Study {spec.name}: {_counts(rows)}; best {best.name if best else 'none'}",
                     data=report)


def _plotted_metrics(spec: StudySpec, rows: list[ChildRow]) -> dict:
    """The metrics of the children the plot overlays (the best ten and the median), read from what each stored
    under its own run id; a child whose results cannot be read is left out of the plot, not the study."""
    by_index = {r.index: r for r in rows}
    token = Settings().store_token(spec.artifact_store, spec.hub_token_secret)
    metrics = {}
    for index, label in plotted_children(rows, spec.study.maximize()).items():
        try:
            results = read_run_results(spec.artifact_store, by_index[index].flow_run_id, token)
        except Exception as e:  # noqa: BLE001 - the plot is a view, not the comparison
            get_run_logger().warning("Child %s's curve is left out of the plot: %s: %s", label, type(e).__name__, e)
            continue
        if results.result is not None:
            metrics[label] = results.result.metrics
    return metrics


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


def _counts(rows: list[ChildRow]) -> str:
    counts: dict[str, int] = {}
    for row in rows:
        counts[row.state] = counts.get(row.state, 0) + 1
    return ", ".join(f"{n} {state}" for state, n in counts.items())


def start_or_resume(spec: StudySpec, resume: str | None) -> FlowRun:
    """The flow run the study runs in: a new one, or (`resume`) the study's own earlier one, so that its children,
    found by their tag and keys, are its own. `SpecError` when `resume` names no study flow run."""
    with get_client(sync_client=True) as client:
        if resume is None:
            return client.create_flow_run(study, parameters=study.serialize_parameters({"spec": spec}),
                                          state=Pending())
        try:
            run = client.read_flow_run(resume)
        except (ObjectNotFound, ValueError):
            raise SpecError(f"--resume {resume}: no flow run with that id on this Prefect server") from None
        if client.read_flow(run.flow_id).name != study.name:
            raise SpecError(f"--resume {resume}: flow run {run.name} is not a study (resume a study's own flow run "
                            "id, which it prints when it starts)")
        # Its `spec` is what ran, unless a `run_file` replaced it (then a search's Optuna study still says).
        earlier = (run.parameters or {}).get("spec") if not (run.parameters or {}).get("run_file") else None
        if isinstance(earlier, dict) and (changed := judging_change(earlier.get("study") or {}, spec.study)):
            raise SpecError(f"--resume {resume}: {changed}: the study ranked, pruned and told Optuna its children "
                            "by what it was started with, so nothing was started. Resume it with its own study.metric "
                            "and study.direction, or start a new study")
        # The page shows what this process runs (a resume may change study.parallel and study.budget_usd).
        client.update_flow_run(run.id, parameters=study.serialize_parameters({"spec": spec, "run_file": None}))
        return run


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m flows.study", description="Run a study: a run file with a "
                                     "[study] section.")
    parser.add_argument("run_file", metavar="RUN_FILE", help="a run file with a [study] section")
    parser.add_argument("--resume", metavar="STUDY_FLOW_RUN_ID", help="start the study again in its own flow run "
                        "(the id it printed when it started): what completed or still runs is adopted, the rest run")
    args = parser.parse_args()
    try:
        study_spec = load_study_file(args.run_file)
    except SpecError as e:
        sys.exit(str(e))
    if problem := startup_problem(worker_image=True):
        sys.exit(problem)
    try:
        study_run = start_or_resume(study_spec, args.resume)
    except SpecError as e:
        sys.exit(str(e))
    print(f"study flow run {study_run.id}: {'resuming' if args.resume else 'starting'} (resume it with "
          f"python -m flows.study {args.run_file} --resume {study_run.id})", flush=True)
    final = run_flow(study, flow_run=study_run, parameters={"spec": study_spec, "run_file": None},
                     return_type="state")
    print(f"flow run {study_run.id}: {final.name}", flush=True)
    sys.exit(0 if final.is_completed() else 1)
