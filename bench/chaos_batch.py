"""A chaos batch: many scenario runs at once against one local stack, every fault cleared afterwards,
and the figures that say whether anything leaked or was lost.

    batch = run_batch(stack, plan(["api-faults", "oom"]), workdir, tiny_model, concurrency=4, max_steps=6)
    print(batch.figures.block())
    assert batch.figures.leaks_and_losses() == {...all 0...}
"""

from __future__ import annotations

import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any

from bench.chaos_checks import adapter_changes_the_model, artifact_problems, check_run, live_training_processes, read_back
from bench.chaos_lib import WORKER_EXIT_WAIT_S, Localpod, PrefectApi, RunRecord, own_token, runpod_api, wait_for
from bench.chaos_run import run_scenario
from bench.chaos_scenarios import SCENARIOS, Scenario, route
from localpod.models import Account


def plan(kinds: list[str], prefix: str = "ch") -> list[tuple[str, Scenario]]:
    """(run name, scenario) pairs with unique names: no run's endpoint prefix is another's."""
    return [(f"{prefix}{i:02d}-{kind}", SCENARIOS[kind]) for i, kind in enumerate(kinds)]


def noise_rules(probability: float, seed: int) -> list[dict[str, Any]]:
    """Background faults with a seeded probability each: on every control-plane read/write, every status poll and
    every /health and workers reading, a 429, 500 or dropped connection (`probability` in all per route); and, twice
    as often, a status poll answered a second late (a slow RunPod: the commonest fault, harmless alone). `/run` is
    left alone: a failed submit rightly costs an attempt."""
    rules = []
    routes = ("list_endpoints", "get_endpoint", "create_endpoint", "delete_endpoint", "status", "health",
              "list_endpoint_workers")
    for i, route_name in enumerate(routes):
        for j, action in enumerate(("status_429", "status_500", "drop")):
            rules.append(route(route_name, action, probability=probability / 3, seed=seed * 100 + i * 10 + j))
    rules.append(route("status", "hang", hang_s=1, probability=min(2 * probability, 1.0), seed=seed * 100 + 99))
    return rules


@dataclass
class Figures:
    """What a batch did and left behind. Every leak and loss count must be 0."""

    runs: int = 0
    completed: int = 0
    failed_as_expected: int = 0
    not_as_expected: int = 0
    faults_injected: dict[str, int] = field(default_factory=dict)
    """localpod's own count by kind, every rule (the scenarios' and the background noise's)."""
    scenario_faults: int = 0
    """Faults the scenarios injected: their rules' hits, the endpoints deleted behind runs, the too-tight
    reconciles run beside them, the volumes deleted under a warm record, one per run that met an out-of-stock
    pool, and the study and serve processes killed. Background noise is counted apart."""
    noise_faults: int = 0
    scenario_kinds: int = 0
    out_of_stock_pools: list[str] = field(default_factory=list)
    host_killed: str = "none"
    """The worker host killed mid-batch (the team form), the runs it held, and when they were cleaned up."""
    runs_crashed_with_host: int = 0
    attempts_given_up: dict[str, int] = field(default_factory=dict)
    results_adopted: int = 0
    """Runs whose last given-up attempt had stored complete results anyway, adopted instead of retried."""
    endpoints_created: int = 0
    endpoints_leaked: int = 0
    secrets_made: int = 0
    secrets_leaked: int = 0
    """Account secrets made beyond one per distinct Hub token the batch's runs carried."""
    volumes_made: int = 0
    volumes_unaccounted: int = 0
    """Network volumes made by the batch that still exist and no weight-cache record keeps."""
    slots_leaked: int = 0
    workers_leaked: int = 0
    training_processes_leaked: int = 0
    results_lost: int = 0
    adapters_loaded: int = 0
    billed_worker_seconds: float = 0.0
    wall_s: float = 0.0
    run_wall_s: list[float] = field(default_factory=list)

    def leaks_and_losses(self) -> dict[str, int]:
        return {"endpoints_leaked": self.endpoints_leaked, "slots_leaked": self.slots_leaked,
                "secrets_leaked": self.secrets_leaked, "volumes_unaccounted": self.volumes_unaccounted,
                "workers_leaked": self.workers_leaked, "training_processes_leaked": self.training_processes_leaked,
                "results_lost": self.results_lost}

    def block(self) -> str:
        faults = ", ".join(f"{k} {v}" for k, v in self.faults_injected.items() if v) or "none"
        given_up = ", ".join(f"{k} {v}" for k, v in sorted(self.attempts_given_up.items())) or "none"
        walls = sorted(self.run_wall_s) or [0.0]
        return "\n".join([
            "=== chaos figures ===",
            f"faults injected by kind: {faults} (total {sum(self.faults_injected.values())})",
            f"faults by origin:        {self.scenario_faults} by {self.scenario_kinds} scenarios, "
            f"{self.noise_faults} background noise",
            f"pools out of stock:      {', '.join(self.out_of_stock_pools) or 'none'}",
            f"runs:                    {self.runs} (completed {self.completed}, failed as expected "
            f"{self.failed_as_expected}, crashed with their host {self.runs_crashed_with_host}, not as expected "
            f"{self.not_as_expected})",
            f"worker host killed:      {self.host_killed}",
            f"attempts given up:       {given_up}",
            f"results adopted:         {self.results_adopted} (an attempt given up had stored complete results)",
            f"endpoints created:       {self.endpoints_created}",
            f"endpoints leaked:        {self.endpoints_leaked}",
            f"slots leaked:            {self.slots_leaked}",
            f"secrets:                 {self.secrets_made} made, {self.secrets_leaked} leaked (one per distinct token)",
            f"volumes:                 {self.volumes_made} made, {self.volumes_unaccounted} unaccounted (neither "
            "deleted nor kept by a weight-cache record)",
            f"workers leaked:          {self.workers_leaked} (training processes {self.training_processes_leaked})",
            f"results lost:            {self.results_lost}",
            f"adapters loaded (PEFT):  {self.adapters_loaded}",
            f"billed worker seconds:   {self.billed_worker_seconds:.1f}",
            f"wall time:               {self.wall_s:.0f} s (per run: median {median(walls):.0f} s, max {walls[-1]:.0f} s)",
        ])


@dataclass
class Batch:
    records: list[RunRecord]
    figures: Figures

    def record(self, kind: str) -> RunRecord:
        return next(r for r in self.records if r.scenario.kind == kind)

    def report(self) -> str:
        lines = [f"{'run':<24} {'state':<10} {'given up':<28} {'wall':>6}  problems"]
        for r in self.records:
            ended = ",".join(r.retried + [f"{r.adopted_after} (adopted)"] * bool(r.adopted_after)) or "-"
            lines.append(f"{r.name:<24} {r.state_type or '?':<10} {ended:<28} {r.wall_s:>5.0f}s  "
                         f"{'; '.join(p.replace(chr(10), ' ')[:300] for p in r.problems) or 'ok'}")
        return "\n".join(lines)


KILLED_CLEAN_UP_S = 600
"""How long after the batch a killed host's runs' endpoints get to go (the team form's reconcile deployment
deletes them on its first run after their silence threshold)."""


def run_batch(stack, runs: list[tuple[str, Scenario]], workdir: Path, model: Path, *, concurrency: int, max_steps: int,
              load_adapters: int = 2, noise: float = 0.0, seed: int = 1, flows=None, host_kill=None) -> Batch:
    """Run every (name, scenario) as a real train flow, at most `concurrency` at once, then check them.

    `flows` starts each flow (`CliFlows` when None; the team form's `DeploymentFlows`); `host_kill`, a context
    with `kill` and `settle` (the team form's `HostKiller`), kills a worker host while the batch runs.
    Faults are cleared and the stock restored in a `finally`, whatever happened."""
    pod, prefect = Localpod(stack.localpod_url), PrefectApi(stack.prefect_api_url)
    before = pod.account()
    secrets_before = _secret_names(stack)
    pools = sorted({s.out_of_stock for _, s in runs if s.out_of_stock})
    started = time.monotonic()
    try:
        for pool in pools:
            pod.set_stock(pool, available=False)
        for rule in noise_rules(noise, seed) if noise else []:
            pod.add_route_fault(rule)
        with host_kill or nullcontext(), ThreadPoolExecutor(max_workers=concurrency) as pool_of_runs:
            records = list(pool_of_runs.map(
                lambda run: run_scenario(stack, pod, run[1], name=run[0], workdir=workdir, model=model,
                                         max_steps=max_steps, flows=flows), runs))
        faults = pod.faults_by_id()
    finally:
        pod.clear_faults()
        for pool in pools:
            pod.set_stock(pool, available=True)
    if host_kill is not None:
        host_kill.settle(KILLED_CLEAN_UP_S)
        for record in records:
            record.host_killed = host_kill.kill.victim if record.flow_run_id in host_kill.kill.runs else None
    wall_s = time.monotonic() - started
    slots = prefect.slots_in_use()  # read at once: a slot the flows did not give back is a leak, not a delay
    ours = {e.id for e in pod.account().endpoints if any(r.owns(e.name) for r in records)}
    wait_for(lambda: not _live_workers(pod.account(), ours), WORKER_EXIT_WAIT_S)
    wait_for(lambda: not live_training_processes(stack.home), WORKER_EXIT_WAIT_S)
    after = pod.account()

    figures = Figures(runs=len(records), wall_s=wall_s, slots_leaked=slots, out_of_stock_pools=pools,
                      host_killed=host_kill.kill.summary() if host_kill is not None else "none",
                      billed_worker_seconds=after.billed_worker_seconds - before.billed_worker_seconds,
                      run_wall_s=[r.wall_s for r in records])
    figures.faults_injected = {k: v - before.faults_injected.get(k, 0) for k, v in after.faults_injected.items()}
    figures.scenario_faults = sum(faults.get(fid, {}).get("hits", 0) for r in records for fid in r.fault_ids) + sum(
        bool(r.endpoint_deleted) + bool(r.reconcile) + (r.stale_record_cleared is not None)
        + bool(r.scenario.out_of_stock) + bool(r.study is not None and r.study.killed)
        + bool(r.scenario.kill_while_serving and r.serving_reconcile) for r in records)
    figures.noise_faults = sum(f.get("hits", 0) for f in faults.values()) - sum(
        faults.get(fid, {}).get("hits", 0) for r in records for fid in r.fault_ids)
    figures.scenario_kinds = len({r.scenario.kind for r in records if r.scenario.kind != "clean"})
    tokens = {stack.client_env.get("HF_TOKEN")} | {own_token(r.name) for r in records if r.scenario.own_token}
    figures.secrets_made = len(_secret_names(stack) - secrets_before)
    figures.secrets_leaked = max(figures.secrets_made - len(tokens - {None}), 0)
    new_volumes = {v.id for v in after.volumes} - {v.id for v in before.volumes}
    figures.volumes_made = len(new_volumes)
    figures.volumes_unaccounted = len(new_volumes - prefect.recorded_volumes())
    figures.endpoints_created = sum(1 for e in after.endpoints if e.id in ours)
    figures.endpoints_leaked = sum(1 for e in after.live_endpoints if e.id in ours)
    figures.workers_leaked = len(_live_workers(after, ours))
    figures.training_processes_leaked = len(live_training_processes(stack.home))
    given_up: Counter[str] = Counter()
    for record in records:
        read_back(record, prefect, after)
        record.problems = check_run(record, after, faults, max_steps)
        given_up.update(record.retried + [record.adopted_after] * bool(record.adopted_after))
        figures.results_adopted += record.adopted_after is not None
        figures.completed += record.state_type == "COMPLETED"
        figures.failed_as_expected += record.state_type == "FAILED" and record.scenario.expect_state == "FAILED"
        figures.not_as_expected += bool(record.problems)
        figures.runs_crashed_with_host += bool(record.host_killed) and record.state_type == "CRASHED"
        if record.host_killed:
            continue  # its worker may have stored results after its flow died: a Crashed run promises none
        # A result is lost when the store holds it but the run did not complete, or when the run
        # completed without an intact result.
        completed = record.state_type == "COMPLETED" and record.scenario.flow == "train"  # only a run trains
        figures.results_lost += (record.done and not completed) or (completed and bool(artifact_problems(record.run_dir, max_steps)))
    figures.attempts_given_up = dict(given_up)
    # Load the adapters of runs that took the most attempts: resumed and moved runs are the likelier to be broken.
    completed = sorted((r for r in records if r.state_type == "COMPLETED" and r.scenario.flow == "train" and not r.problems),
                       key=lambda r: -len(r.retried))
    for record in completed[:load_adapters]:
        if adapter_changes_the_model(model, record.run_dir / "adapter"):
            figures.adapters_loaded += 1
        else:
            record.problems.append("the stored adapter does not change the model's output")
            figures.results_lost += 1
    return Batch(records, figures)


def _secret_names(stack) -> set[str]:
    with runpod_api(stack) as runpod:
        return {s["name"] for s in runpod.get("/account/secrets").raise_for_status().json()["secrets"]}


def _live_workers(account: Account, endpoint_ids: set[str]) -> list[str]:
    return [w.id for w in account.workers if w.endpoint_id in endpoint_ids and w.ended_at is None]
