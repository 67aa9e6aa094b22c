"""Studies on the team setup: many children through several workers with a worker host killed, and what pruning saves.

    .venv/bin/python bench/study.py                          # 100 hold-job children, then the pruning grid twice
    .venv/bin/python bench/study.py --children 12            # a small version (~10 minutes on 2 cores)
    .venv/bin/python bench/study.py --children 12 --search   # the children picked by Optuna, stored in PostgreSQL
    .venv/bin/python bench/study.py --skip-scale --steps 2400 --json study.json

Both parts run on the team stack (`deployments/team_stack.py`: Prefect on PostgreSQL, slot leases in Redis, 3
`prefect worker start` processes, the `runpod-endpoints` limit at 5, the reconcile deployment every 30 s), each
study started as a user starts one (`python -m flows.study RUN_FILE`), its children runs of a `train` deployment.

1. **Scale**: a study of `--children` children (a grid of seeds; with `--search`, a TPE search of as many trials over
   the seed, its Optuna study in a database of the team's PostgreSQL), 5 at a time, on localpod's hold jobs (each
   holds its worker `--hold` seconds and trains nothing: the control plane is what is measured). Once half the
   children have started, the worker host holding the most running children is SIGKILLed with them and started
   again (`bench/chaos_team.py`'s `HostKiller`). Checked: the study completes with one row per child; localpod ran
   at most one job per child (none trained twice) and one per child whose run got as far as its job; the children
   ran on at least 2 workers (Prefect's `prefect.worker.submitted-flow-run` events say which).
2. **Pruning**: one grid of the tiny model, learning rates 1e-7 / 1e-5 / 5e-3 (two that leave the model where it
   started, one that learns it), `--steps` steps, evaluated every `--every` steps, 3 at a time, run twice: without
   and with `prune = { rule = "median", after_evals = 2, startup_children = 0 }` (side by side, no child completes
   before the others are judged). Printed: each study's billed worker seconds at localpod
   (worker process lifetimes, what RunPod would bill), its cost as loraflow counted it, its best child, and the
   ratios of the two.

The exit status is 1 when a check fails: a child without a row, a child trained twice, the children on one worker,
the two studies naming different best children, or the pruned study not billed less than the unpruned one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from bench.chaos_lib import DATASET, Localpod, PrefectApi  # noqa: E402
from bench.chaos_team import (  # noqa: E402
    ENDPOINT_HEARTBEAT_S,
    LEASE_S,
    RECONCILE_S,
    SILENT_AFTER_MIN,
    HostKiller,
    default_kill_at,
    worker_limit,
)
from bench.scale_lib import REPO, hold_env, hold_model, set_endpoint_limit, write_json  # noqa: E402
from deployments.local_stack import build_tiny_model  # noqa: E402
from deployments.team_stack import PG_USER, RUN_TOKEN_BLOCK, TeamStack, postgres_bin  # noqa: E402

QUOTA = 5
"""The `runpod-endpoints` limit, and the studies' `parallel`."""
WORKERS = 3
DEPLOYMENT = "study-bench"
LEARNING_RATES = (1e-7, 1e-5, 5e-3)
"""The pruning grid: two rates that leave the tiny model where it started (losers after two evaluations), one that
learns it (the best child)."""
FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


@dataclass
class StudyOutcome:
    """What one study did, read back from Prefect and localpod."""

    name: str
    code: int | None
    wall_s: float
    study_run_id: str | None = None
    states: dict[str, int] = field(default_factory=dict)
    rows: int = 0
    best: str | None = None
    cost_usd: float | None = None
    billed_s: float = 0.0
    jobs_by_child: dict[str, int] = field(default_factory=dict)
    children_by_worker: dict[str, int] = field(default_factory=dict)
    pruned_steps: list[int] = field(default_factory=list)
    child_costs: dict[str, float | None] = field(default_factory=dict)
    trials: dict[str, int] = field(default_factory=dict)
    output_tail: str = ""


def team_stack(home: Path, *, hold_s: float | None) -> TeamStack:
    """The team stack both parts run on: 3 workers that hold the studies' 5 children and a reconcile run after a
    host dies, short leases and heartbeats (a killed host's slots and endpoints come back within the study)."""
    return TeamStack(home, workers=WORKERS, worker_limit=worker_limit(QUOTA, WORKERS), worker_quota=QUOTA + 2,
                     runpod_worker_env=hold_env(hold_s) if hold_s is not None else {},
                     worker_env={"LORAFLOW_SLOT_LEASE_SECONDS": str(LEASE_S),
                                 "LORAFLOW_HEARTBEAT_SECONDS": str(ENDPOINT_HEARTBEAT_S)})


def deploy(team: TeamStack, spec: dict[str, Any]) -> None:
    """`train/study-bench` (the children's deployment; each child passes its whole spec) and the reconcile deployment
    on its interval, as a team runs it."""
    set_endpoint_limit(team.local.prefect_api_url, QUOTA)
    team.deploy("flows/train.py:train", DEPLOYMENT, {"spec": spec})
    team.deploy("flows/reconcile.py:reconcile", DEPLOYMENT, {"policy": {"silent_after_minutes": SILENT_AFTER_MIN}},
                "--interval", str(RECONCILE_S), "--concurrency-limit", "1", "--collision-strategy", "CANCEL_NEW")


def run_spec(team: TeamStack, name: str, model: Path, store: Path, *, max_steps: int,
             evaluation: str = "") -> str:
    """A run file's text for the study's children: the team stack requires a token of one's own and the dataset
    inside its inputs folder."""
    return f'''name = "{name}"
artifact_store = "file://{store}"
deadline_minutes = 30
hub_token_secret = "{RUN_TOKEN_BLOCK}"
[model]
id = "{model}"
[dataset]
local_file = "{team.input_file(DATASET)}"
[lora]
rank = 8
alpha = 16
[training]
learning_rate = 5e-3
max_steps = {max_steps}
batch_size = 8
max_seq_length = 128
seed = 7
[compute]
gpu = ["RTX 4090"]
[attempts]
max_attempts = 1
queue_minutes = 30
{evaluation}'''


def create_database(team: TeamStack, name: str) -> str:
    """A database of its own on the team's PostgreSQL (the Optuna storage a team sets in LORAFLOW_OPTUNA_STORAGE),
    made when missing; its SQLAlchemy URL with the synchronous driver Optuna's storage needs."""
    host, _, port = team.database_url.rpartition("@")[2].partition("/")[0].partition(":")
    created = subprocess.run([str(postgres_bin("createdb")), "-h", host, "-p", port, "-U", PG_USER, name],
                             capture_output=True, text=True)
    if created.returncode != 0 and "already exists" not in created.stderr:
        raise RuntimeError(f"createdb {name} failed: {created.stderr}")
    return f"postgresql+psycopg://{PG_USER}@{host}:{port}/{name}"


class StudyChildren:
    """A study's children as `HostKiller` reads a batch (`started`, `_lock`, `prefect`): the flow runs tagged with
    the study's flow run, once it has printed its id."""

    def __init__(self, api_url: str):
        self.prefect = PrefectApi(api_url)
        self._lock = threading.Lock()
        self.study_run_id: str | None = None

    @property
    def started(self) -> list[str]:
        if self.study_run_id is None:
            return []
        return [r["id"] for r in children_of(self.prefect, self.study_run_id)]


def children_of(prefect: PrefectApi, study_run_id: str) -> list[dict[str, Any]]:
    runs: list[dict[str, Any]] = []
    while True:
        page = prefect.http.post("/flow_runs/filter", json={
            "flow_runs": {"tags": {"all_": [f"study-run:{study_run_id}"]}}, "offset": len(runs), "limit": 200,
        }).raise_for_status().json()
        runs += page
        if len(page) < 200:
            return runs


def run_study(team: TeamStack, run_file: Path, timeout_s: float, children: StudyChildren | None = None,
              env: dict[str, str] | None = None) -> tuple[int | None, str, str | None, float]:
    """`python -m flows.study RUN_FILE` as a user starts it (its own process group); its exit status (None: killed
    at the timeout), output, flow run id and wall time."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "RUNPOD_", "HF_"))}
    log = run_file.with_suffix(".log")
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "flows.study", str(run_file)], cwd=REPO,
                            env=base | team.client_env | (env or {}), stdout=log.open("w"),
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    study_run_id, code = None, None
    while time.monotonic() - started < timeout_s:
        if study_run_id is None and "study flow run " in (text := log.read_text(errors="replace")):
            study_run_id = text.split("study flow run ", 1)[1][:36]
            if children is not None:
                children.study_run_id = study_run_id
        if (code := proc.poll()) is not None:
            break
        time.sleep(2)
    if code is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    return code, log.read_text(errors="replace"), study_run_id, time.monotonic() - started


def read_outcome(team: TeamStack, name: str, code: int | None, output: str, study_run_id: str | None,
                 wall_s: float) -> StudyOutcome:
    """The study's states, best child and cost (its `loraflow.study.finished`), its children's jobs and billed worker
    seconds at localpod, and which worker ran each child."""
    api = team.local.prefect_api_url
    prefect = PrefectApi(api)
    outcome = StudyOutcome(name, code, wall_s, study_run_id, output_tail="\n".join(output.splitlines()[-30:]))
    if study_run_id is None:
        return outcome
    for _ in range(30):  # the server stores events in batches
        found = prefect.http.post("/events/filter", json={"filter": {
            "event": {"name": ["loraflow.study.finished"]}, "resource": {"id": [f"loraflow.study.{study_run_id}"]}},
            "limit": 1}).raise_for_status().json()["events"]
        if found:
            payload = found[0]["payload"]
            outcome.states, outcome.rows = payload["states"], payload["children"]
            outcome.best = (payload.get("best") or {}).get("name")
            outcome.cost_usd = payload["cost_usd"]
            break
        time.sleep(2)
    account = Localpod(team.local.localpod_url).account()
    prefix = f"loraflow-{name}-"
    endpoints = {e.id: e.name for e in account.endpoints if e.name.startswith(prefix)}
    now = time.time()
    outcome.billed_s = round(sum(((w.ended_at.timestamp() if w.ended_at else now) - w.started_at.timestamp())
                                 for w in account.workers if w.endpoint_id in endpoints), 1)
    # An endpoint's name is `loraflow-<run name>-<hash>-<suffix>-a<attempt>`: the child is the run name.
    outcome.jobs_by_child = dict(Counter(endpoints[j.endpoint_id][len("loraflow-"):].rsplit("-", 3)[0]
                                         for j in account.jobs if j.endpoint_id in endpoints))
    table = prefect.http.post("/artifacts/filter", json={"artifacts": {"key": {"any_": [f"study-{name}-table"]}},
                                                         "sort": "CREATED_DESC", "limit": 1}).raise_for_status().json()
    if table:  # its first page: the best 50 children
        outcome.child_costs = {row["child"].removesuffix(" (best)"): row["cost (USD)"] if row["cost (USD)"] != ""
                               else None for row in json.loads(table[0]["data"])}
    runs = children_of(prefect, study_run_id)
    ids = {r["id"] for r in runs}
    outcome.pruned_steps = sorted(int(t.split(":")[1]) for r in runs for t in r["tags"]
                                  if t.startswith("study-pruned:"))
    outcome.children_by_worker = dict(Counter(worker for run_id, worker in submitted_by(prefect).items()
                                              if run_id in ids))
    return outcome


def submitted_by(prefect: PrefectApi) -> dict[str, str]:
    """Flow run id → the Prefect worker that submitted it (its `prefect.worker.submitted-flow-run` events)."""
    found: dict[str, str] = {}
    page = prefect.http.post("/events/filter", json={"filter": {
        "event": {"name": ["prefect.worker.submitted-flow-run"]}}, "limit": 50}).raise_for_status().json()
    while True:
        for event in page["events"]:
            worker = event["resource"].get("prefect.resource.name") or event["resource"]["prefect.resource.id"]
            for related in event.get("related", []):
                if related.get("prefect.resource.role") == "flow-run":
                    found[related["prefect.resource.id"].removeprefix("prefect.flow-run.")] = worker
        if not page.get("next_page"):
            return found
        page = prefect.http.get(page["next_page"]).raise_for_status().json()


def scale(root: Path, children: int, hold_s: float, search: bool) -> tuple[StudyOutcome, str]:
    """Part 1: `children` hold-job children, 5 at a time, a worker host killed once half have started."""
    with team_stack(root / "scale", hold_s=hold_s) as team:
        model = hold_model(root)
        store = root / "scale-store"
        name = "bench-scale"
        spec_text = run_spec(team, name, model, store, max_steps=4)
        deploy(team, tomllib.loads(spec_text))
        env = {}
        if search:
            env["LORAFLOW_OPTUNA_STORAGE"] = create_database(team, "optuna")
            section = (f'search = "tpe"\ntrials = {children}\n'
                       'space = { "training.seed" = { low = 1, high = 1000000 } }\n')
        else:
            section = f'grid = {{ "training.seed" = [{", ".join(str(s) for s in range(1, children + 1))}] }}\n'
        run_file = root / "scale.toml"
        run_file.write_text(spec_text + f'[study]\n{section}parallel = {QUOTA}\nmetric = "train_loss"\n'
                            f'deployment = "train/{DEPLOYMENT}"\n')
        watched = StudyChildren(team.local.prefect_api_url)
        killer = HostKiller(team, watched, default_kill_at(children))
        with killer:
            code, output, study_run_id, wall_s = run_study(team, run_file, timeout_s=600 + children * 60,
                                                          children=watched, env=env)
            killer.settle(240)
        outcome = read_outcome(team, name, code, output, study_run_id, wall_s)
        if search and study_run_id is not None:  # the Optuna study, read back from the team's PostgreSQL
            stored = optuna.load_study(study_name=f"{name}-{study_run_id}", storage=env["LORAFLOW_OPTUNA_STORAGE"])
            outcome.trials = dict(Counter(t.state.name for t in stored.get_trials()))
        return outcome, killer.kill.summary()


def pruning(root: Path, steps: int, every: int) -> tuple[StudyOutcome, StudyOutcome]:
    """Part 2: the learning-rate grid of the tiny model, without and with `prune`, one after the other."""
    with team_stack(root / "prune", hold_s=None) as team:
        model = root / "tiny-model"
        if not (model / "config.json").exists():
            build_tiny_model(model)
        evaluation = f"[evaluation]\nfraction = 0.2\nevery_steps = {every}\n"
        deploy(team, tomllib.loads(run_spec(team, "bench-default", model, root / "prune-store", max_steps=1,
                                            evaluation=evaluation)))
        outcomes = []
        pruned = 'prune = { rule = "median", after_evals = 2, startup_children = 0 }\n'
        for name, prune in (("bench-unpruned", ""), ("bench-pruned", pruned)):
            run_file = root / f"{name}.toml"
            rates = ", ".join(map(str, LEARNING_RATES))
            store = root / "prune-store"
            run_file.write_text(run_spec(team, name, model, store, max_steps=steps, evaluation=evaluation)
                                + f'[study]\ngrid = {{ "training.learning_rate" = [{rates}] }}\n'
                                f'parallel = {len(LEARNING_RATES)}\ndeployment = "train/{DEPLOYMENT}"\n{prune}')
            code, output, study_run_id, wall_s = run_study(team, run_file, timeout_s=900 + steps)
            outcomes.append(read_outcome(team, name, code, output, study_run_id, wall_s))
        return outcomes[0], outcomes[1]


def print_scale(outcome: StudyOutcome, children: int, kill: str, search: bool) -> list[str]:
    jobs = sum(outcome.jobs_by_child.values())
    twice = sorted(child for child, n in outcome.jobs_by_child.items() if n > 1)
    print(f"\n=== a study of {children} deployment children{' (TPE search, Optuna on PostgreSQL)' if search else ''}, "
          f"{QUOTA} at a time, {WORKERS} workers, a host killed ===")
    print(f"study:                 exit {outcome.code}, {outcome.wall_s:.0f} s, {outcome.rows} rows: "
          + ", ".join(f"{n} {state}" for state, n in outcome.states.items()))
    print(f"worker host killed:    {kill}")
    print(f"localpod jobs:         {jobs} for {len(outcome.jobs_by_child)} children; trained twice: {len(twice)}"
          f"{' ' + ', '.join(twice) if twice else ''}")
    print("children by worker:    " + ", ".join(f"{w} {n}" for w, n in sorted(outcome.children_by_worker.items())))
    if search:
        print("Optuna trials:         " + ", ".join(f"{n} {state}" for state, n in sorted(outcome.trials.items())))
    problems = []
    if outcome.code is None or outcome.rows != children:
        problems.append(f"the study ended with {outcome.rows} rows of {children} (exit {outcome.code})")
    if twice:
        problems.append(f"children trained twice: {twice}")
    if search and sum(outcome.trials.values()) != children:
        problems.append(f"the Optuna study holds {sum(outcome.trials.values())} trials, not {children}")
    if len(outcome.children_by_worker) < 2:
        problems.append(f"the children ran on {len(outcome.children_by_worker)} worker(s)")
    return problems


def print_pruning(unpruned: StudyOutcome, pruned: StudyOutcome, steps: int, every: int) -> list[str]:
    print(f"\n=== one grid twice: learning rate {' / '.join(map(str, LEARNING_RATES))}, {steps} steps, evaluated every "
          f"{every}, {len(LEARNING_RATES)} at a time ===")
    print(f"{'study':<15}{'children':<30}{'billed s':>9}{'cost USD':>10}{'wall s':>8}  best child")
    for o in (unpruned, pruned):
        states = ", ".join(f"{n} {s}" for s, n in o.states.items())
        print(f"{o.name:<15}{states:<30}{o.billed_s:>9.1f}{o.cost_usd or 0:>10.4f}{o.wall_s:>8.0f}  {o.best}")
    if pruned.pruned_steps:
        print(f"pruned at steps:       {', '.join(map(str, pruned.pruned_steps))} (of {steps})")
    for o in (unpruned, pruned):
        print(f"{o.name} by child: ".ljust(23) + ", ".join(f"{child.removeprefix(o.name + '-')} ${cost}"
                                                          for child, cost in sorted(o.child_costs.items())))
    ratio = pruned.billed_s / unpruned.billed_s if unpruned.billed_s else float("nan")
    cost_ratio = (pruned.cost_usd or 0) / unpruned.cost_usd if unpruned.cost_usd else float("nan")
    same = pruned.best is not None and pruned.best.removeprefix("bench-pruned") == (unpruned.best or "").removeprefix(
        "bench-unpruned")
    print(f"pruned vs unpruned:    billed x{ratio:.2f}, cost x{cost_ratio:.2f}, same best child: "
          f"{'yes' if same else 'no'}")
    problems = []
    if not same:
        problems.append(f"the best children differ: {unpruned.best} and {pruned.best}")
    if not ratio < 1:
        problems.append(f"the pruned study billed {pruned.billed_s:.0f} s, the unpruned {unpruned.billed_s:.0f} s")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--children", type=int, default=100, help="children of the scale study (default 100)")
    parser.add_argument("--hold", type=float, default=30.0, help="seconds each hold job holds its worker: long "
                        "enough that the host killed holds running children that have sent a heartbeat")
    parser.add_argument("--search", action="store_true", help="the scale study as a TPE search of as many trials, "
                        "its Optuna study in a database of the team's PostgreSQL")
    parser.add_argument("--steps", type=int, default=3000, help="training steps of the pruning grid's children (the "
                        "tiny model trains ~20 a second alone on 2 cores: training, not the workers' boot, dominates)")
    parser.add_argument("--every", type=int, default=40, help="evaluation.every_steps of the pruning grid")
    parser.add_argument("--skip-scale", action="store_true")
    parser.add_argument("--skip-prune", action="store_true")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--keep", action="store_true", help="keep the folder (the stacks' logs, the studies' logs)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="loraflow-bench-study-"))
    print(f"bench folder: {root}", flush=True)
    problems: list[str] = []
    figures: dict[str, Any] = {}
    try:
        if not args.skip_scale:
            outcome, kill = scale(root, args.children, args.hold, args.search)
            problems += print_scale(outcome, args.children, kill, args.search)
            figures["scale"] = outcome.__dict__ | {"kill": kill}
        if not args.skip_prune:
            unpruned, pruned = pruning(root, args.steps, args.every)
            problems += print_pruning(unpruned, pruned, args.steps, args.every)
            figures["pruning"] = {"unpruned": unpruned.__dict__, "pruned": pruned.__dict__}
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    write_json(args.json, figures)
    for problem in problems:
        print(f"PROBLEM: {problem}")
    if problems:  # the folder is temporary: the studies' own words go with the problems
        for part in figures.values():
            for outcome in part.values() if "name" not in part else [part]:
                print(f"--- the end of {outcome['name']}'s output:\n{outcome['output_tail']}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
