"""The chaos suite, short form: one real train flow per fault kind, all at once, against a real Prefect
server and localpod running the real worker; then nothing may be left billing, held or lost.

The long form (many runs, a chosen fault mix, background noise) is `bench/chaos.py`; both run the
scenarios of `bench/chaos_scenarios.py`. This module starts its own stack: localpod's account figures
(peak endpoints, faults injected, billed seconds) must not mix with other tests' runs.

One batch: the 29 scenarios of `SHORT_FORM` and the `delete-outage` run (deletes that fail for minutes
once the job has stored its results), all at once; each test below reads one behaviour off its outcome.
The delete outage used to run alone after the batch (2.5 minutes more); its faults are scoped to its own
endpoints, so beside the others it proves the same: its endpoint is deleted in the end, its run completes,
and the batch's leak figures (which now count it too) stay 0.
"""

from __future__ import annotations

import json

import pytest

from bench.chaos_batch import Batch, plan, run_batch
from bench.chaos_lib import Localpod
from bench.chaos_scenarios import OUT_OF_STOCK_POOL, SCENARIOS, SHORT_FORM

pytestmark = pytest.mark.timeout(900)

MAX_STEPS = 6
KINDS = (*SHORT_FORM, "delete-outage")
"""The batch: every fault kind of the short form, and the delete outage."""


@pytest.fixture(scope="module")
def chaos_stack(tmp_path_factory):
    from deployments.local_stack import LocalStack

    with LocalStack(tmp_path_factory.mktemp("chaos-stack"), worker_quota=30, with_hub=True) as stack:
        yield stack


@pytest.fixture(scope="module")
def chaos(chaos_stack, tmp_path_factory, tiny_model, figures) -> Batch:
    batch = run_batch(chaos_stack, plan(list(KINDS)), tmp_path_factory.mktemp("chaos-runs"), tiny_model,
                      concurrency=len(KINDS), max_steps=MAX_STEPS)
    figures(f"{batch.report()}\n{batch.figures.block()}")
    return batch


def test_nothing_is_left_billing_held_or_lost(chaos):
    assert chaos.figures.leaks_and_losses() == {
        "endpoints_leaked": 0, "slots_leaked": 0, "secrets_leaked": 0, "volumes_unaccounted": 0, "workers_leaked": 0,
        "training_processes_leaked": 0, "results_lost": 0,
    }


def test_every_run_ends_as_its_fault_predicts(chaos):
    wrong = {r.name: r.problems for r in chaos.records if r.problems}
    assert not wrong, chaos.report() + "\n\n" + "\n\n".join(
        f"--- {r.name} output ---\n{r.output[-4000:]}" for r in chaos.records if r.problems)
    failing = [kind for kind in KINDS if SCENARIOS[kind].expect_state == "FAILED"]
    assert chaos.figures.completed == len(KINDS) - len(failing)
    assert chaos.figures.failed_as_expected == len(failing)


def test_every_kind_of_fault_was_really_injected(chaos):
    injected = {kind for kind, count in chaos.figures.faults_injected.items() if count}
    assert {"status_429", "status_500", "drop", "hang", "act_then_500", "worker_crash", "worker_hang", "worker_preempt",
            "worker_env", "unknown_status", "status_400", "answer", "create_patched"} <= injected, chaos.figures.faults_injected
    assert chaos.figures.out_of_stock_pools == [OUT_OF_STOCK_POOL]


def test_tolerated_api_faults_cost_no_attempt(chaos):
    run = chaos.record("api-faults")
    assert run.state_type == "COMPLETED" and run.retried == [] and len(run.endpoint_names) == 1


def test_a_create_that_errors_after_acting_leaves_exactly_one_endpoint(chaos):
    run = chaos.record("ambiguous-create")
    assert run.state_type == "COMPLETED" and len(run.endpoint_names) == 1, run.endpoint_names


def test_a_failed_submit_moves_to_a_new_endpoint(chaos):
    run = chaos.record("run-500")
    assert run.retried == ["submit_failed"] and run.state_type == "COMPLETED"
    assert sorted(n[-3:] for n in run.endpoint_names) == ["-a1", "-a2"]


def test_a_lost_worker_whose_job_runpod_fails_is_retried_on_a_new_endpoint(chaos):
    run = chaos.record("worker-crash")
    assert run.retried == ["worker_lost"] and run.state_type == "COMPLETED"
    assert sorted(n[-3:] for n in run.endpoint_names) == ["-a1", "-a2"]


def test_a_lost_workers_requeued_job_completes_on_the_same_attempt_with_one_training_per_store(chaos):
    run = chaos.record("worker-crash-requeue")
    assert run.state_type == "COMPLETED" and run.retried == [] and len(run.endpoint_names) == 1
    assert run.requeued == 1 and run.resumed_from_step >= 2  # a checkpoint stored before the crash
    assert run.fresh_trainings == 1, run.fresh_trainings


def test_a_preempted_workers_job_is_taken_by_another_worker_of_the_same_endpoint(chaos):
    run = chaos.record("preempt")
    assert run.state_type == "COMPLETED" and run.retried == [] and len(run.endpoint_names) == 1
    assert run.requeued == 1


def test_a_frozen_worker_is_given_up_as_stalled(chaos):
    run = chaos.record("worker-hang")
    # A frozen worker's training process (its own session) may still store the results: then they are adopted.
    assert run.retried + [run.adopted_after] * bool(run.adopted_after) == ["stalled"] and run.state_type == "COMPLETED"


def test_a_stalled_attempt_is_replaced_and_the_next_resumes_from_the_checkpoint(chaos):
    run = chaos.record("stall-resume")
    assert run.retried == ["stalled"] and run.state_type == "COMPLETED"
    assert run.resumed_from_step is not None and 0 < run.resumed_from_step < MAX_STEPS


def test_no_capacity_walks_the_gpu_list(chaos):
    run = chaos.record("no-capacity")
    assert run.retried == ["no_capacity"] and run.gpus_used == ["RTX 5090", "A100 SXM"] and run.state_type == "COMPLETED"


def test_out_of_memory_first_retries_the_same_gpu_with_checkpointing_and_half_the_micro_batch(chaos):
    run = chaos.record("oom")
    assert run.retried == ["out_of_memory"] and run.gpus_used == ["RTX 4090", "RTX 4090"] and run.state_type == "COMPLETED"
    manifest = json.loads((run.run_dir / "manifest.json").read_text())
    assert set(manifest["forced_memory_settings"]) >= {"gradient_checkpointing", "micro_batch_size"}, manifest


def test_out_of_memory_again_moves_to_a_gpu_with_more_memory(chaos):
    run = chaos.record("oom-twice")
    assert run.retried == ["out_of_memory", "out_of_memory"] and run.state_type == "COMPLETED"
    assert run.gpus_used == ["RTX 4090", "RTX 4090", "A100 SXM"]


@pytest.mark.parametrize(("kind", "sign"), [("oom-cuda-error", "CUDA error: out of memory"),
                                            ("oom-cublas", "CUBLAS_STATUS_ALLOC_FAILED"),
                                            ("oom-vllm-kv", "out of memory (vLLM KV cache)")])
def test_gpu_out_of_memory_is_recognised_whatever_the_prefix(chaos, kind, sign):
    run = chaos.record(kind)
    assert run.state_type == "FAILED" and run.retried == ["out_of_memory"], run.state_message
    assert "out_of_memory" in run.state_message and sign in run.state_message, run.state_message


def test_host_ram_running_out_is_its_own_outcome_and_not_moved_to_a_bigger_gpu(chaos):
    run = chaos.record("oom-host")
    assert run.state_type == "FAILED" and run.retried == ["host_out_of_memory"]
    assert run.gpus_used == ["RTX 4090", "RTX 4090"]
    assert "host_out_of_memory" in run.state_message and "host's RAM" in run.state_message, run.state_message


def test_a_host_without_cuda_costs_one_retry_then_fails_naming_the_driver(chaos):
    run = chaos.record("cuda-unavailable")
    assert run.state_type == "FAILED" and run.retried == ["cuda_unavailable"]
    assert "CUDA unavailable" in run.state_message and "driver" in run.state_message, run.state_message
    assert not run.done  # nothing was trained on the CPU


def test_an_endpoint_deleted_mid_training_costs_an_attempt_not_the_run(chaos):
    run = chaos.record("endpoint-deleted")
    assert run.endpoint_deleted is not None
    assert run.retried == ["lost"] and run.state_type == "COMPLETED"
    assert sorted(n[-3:] for n in run.endpoint_names) == ["-a1", "-a2"]
    assert run.resumed_from_step is not None and run.resumed_from_step >= 2  # the checkpoint stored before the delete


def test_a_volume_attached_between_the_volumes_flows_decision_and_its_delete_is_kept(chaos):
    run = chaos.record("volume-race")
    race = run.volume_race
    assert run.state_type == "COMPLETED" and race.attached_by is not None, chaos.report()
    assert (race.row["action"], race.row["result"]) == ("keep", "kept: attached"), race.row
    assert race.attached_by in race.row["attached to"]
    assert race.volume_kept and race.record_kept and race.endpoint_still_attaches


def test_an_unknown_job_status_is_treated_as_running(chaos):
    run = chaos.record("unknown-status")
    assert run.state_type == "COMPLETED" and run.retried == []


def test_a_code_failure_is_not_retried_and_the_state_says_why(chaos):
    run = chaos.record("code-failure")
    assert run.state_type == "FAILED" and run.retried == [] and len(run.endpoint_names) == 1
    assert "ValueError" in run.state_message and "not-a-model" in run.state_message, run.state_message


def test_completed_adapters_load_with_peft_and_change_the_model(chaos):
    assert chaos.figures.adapters_loaded == 2


# --- a delete that keeps failing for minutes ------------------------------------------------------


def test_an_endpoint_whose_deletes_fail_past_the_task_retries_is_still_deleted(chaos, chaos_stack):
    run = chaos.record("delete-outage")
    assert run.endpoint_names and not run.problems, chaos.report()
    live = [e.name for e in Localpod(chaos_stack.localpod_url).account().live_endpoints if run.owns(e.name)]
    assert live == [], live


def test_a_delete_outage_does_not_fail_a_run_whose_results_are_stored(chaos):
    run = chaos.record("delete-outage")
    assert run.done and run.state_type == "COMPLETED", run.state_message[:2000]
