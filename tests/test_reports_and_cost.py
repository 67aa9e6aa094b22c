"""Run reports are pure functions; the budget is checked before anything is rented."""

from datetime import UTC, datetime

import pytest
from loraflow_worker.contract import TrainMetrics

from tasks.placement.cost import check_budget, worst_case_cost_usd
from tasks.reports.summary import RunReport, billed_later, metrics_rows, summary_markdown
from tasks.runpod.catalog import resolve_gpu

METRICS = TrainMetrics(steps=3, losses=[(1, 6.4), (2, 3.0), (3, 1.25)], first_loss=6.4, final_loss=1.25, tokens=1234,
                       wall_seconds=2.5, device="cpu")


def test_worst_case_cost_uses_the_dearest_fallback_gpu_for_the_whole_deadline():
    gpus = [resolve_gpu("4090"), resolve_gpu("h100")]
    assert worst_case_cost_usd(gpus, 1, 60) == 4.18
    assert worst_case_cost_usd(gpus, 2, 30) == 4.18


def test_run_over_budget_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="budget_usd"):
        check_budget(10.0, 5.0)
    check_budget(4.0, 5.0)
    check_budget(4.0, None)


def test_summary_names_model_gpu_steps_loss_cost_and_adapter():
    report = RunReport(run_name="demo", run_id="r1", model="tiny", model_revision=None, gpu="RTX 4090", gpu_count=1,
                       endpoint_name="loraflow-demo-abc-a1", metrics=METRICS, cost_ceiling_usd=0.35,
                       estimated_cost_usd=0.0005, adapter_url="file:///a/adapter", store_url="file:///a",
                       fast_paths={"liger": {"engaged": False, "reason": "no CUDA device"}})
    text = summary_markdown(report)
    for expected in ("tiny", "1 × RTX 4090", "| Steps | 3 |", "6.4000 → 1.2500", "$0.0005", "file:///a/adapter",
                     "| liger | no | no CUDA device |"):
        assert expected in text


def test_summary_says_qlora_and_the_memory_settings_an_out_of_memory_attempt_forced():
    report = RunReport(run_name="demo", run_id="r1", model="tiny", model_revision=None, gpu="RTX 4090", gpu_count=1,
                       endpoint_name="loraflow-demo-abc-a2", metrics=METRICS, cost_ceiling_usd=0.35,
                       estimated_cost_usd=0.0005, adapter_url="file:///a/adapter", store_url="file:///a",
                       quantization="4bit", forced_memory=["gradient_checkpointing", "micro_batch_size"])
    text = summary_markdown(report)
    assert "| Base weights | 4-bit (QLoRA" in text
    assert "| Memory settings forced | gradient_checkpointing, micro_batch_size" in text


def test_metrics_table_has_one_row_per_logged_step():
    assert metrics_rows(METRICS) == [{"step": 1, "loss": 6.4}, {"step": 2, "loss": 3.0}, {"step": 3, "loss": 1.25}]


def report(**fields):
    return RunReport(run_name="demo", run_id="r1", model="tiny", model_revision=None, gpu="RTX 4090", gpu_count=1,
                     endpoint_name="loraflow-demo-abc-a1", metrics=METRICS, cost_ceiling_usd=0.35,
                     estimated_cost_usd=0.0005, adapter_url="file:///a/adapter", store_url="file:///a", **fields)


def test_a_run_runpod_has_not_billed_yet_says_so_and_who_fills_it_in():
    text = summary_markdown(report(billed_usd=0.0, billing_pending=True))
    assert "| Billed by RunPod | not billed yet; the reconciler fills this in |" in text
    unread = summary_markdown(report(billed_usd=None, billing_pending=True))
    assert "| Billed by RunPod | not read yet (RunPod's billing could not be read); the reconciler fills this in |" \
        in unread


def test_the_reconciler_fills_the_billed_figure_into_the_pending_row_only():
    pending = summary_markdown(report(billed_usd=0.0, billing_pending=True))
    filled = billed_later(pending, 0.0123, datetime(2026, 12, 1, 9, 30, tzinfo=UTC))
    assert "| Billed by RunPod | $0.0123 (billed after the run ended; read by the reconciler 2026-12-01 09:30 UTC) |" \
        in filled
    assert "fills this in" not in filled
    assert filled.replace(filled.split("| Billed by RunPod |")[1].split("\n")[0], "") == \
        pending.replace(pending.split("| Billed by RunPod |")[1].split("\n")[0], "")  # nothing else changed
    # Settled already, or billed when the run ended: nothing to fill in.
    assert billed_later(filled, 0.02, datetime.now(UTC)) is None
    assert billed_later(summary_markdown(report(billed_usd=0.0007)), 0.02, datetime.now(UTC)) is None


def test_the_summary_says_a_colocated_vllm_that_failed_and_why():
    # The worker's record when the engine could not be built or loaded and the run went on without it.
    reason = "failed: ImportError: vLLM is not available; completions come from transformers' generate (slower)"
    text = summary_markdown(report(fast_paths={"vllm_colocate": {"engaged": False, "reason": reason}}))
    assert f"| vllm_colocate | no | {reason} |" in text
