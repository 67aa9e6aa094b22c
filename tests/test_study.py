"""A study's spec, its children, its budget and its comparison, without a flow (the study end to end:
`tests/test_study_e2e.py`)."""

from __future__ import annotations

import tomllib

import pytest
from loraflow_worker.contract import TrainMetrics
from pydantic import ValidationError

from flows.spec import SpecError
from flows.study_spec import StudySpec, expand, load_study_file
from tasks.placement.cost import CostCeiling, check_study_budget
from tasks.reports.study import (
    ChildRow,
    StudyReport,
    best_child,
    completed_row,
    overlay_png,
    study_markdown,
    table_rows,
)

BASE = """
name = "sweep"
artifact_store = "file:///tmp/store"
[model]
id = "Qwen/Qwen3-0.6B"
[dataset]
hub_id = "trl-lib/Capybara"
[evaluation]
fraction = 0.1
"""


def study(section: str, base: str = BASE) -> StudySpec:
    return StudySpec.model_validate(tomllib.loads(base + "[study]\n" + section))


def test_a_grid_and_seeds_make_one_child_per_combination_named_after_the_values_that_differ():
    children = expand(study('grid = {"training.learning_rate" = [1e-4, 3e-4], "lora.rank" = [8]}\nseeds = [1, 2]'))
    assert [(c.spec.training.learning_rate, c.spec.lora.rank, c.spec.training.seed) for c in children] == [
        (1e-4, 8, 1), (1e-4, 8, 2), (3e-4, 8, 1), (3e-4, 8, 2)]
    assert [c.spec.name for c in children] == ["sweep-lr0p0001-s1", "sweep-lr0p0001-s2", "sweep-lr0p0003-s1",
                                               "sweep-lr0p0003-s2"]
    assert children[0].values == {"training.learning_rate": 1e-4, "lora.rank": 8, "training.seed": 1}


def test_children_keep_every_field_of_the_run_file_they_do_not_vary():
    (child,) = expand(study('grid = {"training.max_steps" = [7]}'))
    assert child.spec.evaluation.fraction == 0.1 and child.spec.dataset.hub_id == "trl-lib/Capybara"
    assert child.spec.training.max_steps == 7 and child.spec.name == "sweep-c1"  # nothing differs: numbered


def test_a_child_name_too_long_for_a_run_name_is_numbered_instead():
    spec = study('grid = {"training.learning_rate" = [1.25e-4, 2.5e-4]}\nseeds = [11, 12]',
                 BASE.replace('name = "sweep"', f'name = "{"s" * 30}"'))
    assert [c.spec.name for c in expand(spec)] == [f"{'s' * 30}-c{i}" for i in range(1, 5)]


def test_a_grid_value_that_makes_a_child_invalid_refuses_the_study_naming_the_child_and_the_field():
    with pytest.raises(SpecError) as refused:
        expand(study('grid = {"training.learning_rate" = [1e-4, 5.0]}'))
    assert "1 of 2 child run(s) would be invalid, so nothing was started" in str(refused.value)
    assert "child 2 (training.learning_rate=5)" in str(refused.value)
    assert "training.learning_rate: Input should be less than or equal to 1" in str(refused.value)


@pytest.mark.parametrize(("grid", "says"), [
    ('{"training.lr" = [1]}', "`training` has no field `lr`"),
    ('{"name" = ["a"]}', "`name` is not varied"),
    ('{"dataset.mix.fraction" = [0.5]}', "`dataset.mix` has no fields inside it to vary"),
    ('{"training.learning_rate" = [1e-4, 0.0001]}', "a value is listed twice"),
])
def test_a_grid_key_that_is_not_a_run_field_is_refused_naming_it(grid, says):
    with pytest.raises(ValidationError) as refused:
        study(f"grid = {grid}")
    assert says in str(refused.value)


def test_seeds_and_a_seed_grid_together_are_refused():
    with pytest.raises(ValidationError, match="both vary the seed"):
        study('grid = {"training.seed" = [1, 2]}\nseeds = [3]')


def test_a_metric_the_algorithm_does_not_record_is_refused_naming_those_it_does():
    with pytest.raises(ValidationError, match="not recorded by sft runs .* pick one of eval_loss, train_loss"):
        study('metric = "eval_reward"')


def test_an_eval_metric_without_evaluation_is_refused_naming_the_section_to_add():
    with pytest.raises(ValidationError, match=r"add an `\[evaluation\]` section"):
        study("seeds = [1, 2]", BASE.replace("[evaluation]\nfraction = 0.1\n", ""))


def test_publish_without_publish_best_is_refused_as_every_child_would_publish_to_one_repo():
    with pytest.raises(ValidationError, match="every child publish to the same repo"):
        study("seeds = [1, 2]", BASE + '[publish]\nhub_model_id = "acme/best"\n')


def test_publish_best_leaves_publishing_to_the_study():
    spec = study("seeds = [1, 2]\npublish_best = true", BASE + '[publish]\nhub_model_id = "acme/best"\n')
    assert all(child.spec.publish is None for child in expand(spec)) and spec.publish.hub_model_id == "acme/best"


def test_a_run_file_without_a_study_section_is_refused_naming_the_train_flow(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(BASE)
    with pytest.raises(SpecError, match="has no \\[study\\] section: it is one run .*flows.train"):
        load_study_file(path)


def ceiling(usd: float) -> CostCeiling:
    return CostCeiling(usd=usd, gpu="RTX 4090", usd_per_hour=0.69, price_source="static list price")


def test_a_study_whose_ceilings_add_up_to_more_than_its_budget_is_refused_naming_the_totals():
    with pytest.raises(ValueError) as refused:
        check_study_budget({"a": ceiling(1.38), "b": ceiling(1.38), "c": ceiling(2.0)}, budget_usd=4.0)
    message = str(refused.value)
    assert "3 children may cost up to $4.76 in all" in message and "above study.budget_usd $4.00" in message
    assert "the dearest, c: $2.00" in message and "nothing was rented" in message


def test_a_study_within_its_budget_or_without_one_passes():
    check_study_budget({"a": ceiling(1.0), "b": ceiling(1.0)}, budget_usd=2.0)
    check_study_budget({"a": ceiling(100.0)}, budget_usd=None)


def metrics(eval_losses: list[float], final_loss: float = 1.0) -> TrainMetrics:
    return TrainMetrics(steps=len(eval_losses), losses=[(1, 2.0), (2, final_loss)],
                        eval_loss=list(enumerate(eval_losses)), first_loss=2.0, final_loss=final_loss, tokens=10,
                        wall_seconds=1.0, device="cpu")


def row(index: int, state: str = "completed", reason: str = "") -> ChildRow:
    return ChildRow(index=index, name=f"c{index}", values=f"training.seed={index}", state=state, reason=reason)


def test_the_best_child_has_the_lowest_loss_and_a_failed_child_is_a_row_not_a_candidate():
    rows = [completed_row(row(1), metrics([2.0, 1.5]), "eval_loss"), row(2, "failed", "out of memory"),
            completed_row(row(3), metrics([2.0, 1.2]), "eval_loss")]
    best = best_child(rows, maximize=False)
    assert best.index == 3 and best.metric == 1.2
    table = table_rows(rows, "eval_loss", best)
    assert [r["child"] for r in table] == ["c1", "c2", "c3 (best)"]
    assert table[1]["state"] == "failed" and table[1]["reason"] == "out of memory" and table[1]["eval_loss"] == ""


def test_a_maximized_metric_picks_the_highest_and_a_tie_the_earlier_child():
    rows = [row(1).model_copy(update={"metric": 0.5}), row(2).model_copy(update={"metric": 0.7}),
            row(3).model_copy(update={"metric": 0.7})]
    assert best_child(rows, maximize=True).index == 2
    assert best_child(rows, maximize=False).index == 1


def test_no_completed_child_means_no_best():
    assert best_child([row(1, "failed", "x"), row(2, "cancelled", "y")], maximize=False) is None


def test_the_summary_names_the_best_child_lists_every_child_and_overlays_their_curves():
    rows = [completed_row(row(1), metrics([2.0, 1.5]), "eval_loss"), row(2, "failed", "out of memory")]
    plot = overlay_png({"c1": metrics([2.0, 1.5]), "c2": metrics([2.1, 1.9])}, "eval_loss")
    assert plot is not None and plot.startswith(b"\x89PNG")
    report = StudyReport(study="sweep", metric="eval_loss", maximize=False, rows=rows, best=rows[0], cost_usd=0.5,
                         cost_ceiling_usd=2.76, budget_usd=5.0)
    markdown = study_markdown(report, plot)
    assert "**Best child: c1** (training.seed=1): eval_loss 1.5, the lowest of 1." in markdown
    assert "| c1 **(best)** |" in markdown and "| c2 | training.seed=2 | failed |  | unknown |  | out of memory |" \
        in markdown
    assert "Children: 1 completed, 1 failed" in markdown and "of a $5.00 budget" in markdown
    assert "data:image/png;base64," in markdown
