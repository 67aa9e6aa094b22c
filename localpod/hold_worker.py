"""A hold worker: a real `runpod.serverless` worker whose jobs train nothing. Each job holds its worker
for a fixed time, reporting progress every second, then stores a result the flow accepts as complete,
so a benchmark measures the control plane (slots, polling, teardown) and not training.

localpod starts it in place of the loraflow worker when asked (`python -m localpod --hold-jobs 8`); it
runs with the worker environment's interpreter (it uses the worker's job contract and artifact store)
as a script, not from the shipped image, which carries no such mode:

    .venv-worker/bin/python localpod/hold_worker.py 8      # RUNPOD_* set by localpod

With `LOCALPOD_HOLD_ETA=0` in its environment its progress carries no ETA, so the control plane polls
it at its fixed base interval (the benchmarks' "before adaptive polling"). Everything it stores is
labelled as a hold job: the progress messages, `manifest.json`
(`"hold_job": true`) and the metrics' device (`localpod hold job (no training)`).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any

import runpod
from loraflow_worker.artifacts import open_store
from loraflow_worker.contract import JobInput, JobResult, Progress, TrainMetrics, run_prefix
from loraflow_worker.runtime.lifetime import exit_at_once_when_stopped_idle

HOLD_DEVICE = "localpod hold job (no training)"
PROGRESS_EVERY_S = 1.0  # as often as the real worker's training monitor may report


def hold_job(job: dict[str, Any], hold_s: float, *, eta: bool = True, sleep=time.sleep, clock=time.monotonic,
             report=runpod.serverless.progress_update) -> dict[str, Any]:
    """Hold the job for `hold_s` seconds as `max_steps` fake training steps, then store `metrics.json`,
    `result.json`, `manifest.json` and `DONE` (last) in the run's store; returns the `JobResult`."""
    job_input = JobInput.model_validate(job["input"])
    steps = job_input.training.max_steps
    started = clock()
    losses: list[tuple[int, float]] = []
    for step in range(1, steps + 1):
        due = started + hold_s * step / steps
        while (left := due - clock()) > 0:
            elapsed = clock() - started
            report(job, _progress(step - 1, steps, elapsed, hold_s - elapsed if eta else None))
            sleep(min(PROGRESS_EVERY_S, left))
        losses.append((step, round(2.0 / step, 4)))
    report(job, Progress(stage="saving", step=steps, total_steps=steps, message="hold job: storing its result")
           .model_dump(mode="json", exclude_none=True))
    metrics = TrainMetrics(steps=steps, losses=losses, first_loss=losses[0][1] if losses else None,
                           final_loss=losses[-1][1] if losses else None, tokens=0,
                           wall_seconds=round(clock() - started, 3), device=HOLD_DEVICE)
    prefix = run_prefix(job_input.run_id)
    result = JobResult(run_id=job_input.run_id, attempt=job_input.attempt, run_prefix=prefix,
                       adapter_path=f"{prefix}/adapter", metrics=metrics)
    store = open_store(job_input.artifact_store)
    files = {
        f"{prefix}/metrics.json": metrics.model_dump_json().encode(),
        f"{prefix}/result.json": result.model_dump_json().encode(),
        f"{prefix}/manifest.json": json.dumps({"hold_job": True, "hold_seconds": hold_s}).encode(),
    }
    store.put(files, message=f"hold job result for run {job_input.run_id}")
    store.put({f"{prefix}/DONE": b""}, message=f"DONE for run {job_input.run_id}")  # last, as the real worker does
    return result.model_dump(mode="json")


def _progress(step: int, steps: int, elapsed_s: float, eta_s: float | None) -> dict[str, Any]:
    # Every report differs from the last, as a training worker's do (its loss, speed and ETA move), so the
    # control plane mirrors each one it sees, with or without an ETA.
    return Progress(stage="training", step=step, total_steps=steps, loss=round(2.0 / max(step, 1), 4),
                    eta_seconds=None if eta_s is None else round(max(eta_s, 0.0), 1),
                    message=f"hold job: no training (localpod --hold-jobs), held {elapsed_s:.0f} s",
                    ).model_dump(mode="json", exclude_none=True)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    seconds = float(sys.argv[1])
    del sys.argv[1]  # runpod.serverless.start reads the command line as its own
    with_eta = os.environ.get("LOCALPOD_HOLD_ETA", "1") != "0"
    exit_at_once_when_stopped_idle()  # stopped as the loraflow worker it stands in for is
    runpod.serverless.start({"handler": lambda job: hold_job(job, seconds, eta=with_eta)})
