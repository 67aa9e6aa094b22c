"""What the scale benchmarks (`quota.py`, `capacity.py`, `bare_script.py`) share: a local stack whose
localpod runs hold jobs (`python -m localpod --hold-jobs`: each job holds a real `runpod.serverless`
worker for a fixed time and trains nothing, so what is measured is the control plane), hold runs of the
real `train` flow, and the reductions of localpod's and /proc's records into figures.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from bench.chaos_lib import DATASET, ENDPOINT_LIMIT, Localpod
from deployments.local_stack import LocalStack
from localpod.models import Account, AccountEndpoint

REPO = Path(__file__).resolve().parent.parent
WAIT_SETTING = "PREFECT_SERVER_CONCURRENCY_MAXIMUM_CONCURRENCY_SLOT_WAIT_SECONDS"
PREFECT_DEFAULT_WAIT_S = 30.0  # Prefect 3.9.1's default for WAIT_SETTING
_CLK_TCK = os.sysconf("SC_CLK_TCK")
_PAGE_KB = os.sysconf("SC_PAGE_SIZE") // 1024
_WORKER_ROUTES = ("job-take", "job-done", "job-stream", "job-stop", "ping")  # the worker protocol, not the flows


@contextmanager
def hold_stack(home: Path, hold_s: float, *, quota: int = 30, wait_s: float | None = None,
               eta: bool = True) -> Iterator[LocalStack]:
    """A running local stack whose jobs hold their worker `hold_s` seconds, stopped on leaving. `wait_s`: the
    Prefect server's slot-wait setting (None: the local stack's, the recommended 5 s). `eta=False`: the hold
    worker reports progress without an ETA, so the flows poll at the fixed base interval, as before adaptive
    polling."""
    with LocalStack(home, worker_quota=quota, worker_env=hold_env(hold_s, eta),
                    server_env={} if wait_s is None else {WAIT_SETTING: str(wait_s)}) as stack:
        yield stack


def hold_env(hold_s: float, eta: bool = True) -> dict[str, str]:
    """localpod's environment for hold jobs of `hold_s` seconds (`eta=False`: progress without an ETA)."""
    return {"LOCALPOD_HOLD_JOBS": str(hold_s), "LOCALPOD_HOLD_ETA": "1" if eta else "0"}


def hold_model(root: Path) -> Path:
    """A local "model" folder: the flow only checks that a local model is a folder, and a hold job loads nothing."""
    model = root / "hold-model"
    model.mkdir(parents=True, exist_ok=True)
    return model


def write_hold_run(folder: Path, name: str, model: Path, steps: int = 4) -> Path:
    """A run file for one hold run, its `file://` store in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    run_file = folder / "run.toml"
    run_file.write_text(f'''name = "{name}"
artifact_store = "file://{folder / 'store'}"
deadline_minutes = 60
[model]
id = "{model}"
[dataset]
local_file = "{DATASET}"
[training]
max_steps = {steps}
[compute]
gpu = ["RTX 4090"]
[attempts]
max_attempts = 1
queue_minutes = 30
''')
    return run_file


def start_flow(stack: LocalStack, run_file: Path) -> subprocess.Popen[str]:
    """`python -m flows.train run_file` against the stack, as a process of its own (as a Prefect process
    worker runs each flow run); its output goes to `run.log` beside the run file."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "RUNPOD_"))} | stack.client_env
    log = (run_file.parent / "run.log").open("w")
    return subprocess.Popen([sys.executable, "-m", "flows.train", str(run_file)], cwd=REPO, env=env, stdout=log,
                            stderr=subprocess.STDOUT, text=True)


def set_endpoint_limit(api_url: str, slots: int) -> None:
    """Create the `runpod-endpoints` limit with `slots`, or set an existing one to it (a bench owns its server)."""
    with httpx.Client(base_url=api_url, timeout=30) as http:
        if http.get(f"/v2/concurrency_limits/{ENDPOINT_LIMIT}").status_code == 404:
            http.post("/v2/concurrency_limits/", json={"name": ENDPOINT_LIMIT, "limit": slots}).raise_for_status()
        else:
            http.patch(f"/v2/concurrency_limits/{ENDPOINT_LIMIT}", json={"limit": slots}).raise_for_status()


def endpoints_of(account: Account, prefix: str) -> list[AccountEndpoint]:
    return sorted((e for e in account.endpoints if e.name.startswith(prefix)), key=lambda e: e.created_at)


def peak_alive(endpoints: list[AccountEndpoint]) -> int:
    """The most endpoints alive at once (a deletion at the instant of a creation frees its slot first)."""
    events = sorted([(e.created_at, 1) for e in endpoints] + [(e.deleted_at, -1) for e in endpoints if e.deleted_at],
                    key=lambda ev: (ev[0], ev[1]))
    alive = peak = 0
    for _, change in events:
        alive += change
        peak = max(peak, alive)
    return peak


def handoffs(endpoints: list[AccountEndpoint], slots: int) -> list[float]:
    """Seconds from each endpoint's deletion (its slot freed) to the next endpoint's creation on a freed
    slot, while runs queue: the time a slot (a GPU the account could use) stood idle between two runs."""
    freed = sorted(e.deleted_at for e in endpoints if e.deleted_at)
    later = [e.created_at for e in endpoints][slots:]
    return [(created - free).total_seconds() for free, created in zip(freed, later)]


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1), nearest rank; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def seconds(a: datetime, b: datetime) -> float:
    return (b - a).total_seconds()


def request_counts(pod: Localpod) -> dict[str, Any]:
    return pod.http.get("/requests").raise_for_status().json()


def control_plane_requests(counts: dict[str, Any]) -> int:
    """Requests the flows made (the RunPod API and job API), not the workers' protocol."""
    return sum(n for route, n in counts["by_route"].items()
               if route.split(" ", 1)[1].startswith("/v2") and not any(w in route for w in _WORKER_ROUTES))


@dataclass
class Usage:
    """CPU seconds (per process) and resident memory (MiB) of a set of processes at one instant."""

    cpu_by_pid: dict[int, float] = field(default_factory=dict)
    rss_mib: float = 0.0

    @property
    def cpu_s(self) -> float:
        return sum(self.cpu_by_pid.values())

    def cpu_since(self, before: Usage) -> float:
        """CPU seconds used since `before` by the processes alive at both instants (one that ended meanwhile
        takes its CPU time with it, which would make a plain difference of sums too small, even negative)."""
        return sum(cpu - before.cpu_by_pid[pid] for pid, cpu in self.cpu_by_pid.items() if pid in before.cpu_by_pid)


def process_usage(pids: list[int]) -> Usage:
    usage = Usage()
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            statm = Path(f"/proc/{pid}/statm").read_text().split()
        except (OSError, IndexError):
            continue  # ended meanwhile
        usage.cpu_by_pid[pid] = (int(stat[11]) + int(stat[12])) / _CLK_TCK  # utime, stime
        usage.rss_mib += int(statm[1]) * _PAGE_KB / 1024
    return usage


def group_pids(pgid: int) -> list[int]:
    """Every process of a process group (a service LocalStack started in its own session)."""
    pids = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if int(entry.joinpath("stat").read_text().rsplit(")", 1)[1].split()[2]) == pgid:
                pids.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue
    return pids


def write_json(path: Path | None, figures: dict[str, Any]) -> None:
    if path is not None:
        path.write_text(json.dumps(figures, indent=2, default=str))
        print(f"figures written to {path}")


def report_failures(run_files: list[Path], codes: list[int | None], lines: int = 25) -> None:
    """Print the end of each failed flow's log (`run.log` beside its run file): a bench's runs are many and
    its folder is temporary, so a failure's reason is printed, not left behind."""
    for run_file, code in zip(run_files, codes):
        if code != 0:
            log = run_file.parent / "run.log"
            tail = log.read_text(errors="replace").splitlines()[-lines:] if log.exists() else ["(no log)"]
            print(f"--- {run_file.parent.name}: exit status {code}; the end of its log:", *tail, sep="\n", flush=True)


def wait_all(processes: list[subprocess.Popen[str]], timeout_s: float) -> list[int | None]:
    """Wait for every flow process; those still running at the timeout are killed (by their pid)."""
    deadline = time.monotonic() + timeout_s
    codes: list[int | None] = []
    for proc in processes:
        try:
            codes.append(proc.wait(max(deadline - time.monotonic(), 0.1)))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
            codes.append(None)
    return codes
