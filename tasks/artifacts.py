"""The run's artifact store, seen from the control plane: publish the dataset, read the results.

The store itself (`file://` or `hf://datasets/...`) is the worker package's `open_store`, so both
sides read and write it with the same code.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from loraflow_worker.artifacts import ArtifactNotFound, open_store
from loraflow_worker.contract import JobResult, run_prefix
from prefect import task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel

from tasks.settings import Settings

CONSOLE_TAIL_BYTES = 4000


def check_chat_jsonl(path: Path) -> int:
    """Count the examples of a chat JSONL file; ValueError naming the first bad line."""
    if not path.is_file():
        raise ValueError(f"dataset.local_file {path} does not exist or is not a file")
    count = 0
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise ValueError(f"dataset.local_file {path}, line {number}: not JSON ({e})") from e
            messages = row.get("messages") if isinstance(row, dict) else None
            if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages
            ):
                raise ValueError(
                    f"dataset.local_file {path}, line {number}: expected "
                    '{"messages": [{"role": ..., "content": ...}, ...]}'
                )
            count += 1
    if count == 0:
        raise ValueError(f"dataset.local_file {path} has no examples")
    return count


def publish_dataset(store_url: str, run_id: str, local_file: Path, token: str | None = None) -> str:
    """Copy a local dataset file (checked first with `check_chat_jsonl`) into the run's folder;
    returns its path in the store. `token`: the Hub token (default: huggingface_hub's lookup)."""
    store_path = f"{run_prefix(run_id)}/dataset/train.jsonl"
    open_store(store_url, token).put({store_path: local_file}, message=f"dataset for run {run_id}")
    return store_path


class RunResults(BaseModel):
    """What a finished run left in its store."""

    done: bool
    result: JobResult | None = None
    manifest: dict[str, Any] | None = None
    console_tail: str | None = None
    adapter_url: str | None = None


def read_run_results(store_url: str, run_id: str, token: str | None = None) -> RunResults:
    """Read a run's results. Success is decided by `DONE`, written last, not by the job's status."""
    store = open_store(store_url, token)
    prefix = run_prefix(run_id)
    console = _read_text(store, f"{prefix}/console.txt")
    if not store.exists(f"{prefix}/DONE"):
        return RunResults(done=False, console_tail=console[-CONSOLE_TAIL_BYTES:] if console else None)
    result = JobResult.model_validate(store.read_json(f"{prefix}/result.json"))
    try:
        manifest = store.read_json(f"{prefix}/manifest.json")
    except ArtifactNotFound:
        manifest = None
    return RunResults(done=True, result=result, manifest=manifest, adapter_url=store.display_url(result.adapter_path))


def _read_text(store: Any, path: str) -> str | None:
    try:
        return store.read_bytes(path).decode("utf-8", errors="replace")
    except ArtifactNotFound:
        return None


@task(name="publish-dataset", cache_policy=NO_CACHE, retries=3, retry_delay_seconds=[2, 10, 30])
def publish_dataset_task(store_url: str, run_id: str, local_file: str) -> str:
    return publish_dataset(store_url, run_id, Path(local_file), _hub_token(store_url))


@task(name="collect", cache_policy=NO_CACHE, retries=3, retry_delay_seconds=[2, 10, 30])
def collect(store_url: str, run_id: str) -> RunResults:
    return read_run_results(store_url, run_id, _hub_token(store_url))


def _hub_token(store_url: str) -> str | None:
    """The Hub token for an hf:// store (from the environment or the Prefect Secret block)."""
    return Settings().hub_token() if store_url.startswith("hf://") else None
