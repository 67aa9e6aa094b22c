"""A run's `[evaluation]` on the control plane: the spec refuses bad combinations naming the field, an evaluation file
is checked like the dataset and shipped with it, the cost estimate counts evaluation, and the run's end event carries
the final eval figure. (What the worker evaluates: worker_image/tests/test_worker_evaluation.py; the summary's lines
and curve: tests/test_run_summary.py, tests/test_curve.py.)"""

import json

import pytest
from loraflow_worker.artifacts import FileStore
from loraflow_worker.contract import TrainingSettings, TrainMetrics
from pydantic import ValidationError

from flows.forms.run import RunSpec, SpecError, load_run_file
from tasks.placement.cost import evaluation_cost
from tasks.reports.events import final_metrics
from tasks.storage.artifacts import check_dataset_jsonl, eval_store_path, publish_run_inputs
from tasks.storage.run_files import read_run_files

MESSAGES = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}


def spec(**evaluation) -> dict:
    return {"model": {"id": "Qwen/Qwen3-0.6B"}, "dataset": {"hub_id": "trl-lib/Capybara"},
            "artifact_store": "hf://datasets/acme/runs", "evaluation": evaluation}


def refused_fields(evaluation: dict) -> dict[str, str]:
    with pytest.raises(ValidationError) as e:
        RunSpec.model_validate(spec(**evaluation))
    return {".".join(map(str, error["loc"])): error["msg"] for error in e.value.errors()}


def test_a_held_out_fraction_gets_the_documented_defaults():
    evaluation = RunSpec.model_validate(spec(fraction=0.2)).evaluation
    assert (evaluation.fraction, evaluation.every_steps, evaluation.max_samples) == (0.2, 50, 200)


def test_no_evaluation_section_means_no_evaluation():
    assert RunSpec.model_validate({k: v for k, v in spec().items() if k != "evaluation"}).evaluation is None


def test_a_fraction_and_a_file_together_are_refused_naming_both():
    [(field, message)] = refused_fields({"fraction": 0.1, "local_file": "eval.jsonl"}).items()
    assert field == "evaluation" and "`fraction`" in message and "`local_file`" in message


def test_an_evaluation_without_a_source_or_tasks_is_refused():
    [(field, message)] = refused_fields({"every_steps": 10}).items()
    assert field == "evaluation" and "set `fraction`" in message and "`[[evaluation.tasks]]`" in message


@pytest.mark.parametrize("evaluation, field", [
    ({"fraction": 0.5}, "evaluation.fraction"),
    ({"fraction": 0.0}, "evaluation.fraction"),
    ({"fraction": 0.1, "every_steps": 0}, "evaluation.every_steps"),
    ({"fraction": 0.1, "max_samples": 0}, "evaluation.max_samples"),
    ({"fraction": 0.1, "sample": 10}, "evaluation.sample"),
])
def test_out_of_range_or_unknown_evaluation_fields_are_refused_by_name(evaluation, field):
    assert field in refused_fields(evaluation)


def test_a_run_file_names_the_evaluation_field_it_gets_wrong(tmp_path):
    run_file = tmp_path / "run.toml"
    run_file.write_text('artifact_store = "file:///tmp/s"\n[model]\nid = "m"\n[dataset]\nhub_id = "d"\n'
                        "[evaluation]\nfraction = 0.7\n")
    with pytest.raises(SpecError, match=r"evaluation\.fraction: Input should be less than 0\.5"):
        load_run_file(run_file)


def test_a_bad_evaluation_file_is_refused_naming_evaluation_local_file(tmp_path):
    bad = tmp_path / "eval.jsonl"
    bad.write_text(json.dumps({"text": "no chat here"}) + "\n")
    with pytest.raises(ValueError, match=rf"^evaluation\.local_file {bad}, line 1: no `messages` or `prompt`"):
        check_dataset_jsonl(bad, "sft", "evaluation.local_file")


def test_the_evaluation_file_is_stored_with_the_dataset_in_one_commit(tmp_path):
    dataset, eval_file = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    dataset.write_text(json.dumps(MESSAGES) + "\n")
    eval_file.write_text(json.dumps(MESSAGES) + "\n" + json.dumps(MESSAGES) + "\n")
    commits = []

    class Recording(FileStore):
        def put(self, files, *, message, **kwargs):
            commits.append(sorted(files))
            return super().put(files, message=message, **kwargs)

    store = Recording(tmp_path / "store")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("tasks.storage.artifacts.open_store", lambda url, token=None: store)
        files = read_run_files([("dataset.local_file", str(dataset)), ("evaluation.local_file", str(eval_file))],
                               tmp_path / "read", base_dir=tmp_path)
        dataset_path, _, _ = publish_run_inputs("file:///unused", "r1", files, [])
    assert commits == [sorted([dataset_path, eval_store_path("r1")])]
    assert (tmp_path / "store" / eval_store_path("r1")).read_bytes() == eval_file.read_bytes()


def test_the_cost_estimate_counts_every_evaluation_of_the_held_out_examples():
    # 100 examples, 20 held out (of at most 200), 80 trained on; 30 steps of 8: evaluated at 0, 10, 20, 30.
    cost = evaluation_cost("sft", TrainingSettings(max_steps=30, batch_size=8), every_steps=10, max_samples=200,
                           fraction=0.2, dataset_examples=100, eval_file_examples=None)
    assert (cost.evaluations, cost.examples) == (4, 20)
    assert cost.share == pytest.approx(4 * 20 / 3 / (30 * 8), abs=1e-4)


def test_the_cost_estimate_caps_the_examples_at_max_samples_and_counts_the_last_step():
    # An evaluation file of 500 examples, capped at 50; 1 epoch of 1000 examples in batches of 10 = 100 steps, so
    # evaluated at 0, 30, 60, 90 and after step 100.
    cost = evaluation_cost("grpo", TrainingSettings(batch_size=10), every_steps=30, max_samples=50, fraction=None,
                           dataset_examples=1000, eval_file_examples=500)
    assert (cost.evaluations, cost.examples) == (5, 50)


def test_the_cost_of_an_evaluation_over_epochs_of_a_hub_dataset_is_not_known_before_the_run():
    assert evaluation_cost("sft", TrainingSettings(), every_steps=50, max_samples=200, fraction=0.1,
                           dataset_examples=None, eval_file_examples=None) is None


def test_the_finished_event_carries_the_final_train_and_eval_figures():
    metrics = TrainMetrics(steps=4, losses=[(1, 6.4), (4, 1.25)], eval_loss=[(0, 6.9), (4, 2.05)], first_loss=6.4,
                           final_loss=1.25, tokens=10, wall_seconds=1.0, device="cpu")
    assert final_metrics(metrics) == {"steps": 4, "loss": 1.25, "eval_loss": 2.05}
    grpo = metrics.model_copy(update={"eval_loss": [], "rewards": [(4, 0.5)], "eval_reward": [(0, 0.1), (4, 0.4)]})
    assert final_metrics(grpo) == {"steps": 4, "loss": 1.25, "reward": 0.5, "eval_reward": 0.4}
