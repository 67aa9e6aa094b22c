"""What a run shows at a glance: its name and tags, a progress line, and a summary with its training
curve (what the curve draws: tests/test_curve.py) and, when the run evaluated, its held-out figures."""

import base64
import re

from loraflow_worker.contract import EarlyStopped, TrainMetrics

from tasks.reports.curve import curve_png
from tasks.reports.summary import (
    RunReport,
    finished_description,
    metrics_rows,
    progress_description,
    run_tags,
    run_title,
    summary_markdown,
)

METRICS = TrainMetrics(steps=4, losses=[(1, 6.4), (2, 3.0), (3, 2.0), (4, 1.25)], first_loss=6.4, final_loss=1.25,
                       tokens=1234, wall_seconds=2.5, device="cpu")


def test_the_run_name_reads_name_model_algorithm_gpu():
    assert run_title("capybara", "Qwen/Qwen3-0.6B", "sft", "RTX 4090") == "capybara-qwen3-0.6b-sft-rtx-4090"
    assert run_title("local", "/tmp/models/tiny-model/", "grpo", "A100 SXM") == "local-tiny-model-grpo-a100-sxm"


def test_the_run_tags_name_algorithm_model_and_every_gpu():
    assert run_tags("Qwen/Qwen3-0.6B", "sft", ["RTX 4090", "H100"]) == [
        "algorithm:sft", "model:Qwen3-0.6B", "gpu:RTX 4090", "gpu:H100"]


def test_the_progress_line_shows_step_loss_throughput_and_eta():
    line = progress_description({"kind": "progress", "stage": "training", "step": 12, "total_steps": 40,
                                 "loss": 1.23456, "tokens_per_second": 8312.4, "eta_seconds": 130.0, "message": ""})
    assert line == "training: step 12/40 · loss 1.2346 · 8,312 tokens/s · ETA 2m 10s"


def test_a_grpo_progress_line_shows_the_mean_reward_beside_the_loss():
    line = progress_description({"stage": "training", "step": 3, "total_steps": 10, "loss": 0.01, "reward": 0.8125})
    assert line == "training: step 3/10 · loss 0.0100 · reward 0.812"


def test_the_progress_line_leaves_out_what_is_not_known_yet():
    assert progress_description({"stage": "loading", "step": 0, "message": "downloading the model"}) == \
        "loading: step 0/? · downloading the model"


def test_the_summary_embeds_the_curve_and_links_the_adapter_the_store_and_the_run():
    report = RunReport(run_name="demo", run_id="r1", model="tiny", model_revision=None, gpu="RTX 4090", gpu_count=1,
                       endpoint_name="loraflow-demo-abc-a1", metrics=METRICS, cost_ceiling_usd=0.35,
                       estimated_cost_usd=0.0005, billed_usd=0.0007, adapter_url="file:///s/runs/r1/adapter",
                       store_url="file:///s", run_url="file:///s/runs/r1", curve_url="file:///s/runs/r1/curve.png")
    png = curve_png(METRICS, "sft")
    text = summary_markdown(report, png)
    [embedded] = re.findall(r"!\[training loss by step\]\(data:image/png;base64,([A-Za-z0-9+/=]+)\)", text)
    assert base64.b64decode(embedded) == png
    for expected in ("| Cost before (worst case) | $0.35", "| Estimated cost | $0.0005", "| Billed by RunPod | $0.0007",
                     "[file:///s/runs/r1/adapter](file:///s/runs/r1/adapter)", "[file:///s](file:///s)",
                     "[file:///s/runs/r1](file:///s/runs/r1)", "[curve.png](file:///s/runs/r1/curve.png)"):
        assert expected in text, expected


def test_a_completed_jobs_progress_line_comes_from_its_result():
    output = {"run_id": "r1", "attempt": 1, "run_prefix": "runs/r1", "adapter_path": "runs/r1/adapter",
              "metrics": METRICS.model_dump(mode="json")}
    assert finished_description(output) == "completed: step 4/4 · loss 1.2500 · 494 tokens/s · ETA 0s"


EVALUATED = METRICS.model_copy(update={"eval_loss": [(0, 6.9), (2, 3.4), (4, 2.05)]})


def test_the_progress_line_shows_the_latest_eval_loss_or_reward():
    assert progress_description({"stage": "training", "step": 2, "total_steps": 4, "loss": 3.0, "eval_loss": 3.4}) == \
        "training: step 2/4 · loss 3.0000 · eval loss 3.4000"
    assert progress_description({"stage": "training", "step": 2, "total_steps": 4, "reward": 0.5,
                                 "eval_reward": 0.25}) == "training: step 2/4 · reward 0.500 · eval reward 0.250"


def test_a_completed_jobs_progress_line_shows_the_final_eval_loss():
    output = {"run_id": "r1", "attempt": 1, "run_prefix": "runs/r1", "adapter_path": "runs/r1/adapter",
              "metrics": EVALUATED.model_dump(mode="json")}
    assert finished_description(output) == \
        "completed: step 4/4 · loss 1.2500 · eval loss 2.0500 · 494 tokens/s · ETA 0s"


def test_the_summary_shows_the_eval_loss_from_the_start_to_the_end_beside_the_training_loss():
    report = RunReport(run_name="demo", run_id="r1", model="tiny", model_revision=None, gpu="RTX 4090", gpu_count=1,
                       endpoint_name="loraflow-demo-abc-a1", metrics=EVALUATED, cost_ceiling_usd=0.35,
                       estimated_cost_usd=0.0005, adapter_url="file:///s/runs/r1/adapter", store_url="file:///s")
    text = summary_markdown(report, curve_png(EVALUATED, "sft"))
    assert "| Loss (first → final) | 6.4000 → 1.2500 |" in text
    assert "| Eval loss, held-out (start → final) | 6.9000 (step 0) → 2.0500 (step 4) |" in text
    assert "## Training and eval loss by step" in text


STOPPED = EVALUATED.model_copy(update={"early_stopping": EarlyStopped(
    metric="eval_loss", patience=1, min_delta=0.5, stopped=True, step=4, total_steps=40, best_step=2, best_value=3.4,
    reason="eval_loss did not improve by more than 0.5 for 1 evaluation")})


def test_the_summary_of_an_early_stopped_run_says_where_it_stopped_why_and_which_adapter_it_kept():
    report = RunReport(run_name="demo", run_id="r1", model="tiny", model_revision=None, gpu="RTX 4090", gpu_count=1,
                       endpoint_name="loraflow-demo-abc-a1", metrics=STOPPED, cost_ceiling_usd=0.35,
                       estimated_cost_usd=0.0005, adapter_url="file:///s/runs/r1/adapter", store_url="file:///s")
    assert "| Early stopping | stopped at step 4 of 40: eval_loss did not improve by more than 0.5 for 1 evaluation; " \
           "adapter from step 2 (eval_loss 3.4000, the best evaluation) |" in summary_markdown(report)


def test_the_summary_of_a_run_that_trained_to_the_end_under_early_stopping_names_the_adapter_it_kept():
    to_the_end = STOPPED.early_stopping.model_copy(update={"stopped": False, "step": 4, "total_steps": 4,
                                                           "reason": None})
    report = RunReport(run_name="demo", run_id="r1", model="tiny", model_revision=None, gpu="RTX 4090", gpu_count=1,
                       endpoint_name="loraflow-demo-abc-a1", metrics=STOPPED.model_copy(update={"early_stopping":
                                                                                                to_the_end}),
                       cost_ceiling_usd=0.35, estimated_cost_usd=0.0005, adapter_url="file:///s/runs/r1/adapter",
                       store_url="file:///s")
    assert "| Early stopping | trained to step 4 of 4; adapter from step 2 (eval_loss 3.4000, the best evaluation) |" \
        in summary_markdown(report)


def test_an_early_stopped_jobs_progress_line_gives_the_steps_planned_and_where_it_stopped():
    output = {"run_id": "r1", "attempt": 1, "run_prefix": "runs/r1", "adapter_path": "runs/r1/adapter",
              "metrics": STOPPED.model_dump(mode="json")}
    assert finished_description(output).startswith("completed: step 4/40 · loss 1.2500 · eval loss 2.0500 · "
                                                   "494 tokens/s · ETA 0s · stopped at step 4 of 40: ")


def test_the_metrics_table_gives_the_eval_loss_at_the_evaluated_steps():
    assert metrics_rows(EVALUATED) == [
        {"step": 0, "loss": None, "eval_loss": 6.9}, {"step": 1, "loss": 6.4, "eval_loss": None},
        {"step": 2, "loss": 3.0, "eval_loss": 3.4}, {"step": 3, "loss": 2.0, "eval_loss": None},
        {"step": 4, "loss": 1.25, "eval_loss": 2.05}]


def test_the_summary_links_each_trackers_run_or_its_stored_files():
    from loraflow_worker.contract import TrackerRun

    report = RunReport(run_name="demo", run_id="r1", model="tiny", model_revision=None, gpu="RTX 4090", gpu_count=1,
                       endpoint_name="loraflow-demo-abc-a1", metrics=METRICS, cost_ceiling_usd=0.35,
                       estimated_cost_usd=0.0005, adapter_url="file:///s/runs/r1/adapter", store_url="file:///s",
                       trackers=[TrackerRun(tracker="wandb", run_id="w1", run_name="r1-a1",
                                            url="https://wandb.ai/acme/loraflow/runs/w1"),
                                 TrackerRun(tracker="mlflow", run_id="m1", run_name="r1-a1",
                                            store_path="runs/r1/tracking/a1/mlruns.tar.gz", note="extract it")],
                       tracker_files_urls={"mlflow": "file:///s/runs/r1/tracking/a1/mlruns.tar.gz"})
    text = summary_markdown(report)
    assert "| W&B run | [r1-a1](https://wandb.ai/acme/loraflow/runs/w1) |" in text
    assert ("| MLflow run | `r1-a1` (id `m1`), recorded locally: "
            "[its files](file:///s/runs/r1/tracking/a1/mlruns.tar.gz); extract it |") in text


def test_the_summary_says_which_tokens_carried_the_loss():
    loss = {"loss_on": "completion", "masked_by": "the chat template's generation markers",
            "chat_template": "the model's own chat template", "token_share": 0.156}
    report = RunReport(run_name="demo", run_id="r1", model="tiny", model_revision=None, gpu="RTX 4090", gpu_count=1,
                       endpoint_name="loraflow-demo-abc-a1", metrics=METRICS, cost_ceiling_usd=0.35,
                       estimated_cost_usd=0.0005, adapter_url="file:///s/runs/r1/adapter", store_url="file:///s",
                       loss=loss)
    assert ("| Loss on | the answers: 16% of the training tokens (masked by the chat template's generation "
            "markers; the model's own chat template) |") in summary_markdown(report)


def test_a_dpo_runs_summary_and_progress_line_show_the_held_out_pairs_accuracy_and_margin():
    dpo = METRICS.model_copy(update={"eval_loss": [(0, 0.69), (4, 0.1)], "eval_reward_accuracies": [(0, 0.0), (4, 1.0)],
                                     "eval_reward_margins": [(0, 0.0), (4, 3.2)]})
    report = RunReport(run_name="demo", run_id="r1", model="tiny", model_revision=None, gpu="RTX 4090", gpu_count=1,
                       endpoint_name="loraflow-demo-abc-a1", metrics=dpo, cost_ceiling_usd=0.35,
                       estimated_cost_usd=0.0005, adapter_url="file:///s/runs/r1/adapter", store_url="file:///s",
                       algorithm="dpo")
    text = summary_markdown(report, curve_png(dpo.model_copy(update={"reward_accuracies": [(1, 0.5), (4, 1.0)]}), "dpo"))
    assert "## Training and eval reward accuracy by step" in text
    assert "| Eval reward accuracy, held-out pairs (start → final) | 0.0000 (step 0) → 1.0000 (step 4) |" in text
    assert "| Eval reward margin, held-out pairs (start → final) | 0.0000 (step 0) → 3.2000 (step 4) |" in text
    assert progress_description({"stage": "training", "step": 2, "total_steps": 4, "loss": 0.4,
                                 "reward_accuracy": 0.75}) == "training: step 2/4 · loss 0.4000 · reward accuracy 75%"


def test_a_grpo_summary_shows_trajectories_with_their_tool_calls_answers_and_rewards():
    trajectories = [{"step": 3, "prompt": "Record fig.", "answer": "Done.", "reward": 1.0, "rewards": {"receipt": 1.0},
                     "tool_calls": [{"name": "record", "arguments": {"item": "fig"}, "result": "receipt fig"}]},
                    {"step": 3, "prompt": "Record | pear.", "answer": "", "reward": 0.0, "rewards": {"receipt": 0.0},
                     "tool_calls": []}]
    report = RunReport(run_name="demo", run_id="r1", model="tiny", model_revision=None, gpu="RTX 4090", gpu_count=1,
                       endpoint_name="loraflow-demo-abc-a1", metrics=METRICS, cost_ceiling_usd=0.35,
                       estimated_cost_usd=0.0005, adapter_url="file:///s/runs/r1/adapter", store_url="file:///s",
                       algorithm="grpo", trajectories=trajectories,
                       trajectories_url="file:///s/runs/r1/trajectories.jsonl")
    text = summary_markdown(report)
    assert "## Trajectories at step 3" in text
    assert '| Record fig. | `record(item="fig")` → receipt fig | Done. | 1 |' in text
    assert "| Record \\| pear. | none |  | 0 |" in text
    assert "Every trajectory kept: [trajectories.jsonl](file:///s/runs/r1/trajectories.jsonl)." in text


def _report(**fields) -> RunReport:
    return RunReport(run_name="demo", run_id="r1", model="tiny", model_revision=None, gpu="RTX 4090", gpu_count=1,
                     endpoint_name="loraflow-demo-abc-a1", metrics=METRICS, cost_ceiling_usd=0.35,
                     estimated_cost_usd=0.0005, adapter_url="file:///s/runs/r1/adapter", store_url="file:///s",
                     **fields)


def test_the_summary_says_the_prices_and_gpu_classes_came_from_runpods_catalog():
    text = summary_markdown(_report(usd_per_hour=1.12, price_source="catalog", cards_from="catalog"))
    assert "| Prices | RunPod's catalog |" in text
    assert "| GPU classes | pools and cards from RunPod's catalog |" in text
    assert "Refused by RunPod" not in text


def test_the_summary_says_when_loraflows_fallback_list_price_stood_in_and_why():
    reason = "RunPod's catalog could not be read (ServerError: RunPod answered 500 to GET /v2/catalog/gpus)"
    text = summary_markdown(_report(usd_per_hour=1.12, price_source="static list price", price_fallback_reason=reason,
                                    cards_from="static table"))
    assert f"| Prices | fallback list price, not the live catalog ({reason}) |" in text
    assert ("| Estimated cost | $0.0005 (ceiling $0.35) at $1.12/GPU-hour, price source: fallback list price, not the "
            "live catalog |") in text
    assert "| GPU classes | pools and cards from loraflow's static table" in text


def test_the_summary_says_when_the_budget_was_checked_against_the_fallback_list_price():
    fallback = summary_markdown(_report(ceiling_price_source="static list price"))
    assert ("| Cost before (worst case) | $0.35: GPU price × GPUs × deadline, at the fallback list price, not the "
            "live catalog |") in fallback
    live = summary_markdown(_report(ceiling_price_source="catalog"))
    assert "| Cost before (worst case) | $0.35: GPU price × GPUs × deadline |" in live


def test_the_summary_names_each_gpu_class_runpod_refused_with_its_detail():
    refused = {"H100": "RunPod answered 400 to POST /v2/serverless: gpu.excludedTypes: NVIDIA H100 PCIe is not a GPU "
                       "type of the pools ADA_80_PRO"}
    text = summary_markdown(_report(refused=refused))
    assert "| Refused by RunPod | H100: RunPod answered 400 to POST /v2/serverless: gpu.excludedTypes: NVIDIA H100 " \
           "PCIe is not a GPU type of the pools ADA_80_PRO |" in text
