"""What the control plane reads of a finished run's store: the result (the job's own output first, which the stored
copy must agree with), and the trajectories a GRPO run kept."""

import json

import pytest
from loraflow_worker.contract import JobResult, TrainMetrics

from tasks.storage.artifacts import ResultsChanged, read_run_results

ADAPTER_SHA256 = {"adapter_model.safetensors": "a" * 64, "adapter_config.json": "c" * 64}


def _result(run_id: str, **fields) -> JobResult:
    return JobResult(run_id=run_id, attempt=1, run_prefix=f"runs/{run_id}", adapter_path=f"runs/{run_id}/adapter",
                     metrics=TrainMetrics(steps=2, losses=[], first_loss=None, final_loss=None, tokens=1,
                                          wall_seconds=1.0, device="cpu"), adapter_sha256=ADAPTER_SHA256, **fields)


def _finished_run(root, run_id: str, trajectories: str | None, result: JobResult | None = None) -> str:
    folder = root / "runs" / run_id
    folder.mkdir(parents=True)
    (folder / "result.json").write_text((result or _result(run_id)).model_dump_json())
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


def test_a_completed_jobs_output_is_the_result_with_the_commit_that_holds_the_adapter(tmp_path):
    output = _result("r3", revision="d" * 40).model_dump(mode="json")
    results = read_run_results(_finished_run(tmp_path, "r3", None), "r3", job_output=output)
    assert results.result.revision == "d" * 40 and results.result.adapter_sha256 == ADAPTER_SHA256


def test_a_stored_result_whose_adapter_hashes_differ_from_the_jobs_output_is_refused(tmp_path):
    covered_up = _result("r4").model_copy(update={"adapter_sha256": ADAPTER_SHA256 | {
        "adapter_model.safetensors": "b" * 64}})
    store_url = _finished_run(tmp_path, "r4", None, result=covered_up)
    with pytest.raises(ResultsChanged, match=r"runs/r4/result.json names other adapter files than the job reported "
                                             r"\(they differ for adapter_model.safetensors\)"):
        read_run_results(store_url, "r4", job_output=_result("r4").model_dump(mode="json"))


def test_without_a_job_output_the_stored_result_is_the_result(tmp_path):
    results = read_run_results(_finished_run(tmp_path, "r5", None), "r5")
    assert results.result == _result("r5")
