"""The team setup on one machine: the parts a team runs loraflow on, started and stopped here.

    .venv/bin/python -m deployments.team_stack                 # PostgreSQL, Redis, server, localpod, 3 workers
    .venv/bin/python -m deployments.team_stack --workers 5 --limit 8 --home .local/team
    .venv/bin/python -m deployments.team_stack --runs 6 --quota 2    # the demo: 6 tiny-model runs, 2 slots, then stop

A Prefect server on PostgreSQL (Debian's `postgresql`, its own data directory, a free port), slot leases
in Redis through `prefect-redis` (Debian's `redis-server`, likewise), the automation that marks a run
Crashed when its heartbeats stop, a process work pool and N `prefect worker start --pool ...` processes
(each as a separate host would run it, with its own PREFECT_HOME), all drawing on the one global
concurrency limit `runpod-endpoints`; localpod stands in for RunPod. It prints the settings each part
was given (docs/team.md says what each is for) and runs until Ctrl-C (or, with `--runs`, runs
the demo and stops). The end-to-end tests
of this setup are `tests/test_team_stack_e2e.py`.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from deployments.local_stack import REPO, WORKER_PYTHON, LocalStack, Service, build_tiny_model, free_port, start_service

POOL = "loraflow"
"""The pool prefect.yaml's deployments name, so `prefect deploy --all` targets these workers."""
PG_USER = "loraflow"
PG_DATABASE = "prefect"
WORKER_LIMIT = 10
"""Flow runs one worker process holds at once (`--limit`): three such workers cover a 30-worker account's
quota. A run costs its worker ~100 MB and ~8 CPU s, mostly at its start (docs/team.md: the measured figures)."""
SLOT_LEASE_S = 600
"""LORAFLOW_SLOT_LEASE_SECONDS the workers give their runs. Prefect renews a lease once 3/4 of it has passed,
so a lease rides out a server outage of a quarter of its length at worst (the default 120 s: 30 s); a
restart of this server took 32-91 s on a loaded 2-core machine. A lapsed lease frees its slot under a live
endpoint; a longer one gives a dead host's slots back later."""
HEARTBEAT_S = 30
"""PREFECT_FLOWS_HEARTBEAT_FREQUENCY the workers give their runs: the least Prefect accepts."""
DB_POOL_SIZE = 20
DB_POOL_OVERFLOW = 40
LONGEST_RESTART_S = 91
"""The longest restart of this server measured (32-91 s on a loaded 2-core machine; see SLOT_LEASE_S)."""
ZOMBIE_WITHIN_S = 6 * HEARTBEAT_S
"""A run with no heartbeat (and no final state) for this long is marked Crashed. The reconciler's rule holds
(at least 3 heartbeat intervals: one late or lost beat is not death), and it outlasts the longest restart
measured with a minute to spare: a restart silences every run for its own length plus up to one interval
(the beat just before it went down), 91 + 30 = 121 s < 180 s. A run marked Crashed anyway keeps its endpoint
while its heartbeats go on (`tasks/lifecycle/reconcile.py`)."""

# Prefect's documented zombie-run automation (docs: v3/advanced/detect-zombie-flows): a killed worker host
# leaves its runs Running for ever otherwise, since no process is left to report the crash.
CRASH_SILENT_RUNS = {
    "name": "loraflow: crash runs whose heartbeats stopped",
    "description": "A flow run that sent no heartbeat and reached no final state for "
                   f"{ZOMBIE_WITHIN_S} s lost its process (a worker host died): mark it Crashed.",
    "enabled": True,
    "trigger": {
        "type": "event",
        "posture": "Proactive",
        "match": {"prefect.resource.id": "prefect.flow-run.*"},
        "after": ["prefect.flow-run.heartbeat"],
        "expect": ["prefect.flow-run.heartbeat", "prefect.flow-run.Completed", "prefect.flow-run.Failed",
                   "prefect.flow-run.Cancelled", "prefect.flow-run.Crashed"],
        "for_each": ["prefect.resource.id"],
        "threshold": 1,
        "within": ZOMBIE_WITHIN_S,
    },
    "actions": [{"type": "change-flow-run-state", "state": "CRASHED",
                 "message": f"No heartbeat for {ZOMBIE_WITHIN_S} s: the run's process is gone."}],
}


POSTGRES_BINS = "/usr/lib/postgresql/*/bin"
"""Where Debian's `postgresql` puts each major version's server programs (not on PATH)."""
POSTGRES_PROGRAMS = ("initdb", "postgres", "pg_isready", "createdb")
INSTALL_FIX = "`make team-demo` installs what the team setup needs (as `make test` does) and runs its demo"


def postgres_bin(name: str) -> Path:
    """A PostgreSQL server binary from Debian's `postgresql` (the newest installed major version)."""
    found = sorted(glob.glob(f"{POSTGRES_BINS}/{name}"), key=lambda p: int(Path(p).parents[1].name))
    if not found:
        raise RuntimeError(f"no PostgreSQL server ({name}): {INSTALL_FIX}")
    return Path(found[-1])


def redis_server() -> str:
    found = shutil.which("redis-server")
    if not found:
        raise RuntimeError(f"no redis-server on PATH: {INSTALL_FIX}")
    return found


def missing_system_packages() -> list[str]:
    """The Debian packages whose programs the stack starts and this machine lacks."""
    missing = []
    if not all(glob.glob(f"{POSTGRES_BINS}/{name}") for name in POSTGRES_PROGRAMS):
        missing.append("postgresql")
    if not shutil.which("redis-server"):
        missing.append("redis-server")
    return missing


def setup_problem(worker_python: Path = WORKER_PYTHON) -> str | None:
    """What this machine lacks for the stack, in one line that names the command that fixes it; None if nothing."""
    missing = missing_system_packages()
    if missing:
        return f"Debian's {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed: {INSTALL_FIX}"
    if not os.access(worker_python, os.X_OK):
        return (f"no worker environment at {worker_python}: {INSTALL_FIX} (`make install` makes the environments alone), "
                "or point LORAFLOW_WORKER_PYTHON at a worker interpreter")
    return None


SHIPPED_DATA = REPO / "deployments" / "data"
"""The shipped data the stack's runs read, copied into its inputs folder (`TeamStack.inputs_dir`, the workers'
`LORAFLOW_INPUTS_DIR`: every local file a run names must lie inside it, docs/team.md "Trust"). Copies, not the
files themselves: the shipped file is a link out of that folder, which the rule refuses as it should."""
RUN_TOKEN_BLOCK = "team-member-hf-token"
"""The Prefect Secret block the stack saves as a team member's own Hub token: its runs name it in
`hub_token_secret`, since the stack requires one (`LORAFLOW_REQUIRE_RUN_TOKEN=1`)."""
RUN_TOKEN = "hf_team_member_token"
"""That member's token (the local Hub stand-in accepts any): not the control plane's own `HF_TOKEN`, which the stack's
rule refuses a run to borrow (`LORAFLOW_REQUIRE_RUN_TOKEN=1`)."""


def team_rules_env(inputs_dir: Path) -> dict[str, str]:
    """What the workers of a shared server hold every run to: files inside `inputs_dir`, a Hub token of its own."""
    return {"LORAFLOW_INPUTS_DIR": str(inputs_dir), "LORAFLOW_REQUIRE_RUN_TOKEN": "1"}


def team_server_env(database_url: str, redis_url: str) -> dict[str, str]:
    """The Prefect server settings of the team setup (on top of the local stack's PREFECT_SERVER_ENV)."""
    return {
        "PREFECT_API_DATABASE_CONNECTION_URL": database_url,
        # Leases in Redis survive a server restart (no slot leaks), like the filesystem storage, but on any host.
        "PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE": "prefect_redis.lease_storage",
        "PREFECT_REDIS_MESSAGING_URL": redis_url,
        # A worker that picks up many runs at once reads the deployment for each at once: with SQLAlchemy's
        # default pool (5 + 10 overflow, 30 s timeout) 100 such reads timed out, the server answered 500, and
        # the Prefect worker exited. 20 + 40 stays under PostgreSQL's default 100 connections.
        "PREFECT_SERVER_DATABASE_SQLALCHEMY_POOL_SIZE": str(DB_POOL_SIZE),
        "PREFECT_SERVER_DATABASE_SQLALCHEMY_MAX_OVERFLOW": str(DB_POOL_OVERFLOW),
        "PREFECT_SERVER_DATABASE_SQLALCHEMY_POOL_TIMEOUT": "60",
    }


@dataclass
class TeamStack:
    """Start with `with TeamStack(home) as team:`; `team.local` is the LocalStack (Prefect server and localpod),
    `team.client_env` what a CLI or flow process needs."""

    home: Path
    workers: int = 3
    worker_limit: int = WORKER_LIMIT
    pool: str = POOL
    worker_quota: int = 30
    worker_env: dict[str, str] = field(default_factory=dict)
    """Extra environment for the Prefect workers, which their flow runs inherit (a test's short lease)."""
    runpod_worker_env: dict[str, str] = field(default_factory=dict)
    """Extra environment for localpod and the RunPod workers it starts (a benchmark's hold jobs)."""
    with_hub: bool = False
    """Start the local Hub stand-in too (preload sweeps, runs with a Hub token of their own)."""
    local: LocalStack | None = None
    services: dict[str, Service] = field(default_factory=dict)
    database_url: str = ""
    redis_url: str = ""
    _pg_tmp: Path | None = None

    @property
    def client_env(self) -> dict[str, str]:
        return self.local.client_env

    @property
    def inputs_dir(self) -> Path:
        """The workers' `LORAFLOW_INPUTS_DIR`: the stack's `inputs/`, holding a copy of the shipped data."""
        return self.home / "inputs"

    def input_file(self, shipped: Path) -> Path:
        """The copy in the inputs folder of `shipped`, a file of the shipped data."""
        return self.inputs_dir / shipped.name

    @property
    def worker_names(self) -> list[str]:
        return sorted(name for name in self.services if name.startswith("worker-"))

    def __enter__(self) -> TeamStack:
        self.home = self.home.resolve()
        self.home.mkdir(parents=True, exist_ok=True)
        self.inputs_dir.mkdir(exist_ok=True)
        for shipped in SHIPPED_DATA.iterdir():
            shutil.copyfile(shipped, self.input_file(shipped))  # follows the link: a real file in the folder
        try:
            self._start_postgres()
            self._start_redis()
            self.local = LocalStack(self.home, worker_quota=self.worker_quota, worker_env=self.runpod_worker_env,
                                    with_hub=self.with_hub,
                                    server_env=team_server_env(self.database_url, self.redis_url)).__enter__()
            self._prefect("work-pool", "create", self.pool, "--type", "process", "--overwrite")
            self.save_secret(RUN_TOKEN_BLOCK, RUN_TOKEN)
            httpx.post(f"{self.local.prefect_api_url}/automations/", json=CRASH_SILENT_RUNS, timeout=30).raise_for_status()
            for i in range(self.workers):
                self.start_worker(f"worker-{i + 1}")
            self.wait_for_workers(self.workers)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start_worker(self, name: str) -> Service:
        """`prefect worker start --pool POOL --limit N` as a host of its own would run it (own PREFECT_HOME)."""
        env = self._base_env() | self.client_env | {
            "PREFECT_HOME": str(self.home / name),
            "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(HEARTBEAT_S),
            "LORAFLOW_SLOT_LEASE_SECONDS": str(SLOT_LEASE_S),
        } | team_rules_env(self.inputs_dir) | self.worker_env
        log_path = self.home / "logs" / f"{name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        process = subprocess.Popen(
            [sys.executable, "-m", "prefect", "worker", "start", "--pool", self.pool, "--type", "process",
             "--name", name, "--limit", str(self.worker_limit)],
            cwd=REPO, env=env, stdout=log_path.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)
        self.services[name] = Service(name, process, "", log_path)
        return self.services[name]

    def wait_for_workers(self, count: int, timeout_s: float = 180) -> None:
        """Until `count` workers of the pool are ONLINE (each has sent its first heartbeat)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for name in self.worker_names:
                if self.services[name].process.poll() is not None:
                    raise RuntimeError(f"{name} exited; see {self.services[name].log_path}")
            online = [w for w in httpx.post(f"{self.local.prefect_api_url}/work_pools/{self.pool}/workers/filter",
                                            json={}, timeout=30).json() if w["status"] == "ONLINE"]
            if len(online) >= count:
                return
            time.sleep(1)
        raise RuntimeError(f"fewer than {count} workers came online within {timeout_s:.0f} s; see {self.home / 'logs'}")

    def worker_of(self, run: dict) -> str | None:
        """The worker whose process tree holds a flow run's process (`run`: the API's flow run, whose
        `infrastructure_pid` is `host:pid`); None while it has none."""
        pid = int(str(run.get("infrastructure_pid") or "0").rpartition(":")[2] or 0)
        for name in self.worker_names:
            if pid and pid in descendants(self.services[name].process.pid):
                return name
        return None

    def kill_worker(self, name: str) -> list[int]:
        """SIGKILL a worker and every process under it (its flow runs run in sessions of their own), as when its
        host dies; returns the PIDs killed."""
        worker = self.services.pop(name)
        pids = [worker.process.pid, *descendants(worker.process.pid)]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        worker.process.wait(10)
        return pids

    def stop(self) -> None:
        # Workers first, with any run a worker leaves behind (runs live in sessions of their own), then the
        # server and localpod, then the server's storage.
        for name in self.worker_names:
            worker = self.services.pop(name)
            runs = descendants(worker.process.pid)
            worker.stop(grace_s=30)
            for pid in runs:
                try:
                    os.kill(pid, signal.SIGKILL)  # a flow run left behind by a worker that did not stop it
                except ProcessLookupError:
                    pass
        if self.local is not None:
            self.local.stop()
        for name in ("redis", "postgres"):
            service = self.services.pop(name, None)
            if service is not None:
                service.stop()
        if self._pg_tmp is not None:
            shutil.rmtree(self._pg_tmp, ignore_errors=True)
            self._pg_tmp = None

    def _start_postgres(self) -> None:
        # PostgreSQL refuses to run as root: as root, run it as Debian's `postgres` user, in a folder that user
        # can reach (a temporary one when the stack's own folder is private, as pytest's are).
        user = "postgres" if os.geteuid() == 0 else None
        data = self.home / "postgres"
        if user and not _reachable_by_others(self.home):
            self._pg_tmp = Path(tempfile.mkdtemp(prefix="loraflow-postgres-"))
            os.chmod(self._pg_tmp, 0o755)
            data = self._pg_tmp / "data"
        if not (data / "PG_VERSION").exists():
            data.mkdir(parents=True, exist_ok=True)
            if user:
                shutil.chown(data, user, user)
            # trust: the server listens on 127.0.0.1 only, its socket in its own data directory.
            subprocess.run([str(postgres_bin("initdb")), "-D", str(data), "-U", PG_USER, "--auth=trust",
                            "-E", "UTF8", "--no-sync"], check=True, capture_output=True, user=user, group=user,
                           extra_groups=[] if user else None)
        port = free_port()
        self.services["postgres"] = start_service(
            "postgres", [str(postgres_bin("postgres")), "-D", str(data), "-p", str(port), "-h", "127.0.0.1",
                         "-k", str(data)],
            {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"}, f"127.0.0.1:{port}", "",
            self.home / "logs" / "postgres.log", ready=lambda: _pg_ready(port), user=user,
            stop_signal=signal.SIGINT)  # PostgreSQL's fast shutdown; SIGTERM waits for every client to leave
        created = subprocess.run([str(postgres_bin("createdb")), "-h", "127.0.0.1", "-p", str(port), "-U", PG_USER,
                                  PG_DATABASE], capture_output=True, text=True)
        if created.returncode != 0 and "already exists" not in created.stderr:
            raise RuntimeError(f"createdb failed: {created.stderr}")
        self.database_url = f"postgresql+asyncpg://{PG_USER}@127.0.0.1:{port}/{PG_DATABASE}"

    def _start_redis(self) -> None:
        port = free_port()
        (self.home / "redis").mkdir(exist_ok=True)
        # The append-only file keeps leases across a Redis restart too, as a production Redis would.
        self.services["redis"] = start_service(
            "redis", [redis_server(), "--bind", "127.0.0.1", "--port",
                      str(port), "--dir", str(self.home / "redis"), "--appendonly", "yes", "--save", ""],
            {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}, f"redis://127.0.0.1:{port}/0", "",
            self.home / "logs" / "redis.log", ready=lambda: _redis_ready(port))
        self.redis_url = f"redis://127.0.0.1:{port}/0"

    def deploy(self, entrypoint: str, name: str, parameters: dict, *args: str) -> str:
        """`prefect deploy ENTRYPOINT` on the team's pool, as docs/team.md's team setup does (prefect.yaml's pull
        step); `args`: more of its options (a schedule). Returns the deployment's id."""
        self._prefect("deploy", entrypoint, "--name", name, "--pool", self.pool, "--params", json.dumps(parameters),
                      *args)
        flow = entrypoint.rpartition(":")[2]
        return httpx.get(f"{self.local.prefect_api_url}/deployments/name/{flow}/{name}",
                         timeout=30).raise_for_status().json()["id"]

    def save_secret(self, name: str, value: str) -> None:
        """A Prefect Secret block on the team's server, as a team member saves their own token."""
        from prefect.blocks.system import Secret
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings({PREFECT_API_URL: self.local.prefect_api_url}):
            Secret(value=value).save(name, overwrite=True)

    def _prefect(self, *args: str) -> str:
        proc = subprocess.run([sys.executable, "-m", "prefect", "--no-prompt", *args], cwd=REPO,
                              env=self._base_env() | self.client_env, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"prefect {' '.join(args)} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        return proc.stdout

    @staticmethod
    def _base_env() -> dict[str, str]:
        return {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "RUNPOD_", "HF_"))}


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (a Prefect worker's flow-run processes)."""
    return _children_by_parent().get(pid, [])


def descendants(pid: int) -> list[int]:
    """Every process under `pid`, however deep (read from /proc: a process's children may have left its group)."""
    by_parent = _children_by_parent()
    found, todo = [], [pid]
    while todo:
        for child in by_parent.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _children_by_parent() -> dict[int, list[int]]:
    by_parent: dict[int, list[int]] = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            # The command name, in parentheses, may hold spaces: the parent's id is the 2nd field after it.
            fields = Path(stat).read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # a process that ended meanwhile
        by_parent.setdefault(int(fields[1]), []).append(int(stat.split("/")[2]))
    return by_parent


def _reachable_by_others(path: Path) -> bool:
    return all(os.stat(p).st_mode & 0o001 for p in [path, *path.parents])


def _pg_ready(port: int) -> bool:
    return subprocess.run([str(postgres_bin("pg_isready")), "-q", "-h", "127.0.0.1", "-p", str(port)]).returncode == 0


def _redis_ready(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--home", default=str(REPO / ".local" / "team"), help="Folder for the stack's state and logs.")
    parser.add_argument("--workers", type=int, default=3, help="Prefect worker processes on the pool.")
    parser.add_argument("--limit", type=int, default=WORKER_LIMIT, help="Flow runs each worker runs at once.")
    parser.add_argument("--runs", type=int, default=0,
                        help="The demo: deploy deployments/local.toml (tiny model) as train/team-demo, start this many "
                             "runs, wait for them, print what happened and stop. 0: keep the stack up until Ctrl-C.")
    parser.add_argument("--quota", type=int, default=3, help="With --runs: slots of runpod-endpoints (when missing).")
    args = parser.parse_args()
    # Before anything starts: a missing program is a set-up step to name, not a traceback from deep inside.
    if problem := setup_problem():
        print(f"team_stack: {problem}", file=sys.stderr)
        return 2
    with TeamStack(Path(args.home), workers=args.workers, worker_limit=args.limit) as team:
        server = team_server_env(team.database_url, team.redis_url)
        print(f"Prefect UI: {team.local.prefect_ui_url}   pool: {team.pool}, {args.workers} workers\n"
              f"server: {' '.join(f'{k}={v}' for k, v in server.items())}\n"
              f"clients and workers: PREFECT_API_URL={team.local.prefect_api_url} "
              f"PREFECT_FLOWS_HEARTBEAT_FREQUENCY={HEARTBEAT_S} LORAFLOW_SLOT_LEASE_SECONDS={SLOT_LEASE_S} "
              f"{' '.join(f'{k}={v}' for k, v in team_rules_env(team.inputs_dir).items())}\n"
              f"a team member's Hub token: the Secret block {RUN_TOKEN_BLOCK} (name it in hub_token_secret)\n"
              f"RunPod: localpod at {team.local.localpod_url}", flush=True)
        if args.runs:
            return _demo(team, args.runs, args.quota)
        print("Ctrl-C stops everything.", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
    return 0


def _demo(team: TeamStack, runs: int, quota: int) -> int:
    api = team.local.prefect_api_url
    model = team.home / "tiny-model"
    if not (model / "config.json").exists():
        build_tiny_model(model)
    spec = tomllib.loads((REPO / "deployments" / "local.toml").read_text())
    spec["model"]["id"] = str(model)
    spec["artifact_store"] = f"file://{team.home / 'artifacts'}"
    spec["training"]["max_steps"] = 10
    spec["hub_token_secret"] = RUN_TOKEN_BLOCK  # the stack requires a token of one's own
    spec["dataset"]["local_file"] = str(team.input_file(SHIPPED_DATA / "tiny-chat.jsonl"))  # inside its inputs folder
    # Created only when missing, as the flow itself does: an operator's limit is never overwritten.
    if httpx.get(f"{api}/v2/concurrency_limits/runpod-endpoints", timeout=30).status_code == 404:
        httpx.post(f"{api}/v2/concurrency_limits/", json={"name": "runpod-endpoints", "limit": quota},
                   timeout=30).raise_for_status()
    deployment = team.deploy("flows/train.py:train", "team-demo", {"spec": spec})
    ids = [httpx.post(f"{api}/deployments/{deployment}/create_flow_run", json={}, timeout=30).json()["id"]
           for _ in range(runs)]
    print(f"Started {runs} runs of train/team-demo; waiting ...", flush=True)
    started = time.monotonic()
    while True:
        found = httpx.post(f"{api}/flow_runs/filter", json={"flow_runs": {"id": {"any_": ids}}}, timeout=30).json()
        states = [r["state"]["type"] for r in found]
        if all(s in {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"} for s in states):
            break
        time.sleep(5)
    account = httpx.get(f"{team.local.localpod_url}/_localpod/account", timeout=30).json()
    limit = httpx.get(f"{api}/v2/concurrency_limits/runpod-endpoints", timeout=30).json()["limit"]
    print(f"{states.count('COMPLETED')}/{runs} runs completed in {time.monotonic() - started:.0f} s through "
          f"{len(team.worker_names)} workers; peak endpoints alive {account['peakLiveEndpoints']} (limit {limit})")
    return 0 if states.count("COMPLETED") == runs else 1


if __name__ == "__main__":
    sys.exit(main())
