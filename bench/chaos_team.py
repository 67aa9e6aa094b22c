"""Chaos on the team setup (`deployments/team_stack.py`): every scenario's flow a deployment run picked up by
one of several Prefect workers (server on PostgreSQL, slot leases in Redis), the reconcile deployment on an
interval as a team runs it, and one worker host SIGKILLed mid-batch with the runs it holds.

    with TeamChaos(home, workers=3, concurrency=8, kill_at_run=16) as chaos:
        batch = run_batch(chaos.team.local, plan(kinds), workdir, model, concurrency=8, max_steps=6,
                          flows=chaos.flows, host_kill=chaos.killer)

A killed host's runs must end Crashed (Prefect's zombie automation: no heartbeat for `ZOMBIE_WITHIN_S`), their
endpoints be deleted (the reconcile deployment: no heartbeat for `SILENT_AFTER_MIN`) and their slots come back
(their leases lapse after `LEASE_S`); the other hosts' runs must end as their scenarios predict.
"""

from __future__ import annotations

import math
import shutil
import threading
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.chaos_lib import (ENDPOINT_LIMIT, HUB_MODEL, BackgroundWatch, PrefectApi, RunRecord, own_token,
                             write_run_file)
from bench.chaos_scenarios import Scenario
from deployments.team_stack import RUN_TOKEN_BLOCK, TeamStack
from tasks.runpod.endpoints import run_hash

LEASE_S = 60
"""The runs' slot lease (LORAFLOW_SLOT_LEASE_SECONDS): the shortest Prefect's server accepts, so that a killed
host's slots come back within the batch."""
ENDPOINT_HEARTBEAT_S = 10
"""LORAFLOW_HEARTBEAT_SECONDS of the runs: the reconcile's silence threshold may then be 3 × the flow heartbeat."""
RECONCILE_S = 30
"""The reconcile deployment's interval."""
SILENT_AFTER_MIN = 3.0
"""The reconcile deployment's silence threshold: twice the least the heartbeats allow (3 × 30 s), because on a
loaded 2-core machine a live run's heartbeat can come late, and a live run's endpoint deleted would be a fault
the batch did not inject."""
FINAL = frozenset({"COMPLETED", "FAILED", "CRASHED", "CANCELLED"})
DEPLOYMENT = "chaos"


def worker_limit(concurrency: int, workers: int) -> int:
    """Flow runs each Prefect worker takes at once: the batch's runs spread over every worker, with room for a
    reconcile run, and after the kill the surviving workers still hold the whole batch."""
    return math.ceil(concurrency / max(workers - 1, 1)) + 1


def default_kill_at(runs: int) -> int:
    """The run whose start makes the kill due: the middle of the batch, when its first runs are ending and later
    ones still start (the kill is mid-batch, not at its start or its tail)."""
    return max(1, runs // 2)


def choose_victim(holdings: dict[str, list[str]]) -> str | None:
    """The worker host to kill: the one holding the most of the batch's running flow runs (the first by name on a
    tie); None while no worker holds one."""
    held = {worker: runs for worker, runs in holdings.items() if runs}
    if not held:
        return None
    return min(held, key=lambda worker: (-len(held[worker]), worker))


@dataclass
class HostKill:
    """What the kill did: the worker host, the batch's runs it held, and when each clean-up step was seen
    (seconds after the kill)."""

    victim: str | None = None
    runs: list[str] = field(default_factory=list)
    killed_at: float | None = None
    times: dict[str, float] = field(default_factory=dict)
    """`crashed`: every killed run Crashed; `endpoints`: none of their endpoints live."""
    ended_first: list[str] = field(default_factory=list)
    """Runs the host held that had reached their own final state by the kill: not killed runs."""
    note: str = ""
    """Why nothing was killed, when nothing was."""

    def summary(self) -> str:
        if self.victim is None:
            return f"none ({self.note})" if self.note else "none"
        seen = ", ".join(f"{step} after {seconds:.0f} s" for step, seconds in self.times.items()) or "no clean-up seen"
        first = f" ({len(self.ended_first)} more had ended just before)" if self.ended_first else ""
        return f"{self.victim} with {len(self.runs)} run(s){first}: {seen}"


def team_run_spec(spec: dict[str, Any], inputs_dir: Path, token_block: str = RUN_TOKEN_BLOCK) -> dict[str, Any]:
    """A train run's spec as the team stack takes it: its token block named (the team member's, unless the run's
    person has one of their own) and its dataset the copy in the stack's inputs folder (the stack requires both)."""
    dataset = spec["dataset"] | {"local_file": str(inputs_dir / Path(spec["dataset"]["local_file"]).name)}
    return spec | {"hub_token_secret": token_block, "dataset": dataset}


def team_serve_spec(spec: dict[str, Any], inputs_dir: Path, token_block: str = RUN_TOKEN_BLOCK) -> dict[str, Any]:
    """A serve's spec as the team stack takes it: its token block named, and each adapter of a local folder served
    from its copy in the stack's inputs folder (copied once; the stack refuses a local path outside it)."""
    adapters = []
    for adapter in spec["serve"]["adapters"]:
        source = Path(adapter["source"])
        if source.is_dir():
            copy = inputs_dir / f"serve-adapter-{source.name}"
            with _COPY_LOCK:
                if not copy.is_dir():
                    shutil.copytree(source, copy)
            adapter = adapter | {"source": str(copy)}
        adapters.append(adapter)
    return spec | {"hub_token_secret": token_block, "serve": spec["serve"] | {"adapters": adapters}}


_COPY_LOCK = threading.Lock()


def own_token_block(run_name: str) -> str:
    """The Secret block a second person saved their own Hub token in (an `own_token` scenario on the team stack,
    where every run names its token block: an `HF_TOKEN` in the job's environment is not what the stack uses)."""
    return f"{run_name}-hf-token"


class DeploymentFlows:
    """Starts each scenario's flow as a team does: a run of the flow's deployment (`train/chaos`, `preload/chaos`,
    `serve/chaos`),
    picked up by whichever Prefect worker polls first; the scenario's environment goes in its job variables."""

    def __init__(self, api_url: str, deployments: dict[str, str], inputs_dir: Path,
                 save_secret: Callable[[str, str], None]):
        self.prefect = PrefectApi(api_url)
        self.save_secret = save_secret
        self.deployments = deployments
        self.inputs_dir = inputs_dir
        self.train_deployment = f"train/{DEPLOYMENT}"
        """What a study's children are runs of (`bench/chaos_study.py`), each naming `token_block`."""
        self.token_block = RUN_TOKEN_BLOCK
        self.started: list[str] = []
        self._lock = threading.Lock()

    def run(self, record: RunRecord, argument: Path | dict[str, Any], env: dict[str, str], timeout_s: float) -> None:
        spec = tomllib.loads(argument.read_text()) if isinstance(argument, Path) else argument
        if record.scenario.flow == "train" and record.scenario.own_token:
            self.save_secret(own_token_block(record.name), own_token(record.name))
            spec = team_run_spec(spec, self.inputs_dir, own_token_block(record.name))
            # On the team stack a person's token reaches a run only through their block: in the flow's env it would
            # be the control plane's own, which LORAFLOW_REQUIRE_RUN_TOKEN refuses to run on.
            env = {name: value for name, value in env.items() if name != "HF_TOKEN"}
        elif record.scenario.flow == "train":
            spec = team_run_spec(spec, self.inputs_dir)
        elif record.scenario.flow == "serve":
            spec = team_serve_spec(spec, self.inputs_dir)
        else:  # a preload sweep names its token block as a run does: the stack requires one
            spec = spec | {"hub_token_secret": RUN_TOKEN_BLOCK}
        # The idempotency key makes a create retried after a lost answer return the same run, not a second one.
        body = {"parameters": {"spec": spec}, "job_variables": {"env": env}, "idempotency_key": record.name}
        created = _retried(lambda: self.prefect.http.post(
            f"/deployments/{self.deployments[record.scenario.flow]}/create_flow_run", json=body))
        record.flow_run_id = created["id"]
        with self._lock:
            self.started.append(record.flow_run_id)
        deadline = time.monotonic() + timeout_s
        state: dict[str, Any] = {}
        while time.monotonic() < deadline:
            state = _retried(lambda: self.prefect.http.get(f"/flow_runs/{record.flow_run_id}"))["state"] or {}
            if state.get("type") in FINAL:
                break
            time.sleep(3)
        record.returncode = 0 if state.get("type") == "COMPLETED" else 1
        record.output = "\n".join(self.prefect.log_messages(record.flow_run_id))
        if state.get("type") not in FINAL:
            record.output += f"\n(the flow run was still {state.get('type')} after {timeout_s:.0f} s)"


class HostKiller(BackgroundWatch):
    """From a thread of its own: once the batch's `kill_at_run`-th flow run has been created, waits for a moment
    when no run of the batch is between a worker's claim and its process, and a worker holds running ones that
    have each sent a heartbeat; SIGKILLs that host with its runs (`choose_victim`), and starts it again, as a host
    that reboots. Then watches the killed runs end Crashed and their endpoints go.

    The two waits are Prefect's limits, not loraflow's: a run claimed (PENDING) by a host that dies stays PENDING,
    and the zombie automation marks Crashed only a run whose heartbeats stopped, so one killed before its first
    heartbeat reached the server stays Running (seen: runs started together on a loaded host sent none in their
    first minute)."""

    def __init__(self, team: TeamStack, flows: DeploymentFlows, kill_at_run: int):
        self.team, self.flows, self.kill_at_run = team, flows, kill_at_run
        self.kill = HostKill()
        self._beating: set[str] = set()
        super().__init__()

    def settle(self, timeout_s: float) -> None:
        """Wait, after the batch, until the killed runs' endpoints are gone (the reconcile deployment deletes them
        on its next run after their silence threshold), for at most `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while self.kill.victim and time.monotonic() < deadline:
            try:
                if self._note_clean_up():
                    return
            except httpx.HTTPError:
                pass
            time.sleep(2)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self.kill.victim is None:
                    self._maybe_kill()
                elif self._note_clean_up():
                    return
            except httpx.HTTPError:
                pass  # a busy server: the next look tries again
            self._stop.wait(1)
        if self.kill.victim is None:
            self.kill.note = (f"the batch started fewer than {self.kill_at_run} runs" if len(self.flows.started)
                              < self.kill_at_run else "no worker held a running run of the batch when one was due")

    def _maybe_kill(self) -> None:
        with self.flows._lock:
            started = list(self.flows.started)
        if len(started) < self.kill_at_run:
            return
        runs = self._runs(started)
        if any(r["state"]["type"] == "PENDING" for r in runs.values()):
            return
        holdings: dict[str, list[str]] = {}
        for run_id, run in runs.items():
            if run["state"]["type"] == "RUNNING" and (worker := self.team.worker_of(run)):
                holdings.setdefault(worker, []).append(run_id)
        beating = self._sent_heartbeats([r for held in holdings.values() for r in held])
        victim = choose_victim({w: held for w, held in holdings.items() if set(held) <= beating})
        if victim is None:
            return
        self.team.kill_worker(victim)
        killed_at = time.monotonic()
        # A run read as RUNNING above may have set its own final state since: it ended before the kill, and is judged
        # by its scenario. After the SIGKILL only the server changes a run's state (the zombie automation: Crashed).
        ended = {run_id for run_id, run in self._runs(holdings[victim]).items()
                 if run["state"]["type"] in FINAL - {"CRASHED"}}
        self.kill = HostKill(victim, sorted(set(holdings[victim]) - ended), killed_at, ended_first=sorted(ended))
        print(f"chaos: killed worker host {victim} with {len(self.kill.runs)} run(s) of the batch"
              + (f" ({len(ended)} more had just ended)" if ended else ""), flush=True)
        self.team.start_worker(victim)

    def _note_clean_up(self) -> bool:
        """Note the clean-up steps seen so far; True once all are."""
        now = time.monotonic() - self.kill.killed_at
        if "crashed" not in self.kill.times and {r["state"]["type"] for r in self._runs(self.kill.runs).values()} == {
                "CRASHED"}:
            self.kill.times["crashed"] = now
        if "endpoints" not in self.kill.times:
            account = httpx.get(f"{self.team.local.localpod_url}/_localpod/account", timeout=30).raise_for_status().json()
            hashes = {run_hash(r) for r in self.kill.runs}
            if not any(h in e["name"] for e in account["liveEndpoints"] for h in hashes):
                self.kill.times["endpoints"] = now
        return {"crashed", "endpoints"} <= set(self.kill.times)

    def _sent_heartbeats(self, ids: list[str]) -> set[str]:
        """The flow runs among `ids` whose heartbeat has reached the server (one look per run until it has)."""
        for run_id in set(ids) - self._beating:
            found = self.flows.prefect.http.post("/events/filter", json={"filter": {
                "event": {"name": ["prefect.flow-run.heartbeat"]}, "resource": {"id": [f"prefect.flow-run.{run_id}"]}},
                "limit": 1}).raise_for_status().json()
            if found["events"]:
                self._beating.add(run_id)
        return self._beating & set(ids)

    def _runs(self, ids: list[str]) -> dict[str, dict[str, Any]]:
        found = self.flows.prefect.http.post("/flow_runs/filter", json={"flow_runs": {"id": {"any_": ids}}})
        return {r["id"]: r for r in found.raise_for_status().json()}


class TeamChaos:
    """The team stack a chaos batch runs on: `workers` Prefect workers, the `runpod-endpoints` limit at
    `slots`, the train, preload and serve deployments the scenarios' runs come from, the reconcile deployment on its
    interval, and (with `kill_at_run`) the host killer."""

    def __init__(self, home: Path, *, workers: int, concurrency: int, slots: int, model: Path, store: Path,
                 kill_at_run: int | None):
        self.team = TeamStack(home, workers=workers, worker_limit=worker_limit(concurrency, workers),
                              worker_quota=slots + 2, with_hub=True,
                              worker_env={"LORAFLOW_SLOT_LEASE_SECONDS": str(LEASE_S),
                                          "LORAFLOW_HEARTBEAT_SECONDS": str(ENDPOINT_HEARTBEAT_S)})
        self.slots, self.model, self.store, self.kill_at_run = slots, model, store, kill_at_run
        self.flows: DeploymentFlows | None = None
        self.killer: HostKiller | None = None

    def __enter__(self) -> TeamChaos:
        team = self.team.__enter__()
        try:
            api = team.local.prefect_api_url
            httpx.post(f"{api}/v2/concurrency_limits/", json={"name": ENDPOINT_LIMIT, "limit": self.slots},
                       timeout=30).raise_for_status()
            # Each run passes its whole spec; the deployments' defaults are only what `prefect deploy` asks for.
            self.store.mkdir(parents=True, exist_ok=True)
            default_train = tomllib.loads(write_run_file(
                self.store / "default.toml", Scenario("default", "the deployment's default, never run"),
                name="chaos-default", model=self.model, store=self.store, max_steps=1).read_text())
            default_preload = {"models": [{"id": HUB_MODEL}], "data_centers": ["US-CA-2"],
                               "hub_token_secret": RUN_TOKEN_BLOCK}
            default_serve = {"name": "chaos-default", "hub_token_secret": RUN_TOKEN_BLOCK, "serve": {
                "base_model": str(self.model), "adapters": [{"source": HUB_MODEL}], "hours": 1, "budget_usd": 1}}
            self.flows = DeploymentFlows(api, {
                "train": team.deploy("flows/train.py:train", DEPLOYMENT,
                                     {"spec": team_run_spec(default_train, team.inputs_dir)}),
                "preload": team.deploy("flows/preload.py:preload", DEPLOYMENT, {"spec": default_preload}),
                "serve": team.deploy("flows/serve.py:serve", DEPLOYMENT, {"spec": default_serve}),
            }, team.inputs_dir, team.save_secret)
            team.deploy("flows/reconcile.py:reconcile", DEPLOYMENT, {"policy": {"silent_after_minutes": SILENT_AFTER_MIN}},
                        "--interval", str(RECONCILE_S), "--concurrency-limit", "1", "--collision-strategy", "CANCEL_NEW")
            if self.kill_at_run:
                self.killer = HostKiller(team, self.flows, self.kill_at_run)
        except BaseException:
            self.team.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.team.__exit__(*exc)


def _retried(call, tries: int = 5) -> dict[str, Any]:
    """A Prefect API call's JSON, asked again on a transport error or a 5xx (a busy server under the batch)."""
    for attempt in range(tries):
        try:
            response = call()
            if response.status_code < 500 or attempt == tries - 1:
                return response.raise_for_status().json()
        except httpx.TransportError:
            if attempt == tries - 1:
                raise
        time.sleep(2 * (attempt + 1))
    raise AssertionError("unreachable")
