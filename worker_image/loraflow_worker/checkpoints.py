"""Checkpoints in the artifact store: stored every N steps while training, resumed by the next attempt.

Layout: `<prefix>/checkpoints/step-<N>/` holds the Trainer's `checkpoint-<N>` folder (adapter, optimizer,
scheduler and RNG state, `trainer_state.json` with the step and the loss history) and a `COMPLETE`
marker. Each checkpoint is ONE `put`: its files, its marker, and the deletion of the checkpoints beyond
`keep_checkpoints`, in one commit, so a reader that sees `COMPLETE` sees the whole checkpoint.

Hub commit budget (128 commits per hour per repo): checkpoints are stored at most once per
`MIN_COMMIT_INTERVAL_S` (60 an hour), heartbeats once per `heartbeat.INTERVAL_S` (12 an hour), and a run
adds its result, `DONE` and perhaps a console tail: at most ~75 commits in any hour.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from loraflow_worker.artifacts import ArtifactStore, ArtifactStoreError
from loraflow_worker.contract import TrainingSettings

COMPLETE = "COMPLETE"
MIN_COMMIT_INTERVAL_S = 60.0
"""Least time between two checkpoint commits; a save that comes sooner stays on the local disk only."""

_STEP_FOLDER = re.compile(r"^step-(\d+)$")
log = logging.getLogger("loraflow_worker")


def save_settings(training: TrainingSettings) -> dict[str, Any]:
    """The Trainer arguments that make it write `checkpoint-<N>` folders every `checkpoint_every_steps`."""
    if training.checkpoint_every_steps is None:
        return {"save_strategy": "no"}
    # One local checkpoint is enough: older ones are in the store already (or were skipped on purpose).
    return {"save_strategy": "steps", "save_steps": training.checkpoint_every_steps, "save_total_limit": 1}


def checkpoints_prefix(run_prefix: str) -> str:
    return f"{run_prefix}/checkpoints"


def stored_checkpoints(store: ArtifactStore, run_prefix: str) -> dict[int, bool]:
    """Step -> complete, for every checkpoint folder in the store (an incomplete one is a FileStore
    write cut short; on the Hub a commit is all or nothing)."""
    base = checkpoints_prefix(run_prefix)
    folders: dict[int, bool] = {}
    for path in store.list_files(base):
        folder, _, rest = path[len(base) + 1:].partition("/")
        match = _STEP_FOLDER.match(folder)
        if match:
            step = int(match[1])
            folders[step] = folders.get(step, False) or rest == COMPLETE
    return folders


def download_latest_checkpoint(store: ArtifactStore, run_prefix: str, output_dir: Path) -> Path | None:
    """Copy the latest complete checkpoint to `output_dir/checkpoint-<N>` (the Trainer's own layout, for
    `resume_from_checkpoint`) and return that folder; None when the store holds none."""
    complete = [step for step, done in stored_checkpoints(store, run_prefix).items() if done]
    if not complete:
        return None
    step = max(complete)
    local = store.download(f"{checkpoints_prefix(run_prefix)}/step-{step}", Path(output_dir) / f"checkpoint-{step}")
    (local / COMPLETE).unlink()
    log.info("resuming from checkpoint step-%d of %s", step, store.display_url(run_prefix))
    return local


class CheckpointUploader(TrainerCallback):
    """Stores each checkpoint the Trainer writes (`on_save` comes after the folder is complete on disk),
    at most one per `min_interval_s`, keeping the newest `keep` in the store."""

    def __init__(self, store: ArtifactStore, run_prefix: str, keep: int, *,
                 min_interval_s: float = MIN_COMMIT_INTERVAL_S, clock: Callable[[], float] = time.monotonic):
        self.store = store
        self.run_prefix = run_prefix
        self.keep = keep
        self.min_interval_s = min_interval_s
        self.clock = clock
        self.uploaded: list[int] = []
        self._last_commit: float | None = None

    def on_save(self, args, state, control, **kwargs):
        step = state.global_step
        if step >= state.max_steps:
            return  # the end of training: the adapter is published next, a checkpoint would resume nothing
        now = self.clock()
        if self._last_commit is not None and now - self._last_commit < self.min_interval_s:
            log.info("checkpoint at step %d kept local only: the last one was stored %.0f s ago (limit: one per %.0f s)",
                     step, now - self._last_commit, self.min_interval_s)
            return
        try:
            self._store(Path(args.output_dir) / f"checkpoint-{step}", step)
        except ArtifactStoreError as e:
            if not e.transient:
                raise  # wrong credentials or store: the final publish would fail the same way, after all the training
            log.warning("checkpoint at step %d not stored (training goes on): %s", step, e)
            return
        self._last_commit = now
        self.uploaded.append(step)

    def _store(self, local: Path, step: int) -> None:
        base = checkpoints_prefix(self.run_prefix)
        folder = f"{base}/step-{step}"
        files: dict[str, bytes | Path] = {
            f"{folder}/{path.relative_to(local).as_posix()}": path for path in sorted(local.rglob("*")) if path.is_file()
        }
        # Last, so that a FileStore write cut short leaves no marker (the Hub commits all files at once).
        files[f"{folder}/{COMPLETE}"] = json.dumps({"step": step, "stored_at": time.time()}).encode()
        stored = stored_checkpoints(self.store, self.run_prefix)
        kept = sorted((s for s, done in stored.items() if done and s < step), reverse=True)[: self.keep - 1]
        # Everything else goes in the same commit: older checkpoints beyond `keep`, incomplete ones, and a
        # leftover folder of this very step (deletions apply before the new files).
        stale = [s for s in stored if s not in kept]
        self.store.put(files, message=f"checkpoint at step {step}",
                       delete_prefixes=[f"{base}/step-{s}" for s in sorted(stale)])
        log.info("checkpoint at step %d stored in %s", step, self.store.display_url(folder))
