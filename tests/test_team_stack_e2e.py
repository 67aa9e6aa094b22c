"""The team setup, end to end (`deployments/team_stack.py`): a Prefect server on PostgreSQL, slot leases in
Redis, three `prefect worker start` processes on one process pool, deployment runs of the train flow, and
the reconcile deployment on a short interval, all against one `runpod-endpoints` limit of 3.

One stack, one timeline of three scenarios, each read by the tests that follow it:

1. A worker SIGKILLed mid-run with its runs (its host dies): its runs' endpoints are deleted by the reconcile
   deployment and their slots freed within the lease + one reconcile interval, while the other workers' runs
   train on; cancelled, those delete their endpoints and give their slots back; the dead worker's runs end
   Crashed (Prefect's zombie automation, after 3 minutes without a heartbeat), and no live run ever does. That
   last wait is the scenario's longest and needs nothing else of the stack, so it is watched in the background
   while scenario 2 runs (whose 12 live runs the automation must leave alone too), and checked after it.
2. 12 runs through 3 workers: never more than 3 endpoints alive, all complete.
3. The server restarted mid-run, a fourth run waiting for a slot: never more than 3 endpoints (no lease lapsed),
   the runs complete, no slot leaks.

(They used to be three tests run one after another, the kill test waiting out the zombie threshold alone.)
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
import tomllib
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import pytest

from bench.scale_lib import process_usage
from deployments.team_stack import (
    HEARTBEAT_S,
    LONGEST_RESTART_S,
    RUN_TOKEN_BLOCK,
    SLOT_LEASE_S,
    ZOMBIE_WITHIN_S,
    TeamStack,
    children,
    descendants,
)
from tasks.runpod.endpoints import parse_endpoint_name, run_hash
from tests.conftest import DATASET, localpod_account, prefect_api
from tests.test_crash_recovery_e2e import wait_for
from tests.test_train_e2e import write_run_file

pytestmark = pytest.mark.timeout(1800)

LIMIT = 3
WORKERS = 3
WORKER_LIMIT = 2
"""Runs each worker starts at once: 3 workers then hold 6 runs for 3 slots (the quota, not the workers, is
what holds runs back), and any 3 runs are spread over at least 2 workers (the kill test needs that)."""
LEASE_S = 60
"""The slot lease of the first two tests' runs: the shortest Prefect's server accepts, so that a dead worker's
slots come back within the test (the restart test uses the team setup's own, SLOT_LEASE_S)."""
RECONCILE_S = 30
SILENT_AFTER_MIN = 3 * HEARTBEAT_S / 60
"""The reconcile deployment's silence threshold: the least its heartbeats allow, 3 × the longer of them (30 s flow,
10 s endpoint); a shorter one is refused."""
FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


@pytest.fixture(scope="module")
def team(tmp_path_factory, tiny_model):
    home = tmp_path_factory.mktemp("team")
    with TeamStack(home, workers=WORKERS, worker_limit=WORKER_LIMIT,
                   worker_env={"LORAFLOW_SLOT_LEASE_SECONDS": str(LEASE_S), "LORAFLOW_HEARTBEAT_SECONDS": "10"}) as team:
        prefect_api(team.local, "POST", "/v2/concurrency_limits/", json={"name": "runpod-endpoints", "limit": LIMIT})
        # The stack requires a token of one's own and the run's files inside its inputs folder.
        spec = tomllib.loads(write_run_file(home / "deployment.toml", name="team", model=tiny_model,
                                            store=home / "store", max_steps=3,
                                            dataset=team.input_file(DATASET)).read_text()) | {
            "hub_token_secret": RUN_TOKEN_BLOCK}
        team.deploy("flows/train.py:train", "team-e2e", {"spec": spec})
        team.deploy("flows/reconcile.py:reconcile", "team-interval",
               {"policy": {"silent_after_minutes": SILENT_AFTER_MIN, "min_age_minutes": 0}},
               "--interval", str(RECONCILE_S), "--concurrency-limit", "1", "--collision-strategy", "CANCEL_NEW")
        yield team


def test_the_zombie_threshold_spans_three_heartbeats_and_outlasts_the_longest_restart():
    # A restart silences a run for its length plus up to one interval (the beat sent just before it went down).
    assert ZOMBIE_WITHIN_S >= 3 * HEARTBEAT_S
    assert ZOMBIE_WITHIN_S >= LONGEST_RESTART_S + HEARTBEAT_S + 30


def start_runs(team: TeamStack, count: int, env: dict[str, str] | None = None, **params) -> list[str]:
    """`count` runs of `train/team-e2e` with `params`; `env` on top of the worker's for their processes."""
    deployment = prefect_api(team.local, "GET", "/deployments/name/train/team-e2e").json()
    body = {"parameters": params, "job_variables": {"env": env or {}}}
    return [prefect_api(team.local, "POST", f"/deployments/{deployment['id']}/create_flow_run", json=body).json()["id"]
            for _ in range(count)]


def runs(team: TeamStack, ids: list[str]) -> dict[str, dict]:
    found = prefect_api(team.local, "POST", "/flow_runs/filter", json={"flow_runs": {"id": {"any_": ids}}}).json()
    return {r["id"]: r for r in found}


def states(team: TeamStack, ids: list[str]) -> dict[str, str]:
    return {i: r["state"]["type"] for i, r in runs(team, ids).items()}


def endpoints(team: TeamStack, name: str) -> list[dict]:
    return [e for e in localpod_account(team.local)["endpoints"] if e["name"].startswith(f"loraflow-{name}-")]


def peak_alive(endpoints: list[dict]) -> int:
    """Most endpoints alive at one instant, from their creation and deletion times (localpod's clock)."""
    events = []
    for e in endpoints:
        events.append((datetime.fromisoformat(e["createdAt"].replace("Z", "+00:00")), 1))
        if e["deletedAt"]:
            events.append((datetime.fromisoformat(e["deletedAt"].replace("Z", "+00:00")), -1))
    alive = peak = 0
    for _, step in sorted(events, key=lambda ev: (ev[0], ev[1])):  # a delete before a create at the same instant
        alive += step
        peak = max(peak, alive)
    return peak


def logged(team: TeamStack, run_id: str, text: str) -> bool:
    """Whether the run's logs in Prefect hold `text`."""
    logs = prefect_api(team.local, "POST", "/logs/filter",
                       json={"logs": {"flow_run_id": {"any_": [run_id]}}, "limit": 200}).json()
    return any(text in log["message"] for log in logs)


def slots_in_use(team: TeamStack) -> int:
    return prefect_api(team.local, "GET", "/v2/concurrency_limits/runpod-endpoints").json()["active_slots"]


class RunSampler(threading.Thread):
    """Samples, every second, the processes under each worker: the runs it holds, their memory and CPU time."""

    def __init__(self, team: TeamStack):
        super().__init__(daemon=True)
        self.team, self.stopped = team, threading.Event()
        self.runs: dict[int, dict] = {}  # a flow-run process (a worker's child) → its peak MiB, CPU s, life
        self.most_per_worker = 0
        self.workers_used: set[str] = set()
        self.worker_mib = 0.0

    def run(self) -> None:
        while not self.stopped.wait(1.0):
            for name in list(self.team.worker_names):
                worker_pid = self.team.services[name].process.pid
                runs = children(worker_pid)
                self.most_per_worker = max(self.most_per_worker, len(runs))
                if runs:
                    self.workers_used.add(name)
                self.worker_mib = max(self.worker_mib, process_usage([worker_pid]).rss_mib)
                for run in runs:
                    usage = process_usage([run, *descendants(run)])
                    seen = self.runs.setdefault(run, {"mib": 0.0, "cpu_s": 0.0, "first": time.monotonic()})
                    seen["mib"] = max(seen["mib"], usage.rss_mib)
                    seen["cpu_s"] = max(seen["cpu_s"], usage.cpu_s)
                    seen["last"] = time.monotonic()

    def stop(self) -> None:
        self.stopped.set()
        self.join(10)


KILL_CLEANUP_WITHIN_S = LEASE_S + RECONCILE_S + 240
"""How long, from the kill, the dead worker's runs get to lose their endpoints and slots and to be marked Crashed."""


@dataclass
class Killed:
    """What scenario 1 saw: the worker SIGKILLed, its runs and the others', and when each clean-up step happened
    (seconds after the kill)."""

    victim: str
    killed_runs: list[str]
    survivors: list[str]
    killed_at: float
    times: dict[str, float] = field(default_factory=dict)
    survivor_states: dict[str, str] = field(default_factory=dict)
    survivors_training: bool = False
    survivors_cleaned_up: str = ""
    """Empty once the cancelled survivors' runs ended Cancelled with no endpoint or slot left; else what was not."""
    crash_watch: threading.Thread | None = None

    def watch_crash(self, team: TeamStack) -> None:
        """Until the deadline, note when every killed run has been marked Crashed (from a thread of its own)."""
        def watch() -> None:
            while time.monotonic() < self.killed_at + KILL_CLEANUP_WITHIN_S:
                if {states(team, self.killed_runs).get(r) for r in self.killed_runs} == {"CRASHED"}:
                    self.times["crashed"] = time.monotonic() - self.killed_at
                    return
                time.sleep(1)

        self.crash_watch = threading.Thread(target=watch, daemon=True)
        self.crash_watch.start()


@pytest.fixture(scope="module")
def killed(team) -> Killed:
    """Scenario 1: 3 long runs training, spread over at least 2 workers; the worker holding the most is SIGKILLed
    with its runs; once their endpoints and slots are gone, the other runs are cancelled as a user would and the
    dead worker's host comes back. Whether the dead runs end Crashed is watched in the background."""
    ids = start_runs(team, LIMIT, name="team-kill", max_steps=100_000)

    def all_training():
        seen = runs(team, ids)
        live = {e["id"] for e in endpoints(team, "team-kill") if not e["deletedAt"]}
        training = {j["endpointId"] for j in localpod_account(team.local)["jobs"]
                    if j["endpointId"] in live and j["status"] == "IN_PROGRESS"}
        return len(training) == LIMIT and all(team.worker_of(r) for r in seen.values()) and seen

    seen = wait_for(all_training, 600, "3 runs training", interval_s=2)
    by_worker: dict[str, list[str]] = {}
    for run_id, run in seen.items():
        by_worker.setdefault(team.worker_of(run), []).append(run_id)
    assert len(by_worker) >= 2, by_worker
    victim, killed_runs = max(by_worker.items(), key=lambda item: len(item[1]))
    survivors = [i for i in ids if i not in killed_runs]
    endpoint_of = {run_id: [e for e in endpoints(team, "team-kill")
                            if parse_endpoint_name(e["name"]).run_hash == run_hash(run_id)] for run_id in ids}

    outcome = Killed(victim, killed_runs, survivors, time.monotonic())
    team.kill_worker(victim)
    outcome.watch_crash(team)

    def cleaned_up():
        now = time.monotonic() - outcome.killed_at
        live = {e["id"] for e in localpod_account(team.local)["liveEndpoints"]}
        if "endpoints" not in outcome.times and not any(e["id"] in live for r in killed_runs for e in endpoint_of[r]):
            outcome.times["endpoints"] = now
        if "slots" not in outcome.times and slots_in_use(team) == len(survivors):
            outcome.times["slots"] = now
        return "endpoints" in outcome.times and "slots" in outcome.times

    until(cleaned_up, KILL_CLEANUP_WITHIN_S, interval_s=1)
    # The other workers' runs, as the dead worker's were cleaned up: still running, their endpoints training.
    outcome.survivor_states = states(team, survivors)
    live_jobs = {j["endpointId"] for j in localpod_account(team.local)["jobs"] if j["status"] == "IN_PROGRESS"}
    outcome.survivors_training = all(e["id"] in live_jobs for r in survivors for e in endpoint_of[r])

    # Stop the survivors the way a user would: cancelled runs delete their endpoints and give their slots back.
    for run_id in survivors:
        prefect_api(team.local, "POST", f"/flow_runs/{run_id}/set_state",
                    json={"state": {"type": "CANCELLING"}, "force": True})
    if not until(lambda: set(states(team, survivors).values()) == {"CANCELLED"}, 300):
        outcome.survivors_cleaned_up = f"the survivors did not end Cancelled: {states(team, survivors)}"
    elif not until(lambda: slots_in_use(team) == 0 and not localpod_account(team.local)["liveEndpoints"], 120):
        outcome.survivors_cleaned_up = (f"slots in use {slots_in_use(team)}, live endpoints "
                                        f"{[e['name'] for e in localpod_account(team.local)['liveEndpoints']]}")
    restarted_at = datetime.now(timezone.utc)
    team.start_worker(victim)  # the host comes back
    team.wait_for_workers(WORKERS)
    wait_for(lambda: polled_since(team, victim, restarted_at), 180, f"{victim} to poll again")
    return outcome


def until(condition, timeout_s: float, interval_s: float = 1.0) -> bool:
    """Whether `condition()` became true within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        if condition():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)


def polled_since(team: TeamStack, name: str, since: datetime) -> bool:
    """Whether the worker `name` has sent a heartbeat since `since` (a killed worker's record stays ONLINE a while)."""
    found = prefect_api(team.local, "POST", f"/work_pools/{team.pool}/workers/filter", json={}).json()
    beats = [w["last_heartbeat_time"] for w in found if w["name"] == name and w.get("last_heartbeat_time")]
    return any(datetime.fromisoformat(b.replace("Z", "+00:00")) > since for b in beats)


def test_a_sigkilled_workers_endpoints_are_deleted_by_the_reconcile_deployment_in_time(killed):
    assert "endpoints" in killed.times, f"still live {KILL_CLEANUP_WITHIN_S} s after the kill"
    # + 60 s: a reconcile run's own start (a fresh Python process importing Prefect) on a loaded 2-core machine.
    assert killed.times["endpoints"] <= SILENT_AFTER_MIN * 60 + RECONCILE_S + 60


def test_a_sigkilled_workers_slots_come_back_within_the_lease(killed):
    assert "slots" in killed.times, f"still held {KILL_CLEANUP_WITHIN_S} s after the kill"
    assert killed.times["slots"] <= LEASE_S + RECONCILE_S + 60


def test_the_other_workers_runs_train_on_untouched(killed):
    assert set(killed.survivor_states.values()) == {"RUNNING"}, killed.survivor_states
    assert killed.survivors_training


def test_the_other_workers_runs_cancelled_delete_their_endpoints_and_free_their_slots(killed):
    assert killed.survivors_cleaned_up == ""


def test_twelve_runs_through_three_workers_never_exceed_the_limit_and_all_complete(team, figures):
    sampler = RunSampler(team)
    sampler.start()
    started = time.monotonic()
    ids = start_runs(team, 12, name="team-quota")
    most_alive = 0

    def all_final():
        nonlocal most_alive
        most_alive = max(most_alive, len(localpod_account(team.local)["liveEndpoints"]))
        return set(states(team, ids).values()) <= FINAL

    try:
        wait_for(all_final, 1500, "the 12 runs to end", interval_s=1)
    finally:
        sampler.stop()
    elapsed = time.monotonic() - started
    final = states(team, ids)
    assert list(final.values()) == ["COMPLETED"] * 12, final
    ours = endpoints(team, "team-quota")
    peak = peak_alive(ours)
    figures(f"team stack: 12 runs, limit {LIMIT}, {WORKERS} workers: {len(final)} completed in {elapsed:.0f} s; peak "
            f"endpoints alive {peak} (sampled {most_alive}, localpod's own count "
            f"{localpod_account(team.local)['peakLiveEndpoints']})")
    assert len(ours) == 12 and all(e["deletedAt"] for e in ours)
    assert peak == LIMIT and most_alive <= LIMIT  # the quota was reached and never passed
    assert slots_in_use(team) == 0
    assert len(sampler.workers_used) == WORKERS and sampler.most_per_worker <= WORKER_LIMIT, sampler.workers_used

    per_run = [r for r in sampler.runs.values() if "last" in r and r["last"] - r["first"] > 5]
    run_mib = sum(r["mib"] for r in per_run) / len(per_run)
    cpu_s = sum(r["cpu_s"] for r in per_run) / len(per_run)
    life_s = sum(r["last"] - r["first"] for r in per_run) / len(per_run)
    available_mib = int(Path("/proc/meminfo").read_text().split("MemAvailable:")[1].split()[0]) / 1024
    figures(f"team stack: a worker process {sampler.worker_mib:.0f} MiB; each run it holds {run_mib:.0f} MiB "
            f"and {cpu_s:.1f} CPU s over {life_s:.0f} s ({100 * cpu_s / life_s:.0f}% of a core, mostly starting up); "
            f"this machine ({os.cpu_count()} cores, {available_mib / 1024:.1f} GiB free) holds ~"
            f"{int(0.8 * available_mib / run_mib)} runs by memory, ~{int(0.8 * os.cpu_count() * life_s / cpu_s)} by CPU")


def test_a_sigkilled_workers_runs_end_crashed(team, killed, figures):
    """Scenario 1's last step, awaited while scenario 2 ran: the zombie automation marks the dead runs Crashed."""
    killed.crash_watch.join(max(0.0, killed.killed_at + KILL_CLEANUP_WITHIN_S + 10 - time.monotonic()))
    figures(f"team stack: worker SIGKILLed with {len(killed.killed_runs)} run(s): endpoints deleted after "
            f"{killed.times.get('endpoints', float('nan')):.0f} s, slots freed after "
            f"{killed.times.get('slots', float('nan')):.0f} s, runs Crashed after "
            f"{killed.times.get('crashed', float('nan')):.0f} s (lease {LEASE_S} s, reconcile every {RECONCILE_S} s)")
    assert "crashed" in killed.times, (f"not all Crashed {KILL_CLEANUP_WITHIN_S} s after the kill: "
                                       f"{states(team, killed.killed_runs)}")


def test_the_zombie_automation_crashed_no_live_run(team, killed):
    """While it marked the dead runs Crashed, the other runs of the train deployment (the dead worker's neighbours,
    then the 12 runs of scenario 2) were live: none of them was ever Crashed."""
    killed.crash_watch.join(max(0.0, killed.killed_at + KILL_CLEANUP_WITHIN_S + 10 - time.monotonic()))
    deployment = prefect_api(team.local, "GET", "/deployments/name/train/team-e2e").json()
    found = prefect_api(team.local, "POST", "/flow_runs/filter",
                        json={"deployments": {"id": {"any_": [deployment["id"]]}}}).json()
    others = [r["id"] for r in found if r["id"] not in killed.killed_runs]
    assert set(killed.survivors) <= set(others), others
    assert [r for r in others if "CRASHED" in state_history(team, r)] == []


def state_history(team: TeamStack, run_id: str) -> list[str]:
    return [s["type"] for s in prefect_api(team.local, "GET", "/flow_run_states/", params={"flow_run_id": run_id}).json()]


def test_runs_complete_across_a_server_restart_and_the_quota_holds_through_it(team, figures):
    # The team setup's lease (the other tests shorten it), sized to ride out a restart. One that lapsed would
    # free its slot under a live endpoint and the waiting run would take it: a 4th endpoint.
    env = {"LORAFLOW_SLOT_LEASE_SECONDS": str(SLOT_LEASE_S)}
    holders = start_runs(team, LIMIT, env, name="team-restart", max_steps=150)
    waiter = start_runs(team, 1, env, name="team-restart", max_steps=3)

    def training() -> int:
        live = {e["id"] for e in endpoints(team, "team-restart") if not e["deletedAt"]}
        return len({j["endpointId"] for j in localpod_account(team.local)["jobs"]
                    if j["endpointId"] in live and j["status"] == "IN_PROGRESS"})

    wait_for(lambda: training() == LIMIT, 600, "3 runs training", interval_s=2)
    # The fourth run waits for a slot before the restart. A flow-run process that starts while the server is
    # down ends at once, Crashed: Prefect's client retries a refused connection only once it has connected.
    wait_for(lambda: logged(team, waiter[0], "Attempt 1 on"), 600, "the fourth run to wait for a slot", interval_s=2)
    leases = subprocess.run(["redis-cli", "-u", team.redis_url, "--scan", "--pattern", "prefect:concurrency:lease:*"],
                            capture_output=True, text=True, check=True).stdout.split()
    assert len(leases) >= LIMIT, f"the slot leases are not in Redis: {leases}"
    down_s = team.local.restart_prefect()
    ids = holders + waiter
    wait_for(lambda: set(states(team, ids).values()) <= FINAL, 900, "the runs to end", interval_s=2)
    final = states(team, ids)
    ours = endpoints(team, "team-restart")
    figures(f"team stack: server (PostgreSQL, leases in Redis: {len(leases)}) down {down_s:.0f} s mid-run: "
            f"{list(final.values()).count('COMPLETED')}/{len(ids)} runs completed, peak endpoints {peak_alive(ours)} "
            f"(limit {LIMIT}), slots in use after {slots_in_use(team)} (lease {SLOT_LEASE_S} s)")
    assert down_s < SLOT_LEASE_S / 4, "the restart took longer than the lease can ride out"
    assert down_s + HEARTBEAT_S < ZOMBIE_WITHIN_S, "the restart took longer than the zombie threshold rides out"
    assert list(final.values()) == ["COMPLETED"] * len(ids), final
    assert len(ours) == len(ids) and all(e["deletedAt"] for e in ours) and peak_alive(ours) <= LIMIT
    assert slots_in_use(team) == 0


def test_a_run_that_names_no_token_of_its_own_is_refused_by_the_team_stack_before_renting(team):
    deployment = prefect_api(team.local, "GET", "/deployments/name/train/team-e2e").json()
    spec = {k: v for k, v in deployment["parameters"]["spec"].items() if k != "hub_token_secret"} | {
        "name": "team-notoken"}

    [run_id] = start_runs(team, 1, spec=spec)

    state = wait_for(lambda: (s := runs(team, [run_id])[run_id]["state"])["type"] in FINAL and s, 240, "the run's end")
    assert state["type"] == "FAILED" and "LORAFLOW_REQUIRE_RUN_TOKEN=1" in state["message"], state
    assert endpoints(team, "team-notoken") == []
