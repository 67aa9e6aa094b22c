"""What Prefect costs a run: the same RunPod calls made by a bare script (create → run → poll → delete)
beside the `train` flow, one run at a time against the same localpod, with hold jobs of a fixed length
(no training), and where a run's billed idle seconds go (before the submit, after the completion).

    .venv/bin/python bench/bare_script.py                      # 3 + 3 runs of 6 s jobs, ~3 minutes
    .venv/bin/python bench/bare_script.py --runs 5 --hold 10 --json bare.json

Starts its own local stacks (a real `prefect server start` + localpod with `--hold-jobs`), one whose hold
worker reports an ETA (the flow polls adaptively: fast near the end) and one whose worker reports none
(the flow polls every 2 s, as before adaptive polling). For each, per run and as medians:
- overhead: the run's wall time minus its job's time at localpod (submitted → finished); the bare
  script's is the floor, so flow/bare is the cost of Prefect itself;
- teardown: seconds from the job finishing to its endpoint being deleted;
- billed idle: the worker's billed seconds before its job was submitted, and after it finished (the
  teardown, then the worker's own exit once localpod stops it, which the control plane does not decide).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from bench.chaos_lib import Localpod, wait_for  # noqa: E402
from bench.scale_lib import (  # noqa: E402
    endpoints_of,
    hold_model,
    hold_stack,
    median,
    seconds,
    start_flow,
    write_hold_run,
    write_json,
)
from deployments.local_stack import LOCALPOD_API_KEY  # noqa: E402
from tasks.runpod.jobs import FAST_POLL_S  # noqa: E402

TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMED_OUT")


def bare_run(localpod_url: str, name: str, store_url: str, steps: int = 4) -> float:
    """One run as a minimal script makes it: create the endpoint, POST /run, poll /status every
    `FAST_POLL_S` until the job ends, DELETE and GET until 404. Returns its wall seconds."""
    endpoint_body = {"name": name, "type": "QUEUE", "scaling": {"type": "QUEUE_DELAY", "queueDelay": 4}, "image": "x",
                     "gpu": {"pools": ["ADA_24"]}, "workers": {"min": 0, "max": 1, "idleTimeout": 5}}
    job_input = {"run_id": name, "model": {"id": "/hold"}, "dataset": {"store_path": "runs/x/train.jsonl"},
                 "training": {"max_steps": steps}, "artifact_store": store_url}
    started = time.monotonic()
    with httpx.Client(base_url=f"{localpod_url}/v2", headers={"Authorization": f"Bearer {LOCALPOD_API_KEY}"},
                      timeout=30) as http:
        endpoint = http.post("/serverless", json=endpoint_body).raise_for_status().json()
        job = http.post(f"/{endpoint['id']}/run", json={"input": job_input}).raise_for_status().json()
        for _ in range(100_000):  # bounded: a hold job ends by itself
            if http.get(f"/{endpoint['id']}/status/{job['id']}").raise_for_status().json()["status"] in TERMINAL:
                break
            time.sleep(FAST_POLL_S)
        http.delete(f"/serverless/{endpoint['id']}").raise_for_status()
        while http.get(f"/serverless/{endpoint['id']}").status_code != 404:
            time.sleep(0.05)
    return time.monotonic() - started


def measure(pod: Localpod, prefix: str, wall_s: float) -> dict[str, float]:
    """A finished run's figures from localpod's records of its endpoint, job and worker (once the worker,
    stopped by the delete, has exited: its billed time ends there)."""

    def workers_ended():
        account = pod.account()
        [endpoint] = endpoints_of(account, prefix)
        return account if all(w.ended_at for w in account.workers if w.endpoint_id == endpoint.id) else None

    account = wait_for(workers_ended, timeout_s=30) or pod.account()
    [endpoint] = endpoints_of(account, prefix)
    [job] = [j for j in account.jobs if j.endpoint_id == endpoint.id]
    workers = [w for w in account.workers if w.endpoint_id == endpoint.id]
    job_s = seconds(job.created_at, job.finished_at)
    return {
        "wall_s": wall_s, "job_s": job_s, "overhead_s": wall_s - job_s,
        "teardown_s": seconds(job.finished_at, endpoint.deleted_at),
        "idle_before_submit_s": sum(max(0.0, seconds(w.started_at, job.created_at)) for w in workers),
        "idle_after_completion_s": sum(max(0.0, seconds(job.finished_at, w.ended_at or endpoint.deleted_at))
                                       for w in workers),
        "endpoint_before_submit_s": seconds(endpoint.created_at, job.created_at),
    }


def run_mode(root: Path, hold_s: float, runs: int, eta: bool) -> dict[str, list[dict[str, float]]]:
    label = "adaptive" if eta else "fixed-2s"
    rows: dict[str, list[dict[str, float]]] = {"bare": [], "flow": []}
    model = hold_model(root)
    with hold_stack(root / f"stack-{label}", hold_s, eta=eta) as stack:
        pod = Localpod(stack.localpod_url)
        for i in range(runs):
            name = f"bare{i:02d}-{label}"
            wall = bare_run(stack.localpod_url, f"loraflow-{name}-x", f"file://{root / name / 'store'}")
            rows["bare"].append(measure(pod, f"loraflow-{name}-", wall))
            name = f"flow{i:02d}-{label}"
            started = time.monotonic()
            proc = start_flow(stack, write_hold_run(root / name, name, model))
            if proc.wait(600) != 0:
                sys.exit(f"flow {name} failed:\n{(root / name / 'run.log').read_text()[-3000:]}")
            rows["flow"].append(measure(pod, f"loraflow-{name}-", time.monotonic() - started))
            for kind in ("bare", "flow"):
                r = rows[kind][-1]
                print(f"{label:9} {kind} {i}: wall {r['wall_s']:5.2f} s  job {r['job_s']:5.2f} s  overhead "
                      f"{r['overhead_s']:5.2f} s  teardown {r['teardown_s']:4.2f} s  billed idle before submit "
                      f"{r['idle_before_submit_s']:4.2f} s / after completion {r['idle_after_completion_s']:4.2f} s",
                      flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="bare runs and flow runs per polling mode")
    parser.add_argument("--hold", type=float, default=6.0, help="seconds each job holds its worker")
    parser.add_argument("--json", type=Path, help="write the figures and every run's row here")
    args = parser.parse_args()
    figures: dict[str, object] = {"runs": args.runs, "hold_s": args.hold}
    with tempfile.TemporaryDirectory(prefix="loraflow-bare-") as tmp:
        for eta in (False, True):
            label = "adaptive" if eta else "fixed-2s"
            figures[label] = run_mode(Path(tmp), args.hold, args.runs, eta)
    print(f"\n=== bare script vs flow: medians of {args.runs} runs, {args.hold:g} s hold jobs ===")
    print(f"{'flow polling':12} {'run':5} {'wall s':>7} {'job s':>6} {'overhead s':>10} {'teardown s':>10} "
          f"{'idle before submit s':>20} {'idle after completion s':>23}")
    summary = {}
    for label in ("fixed-2s", "adaptive"):
        for kind in ("bare", "flow"):
            rows = figures[label][kind]  # type: ignore[index]
            med = {k: median([r[k] for r in rows]) for k in rows[0]}
            summary[f"{label}/{kind}"] = med
            print(f"{label:12} {kind:5} {med['wall_s']:7.2f} {med['job_s']:6.2f} {med['overhead_s']:10.2f} "
                  f"{med['teardown_s']:10.2f} {med['idle_before_submit_s']:20.2f} {med['idle_after_completion_s']:23.2f}")
    for label in ("fixed-2s", "adaptive"):
        flow, bare = summary[f"{label}/flow"], summary[f"{label}/bare"]
        print(f"{label}: Prefect's cost per run = flow overhead / bare overhead = x{flow['overhead_s'] / bare['overhead_s']:.1f} "
              f"({flow['overhead_s']:.2f} s vs {bare['overhead_s']:.2f} s; +{flow['overhead_s'] - bare['overhead_s']:.2f} s); "
              f"teardown {flow['teardown_s']:.2f} s vs {bare['teardown_s']:.2f} s")
    figures["medians"] = summary
    write_json(args.json, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
