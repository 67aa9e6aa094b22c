"""The team form of the chaos benchmark (`bench/chaos.py --team`, `bench/chaos_team.py`), its pure parts: which
worker host is killed and when, how many runs each worker takes, what a killed run must end as, and the
command's refusals. The batch itself runs on the team stack (PostgreSQL, Redis, several workers), for minutes:
its figures are in bench/README.md."""

from __future__ import annotations

import re
from datetime import datetime, timezone
from pathlib import Path

import pytest

from bench.chaos import main
from bench.chaos_checks import check_run
from bench.chaos_lib import RunRecord
from bench.chaos_scenarios import SCENARIOS
from bench.chaos_team import choose_victim, default_kill_at, worker_limit
from localpod.models import Account, AccountEndpoint

NOW = datetime(2026, 1, 1, tzinfo=timezone.utc)


def test_the_host_holding_the_most_running_runs_is_killed():
    assert choose_victim({"worker-1": ["a"], "worker-2": ["b", "c"], "worker-3": []}) == "worker-2"


def test_on_a_tie_the_first_host_by_name_is_killed():
    assert choose_victim({"worker-3": ["a", "b"], "worker-2": ["c", "d"]}) == "worker-2"


def test_no_host_is_killed_while_none_holds_a_running_run():
    assert choose_victim({"worker-1": [], "worker-2": []}) is None
    assert choose_victim({}) is None


def test_the_kill_is_due_mid_batch():
    assert default_kill_at(32) == 16
    assert default_kill_at(1) == 1


@pytest.mark.parametrize(("concurrency", "workers"), [(8, 3), (3, 3), (28, 3), (6, 2), (10, 5)])
def test_the_hosts_left_after_a_kill_still_hold_the_whole_batch_and_a_reconcile_run(concurrency, workers):
    assert (workers - 1) * worker_limit(concurrency, workers) >= concurrency + 1


def record(state: str, host_killed: str | None) -> RunRecord:
    return RunRecord(SCENARIOS["api-faults"], "b07-api-faults", Path("/nonexistent"), flow_run_id="f" * 36,
                     state_type=state, host_killed=host_killed)


def account(*live: str) -> Account:
    endpoints = [AccountEndpoint(id=f"e{i}", name=name, workers_max=1, created_at=NOW, age_seconds=1)
                 for i, name in enumerate(live)]
    return Account(worker_quota=30, live_endpoints=endpoints, endpoints=endpoints, peak_live_endpoints=len(live),
                   peak_workers_max=len(live), billed_worker_seconds=0, workers_spawned=0, workers=[],
                   out_of_stock_pools=[], faults_injected={}, jobs=[])


def test_a_run_whose_host_was_killed_must_end_crashed_with_nothing_left_live():
    assert check_run(record("CRASHED", "worker-2"), account(), {}, max_steps=6) == []


def test_a_killed_run_that_ended_otherwise_is_a_problem_naming_the_host():
    problems = check_run(record("RUNNING", "worker-2"), account(), {}, max_steps=6)
    assert len(problems) == 1 and "worker-2" in problems[0] and "RUNNING" in problems[0]


def test_a_killed_runs_endpoint_left_live_is_a_problem():
    problems = check_run(record("CRASHED", "worker-2"), account("loraflow-b07-api-faults-abc-a1"), {}, max_steps=6)
    assert problems == ["endpoints still live after its host was killed: ['loraflow-b07-api-faults-abc-a1']"]


@pytest.mark.parametrize(("argv", "refusal"), [
    (["--workers", "4"], "--workers and --kill-at need --team"),
    (["--kill-at", "3"], "--workers and --kill-at need --team"),
    (["--team", "--runs", "4", "--kill-at", "5"], "--kill-at must be 0..4"),
    (["--team", "--workers", "1"], "--workers must be at least 2"),
])
def test_the_command_refuses_team_options_that_cannot_work(argv, refusal, capsys):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert refusal in capsys.readouterr().err


def test_an_own_token_run_on_the_team_stack_names_its_person_s_own_token_block(tmp_path):
    # The stack requires every run to name its token block: the person's own, not the team member's every other
    # run names (a token in the job's environment is not what the stack's runs use).
    from bench.chaos_team import own_token_block, team_run_spec
    from deployments.team_stack import RUN_TOKEN_BLOCK

    spec = {"name": "b09-own-token", "dataset": {"local_file": "deployments/data/local.jsonl"}}
    assert team_run_spec(spec, tmp_path)["hub_token_secret"] == RUN_TOKEN_BLOCK
    own = team_run_spec(spec, tmp_path, own_token_block("b09-own-token"))
    assert own["hub_token_secret"] == "b09-own-token-hf-token" != RUN_TOKEN_BLOCK
    assert own["dataset"]["local_file"] == str(tmp_path / "local.jsonl")


def test_the_catalogue_holds_at_least_forty_scenarios_each_with_a_summary_and_a_run_name_part():
    assert len(SCENARIOS) >= 40
    for kind, scenario in SCENARIOS.items():
        assert kind == scenario.kind and re.fullmatch(r"[a-z0-9-]+", kind) and scenario.summary


@pytest.mark.parametrize("kind", ["serve-deleted", "serve-crash", "serve-expiry", "serve-faults"])
def test_a_serve_scenario_says_how_it_must_end(kind):
    scenario = SCENARIOS[kind]
    assert scenario.flow == "serve"
    assert scenario.serve_ends or (scenario.expect_state == "FAILED" and scenario.failure_text)
    assert not scenario.retried and not scenario.resumes  # a serve has no attempts


def test_the_noise_reaches_every_route_a_run_or_a_serve_polls_and_late_status_answers():
    from bench.chaos_batch import noise_rules

    rules = noise_rules(0.12, seed=31)
    assert {r["route"] for r in rules} == {"list_endpoints", "get_endpoint", "create_endpoint", "delete_endpoint",
                                           "status", "health", "list_endpoint_workers"}
    assert "run" not in {r["route"] for r in rules}  # a failed submit rightly costs an attempt
    assert len({r["seed"] for r in rules}) == len(rules)
    late = [r for r in rules if r["action"] == "hang"]
    assert late == [{"route": "status", "action": "hang", "hang_s": 1, "probability": 0.24, "seed": 3199}]


def serve_record(kind: str, state: str, messages: list[str], endpoints: list[str], *, message: str = "",
                 **found) -> RunRecord:
    return RunRecord(SCENARIOS[kind], f"b03-{kind}", Path("/nonexistent"), flow_run_id="f" * 36, state_type=state,
                     state_message=message, log_messages=messages, endpoint_names=endpoints, **found)


def gone(*names: str) -> Account:
    """An account whose only endpoints are `names`, every one deleted."""
    endpoints = [AccountEndpoint(id=f"e{i}", name=n, workers_max=1, created_at=NOW, age_seconds=1)
                 for i, n in enumerate(names)]
    return Account(worker_quota=30, live_endpoints=[], endpoints=endpoints, peak_live_endpoints=1, peak_workers_max=1,
                   billed_worker_seconds=0, workers_spawned=0, workers=[], out_of_stock_pools=[], faults_injected={},
                   jobs=[])


ENDPOINT = "loraflow-b03-serve-deleted-abc-ns-s1700000000"


def test_a_serve_whose_endpoint_was_deleted_behind_it_and_that_said_so_behaved():
    ended = ["Serving ends: the endpoint was deleted behind the serve (the console, or the reconciler)"]
    record = serve_record("serve-deleted", "COMPLETED", ended, [ENDPOINT], endpoint_deleted="e0")
    assert check_run(record, gone(ENDPOINT), {}, max_steps=6) == []


def test_a_serve_that_ended_otherwise_than_its_deleted_endpoint_says_is_a_problem():
    record = serve_record("serve-deleted", "COMPLETED", ["Serving ends: its time ran out at 2026-01-01 00:00:00 UTC"],
                          [ENDPOINT], endpoint_deleted="e0")
    [problem] = check_run(record, gone(ENDPOINT), {}, max_steps=6)
    assert "never said it ended as 'the endpoint was deleted behind the serve'" in problem


def test_a_serve_endpoint_left_live_or_a_second_endpoint_is_a_problem():
    ended = ["Serving ends: the endpoint was deleted behind the serve (the console, or the reconciler)"]
    second = ENDPOINT.replace("abc", "abd")
    record = serve_record("serve-deleted", "COMPLETED", ended, [ENDPOINT, second], endpoint_deleted="e0")
    live = gone(ENDPOINT, second)
    live.live_endpoints = live.endpoints[1:]
    problems = check_run(record, live, {}, max_steps=6)
    assert [p.split(":")[0] for p in problems] == ["a serve has one endpoint; it had ['loraflow-b03-serve-deleted-abc-"
                                                   "ns-s1700000000', 'loraflow-b03-serve-deleted-abd-ns-s1700000000']",
                                                   "endpoints still live"]


def test_a_crash_loop_must_fail_naming_it_and_max_lora_rank():
    name = "loraflow-b03-serve-crash-abc-ns-s1700000000"
    said = ("the endpoint's workers crash while they start: 2 workers started and were gone ... above "
            "MAX_LORA_RANK (8 here)")
    assert check_run(serve_record("serve-crash", "FAILED", [], [name], message=said), gone(name), {},
                     max_steps=6) == []
    vague = serve_record("serve-crash", "FAILED", [], [name], message="no worker answered within 600 s")
    [problem] = check_run(vague, gone(name), {}, max_steps=6)
    assert problem.startswith("the failure message lacks ['crash while they start', 'MAX_LORA_RANK']")


def test_an_expiring_serve_needs_the_reconcile_beside_it_to_have_kept_its_endpoint():
    name = "loraflow-b03-serve-expiry-abc-ns-s1700000000"
    ended = ["Serving ends: its time ran out at 2026-01-01 00:00:00 UTC"]
    kept = {"returncode": 0, "kept": True, "output": "keep: its run is RUNNING; serving until 2026-01-01 00:00:00 UTC"}
    assert check_run(serve_record("serve-expiry", "COMPLETED", ended, [name], serving_reconcile=kept), gone(name), {},
                     max_steps=6) == []
    deleted = kept | {"kept": False}
    [problem] = check_run(serve_record("serve-expiry", "COMPLETED", ended, [name], serving_reconcile=deleted),
                          gone(name), {}, max_steps=6)
    assert "did not keep its endpoint" in problem
    [problem] = check_run(serve_record("serve-expiry", "COMPLETED", ended, [name]), gone(name), {}, max_steps=6)
    assert problem == "the reconcile beside the serve never ran: the serve never answered"


def test_a_serves_adapter_is_served_from_its_copy_in_the_stacks_inputs_folder(tmp_path):
    from bench.chaos_team import team_serve_spec
    from deployments.team_stack import RUN_TOKEN_BLOCK

    adapter = tmp_path / "made" / "serve-adapter"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text("{}")
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    spec = {"name": "b03-serve-expiry", "serve": {"base_model": "m", "adapters": [
        {"name": "chaos", "source": str(adapter)}, {"source": "acme/hub-adapter"}], "hours": 0.06}}
    served = team_serve_spec(spec, inputs)
    assert served["hub_token_secret"] == RUN_TOKEN_BLOCK
    assert served["serve"]["adapters"] == [{"name": "chaos", "source": str(inputs / "serve-adapter-serve-adapter")},
                                           {"source": "acme/hub-adapter"}]
    assert (inputs / "serve-adapter-serve-adapter" / "adapter_config.json").is_file()
    assert served["serve"]["hours"] == 0.06


@pytest.mark.parametrize("kind", sorted(k for k, s in SCENARIOS.items() if s.flow in ("train", "serve")))
def test_every_scenarios_run_name_survives_whole_in_its_endpoints_name(kind):
    # Its faults are scoped, and its endpoints found, by `loraflow-<run name>-`: a name cut short to fit RunPod's
    # length limit would leave its faults unfired (seen: `serve-crash-loop` cut to `serve-crash-loo`).
    from tasks.runpod.endpoints import endpoint_name, serving_endpoint_name

    run = RunRecord(SCENARIOS[kind], f"b95-{kind}", Path("/nonexistent"))
    longest = "n" * 8  # the longest namespace
    names = [serving_endpoint_name("f" * 36, run.name, longest, 1796606787.0)] if run.scenario.flow == "serve" else [
        endpoint_name("f" * 36, 3, run.name, longest)]
    assert all(name.startswith(run.endpoint_prefix) for name in names), names


STUDY = "5" * 8 + "-1111-2222-3333-" + "4" * 12


def study_child(index: int, rate: float, state: str, start: int = 1, *, trained: float | None = None,
                message: str = "") -> dict:
    from bench.chaos_study import RATES
    from tasks.lifecycle.study_children import child_key

    assert rate in RATES
    return {"id": f"run-{index}-{start}", "name": f"b05-study-resume-c{index}-tiny-model-sft-rtx-4090", "state": state,
            "message": message,
            "key": child_key(STUDY, index, {"training.learning_rate": rate}, start),
            "learning_rate": rate if trained is None else trained}


def resumed_study(children: list[dict], costs: dict[str, float], row_costs: dict[str, float], *, killed: bool = True,
                  said: str = "Earlier starts of 1 child(ren) cost $0.0040: counted in the study's budget and their "
                              "rows") -> RunRecord:
    from bench.chaos_study import StudyFindings

    rows = [{"child": name, "state": "completed", "cost (USD)": cost} for name, cost in row_costs.items()]
    found = StudyFindings(study_run_id=STUDY, killed=killed, resume_returncode=0, children=children, rows=rows,
                          costs=costs)
    return RunRecord(SCENARIOS["study-resume"], "b05-study-resume", Path("/nonexistent"), flow_run_id=STUDY,
                     state_type="COMPLETED", study=found, log_messages=[
                         "Resumed: 2 child run(s) found; adopting 0 completed, 0 pruned and 1 still running; 2 to "
                         "start", said])


def behaved_study_children() -> list[dict]:
    return [study_child(1, 1e-4, "FAILED"), study_child(1, 1e-4, "COMPLETED", start=2),
            study_child(2, 5e-4, "COMPLETED"), study_child(3, 2e-3, "COMPLETED")]


BEHAVED_COSTS = {"run-1-1": 0.004, "run-1-2": 0.003, "run-2-1": 0.003, "run-3-1": 0.003}
BEHAVED_ROWS = {"b05-study-resume-c1": 0.007, "b05-study-resume-c2": 0.003, "b05-study-resume-c3": 0.003}


def test_a_killed_and_resumed_study_whose_children_each_trained_their_own_values_once_behaved():
    record = resumed_study(behaved_study_children(), BEHAVED_COSTS, BEHAVED_ROWS)
    assert check_run(record, account(), {}, max_steps=6) == []


def test_a_child_handed_a_run_that_trained_other_values_is_a_problem_naming_both():
    children = behaved_study_children()
    children[2] = study_child(2, 5e-4, "COMPLETED", trained=2e-3)  # the key of 5e-4, a run that trained 2e-3
    [problem] = check_run(resumed_study(children, BEHAVED_COSTS, BEHAVED_ROWS), account(), {}, max_steps=6)
    assert "trained learning_rate 0.002: another child's values, not child 2's" in problem


def test_a_child_that_trained_twice_is_a_problem():
    children = behaved_study_children() + [study_child(2, 5e-4, "COMPLETED", start=2)]
    problems = check_run(resumed_study(children, BEHAVED_COSTS, BEHAVED_ROWS), account(), {}, max_steps=6)
    assert any("child 2 ended ['COMPLETED', 'COMPLETED']" in p for p in problems), problems


def test_a_resumed_study_whose_row_leaves_out_an_earlier_starts_cost_is_a_problem():
    rows = BEHAVED_ROWS | {"b05-study-resume-c1": 0.003}  # its completed run's cost only
    [problem] = check_run(resumed_study(behaved_study_children(), BEHAVED_COSTS, rows), account(), {}, max_steps=6)
    assert problem.startswith("child b05-study-resume-c1's row costs 0.003, less than its starts'")


def test_a_resumed_study_that_never_counted_earlier_starts_is_a_problem():
    record = resumed_study(behaved_study_children(), BEHAVED_COSTS, BEHAVED_ROWS, said="")
    assert check_run(record, account(), {}, max_steps=6) == [
        "the resumed study never counted its earlier starts' cost: not said"]


def test_a_study_whose_process_was_never_killed_is_a_problem():
    record = resumed_study(behaved_study_children(), BEHAVED_COSTS, BEHAVED_ROWS, killed=False)
    [problem] = check_run(record, account(), {}, max_steps=6)
    assert problem.startswith("the study's process was never killed while a child trained")


def test_a_studys_child_endpoint_left_live_is_a_problem():
    record = resumed_study(behaved_study_children(), BEHAVED_COSTS, BEHAVED_ROWS)
    problems = check_run(record, account("loraflow-b05-study-resume-c2-abc-a1"), {}, max_steps=6)
    assert problems == ["endpoints still live: ['loraflow-b05-study-resume-c2-abc-a1']"]


def test_the_study_scenarios_file_is_a_valid_study_of_deployment_children_on_the_team_stack(tmp_path):
    from bench.chaos_study import RATES, write_study_file
    from deployments.team_stack import RUN_TOKEN_BLOCK
    from flows.forms.study import load_study_file

    spec = load_study_file(write_study_file(
        tmp_path / "study.toml", SCENARIOS["study-resume"], name="b05-study-resume", model=tmp_path / "model",
        store=tmp_path / "store", deployment="train/chaos", dataset=tmp_path / "inputs" / "tiny-chat.jsonl",
        token_block=RUN_TOKEN_BLOCK))
    assert spec.study.deployment == "train/chaos" and spec.study.parallel == 1
    assert spec.study.grid == {"training.learning_rate": list(RATES)}
    assert spec.hub_token_secret == RUN_TOKEN_BLOCK
    assert spec.dataset.local_file == str(tmp_path / "inputs" / "tiny-chat.jsonl")


def test_a_studys_child_that_died_with_its_worker_host_is_accounted_for_and_any_other_loss_is_not():
    children = behaved_study_children()
    children[3] = study_child(3, 2e-3, "CRASHED", message="No heartbeat for 180 s: the run's process is gone.")
    record = resumed_study(children, BEHAVED_COSTS, BEHAVED_ROWS)
    record.study.rows[2]["state"] = "failed"
    assert check_run(record, account(), {}, max_steps=6) == []
    children[3] = study_child(3, 2e-3, "CRASHED", message="Execution was cancelled by the runtime environment.")
    problems = check_run(resumed_study(children, BEHAVED_COSTS, BEHAVED_ROWS), account(), {}, max_steps=6)
    assert problems == ["child 3 ended ['CRASHED'] over its starts: one completed run expected, no child trained twice"]


LOST = "loraflow-b03-serve-lost-abc-ns-s1700000180"
KEPT_BESIDE = {"returncode": 0, "kept": True, "killed": [4242],
               "output": "keep: its run is RUNNING; serving until 2023-11-14 22:16:20 UTC"}


def after_expiry(deleted_at: float | None, *, live_before: bool = True, output: str = "delete: a serving endpoint "
                 "whose time ran out at 2023-11-14 22:16:20 UTC") -> dict:
    return {"returncode": 0, "kept": deleted_at is None, "output": output, "live_before": live_before,
            "expires_at": 1700000180, "deleted_at": deleted_at}


def test_a_killed_serves_endpoint_kept_until_its_expiry_and_deleted_after_by_the_reconcile_behaved():
    record = serve_record("serve-lost", "CRASHED", [], [LOST], serving_reconcile=KEPT_BESIDE,
                          expiry_reconcile=after_expiry(1700000183.0))
    assert check_run(record, gone(LOST), {}, max_steps=6) == []
    # The team's reconcile deployment may have deleted it after its expiry, before the harness's own reconcile ran.
    record.expiry_reconcile = after_expiry(1700000195.0, live_before=False, output="nothing to do")
    assert check_run(record, gone(LOST), {}, max_steps=6) == []


def test_a_killed_serves_endpoint_deleted_before_its_expiry_is_a_problem():
    record = serve_record("serve-lost", "CRASHED", [], [LOST], serving_reconcile=KEPT_BESIDE,
                          expiry_reconcile=after_expiry(1700000100.0, live_before=False, output=""))
    assert check_run(record, gone(LOST), {}, max_steps=6) == ["its endpoint was deleted 80 s before its expiry"]


def test_a_killed_serves_endpoint_the_reconcile_keeps_past_its_expiry_is_a_problem():
    record = serve_record("serve-lost", "CRASHED", [], [LOST], serving_reconcile=KEPT_BESIDE,
                          expiry_reconcile=after_expiry(None, output="keep: its run is RUNNING"))
    [problem] = check_run(record, gone(LOST), {}, max_steps=6)
    assert problem.startswith("its endpoint was not deleted once its expiry had passed")


def test_a_killed_serve_its_worker_marked_crashed_has_its_endpoint_deleted_whatever_its_expiry():
    # A Prefect worker outlives the flow process it started: it marks the run Crashed at once and runs the serve's
    # on_crashed hook, which deletes the endpoint, whatever its expiry.
    from bench.chaos_serve import WORKER_CRASHED

    crashed = f"{WORKER_CRASHED}: -9. Process was terminated due to a SIGKILL."
    record = serve_record("serve-lost", "CRASHED", [], [LOST], message=crashed,
                          expiry_reconcile=after_expiry(1700000100.0, live_before=False, output=""))
    assert check_run(record, gone(LOST), {}, max_steps=6) == []
    record.expiry_reconcile = after_expiry(None, output="keep: its run is CRASHED, but its heartbeats go on")
    [problem] = check_run(record, gone(LOST), {}, max_steps=6)
    assert problem.startswith("its endpoint was not deleted once its run ended")


def test_a_serve_that_was_never_killed_is_a_problem():
    record = serve_record("serve-lost", "COMPLETED", ["Serving ends: its time ran out at ..."], [LOST])
    assert check_run(record, gone(LOST), {}, max_steps=6) == [
        "ended COMPLETED, expected CRASHED: ", "the serve's process was never killed: it never answered",
        "the reconcile beside the serve never ran: the serve never answered"]
