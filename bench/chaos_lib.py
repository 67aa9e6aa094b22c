"""The parts a chaos scenario's run (`bench/chaos_run.py`) is built of: its run file, the stack's RunPod and Prefect
seen from outside, the watches that act while it trains, how its flow is started, and the `RunRecord` of what
happened. `bench/chaos_checks.py` judges the record; `bench/chaos_batch.py` runs many at once and counts what leaked
or was lost.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import httpx

from bench.chaos_scenarios import Scenario
from bench.prefect_rest import PrefectServerClient
from localpod.models import Account
from tasks.runpod.endpoints import run_hash
from tasks.placement.weight_cache import VARIABLE_PREFIX, DataCenterCache, WarmModel, variable_name

REPO = Path(__file__).resolve().parent.parent
DATASET = REPO / "deployments" / "data" / "tiny-chat.jsonl"
ENDPOINT_LIMIT = "runpod-endpoints"
WORKER_EXIT_WAIT_S = 60
"""How long deleted endpoints' workers get to exit (localpod: SIGTERM, SIGKILL after its grace)."""

def wait_for(condition, timeout_s: float, interval_s: float = 0.5):
    """The condition's first truthy value, or its last value once `timeout_s` has passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(interval_s)


class Localpod:
    """localpod's fault-injection and account routes (no key: they are not RunPod's API)."""

    def __init__(self, url: str):
        self.http = httpx.Client(base_url=f"{url}/_localpod", timeout=30)

    def add_route_fault(self, rule: dict[str, Any]) -> str:
        return self.http.post("/faults", json=rule).raise_for_status().json()["id"]

    def add_worker_fault(self, rule: dict[str, Any]) -> str:
        return self.http.post("/worker-faults", json=rule).raise_for_status().json()["id"]

    def faults_by_id(self) -> dict[str, dict[str, Any]]:
        rules = self.http.get("/faults").raise_for_status().json() + self.http.get("/worker-faults").raise_for_status().json()
        return {r["id"]: r for r in rules}

    def clear_faults(self) -> None:
        self.http.delete("/faults").raise_for_status()
        self.http.delete("/worker-faults").raise_for_status()

    def set_stock(self, pool: str, available: bool) -> None:
        self.http.post("/stock", json={"pool": pool, "available": available}).raise_for_status()

    def account(self) -> Account:
        return Account.model_validate(self.http.get("/account").raise_for_status().json())


class BackgroundWatch:
    """A watch that runs `_run` in a daemon thread of its own while the `with` block lasts; `_stop` asks it to end
    early. Subclasses call `super().__init__()` and loop on `self._stop`."""

    join_timeout_s = 120.0

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=self.join_timeout_s)

    def _run(self) -> None:
        raise NotImplementedError


class WhenReady(BackgroundWatch):
    """Does something behind a run's back, from a thread of its own, once `_ready()` names its endpoint (looked at
    every `poll_s`, until `timeout_s`): `action(endpoint_id)` runs once; its return value is kept as `result`."""

    poll_s = 0.2

    def __init__(self, timeout_s: float, action: Callable[[str], Any]):
        self.timeout_s, self.action = timeout_s, action
        self.done = False
        self.result: Any = None
        super().__init__()

    def _run(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not self._stop.is_set() and time.monotonic() < deadline:
            try:
                if endpoint_id := self._ready():
                    self.result, self.done = self.action(endpoint_id), True
                    return
            except httpx.HTTPError:
                pass  # the next look tries again
            self._stop.wait(self.poll_s)

    def _ready(self) -> str | None:
        raise NotImplementedError


class WhenTraining(WhenReady):
    """Acts once the job of a run's first attempt reports training step `at_step`: what a person in RunPod's console,
    a teammate's script or RunPod itself could do at that moment."""

    def __init__(self, pod: Localpod, runpod: httpx.Client, prefix: str, at_step: int, timeout_s: float,
                 action: Callable[[str], Any]):
        self.pod, self.runpod, self.prefix, self.at_step = pod, runpod, prefix, at_step
        super().__init__(timeout_s, action)

    def _ready(self) -> str | None:
        return self._training_endpoint()

    def _training_endpoint(self) -> str | None:
        account = self.pod.account()
        first = [e for e in account.live_endpoints if e.name.startswith(self.prefix) and e.name.endswith("-a1")]
        for endpoint in first:
            for job in (j for j in account.jobs if j.endpoint_id == endpoint.id and j.status == "IN_PROGRESS"):
                status = self.runpod.get(f"/{endpoint.id}/status/{job.id}").raise_for_status().json()
                progress = status.get("output") if isinstance(status.get("output"), dict) else {}
                if progress.get("stage") == "training" and (progress.get("step") or 0) >= self.at_step:
                    return endpoint.id
        return None


class WorkerTokens:
    """Reads, from a thread of its own while the run goes, the `HF_TOKEN` each of the run's workers booted with
    (from the process itself: what RunPod put in when it filled in the account secret). None: booted without."""

    def __init__(self, pod: Localpod, prefix: str):
        self.pod, self.prefix = pod, prefix
        self.tokens: dict[str, str | None] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> WorkerTokens:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                account = self.pod.account()
            except httpx.HTTPError:
                account = None
            names = {e.id: e.name for e in account.endpoints} if account else {}
            for w in account.workers if account else []:
                if w.id in self.tokens or w.ended_at is not None or w.pid is None:
                    continue
                if not names.get(w.endpoint_id, "").startswith(self.prefix):
                    continue
                try:
                    environ = Path(f"/proc/{w.pid}/environ").read_bytes().split(b"\0")
                except OSError:
                    continue  # ended meanwhile
                env = dict(item.decode(errors="replace").split("=", 1) for item in environ if b"=" in item)
                self.tokens[w.id] = env.get("HF_TOKEN")
            self._stop.wait(0.2)


def own_token(run_name: str) -> str:
    """The Hub token of the person who started this run (a scenario with `own_token`)."""
    return f"hf_chaos_{run_name.replace('-', '_')}"


class ObserverClient(httpx.Client):
    """The harness's own RunPod client. The batch's background noise (429, 5xx, dropped connections on every route)
    is meant for the flows, not for the harness that watches them: its reads and deletes are asked again through it.
    A create is never asked again (not idempotent: a dropped answer may hide an endpoint that exists)."""

    TRIES = 6

    def request(self, method: str, url: httpx.URL | str, **kwargs: Any) -> httpx.Response:
        for attempt in range(1, self.TRIES + 1):
            again = method.upper() in ("GET", "DELETE") and attempt < self.TRIES
            try:
                response = super().request(method, url, **kwargs)
            except httpx.TransportError:
                if not again:
                    raise
            else:
                if not again or response.status_code not in (429, 500, 502, 503):
                    return response
            time.sleep(0.5 * attempt)
        raise AssertionError("unreachable")


def runpod_api(stack) -> httpx.Client:
    """RunPod's API as localpod serves it, with the account's key, seen through the batch's noise."""
    return ObserverClient(base_url=stack.client_env["RUNPOD_API_URL"], timeout=30,
                          headers={"Authorization": f"Bearer {stack.client_env['RUNPOD_API_KEY']}"})


def tight_reconcile(stack, minutes: float) -> Callable[[str], subprocess.CompletedProcess]:
    """Runs the reconcile flow with a silence threshold of `minutes`, as an operator would from a shell."""
    def run(endpoint_id: str) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "RUNPOD_"))} | stack.client_env
        return subprocess.run([sys.executable, "-m", "flows.reconcile", json.dumps({"silent_after_minutes": minutes})],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    return run


class PrefectApi:
    """The few Prefect server reads the checks need."""

    def __init__(self, api_url: str):
        self.http = PrefectServerClient(base_url=api_url, timeout=30)

    def state(self, flow_run_id: str) -> dict[str, Any]:
        return self.http.get(f"/flow_runs/{flow_run_id}").raise_for_status().json()["state"]

    def log_messages(self, flow_run_id: str) -> list[str]:
        messages: list[str] = []
        while True:
            page = self.http.post("/logs/filter", json={
                "logs": {"flow_run_id": {"any_": [flow_run_id]}}, "sort": "TIMESTAMP_ASC",
                "offset": len(messages), "limit": 200,
            }).raise_for_status().json()
            messages += [log["message"] for log in page]
            if len(page) < 200:
                return messages

    def set_variable(self, name: str, value: Any) -> None:
        response = self.http.post("/variables/", json={"name": name, "value": value})
        if response.status_code == 409:
            response = self.http.patch(f"/variables/name/{name}", json={"value": value})
        response.raise_for_status()

    def get_variable(self, name: str) -> Any:
        response = self.http.get(f"/variables/name/{name}")
        return None if response.status_code == 404 else response.raise_for_status().json()["value"]

    def recorded_volumes(self) -> set[str]:
        """The network volumes the weight-cache records keep."""
        found = self.http.post("/variables/filter", json={"variables": {"name": {"like_": VARIABLE_PREFIX}}}
                               ).raise_for_status().json()
        return {v["value"]["volume_id"] for v in found
                if v["name"].startswith(VARIABLE_PREFIX) and isinstance(v.get("value"), dict) and "volume_id" in v["value"]}

    def sweep_table(self, flow_run_id: str) -> dict[str, dict[str, Any]]:
        """A preload flow run's sweep table, datacenter → row."""
        found = self.http.post("/artifacts/filter", json={"artifacts": {
            "flow_run_id": {"any_": [flow_run_id]}, "key": {"any_": ["preload-sweep"]}}}).raise_for_status().json()
        rows = [row for a in found for row in (a["data"] if isinstance(a["data"], list) else json.loads(a["data"]))]
        return {row["datacenter"]: row for row in rows}

    def slots_in_use(self) -> int:
        response = self.http.get(f"/v2/concurrency_limits/{ENDPOINT_LIMIT}")
        return 0 if response.status_code == 404 else response.raise_for_status().json()["active_slots"]


@dataclass
class RunRecord:
    """One run of one scenario: what was injected, how the flow ended, and what was wrong with it."""

    scenario: Scenario
    name: str
    store: Path
    fault_ids: list[str] = field(default_factory=list)
    returncode: int | None = None
    output: str = ""
    flow_run_id: str | None = None
    wall_s: float = 0.0
    state_type: str | None = None
    state_message: str = ""
    retried: list[str] = field(default_factory=list)
    log_messages: list[str] = field(default_factory=list)
    """The flow run's log, as the Prefect server keeps it."""
    adopted_after: str | None = None
    """The outcome of the last attempt when the flow adopted results it found stored anyway."""
    gpus_used: list[str] = field(default_factory=list)
    resumed_from_step: int | None = None
    endpoint_names: list[str] = field(default_factory=list)
    done: bool = False
    endpoint_deleted: str | None = None
    """The endpoint the scenario deleted behind the run, when it did."""
    worker_tokens: dict[str, str | None] = field(default_factory=dict)
    """Worker id → the HF_TOKEN it booted with, read when the scenario gives the run a token of its own."""
    stale_record_cleared: bool | None = None
    """Whether the stale weight-cache record the scenario wrote was gone after the run (None: none written)."""
    sweep_rows: dict[str, dict[str, Any]] = field(default_factory=dict)
    """A preload scenario's sweep table, datacenter → row."""
    volumes_before: list[str] = field(default_factory=list)
    """A preload scenario's volume ids in its datacenters before it ran."""
    reconcile: subprocess.CompletedProcess | None = None
    """The too-tight reconcile the scenario ran while the run trained, when it did."""
    requeued: int = 0
    """Times the flow said its job went back to RunPod's queue after it had started, waiting for another worker."""
    fresh_trainings: int = 0
    """Workers of the run whose log shows a training started from the start (not resumed from a checkpoint)."""
    volume_race: Any = None
    """A volumes scenario's findings (`bench.chaos_volumes.VolumeRace`)."""
    serving_reconcile: dict[str, Any] | None = None
    """A serve scenario's reconcile run beside the live serve: its exit code, output, and whether it kept the
    endpoint (`bench/chaos_serve.py`)."""
    study: Any = None
    """A study scenario's findings (`bench.chaos_study.StudyFindings`)."""
    expiry_reconcile: dict[str, Any] | None = None
    """A serve scenario whose process was killed: the reconcile run once the endpoint's expiry passed (its exit code,
    output, whether the endpoint was live before it and is after), the expiry and when localpod says it was deleted."""
    host_killed: str | None = None
    """The worker host SIGKILLed under the run (the team form): the run must end Crashed with no endpoint left,
    whatever its scenario predicted."""
    problems: list[str] = field(default_factory=list)

    @property
    def endpoint_prefix(self) -> str:
        return f"loraflow-{self.name}-"

    def owns(self, endpoint_name: str) -> bool:
        """Whether the endpoint is this run's: named with its prefix (a train run), or with its flow run's hash
        (a preload sweep's endpoints are named for their datacenter)."""
        if endpoint_name.startswith(self.endpoint_prefix):
            return True
        return self.scenario.flow == "preload" and self.flow_run_id is not None and run_hash(self.flow_run_id) in endpoint_name

    @property
    def run_dir(self) -> Path | None:
        """The run's folder in its own store (found by listing when the flow printed no run id)."""
        if self.flow_run_id is not None:
            return self.store / "runs" / self.flow_run_id
        return next(iter(sorted((self.store / "runs").glob("*/"))), None) if (self.store / "runs").is_dir() else None

    @property
    def as_expected(self) -> bool:
        return not self.problems


def write_run_file(path: Path, scenario: Scenario, *, name: str, model: Path, store: Path, max_steps: int) -> Path:
    checkpoint = f"checkpoint_every_steps = {scenario.checkpoint_every_steps}\n" if scenario.checkpoint_every_steps else ""
    path.write_text(f'''name = "{name}"
artifact_store = "file://{store}"
deadline_minutes = 20
[model]
id = "{model}"
[dataset]
local_file = "{DATASET}"
[lora]
rank = 8
alpha = 16
[training]
learning_rate = 5e-3
max_steps = {max_steps}
batch_size = 8
max_seq_length = 128
seed = 7
{checkpoint}[compute]
gpu = {json.dumps(list(scenario.gpus))}
[attempts]
max_attempts = 3
queue_minutes = {scenario.queue_minutes}
startup_minutes = {scenario.startup_minutes}
stall_minutes = {scenario.stall_minutes}
''')
    return path


# Runs whose scenario writes a datacenter's weight-cache record take turns: the record is one per datacenter.
_RECORD_LOCK = threading.Lock()
_HUB_LOCK = threading.Lock()
HUB_MODEL = "chaos/tiny-model"


def hub_model(stack, model: Path) -> str:
    """The tiny model as a Hub repo of the stack's Hub stand-in (uploaded once), for preload sweeps."""
    from huggingface_hub import HfApi

    with _HUB_LOCK:
        api = HfApi(endpoint=stack.hub_url, token=stack.client_env["HF_TOKEN"])
        if not api.repo_exists(HUB_MODEL):
            api.create_repo(HUB_MODEL)
            api.upload_folder(repo_id=HUB_MODEL, folder_path=str(model), commit_message="tiny model")
    return HUB_MODEL


def write_stale_record(stack, prefect: PrefectApi, data_center: str, model_id: str) -> str:
    """A weight-cache record saying `model_id` is warm in `data_center` on a network volume that is then
    deleted through RunPod's API, as someone would in RunPod's console. Returns the record's Variable name."""
    with runpod_api(stack) as runpod:
        volume = runpod.post("/network-volumes", json={"name": f"chaos-stale-{data_center.lower()}", "size": 10,
                                                       "dataCenter": data_center}).raise_for_status().json()
        record = DataCenterCache(data_center=data_center, volume_id=volume["id"], volume_gb=10, models={
            model_id: WarmModel(revision="local", size_bytes=1, warmed_at=time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                      time.gmtime()))})
        prefect.set_variable(variable_name(data_center), record.model_dump(mode="json"))
        runpod.delete(f"/network-volumes/{volume['id']}").raise_for_status()
    return variable_name(data_center)


class CliFlows:
    """Starts each scenario's flow as a person does from a shell (`python -m flows.train RUN_FILE`), in a process
    of its own that ends with the flow. The team form, deployment runs through Prefect workers, is
    `bench/chaos_team.py`'s `DeploymentFlows`."""

    def __init__(self, stack):
        self.stack = stack

    def run(self, record: RunRecord, argument: Path | dict[str, Any], env: dict[str, str], timeout_s: float) -> None:
        """Run the record's flow with `argument` (a train run file, or a preload spec) and `env` on top of the stack's
        client environment, to its end; fills in the record's exit code, output and flow run id."""
        base = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "RUNPOD_"))}
        flow_argument = str(argument) if isinstance(argument, Path) else json.dumps(argument)
        try:
            proc = subprocess.run([sys.executable, "-m", f"flows.{record.scenario.flow}", flow_argument], cwd=REPO,
                                  env=base | self.stack.client_env | env, capture_output=True, text=True,
                                  timeout=timeout_s)
            record.returncode, record.output = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as e:
            record.output = f"{e.stdout or ''}{e.stderr or ''}\n(the flow ran past {timeout_s:.0f} s and was killed)"
        match = re.search(r"flow run ([0-9a-f-]{36}):", record.output)
        record.flow_run_id = match.group(1) if match else None
