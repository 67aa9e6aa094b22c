"""Checkpoints in the artifact store: stored while training, resumed by the next attempt.

A checkpoint is saved when `checkpoint_every_steps` steps have passed (the Trainer's own schedule), when
`checkpoint_every_minutes` have passed (`CheckpointTimer`), and at the job's deadline (`TrainingMonitor`;
train_job.py stores that one together with the adapter trained so far).

Layout: `<prefix>/checkpoints/step-<N>/` holds the Trainer's `checkpoint-<N>` folder (adapter, optimizer,
scheduler and RNG state, `trainer_state.json` with the step and the loss history) and a `COMPLETE`
marker. Each checkpoint is ONE `put`: its files, its marker, and the deletion of the checkpoints beyond
`keep_checkpoints`, in one commit, so a reader that sees `COMPLETE` sees the whole checkpoint.

Checkpoints of one's own: the marker is the run's record of the checkpoint (its run folder, step and the sha256 of
each of its files), signed with the run's checkpoint key (`JobInput.checkpoint_key`, which the control plane derives
for the run from a key of its own; no one who can merely write the store has it). A resume reads only a checkpoint
whose record the key signs, only the files the record names, each at its hash (`download_own_checkpoint`): a folder
someone else put in the run's store (a `step-100000` beside the run's own `step-100`), or an own checkpoint whose
files changed, is named in the log and never loaded (its `torch.load`ed files could run code with the run's token).

Hub commit budget (128 commits per hour per repo, shared by every run that writes to the repo): at the
defaults (`checkpoint_every_minutes` 15, no step-based checkpoints) a run costs about 4 checkpoint commits an
hour plus its final save (one commit: results and `DONE` together); a failed run instead adds a console tail,
and one stopped by its deadline its partial save. Nothing else commits while training, so about 25 runs at
the defaults can write to one repo at once. Whatever asks for them, checkpoints are stored at most once per
`MIN_COMMIT_INTERVAL_S` (a save that comes sooner stays local): frequent step-based checkpoints cost up to 60
commits an hour, and such a run stays under ~62 commits in any hour.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from loraflow_worker.artifacts import ArtifactChanged, ArtifactNotFound, ArtifactStore, ArtifactStoreError
from loraflow_worker.artifacts.pins import download_pinned, file_sha256, sha256_hex
from loraflow_worker.contract import TrainingSettings

COMPLETE = "COMPLETE"
CHECKPOINT_RETRY_BUDGET_S = 60.0
"""How long training waits for a rate-limited or failing Hub to take a checkpoint before going on without it
(the next checkpoint tries again; the final save has a budget of its own, `artifacts.store.HUB_RETRY_BUDGET_S`)."""
MIN_COMMIT_INTERVAL_S = 60.0
"""Least time between two checkpoint commits; a save that comes sooner stays on the local disk only."""

_STEP_FOLDER = re.compile(r"^step-(\d+)$")
log = logging.getLogger("loraflow_worker")


def save_settings(training: TrainingSettings) -> dict[str, Any]:
    """The Trainer arguments that make it write `checkpoint-<N>` folders every `checkpoint_every_steps`.

    The other saves (`CheckpointTimer`, the deadline's) set `control.should_save` from a callback, which the
    Trainer honours whatever `save_strategy` says (transformers 5.20 `Trainer._maybe_log_save_evaluate`)."""
    # One local checkpoint is enough: older ones are in the store already (or were skipped on purpose).
    if training.checkpoint_every_steps is None:
        return {"save_strategy": "no", "save_total_limit": 1}
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


def record_signature(key: str, run_prefix: str, step: int, sha256: dict[str, str]) -> str:
    """The run's signature of its record of a checkpoint: HMAC-SHA256, keyed with the run's checkpoint key, of the run
    folder, the step and every file's sha256 (so neither can be moved to another run, step or file)."""
    message = json.dumps({"run_prefix": run_prefix, "step": step, "sha256": sha256}, sort_keys=True).encode()
    return hmac.new(key.encode(), message, hashlib.sha256).hexdigest()


def own_record_problem(marker: bytes, run_prefix: str, step: int, key: str | None) -> str | None:
    """Why the `COMPLETE` marker of `step-<step>` is not a record this run made of that checkpoint; None when it is."""
    if key is None:
        return "the job carries no checkpoint key, so no checkpoint is the run's own"
    try:
        record = json.loads(marker)
        sha256, signature = record["sha256"], record["signature"]
        signed = isinstance(sha256, dict) and isinstance(signature, str)
    except (ValueError, KeyError, TypeError):
        signed = False
    if not signed:
        return "its COMPLETE marker is not a record of this run (no signed file hashes)"
    if record.get("run_prefix") != run_prefix or record.get("step") != step:
        return f"its record is of {record.get('run_prefix')!r} step {record.get('step')!r}, not of this folder"
    if not hmac.compare_digest(signature, record_signature(key, run_prefix, step, sha256)):
        return "its record is not signed with this run's checkpoint key: this run did not store it"
    return None


def download_own_checkpoint(store: ArtifactStore, run_prefix: str, output_dir: Path,
                            key: str | None) -> tuple[Path | None, dict[str, str]]:
    """Copy the latest checkpoint this run recorded (`own_record_problem`) to `output_dir/checkpoint-<N>` (the
    Trainer's own layout, for `resume_from_checkpoint`), reading only the files its record names, each checked against
    its recorded sha256. Returns that folder (None: there is none) and each checkpoint folder found and ignored
    (`step-<N>` → why), also named in the log: another's, an incomplete one, or an own one whose files changed (then
    the next older own one is tried)."""
    base = checkpoints_prefix(run_prefix)
    own: dict[int, dict[str, str]] = {}
    ignored: dict[str, str] = {}

    def ignore(step: int, why: str) -> None:
        ignored[f"step-{step}"] = why
        log.warning("ignoring checkpoint step-%d in %s: %s", step, store.display_url(base), why)

    for step, complete in sorted(stored_checkpoints(store, run_prefix).items(), reverse=True):
        problem = "it has no COMPLETE marker (a write cut short)" if not complete else None
        if problem is None:
            try:
                marker = store.read_bytes(f"{base}/step-{step}/{COMPLETE}")
            except ArtifactNotFound:
                marker = b""
            problem = own_record_problem(marker, run_prefix, step, key)
        if problem is not None:
            ignore(step, problem)
            continue
        own[step] = {**json.loads(marker)["sha256"], COMPLETE: sha256_hex(marker)}
    for step, sha256 in own.items():
        local = Path(output_dir) / f"checkpoint-{step}"
        try:
            download_pinned(store, f"{base}/step-{step}", local, revision=None, sha256=sha256,
                            since="after this run recorded the checkpoint")
        except ArtifactChanged as e:
            ignore(step, str(e))
            continue
        (local / COMPLETE).unlink()
        log.info("resuming from checkpoint step-%d of %s", step, store.display_url(run_prefix))
        return local, ignored
    return None, ignored


def checkpoint_commit(store: ArtifactStore, run_prefix: str, local: Path, step: int,
                      keep: int, key: str | None = None) -> tuple[dict[str, bytes | Path], list[str]]:
    """The files (its `COMPLETE` marker, the run's signed record of the checkpoint, last) and the folders to delete
    of the commit that stores the Trainer checkpoint folder `local` as step `step`, keeping the newest `keep` of the
    run's own checkpoints (`key`: the run's checkpoint key; None: the record is unsigned, and no resume reads it)."""
    base = checkpoints_prefix(run_prefix)
    folder = f"{base}/step-{step}"
    names = {path.relative_to(local).as_posix(): path for path in sorted(local.rglob("*")) if path.is_file()}
    files: dict[str, bytes | Path] = {f"{folder}/{name}": path for name, path in names.items()}
    sha256 = {name: file_sha256(path) for name, path in names.items()}
    record = {"run_prefix": run_prefix, "step": step, "stored_at": time.time(), "sha256": sha256,
              "signature": record_signature(key, run_prefix, step, sha256) if key is not None else None}
    # Last, so that a FileStore write cut short leaves no marker (the Hub commits all files at once).
    files[f"{folder}/{COMPLETE}"] = json.dumps(record).encode()
    stored = stored_checkpoints(store, run_prefix)
    own = [s for s, done in stored.items() if done and s < step and _is_own(store, base, run_prefix, s, key)]
    kept = sorted(own, reverse=True)[: keep - 1]
    # Everything else goes in the same commit: older checkpoints beyond `keep`, incomplete ones, and a
    # leftover folder of this very step (deletions apply before the new files).
    stale = [s for s in stored if s not in kept]
    return files, [f"{base}/step-{s}" for s in sorted(stale)]


def _is_own(store: ArtifactStore, base: str, run_prefix: str, step: int, key: str | None) -> bool:
    try:
        marker = store.read_bytes(f"{base}/step-{step}/{COMPLETE}")
    except ArtifactNotFound:
        return False
    return own_record_problem(marker, run_prefix, step, key) is None


class CheckpointTimer(TrainerCallback):
    """Asks the Trainer for a checkpoint once `interval_s` has passed since training began or since its last
    save, whatever triggered that one."""

    def __init__(self, interval_s: float, *, clock: Callable[[], float] = time.monotonic):
        self.interval_s = interval_s
        self.clock = clock
        self._last: float | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        self._last = self.clock()

    def on_step_end(self, args, state, control, **kwargs):
        if self.clock() - self._last >= self.interval_s:
            control.should_save = True

    def on_save(self, args, state, control, **kwargs):
        self._last = self.clock()


class CheckpointUploader(TrainerCallback):
    """Stores each checkpoint the Trainer writes (`on_save` comes after the folder is complete on disk),
    at most one per `min_interval_s`, keeping the newest `keep` in the store."""

    def __init__(self, store: ArtifactStore, run_prefix: str, keep: int, *, key: str | None = None,
                 min_interval_s: float = MIN_COMMIT_INTERVAL_S, clock: Callable[[], float] = time.monotonic):
        self.store = store
        self.run_prefix = run_prefix
        self.keep = keep
        self.key = key
        self.min_interval_s = min_interval_s
        self.clock = clock
        self.uploaded: list[int] = []
        self._last_commit: float | None = None

    def on_save(self, args, state, control, **kwargs):
        step = state.global_step
        if control.should_training_stop:
            # The last save of this training: at its end the adapter is published next (a checkpoint would
            # resume nothing); at the deadline train_job.py stores this checkpoint with the partial adapter.
            return
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
        files, stale = checkpoint_commit(self.store, self.run_prefix, local, step, self.keep, self.key)
        self.store.put(files, message=f"checkpoint at step {step}", delete_prefixes=stale,
                       retry_budget_s=CHECKPOINT_RETRY_BUDGET_S)
        log.info("checkpoint at step %d stored in %s", step,
                 self.store.display_url(f"{checkpoints_prefix(self.run_prefix)}/step-{step}"))
