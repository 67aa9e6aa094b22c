"""One control plane's capacity: how many runs, all waiting on their jobs and polling at once, one Prefect
server and one Prefect process worker hold on this machine, and what each run costs.

    .venv/bin/python bench/capacity.py                                  # 2, 4, 8 runs; ~10 minutes
    .venv/bin/python bench/capacity.py --levels 10,25,50,100 --start-allowance 6   # the issue's sizes (~1 hour)
    .venv/bin/python bench/capacity.py --fixed-at 0 --json capacity.json   # no before/after comparison

For each level M it starts the team setup (`deployments/team_stack.py`: Prefect on PostgreSQL, slot
leases in Redis) with one `prefect worker start --pool loraflow --limit M` and localpod running hold jobs
(every job holds its worker T seconds and trains nothing; T is `--hold` plus `--start-allowance` seconds
per run, so that the last flow run starts before the first job ends), deploys the `train` flow with
`prefect deploy`, and creates M runs of it at once: the worker runs each in a process of its own, as it
would for a team. While all M jobs are running (the window: the last job started → the first ended) it
measures, per run:
- CPU, as % of one core: the Prefect server, PostgreSQL and Redis, the worker process itself, the flow-run
  processes under it, localpod;
- memory: a flow-run process's resident MiB, the worker's and the server's;
- requests per second the flows make to localpod (RunPod's API and `/status` polls; the RunPod workers'
  own protocol is not counted);
and after the runs end, each run's overhead (created → ended in Prefect, minus its job's time at
localpod). The knee is the first level whose median overhead per run exceeds 1.5 × the smallest level's,
or whose control-plane CPU reaches 80 % of the machine's cores: from there, more runs cost each run more.

Before/after adaptive polling: `--fixed-at M` (default: the largest level) repeats level M with hold jobs
that report no ETA, so the flows poll `/status` every 2 s as before.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import tomllib
from datetime import datetime
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from bench.chaos_lib import Localpod  # noqa: E402
from bench.scale_lib import (  # noqa: E402
    control_plane_requests,
    endpoints_of,
    group_pids,
    hold_env,
    hold_model,
    median,
    process_usage,
    request_counts,
    seconds,
    set_endpoint_limit,
    write_hold_run,
    write_json,
)
from deployments.team_stack import RUN_TOKEN_BLOCK, TeamStack, descendants  # noqa: E402

KNEE_OVERHEAD_GROWTH = 1.5
KNEE_CPU_SHARE = 0.8
FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def run_level(root: Path, level: int, hold_s: float, label: str, eta: bool = True) -> dict[str, float]:
    """A fresh team stack with one worker, `level` deployment runs at once; the figures per run."""
    with TeamStack(root / f"stack-{label}{level}", workers=1, worker_limit=level, worker_quota=level + 2,
                   runpod_worker_env=hold_env(hold_s, eta)) as team:
        api = team.local.prefect_api_url
        set_endpoint_limit(api, level + 2)
        spec = tomllib.loads(write_hold_run(root / f"{label}{level}", "capacity", hold_model(root)).read_text())
        # The team stack requires a token of one's own and the run's files inside its inputs folder.
        spec |= {"hub_token_secret": RUN_TOKEN_BLOCK,
                 "dataset": spec["dataset"] | {"local_file": str(team.input_file(Path(spec["dataset"]["local_file"])))}}
        deployment = team.deploy("flows/train.py:train", "capacity", {"spec": spec})
        return _measure(team, deployment, level, hold_s, label)


def _measure(team: TeamStack, deployment: str, level: int, hold_s: float, label: str) -> dict[str, float]:
    api = team.local.prefect_api_url
    pod = Localpod(team.local.localpod_url)
    names = [f"c{label}{level:03d}-{i:03d}" for i in range(level)]
    prefix = f"loraflow-c{label}{level:03d}-"
    ids = {httpx.post(f"{api}/deployments/{deployment}/create_flow_run", json={"parameters": {"name": name}},
                      timeout=30).raise_for_status().json()["id"]: name for name in names}
    started = time.monotonic()

    def jobs():
        account = pod.account()
        endpoint_ids = {e.id for e in endpoints_of(account, prefix)}
        return [j for j in account.jobs if j.endpoint_id in endpoint_ids]

    # The window opens once every job runs (started by its worker) and closes when the first ends.
    while time.monotonic() - started < hold_s + 900:
        if (code := team.services["worker-1"].process.poll()) is not None:
            raise RuntimeError(f"the Prefect worker exited ({code}) with {level} runs to start; see "
                               f"{team.services['worker-1'].log_path} and the server's log beside it")
        current = jobs()
        if any(j.finished_at for j in current) or (len(current) == level and all(j.worker_id for j in current)):
            break
        time.sleep(1.0)
    worker = team.services["worker-1"].process.pid
    groups = {
        "server": group_pids(team.local.services["prefect"].process.pid),
        # PostgreSQL's backends are group leaders of their own: found as the postmaster's children.
        "database": [pg := team.services["postgres"].process.pid, *descendants(pg), team.services["redis"].process.pid],
        "worker": [worker],
        "runs": descendants(worker),
        "localpod": group_pids(team.local.services["localpod"].process.pid),
    }
    before = {k: process_usage(pids) for k, pids in groups.items()}
    before_requests, opened = request_counts(pod), time.monotonic()
    while not any(j.finished_at for j in jobs()) and time.monotonic() - opened < hold_s:
        time.sleep(1.0)
    after = {k: process_usage(pids) for k, pids in groups.items()}
    window = max(time.monotonic() - opened, 1e-6)
    requests = control_plane_requests(request_counts(pod)) - control_plane_requests(before_requests)
    if window < 10:
        print(f"{label} {level} runs: the window with every job running lasted {window:.1f} s: raise "
              "--start-allowance (the flows took longer to start than the jobs last)", flush=True)

    deadline = time.monotonic() + hold_s + 900
    while time.monotonic() < deadline:
        found = httpx.post(f"{api}/flow_runs/filter", json={"flow_runs": {"id": {"any_": list(ids)}}},
                           timeout=30).raise_for_status().json()
        if all(r["state"]["type"] in FINAL for r in found):
            break
        time.sleep(2.0)
    for run in found:
        if run["state"]["type"] != "COMPLETED":
            print(f"--- {ids[run['id']]} ({run['id']}): {run['state']['type']}: "
                  f"{(run['state'].get('message') or '')[:1500]}", flush=True)
    account = pod.account()
    endpoints = endpoints_of(account, prefix)
    overheads = []
    for run in found:
        name = ids[run["id"]]
        job = next((j for e in endpoints if e.name.startswith(f"loraflow-{name}-")
                    for j in account.jobs if j.endpoint_id == e.id), None)
        if job is not None and job.finished_at and run["end_time"]:
            wall = seconds(datetime.fromisoformat(run["created"]), datetime.fromisoformat(run["end_time"]))
            overheads.append(wall - seconds(job.created_at, job.finished_at))
    pct = 100 / window / level

    def cpu(name: str) -> float:
        return after[name].cpu_since(before[name]) * pct

    result = {
        "runs": level, "completed": sum(r["state"]["type"] == "COMPLETED" for r in found), "window_s": window,
        "server_cpu_pct_per_run": cpu("server"),
        "database_cpu_pct_per_run": cpu("database"),
        "worker_cpu_pct_per_run": cpu("worker"),
        "flow_cpu_pct_per_run": cpu("runs"),
        "localpod_cpu_pct_per_run": cpu("localpod"),
        "control_plane_cpu_cores": sum(after[k].cpu_since(before[k]) for k in groups) / window,
        "flow_rss_mib_per_run": after["runs"].rss_mib / level,
        "worker_rss_mib": after["worker"].rss_mib,
        "server_rss_mib": after["server"].rss_mib,
        "requests_per_s_per_run": requests / window / level,
        "overhead_median_s": median(overheads),
    }
    print(f"{label} {level:3d} runs: window {window:5.1f} s  server {cpu('server'):5.2f} %/run  db "
          f"{cpu('database'):5.2f}  worker {cpu('worker'):5.2f}  flows {cpu('runs'):5.2f}  localpod {cpu('localpod'):5.2f}  "
          f"run RSS {result['flow_rss_mib_per_run']:5.0f} MiB  {result['requests_per_s_per_run']:.2f} req/s/run  "
          f"overhead {result['overhead_median_s']:5.1f} s  ({result['completed']}/{level} completed)", flush=True)
    return result


def knee(results: list[dict[str, float]], cores: int) -> int | None:
    base = results[0]["overhead_median_s"]
    for r in results:
        if r["overhead_median_s"] > KNEE_OVERHEAD_GROWTH * base or r["control_plane_cpu_cores"] >= KNEE_CPU_SHARE * cores:
            return int(r["runs"])
    return None


def per_run_cores(r: dict[str, float]) -> float:
    """What one waiting run costs the control plane, in cores (everything but starting it)."""
    return sum(r[f"{k}_cpu_pct_per_run"] for k in ("server", "database", "worker", "flow", "localpod")) / 100


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", default="2,4,8", help="concurrent runs per level, comma-separated")
    parser.add_argument("--hold", type=float, default=60.0,
                        help="seconds each job holds its worker once every flow run has started")
    parser.add_argument("--start-allowance", type=float, default=5.0,
                        help="seconds per run added to a level's hold, for starting its flow-run processes")
    parser.add_argument("--fixed-at", type=int, default=-1,
                        help="repeat this level with fixed 2 s polling (default: the largest level; 0: skip)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    levels = [int(n) for n in args.levels.split(",")]
    fixed_at = max(levels) if args.fixed_at < 0 else args.fixed_at
    cores = os.cpu_count() or 1
    available_mib = int(Path("/proc/meminfo").read_text().split("MemAvailable:")[1].split()[0]) / 1024
    figures: dict[str, object] = {"hold_s": args.hold, "start_allowance_s": args.start_allowance, "cores": cores,
                                  "available_mib": available_mib}

    def hold(level: int) -> float:
        return args.hold + args.start_allowance * level

    with tempfile.TemporaryDirectory(prefix="loraflow-capacity-") as tmp:
        root = Path(tmp)
        results = [run_level(root, level, hold(level), "a") for level in levels]
        fixed = run_level(root, fixed_at, hold(fixed_at), "f", eta=False) if fixed_at else None
    print(f"\n=== control-plane capacity on {cores} cores: one Prefect server (PostgreSQL, Redis) and one process "
          f"worker; per run, while all wait on their jobs ===")
    print(f"{'runs':>5} {'server %cpu':>11} {'db %cpu':>7} {'worker %cpu':>11} {'flow %cpu':>9} {'localpod %cpu':>13} "
          f"{'cp cores':>8} {'flow MiB':>8} {'worker MiB':>10} {'server MiB':>10} {'req/s':>6} {'overhead s':>10}")
    for r in results + ([fixed] if fixed else []):
        tag = " (fixed 2 s polls)" if r is fixed else ""
        print(f"{int(r['runs']):5d} {r['server_cpu_pct_per_run']:11.2f} {r['database_cpu_pct_per_run']:7.2f} "
              f"{r['worker_cpu_pct_per_run']:11.2f} {r['flow_cpu_pct_per_run']:9.2f} {r['localpod_cpu_pct_per_run']:13.2f} "
              f"{r['control_plane_cpu_cores']:8.2f} {r['flow_rss_mib_per_run']:8.0f} {r['worker_rss_mib']:10.0f} "
              f"{r['server_rss_mib']:10.0f} {r['requests_per_s_per_run']:6.2f} {r['overhead_median_s']:10.1f}{tag}")
    found = knee(results, cores)
    print(f"knee: {found} runs" if found else f"knee: not reached up to {max(levels)} runs")
    top = results[-1]
    by_cpu = KNEE_CPU_SHARE * cores / per_run_cores(top)
    by_memory = KNEE_CPU_SHARE * available_mib / top["flow_rss_mib_per_run"]
    print(f"while waiting, a run costs {per_run_cores(top) * 100:.1f} % of a core and {top['flow_rss_mib_per_run']:.0f} MiB "
          f"(its flow-run process): one worker on these {cores} cores and {available_mib / 1024:.1f} GiB free holds "
          f"~{by_cpu:.0f} waiting runs by CPU and ~{by_memory:.0f} by memory ({KNEE_CPU_SHARE:.0%} of each); starting "
          "them costs far more: see the overhead column")
    if fixed:
        [same] = [r for r in results if r["runs"] == fixed_at] or [None]
        if same:
            print(f"adaptive vs fixed 2 s polling at {fixed_at} runs: requests x{same['requests_per_s_per_run'] / fixed['requests_per_s_per_run']:.2f}, "
                  f"flow CPU x{same['flow_cpu_pct_per_run'] / fixed['flow_cpu_pct_per_run']:.2f}, "
                  f"server CPU x{same['server_cpu_pct_per_run'] / fixed['server_cpu_pct_per_run']:.2f}")
    figures |= {"levels": results, "fixed": fixed, "knee_runs": found, "runs_by_cpu": by_cpu, "runs_by_memory": by_memory}
    write_json(args.json, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
