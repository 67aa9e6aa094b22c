"""The embedded local stack: a Prefect server (SQLite), localpod in place of RunPod and, when asked,
the local Hub stand-in. Used by the local demo (`deployments/local.py`) and the end-to-end tests.

The control plane and the worker never share an environment (as in production, where the worker runs in
its image): localpod starts workers with the worker environment's interpreter, `WORKER_PYTHON`
(`.venv-worker/bin/python`, made by `make install` from the image's lock; `LORAFLOW_WORKER_PYTHON`
overrides it), and whatever needs the training stack here (building the tiny model, loading an adapter)
runs there too.

The team setup (PostgreSQL, leases in Redis, several Prefect workers) builds on this stack:
`deployments/team_stack.py`.

Every process is started here, stopped here by its PID (with its process group), and given free
ports; nothing of a developer's own Prefect profile is touched (PREFECT_HOME is the stack's folder).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from loraflow_worker.contract import CONTRACT_VERSION

REPO = Path(__file__).resolve().parent.parent
WORKER_PYTHON = Path(os.environ.get("LORAFLOW_WORKER_PYTHON") or REPO / ".venv-worker" / "bin" / "python")
LOCALPOD_API_KEY = "localpod-local-key"

PREFECT_SERVER_ENV = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    # The default in-memory lease storage forgets slot leases on a restart and leaks the slots;
    # the filesystem storage keeps them, so the repossessor frees a crashed holder's slot.
    "PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE": "prefect.server.concurrency.lease_storage.filesystem",
    "PREFECT_SERVER_LOGGING_LEVEL": "WARNING",
    # Queued runs ask for a slot again after at most 5 s, not Prefect's 30 s: bench/quota.py measured a freed
    # slot idle 2.3 s instead of 11.2 s (median) and a 12-run batch done in 0.47 × the time (bench/README.md).
    "PREFECT_SERVER_CONCURRENCY_MAXIMUM_CONCURRENCY_SLOT_WAIT_SECONDS": "5",
    # The volumes flow's and the secrets' retention read use events; Prefect forgets events after 7 days by
    # default, which would keep every volume unused for longer than that out of the 14-day retention's reach.
    "PREFECT_SERVER_EVENTS_RETENTION_PERIOD": "P30D",
    # Prefect's task run recorder writes each task run event in its own transaction by default. On SQLite a slot
    # request (a read, then a write, in one deferred transaction) that meets one of those writes fails SQLITE_BUSY,
    # the server answers 503 and the client asks again 2 s later: after a run's burst of checks that was most runs'
    # slot (bench/overhead.py: 2.6 s before the job, 0.6 s without). Batched, task runs show in the UI ≤ 1 s later.
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE": "100",
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL": "1",
    # Prefect's event persister writes as soon as 20 events are in: a run's checks send about that many, so the write
    # came just as the run asked for its slot, which then failed SQLITE_BUSY as above (4 runs in 6 once the checks
    # ended 0.1 s sooner; bench/README.md). Written once a second instead: events show in the UI ≤ 1 s later.
    "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_BATCH_SIZE": "1000",
    "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_FLUSH_INTERVAL": "1",
}
SERVER_START_TIMEOUT_S = 240  # ~20 s on a fresh database; over 120 s seen on a loaded 2-core machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Service:
    name: str
    process: subprocess.Popen
    url: str
    log_path: Path
    stop_signal: int = signal.SIGTERM
    """Sent to the process group to stop it (PostgreSQL's fast shutdown is SIGINT; SIGTERM waits for clients)."""

    def stop(self, grace_s: float = 15.0) -> None:
        if self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, self.stop_signal)
        except ProcessLookupError:
            return
        try:
            self.process.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)


def start_service(name: str, argv: list[str], env: dict[str, str], url: str, health_path: str, log_path: Path,
                  timeout_s: float = SERVER_START_TIMEOUT_S, ready: Callable[[], bool] | None = None,
                  user: str | None = None, stop_signal: int = signal.SIGTERM) -> Service:
    """Start a server in its own process group and wait until `url + health_path` answers 200 (or, for a
    server that speaks no HTTP, until `ready()` is true). `user`: run it as that system user (root only)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = log_path.open("ab")
    process = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                               user=user, group=user, extra_groups=[] if user else None)
    service = Service(name, process, url, log_path, stop_signal)
    ready = ready or (lambda: _answers_200(url + health_path))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with code {process.returncode}; see {log_path}:\n{_tail(log_path)}")
        if ready():
            return service
        time.sleep(0.3)
    service.stop()
    raise RuntimeError(f"{name} did not become healthy within {timeout_s:.0f} s; see {log_path}:\n{_tail(log_path)}")


def require_worker_python(python: Path = WORKER_PYTHON) -> Path:
    """`python`, once it is known to be an interpreter with the worker's training stack."""
    if not os.access(python, os.X_OK):
        raise RuntimeError(f"no worker environment at {python}: run `make install` (it builds .venv-worker from "
                           "the worker image's lock), or point LORAFLOW_WORKER_PYTHON at a worker interpreter")
    return python


def build_tiny_model(out_dir: Path, python: Path = WORKER_PYTHON) -> Path:
    """Build the tiny Qwen3-architecture model offline into `out_dir` (in the worker's environment)."""
    subprocess.run([str(require_worker_python(python)), "-m", "loraflow_worker.self_test.tiny_model", "--out", str(out_dir)],
                   check=True, env=os.environ | {"OMP_NUM_THREADS": "1"})
    return out_dir


def check_adapter(base_model: Path, adapter_dir: Path, python: Path = WORKER_PYTHON) -> dict:
    """Load `adapter_dir` with PEFT onto `base_model` in the worker's environment; the report of
    `loraflow_worker.artifacts.adapter_check` (`loads`, `changes_output`, ...), or an error naming what failed."""
    proc = subprocess.run([str(require_worker_python(python)), "-m", "loraflow_worker.artifacts.adapter_check", str(base_model),
                           str(adapter_dir)], capture_output=True, text=True, env=os.environ | {"OMP_NUM_THREADS": "1"})
    lines = proc.stdout.strip().splitlines()
    if not lines:
        raise RuntimeError(f"the adapter check printed nothing (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def _answers_200(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def _tail(path: Path, size: int = 3000) -> str:
    data = path.read_bytes() if path.exists() else b""
    return data[-size:].decode("utf-8", errors="replace")


@dataclass
class LocalStack:
    """Start with `with LocalStack(home) as stack:`; `stack.client_env` is what a flow process needs."""

    home: Path
    worker_quota: int = 30
    with_hub: bool = False
    prefect_port: int = 0
    worker_python: Path = WORKER_PYTHON
    worker_env: dict[str, str] = field(default_factory=dict)
    """Extra environment for every worker process localpod starts (on top of the endpoint's own env); a
    container gets only the endpoint's env, as on RunPod."""
    worker_runtime: str = "process"
    """`process` (workers run with `worker_python`) or `docker` (each worker a container of `worker_image`)."""
    worker_image: str = f"loraflow-worker:local-contract{CONTRACT_VERSION}"
    """The image the flows ask for (LORAFLOW_WORKER_IMAGE); with the docker runtime it must be built here. Its
    tag names the job contract, as `make image` tags do: the control plane checks it before renting."""
    worker_mounts: list[Path] = field(default_factory=list)
    """Folders a containerised worker sees at the same path (a `file://` store, a local model)."""
    docker: str = os.environ.get("DOCKER", "docker")
    server_env: dict[str, str] = field(default_factory=dict)
    """Extra settings for the Prefect server, on top of PREFECT_SERVER_ENV (a benchmark's wait setting, a
    database URL)."""
    services: dict[str, Service] = field(default_factory=dict)
    _exit: ExitStack = field(default_factory=ExitStack)

    @property
    def prefect_api_url(self) -> str:
        return f"http://127.0.0.1:{self.prefect_port}/api"

    @property
    def prefect_ui_url(self) -> str:
        return f"http://127.0.0.1:{self.prefect_port}"

    @property
    def localpod_url(self) -> str:
        return self.services["localpod"].url

    @property
    def hub_url(self) -> str:
        return self.services["hub"].url

    @property
    def client_env(self) -> dict[str, str]:
        """Environment for processes that run flows against this stack."""
        env = {
            "PREFECT_API_URL": self.prefect_api_url,
            "PREFECT_HOME": str(self.home / "prefect-client"),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            # A local server keeps its database in SQLite, which answers "database is locked" (a 503) while another
            # writer holds it: with many runs starting at once, Prefect's 5 retries (about a minute) ran out
            # before a run was even created. 7 back off for about four minutes.
            "PREFECT_CLIENT_MAX_RETRIES": "7",
            "RUNPOD_API_KEY": LOCALPOD_API_KEY,
            "RUNPOD_API_URL": f"{self.localpod_url}/v2",
            "RUNPOD_JOB_URL": f"{self.localpod_url}/v2",
            "LORAFLOW_WORKER_IMAGE": self.worker_image,
            # localpod's quota is the account's: runs create the runpod-endpoints limit at it.
            "LORAFLOW_WORKER_QUOTA": str(self.worker_quota),
        }
        if self.with_hub:
            env |= {"HF_ENDPOINT": self.hub_url, "HF_TOKEN": "hf_local_stack_token", "HF_HUB_DISABLE_TELEMETRY": "1"}
        return env

    def __enter__(self) -> LocalStack:
        self.home.mkdir(parents=True, exist_ok=True)
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _start(self) -> None:
        base = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "RUNPOD_", "HF_"))}
        self.prefect_port = self.prefect_port or free_port()
        self._start_prefect()
        if self.with_hub:
            port = free_port()
            self.services["hub"] = start_service(
                "hub stand-in",
                [sys.executable, "-m", "localpod.hub", "--host", "127.0.0.1", "--port", str(port),
                 "--data-dir", str(self.home / "hub")],
                base, f"http://127.0.0.1:{port}", "/api/agent-harnesses", self.home / "logs" / "hub.log",
            )
        port = free_port()
        worker_env = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_DISABLE_TELEMETRY": "1",
                      **self.worker_env}
        if self.worker_runtime == "docker":
            runtime = ["--worker-runtime", "docker", "--docker", self.docker,
                       *(arg for mount in self.worker_mounts for arg in ("--worker-mount", str(mount)))]
        else:
            runtime = ["--worker-python", str(require_worker_python(self.worker_python))]
        self.services["localpod"] = start_service(
            "localpod",
            [sys.executable, "-m", "localpod", "--host", "127.0.0.1", "--port", str(port), "--api-key", LOCALPOD_API_KEY,
             "--worker-quota", str(self.worker_quota), "--log-dir", str(self.home / "logs" / "workers"), *runtime],
            base | worker_env, f"http://127.0.0.1:{port}", "/_localpod/account", self.home / "logs" / "localpod.log",
        )

    def _start_prefect(self) -> None:
        base = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "RUNPOD_", "HF_"))}
        self.services["prefect"] = start_service(
            "prefect server",
            [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(self.prefect_port)],
            # The UI asks its server's /ui-settings for the API URL, which defaults to port 4200.
            base | PREFECT_SERVER_ENV | self.server_env | {"PREFECT_HOME": str(self.home / "prefect-server"),
                                         "PREFECT_UI_API_URL": self.prefect_api_url},
            f"http://127.0.0.1:{self.prefect_port}", "/api/health",
            self.home / "logs" / "prefect-server.log",
        )

    def restart_prefect(self) -> float:
        """Stop the Prefect server and start it again on the same port and database (as an operator's
        upgrade would); returns the seconds it was down."""
        stopped = time.monotonic()
        self.services.pop("prefect").stop()
        self._start_prefect()
        return time.monotonic() - stopped

    def stop(self) -> None:
        # localpod first: it stops the workers it started.
        for name in ("localpod", "hub", "prefect"):
            service = self.services.pop(name, None)
            if service is not None:
                service.stop()
