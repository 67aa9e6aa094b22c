"""Shared fixtures for the worker tests: a tiny model built once, a job builder, a progress recorder,
and one finished SFT job (50 steps, a checkpoint every 20) that several test modules inspect."""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from loraflow_worker.contract import CONTRACT_VERSION
from loraflow_worker.handler import WORK_DIR_ENV, handler
from loraflow_worker.self_test.tiny_model import DEFAULT_CORPUS, build_tiny_model, corpus_from_jsonl
from worker_test_support import BASE_TRAINING, CHECKPOINT_KEY, PLANTED_SECRET

TINY_CHAT = DEFAULT_CORPUS


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), corpus_from_jsonl([TINY_CHAT]))


@dataclass
class FinishedJob:
    job: dict
    result: dict
    run_dir: Path
    work_dir: Path
    progress: list[dict]
    seconds: float


@pytest.fixture(scope="session")
def finished_job(tiny_model_dir, tmp_path_factory) -> FinishedJob:
    """`run-a`: 50 SFT steps with a checkpoint every 20, run through `handler()` with HF_TOKEN planted."""
    store_root = tmp_path_factory.mktemp("store")
    work_base = tmp_path_factory.mktemp("work")
    job = _make_job("run-a", tiny_model_dir, store_root,
                    training={**BASE_TRAINING, "checkpoint_every_steps": 20})
    # What a previous job on this warm worker left behind.
    stale = work_base / "loraflow-job" / "adapter" / "stale-from-previous-job.safetensors"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"old")
    with pytest.MonkeyPatch.context() as env, _recording_progress() as progress:
        env.setenv(WORK_DIR_ENV, str(work_base))
        env.setenv("HF_TOKEN", PLANTED_SECRET)
        env.delenv("RUNPOD_WEBHOOK_POST_OUTPUT", raising=False)
        env.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)  # the supervisor sets it, unless the worker's env has one
        started = time.monotonic()
        result = handler(job)
        seconds = time.monotonic() - started
    return FinishedJob(job, result, store_root / "runs" / "run-a", work_base / "loraflow-job", progress, seconds)


@pytest.fixture(scope="session")
def make_job():
    return _make_job


@pytest.fixture(scope="session")
def record_progress():
    return _recording_progress


def _make_job(run_id: str, model_dir: Path, store_root: Path, **overrides) -> dict:
    """A RunPod job dict as the runtime hands it to `handler`, training on the shipped tiny-chat data.
    Publishes the dataset into the store first, as the control plane does."""
    dataset_path = f"runs/{run_id}/dataset/train.jsonl"
    (store_root / dataset_path).parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(TINY_CHAT, store_root / dataset_path)
    job_input = {
        "contract_version": CONTRACT_VERSION,
        "run_id": run_id,
        "model": {"id": str(model_dir)},
        "dataset": {"store_path": dataset_path},
        "training": dict(BASE_TRAINING),
        "artifact_store": store_root.as_uri(),
        "checkpoint_key": CHECKPOINT_KEY,
    }
    job_input.update(overrides)
    return {"id": f"job-{run_id}", "input": job_input}


@contextmanager
def _recording_progress() -> Iterator[list[dict]]:
    """Collects the progress updates the worker logs (it logs every update it sends)."""
    updates: list[dict] = []

    class _Recorder(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.msg == "progress %s":
                updates.append(json.loads(record.args[0]))

    logger = logging.getLogger("loraflow_worker")
    recorder, old_level = _Recorder(), logger.level
    logger.addHandler(recorder)
    logger.setLevel(logging.INFO)
    try:
        yield updates
    finally:
        logger.removeHandler(recorder)
        logger.setLevel(old_level)
