"""Quota throughput: N runs queued against a limit of K endpoint slots, each job holding its worker a fixed
T seconds (hold jobs: no training), under Prefect's default slot-wait setting and the recommended one.

    .venv/bin/python bench/quota.py                                   # N=12, K=3, T=10 s; ~5 minutes
    .venv/bin/python bench/quota.py --runs 60 --slots 5 --hold 30     # the issue's size (~15 minutes)
    .venv/bin/python bench/quota.py --waits 30,5,2 --json quota.json

For each wait setting (`PREFECT_SERVER_CONCURRENCY_MAXIMUM_CONCURRENCY_SLOT_WAIT_SECONDS`, the cap on the
Retry-After a queued run is told to wait before asking for a slot again) it starts a fresh local stack
(a real `prefect server start` + localpod `--hold-jobs T`), sets the `runpod-endpoints` limit to K, seeds
the limit's average slot occupancy (`--seed-occupancy`, default an hour: the server learns it from
releases, and bases the Retry-After it tells waiters on it, capped by the wait setting; real training
runs are long, so the cap is what binds, which T-second hold jobs alone would never show), takes all K
slots itself as a gate, starts N `python -m flows.train` processes, and opens the gate once every
run waits for a slot (so slow process starts on a loaded machine do not count). Then it prints:
- makespan (gate opened → last endpoint deleted) over the ideal ceil(N/K)·T, and over ceil(N/K) × the
  median endpoint life (create → delete: T plus worker start and teardown), which isolates queueing;
- the most endpoints alive at once at localpod (must never exceed K);
- slot hand-off: seconds from a slot freed (gate opened, or an endpoint deleted) to the next endpoint
  created on it, median and p95: the time a slot the account pays quota for stands idle;
- the Prefect server's CPU seconds per minute of makespan (the cost of the waiters' polling).
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from bench.chaos_lib import ENDPOINT_LIMIT, Localpod, wait_for  # noqa: E402
from bench.scale_lib import (  # noqa: E402
    PREFECT_DEFAULT_WAIT_S,
    endpoints_of,
    group_pids,
    hold_model,
    hold_stack,
    median,
    peak_alive,
    percentile,
    process_usage,
    report_failures,
    seconds,
    set_endpoint_limit,
    start_flow,
    wait_all,
    write_hold_run,
    write_json,
)

RECOMMENDED_WAIT_S = 5.0  # the local stack's and docs/running-on-runpod.md's setting; this bench is the evidence
_GATE_LEASE_S = 3600


def run_setting(root: Path, wait_s: float, runs: int, slots: int, hold_s: float,
                seed_s: float) -> dict[str, object]:
    label = f"wait{wait_s:g}"
    model = hold_model(root)
    with hold_stack(root / f"stack-{label}", hold_s, quota=slots + 2, wait_s=wait_s) as stack:
        pod = Localpod(stack.localpod_url)
        set_endpoint_limit(stack.prefect_api_url, slots)
        prefect = httpx.Client(base_url=stack.prefect_api_url, timeout=30)
        if seed_s:
            _seed_occupancy(prefect, slots, seed_s)
        gate = _post(prefect, "/v2/concurrency_limits/increment-with-lease", {
            "names": [ENDPOINT_LIMIT], "slots": slots, "mode": "concurrency", "lease_duration": _GATE_LEASE_S,
        }).json()["lease_id"]
        names = [f"q{i:02d}-{label}" for i in range(runs)]
        run_files = [write_hold_run(root / name, name, model) for name in names]
        processes = [start_flow(stack, run_file) for run_file in run_files]
        logs = [root / name / "run.log" for name in names]
        waiting = wait_for(lambda: all("Attempt 1 on" in log.read_text() for log in logs if log.exists())
                           and all(log.exists() for log in logs), timeout_s=600, interval_s=1.0)
        if not waiting:
            print(f"{label}: not every run reached its slot wait within 600 s; opening the gate anyway", flush=True)
        time.sleep(2.0)  # the last run's first slot request reaches the server
        server = group_pids(stack.services["prefect"].process.pid)
        cpu_before = process_usage(server)
        opened = datetime.now(timezone.utc)
        _post(prefect, "/v2/concurrency_limits/decrement-with-lease", {"lease_id": gate})
        codes = wait_all(processes, timeout_s=runs / slots * (hold_s + 120) + 300)
        report_failures(run_files, codes)
        endpoints = endpoints_of(pod.account(), "loraflow-q")
        server_cpu_s = process_usage(server).cpu_since(cpu_before)
        learned = prefect.get(f"/v2/concurrency_limits/{ENDPOINT_LIMIT}").raise_for_status().json()
    last_deleted = max((e.deleted_at for e in endpoints if e.deleted_at), default=opened)
    makespan = seconds(opened, last_deleted)
    freed = sorted([opened] * slots + [e.deleted_at for e in endpoints if e.deleted_at])
    created = [e.created_at for e in endpoints]
    handoff = [seconds(free, made) for free, made in zip(freed, created)]
    life = median([seconds(e.created_at, e.deleted_at) for e in endpoints if e.deleted_at])
    rounds = math.ceil(runs / slots)
    result = {
        "wait_s": wait_s, "runs": runs, "slots": slots, "hold_s": hold_s,
        "completed": sum(code == 0 for code in codes), "endpoints": len(endpoints),
        "makespan_s": makespan, "ideal_s": rounds * hold_s, "makespan_over_ideal": makespan / (rounds * hold_s),
        "endpoint_life_median_s": life, "makespan_over_rounds_of_life": makespan / (rounds * life),
        "peak_endpoints": peak_alive(endpoints), "handoff_s": handoff,
        "handoff_median_s": median(handoff), "handoff_p95_s": percentile(handoff, 0.95),
        "server_cpu_s_per_min": server_cpu_s / makespan * 60 if makespan else math.nan,
        "seeded_occupancy_s": seed_s, "avg_slot_occupancy_s_at_end": learned.get("avg_slot_occupancy_seconds"),
    }
    print(f"{label}: {result['completed']}/{runs} completed, makespan {makespan:.1f} s (ideal {rounds * hold_s:.0f} s), "
          f"peak endpoints {result['peak_endpoints']} (limit {slots}), hand-off median {result['handoff_median_s']:.2f} s "
          f"p95 {result['handoff_p95_s']:.2f} s", flush=True)
    return result


def _seed_occupancy(prefect: httpx.Client, slots: int, seed_s: float) -> None:
    """Move the limit's average slot occupancy to ~`seed_s` as releases of `seed_s`-long holds would: each
    release moves it 1/(2 × limit) of the way (Prefect 3.9.1, OCCUPANCY_SAMPLES_MULTIPLIER = 2)."""
    for _ in range(8 * slots):  # (1 - 1/(2K))^(8K) < 2 %
        _post(prefect, "/v2/concurrency_limits/increment", {"names": [ENDPOINT_LIMIT], "slots": slots,
                                                            "mode": "concurrency"})
        _post(prefect, "/v2/concurrency_limits/decrement", {"names": [ENDPOINT_LIMIT], "slots": slots,
                                                            "occupancy_seconds": seed_s * slots})


def _post(prefect: httpx.Client, path: str, body: dict[str, object]) -> httpx.Response:
    """POST, tried again on a 503 (the server's database busy on a loaded machine), up to 10 times."""
    for _ in range(9):
        response = prefect.post(path, json=body)
        if response.status_code != 503:
            break
        time.sleep(1.0)
    else:
        response = prefect.post(path, json=body)
    return response.raise_for_status()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=12, help="N: runs queued at once")
    parser.add_argument("--slots", type=int, default=3, help="K: the runpod-endpoints limit")
    parser.add_argument("--hold", type=float, default=10.0, help="T: seconds each job holds its worker")
    parser.add_argument("--waits", default=f"{PREFECT_DEFAULT_WAIT_S:g},{RECOMMENDED_WAIT_S:g}",
                        help="slot-wait settings to compare, seconds (default: Prefect's, then the recommended)")
    parser.add_argument("--seed-occupancy", type=float, default=3600.0,
                        help="the limit's average slot occupancy to start from, seconds (0: a fresh limit's 2 s)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="loraflow-quota-") as tmp:
        for wait_s in (float(w) for w in args.waits.split(",")):
            results.append(run_setting(Path(tmp), wait_s, args.runs, args.slots, args.hold, args.seed_occupancy))
    print(f"\n=== quota throughput: N={args.runs} runs, K={args.slots} slots, T={args.hold:g} s hold jobs, slot "
          f"occupancy seeded at {args.seed_occupancy:g} s ===")
    print(f"{'slot wait s':>11} {'done':>5} {'makespan s':>10} {'/ideal':>7} {'/rounds×life':>12} {'peak ≤K':>8} "
          f"{'hand-off med s':>14} {'p95 s':>6} {'server cpu s/min':>16}")
    for r in results:
        peak = f"{r['peak_endpoints']}{'' if r['peak_endpoints'] <= args.slots else ' (!)'}"
        print(f"{r['wait_s']:11g} {r['completed']:>5} {r['makespan_s']:10.1f} {r['makespan_over_ideal']:7.2f} "
              f"{r['makespan_over_rounds_of_life']:12.2f} {peak:>8} {r['handoff_median_s']:14.2f} "
              f"{r['handoff_p95_s']:6.2f} {r['server_cpu_s_per_min']:16.1f}")
    base = results[0]
    for r in results[1:]:
        print(f"wait {r['wait_s']:g} s vs {base['wait_s']:g} s: makespan x{r['makespan_s'] / base['makespan_s']:.2f}, "
              f"hand-off median x{r['handoff_median_s'] / base['handoff_median_s']:.2f}, "
              f"p95 x{r['handoff_p95_s'] / base['handoff_p95_s']:.2f}, "
              f"server CPU x{r['server_cpu_s_per_min'] / base['server_cpu_s_per_min']:.2f}")
    write_json(args.json, {"results": results})
    ok = all(r["peak_endpoints"] <= args.slots and r["completed"] == args.runs for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
