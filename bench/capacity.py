"""One control plane's capacity: how many runs, all waiting on their jobs and polling at once, one Prefect
server and their flow processes sustain on this machine, and what each run costs.

    .venv/bin/python bench/capacity.py                                  # 2, 4, 8 runs; ~10 minutes
    .venv/bin/python bench/capacity.py --levels 10,25,50,100 --hold 240  # the issue's sizes (long)
    .venv/bin/python bench/capacity.py --fixed-at 0 --json capacity.json   # no before/after comparison

Starts a local stack (a real `prefect server start` + localpod `--hold-jobs T`: every job holds its
worker T seconds, no training) with the `runpod-endpoints` limit above the largest level, then for each
level M starts M `python -m flows.train` processes at once (as a Prefect process worker runs each flow
run in a process of its own). While all M jobs are running (the window: the last job started → the first
ended) it measures, per run:
- CPU, as % of one core: the Prefect server, the flow processes, localpod;
- memory: a flow process's resident MiB, and the server's;
- requests per second the flows make to localpod (RunPod's API and `/status` polls; the workers' own
  protocol is not counted);
and after the runs end, each run's overhead (its flow's wall time minus its job's time at localpod).
The knee is the first level whose median overhead per run exceeds 1.5 × the smallest level's, or whose
control-plane CPU reaches 80 % of the machine's cores: from there, more runs cost each run more.

Before/after adaptive polling: `--fixed-at M` (default: the largest level) repeats level M on a second
stack whose hold worker reports no ETA, so the flows poll `/status` every 2 s as before.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from bench.chaos_lib import Localpod  # noqa: E402
from bench.scale_lib import (  # noqa: E402
    control_plane_requests,
    endpoints_of,
    group_pids,
    hold_model,
    hold_stack,
    median,
    process_usage,
    request_counts,
    seconds,
    set_endpoint_limit,
    start_flow,
    wait_all,
    write_hold_run,
    write_json,
)
from deployments.local_stack import LocalStack  # noqa: E402

KNEE_OVERHEAD_GROWTH = 1.5
KNEE_CPU_SHARE = 0.8


def run_level(stack: LocalStack, root: Path, level: int, hold_s: float, label: str) -> dict[str, float]:
    pod = Localpod(stack.localpod_url)
    model = hold_model(root)
    prefix = f"loraflow-c{label}{level:03d}-"
    names = [f"c{label}{level:03d}-{i:03d}" for i in range(level)]
    started = time.monotonic()
    processes = [start_flow(stack, write_hold_run(root / name, name, model)) for name in names]

    def jobs():
        account = pod.account()
        ids = {e.id for e in endpoints_of(account, prefix)}
        return [j for j in account.jobs if j.endpoint_id in ids]

    # The window opens once every job runs (started by its worker) and closes when the first ends.
    while time.monotonic() - started < 900:
        current = jobs()
        if any(j.finished_at for j in current) or (len(current) == level and all(j.worker_id for j in current)):
            break
        time.sleep(1.0)
    server = group_pids(stack.services["prefect"].process.pid)
    pod_pids = group_pids(stack.services["localpod"].process.pid)
    flows = [p.pid for p in processes]
    before = (process_usage(server), process_usage(flows), process_usage(pod_pids), request_counts(pod), time.monotonic())
    while not any(j.finished_at for j in jobs()) and time.monotonic() - before[4] < hold_s:
        time.sleep(1.0)
    after = (process_usage(server), process_usage(flows), process_usage(pod_pids), request_counts(pod), time.monotonic())
    window = max(after[4] - before[4], 1e-6)
    if window < 10:
        print(f"{label} {level} runs: the window with every job running lasted {window:.1f} s: raise --hold "
              "(the flows took longer to start than the jobs last)", flush=True)
    walls = _walls(processes, started, timeout_s=hold_s + 600)
    codes = wait_all(processes, timeout_s=1)
    account = pod.account()
    endpoints = endpoints_of(account, prefix)
    overheads = []
    for name, wall in zip(names, walls):
        job = next((j for e in endpoints if e.name.startswith(f"loraflow-{name}-")
                    for j in account.jobs if j.endpoint_id == e.id), None)
        if job is not None and job.finished_at and wall is not None:
            overheads.append(wall - seconds(job.created_at, job.finished_at))
    pct = 100 / window / level
    result = {
        "runs": level, "completed": sum(c == 0 for c in codes), "window_s": window,
        "server_cpu_pct_per_run": (after[0].cpu_s - before[0].cpu_s) * pct,
        "flow_cpu_pct_per_run": (after[1].cpu_s - before[1].cpu_s) * pct,
        "localpod_cpu_pct_per_run": (after[2].cpu_s - before[2].cpu_s) * pct,
        "control_plane_cpu_cores": (after[0].cpu_s - before[0].cpu_s + after[1].cpu_s - before[1].cpu_s
                                    + after[2].cpu_s - before[2].cpu_s) / window,
        "flow_rss_mib_per_run": after[1].rss_mib / max(after[1].count, 1),
        "server_rss_mib": after[0].rss_mib,
        "requests_per_s_per_run": (control_plane_requests(after[3]) - control_plane_requests(before[3])) / window / level,
        "overhead_median_s": median(overheads),
    }
    print(f"{label} {level:3d} runs: window {window:5.1f} s  server {result['server_cpu_pct_per_run']:5.2f} %/run  "
          f"flows {result['flow_cpu_pct_per_run']:5.2f} %/run  localpod {result['localpod_cpu_pct_per_run']:5.2f} %/run  "
          f"flow RSS {result['flow_rss_mib_per_run']:5.0f} MiB  {result['requests_per_s_per_run']:.2f} req/s/run  "
          f"overhead {result['overhead_median_s']:5.1f} s  ({result['completed']}/{level} completed)", flush=True)
    return result


def _walls(processes: list, started: float, timeout_s: float) -> list[float | None]:
    """Each flow process's wall time from `started` to its exit (None: still running at the timeout)."""
    ended: dict[int, float] = {}
    deadline = time.monotonic() + timeout_s
    while len(ended) < len(processes) and time.monotonic() < deadline:
        for i, proc in enumerate(processes):
            if i not in ended and proc.poll() is not None:
                ended[i] = time.monotonic() - started
        time.sleep(0.2)
    return [ended.get(i) for i in range(len(processes))]


def knee(results: list[dict[str, float]], cores: int) -> int | None:
    base = results[0]["overhead_median_s"]
    for r in results:
        if r["overhead_median_s"] > KNEE_OVERHEAD_GROWTH * base or r["control_plane_cpu_cores"] >= KNEE_CPU_SHARE * cores:
            return int(r["runs"])
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", default="2,4,8", help="concurrent runs per level, comma-separated")
    parser.add_argument("--hold", type=float, default=60.0,
                        help="T: seconds each job holds its worker (longer than starting the largest level's flows)")
    parser.add_argument("--fixed-at", type=int, default=-1,
                        help="repeat this level with fixed 2 s polling (default: the largest level; 0: skip)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    levels = [int(n) for n in args.levels.split(",")]
    fixed_at = max(levels) if args.fixed_at < 0 else args.fixed_at
    cores = os.cpu_count() or 1
    figures: dict[str, object] = {"hold_s": args.hold, "cores": cores}
    with tempfile.TemporaryDirectory(prefix="loraflow-capacity-") as tmp:
        root = Path(tmp)
        with hold_stack(root / "stack-adaptive", args.hold, quota=max(levels) + 2) as stack:
            set_endpoint_limit(stack.prefect_api_url, max(levels) + 2)
            results = [run_level(stack, root, level, args.hold, "a") for level in levels]
        fixed = None
        if fixed_at:
            with hold_stack(root / "stack-fixed", args.hold, quota=fixed_at + 2, eta=False) as stack:
                set_endpoint_limit(stack.prefect_api_url, fixed_at + 2)
                fixed = run_level(stack, root, fixed_at, args.hold, "f")
    print(f"\n=== control-plane capacity on {cores} cores, {args.hold:g} s hold jobs (per run, while all wait on "
          "their jobs) ===")
    print(f"{'runs':>5} {'server %cpu':>11} {'flow %cpu':>9} {'localpod %cpu':>13} {'cp cores':>8} {'flow MiB':>8} "
          f"{'server MiB':>10} {'req/s':>6} {'overhead s':>10}")
    for r in results + ([fixed] if fixed else []):
        tag = " (fixed 2 s polls)" if r is fixed else ""
        print(f"{int(r['runs']):5d} {r['server_cpu_pct_per_run']:11.2f} {r['flow_cpu_pct_per_run']:9.2f} "
              f"{r['localpod_cpu_pct_per_run']:13.2f} {r['control_plane_cpu_cores']:8.2f} {r['flow_rss_mib_per_run']:8.0f} "
              f"{r['server_rss_mib']:10.0f} {r['requests_per_s_per_run']:6.2f} {r['overhead_median_s']:10.1f}{tag}")
    found = knee(results, cores)
    print(f"knee: {found} runs" if found else f"knee: not reached up to {max(levels)} runs")
    top = results[-1]
    per_run_cores = (top["server_cpu_pct_per_run"] + top["flow_cpu_pct_per_run"] + top["localpod_cpu_pct_per_run"]) / 100
    print(f"while waiting, a run costs {per_run_cores * 100:.1f} % of a core and {top['flow_rss_mib_per_run']:.0f} MiB: "
          f"{KNEE_CPU_SHARE * cores / per_run_cores:.0f} waiting runs would fill {KNEE_CPU_SHARE:.0%} of the "
          f"{cores} cores (starting them costs far more: see the overhead column)")
    if fixed:
        [same] = [r for r in results if r["runs"] == fixed_at] or [None]
        if same:
            print(f"adaptive vs fixed 2 s polling at {fixed_at} runs: requests x{same['requests_per_s_per_run'] / fixed['requests_per_s_per_run']:.2f}, "
                  f"flow CPU x{same['flow_cpu_pct_per_run'] / fixed['flow_cpu_pct_per_run']:.2f}, "
                  f"server CPU x{same['server_cpu_pct_per_run'] / fixed['server_cpu_pct_per_run']:.2f}")
    figures |= {"levels": results, "fixed": fixed, "knee_runs": found}
    write_json(args.json, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
