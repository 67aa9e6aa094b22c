"""Run one chaos scenario (`bench/chaos_scenarios.py`) as a real flow against a local stack: its faults scoped to its
endpoint names, the watches that act while it trains, the flow itself, and the `RunRecord` of what happened. The
parts it is built of are `bench/chaos_lib.py` (and `bench/chaos_volumes.py` for the volumes scenario);
`bench/chaos_checks.py` judges the record; `bench/chaos_batch.py` runs many at once.
"""

from __future__ import annotations

import shutil
import time
from contextlib import nullcontext
from pathlib import Path

from bench.chaos_lib import (
    _RECORD_LOCK,
    CliFlows,
    Localpod,
    PrefectApi,
    RunRecord,
    WhenTraining,
    WorkerTokens,
    hub_model,
    own_token,
    runpod_api,
    tight_reconcile,
    write_run_file,
    write_stale_record,
)
from bench.chaos_scenarios import Scenario, scoped
from bench.chaos_serve import make_adapter, run_serve_scenario
from bench.chaos_study import run_study_scenario
from bench.chaos_volumes import run_volume_race


def run_scenario(stack, pod: Localpod, scenario: Scenario, *, name: str, workdir: Path, model: Path, max_steps: int,
                 timeout_s: float = 900, flows=None) -> RunRecord:
    """Inject the scenario's faults for this run's endpoints, then run its flow to its end (`flows`: how flows are
    started, `CliFlows` when None)."""
    flows = flows or CliFlows(stack)
    here = workdir / name
    here.mkdir(parents=True)
    if scenario.flow == "volumes":
        return run_volume_race(stack, pod, scenario, name=name, here=here, timeout_s=timeout_s)
    if scenario.flow == "preload":
        return run_preload_scenario(stack, pod, scenario, name=name, here=here, model=model, timeout_s=timeout_s,
                                    flows=flows)
    if scenario.flow == "serve":
        return run_serve_scenario(stack, pod, scenario, name=name, here=here, model=model,
                                  adapter=make_adapter(model, workdir / "serve-adapter"), timeout_s=timeout_s,
                                  flows=flows)
    if scenario.flow == "study":
        return run_study_scenario(stack, pod, scenario, name=name, here=here, model=model, timeout_s=timeout_s,
                                  flows=flows)
    if scenario.broken_model:
        model = here / "not-a-model"
        model.mkdir()
    if scenario.stale_warm_record:
        # A copy of its own (the flow resolves links), so that only this run's model is named in the record.
        model = Path(shutil.copytree(model, here / "model")).resolve()
    record = RunRecord(scenario, name, here / "store")
    run_file = write_run_file(here / "run.toml", scenario, name=name, model=model, store=record.store, max_steps=max_steps)
    with _RECORD_LOCK if scenario.stale_warm_record else nullcontext():
        if scenario.stale_warm_record:
            prefect = PrefectApi(stack.prefect_api_url)
            variable = write_stale_record(stack, prefect, scenario.stale_warm_record, str(model))
        _run_train(stack, pod, scenario, record, run_file, timeout_s=timeout_s, flows=flows)
        if scenario.stale_warm_record:
            record.stale_record_cleared = prefect.get_variable(variable) is None
    return record


def run_preload_scenario(stack, pod: Localpod, scenario: Scenario, *, name: str, here: Path, model: Path,
                         timeout_s: float, flows) -> RunRecord:
    """A preload sweep of the tiny model (a Hub repo of the stack's Hub stand-in) with the scenario's faults."""
    record = RunRecord(scenario, name, here / "store")
    spec = {"models": [{"id": hub_model(stack, model)}], "data_centers": list(scenario.preload_data_centers),
            "minutes_per_data_center": 10, "queue_minutes": 3}
    record.volumes_before = [v.id for v in pod.account().volumes if v.data_center in scenario.preload_data_centers]
    for rule in scenario.route_faults:
        record.fault_ids.append(pod.add_route_fault(scoped(rule, record.endpoint_prefix)))
    started = time.monotonic()
    flows.run(record, spec, {}, timeout_s)
    record.wall_s = time.monotonic() - started
    if record.flow_run_id:
        record.sweep_rows = PrefectApi(stack.prefect_api_url).sweep_table(record.flow_run_id)
    return record


def _run_train(stack, pod: Localpod, scenario: Scenario, record: RunRecord, run_file: Path, *,
               timeout_s: float, flows) -> None:
    name = record.name
    if scenario.route_faults_at_step is None:
        for rule in scenario.route_faults:
            record.fault_ids.append(pod.add_route_fault(scoped(rule, record.endpoint_prefix)))
    for rule in scenario.worker_faults:
        record.fault_ids.append(pod.add_worker_fault({**rule, "endpoint_name_prefix": record.endpoint_prefix}))
    env = {"HF_TOKEN": own_token(name)} if scenario.own_token else {}
    started = time.monotonic()
    runpod = runpod_api(stack)
    deleter = reconciler = tokens = nullcontext()
    if scenario.own_token:
        tokens = WorkerTokens(pod, record.endpoint_prefix)
    if scenario.delete_endpoint_at_step is not None:
        deleter = WhenTraining(pod, runpod, record.endpoint_prefix, scenario.delete_endpoint_at_step, timeout_s,
                               lambda endpoint_id: runpod.delete(f"/serverless/{endpoint_id}").raise_for_status())
    if scenario.tight_reconcile_at_step is not None:
        reconciler = WhenTraining(pod, runpod, record.endpoint_prefix, scenario.tight_reconcile_at_step, timeout_s,
                                  tight_reconcile(stack, scenario.tight_reconcile_minutes))
    faulter = nullcontext()
    if scenario.route_faults_at_step is not None:
        faulter = WhenTraining(pod, runpod, record.endpoint_prefix, scenario.route_faults_at_step, timeout_s,
                               lambda endpoint_id: record.fault_ids.extend(
                                   pod.add_route_fault(scoped(rule, record.endpoint_prefix))
                                   for rule in scenario.route_faults))
    with runpod, deleter, reconciler, tokens, faulter:
        flows.run(record, run_file, env, timeout_s)
    record.wall_s = time.monotonic() - started
    if isinstance(deleter, WhenTraining) and deleter.done:
        record.endpoint_deleted = deleter.result.request.url.path.rsplit("/", 1)[-1]
    if isinstance(tokens, WorkerTokens):
        record.worker_tokens = dict(tokens.tokens)
    if isinstance(reconciler, WhenTraining) and reconciler.done:
        record.reconcile = reconciler.result
