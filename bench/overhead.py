"""Control-plane overhead, teardown latency and billed waste of clean runs, each against a baseline
measured in the same run.

    .venv/bin/python bench/overhead.py --runs 3

Starts its own local stack (a real `prefect server start` + localpod running the real worker on the
CPU), runs `--runs` clean `train` flows one after another on the tiny model (`python -m flows.train RUN_FILE`,
as a Prefect process worker would), and prints per run and as medians:
- overhead: what a run adds to its job's time at localpod (submitted → finished, the training itself plus the
  worker's start): the flow run's own (its start → end in Prefect, the run's duration in the UI) and the
  process's (its start → exit), split into where it goes: the process's start (Python, imports, the flow run's
  creation), the flow before its job is submitted (the checks, placement, the endpoint's create), after the
  job finished (teardown, collect, report) and the process's exit (Prefect joining its heartbeat thread, which
  sleeps in 1 s steps, and flushing its logs and events); beside a flow that does nothing but one task, timed
  the same way against the same server (the baseline: what any Prefect flow process costs here);
- teardown: seconds from the job finishing to its endpoint being deleted, over a bare DELETE + 404 GET
  cycle timed against the same localpod (the baseline);
- billed waste: the worker's billed lifetime over the job's time (1.0 = no idle worker billed), and its
  idle billed seconds split into before the job was submitted and after it finished.

With `--baseline-checkout DIR` (a checkout of another commit), that checkout's clean runs alternate with this one's
on the same stack, and its medians and this one's ratio to them are printed too: on a shared machine the load drifts
more between two batches than the change being measured.

The same figures with hold jobs (no training) and beside a bare script's: `bench/bare_script.py`.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import astuple, dataclass
from datetime import datetime
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from bench.chaos_lib import Localpod, write_run_file  # noqa: E402
from bench.chaos_scenarios import SCENARIOS  # noqa: E402
from deployments.local_stack import LOCALPOD_API_KEY, LocalStack, build_tiny_model  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Row:
    """One run's figures, in seconds (a median row: each column's median)."""

    process_s: float
    flow_s: float
    job_s: float
    start_s: float
    before_job_s: float
    after_job_s: float
    exit_s: float
    teardown_s: float
    billed_s: float
    idle_before_s: float
    idle_after_s: float
    flow_overhead_s: float
    """The flow run's time beyond its job's, per run (a median row's is the median of the runs', not the difference
    of the flow's and the job's medians, which are often of two different runs)."""
    process_overhead_s: float

    def describe(self, delete_cycle_s: float) -> str:
        return (f"flow run {self.flow_s:5.1f} s, job {self.job_s:5.1f} s: flow overhead "
                f"{self.flow_overhead_s:4.2f} s (before the job {self.before_job_s:4.2f} s, after it "
                f"{self.after_job_s:4.2f} s); process {self.process_s:5.1f} s: overhead "
                f"{self.process_overhead_s:4.2f} s (+ start {self.start_s:4.2f} s, exit {self.exit_s:4.2f} s); "
                f"teardown {self.teardown_s:4.2f} s "
                f"(x{self.teardown_s / delete_cycle_s:.0f} the bare delete cycle of {delete_cycle_s * 1000:.0f} ms); "
                f"billed x{self.billed_s / self.job_s:4.2f} the job (idle {self.idle_before_s:4.2f} s before submit, "
                f"{self.idle_after_s:4.2f} s after completion)")


@dataclass
class TimedRun:
    endpoint_prefix: str
    process_start: float
    process_end: float
    flow_start: float
    flow_end: float


BARE_FLOW = """
import sys
from prefect import flow, task

@task
def one_task():
    return 1

@flow(name="bare")
def bare():
    return one_task()

state = bare(return_state=True)
print(f"flow run {state.state_details.flow_run_id}: {state.name}")
sys.exit(0 if state.is_completed() else 1)
"""


def run_bare(stack: LocalStack) -> TimedRun | None:
    """A Prefect flow that does nothing but one task, as a process worker starts it."""
    return _timed(stack, [sys.executable, "-c", BARE_FLOW], endpoint_prefix="")


def run_clean(stack: LocalStack, workdir: Path, name: str, model: Path, max_steps: int,
              checkout: Path = REPO) -> TimedRun | None:
    """One clean run as a Prefect process worker starts it, of the flows of `checkout` (this one's by default); its
    process's and its flow run's start and end (Unix time); None (after printing its output) when it did not
    complete."""
    here = workdir / name
    here.mkdir(parents=True)
    run_file = write_run_file(here / "run.toml", SCENARIOS["clean"], name=name, model=model, store=here / "store",
                              max_steps=max_steps)
    return _timed(stack, [sys.executable, "-m", "flows.train", str(run_file)], endpoint_prefix=f"loraflow-{name}-",
                  cwd=checkout)


def _timed(stack: LocalStack, command: list[str], endpoint_prefix: str, cwd: Path = REPO) -> TimedRun | None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "RUNPOD_"))} | stack.client_env
    started = time.time()
    # `python -m` puts its working folder first on the path: the flows and tasks of `cwd` run.
    proc = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    ended = time.time()
    match = re.search(r"flow run ([0-9a-f-]{36}):", proc.stdout)
    if proc.returncode != 0 or match is None:
        print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
        return None
    flow_run = httpx.get(f"{stack.prefect_api_url}/flow_runs/{match.group(1)}", timeout=30).raise_for_status().json()
    return TimedRun(endpoint_prefix=endpoint_prefix, process_start=started, process_end=ended,
                    flow_start=datetime.fromisoformat(flow_run["start_time"]).timestamp(),
                    flow_end=datetime.fromisoformat(flow_run["end_time"]).timestamp())


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
    parser.add_argument("--baseline-checkout", type=Path, default=None,
                        help="a checkout of another commit (e.g. `git worktree add ../base <rev>`): its clean runs "
                             "alternate with this one's on the same stack, and both medians are printed with their "
                             "ratio (the load's drift falls on both alike)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="loraflow-overhead-") as tmp:
        root = Path(tmp)
        model = build_tiny_model(root / "tiny-model")
        with LocalStack(root / "stack") as stack:
            pod = Localpod(stack.localpod_url)
            baseline_s = delete_cycle_seconds(stack.localpod_url)
            bare_runs = [run_bare(stack) for _ in range(args.runs)]
            if None in bare_runs:
                return 1
            rows, baseline_rows = [], []
            # With a baseline checkout its runs alternate with this one's, each first in every other pair.
            plan = [(i, REPO) for i in range(args.runs)] if args.baseline_checkout is None else [
                (i, checkout) for i in range(args.runs)
                for checkout in ((REPO, args.baseline_checkout) if i % 2 else (args.baseline_checkout, REPO))]
            for n, (i, checkout) in enumerate(plan):
                run = run_clean(stack, root / "runs", f"ovh{n:02d}-clean", model, args.max_steps, checkout)
                if run is None:
                    return 1
                account = pod.account()
                [endpoint] = [e for e in account.endpoints if e.name.startswith(run.endpoint_prefix)]
                [job] = [j for j in account.jobs if j.endpoint_id == endpoint.id]
                workers = [w for w in account.workers if w.endpoint_id == endpoint.id]
                submitted, finished = job.created_at.timestamp(), job.finished_at.timestamp()
                job_s = finished - submitted
                billed_s = sum(((w.ended_at or job.finished_at) - w.started_at).total_seconds() for w in workers)
                teardown_s = endpoint.deleted_at.timestamp() - finished
                before_s = sum(max(0.0, submitted - w.started_at.timestamp()) for w in workers)
                after_s = sum(max(0.0, (w.ended_at or endpoint.deleted_at).timestamp() - finished) for w in workers)
                row = Row(process_s=run.process_end - run.process_start, flow_s=run.flow_end - run.flow_start,
                          job_s=job_s, start_s=run.flow_start - run.process_start,
                          before_job_s=submitted - run.flow_start,
                          after_job_s=run.flow_end - finished, exit_s=run.process_end - run.flow_end,
                          teardown_s=teardown_s, billed_s=billed_s, idle_before_s=before_s, idle_after_s=after_s,
                          flow_overhead_s=run.flow_end - run.flow_start - job_s,
                          process_overhead_s=run.process_end - run.process_start - job_s)
                (rows if checkout == REPO else baseline_rows).append(row)
                which = "" if args.baseline_checkout is None else " (baseline)" if checkout != REPO else " (this)"
                print(f"run {i}{which}: {row.describe(baseline_s)}", flush=True)
    median = _median(rows)
    print(f"\nmedians over {len(rows)} runs: {median.describe(baseline_s)}")
    if baseline_rows:
        base = _median(baseline_rows)
        print(f"the baseline checkout's, over {len(baseline_rows)} runs alternating with them: "
              f"{base.describe(baseline_s)}")
        print("this checkout against the baseline: " + ", ".join(
            f"{label} x{getattr(median, field) / getattr(base, field):.2f}" for label, field in (
                ("flow overhead", "flow_overhead_s"), ("before the job", "before_job_s"),
                ("after it", "after_job_s"), ("teardown", "teardown_s"),
                ("idle billed after completion", "idle_after_s"))))
    bare_process = statistics.median(r.process_end - r.process_start for r in bare_runs)
    bare_flow = statistics.median(r.flow_end - r.flow_start for r in bare_runs)
    print(f"a flow that does nothing but one task (median of {len(bare_runs)}): flow run {bare_flow:4.2f} s, process "
          f"{bare_process:4.2f} s; a train run's process overhead beyond it: "
          f"{median.process_overhead_s - bare_process:4.2f} s "
          f"(x{median.process_overhead_s / bare_process:.2f} the bare flow's process)")
    return 0


def _median(rows: list[Row]) -> Row:
    return Row(*(statistics.median(column) for column in zip(*(astuple(row) for row in rows))))


if __name__ == "__main__":
    sys.exit(main())
