"""The training process of one job: resume or start, train, publish the run's artifacts with `DONE` last.

The handler's supervisor starts it in the job's (empty) work dir:

    python -m loraflow_worker.train_job <work_dir>/job.json

`job.json` is the validated job input, the process's only instructions (the run id and the artifact
store come from it, never from the environment). Progress goes to stdout as `LORAFLOW_PROGRESS {json}`
lines. On failure it prints the traceback, writes `error.json` (exception type and message) beside the
job file and exits with 1; the supervisor turns that into the job's error.
"""

from __future__ import annotations

import json
import logging
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

from loraflow_worker.artifacts import ArtifactStore, open_store
from loraflow_worker.contract import JobInput, JobResult, Progress, run_prefix
from loraflow_worker.supervisor import ERROR_FILE, PROGRESS_MARKER

if TYPE_CHECKING:
    from loraflow_worker.training_run import TrainOutcome

_OOM_TYPES = ("OutOfMemoryError",)  # torch.OutOfMemoryError, and torch.cuda.OutOfMemoryError (the same class)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m loraflow_worker.train_job WORK_DIR/job.json", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec = Path(args[0])
    try:
        job = JobInput.model_validate_json(spec.read_text())
        train_and_publish(job, spec.parent)
    except BaseException as exc:  # noqa: BLE001 - every failure must leave its report, even KeyboardInterrupt
        traceback.print_exc()
        report = {"type": type(exc).__name__, "message": str(exc),
                  "out_of_memory": type(exc).__name__ in _OOM_TYPES or "CUDA out of memory" in str(exc)}
        (spec.parent / ERROR_FILE).write_text(json.dumps(report))
        return 1
    return 0


def train_and_publish(job: JobInput, work_dir: Path) -> JobResult:
    """Train `job` in `work_dir` (resuming from the store's latest checkpoint, if any) and publish the
    adapter, metrics, manifest and result, then `DONE`."""
    # The training stack takes seconds to import: after the job file is read, not before.
    from loraflow_worker.checkpoints import CheckpointUploader, download_latest_checkpoint
    from loraflow_worker.heartbeat import Heartbeat

    if job.algorithm == "grpo":
        from loraflow_worker.grpo import train_grpo as train
    else:
        from loraflow_worker.sft import train_sft as train

    store = open_store(job.artifact_store)
    prefix = run_prefix(job.run_id)
    resume_from = download_latest_checkpoint(store, prefix, work_dir / "trainer")
    if resume_from is not None:
        report_progress(Progress(stage="loading", message=f"resuming from the checkpoint at step {resume_from.name.rpartition('-')[2]}"))
    callbacks = [Heartbeat(store, prefix, job.attempt)]
    if job.training.checkpoint_every_steps is not None:
        callbacks.append(CheckpointUploader(store, prefix, job.training.keep_checkpoints))
    outcome = train(job, store, work_dir, report_progress, callbacks=callbacks, resume_from=resume_from)
    report_progress(Progress(stage="saving", step=outcome.metrics.steps, message=f"saving adapter to {store.display_url(prefix)}"))
    result = JobResult(run_id=job.run_id, attempt=job.attempt, run_prefix=prefix, adapter_path=f"{prefix}/adapter",
                       metrics=outcome.metrics)
    _publish(store, prefix, outcome, result)
    return result


def report_progress(progress: Progress) -> None:
    """Hand a progress update to the supervisor (it posts it to RunPod)."""
    print(PROGRESS_MARKER + progress.model_dump_json(), flush=True)


def _publish(store: ArtifactStore, prefix: str, outcome: TrainOutcome, result: JobResult) -> None:
    """Everything in one commit (the Hub allows 128 commits/hour/repo), then DONE alone, last: a
    reader that sees DONE can rely on the rest being there."""
    files: dict[str, bytes | Path] = {
        f"{prefix}/adapter/{path.relative_to(outcome.adapter_dir).as_posix()}": path
        for path in sorted(outcome.adapter_dir.rglob("*"))
        if path.is_file()
    }
    files[f"{prefix}/metrics.json"] = outcome.metrics.model_dump_json(indent=2).encode()
    files[f"{prefix}/manifest.json"] = outcome.manifest.model_dump_json(indent=2).encode()
    files[f"{prefix}/result.json"] = result.model_dump_json(indent=2).encode()
    store.put(
        files,
        message=f"run {result.run_id} attempt {result.attempt}: adapter, metrics, manifest, result",
        # A previous attempt's adapter files must not mix with this one's.
        delete_prefixes=[f"{prefix}/adapter"],
    )
    done = json.dumps({"run_id": result.run_id, "attempt": result.attempt}).encode()
    store.put({f"{prefix}/DONE": done}, message=f"run {result.run_id} attempt {result.attempt}: DONE")


if __name__ == "__main__":
    sys.exit(main())
