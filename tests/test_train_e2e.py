"""End to end: a real `prefect server start`, localpod, and the real worker under the real
`runpod.serverless` loop training a tiny model on the CPU."""

from __future__ import annotations

import json
import threading
from datetime import datetime
from pathlib import Path

import httpx
import pytest

from deployments.local_stack import check_adapter
from tasks.reports.summary import score_text
from tests.conftest import DATASET, localpod_account, prefect_api, run_train_flow

pytestmark = pytest.mark.timeout(900)


def write_run_file(path: Path, *, name: str, model: Path, store: Path, max_steps: int = 40, dataset: Path = DATASET,
                   extra: str = "") -> Path:
    """A run file of an SFT run of the tiny model; `extra`: more TOML sections, appended."""
    path.write_text(f'''
name = "{name}"
artifact_store = "file://{store}"
deadline_minutes = 20
[model]
id = "{model}"
[dataset]
local_file = "{dataset}"
[lora]
rank = 8
alpha = 16
[training]
learning_rate = 5e-3
max_steps = {max_steps}
batch_size = 8
max_seq_length = 128
seed = 7
''' + extra)
    return path


USER_GRADER = """\
def words_said(prompts, completions, answer, **kwargs):
    said = [completion[-1]["content"].lower().split() for completion in completions]
    return [sum(word in words for word in expected.lower().split()) / len(expected.split())
            for words, expected in zip(said, answer)]
"""
HARNESS_TASK = """\
task: capitals_perplexity
dataset_path: json
dataset_kwargs:
  data_files:
    test: data/capitals.jsonl
test_split: test
output_type: loglikelihood
doc_to_text: "{{question}}"
doc_to_target: " {{reply}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
"""


def flow_run_state(stack, flow_run_id: str) -> dict:
    return prefect_api(stack, "GET", f"/flow_runs/{flow_run_id}").json()["state"]


def endpoint_slots_in_use(stack) -> int:
    limit = httpx.get(f"{stack.prefect_api_url}/v2/concurrency_limits/runpod-endpoints", timeout=30)
    if limit.status_code == 404:
        return 0  # the first run (or serve) makes the limit
    return limit.raise_for_status().json()["active_slots"]


def run_endpoints(stack, name: str) -> list[dict]:
    return [e for e in localpod_account(stack)["endpoints"] if e["name"].startswith(f"loraflow-{name}-")]


def test_sft_run_trains_stores_an_adapter_and_cleans_up(local_stack, tiny_model, tmp_path):
    store = tmp_path / "store"
    # A task of four of the trained chats' questions, each with its chat's answer, asked of the base and the adapter.
    chats = [json.loads(line)["messages"] for line in DATASET.read_text().splitlines() if line.strip()][:4]
    task_file = tmp_path / "capitals.jsonl"
    task_file.write_text("".join(json.dumps({"messages": chat[:-1], "answer": chat[-1]["content"]}) + "\n"
                                 for chat in chats))
    # A user's grader file: the share of the expected sentence's words in the answer, called as a reward function is.
    grader_file = tmp_path / "graders.py"
    grader_file.write_text(USER_GRADER)
    # A private lm-evaluation-harness task in a folder of its own (its YAML and its data beside it), shipped with the
    # run: the perplexity of the same four answers after their questions, read with no Hub.
    task_dir = tmp_path / "harness-tasks"
    (task_dir / "data").mkdir(parents=True)
    (task_dir / "capitals_perplexity.yaml").write_text(HARNESS_TASK)
    (task_dir / "data" / "capitals.jsonl").write_text("".join(json.dumps(
        {"question": chat[-2]["content"], "reply": chat[-1]["content"]}) + "\n" for chat in chats))
    evaluation = (f"[evaluation]\nfraction = 0.2\nevery_steps = 20\n[[evaluation.tasks]]\nname = \"capitals\"\n"
                  f"local_file = \"{task_file}\"\ngraders = [\"f1\", \"{grader_file}:words_said\"]\n"
                  f"max_new_tokens = 16\n[evaluation.benchmarks]\ntasks = [\"capitals_perplexity\"]\n"
                  f"task_dir = \"{task_dir}\"\nbatch_size = 4\n")
    run_file = write_run_file(tmp_path / "run.toml", name="e2e-sft", model=tiny_model, store=store, extra=evaluation)
    run = run_train_flow(local_stack, run_file)
    assert run.returncode == 0, run.output
    assert flow_run_state(local_stack, run.flow_run_id)["type"] == "COMPLETED"

    run_dir = store / "runs" / run.flow_run_id
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["steps"] == 40
    # On the answers only (the default `loss_on`): the chat template's own tokens, learnt first, do not count.
    assert metrics["final_loss"] < 0.65 * metrics["first_loss"], metrics["losses"]
    # The held-out fifth of the dataset, evaluated before the first step, at step 20 and after the last: it falls.
    assert [step for step, _ in metrics["eval_loss"]] == [0, 20, 40], metrics["eval_loss"]
    assert metrics["eval_loss"][-1][1] < 0.75 * metrics["eval_loss"][0][1], metrics["eval_loss"]
    assert (run_dir / "DONE").exists()
    # The task asked after training: the adapter answers its trained questions closer to their answers than the base.
    score, user_score = metrics["task_scores"]
    assert (score["task"], score["grader"], score["n"]) == ("capitals", "f1", 4)
    assert score["adapter"] > score["base"], score
    # The user's grader, run on the worker from the stored file: the adapter says more of the expected words.
    assert (user_score["task"], user_score["grader"], user_score["n"]) == ("capitals", "words_said", 4)
    assert user_score["adapter"] > user_score["base"], user_score
    # The private harness task from the shipped task folder: the adapter finds its trained answers less surprising.
    (benchmark,) = metrics["benchmark_scores"]
    assert (benchmark["task"], benchmark["metric"], benchmark["n"]) == ("capitals_perplexity", "perplexity", 4)
    assert benchmark["higher_is_better"] is False and benchmark["adapter"] < benchmark["base"], benchmark
    assert len((run_dir / "evaluation" / "capitals.jsonl").read_text().splitlines()) == 4

    # The adapter loads with PEFT (in the worker's environment) and changes the model's output.
    report = check_adapter(tiny_model, run_dir / "adapter")
    assert report["loads"] and report["changes_output"], report

    # The endpoint is gone and the slot is back.
    endpoints = run_endpoints(local_stack, "e2e-sft")
    assert len(endpoints) == 1 and endpoints[0]["deletedAt"] is not None
    assert endpoint_slots_in_use(local_stack) == 0

    # The UI shows the summary and the loss table.
    artifacts = {a["key"]: a for a in prefect_api(local_stack, "POST", "/artifacts/filter",
                                                 json={"artifacts": {"flow_run_id": {"any_": [run.flow_run_id]}}}).json()}
    assert {"train-e2e-sft-summary", "train-e2e-sft-metrics", "train-e2e-sft-progress"} <= set(artifacts)
    # Priced from RunPod's live catalog (localpod serves one), with what RunPod billed the endpoint.
    summary = artifacts["train-e2e-sft-summary"]["data"]
    assert "price source: catalog" in summary and "Billed by RunPod" in summary, summary
    assert "| Eval loss, held-out (start → final) |" in summary and "## Training and eval loss by step" in summary
    assert "| Loss on | the answers: " in summary  # the default: the assistant turns only
    assert f"| capitals | f1 | {score['base']:.3f} | {score['adapter']:.3f} |" in summary, summary
    assert f"| capitals | words_said | {user_score['base']:.3f} | {user_score['adapter']:.3f} |" in summary, summary
    # A perplexity this large shows in three significant digits (the summary's rule for scores of 10,000 or more).
    assert (f"| capitals_perplexity | benchmark perplexity (lower is better) | {score_text(benchmark['base'])} | "
            f"{score_text(benchmark['adapter'])} |") in summary, summary


def test_a_run_from_an_earlier_runs_adapter_starts_from_a_much_lower_loss(local_stack, tiny_model, tmp_path):
    store = tmp_path / "store"
    first = run_train_flow(local_stack, write_run_file(tmp_path / "first.toml", name="e2e-parent", model=tiny_model,
                                                       store=store, max_steps=30))
    assert first.returncode == 0, first.output
    child_file = write_run_file(tmp_path / "child.toml", name="e2e-child", model=tiny_model, store=store, max_steps=3)
    child_file.write_text(child_file.read_text().replace("alpha = 16", f'alpha = 16\ninit_from = "runs/{first.flow_run_id}"'))
    child = run_train_flow(local_stack, child_file)
    assert child.returncode == 0, child.output
    parent_metrics = json.loads((store / "runs" / first.flow_run_id / "metrics.json").read_text())
    child_metrics = json.loads((store / "runs" / child.flow_run_id / "metrics.json").read_text())
    assert child_metrics["first_loss"] < 0.7 * parent_metrics["first_loss"], (child_metrics, parent_metrics["losses"])
    manifest = json.loads((store / "runs" / child.flow_run_id / "manifest.json").read_text())
    assert manifest["job"]["lora"]["init_from"] == f"runs/{first.flow_run_id}"


def test_failing_job_fails_the_flow_with_the_workers_error_and_still_deletes_the_endpoint(local_stack, tmp_path):
    not_a_model = tmp_path / "not-a-model"
    not_a_model.mkdir()
    run = run_train_flow(local_stack, write_run_file(tmp_path / "run.toml", name="e2e-fail", model=not_a_model,
                                                     store=tmp_path / "store"))
    assert run.returncode == 1, run.output
    state = flow_run_state(local_stack, run.flow_run_id)
    assert state["type"] == "FAILED"
    # The worker's own error (here: the folder holds no model) reaches the flow run's state.
    assert "ValueError" in state["message"] and str(not_a_model) in state["message"], state["message"]
    assert "[failed: not retried]" in state["message"]
    endpoints = run_endpoints(local_stack, "e2e-fail")
    assert len(endpoints) == 1 and endpoints[0]["deletedAt"] is not None
    assert endpoint_slots_in_use(local_stack) == 0


def test_bad_dataset_is_refused_before_any_endpoint_is_created(local_stack, tiny_model, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{"text": "no messages here"}\n')
    run = run_train_flow(local_stack, write_run_file(tmp_path / "run.toml", name="e2e-baddata", model=tiny_model,
                                                     store=tmp_path / "store", dataset=bad))
    assert run.returncode == 1
    assert "line 2" in flow_run_state(local_stack, run.flow_run_id)["message"]
    assert run_endpoints(local_stack, "e2e-baddata") == []


def test_runs_never_hold_more_endpoints_than_the_limit(local_stack, tiny_model, tmp_path):
    limit = 2
    if endpoint_limit_missing(local_stack):
        prefect_api(local_stack, "POST", "/v2/concurrency_limits/",
                    json={"name": "runpod-endpoints", "limit": local_stack.worker_quota})
    prefect_api(local_stack, "PATCH", "/v2/concurrency_limits/runpod-endpoints", json={"limit": limit})
    try:
        files = [write_run_file(tmp_path / f"run{i}.toml", name=f"e2e-quota{i}", model=tiny_model,
                                store=tmp_path / "store", max_steps=4) for i in range(3)]
        results = []
        threads = [threading.Thread(target=lambda f=f: results.append(run_train_flow(local_stack, f))) for f in files]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [r.returncode for r in results] == [0, 0, 0], "\n".join(r.output[-3000:] for r in results)
        endpoints = [e for i in range(3) for e in run_endpoints(local_stack, f"e2e-quota{i}")]
        assert len(endpoints) == 3 and all(e["deletedAt"] for e in endpoints), endpoints
        assert most_live_at_once(endpoints) <= limit, endpoints
        assert endpoint_slots_in_use(local_stack) == 0
    finally:
        # Back to what the runs create it with on this stack (LORAFLOW_WORKER_QUOTA = localpod's quota).
        prefect_api(local_stack, "PATCH", "/v2/concurrency_limits/runpod-endpoints",
                    json={"limit": local_stack.worker_quota})


def most_live_at_once(endpoints: list[dict]) -> int:
    """The most of these endpoints that were live at one instant, from their creation and deletion times
    (the account's own peak counts every test of the session, and some create endpoints outside the limit)."""
    events = sorted([(datetime.fromisoformat(e["createdAt"]), 1) for e in endpoints]
                    + [(datetime.fromisoformat(e["deletedAt"]), -1) for e in endpoints])  # a deletion at the same instant goes first
    live = most = 0
    for _, change in events:
        live += change
        most = max(most, live)
    return most


def test_a_chat_run_whose_answers_are_beyond_max_seq_length_is_refused_before_any_endpoint_is_created(
        local_stack, tiny_model, tmp_path):
    chats = tmp_path / "long-prompts.jsonl"
    chats.write_text(json.dumps({"messages": [{"role": "user", "content": "word " * 300},
                                              {"role": "assistant", "content": "ok"}]}) + "\n")
    run = run_train_flow(local_stack, write_run_file(tmp_path / "run.toml", name="e2e-noanswer", model=tiny_model,
                                                     store=tmp_path / "store", dataset=chats))
    assert run.returncode == 1
    message = flow_run_state(local_stack, run.flow_run_id)["message"]
    assert "no token of an assistant turn within training.max_seq_length (128)" in message, message
    assert "training.chat_template" in message and "training.loss_on" in message, message
    assert run_endpoints(local_stack, "e2e-noanswer") == []
    assert not (tmp_path / "store").exists()  # refused before its inputs were stored


def test_packing_a_gated_deltanet_hybrid_is_refused_before_any_endpoint_is_created(local_stack, tmp_path):
    from transformers import Qwen3NextConfig

    hybrid = tmp_path / "qwen3-next"
    hybrid.mkdir()
    (hybrid / "config.json").write_text(Qwen3NextConfig(num_hidden_layers=4).to_json_string())
    run_file = write_run_file(tmp_path / "run.toml", name="e2e-packhybrid", model=hybrid, store=tmp_path / "store")
    run_file.write_text(run_file.read_text().replace("seed = 7", "seed = 7\npacking = true\nloss_on = \"all\""))  # no tokenizer here
    run = run_train_flow(local_stack, run_file)
    assert run.returncode == 1
    message = flow_run_state(local_stack, run.flow_run_id)["message"]
    assert "training.packing: `qwen3_next` is a Gated-DeltaNet hybrid" in message, message
    assert run_endpoints(local_stack, "e2e-packhybrid") == []


def endpoint_limit_missing(stack) -> bool:
    import httpx

    return httpx.get(f"{stack.prefect_api_url}/v2/concurrency_limits/runpod-endpoints", timeout=10).status_code == 404


@pytest.mark.parametrize(
    ("case", "model", "dataset", "expected"),
    [
        ("nofile", None, "/nonexistent/data.jsonl", "does not exist"),
        ("nomodel", "acme/no-such-model", None, "no such model on the Hub"),
        ("norev", "acme/tiny-qwen3@no-such-branch", None, "does not exist in acme/tiny-qwen3"),
    ],
)
def test_missing_inputs_are_refused_before_anything_is_created(local_stack, tiny_model, tmp_path, case, model, dataset,
                                                               expected):
    from huggingface_hub import HfApi

    api = HfApi(endpoint=local_stack.hub_url, token=local_stack.client_env["HF_TOKEN"])
    api.create_repo("acme/tiny-qwen3", exist_ok=True)
    run_file = write_run_file(tmp_path / "run.toml", name=f"e2e-bad-{case}", model=tiny_model, store=tmp_path / "store",
                              dataset=Path(dataset) if dataset else DATASET)
    if model is not None:
        model_id, _, revision = model.partition("@")
        text = run_file.read_text().replace(f'id = "{tiny_model}"', f'id = "{model_id}"'
                                            + (f'\nrevision = "{revision}"' if revision else ""))
        run_file.write_text(text)
    run = run_train_flow(local_stack, run_file)
    assert run.returncode == 1
    assert expected in flow_run_state(local_stack, run.flow_run_id)["message"]
    assert run_endpoints(local_stack, f"e2e-bad-{case}") == []
