"""A study's spec, its children, its budget kept as children start, which earlier runs a resumed study adopts, how it
prunes a losing child, how Optuna picks a search's children (a real Optuna study, on SQLite), and its comparison,
without a flow (the study end to end: `tests/test_study_e2e.py`)."""

from __future__ import annotations

import tomllib
import uuid

import pytest
from loraflow_worker.contract import TrainMetrics
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from prefect.client.schemas.objects import FlowRun, StateType
from pydantic import ValidationError

from flows.forms.run import SpecError
from flows.study_search import Search, distributions, space_corners
from flows.forms.study import MAX_CHILDREN, StudySpec, expand, load_study_file, spec_difference
from tasks.lifecycle.study_children import FoundChild, adoption_plan, child_key, found_child, on_study_end
from tasks.lifecycle.study_pruning import Verdict, median_rule, pruned_step
from flows.study import children_ceilings_usd
from tasks.placement.cost import CostCeiling, check_study_budget, check_study_cap, study_budget_decision
from tasks.runpod.catalog import resolve_gpu
from tasks.runpod.live_catalog import static_offer
from tasks.reports.study import (
    PAGE_ROWS,
    ChildRow,
    StudyReport,
    best_child,
    completed_row,
    overlay_png,
    page_key,
    plotted_children,
    ranked,
    study_markdown,
    table_pages,
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


def test_a_study_with_a_child_whose_ceiling_alone_passes_its_budget_is_refused_naming_it():
    with pytest.raises(ValueError) as refused:
        check_study_budget({"a": ceiling(1.38), "b": ceiling(1.38), "c": ceiling(5.0)}, budget_usd=4.0)
    message = str(refused.value)
    assert "1 of the study's 3 children may each cost more than study.budget_usd $4.00 alone" in message
    assert "the dearest, c: $5.00" in message and "nothing was rented" in message
    assert "raise study.budget_usd" in message


def test_a_study_whose_ceilings_add_up_to_more_than_its_budget_passes_the_check_as_the_budget_is_kept_live():
    check_study_budget({"a": ceiling(1.38), "b": ceiling(1.38), "c": ceiling(2.0)}, budget_usd=4.0)
    check_study_budget({"a": ceiling(100.0)}, budget_usd=None)


def test_a_thousand_children_each_under_the_run_cap_are_refused_together_by_the_study_cap_naming_it():
    # Each child at $49.99 passes a $50 LORAFLOW_MAX_RUN_USD; together, with no study budget, they may cost $49,990.
    check_study_budget({f"c{i}": ceiling(49.99) for i in range(1000)}, budget_usd=None, cap_usd=50)
    with pytest.raises(ValueError) as refused:
        check_study_cap([49.99] * 1000, budget_usd=None, cap_usd=500)
    assert str(refused.value) == (
        "the study may cost up to $49990.00 (its 1000 children's cost ceilings together, GPU price × GPUs × deadline "
        "each; it names no study.budget_usd), above this server's cap of $500.00 per study (LORAFLOW_MAX_STUDY_USD, "
        "set by its operator), so no child was started: set study.budget_usd to at most $500.00 (children start only "
        "while it has room), run fewer children, or ask the operator")


def test_a_study_budget_within_the_study_cap_holds_its_children_whatever_their_ceilings_add_up_to():
    check_study_cap([49.99] * 1000, budget_usd=500, cap_usd=500)
    check_study_cap([1.0] * 3, budget_usd=10_000, cap_usd=500)  # the children cannot spend the budget
    check_study_cap([49.99] * 1000, budget_usd=None, cap_usd=None)  # no cap set: one person's machine
    with pytest.raises(ValueError, match=r"up to \$600.00 \(its study.budget_usd\), above .* \$500.00 per study"):
        check_study_cap([49.99] * 1000, budget_usd=600, cap_usd=500)


def offers_for(*gpus: str) -> dict:
    return {(g := resolve_gpu(name)).name: static_offer(g, "a test's prices") for name in gpus}


def test_a_grids_spend_is_each_childs_ceiling_and_a_searchs_is_its_trials_at_the_dearest_corner_values():
    grid = study('grid = { "compute.gpu" = ["4090", "H100"] }\nseeds = [1, 2]', "deadline_minutes = 60\n" + BASE)
    offers = offers_for("4090", "H100")
    cheap, dear = offers[resolve_gpu("4090").name].usd_per_hour, offers[resolve_gpu("H100").name].usd_per_hour
    assert children_ceilings_usd(grid, expand(grid), offers) == [round(cheap, 2), round(cheap, 2), round(dear, 2),
                                                                  round(dear, 2)]
    # Optuna may pair the dearest GPU with the longest deadline, which no single corner does.
    search = study('search = "tpe"\ntrials = 7\nspace = { "compute.gpu" = ["4090", "H100"], "deadline_minutes" = '
                   '{ low = 30, high = 120 } }')
    assert children_ceilings_usd(search, space_corners(search), offers) == [round(dear * 2, 2)] * 7


def test_a_child_starts_when_the_spent_the_running_ceilings_and_its_own_fit_the_budget():
    assert study_budget_decision(10.0, spent_usd=3.0, running_ceilings_usd=[2.0, 2.0], ceiling_usd=3.0) == ("start", "")
    assert study_budget_decision(None, spent_usd=300.0, running_ceilings_usd=[2.0], ceiling_usd=3.0) == ("start", "")


def test_a_child_that_does_not_fit_waits_while_others_run_and_is_skipped_when_none_does():
    decision, why = study_budget_decision(10.0, spent_usd=3.0, running_ceilings_usd=[2.0, 2.0], ceiling_usd=3.5)
    assert decision == "wait" and "2 running may cost up to $4.00" in why
    decision, why = study_budget_decision(10.0, spent_usd=7.0, running_ceilings_usd=[], ceiling_usd=3.5)
    assert decision == "skip"
    assert why == "study.budget_usd $10.00 reached: $7.00 spent by the children before it, $3.00 left, below its " \
        "cost ceiling $3.50"


def simulate_budget(budget: float, ceilings: list[float], costs: list[float], parallel: int) -> list[str]:
    """The study's loop in miniature: each round the children that fit start, then the one that started first ends
    having cost what `costs` says. Returns each child's fate."""
    fate, running, spent, pending = {}, [], 0.0, list(range(len(ceilings)))
    while pending or running:
        while pending and len(running) < parallel:
            decision, _ = study_budget_decision(budget, spent, [ceilings[i] for i in running], ceilings[pending[0]])
            if decision == "wait":
                break
            child = pending.pop(0)
            if decision == "skip":
                fate[child] = "skipped"
            else:
                running.append(child)
        if running:
            child = running.pop(0)
            spent += costs[child]
            fate[child] = "ran"
    return [fate[i] for i in range(len(ceilings))]


def test_a_budget_below_the_ceilings_summed_runs_children_while_what_they_really_cost_leaves_room():
    # Ten children of a $1 ceiling that each cost $0.30: a $4 budget (less than half their ceilings) runs them two at
    # a time until $3.30 is spent, then the room left ($0.70) fits no ceiling: the rest are skipped.
    assert simulate_budget(4.0, [1.0] * 10, [0.3] * 10, parallel=2) == ["ran"] * 10
    assert simulate_budget(2.5, [1.0] * 10, [0.3] * 10, parallel=2) == ["ran"] * 6 + ["skipped"] * 4
    # Never more committed than the budget: with room for one ceiling only, children run one at a time.
    assert simulate_budget(1.0, [1.0] * 3, [1.0] * 3, parallel=3) == ["ran", "skipped", "skipped"]


def test_up_to_a_thousand_children_are_accepted_and_parallel_up_to_as_many():
    spec = study('grid = {"training.learning_rate" = [' + ", ".join(f"{i}e-6" for i in range(1, 101))
                 + ']}\nseeds = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]\nparallel = 1000')
    assert spec.study.children() == MAX_CHILDREN == 1000 and spec.study.parallel == 1000
    with pytest.raises(ValidationError, match="1001 child runs .* more than 1000"):
        study('grid = {"training.learning_rate" = [' + ", ".join(f"{i}e-6" for i in range(1, 78))
              + ']}\nseeds = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]')


def test_a_deployment_must_name_a_deployment_of_the_train_flow():
    assert study('deployment = "train/qwen"').study.deployment == "train/qwen"
    with pytest.raises(ValidationError, match="study.deployment"):
        study('deployment = "study/qwen-lr"')


def test_a_deployment_child_is_given_its_whole_spec_and_every_other_train_parameter_none():
    from flows.study_run import child_parameters
    from flows.train import train

    (child,) = expand(study('grid = {"training.max_steps" = [7]}'))
    parameters = child_parameters(child.spec)
    # Every parameter the train flow has: a deployment's default `run_file` or `max_steps` cannot replace the spec.
    assert set(parameters) == set(train.parameters.properties)
    assert {k: v for k, v in parameters.items() if k != "spec"} == dict.fromkeys(set(parameters) - {"spec"})
    assert parameters["spec"]["training"] == {"max_steps": 7} and parameters["spec"]["name"] == "sweep-c1"


STUDY = "6f1c1d1e-0000-4000-8000-000000000001"


def found(index: int, state: str, *, start: int = 1, deployment: bool = True) -> FoundChild:
    return FoundChild(index=index, start=start, flow_run_id=f"run-{index}-{start}-{state}", state=state,
                      deployment=deployment)


def test_a_resumed_study_adopts_what_completed_or_still_runs_and_starts_only_the_rest():
    plans = adoption_plan([1, 2, 3, 4, 5], [
        found(1, "COMPLETED"),
        found(2, "RUNNING"),
        found(3, "FAILED"),
        found(4, "SCHEDULED"),  # started, no worker has taken it yet: it will run, so it is not started again
    ])
    assert {i: (p.action, p.run.flow_run_id if p.run else p.start) for i, p in plans.items()} == {
        1: ("adopt", "run-1-1-COMPLETED"), 2: ("adopt", "run-2-1-RUNNING"), 3: ("start", 2),
        4: ("adopt", "run-4-1-SCHEDULED"), 5: ("start", 1)}


def test_a_child_started_again_gets_a_key_of_its_own_and_a_completed_start_is_never_repeated():
    plans = adoption_plan([1, 2], [found(1, "FAILED"), found(1, "CRASHED", start=2),
                                   found(2, "FAILED"), found(2, "COMPLETED", start=2)])
    assert (plans[1].action, plans[1].start) == ("start", 3)
    values = {"training.learning_rate": 1e-4}
    first = child_key(STUDY, 1, values)
    assert child_key(STUDY, 1, values, plans[1].start) == f"{first}:3"
    assert found_child(flow_run(key=f"{first}:3"), STUDY, {}).model_dump(include={"index", "start"}) == {
        "index": 1, "start": 3}
    assert plans[2].action == "adopt" and plans[2].run.start == 2
    assert plans[1].earlier == ["run-1-1-FAILED", "run-1-2-CRASHED"] and plans[2].earlier == ["run-2-1-FAILED"]


def test_a_childs_key_carries_its_values_so_another_child_at_its_place_never_gets_its_run():
    # Prefect hands back the run an earlier start with the same key made, whatever it trained: a search resumed
    # without its Optuna study asks new values at index 1, and must not be given the run that trained others.
    ran = child_key(STUDY, 1, {"training.learning_rate": 2.4e-3, "lora.rank": 8})
    assert ran.startswith(f"{STUDY}:1:v")
    assert child_key(STUDY, 1, {"training.learning_rate": 3.9e-4, "lora.rank": 8}) != ran
    assert child_key(STUDY, 1, {"lora.rank": 8, "training.learning_rate": 2.4e-3}) == ran  # the order is not a value
    assert child_key(STUDY, 2, {"training.learning_rate": 2.4e-3, "lora.rank": 8}) != ran


def test_a_resumed_study_counts_what_every_earlier_start_of_a_child_cost():
    from tasks.lifecycle.study_children import earlier_cost

    plans = adoption_plan([1, 2, 3], [found(1, "FAILED"), found(1, "COMPLETED", start=2), found(2, "CANCELLED"),
                                      found(3, "RUNNING", start=0, deployment=False)])
    # The adopted run's cost is its row's; every other start of the child ran, and its cost counts too.
    assert [plans[i].earlier for i in (1, 2, 3)] == [["run-1-1-FAILED"], ["run-2-1-CANCELLED"],
                                                    ["run-3-0-RUNNING"]]
    assert earlier_cost(0.42, minutes=30.0, ceiling_usd=2.0, deadline_minutes=60) == 0.42  # its run.finished
    # A run whose process died sent none: its ceiling for the time it lived, at most the whole ceiling.
    assert earlier_cost(None, minutes=30.0, ceiling_usd=2.0, deadline_minutes=60) == 1.0
    assert earlier_cost(None, minutes=90.0, ceiling_usd=2.0, deadline_minutes=60) == 2.0
    assert earlier_cost(None, minutes=None, ceiling_usd=2.0, deadline_minutes=60) == 0.0  # never started


def test_a_subflow_child_left_running_by_a_dead_study_process_is_torn_down_and_run_again():
    plans = adoption_plan([1, 2], [found(1, "RUNNING", start=0, deployment=False),
                                   found(2, "COMPLETED", start=0, deployment=False)])
    assert plans[1].action == "start" and plans[1].stale == ["run-1-0-RUNNING"]
    assert plans[2].action == "adopt"


def flow_run(*, key: str | None = None, spec: dict | None = None, deployment: bool = True,
             state: StateType = StateType.RUNNING) -> FlowRun:
    return FlowRun(id=uuid.uuid4(), flow_id=uuid.uuid4(), name="x", idempotency_key=key,
                   deployment_id=uuid.uuid4() if deployment else None, parameters={"spec": spec or {}},
                   state_type=state)


def test_a_childs_run_is_known_by_its_key_or_else_by_its_spec_name():
    names = {"sweep-s1": 1, "sweep-s2": 2}
    by_key = found_child(flow_run(key=f"{STUDY}:2:3"), STUDY, names)
    assert (by_key.index, by_key.start, by_key.deployment) == (2, 3, True)
    by_name = found_child(flow_run(spec={"name": "sweep-s1"}, deployment=False), STUDY, names)
    assert (by_name.index, by_name.start, by_name.deployment) == (1, 0, False)
    assert found_child(flow_run(spec={"name": "sweep-merge"}), STUDY, names) is None  # the study's merge, not a child


def test_an_earlier_run_of_a_child_given_another_spec_is_named_with_the_fields_that_differ():
    from flows.train import train

    (child,) = expand(study('grid = {"training.max_steps" = [7]}'))
    ran = child.spec.model_dump(mode="json", exclude_unset=True)  # a deployment child's `spec` parameter
    assert spec_difference(ran, child.spec) is None
    assert spec_difference(train.serialize_parameters({"spec": child.spec})["spec"], child.spec) is None  # a subflow's
    ran["training"]["max_steps"] = 8
    assert spec_difference(ran, child.spec) == "training.max_steps: 8 then, 7 now"


def test_a_cancelled_study_cancels_its_deployment_children_and_a_crashed_one_leaves_them_to_a_resume():
    assert on_study_end(True, StateType.CANCELLING) == on_study_end(True, StateType.CANCELLED) == "cancel"
    assert on_study_end(True, StateType.CRASHED) == on_study_end(True, StateType.FAILED) == "leave running"
    # A subflow child ran in the study's process, gone or going: its endpoints are deleted whatever the study's end.
    assert {on_study_end(False, s) for s in (StateType.CANCELLED, StateType.CRASHED, StateType.FAILED)} == {
        "tear down"}


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
    table = table_rows(ranked(rows, maximize=False), "eval_loss", best)
    assert [r["child"] for r in table] == ["c3 (best)", "c1", "c2"]  # by the metric, then those without it
    assert table[2]["state"] == "failed" and table[2]["reason"] == "out of memory" and table[2]["eval_loss"] == ""


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


def scored(index: int, metric: float | None, state: str = "completed") -> ChildRow:
    return row(index, state).model_copy(update={"metric": metric})


def test_the_table_of_many_children_is_paged_best_first_each_page_an_artifact():
    rows = [scored(i, 1000.0 - i) for i in range(1, 119)] + [row(119, "failed", "x"), row(120, "skipped", "budget")]
    best = best_child(rows, maximize=False)
    pages = table_pages(rows, "eval_loss", best, maximize=False)
    assert [len(p) for p in pages] == [PAGE_ROWS, PAGE_ROWS, 20]
    assert pages[0][0]["child"] == "c118 (best)" and pages[0][1]["child"] == "c117"
    assert [r["state"] for r in pages[2][-2:]] == ["failed", "skipped"]
    assert [page_key("sweep", n) for n in (1, 2, 3)] == ["study-sweep-table", "study-sweep-table-2",
                                                         "study-sweep-table-3"]
    markdown = study_markdown(StudyReport(study="sweep", metric="eval_loss", maximize=False, rows=rows, best=best,
                                          cost_usd=1.0, cost_ceiling_usd=2.0), None)
    shown = [line.split(" |")[0] for line in markdown.splitlines() if line.startswith("| c") and "child" not in line]
    assert len(shown) == PAGE_ROWS and shown[0] == "| c118 **(best)**"  # the summary shows the first page
    assert "The best 50 of 120 children; every child, ranked, is in the table artifacts `study-sweep-table` to " \
        "`study-sweep-table-3`" in markdown


def test_the_plot_draws_the_ten_best_children_and_the_median_one():
    rows = [scored(i, float(i)) for i in range(1, 32)] + [row(32, "failed", "x")]
    chosen = plotted_children(rows, maximize=False)
    assert list(chosen)[:10] == list(range(1, 11)) and chosen[16] == "c16 (median)" and len(chosen) == 11
    few = plotted_children([scored(1, 2.0), scored(2, 1.0), scored(3, 3.0)], maximize=True)
    assert few == {3: "c3", 1: "c1", 2: "c2"}  # all of them: the median is among the best


def test_a_skipped_child_is_a_row_with_its_reason_and_no_cost():
    rows = [completed_row(row(1), metrics([2.0, 1.5]), "eval_loss"),
            row(2, "skipped", "study.budget_usd $1.00 reached")]
    markdown = study_markdown(StudyReport(study="sweep", metric="eval_loss", maximize=False, rows=rows, best=rows[0],
                                          cost_usd=0.5, cost_ceiling_usd=1.0, budget_usd=1.0), None)
    assert "| c2 | training.seed=2 | skipped |  |  |  | study.budget_usd $1.00 reached |" in markdown


# Pruning: the median rule (Optuna's MedianPruner's comparison, over every other child that reached the step).

def test_a_child_below_the_median_of_the_others_is_not_pruned_and_one_above_it_is():
    others = [{0: 7.0, 4: 6.0, 8: 5.0}, {0: 7.0, 4: 6.4, 8: 5.6}, {0: 7.0, 4: 6.8, 8: 6.2}]
    assert median_rule({0: 7.0, 4: 5.9, 8: 5.1}, others, after_evals=2, maximize=False) is None
    verdict = median_rule({0: 7.0, 4: 6.9, 8: 6.7}, others, after_evals=2, maximize=False)
    assert verdict == Verdict(step=8, value=6.7, median=5.6, others=3)
    assert verdict.reason("eval_loss") == ("pruned at step 8: eval_loss 6.7 (its best by then) was worse than the "
                                           "median 5.6 of 3 other child(ren) at that step")


def test_a_child_is_not_judged_before_after_evals_evaluations_since_its_first_step():
    others = [{0: 7.0, 4: 5.0, 8: 4.0}]
    # The evaluation before the first step (the base model's) does not count: one evaluation since is too few.
    assert median_rule({0: 7.0, 4: 6.9}, others, after_evals=2, maximize=False) is None
    assert median_rule({0: 7.0, 4: 6.9}, others, after_evals=1, maximize=False).step == 4


def test_a_child_ahead_of_the_others_is_judged_at_its_latest_step_another_child_reached():
    # The loser has evaluated at step 12 already; the other child, still running, only at 8: step 8 decides.
    verdict = median_rule({4: 6.9, 8: 6.8, 12: 6.7}, [{4: 6.0, 8: 5.0}], after_evals=2, maximize=False)
    assert (verdict.step, verdict.value, verdict.median) == (8, 6.8, 5.0)
    # With no other child at any of its steps yet, nothing is decided.
    assert median_rule({4: 6.9, 8: 6.8}, [{}, {2: 1.0}], after_evals=2, maximize=False) is None


def test_the_best_value_by_the_step_is_what_is_compared_and_a_reward_is_maximized():
    # A child that was better than the median at an earlier step keeps its best, as Optuna's pruner does.
    assert median_rule({4: 5.0, 8: 6.0}, [{8: 5.5}], after_evals=2, maximize=False) is None
    assert median_rule({4: 0.2, 8: 0.3}, [{8: 0.5}, {8: 0.6}], after_evals=2, maximize=True).median == 0.55
    assert median_rule({4: 0.7, 8: 0.3}, [{8: 0.5}, {8: 0.6}], after_evals=2, maximize=True) is None


def test_another_child_with_no_evaluation_at_the_step_counts_with_its_latest_before_it_once_it_reached_it():
    # The events hold the evaluations a poll saw: the other child's step 8 was missed, its step 12 seen.
    verdict = median_rule({4: 6.9, 8: 6.8}, [{4: 6.0, 12: 5.0}], after_evals=2, maximize=False)
    assert (verdict.step, verdict.median) == (8, 6.0)
    # A child that has not reached the step yet does not count there.
    assert median_rule({4: 6.9, 8: 6.8}, [{4: 6.0}], after_evals=2, maximize=False) is None


def test_a_child_whose_metric_is_nan_is_pruned():
    assert median_rule({4: 6.0, 8: float("nan")}, [{8: 5.0}], after_evals=2, maximize=False).step == 8


def test_a_pruned_childs_step_is_read_from_its_tag():
    assert pruned_step(["study", "study-pruned:8"]) == 8
    assert pruned_step(["study"]) is None and pruned_step(None) is None


def test_prune_needs_an_eval_metric_and_evaluation_every_steps_and_names_both():
    spec = study('seeds = [1, 2]\nprune = { rule = "median", after_evals = 2 }',
                 BASE.replace("fraction = 0.1\n", "fraction = 0.1\nevery_steps = 4\n"))
    assert spec.study.prune.after_evals == 2
    with pytest.raises(ValidationError, match=r"set `\[evaluation\]` `every_steps`"):
        study('seeds = [1, 2]\nprune = { after_evals = 2 }')
    with pytest.raises(ValidationError, match=r"study.metric 'train_loss' is not one: pick eval_loss"):
        study('seeds = [1, 2]\nmetric = "train_loss"\nprune = { after_evals = 2 }',
              BASE.replace("fraction = 0.1\n", "fraction = 0.1\nevery_steps = 4\n"))


def test_a_resumed_study_adopts_a_pruned_child_and_never_starts_it_again():
    pruned = found(1, "CANCELLED").model_copy(update={"pruned_at": 8})
    plans = adoption_plan([1, 2], [pruned, found(2, "CANCELLED")])
    assert plans[1].action == "adopt" and plans[1].run.pruned_at == 8
    assert (plans[2].action, plans[2].start) == ("start", 2)  # an ordinary cancel runs again


def test_a_searchs_told_trial_is_adopted_however_its_run_ended_and_one_with_no_run_is_left_as_told():
    plans = adoption_plan([1, 2, 3], [found(1, "FAILED"), found(3, "FAILED")], final={1, 2})
    assert plans[1].action == "adopt" and plans[1].run.state == "FAILED"
    assert plans[2].action == "told" and plans[3].action == "start"


def test_a_pruned_child_is_a_row_after_the_completed_ones_with_its_step():
    rows = [completed_row(row(1), metrics([2.0, 1.5]), "eval_loss"),
            row(2, "pruned", "pruned at step 8: eval_loss 6.7 (its best by then) was worse than the median 5.6")]
    table = table_rows(ranked(rows, maximize=False), "eval_loss", best_child(rows, maximize=False))
    assert [(r["child"], r["state"]) for r in table] == [("c1 (best)", "completed"), ("c2", "pruned")]
    assert table[1]["reason"].startswith("pruned at step 8")
    markdown = study_markdown(StudyReport(study="sweep", metric="eval_loss", maximize=False, rows=rows, best=rows[0],
                                          cost_usd=0.5, cost_ceiling_usd=1.0), None)
    assert "Children: 1 completed, 1 pruned" in markdown


def test_a_run_stopped_within_an_attempt_counts_the_attempts_time_so_far(monkeypatch):
    from tasks.reports import events

    clock = iter([100.0, 130.0])
    sent = {}
    monkeypatch.setattr(events, "run_finished", lambda *a, **kw: sent.update(kw))
    spent = events.RunSpend(usd=0.25, clock=lambda: next(clock))
    spent.attempt_began(usd_per_hour=36.0)  # a cent a second
    spent.finish("run", "r", "cancelled", None)  # a cancel's signal, 30 s into the attempt
    assert sent["cost_usd"] == 0.55
    finished = events.RunSpend()
    finished.attempt_began(usd_per_hour=3.6)
    finished.attempt_ended(0.1)  # an attempt that ended counts what its worker ran, not its wall time
    assert finished.usd == 0.1 and finished._attempt is None


# Search: Optuna picks the children's values from the space.

SPACE = 'search = "tpe"\ntrials = 4\nspace = { "training.learning_rate" = { low = 1e-5, high = 1e-3, log = true }, ' \
    '"lora.rank" = [8, 16, 32], "training.max_steps" = { low = 4, high = 20, step = 4 } }'


def test_a_search_space_is_ranges_and_choices_as_optuna_takes_them():
    spec = study(SPACE)
    assert spec.study.children() == 4
    space = distributions(spec.study.space)
    assert space["training.learning_rate"] == FloatDistribution(1e-5, 1e-3, log=True)
    assert space["lora.rank"] == CategoricalDistribution([8, 16, 32])
    assert space["training.max_steps"] == IntDistribution(4, 20, step=4)


@pytest.mark.parametrize(("section", "says"), [
    ('search = "tpe"\ntrials = 3', "needs `study.trials`"),
    ('search = "tpe"\nspace = { "lora.rank" = [8] }', "needs `study.trials`"),
    ('trials = 3\nspace = { "lora.rank" = [8] }', 'add `search = "tpe"`'),
    ('search = "tpe"\ntrials = 3\nspace = { "lora.rank" = [8] }\nseeds = [1, 2]', "remove `study.grid` and"),
    ('search = "tpe"\ntrials = 3\nspace = { "training.lr" = [1] }', "`training` has no field `lr`"),
    ('search = "tpe"\ntrials = 3\nspace = { "training.learning_rate" = { low = 0.0, high = 1e-3, log = true } }',
     "log = true needs low above 0"),
    ('search = "tpe"\ntrials = 3\nspace = { "training.learning_rate" = { low = 1e-3, high = 1e-5 } }',
     "low 0.001 is not below high 1e-05"),
    ('search = "tpe"\ntrials = 3\nspace = { "lora.rank" = { low = 8, high = 64, log = true, step = 8 } }',
     "log and step together"),
    ('search = "tpe"\ntrials = 3\nspace = { "lora.target_modules" = [["q_proj"], ["v_proj"]] }',
     "Optuna chooses among single values"),
])
def test_a_search_without_what_it_needs_or_with_a_range_optuna_refuses_is_refused_naming_the_field(section, says):
    with pytest.raises(ValidationError) as refused:
        study(section)
    assert says in str(refused.value)


def test_the_space_corners_stand_for_the_search_before_anything_is_rented_and_a_bad_one_refuses_it():
    corners = space_corners(study(SPACE))
    assert [c.values for c in corners] == [
        {"training.learning_rate": 1e-5, "lora.rank": 8, "training.max_steps": 4},
        {"training.learning_rate": 1e-3, "lora.rank": 8, "training.max_steps": 4},
        {"training.learning_rate": 1e-5, "lora.rank": 16, "training.max_steps": 4},
        {"training.learning_rate": 1e-5, "lora.rank": 32, "training.max_steps": 4},
        {"training.learning_rate": 1e-5, "lora.rank": 8, "training.max_steps": 20}]
    with pytest.raises(SpecError) as refused:
        space_corners(study('search = "tpe"\ntrials = 3\nspace = { "lora.rank" = [8, 4096] }'))
    assert "1 of the space's 2 corner values would make invalid children" in str(refused.value)
    assert "values lora.rank=4096" in str(refused.value)


def test_optuna_asks_for_children_inside_the_space_and_is_told_how_each_ended(tmp_path):
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    search = Search(study(SPACE), STUDY, storage)
    children = [search.ask() for _ in range(3)]
    assert [c.index for c in children] == [1, 2, 3] and [c.spec.name for c in children] == [
        "sweep-c1", "sweep-c2", "sweep-c3"]
    for child in children:
        assert 1e-5 <= child.spec.training.learning_rate <= 1e-3 and child.spec.lora.rank in (8, 16, 32)
        assert child.spec.training.max_steps in (4, 8, 12, 16, 20)
        assert child.values == {path: child.values[path] for path in study(SPACE).study.space}
    search.tell(row(1).model_copy(update={"metric": 1.5, "flow_run_id": "run-1"}))
    search.tell(row(2, "failed", "out of memory"))
    trials = search.study.get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE", "FAIL", "RUNNING"] and trials[0].value == 1.5
    assert trials[0].user_attrs == {"child": "sweep-c1", "row_state": "completed", "reason": "",
                                    "flow_run_id": "run-1"}
    assert search.left() == 1


def test_a_resumed_search_keeps_its_trials_and_asks_only_for_those_never_asked(tmp_path):
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    first = Search(study(SPACE), STUDY, storage)
    asked = [first.ask() for _ in range(2)]
    first.tell(row(1).model_copy(update={"metric": 1.5}))
    resumed = Search(study(SPACE), STUDY, storage)  # the same study flow run: the same Optuna study
    assert [(index, child.spec) for index, _, child in resumed.asked()] == [(c.index, c.spec) for c in asked]
    assert resumed.told() == {1: ("completed", "")} and resumed.left() == 2
    assert resumed.ask().index == 3 and resumed.ask().index == 4 and resumed.left() == 0
    assert Search(study(SPACE), "another-study-run", storage).left() == 4  # another study, another Optuna study


def test_a_search_prunes_through_optunas_median_pruner_after_after_evals_reports(tmp_path):
    search = Search(study(SPACE), STUDY, f"sqlite:///{tmp_path / 'optuna.db'}")
    winner, loser = search.ask(), search.ask()
    search.report(winner.index, {0: 7.0, 4: 5.0, 8: 4.0})
    assert search.should_prune(winner.index, after_evals=2) is None  # no trial completed: Optuna prunes none
    search.tell(row(winner.index).model_copy(update={"metric": 4.0}))
    search.report(loser.index, {0: 7.0, 4: 6.5})
    assert search.should_prune(loser.index, after_evals=2) is None  # one evaluation since its first step
    search.report(loser.index, {0: 7.0, 4: 6.5, 8: 6.2})
    verdict = search.should_prune(loser.index, after_evals=2)
    assert verdict == Verdict(step=8, value=6.2, median=4.0, others=1)
    search.tell_pruned(loser.index, verdict.reason("eval_loss", "completed trial(s)"), "run-2")
    assert search.study.get_trials()[1].state.name == "PRUNED" and search.told()[2][0] == "pruned"


def test_an_optuna_storage_that_cannot_be_opened_refuses_the_study_naming_the_setting(tmp_path):
    with pytest.raises(SpecError, match="could not be opened .*set LORAFLOW_OPTUNA_STORAGE") as refused:
        Search(study(SPACE), STUDY, "postgresql+psycopg://someone:secret@127.0.0.1:1/optuna")
    assert "secret" not in str(refused.value) and "someone:***@127.0.0.1:1" in str(refused.value)


# Resuming a search whose Optuna study is gone or was another's.

def child_run(index: int, values: dict, state: str = "COMPLETED") -> FoundChild:
    spec: dict = {"name": f"sweep-c{index}"}
    for path, value in values.items():
        section = spec
        *parents, last = path.split(".")
        for key in parents:
            section = section.setdefault(key, {})
        section[last] = value
    return FoundChild(index=index, start=1, flow_run_id=f"run-{index}", state=state, deployment=True, spec=spec)


def test_a_search_resumed_with_an_empty_optuna_study_rebuilds_its_trials_from_its_childrens_runs(tmp_path):
    ran = {1: {"training.learning_rate": 2.4e-4, "lora.rank": 8, "training.max_steps": 8},
           3: {"training.learning_rate": 1e-4, "lora.rank": 16, "training.max_steps": 4}}
    resumed = Search(study(SPACE), STUDY, f"sqlite:///{tmp_path / 'elsewhere.db'}")  # another folder's, empty
    assert resumed.rebuild([child_run(1, ran[1]), child_run(3, ran[3], "FAILED")]) == 3
    asked = {index: (values, child) for index, values, child in resumed.asked()}
    # Each child keeps its index and its values: never asked again with others, and adopted as it ran.
    assert asked[1][0] == ran[1] and asked[3][0] == ran[3] and asked[1][1].spec.training.learning_rate == 2.4e-4
    assert asked[1][1].spec.name == "sweep-c1"
    assert [t.state.name for t in resumed.study.get_trials()] == ["RUNNING", "FAIL", "RUNNING"]
    assert resumed.told() == {2: ("not started", "its trial was lost with the Optuna study in sqlite:///"
                                  f"{tmp_path / 'elsewhere.db'} before its child started")}
    assert resumed.left() == 1 and resumed.ask().index == 4
    resumed.tell(row(1).model_copy(update={"metric": 1.5}))  # its adopted run's result, told as any trial's
    assert resumed.study.get_trials()[0].value == 1.5
    assert resumed.rebuild([child_run(1, ran[1])]) == 0  # a study that holds them all is left as it is


def test_a_search_whose_optuna_study_holds_other_values_than_its_childrens_runs_is_refused_naming_the_storage(
        tmp_path):
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    first = Search(study(SPACE), STUDY, storage)
    first.ask()
    with pytest.raises(SpecError) as refused:
        Search(study(SPACE), STUDY, storage).rebuild([child_run(1, {"training.learning_rate": 3.3e-4, "lora.rank": 8,
                                                                     "training.max_steps": 8})])
    assert f"Optuna study sweep-{STUDY} in {storage} holds 1 trial(s)" in str(refused.value)
    assert "trial 0 holds" in str(refused.value) and "where its child's run trained" in str(refused.value)
    outside = child_run(1, {"training.learning_rate": 0.5, "lora.rank": 8, "training.max_steps": 8})
    with pytest.raises(SpecError, match="child 1 ran .*outside this run file's study.space"):
        Search(study(SPACE), "another-study-run", storage).rebuild([outside])


def test_a_resume_that_changes_the_metric_or_the_direction_is_refused_naming_both(tmp_path):
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    Search(study(SPACE), STUDY, storage).ask()
    with pytest.raises(SpecError) as refused:
        Search(study(SPACE + '\ndirection = "maximize"'), STUDY, storage)
    assert "was told eval_loss to minimize, and this run file asks eval_loss to maximize" in str(refused.value)
    with pytest.raises(SpecError, match="was told eval_loss to minimize, and this run file asks train_loss to "
                                        "minimize"):
        Search(study(SPACE + '\nmetric = "train_loss"'), STUDY, storage)
    Search(study(SPACE), STUDY, storage)  # its own run file resumes it



def test_a_resumed_grid_or_search_that_judges_by_another_metric_or_direction_is_named_with_both():
    from flows.study import study as study_flow
    from flows.forms.study import judging_change

    started = study_flow.serialize_parameters({"spec": study("seeds = [1, 2]")})["spec"]["study"]  # what its page holds
    assert judging_change(started, study("seeds = [1, 2, 3]\nparallel = 3").study) is None
    assert judging_change(started, study('seeds = [1, 2]\nmetric = "train_loss"').study) == (
        "study.metric eval_loss then, train_loss now")
    assert judging_change(started, study('seeds = [1, 2]\ndirection = "maximize"').study) == (
        "study.direction minimize then, maximize now")
    assert judging_change({}, study('seeds = [1, 2]\ndirection = "minimize"').study) is None  # the defaults, spelt out


def test_a_search_samples_with_a_seeded_tpe_that_lies_about_running_trials_and_a_settable_startup(tmp_path):
    search = Search(study(SPACE + "\nstartup_trials = 3"), STUDY, f"sqlite:///{tmp_path / 'optuna.db'}")
    sampler = search.study.sampler
    assert sampler._constant_liar and sampler._n_startup_trials == 3
    again = Search(study(SPACE + "\nstartup_trials = 3"), "another-study-run", f"sqlite:///{tmp_path / 'optuna.db'}")
    assert search.ask().values == again.ask().values  # seeded with the run file's training.seed
    with pytest.raises(ValidationError, match="are for a search"):
        study("seeds = [1, 2]\nstartup_trials = 3")


def test_a_search_on_a_prefect_server_elsewhere_needs_a_shared_optuna_storage_and_a_local_one_a_home_file(
        tmp_path, monkeypatch):
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

    from flows.study_search import storage_url

    monkeypatch.delenv("LORAFLOW_OPTUNA_STORAGE", raising=False)
    monkeypatch.chdir(tmp_path)
    with temporary_settings({PREFECT_API_URL: "https://prefect.team.example/api", PREFECT_HOME: tmp_path / "home"}):
        with pytest.raises(SpecError, match="on the Prefect server at https://prefect.team.example/api needs "
                                            "LORAFLOW_OPTUNA_STORAGE"):
            storage_url()
    # On this machine, from whatever folder: the same file, under Prefect's home.
    with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:4200/api", PREFECT_HOME: tmp_path / "home"}):
        assert storage_url() == f"sqlite:///{tmp_path / 'home' / 'loraflow' / 'optuna.db'}"
    monkeypatch.setenv("LORAFLOW_OPTUNA_STORAGE", "postgresql+psycopg://u:p@db:5432/optuna")
    with temporary_settings({PREFECT_API_URL: "https://prefect.team.example/api"}):
        assert storage_url() == "postgresql+psycopg://u:p@db:5432/optuna"


# Fair judging: the kept adapter's metric, and pruning that waits and treats seeds as one setting.

def test_an_early_stopped_childs_row_shows_the_metric_of_the_adapter_it_kept_not_its_last_evaluation():
    from loraflow_worker.contract import EarlyStopped

    stopped = metrics([6.0, 4.0, 4.5, 4.8, 5.1]).model_copy(update={
        "losses": [(1, 5.0), (2, 3.5), (3, 3.0), (4, 2.9)], "final_loss": 2.9,
        "early_stopping": EarlyStopped(metric="eval_loss", patience=3, min_delta=0.0, stopped=True, step=4,
                                       total_steps=100, best_step=1, best_value=4.0, reason="no better for 3")})
    kept = completed_row(row(1), stopped, "eval_loss")
    assert (kept.metric, kept.eval_loss, kept.train_loss, kept.kept_step) == (4.0, 4.0, 5.0, 1)
    assert completed_row(row(1), stopped, "train_loss").metric == 5.0  # the training loss it had at that step
    # Ranked by it: its kept 4.0 beats a child whose last evaluation, 4.2, is better than its own last, 5.1.
    other = completed_row(row(2), metrics([6.0, 4.2]), "eval_loss")
    assert best_child([kept, other], maximize=False).index == 1
    markdown = study_markdown(StudyReport(study="sweep", metric="eval_loss", maximize=False, rows=[kept, other],
                                          best=kept, cost_usd=0.0, cost_ceiling_usd=0.0), None)
    assert "| c1 **(best)** | training.seed=1 | completed | 4 (step 1) |" in markdown
    assert table_rows([kept], "eval_loss", kept)[0]["eval_loss"] == 4.0


def test_six_children_a_hundredth_apart_in_lockstep_are_not_pruned_before_the_startup_count_completed():
    lockstep = [{0: 7.0, 4: 5.0 + k / 100, 8: 4.0 + k / 100, 12: 3.0 + k / 100} for k in range(6)]
    for k, own in enumerate(lockstep):  # the default startup count, 5: none completed while they run side by side
        others = [o for j, o in enumerate(lockstep) if j != k]
        assert median_rule(own, others, after_evals=2, maximize=False, completed=0, startup=5) is None
    # Five completed (the sixth a slow starter, judged after them): from then on it is judged as Optuna judges.
    slow = lockstep[5]
    assert median_rule(slow, lockstep[:5], after_evals=2, maximize=False, completed=4, startup=5) is None
    assert median_rule(slow, lockstep[:5], after_evals=2, maximize=False, completed=5, startup=5).step == 12
    # A study counts the children that completed as they end, deployment children (whose metrics it never holds)
    # as much as its subflows.
    from tasks.lifecycle.study_pruning import Pruning

    pruning = Pruning(after_evals=2, metric="eval_loss", maximize=False, startup=5)
    pruning.log.by_run = {f"run-{k}": series for k, series in enumerate(lockstep)}
    for k in range(4):
        pruning.ended(k, f"run-{k}", None, completed=True)
    pruning.run_of[4] = "run-4"
    pruning.ended(4, "run-4", None, completed=False)  # failed: not a completed child
    pruning.run_of[5] = "run-5"
    assert pruning._judge(5, "run-5")[0] is None
    pruning.ended(4, "run-4", None, completed=True)
    assert pruning._judge(5, "run-5")[0].step == 12
    defaults = study("seeds = [1]\nprune = { after_evals = 2 }",
                     BASE.replace("fraction = 0.1\n", "fraction = 0.1\nevery_steps = 4\n"))
    assert defaults.study.prune.startup_children == 5


def test_of_two_seeds_per_setting_and_a_useless_learning_rate_only_the_useless_setting_is_pruned():
    from tasks.lifecycle.study_pruning import Pruning

    good = [{0: 7.0, 4: 5.0, 8: 4.0}, {0: 7.0, 4: 5.6, 8: 4.9}]  # 3e-3, two seeds: one noticeably luckier
    useless = [{0: 7.0, 4: 6.99, 8: 6.98}, {0: 7.0, 4: 6.98, 8: 6.97}]  # 1e-7: the model where it started
    pruning = Pruning(after_evals=2, metric="eval_loss", maximize=False, startup=0,
                      setting_of={1: "lr=0.003", 2: "lr=0.003", 3: "lr=1e-07", 4: "lr=1e-07"})
    series = {1: good[0], 2: good[1], 3: useless[0], 4: useless[1]}
    pruning.run_of = {i: f"run-{i}" for i in series}
    pruning.log.by_run = {f"run-{i}": s for i, s in series.items()}
    verdicts = {i: pruning._judge(i, f"run-{i}") for i in series}
    # The unlucky good seed (4.9) is worse than the median of the other three children, but not its setting.
    assert verdicts[1][0] is None and verdicts[2][0] is None
    for index in (3, 4):  # the useless setting is pruned as a whole, by its seeds' mean against the good setting's
        verdict, against = verdicts[index]
        assert verdict == Verdict(step=8, value=6.975, median=4.45, others=1), verdict
        assert against == "other setting(s) (the mean of each one's seeds)"
    # Four seeds of one setting never prune each other: there is no other setting to be worse than.
    assert median_rule(good[1], [], own_seeds=[good[0], good[0], good[0]], after_evals=2, maximize=False) is None
