"""The RunPod serverless handler: one job = one LoRA training run, published to the artifact store, or
one preload of Hub models onto the endpoint's network volume (`"mode": "preload"`, runtime/preload.py), or one
stored adapter merged into its base and published as a Hub model (`"mode": "merge"`, runtime/merge.py), or one
base model and several adapters (stored runs', Hub repos') asked the same task evaluations and benchmarks, each
adapter scored against one set of base answers and the scores stored under `runs/<run_id>/` (`"mode": "evaluate"`,
runtime/evaluate.py; it runs in a child process as training does, with `DONE` last and redelivery as below).

On RunPod (the image's command; the platform sets the RUNPOD_* environment):

    python -m loraflow_worker.handler

Locally, one job through runpod's test mode (no server involved):

    python -m loraflow_worker.self_test.tiny_model --out /tmp/tiny-qwen3
    python -m loraflow_worker.handler --test_input '{"input": {"contract_version": 13, "run_id": "demo",
        "model": {"id": "/tmp/tiny-qwen3"}, "dataset": {"store_path": "runs/demo/dataset/train.jsonl"},
        "training": {"max_steps": 50}, "artifact_store": "file:///tmp/loraflow-store"}}'

(the dataset must already be in the store at `store_path`). The job's artifacts land under
`runs/<run_id>/` in the store, `DONE` last; a redelivered job whose `DONE` exists returns the stored
result without training again. With `LORAFLOW_REQUIRE_CUDA=1` (the control plane's training endpoints) a
train job first checks that CUDA starts and fails at once when it does not (runtime/cuda_check.py; set 0 to train
on the CPU, as localpod's workers do). The training itself runs in a child process (runtime/supervisor.py); the job
succeeded when `DONE` is in the store, whatever that process's exit code. A failed job leaves its
console tail in `runs/<run_id>/console.txt`. The worker exits by itself at the run's deadline
(runtime/lifetime.py).
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import runpod
from pydantic import ValidationError

from loraflow_worker.artifacts import ArtifactStore, ArtifactStoreError, open_store
from loraflow_worker.contract import (
    CONTRACT_VERSION,
    JobInput,
    EvaluateInput,
    JobResult,
    MergeInput,
    PreloadInput,
    Progress,
    run_prefix,
)
from loraflow_worker.runtime.cuda_check import check_cuda
from loraflow_worker.runtime.environment import child_env
from loraflow_worker.runtime.evaluate import evaluate_adapters
from loraflow_worker.runtime.lifetime import WorkerLifetime
from loraflow_worker.runtime.merge import merge_adapter
from loraflow_worker.runtime.packages import install_extra_packages
from loraflow_worker.runtime.preload import preload_models
from loraflow_worker.runtime.redaction import redact_secrets
from loraflow_worker.runtime.supervisor import RESULT_FILE, JobFailed, run_training

CONSOLE_RETRY_BUDGET_S = 60.0
"""How long a failed job's console upload retries a rate-limited or failing Hub before the failure is reported without it."""
WORK_DIR_ENV = "LORAFLOW_WORK_DIR"
"""Folder under which the worker keeps the current job's files (default: the system temp folder)."""
_INPUT_BY_MODE: dict[str, type[JobInput] | type[PreloadInput] | type[MergeInput] | type[EvaluateInput]] = {
    "train": JobInput, "preload": PreloadInput, "merge": MergeInput, "evaluate": EvaluateInput}

log = logging.getLogger("loraflow_worker")

__all__ = ["JobFailed", "JobRefused", "WORK_DIR_ENV", "fresh_work_dir", "handler", "parse_job_input"]


class JobRefused(ValueError):
    """The job input is not one this worker can run (wrong contract version, invalid fields)."""


def handler(job: dict[str, Any], *, lifetime: WorkerLifetime | None = None) -> dict[str, Any]:
    """Run one RunPod job (`{"id": ..., "input": <JobInput, PreloadInput, MergeInput or EvaluateInput as JSON>}`) and
    return its `JobResult`, `PreloadResult`, `MergeResult` or `EvaluateResult`.
    Errors propagate (the runpod runtime reports them as the job's `error`), with secrets removed: the
    environment's and the job's own (`worker_secret_names`)."""
    try:
        return _run(job, lifetime)
    except Exception as exc:
        message = str(exc)
        redacted = redact_secrets(message, secret_names=_secret_names(job))
        if redacted == message:
            raise
        # The original exception (and its traceback) would carry the secret into the job's error.
        raise JobFailed(f"{type(exc).__name__}: {redacted}") from None


def parse_job_input(raw: Any) -> JobInput | PreloadInput | MergeInput | EvaluateInput:
    """Validate a job's `input`, checking the contract version before anything else, then its `mode`
    (left out: `train`)."""
    version = raw.get("contract_version", "none") if isinstance(raw, dict) else "none"
    if version != CONTRACT_VERSION or isinstance(version, bool):
        raise JobRefused(
            f"worker speaks contract version {CONTRACT_VERSION}, job has version {version}: "
            "deploy a matching worker image"
        )
    mode = raw.get("mode", "train")
    if not isinstance(mode, str) or mode not in _INPUT_BY_MODE:
        raise JobRefused(f"invalid job input: `mode`: {mode!r} is not a mode; use one of {', '.join(_INPUT_BY_MODE)}")
    try:
        return _INPUT_BY_MODE[mode].model_validate(raw)
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


def _run(job: dict[str, Any], lifetime: WorkerLifetime | None) -> dict[str, Any]:
    job_input = parse_job_input(job.get("input"))
    if lifetime is not None:
        lifetime.use_deadline(job_input.deadline_epoch_s)
    if isinstance(job_input, PreloadInput):
        return preload_models(job_input, _progress_sender(job)).model_dump(mode="json")
    if isinstance(job_input, MergeInput):  # needs no CUDA: the control plane runs it on a CPU endpoint
        return merge_adapter(job_input, fresh_work_dir(), _progress_sender(job)).model_dump(mode="json")
    if isinstance(job_input, EvaluateInput):  # its own redelivery check: a stored result is returned as it is
        return evaluate_adapters(job_input, fresh_work_dir(), _progress_sender(job)).model_dump(mode="json")
    store = open_store(job_input.artifact_store)
    prefix = run_prefix(job_input.run_id)
    if store.exists(f"{prefix}/DONE"):
        log.info("run %s already has DONE in %s: returning the stored result", job_input.run_id, store.url)
        return _stored_result(store, prefix)

    # Before anything is downloaded or installed: on a GPU host without a working CUDA, this job must cost seconds.
    check_cuda(child_env(job_input))
    work_dir = fresh_work_dir()
    report = _progress_sender(job)
    if job_input.extra_packages:
        report(Progress(stage="loading", message=f"installing {' '.join(job_input.extra_packages)}"))
        install_extra_packages(job_input.extra_packages, work_dir)
    ended = run_training(job_input, work_dir, report)
    # The artifacts decide: vLLM can crash at interpreter exit after everything was stored.
    if store.exists(f"{prefix}/DONE"):
        if ended.returncode != 0:
            log.warning("training process exited with %s after storing DONE: the run completed", ended.returncode)
        # The training process's own result names the commit that holds the adapter, and no one who can write the
        # store can change it; the stored copy is the fallback when the process ended before writing it.
        local = work_dir / RESULT_FILE
        if local.is_file():
            return JobResult.model_validate_json(local.read_text()).model_dump(mode="json")
        return _stored_result(store, prefix)
    message = ended.failure_message()
    try:
        store.put({f"{prefix}/console.txt": ended.console_tail.encode()},
                  message=f"run {job_input.run_id} attempt {job_input.attempt}: console of the failed training",
                  retry_budget_s=CONSOLE_RETRY_BUDGET_S)
    except ArtifactStoreError as e:  # the training's failure is the news; the store's is a footnote
        message += f" (its console could not be stored: {e})"
    raise JobFailed(message)


def _secret_names(job: dict[str, Any]) -> list[str]:
    """The job's own secret names, from its raw input: an error can come before (or from) its validation."""
    raw = job.get("input")
    names = raw.get("worker_secret_names") if isinstance(raw, dict) else None
    return [name for name in names if isinstance(name, str)] if isinstance(names, list) else []


def _stored_result(store: ArtifactStore, prefix: str) -> dict[str, Any]:
    return JobResult.model_validate(store.read_json(f"{prefix}/result.json")).model_dump(mode="json")


def _progress_sender(job: dict[str, Any]):
    def send(progress: Progress) -> None:
        payload = progress.model_dump(mode="json")
        log.info("progress %s", progress.model_dump_json())
        # runpod posts progress to this URL; without it (in-process calls, runpod's --test_input mode)
        # it would log an error for every update, so progress only goes to the log then.
        if os.environ.get("RUNPOD_WEBHOOK_POST_OUTPUT"):
            runpod.serverless.progress_update(job, payload)

    return send


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    worker_lifetime = WorkerLifetime.from_env()
    worker_lifetime.start()
    runpod.serverless.start({"handler": functools.partial(handler, lifetime=worker_lifetime)})
