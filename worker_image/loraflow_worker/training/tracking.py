"""The run's trackers (`training.report_to`): W&B and MLflow through transformers' own callbacks, which the
Trainer takes from `report_to` and which read their settings from the environment; this module sets that
environment before training and, after it, says where each tracker recorded the attempt and hands over the
trackers' local files, to be stored with the run (`<run prefix>/tracking/a<attempt>/`).

- W&B: online when the training process has `WANDB_API_KEY` (the run's `[worker] secrets`), else offline. An
  offline run is uploaded later with `wandb sync` from its stored folder.
- MLflow: to `MLFLOW_TRACKING_URI` when the run's `[worker] env` names a server, else to a file store in the work
  dir, stored with the run and opened with `mlflow ui --backend-store-uri`.

Both trackers name the attempt's run `<run id>-a<attempt>` (the Trainer's `run_name`); W&B groups a run's
attempts by the run id, MLflow tags them with it.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import tarfile
from collections.abc import Iterable, Mapping
from pathlib import Path

from loraflow_worker.contract import JobInput, TrackerRun
from loraflow_worker.runtime.redaction import REDACTED, redact_secrets, secret_values

logger = logging.getLogger(__name__)

DEFAULT_PROJECT = "loraflow"
"""W&B's project and MLflow's experiment when the run's env names none."""
_SERVER_SCHEMES = ("http://", "https://")
MLFLOW_STORE = "mlruns"
"""The MLflow file store's folder under the tracking folder (and, as `mlruns.tar.gz`, in the artifact store)."""


def tracker_run_name(job: JobInput) -> str:
    return f"{job.run_id}-a{job.attempt}"


def tracking_dir(work_dir: Path) -> Path:
    """Where the trackers keep their local files during the attempt."""
    return work_dir / "tracking"


def tracking_env(job: JobInput, work_dir: Path, env: Mapping[str, str]) -> dict[str, str]:
    """The variables to set, on top of `env`, before the Trainer starts, for the job's trackers."""
    trackers = job.training.report_to
    local = tracking_dir(work_dir)
    settings: dict[str, str] = {}
    if "wandb" in trackers:
        settings |= {
            "WANDB_DIR": str(local),
            "WANDB_MODE": env.get("WANDB_MODE") or ("online" if env.get("WANDB_API_KEY") else "offline"),
            "WANDB_PROJECT": env.get("WANDB_PROJECT") or DEFAULT_PROJECT,
            "WANDB_RUN_GROUP": job.run_id,
            # The console is the worker's log already (secrets redacted); W&B's copy of it would not be.
            "WANDB_CONSOLE": "off",
        }
    if "mlflow" in trackers:
        settings |= {
            "MLFLOW_EXPERIMENT_NAME": env.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_PROJECT,
            "MLFLOW_TAGS": json.dumps({"loraflow.run_id": job.run_id, "loraflow.attempt": str(job.attempt)}),
            # The image has no `git`: GitPython's import then fails, and MLflow logs three warnings per run for the
            # commit it cannot read. "quiet" lets the import succeed; the commit is then simply not found.
            "GIT_PYTHON_REFRESH": "quiet",
        }
        if not env.get("MLFLOW_TRACKING_URI"):
            # MLflow 3 refuses a file store (in maintenance mode, still supported) unless this is set.
            settings |= {"MLFLOW_TRACKING_URI": (local / MLFLOW_STORE).as_uri(), "MLFLOW_ALLOW_FILE_STORE": "true"}
    return settings


def start_tracking(job: JobInput, work_dir: Path) -> None:
    """Set this (training) process's environment for the job's trackers; nothing without `report_to`."""
    if job.training.report_to:
        tracking_dir(work_dir).mkdir(parents=True, exist_ok=True)
        os.environ.update(tracking_env(job, work_dir, os.environ))


def record_evaluations(job: JobInput, metrics: Mapping[str, float], step: int) -> None:
    """Log the evaluations after training (`metrics`, by name) to the job's trackers, at the training's last `step`:
    into the attempt's W&B run, and into its MLflow run (which transformers' callback ended when training did)."""
    if not metrics or not job.training.report_to:
        return
    if "wandb" in job.training.report_to:
        import wandb

        if wandb.run is not None:
            # Beside transformers' own x axis (`train/global_step`), so the scores sit at the last step.
            wandb.run.log({**metrics, "train/global_step": step})
    if "mlflow" in job.training.report_to:
        import mlflow

        active = mlflow.active_run()
        run = active or mlflow.last_active_run()
        if run is None:
            return
        with contextlib.nullcontext() if active else mlflow.start_run(run_id=run.info.run_id):
            mlflow.log_metrics(dict(metrics), step=step)


def finish_tracking(job: JobInput, work_dir: Path, prefix: str) -> tuple[list[TrackerRun], dict[str, bytes | Path]]:
    """After training: close the trackers' runs (their files complete) and return where each recorded the attempt
    and the files to store with the run, keyed by their path in the artifact store."""
    if not job.training.report_to:
        return [], {}
    folder = f"{prefix}/tracking/a{job.attempt}"
    runs: list[TrackerRun] = []
    if "wandb" in job.training.report_to:
        runs.extend(_finish_wandb(job, folder))
    if "mlflow" in job.training.report_to:
        runs.extend(_finish_mlflow(job, folder))
    files, left_out = tracker_files(tracking_dir(work_dir), folder, secret_values(secret_names=job.worker_secret_names))
    for path in left_out:
        logger.warning("tracking: %s is not stored with the run: it holds a secret's value", path)
    return [run if _stored(run.store_path, files) else run.model_copy(update={
        "store_path": None, "note": "its local files were not stored (they hold a secret's value)"}) for run in runs], files


def _stored(store_path: str | None, files: Mapping[str, object]) -> bool:
    return store_path is None or any(key == store_path or key.startswith(store_path + "/") for key in files)


def _finish_wandb(job: JobInput, folder: str) -> list[TrackerRun]:
    import wandb

    run = wandb.run
    if run is None:  # the callback never started one (no training step was reached)
        return []
    offline = run.settings.mode == "offline"
    local = Path(run.settings.sync_dir)
    run_id, url = run.id, None if offline else run.url
    run.finish()
    store_path = f"{folder}/wandb/{local.name}"
    note = (f"offline: upload it with `wandb sync <folder>` after downloading {store_path}" if offline
            else "W&B's local files of the run are stored beside it")
    return [TrackerRun(tracker="wandb", run_id=run_id, run_name=tracker_run_name(job), url=url, store_path=store_path,
                       note=note)]


def _finish_mlflow(job: JobInput, folder: str) -> list[TrackerRun]:
    import mlflow

    if mlflow.active_run() is not None:  # the callback ends its run at the end of training; a failure may not have
        mlflow.end_run()
    run = mlflow.last_active_run()
    if run is None:
        return []
    # A server's URI may carry a password (`https://user:pass@host`): redacted wherever it is shown.
    uri = redact_secrets(mlflow.get_tracking_uri(), secret_names=job.worker_secret_names)
    if not uri.startswith("file:"):
        url = (f"{uri.rstrip('/')}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}"
               if uri.startswith(_SERVER_SCHEMES) else None)
        return [TrackerRun(tracker="mlflow", run_id=run.info.run_id, run_name=tracker_run_name(job), url=url,
                           note=f"recorded on the tracking server {uri}")]
    store_path = f"{folder}/{MLFLOW_STORE}.tar.gz"
    note = (f"a file store: download {store_path}, extract it (`tar xzf`), then open it with "
            f"`MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri {MLFLOW_STORE}`")
    return [TrackerRun(tracker="mlflow", run_id=run.info.run_id, run_name=tracker_run_name(job), store_path=store_path,
                       note=note)]


def tracker_files(local: Path, folder: str, secrets: Iterable[str]) -> tuple[dict[str, bytes | Path], list[str]]:
    """(the files under `local` to store, keyed by their path under `folder`; the ones left out). A text file's
    secrets are redacted; a binary file that holds a secret's value is left out (replacing bytes would corrupt it).
    Links (W&B's `latest-run`) and W&B's scratch folder are skipped. An MLflow file store (`mlruns/`: a file per
    parameter, hundreds) is stored as one archive, `mlruns.tar.gz`, which also keeps the empty folders MLflow
    requires of a run."""
    secrets = [value.encode() for value in secrets]
    files: dict[str, bytes | Path] = {}
    archived: dict[str, bytes] = {}
    left_out: list[str] = []
    if not local.is_dir():
        return files, left_out
    for path in sorted(local.rglob("*")):
        relative = path.relative_to(local)
        if path.is_symlink() or not path.is_file() or "tmp" in relative.parts[:-1]:
            continue
        data = path.read_bytes()
        found = [value for value in secrets if value in data]
        if found and not _is_text(data):
            left_out.append(relative.as_posix())
            continue
        for value in found:
            data = data.replace(value, REDACTED.encode())
        if relative.parts[0] == MLFLOW_STORE:
            archived[relative.as_posix()] = data
        else:
            files[f"{folder}/{relative.as_posix()}"] = data if found else path
    if (local / MLFLOW_STORE).is_dir():
        files[f"{folder}/{MLFLOW_STORE}.tar.gz"] = _tar_gz(local, MLFLOW_STORE, archived)
    return files, left_out


def _tar_gz(root: Path, top: str, members: dict[str, bytes]) -> bytes:
    """`root/top` as a gzipped tar of its folders (empty ones too) and of `members` (path under `root`: content)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for folder in [root / top, *sorted(p for p in (root / top).rglob("*") if p.is_dir() and not p.is_symlink())]:
            archive.addfile(_tar_info(folder.relative_to(root).as_posix(), tarfile.DIRTYPE))
        for name, data in members.items():
            archive.addfile(_tar_info(name, tarfile.REGTYPE, len(data)), io.BytesIO(data))
    return buffer.getvalue()


def _tar_info(name: str, kind: bytes, size: int = 0) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.size, info.mode = kind, size, 0o755 if kind == tarfile.DIRTYPE else 0o644
    return info


def _is_text(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return b"\0" not in data
