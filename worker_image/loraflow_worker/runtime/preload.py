"""A preload job: download Hub models into the network volume's Hub cache ("warm weights").

The control plane starts an endpoint with a datacenter's volume attached and sends it

    {"contract_version": 13, "mode": "preload", "run_id": "warm-2025-06-01",
     "models": [{"id": "Qwen/Qwen3-0.6B"}, {"id": "meta-llama/Llama-3.1-8B", "revision": "main"}],
     "remove_others": true}

With `remove_others`, every model the volume's cache holds that the list does not name is deleted first, so
the volume keeps only what the sweep keeps warm (and a volume sized for those models has room for them).
Each model's revision is resolved to a commit; when the volume already holds every file of that commit
(after `model_cache.download_ignore_patterns`) the model is `cached`, else the missing files are
downloaded. One model that fails (missing, gated, no space left) is reported and the rest go on. The job
runs in the handler's process: it loads no model, so it needs no training process to contain it.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

from huggingface_hub import HfApi, try_to_load_from_cache
from huggingface_hub.file_download import repo_folder_name
from huggingface_hub.utils import filter_repo_objects

from loraflow_worker.contract import ModelSource, PreloadInput, PreloadModelResult, PreloadResult, Progress
from loraflow_worker.runtime.model_cache import (
    VOLUME_PATH_ENV,
    attached_volume,
    download_ignore_patterns,
    fetch_model,
    hub_cache_dir,
    volume_path,
)
from loraflow_worker.runtime.redaction import redact_secrets

DATA_CENTER_ENV = "RUNPOD_DC_ID"
"""RunPod sets the worker's datacenter id here (e.g. `EU-RO-1`)."""
DEADLINE_REACHED = "deadline reached"
_ERROR_CHARS = 1000

log = logging.getLogger("loraflow_worker")


class NoVolume(RuntimeError):
    """A preload job reached a worker without a network volume. It downloads nothing: a model "cached" on
    the container's own disk would be reported warm and be gone with the worker."""


def preload_models(job: PreloadInput, report: Callable[[Progress], None]) -> PreloadResult:
    """Cache `job.models` on the attached volume, in order, until the job's deadline; one progress update per
    model. Raises `NoVolume` (before any download) when no volume is attached."""
    volume = attached_volume()
    if volume is None:
        raise NoVolume(
            f"no network volume at {volume_path()}: a preload job needs the endpoint's network volume mounted "
            f"there (or named by {VOLUME_PATH_ENV}); attach the datacenter's volume to the endpoint"
        )
    cache = hub_cache_dir(volume)
    if job.remove_others:
        remove_other_models(cache, [m.id for m in job.models])
    api = HfApi(library_name="loraflow")
    results = []
    for number, source in enumerate(job.models, 1):
        started = time.monotonic()
        result = _before_deadline(functools.partial(_preload_one, api, source, cache), job.deadline_epoch_s)
        results.append(result or _failed(source, None, time.monotonic() - started, DEADLINE_REACHED))
        report(Progress(stage="loading", message=f"preload {number}/{len(job.models)}: {_summary(results[-1])}"))
    return PreloadResult(run_id=job.run_id, data_center=os.environ.get(DATA_CENTER_ENV), volume_path=str(volume),
                         models=results)


def remove_other_models(cache: Path, keep: list[str]) -> list[str]:
    """Delete from the Hub cache every model repo not in `keep` (its folder and its download locks); returns
    the model folders deleted. Datasets and anything not a model repo are left alone."""
    kept = {repo_folder_name(repo_id=model_id, repo_type="model") for model_id in keep}
    others = sorted(p.name for p in cache.glob("models--*") if p.is_dir() and p.name not in kept) \
        if cache.is_dir() else []
    for name in others:
        shutil.rmtree(cache / name)
        shutil.rmtree(cache / ".locks" / name, ignore_errors=True)
        log.info("preload: removed %s from the volume (no longer in the sweep's list)", name)
    return others


def _preload_one(api: HfApi, source: ModelSource, cache: Path) -> PreloadModelResult:
    started = time.monotonic()
    sha = None
    try:
        # Resolve first, even when a snapshot is cached: the volume's `refs/main` is as old as the last
        # download, and a branch that moved on the Hub must be downloaded again, not reported warm.
        info = api.model_info(source.id, revision=source.revision)
        sha = info.sha
        filenames = [sibling.rfilename for sibling in info.siblings or []]
        wanted = list(filter_repo_objects(filenames, ignore_patterns=download_ignore_patterns(filenames)))
        repo_folder = cache / repo_folder_name(repo_id=source.id, repo_type="model")
        blobs_before = set(os.listdir(repo_folder / "blobs")) if (repo_folder / "blobs").is_dir() else set()
        cached = all(isinstance(try_to_load_from_cache(source.id, name, cache_dir=cache, revision=sha), str)
                     for name in wanted)
        snapshot = repo_folder / "snapshots" / sha
        if not cached:
            snapshot = fetch_model(source.id, sha, filenames, cache)
        kept = [snapshot / name for name in wanted]
        # A file whose blob was there before (another revision shares it) cost no download.
        downloaded = sum(path.stat().st_size for path in kept if path.resolve().name not in blobs_before)
        return PreloadModelResult(
            id=source.id, requested_revision=source.revision, revision=sha, status="cached" if cached else "downloaded",
            size_bytes=sum(path.stat().st_size for path in kept), bytes_downloaded=0 if cached else downloaded,
            seconds=time.monotonic() - started,
        )
    except Exception as e:  # one model's failure is reported in the output; the others go on
        log.warning("preload of %s failed: %s", source.id, redact_secrets(str(e)))
        return _failed(source, sha, time.monotonic() - started, f"{type(e).__name__}: {e}")


def _before_deadline(work: Callable[[], PreloadModelResult], deadline: float | None) -> PreloadModelResult | None:
    """`work()`'s result, or None when the deadline comes first. Past the deadline the download goes on in a
    daemon thread until the worker exits (lifetime.py); huggingface_hub resumes its partial file next time."""
    if deadline is None:
        return work()
    if time.time() >= deadline:
        return None
    done: list[PreloadModelResult] = []
    thread = threading.Thread(target=lambda: done.append(work()), name="loraflow-preload", daemon=True)
    thread.start()
    thread.join(timeout=max(0.0, deadline - time.time()))
    return done[0] if done else None


def _failed(source: ModelSource, sha: str | None, seconds: float, error: str) -> PreloadModelResult:
    return PreloadModelResult(id=source.id, requested_revision=source.revision, revision=sha, status="failed",
                              size_bytes=0, bytes_downloaded=0, seconds=seconds,
                              error=redact_secrets(error)[:_ERROR_CHARS])


def _summary(result: PreloadModelResult) -> str:
    where = f"{result.id}@{result.revision[:12]}" if result.revision else result.id
    if result.status == "failed":
        return f"{where} failed: {result.error}"
    return (f"{where} {result.status}: {result.size_bytes / 1e9:.2f} GB kept, {result.bytes_downloaded / 1e9:.2f} GB "
            f"downloaded in {result.seconds:.1f} s")
