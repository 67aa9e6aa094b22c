"""Control-plane overhead, teardown latency and billed waste of clean runs, each against a baseline
measured in the same run.

    .venv/bin/python bench/overhead.py --runs 3

Starts its own local stack (a real `prefect server start` + localpod running the real worker on the
CPU), runs `--runs` clean `train` flows one after another on the tiny model, and prints per run and as
medians:
- overhead: the flow's wall time over its job's time at localpod (submitted → finished), the part of a
  run that is the training itself plus the worker's start;
- teardown: seconds from the job finishing to its endpoint being deleted, over a bare DELETE + 404 GET
  cycle timed against the same localpod (the baseline);
- billed waste: the worker's billed lifetime over the job's time (1.0 = no idle worker billed), and its
  idle billed seconds split into before the job was submitted and after it finished.

The same figures with hold jobs (no training) and beside a bare script's: `bench/bare_script.py`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from bench.chaos_lib import Localpod, run_scenario  # noqa: E402
from bench.chaos_scenarios import SCENARIOS  # noqa: E402
from deployments.local_stack import (  # noqa: E402
    LOCALPOD_API_KEY,
    LocalStack,
    build_tiny_model,  # noqa: E402
)


def delete_cycle_seconds(localpod_url: str, samples: int = 5) -> float:
    """Median seconds of create-free teardown as the client does it: DELETE, then GET until 404."""
    headers = {"Authorization": f"Bearer {LOCALPOD_API_KEY}"}
    body = {"name": "loraflow-bench-baseline", "type": "QUEUE", "scaling": {"type": "QUEUE_DELAY", "queueDelay": 4},
            "image": "x", "gpu": {"pools": ["ADA_24"]}, "workers": {"min": 0, "max": 1}}
    times = []
    with httpx.Client(base_url=f"{localpod_url}/v2", headers=headers, timeout=30) as http:
        for _ in range(samples):
            endpoint = http.post("/serverless", json=body).raise_for_status().json()
            started = time.monotonic()
            http.delete(f"/serverless/{endpoint['id']}").raise_for_status()
            assert http.get(f"/serverless/{endpoint['id']}").status_code == 404
            times.append(time.monotonic() - started)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="clean runs, one after another")
    parser.add_argument("--max-steps", type=int, default=20, help="training steps per run")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="loraflow-overhead-") as tmp:
        root = Path(tmp)
        model = build_tiny_model(root / "tiny-model")
        with LocalStack(root / "stack") as stack:
            pod = Localpod(stack.localpod_url)
            baseline_s = delete_cycle_seconds(stack.localpod_url)
            rows = []
            for i in range(args.runs):
                record = run_scenario(stack, pod, SCENARIOS["clean"], name=f"ovh{i:02d}-clean", workdir=root / "runs",
                                      model=model, max_steps=args.max_steps)
                if record.returncode != 0:
                    print(record.output[-3000:], file=sys.stderr)
                    return 1
                account = pod.account()
                [endpoint] = [e for e in account.endpoints if e.name.startswith(record.endpoint_prefix)]
                [job] = [j for j in account.jobs if j.endpoint_id == endpoint.id]
                workers = [w for w in account.workers if w.endpoint_id == endpoint.id]
                job_s = (job.finished_at - job.created_at).total_seconds()
                billed_s = sum(((w.ended_at or job.finished_at) - w.started_at).total_seconds() for w in workers)
                teardown_s = (endpoint.deleted_at - job.finished_at).total_seconds()
                before_s = sum(max(0.0, (job.created_at - w.started_at).total_seconds()) for w in workers)
                after_s = sum(max(0.0, ((w.ended_at or endpoint.deleted_at) - job.finished_at).total_seconds())
                              for w in workers)
                rows.append((record.wall_s, job_s, teardown_s, billed_s, before_s, after_s))
                print(f"run {i}: flow {record.wall_s:6.1f} s  job {job_s:6.1f} s  overhead x{record.wall_s / job_s:5.2f}  "
                      f"teardown {teardown_s:5.2f} s (x{teardown_s / baseline_s:6.1f} baseline)  "
                      f"billed x{billed_s / job_s:4.2f} of the job (idle {before_s:.2f} s before submit, "
                      f"{after_s:.2f} s after completion)", flush=True)
    wall, job, teardown, billed, before, after = (statistics.median(column) for column in zip(*rows))
    print(f"\nmedians over {len(rows)} runs: overhead x{wall / job:.2f} (flow {wall:.1f} s / job {job:.1f} s); "
          f"teardown {teardown:.2f} s = x{teardown / baseline_s:.1f} the bare delete cycle ({baseline_s * 1000:.0f} ms); "
          f"billed worker time x{billed / job:.2f} the job's time (idle {before:.2f} s before submit, {after:.2f} s "
          "after completion)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
