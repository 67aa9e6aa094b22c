"""The team form of the chaos benchmark (`bench/chaos.py --team`, `bench/chaos_team.py`), its pure parts: which
worker host is killed and when, how many runs each worker takes, what a killed run must end as, and the
command's refusals. The batch itself runs on the team stack (PostgreSQL, Redis, several workers), for minutes:
its figures are in bench/README.md."""

from __future__ import annotations

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
