"""The RunPod serverless handler: one job = one LoRA training run, published to the artifact store.

On RunPod (the image's command; the platform sets the RUNPOD_* environment):

    python -m loraflow_worker.handler

Locally, one job through runpod's test mode (no server involved):

    python -m loraflow_worker.tiny_model --out /tmp/tiny-qwen3
    python -m loraflow_worker.handler --test_input '{"input": {"contract_version": 1, "run_id": "demo",
        "model": {"id": "/tmp/tiny-qwen3"}, "dataset": {"store_path": "runs/demo/dataset/train.jsonl"},
        "training": {"max_steps": 50}, "artifact_store": "file:///tmp/loraflow-store"}}'

(the dataset must already be in the store at `store_path`). The job's artifacts land under
`runs/<run_id>/` in the store, `DONE` last; a redelivered job whose `DONE` exists returns the stored
result without training again.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import runpod
from pydantic import ValidationError

from loraflow_worker.artifacts import ArtifactStore, open_store
from loraflow_worker.contract import CONTRACT_VERSION, JobInput, JobResult, Progress, run_prefix
from loraflow_worker.redaction import redact_secrets
from loraflow_worker.sft import TrainOutcome, train_sft

WORK_DIR_ENV = "LORAFLOW_WORK_DIR"
"""Folder under which the worker keeps the current job's files (default: the system temp folder)."""

log = logging.getLogger("loraflow_worker")


class JobRefused(ValueError):
    """The job input is not one this worker can run (wrong contract version, invalid fields)."""


class JobFailed(RuntimeError):
    """A failure whose message had to be redacted before leaving the worker."""


def handler(job: dict[str, Any]) -> dict[str, Any]:
    """Run one RunPod job (`{"id": ..., "input": <JobInput as JSON>}`) and return its `JobResult`.
    Errors propagate (the runpod runtime reports them as the job's `error`), with secrets removed."""
    try:
        return _run(job)
    except Exception as exc:
        message = str(exc)
        redacted = redact_secrets(message)
        if redacted == message:
            raise
        # The original exception (and its traceback) would carry the secret into the job's error.
        raise JobFailed(f"{type(exc).__name__}: {redacted}") from None


def parse_job_input(raw: Any) -> JobInput:
    """Validate a job's `input`, checking the contract version before anything else."""
    version = raw.get("contract_version", "none") if isinstance(raw, dict) else "none"
    if version != CONTRACT_VERSION or isinstance(version, bool):
        raise JobRefused(
            f"worker speaks contract version {CONTRACT_VERSION}, job has version {version}: "
            "deploy a matching worker image"
        )
    try:
        return JobInput.model_validate(raw)
    except ValidationError as e:
        problems = "; ".join(f"`{'.'.join(map(str, err['loc']))}`: {err['msg']}" for err in e.errors())
        raise JobRefused(f"invalid job input: {problems}") from e


def fresh_work_dir() -> Path:
    """An empty folder for this job. A warm worker keeps its disk between jobs, so whatever the
    previous job left there is deleted first."""
    work_dir = Path(os.environ.get(WORK_DIR_ENV) or tempfile.gettempdir()) / "loraflow-job"
    if work_dir.exists():
        shutil.rmtree(work_dir)
    work_dir.mkdir(parents=True)
    return work_dir


def _run(job: dict[str, Any]) -> dict[str, Any]:
    job_input = parse_job_input(job.get("input"))
    store = open_store(job_input.artifact_store)
    prefix = run_prefix(job_input.run_id)
    if store.exists(f"{prefix}/DONE"):
        log.info("run %s already has DONE in %s: returning the stored result", job_input.run_id, store.url)
        return JobResult.model_validate(store.read_json(f"{prefix}/result.json")).model_dump(mode="json")

    report = _progress_sender(job)
    outcome = train_sft(job_input, store, fresh_work_dir(), report)
    report(Progress(stage="saving", step=outcome.metrics.steps, message=f"saving adapter to {store.display_url(prefix)}"))
    result = JobResult(
        run_id=job_input.run_id,
        attempt=job_input.attempt,
        run_prefix=prefix,
        adapter_path=f"{prefix}/adapter",
        metrics=outcome.metrics,
    )
    _publish(store, prefix, outcome, result)
    return result.model_dump(mode="json")


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


def _progress_sender(job: dict[str, Any]):
    def send(progress: Progress) -> None:
        payload = progress.model_dump(mode="json")
        log.info("progress %s", json.dumps(payload))
        # runpod posts progress to this URL; without it (in-process calls, runpod's --test_input mode)
        # it would log an error for every update, so progress only goes to the log then.
        if os.environ.get("RUNPOD_WEBHOOK_POST_OUTPUT"):
            runpod.serverless.progress_update(job, payload)

    return send


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    runpod.serverless.start({"handler": handler})
