"""What the control plane reads of a finished run's store beyond its result: the trajectories a GRPO run kept."""

import json

from loraflow_worker.contract import JobResult, TrainMetrics

from tasks.storage.artifacts import read_run_results


def _finished_run(root, run_id: str, trajectories: str | None) -> str:
    folder = root / "runs" / run_id
    folder.mkdir(parents=True)
    result = JobResult(run_id=run_id, attempt=1, run_prefix=f"runs/{run_id}", adapter_path=f"runs/{run_id}/adapter",
                       metrics=TrainMetrics(steps=2, losses=[], first_loss=None, final_loss=None, tokens=1,
                                           wall_seconds=1.0, device="cpu"))
    (folder / "result.json").write_text(result.model_dump_json())
    (folder / "DONE").write_text("{}")
    if trajectories is not None:
        (folder / "trajectories.jsonl").write_text(trajectories)
    return f"file://{root}"


def test_the_trajectories_of_the_last_logging_step_are_read_skipping_unreadable_lines(tmp_path):
    lines = [json.dumps({"step": 1, "prompt": "a"}), "not json", json.dumps({"step": 2, "prompt": "b"}),
             json.dumps(["no", "object"]), json.dumps({"step": 2, "prompt": "c"})]
    results = read_run_results(_finished_run(tmp_path, "r1", "\n".join(lines)), "r1")
    assert [t["prompt"] for t in results.trajectories] == ["b", "c"]
    assert results.trajectories_url.endswith("runs/r1/trajectories.jsonl")


def test_a_run_without_trajectories_has_none(tmp_path):
    results = read_run_results(_finished_run(tmp_path, "r2", None), "r2")
    assert results.trajectories == [] and results.trajectories_url is None
