"""Tracking (`training.report_to`): W&B offline and an MLflow file store record a real training process's loss and
eval loss and the task and benchmark scores after training, the trackers' files are stored with the run, the result names each tracker's run, and the run's secrets
stay out of what is stored.

One short SFT job (module fixture) runs as the real training process (`python -m loraflow_worker.training.train_job`) with
both trackers and no tracker credentials, as a user with neither a W&B key nor an MLflow server gets it.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import struct
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from pydantic import ValidationError
from worker_test_support import CHOICE_TASK, COLOURS, stored_files_containing

from loraflow_worker.contract import JobInput, JobResult, TrainingSettings
from loraflow_worker.contract.task_evaluation import BenchmarkScore, TaskScore
from loraflow_worker.evaluation.evaluated import Evaluated, tracker_metrics
from loraflow_worker.runtime.environment import child_env
from loraflow_worker.self_test.tiny_model import DEFAULT_CORPUS
from loraflow_worker.training.tracking import tracker_files, tracking_env

STEPS, EVERY = 6, 3
RUN_ID = "tracked-run"
TASK_FILE = f"runs/{RUN_ID}/evaluation-inputs/capitals.jsonl"
TASK_DIR = f"runs/{RUN_ID}/evaluation-inputs/benchmarks"
JUDGE_KEY = "judge-key-value-4711"
"""A run's own secret (`worker_secret_names`): it must be in none of the trackers' stored files."""


@dataclass
class TrackedRun:
    result: JobResult
    store_root: Path
    output: str

    def stored(self, store_path: str) -> Path:
        return self.store_root / store_path


@pytest.fixture(scope="module")
def tracked(tiny_model_dir, tmp_path_factory) -> TrackedRun:
    store_root, work_dir, home = (tmp_path_factory.mktemp(name) for name in ("store", "work", "home"))
    dataset_path = f"runs/{RUN_ID}/dataset/train.jsonl"
    (store_root / dataset_path).parent.mkdir(parents=True)
    shutil.copyfile(DEFAULT_CORPUS, store_root / dataset_path)
    (store_root / TASK_FILE).parent.mkdir(parents=True)
    (store_root / TASK_FILE).write_text("".join(json.dumps({"prompt": question, "answer": "Paris"}) + "\n"
                                                for question in ("What is the capital of France?", "France?")))
    (store_root / TASK_DIR / "data").mkdir(parents=True)
    (store_root / TASK_DIR / "colours.yaml").write_text(CHOICE_TASK)
    (store_root / TASK_DIR / "data" / "colours.jsonl").write_text("".join(json.dumps(row) + "\n" for row in COLOURS))
    job = JobInput.model_validate({
        "run_id": RUN_ID, "model": {"id": str(tiny_model_dir)}, "dataset": {"store_path": dataset_path},
        "artifact_store": store_root.as_uri(), "worker_secret_names": ["JUDGE_KEY"],
        "training": {"max_steps": STEPS, "learning_rate": 1e-2, "batch_size": 8, "report_to": ["wandb", "mlflow"]},
        "evaluation": {"fraction": 0.2, "every_steps": EVERY, "tasks": [
            {"name": "capitals", "store_path": TASK_FILE, "graders": [{"kind": "contains"}], "max_new_tokens": 4}],
            "benchmarks": {"tasks": ["colours"], "batch_size": 6, "task_dir_store_path": TASK_DIR}},
    })
    (work_dir / "job.json").write_text(job.model_dump_json())
    outside = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "MLFLOW_"))}
    # The training process's environment as the supervisor builds it; W&B's settings and cache in a home of its own.
    env = child_env(job, outside | {"JUDGE_KEY": JUDGE_KEY, "HOME": str(home)})
    proc = subprocess.run([sys.executable, "-m", "loraflow_worker.training.train_job", str(work_dir / "job.json")],
                          cwd=work_dir, env=env, capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    result = JobResult.model_validate_json((store_root / "runs" / RUN_ID / "result.json").read_text())
    return TrackedRun(result, store_root, output)


def _tracker(run: TrackedRun, name: str):
    return next(t for t in run.result.trackers if t.tracker == name)


def wandb_records(run_file: Path) -> list:
    """The records of a W&B run file (`run-<id>.wandb`): a 7-byte header (`:W&B`, an id, a version), then
    LevelDB's log format (32 KiB blocks of chunks, each with a 7-byte header: CRC, length, type), each record a
    `wandb_internal_pb2.Record`. W&B's own reader lives in its Go core, which has no offline reading API."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B", run_file
    block, position, pending, records = 32768, 7, b"", []
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if length == 0 and kind == 0:
            break
        pending += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # FULL or LAST: the record is whole
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_history(run_file: Path) -> dict[str, list[tuple[int, float]]]:
    """Each logged key's (step, value) pairs, from the run file's history records."""
    series: dict[str, list[tuple[int, float]]] = {}
    for record in wandb_records(run_file):
        if record.WhichOneof("record_type") != "history":
            continue
        items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
        step = int(items.pop("train/global_step", items.get("_step", 0)))
        for key, value in items.items():
            if not key.startswith("_") and isinstance(value, (int, float)):
                series.setdefault(key, []).append((step, float(value)))
    return series


def test_the_result_names_both_trackers_runs_and_where_their_files_are_stored(tracked):
    wandb, mlflow = _tracker(tracked, "wandb"), _tracker(tracked, "mlflow")
    assert wandb.run_name == mlflow.run_name == f"{RUN_ID}-a1"
    assert wandb.url is None and "wandb sync" in wandb.note  # offline: no key
    assert mlflow.url is None and "mlflow ui" in mlflow.note  # a file store: no server
    assert wandb.store_path.startswith(f"runs/{RUN_ID}/tracking/a1/wandb/offline-run-")
    assert mlflow.store_path == f"runs/{RUN_ID}/tracking/a1/mlruns.tar.gz"
    assert tracked.stored(wandb.store_path).is_dir() and tracked.stored(mlflow.store_path).is_file()


def test_wandb_offline_records_the_loss_and_the_eval_loss_of_every_step(tracked):
    wandb = _tracker(tracked, "wandb")
    run_file = next(tracked.stored(wandb.store_path).glob("run-*.wandb"))
    run = next(r.run for r in wandb_records(run_file) if r.WhichOneof("record_type") == "run")
    assert (run.run_id, run.display_name, run.run_group, run.project) == (wandb.run_id, f"{RUN_ID}-a1", RUN_ID, "loraflow")
    history = wandb_history(run_file)
    assert [step for step, _ in history["train/loss"]] == list(range(1, STEPS + 1))
    assert [step for step, _ in history["eval/loss"]] == [0, EVERY, STEPS]
    assert history["train/loss"][-1][1] == pytest.approx(tracked.result.metrics.final_loss, rel=1e-3)


def test_both_trackers_record_the_task_and_benchmark_scores_at_the_last_step(tracked, monkeypatch, tmp_path):
    from mlflow.tracking import MlflowClient

    (score,) = tracked.result.metrics.task_scores
    (benchmark,) = tracked.result.metrics.benchmark_scores
    expected = {f"task/capitals/contains/{part}": getattr(score, part)
                for part in ("base", "adapter", "delta", "delta_stderr")}
    expected |= {f"benchmark/colours/acc/{part}": getattr(benchmark, part)
                 for part in ("base", "adapter", "delta", "base_stderr", "adapter_stderr")}
    run_file = next(tracked.stored(_tracker(tracked, "wandb").store_path).glob("run-*.wandb"))
    history = wandb_history(run_file)
    assert {key: history.get(key) for key in expected} == {key: [(STEPS, value)] for key, value in expected.items()}
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    mlflow = _tracker(tracked, "mlflow")
    with tarfile.open(tracked.stored(mlflow.store_path)) as archive:
        archive.extractall(tmp_path, filter="data")
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    assert {key: [(m.step, m.value) for m in client.get_metric_history(mlflow.run_id, key)] for key in expected} == \
        {key: [(STEPS, pytest.approx(value))] for key, value in expected.items()}


def test_the_tracker_name_of_a_harness_metric_under_a_filter_is_one_mlflow_takes():
    from mlflow.utils.validation import _validate_metric_name

    evaluated = Evaluated(
        task_scores=[TaskScore(task="capitals", grader="one_word", n=2, base=0.0, base_stderr=0.0,
                               adapter=1.0, adapter_stderr=0.0, delta=1.0, delta_stderr=0.0)],
        benchmark_scores=[BenchmarkScore(task="gsm8k", metric="exact_match,strict-match", n=2, base=0.0,
                                         base_stderr=None, adapter=0.5, adapter_stderr=0.5, delta=0.5)])
    names = tracker_metrics(evaluated)
    assert sorted(names) == sorted([
        *(f"task/capitals/one_word/{part}" for part in ("base", "adapter", "delta", "delta_stderr")),
        *(f"benchmark/gsm8k/exact_match_strict-match/{part}" for part in ("base", "adapter", "delta",
                                                                            "adapter_stderr"))])
    for name in names:
        _validate_metric_name(name)


def test_mlflow_records_the_loss_and_the_eval_loss_in_a_file_store_stored_with_the_run(tracked, monkeypatch, tmp_path):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    mlflow = _tracker(tracked, "mlflow")
    with tarfile.open(tracked.stored(mlflow.store_path)) as archive:
        archive.extractall(tmp_path, filter="data")
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    run = client.get_run(mlflow.run_id)
    assert run.info.run_name == f"{RUN_ID}-a1" and run.data.tags["loraflow.run_id"] == RUN_ID
    assert client.get_experiment(run.info.experiment_id).name == "loraflow"
    assert [m.step for m in client.get_metric_history(mlflow.run_id, "loss")] == list(range(1, STEPS + 1))
    assert [m.step for m in client.get_metric_history(mlflow.run_id, "eval_loss")] == [0, EVERY, STEPS]
    assert run.data.params["learning_rate"] == "0.01"


def test_no_stored_file_holds_the_runs_secret(tracked):
    assert stored_files_containing(tracked.store_root, JUDGE_KEY) == []


def test_a_run_without_trackers_stores_no_tracking_folder(finished_job):
    assert finished_job.result["trackers"] == []
    assert not (finished_job.run_dir / "tracking").exists()


def test_wandb_is_online_only_with_a_key_and_mlflow_uses_a_server_only_when_named(tmp_path):
    job = JobInput.model_validate({"run_id": "r", "model": {"id": "m"}, "dataset": {"hub_id": "d"},
                                   "artifact_store": "file:///s", "training": {"report_to": ["wandb", "mlflow"]}})
    bare = tracking_env(job, tmp_path, {})
    assert bare["WANDB_MODE"] == "offline" and bare["MLFLOW_TRACKING_URI"].startswith("file://")
    assert bare["WANDB_DIR"] == str(tmp_path / "tracking") and bare["WANDB_CONSOLE"] == "off"
    given = tracking_env(job, tmp_path, {"WANDB_API_KEY": "k" * 40, "WANDB_PROJECT": "mine",
                                         "MLFLOW_TRACKING_URI": "https://mlflow.example.com"})
    assert given["WANDB_MODE"] == "online" and given["WANDB_PROJECT"] == "mine"
    assert "MLFLOW_TRACKING_URI" not in given and "MLFLOW_ALLOW_FILE_STORE" not in given


def test_tracker_files_redact_text_leave_out_binary_holding_a_secret_and_skip_links(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "debug.log").write_text("token=sekrit-value here")
    (tmp_path / "run" / "run.wandb").write_bytes(b"\x00\x01sekrit-value\x02")
    (tmp_path / "run" / "plain.json").write_text("{}")
    (tmp_path / "latest-run").symlink_to(tmp_path / "run")
    (tmp_path / "mlruns" / "1" / "abc" / "artifacts").mkdir(parents=True)
    (tmp_path / "mlruns" / "1" / "abc" / "meta.yaml").write_text("key: sekrit-value")
    files, left_out = tracker_files(tmp_path, "runs/r/tracking/a1", ["sekrit-value"])
    assert files["runs/r/tracking/a1/run/debug.log"] == b"token=*** here"
    assert files["runs/r/tracking/a1/run/plain.json"] == tmp_path / "run" / "plain.json"
    assert left_out == ["run/run.wandb"] and not any("latest-run" in key for key in files)
    with tarfile.open(fileobj=io.BytesIO(files["runs/r/tracking/a1/mlruns.tar.gz"])) as archive:
        assert "mlruns/1/abc/artifacts" in archive.getnames()  # an empty folder MLflow requires of a run
        assert archive.extractfile("mlruns/1/abc/meta.yaml").read() == b"key: ***"
    assert not any(key.startswith("runs/r/tracking/a1/mlruns/") for key in files)


@pytest.mark.parametrize("report_to", [["wandb", "wandb"], ["tensorboard"]])
def test_report_to_takes_each_known_tracker_once(report_to):
    with pytest.raises(ValidationError, match="report_to"):
        TrainingSettings(report_to=report_to)
