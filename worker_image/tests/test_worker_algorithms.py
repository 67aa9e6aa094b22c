"""The training process runs the training body the job's `algorithm` names."""

from __future__ import annotations

from loraflow_worker.handler import WORK_DIR_ENV, handler


def test_grpo_job_runs_through_the_handler(tiny_model_dir, make_job, tmp_path, monkeypatch):
    monkeypatch.setenv(WORK_DIR_ENV, str(tmp_path / "work"))
    job = make_job("run-g", tiny_model_dir, tmp_path / "store", algorithm="grpo",
                   training={"max_steps": 2, "learning_rate": 3e-2, "batch_size": 8},
                   grpo={"num_generations": 4, "max_completion_length": 8, "rewards": [{"name": "digit_fraction"}]})
    result = handler(job)
    assert result["metrics"]["steps"] == 2
    assert [step for step, _ in result["metrics"]["rewards"]] == [1, 2]  # only GRPO logs rewards
    assert (tmp_path / "store" / "runs" / "run-g" / "DONE").is_file()
