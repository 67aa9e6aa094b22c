"""The training process of one job: resume or start, train, publish the run's artifacts with `DONE` last
(or, when the job's deadline stops training, the adapter trained so far and a checkpoint to resume from).

The handler's supervisor starts it in the job's (empty) work dir:

    python -m loraflow_worker.training.train_job <work_dir>/job.json

`job.json` is the validated job input, the process's only instructions (the run id and the artifact
store come from it, never from the environment). Progress goes to stdout as `LORAFLOW_PROGRESS {json}`
lines. On success it writes the run's `JobResult` as `result.json` beside the job file: the job's output, with the
store commit that holds the adapter, which the stored copy cannot name. On failure it prints the traceback, writes
`error.json` (exception type and message, and which memory ran out, if any) beside the job file and exits with 1; the
supervisor turns that into the job's error.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from loraflow_worker.artifacts import ArtifactStore, ArtifactStoreError, open_store
from loraflow_worker.artifacts.pins import folder_sha256
from loraflow_worker.contract import JobInput, JobResult, PartialResult, Progress, run_prefix
from loraflow_worker.runtime.supervisor import child_main
from loraflow_worker.runtime.supervisor import send_progress as report_progress
from loraflow_worker.evaluation.evaluated import Evaluated, tracker_metrics
from loraflow_worker.training.tracking import finish_tracking, record_evaluations, start_tracking
from loraflow_worker.training.user_files import RunFilesStore

if TYPE_CHECKING:
    from transformers import TrainerCallback

    from loraflow_worker.training.run import TrainOutcome

DEADLINE_SAVE_RETRY_BUDGET_S = 30.0
"""The deadline save retries a rate-limited or failing Hub this long: it must end before the supervisor kills
the training process (`runtime.supervisor.DEADLINE_KILL_GRACE_S` past the deadline)."""


def main(argv: list[str] | None = None) -> int:
    return child_main(sys.argv[1:] if argv is None else argv, "loraflow_worker.training.train_job",
                      lambda spec: train_and_publish(JobInput.model_validate_json(spec.read_text()), spec.parent))


def train_and_publish(job: JobInput, work_dir: Path) -> JobResult:
    """Train `job` in `work_dir` (resuming from the latest checkpoint the run itself recorded, if any:
    `download_own_checkpoint`) and publish the
    adapter, metrics, manifest, result and `DONE` in one commit; returns the result with the adapter's hashes and that
    commit. The run's own files are read as the control plane stored them (`RunFilesStore`). When the job's deadline
    stops training first, store the adapter trained so far and a checkpoint of its last step instead (one commit, no
    `DONE`) and raise `DeadlineReached`."""
    # The training stack takes seconds to import: after the job file is read, not before.
    from loraflow_worker.training.checkpoints import CheckpointTimer, CheckpointUploader, download_own_checkpoint
    from loraflow_worker.training.monitor import DeadlineReached

    if job.algorithm == "grpo":
        from loraflow_worker.training.grpo import train_grpo as train
    elif job.algorithm == "dpo":
        from loraflow_worker.training.dpo import train_dpo as train
    else:
        from loraflow_worker.training.sft import train_sft as train

    store = RunFilesStore(open_store(job.artifact_store), job)
    prefix = run_prefix(job.run_id)
    resume_from, ignored = download_own_checkpoint(store, prefix, work_dir / "trainer", job.checkpoint_key)
    if resume_from is not None:
        report_progress(Progress(stage="loading",
                                 message=f"resuming from the checkpoint at step {_checkpoint_step(resume_from)}"))
    if ignored:  # the control plane logs it: whoever put them there is seen
        report_progress(Progress(stage="loading", message=_shorten(
            "checkpoints in the store ignored (not this run's own, or changed since it stored them): "
            + "; ".join(f"{name} ({why})" for name, why in ignored.items()))))
    callbacks: list[TrainerCallback] = [CheckpointUploader(store, prefix, job.training.keep_checkpoints,
                                                           key=job.checkpoint_key)]
    if job.training.early_stopping is not None:
        from loraflow_worker.training.early_stopping import EarlyStopping
        from loraflow_worker.training.run import TRAINED_ADAPTER

        # Before the uploader: its `on_save` puts the best evaluation's adapter into the checkpoint the uploader stores.
        callbacks.insert(0, EarlyStopping(job.training.early_stopping, job.algorithm, work_dir, TRAINED_ADAPTER))
    if job.training.checkpoint_every_minutes is not None:
        callbacks.append(CheckpointTimer(job.training.checkpoint_every_minutes * 60.0))
    from loraflow_worker.evaluation.after_training import evaluate_after_training, prepare_evaluation

    tasks = prepare_evaluation(job, store, work_dir)
    start_tracking(job, work_dir)
    outcome = train(job, store, work_dir, report_progress, callbacks=callbacks, resume_from=resume_from)
    evaluated = Evaluated()
    if outcome.deadline_checkpoint is None:
        # The task evaluations (and benchmarks) of the adapter the run keeps, stored in the same commit as it and
        # recorded by the trackers before they close.
        evaluated = evaluate_after_training(job, store, work_dir, outcome.adapter_dir, tasks, report_progress,
                                            outcome.metrics.steps)
        outcome.metrics = outcome.metrics.model_copy(update={
            "task_scores": evaluated.task_scores, "benchmark_scores": evaluated.benchmark_scores,
            "evaluation_stopped": evaluated.stopped})
        record_evaluations(job, tracker_metrics(evaluated), outcome.metrics.steps)
    trackers, tracker_files = finish_tracking(job, work_dir, prefix)
    if outcome.deadline_checkpoint is not None:
        step, total = outcome.metrics.steps, outcome.total_steps
        stopped = (f"deadline reached at step {step} of {total}: the job's deadline_epoch_s ({job.deadline_epoch_s}) "
                   "passed before training finished")
        report_progress(Progress(stage="saving", step=step, total_steps=total,
                                 message=f"{stopped}; saving the adapter so far to {store.display_url(prefix)}"))
        try:
            partial = _publish_partial(store, prefix, job, outcome, stopped, tracker_files)
        except ArtifactStoreError as e:
            raise DeadlineReached(f"{stopped}; storing the adapter trained so far and a checkpoint failed: {e}") from e
        raise DeadlineReached(
            f"{stopped}. The adapter trained so far is stored at {store.display_url(partial.adapter_path)} and a "
            f"checkpoint of step {step} at {store.display_url(partial.checkpoint_path)}; retrying the same flow run "
            "resumes from that checkpoint."
        )
    # The final loss (and reward) go with it: a short run may end between two of the control plane's polls, and
    # this is then the only update it sees after the first.
    metrics = outcome.metrics
    stopping = f"{metrics.early_stopping.summary()}; " if metrics.early_stopping else ""
    report_progress(Progress(stage="saving", step=metrics.steps, total_steps=metrics.steps, loss=metrics.final_loss,
                             reward=metrics.rewards[-1][1] if metrics.rewards else None,
                             message=f"{stopping}saving adapter to {store.display_url(prefix)}"))
    outcome.manifest.input_sha256 = store.read_sha256
    result = JobResult(run_id=job.run_id, attempt=job.attempt, run_prefix=prefix, adapter_path=f"{prefix}/adapter",
                       metrics=outcome.metrics, trackers=trackers, adapter_sha256=folder_sha256(outcome.adapter_dir),
                       resumed_from_step=_checkpoint_step(resume_from) if resume_from else 0)
    revision = _publish(store, prefix, outcome, result, tracker_files | evaluated.files)
    return result.model_copy(update={"revision": revision})


def _shorten(message: str, limit: int = 2000) -> str:
    """`message` within `Progress.message`'s limit."""
    return message if len(message) <= limit else message[:limit - 3] + "..."


def _checkpoint_step(checkpoint: Path) -> int:
    """The step of a Trainer checkpoint folder, `checkpoint-<step>`."""
    return int(checkpoint.name.rpartition("-")[2])


def _publish(store: ArtifactStore, prefix: str, outcome: TrainOutcome, result: JobResult,
             tracker_files: dict[str, bytes | Path]) -> str | None:
    """Adapter, the trackers' files (and the evaluations' answers), metrics, manifest, result and `DONE` in ONE commit (the Hub allows about 128 commits per hour
    per repo), `DONE` last: a reader that sees `DONE` sees the rest. A Hub commit is all or nothing; FileStore
    moves the files into place one by one in the order given (`FileStore.put`), so there too `DONE` comes after the
    rest. Returns the commit (None for a folder)."""
    files = _adapter_files(outcome.adapter_dir, f"{prefix}/adapter") | tracker_files | _trajectory_file(prefix, outcome)
    files[f"{prefix}/metrics.json"] = outcome.metrics.model_dump_json(indent=2).encode()
    files[f"{prefix}/manifest.json"] = outcome.manifest.model_dump_json(indent=2).encode()
    files[f"{prefix}/result.json"] = result.model_dump_json(indent=2).encode()
    files[f"{prefix}/DONE"] = json.dumps({"run_id": result.run_id, "attempt": result.attempt}).encode()
    return store.put(
        files,
        message=f"run {result.run_id} attempt {result.attempt}: adapter, metrics, manifest, result, DONE",
        # A previous attempt's adapter files must not mix with this one's; its deadline save is superseded.
        delete_prefixes=[f"{prefix}/adapter", f"{prefix}/partial"],
    )


def _publish_partial(store: ArtifactStore, prefix: str, job: JobInput, outcome: TrainOutcome,
                     stopped: str, tracker_files: dict[str, bytes | Path]) -> PartialResult:
    """The deadline's save, in ONE commit and without `DONE` (the run is not complete): the checkpoint of the
    last step, where the next attempt resumes, the adapter trained so far under `<prefix>/partial/` and the
    trackers' files of the attempt, with `partial/result.json` last (written last by FileStore too, as in `_publish`)."""
    from loraflow_worker.training.checkpoints import checkpoint_commit, checkpoints_prefix

    step = outcome.metrics.steps
    partial = PartialResult(run_id=job.run_id, attempt=job.attempt, step=step, total_steps=outcome.total_steps,
                            loss=outcome.metrics.final_loss, stopped_because=stopped,
                            adapter_path=f"{prefix}/partial/adapter",
                            checkpoint_path=f"{checkpoints_prefix(prefix)}/step-{step}")
    files, stale = checkpoint_commit(store, prefix, outcome.deadline_checkpoint, step, job.training.keep_checkpoints,
                                     job.checkpoint_key)
    files.update(_adapter_files(outcome.adapter_dir, partial.adapter_path))
    files.update(tracker_files)
    files.update(_trajectory_file(prefix, outcome))
    files[f"{prefix}/partial/result.json"] = partial.model_dump_json(indent=2).encode()
    store.put(files, message=f"run {job.run_id} attempt {job.attempt}: deadline at step {step}, checkpoint and adapter so far",
              delete_prefixes=[*stale, f"{prefix}/partial"], retry_budget_s=DEADLINE_SAVE_RETRY_BUDGET_S)
    return partial


def _trajectory_file(prefix: str, outcome: TrainOutcome) -> dict[str, bytes | Path]:
    # Its name in the store is its name in the work dir (`trajectories.TRAJECTORIES_FILE`).
    return {f"{prefix}/{outcome.trajectories.name}": outcome.trajectories} if outcome.trajectories else {}


def _adapter_files(adapter_dir: Path, folder: str) -> dict[str, bytes | Path]:
    return {f"{folder}/{path.relative_to(adapter_dir).as_posix()}": path
            for path in sorted(adapter_dir.rglob("*")) if path.is_file()}


if __name__ == "__main__":
    sys.exit(main())
