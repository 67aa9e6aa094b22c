"""The adapter published by name (`[publish]`): the model card, one commit per run to the Hub model repo, no
second commit when a run is published again, and a token that cannot write reported, never raised into the run.

The Hub is the local stand-in (tests/hub_fixture.py, a real server); the run is a `file://` store laid out as a
worker leaves it (or, where the store's revisions matter, a dataset repo on the stand-in). huggingface_hub reads HF_ENDPOINT at import, so each call passes the endpoint explicitly.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import yaml
from huggingface_hub import HfApi
from loraflow_worker.artifacts import ArtifactStore, open_store
from loraflow_worker.artifacts.pins import sha256_hex
from loraflow_worker.contract import JobResult, TrainMetrics
from prefect.states import Completed, Failed

from flows.forms.run import PublishSpec
from tasks.reports.summary import RunReport, summary_markdown
from tasks.storage.publish import (
    PUBLISH_TITLE,
    CardFacts,
    PublishedModel,
    PublishError,
    check_publish_token,
    model_card,
    publish_adapter,
    publish_adapter_task,
    published_or_failed,
)
from tests.hub_fixture import HubStandIn

_runs = itertools.count()
SWAPPED = b"a teammate's weights"
"""What someone else who can write the store puts in place of a run's adapter weights."""
ADAPTER_CONFIG = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "base_model_name_or_path": "/worker/cache/base",
                  "target_modules": ["q_proj"], "task_type": "CAUSAL_LM"}
ADAPTER_FILES = {"adapter_config.json": json.dumps(ADAPTER_CONFIG).encode(), "adapter_model.safetensors": b"weights",
                 "README.md": b"PEFT's own card", "tokenizer.json": b"{}"}
"""A stored run's adapter folder, as the worker saves it."""


def card_front_matter(card: str) -> dict:
    assert card.startswith("---\n")
    return yaml.safe_load(card.split("---\n")[1])


def facts(**changes) -> CardFacts:
    base = dict(hub_model_id="acme/tiny-lora", run_id="run-1", run_name="demo", base_model="acme/tiny-qwen3",
                base_model_revision="a" * 40, algorithm="sft", dataset_hub_id="trl-lib/Capybara",
                lora={"rank": 8, "alpha": 16}, training={"learning_rate": 0.005, "max_steps": 3},
                metrics={"steps": 3, "losses": [[1, 6.4], [3, 5.8]], "tokens": 601, "wall_seconds": 1.2,
                         "device": "cpu"})
    return CardFacts(**(base | changes))


def stored_run(store_root: Path, *, algorithm: str = "sft", adapter_files: dict[str, bytes] | None = None,
               store: ArtifactStore | None = None) -> str:
    """A completed run in the `file://` store at `store_root` (or in `store`), as the worker leaves it; returns its run
    id."""
    run_id = f"run-{next(_runs)}"
    prefix = f"runs/{run_id}"
    adapter = adapter_files or ADAPTER_FILES
    job = {"run_id": run_id, "algorithm": algorithm, "model": {"id": "acme/tiny-qwen3", "revision": "b" * 40},
           "dataset": {"hub_id": None, "store_path": f"{prefix}/dataset/train.jsonl"},
           "lora": {"rank": 8, "alpha": 16}, "training": {"max_steps": 3}}
    files = {f"{prefix}/adapter/{name}": data for name, data in adapter.items()}
    files |= {
        f"{prefix}/manifest.json": json.dumps({"job": job, "base_model_id": "acme/tiny-qwen3",
                                               "base_model_revision": "b" * 40}).encode(),
        f"{prefix}/metrics.json": json.dumps({"steps": 3, "losses": [[1, 6.4], [3, 5.8]]}).encode(),
        f"{prefix}/curve.png": b"\x89PNG fake",
        f"{prefix}/result.json": run_result(run_id, adapter).model_dump_json().encode(),
        f"{prefix}/DONE": b"{}",
    }
    (store or open_store(store_root.as_uri())).put(files, message="run")
    return run_id


def run_result(run_id: str, adapter: dict[str, bytes]) -> JobResult:
    """The `JobResult` the worker stores with a run whose adapter files are `adapter`."""
    return JobResult(run_id=run_id, attempt=1, run_prefix=f"runs/{run_id}", adapter_path=f"runs/{run_id}/adapter",
                     metrics=TrainMetrics(steps=3, losses=[(1, 6.4), (3, 5.8)], first_loss=6.4, final_loss=5.8,
                                          tokens=601, wall_seconds=1.2, device="cpu"),
                     adapter_sha256={name: sha256_hex(data) for name, data in adapter.items()})


def _repo_id(stem: str) -> str:
    return f"acme/{stem}-{next(_runs)}"


def test_the_card_front_matter_names_the_base_model_peft_the_tags_and_the_hub_dataset() -> None:
    meta = card_front_matter(model_card(facts()))
    assert meta["base_model"] == "acme/tiny-qwen3"
    assert meta["library_name"] == "peft"
    assert meta["tags"] == ["loraflow", "lora", "sft"]
    assert meta["datasets"] == ["trl-lib/Capybara"]


def test_a_local_base_model_and_a_local_dataset_stay_out_of_the_front_matter() -> None:
    card = model_card(facts(base_model="/models/tiny", base_model_revision=None, dataset_hub_id=None,
                            algorithm="grpo"))
    meta = card_front_matter(card)
    assert "base_model" not in meta and "datasets" not in meta
    assert meta["tags"] == ["loraflow", "lora", "grpo"]
    assert "`/models/tiny`" in card


def test_a_mix_names_its_hub_datasets_in_the_front_matter_and_every_source_in_the_card() -> None:
    card = model_card(facts(dataset_hub_id=None, dataset_mix=[("acme/chats", 0.7), (None, 0.3)]))
    assert card_front_matter(card)["datasets"] == ["acme/chats"]
    assert "| dataset | a mix of `acme/chats` (0.7), a JSONL file published with the run (0.3) |" in card


def test_the_card_says_how_to_load_with_peft_and_serve_with_vllm() -> None:
    card = model_card(facts(lora={"rank": 64}))
    assert 'PeftModel.from_pretrained(base, "acme/tiny-lora")' in card
    assert (f"vllm serve acme/tiny-qwen3 --revision {'a' * 40} --enable-lora --lora-modules tiny-lora=acme/tiny-lora "
            "--max-lora-rank 64") in card


def test_the_card_lists_the_schedule_optimizer_and_adapter_settings_the_run_trained_with() -> None:
    card = model_card(facts(training={"learning_rate": 0.005, "lr_scheduler": "cosine", "warmup_ratio": 0.03,
                                      "optimizer": "adamw_8bit", "weight_decay": 0.01, "max_grad_norm": 1.0},
                            lora={"rank": 8, "use_rslora": True, "loraplus_lr_ratio": 16.0}))
    for row in ("| training.lr_scheduler | `cosine` |", "| training.warmup_ratio | `0.03` |",
                "| training.optimizer | `adamw_8bit` |", "| training.weight_decay | `0.01` |",
                "| lora.use_rslora | `true` |", "| lora.loraplus_lr_ratio | `16.0` |"):
        assert row in card, row


def test_the_card_names_the_runs_own_files_by_their_file_names_only() -> None:
    card = model_card(facts(algorithm="grpo", grpo={
        "rewards": [{"name": "/home/alice/secret-project/reward.py:score", "weight": 1.0},
                    {"name": "numeric_match", "weight": 0.5}, {"name": "acme_rewards.judge:score", "weight": 1.0}],
        "tools": "/home/alice/secret-project/tools.py", "environment": "C:\\Users\\alice\\shop.py:Shop"}))
    assert "| grpo.rewards | `reward.py:score × 1.0, numeric_match × 0.5, acme_rewards.judge:score × 1.0` |" in card
    assert "| grpo.tools | `tools.py` |" in card and "| grpo.environment | `shop.py:Shop` |" in card
    assert "alice" not in card and "secret-project" not in card


def test_a_pissa_adapter_is_served_at_twice_its_rank_as_stored() -> None:
    assert "--max-lora-rank 64" in model_card(facts(lora={"rank": 32, "init": "pissa_niter_16"}))


@pytest.mark.parametrize("lora, named", [({"rank": 8, "use_dora": True}, "`use_dora` is set"),
                                         ({"rank": 8, "modules_to_save": ["lm_head"]}, "`modules_to_save` is ['lm_head']"),
                                         ({"rank": 8, "target_modules": ["q_proj", "lm_head"]},
                                          "`target_modules` includes lm_head")])
def test_an_adapter_vllm_refuses_gets_the_merge_instead_of_a_serve_command(lora, named) -> None:
    # The serve's own rule (`served_adapters.vllm_refusals`), so the card and a serve refuse the same adapters.
    card = model_card(facts(lora=lora))
    assert f"vLLM's LoRA loader refuses this adapter ({named}" in card and "merge_and_unload()" in card
    assert "vllm serve" not in card


def test_the_card_shows_eval_metrics_when_stored_and_leaves_them_out_when_not() -> None:
    with_eval = model_card(facts(metrics={"losses": [[1, 6.4], [3, 5.8]], "eval_loss": [[0, 6.6], [3, 6.0]]}))
    assert "| eval loss | 6.6000 (step 0) | 6.0000 (step 3) |" in with_eval
    without = model_card(facts(metrics={"losses": [[1, 6.4], [3, 5.8]], "eval_loss": "garbled"}))
    assert "| training loss | 6.4000 (step 1) | 5.8000 (step 3) |" in without and "eval loss" not in without


def test_publishing_puts_the_adapter_card_and_curve_in_one_commit(hub: HubStandIn, tmp_path: Path) -> None:
    run_id = stored_run(tmp_path / "store")
    repo_id = _repo_id("adapter")
    published = publish_adapter((tmp_path / "store").as_uri(), run_id, "demo", repo_id, private=True,
                                token=hub.token, endpoint=hub.url)
    api = HfApi(endpoint=hub.url, token=hub.token)
    assert published == PublishedModel(hub_model_id=repo_id, url=f"{hub.url}/{repo_id}",
                                       commit_url=published.commit_url)
    assert api.repo_info(repo_id).private is True
    commits = hub.commits("model", repo_id)
    assert [c["title"] for c in commits] == [PUBLISH_TITLE.format(run_id=run_id), "initial commit"]
    assert set(api.list_repo_files(repo_id)) == {".gitattributes", "adapter_config.json", "adapter_model.safetensors",
                                                "tokenizer.json", "README.md", "curve.png", "loraflow-run.json"}
    card = Path(api.hf_hub_download(repo_id, "README.md", cache_dir=tmp_path / "cache")).read_text()
    assert card_front_matter(card)["base_model"] == "acme/tiny-qwen3" and "![Training curve](curve.png)" in card
    config = json.loads(Path(api.hf_hub_download(repo_id, "adapter_config.json",
                                                 cache_dir=tmp_path / "cache")).read_text())
    assert (config["base_model_name_or_path"], config["revision"]) == ("acme/tiny-qwen3", "b" * 40)


def test_publishing_the_same_run_again_makes_no_new_commit(hub: HubStandIn, tmp_path: Path) -> None:
    run_id = stored_run(tmp_path / "store")
    repo_id = _repo_id("twice")
    first = publish_adapter((tmp_path / "store").as_uri(), run_id, "demo", repo_id, private=True, token=hub.token,
                            endpoint=hub.url)
    again = publish_adapter((tmp_path / "store").as_uri(), run_id, "demo", repo_id, private=True, token=hub.token,
                            endpoint=hub.url)
    assert again.already_published and again.commit_url == first.commit_url
    assert len(hub.commits("model", repo_id)) == 2  # the initial commit and the run's


def test_a_later_run_replaces_the_earlier_runs_files_in_an_existing_repo(hub: HubStandIn, tmp_path: Path) -> None:
    store = tmp_path / "store"
    repo_id = _repo_id("reused")
    HfApi(endpoint=hub.url, token=hub.token).create_repo(repo_id, private=False)
    first = stored_run(store)
    second = stored_run(store, adapter_files={"adapter_config.json": json.dumps(ADAPTER_CONFIG).encode(),
                                              "adapter_model.safetensors": b"new weights"})
    for run_id in (first, second):
        publish_adapter(store.as_uri(), run_id, "demo", repo_id, private=True, token=hub.token, endpoint=hub.url)
    api = HfApi(endpoint=hub.url, token=hub.token)
    assert "tokenizer.json" not in api.list_repo_files(repo_id)  # the first run's, not the second's
    assert api.repo_info(repo_id).private is False  # an existing repo keeps its visibility
    assert len(hub.commits("model", repo_id)) == 3


def test_an_adapter_file_replaced_after_the_run_stored_it_is_not_published(hub: HubStandIn, tmp_path: Path) -> None:
    store = tmp_path / "store"
    run_id = stored_run(store)
    (store / "runs" / run_id / "adapter" / "adapter_model.safetensors").write_bytes(SWAPPED)
    repo_id = _repo_id("swapped")
    with pytest.raises(PublishError) as refused:
        publish_adapter(store.as_uri(), run_id, "demo", repo_id, private=True, token=hub.token, endpoint=hub.url)
    assert (f"cannot publish to {repo_id}: the run's adapter is not the one it trained: runs/{run_id}/adapter/"
            f"adapter_model.safetensors changed after the run stored it: its sha256 was {sha256_hex(b'weights')} then "
            f"and is {sha256_hex(SWAPPED)} now") in str(refused.value)
    assert not refused.value.transient
    assert [c["title"] for c in hub.commits("model", repo_id)] == ["initial commit"]  # nothing published


def test_an_adapter_file_added_after_the_run_stored_it_is_not_published(hub: HubStandIn, tmp_path: Path) -> None:
    store = tmp_path / "store"
    run_id = stored_run(store)
    (store / "runs" / run_id / "adapter" / "adapter_model.bin").write_bytes(b"weights PEFT would load first")
    with pytest.raises(PublishError, match=rf"runs/{run_id}/adapter/adapter_model.bin was added after the run "
                                           "stored it"):
        publish_adapter(store.as_uri(), run_id, "demo", _repo_id("added"), private=True, token=hub.token,
                        endpoint=hub.url)


def test_the_job_outputs_hashes_pin_the_adapter_whatever_the_stored_result_says(hub: HubStandIn,
                                                                                 tmp_path: Path) -> None:
    store = tmp_path / "store"
    run_id = stored_run(store)
    swapped = ADAPTER_FILES | {"adapter_model.safetensors": SWAPPED}
    (store / "runs" / run_id / "adapter" / "adapter_model.safetensors").write_bytes(SWAPPED)
    (store / "runs" / run_id / "result.json").write_text(run_result(run_id, swapped).model_dump_json())  # covered up
    with pytest.raises(PublishError, match="adapter_model.safetensors changed after the run stored it"):
        publish_adapter(store.as_uri(), run_id, "demo", _repo_id("covered-up"), private=True, token=hub.token,
                        endpoint=hub.url, result=run_result(run_id, ADAPTER_FILES))


def test_on_a_hub_store_the_adapter_is_read_at_the_commit_the_run_made(hub: HubStandIn, tmp_path: Path) -> None:
    store_url = f"hf://datasets/acme/runs-{next(_runs)}"
    store = open_store(store_url, hub.token, endpoint=hub.url, cache_dir=tmp_path / "cache")
    run_id = stored_run(tmp_path, store=store)
    done_commit = hub.commits("dataset", store_url.removeprefix("hf://datasets/"))[0]["id"]
    store.put({f"runs/{run_id}/adapter/adapter_model.safetensors": SWAPPED}, message="swap")
    result = run_result(run_id, ADAPTER_FILES).model_copy(update={"revision": done_commit})  # the job's output
    repo_id = _repo_id("at-revision")
    publish_adapter(store_url, run_id, "demo", repo_id, private=True, token=hub.token, endpoint=hub.url,
                    result=result)
    weights = HfApi(endpoint=hub.url, token=hub.token).hf_hub_download(repo_id, "adapter_model.safetensors",
                                                                       cache_dir=tmp_path / "published")
    assert Path(weights).read_bytes() == b"weights"


def test_a_token_that_cannot_write_fails_publishing_naming_the_repo_and_the_fix(hub: HubStandIn,
                                                                                 tmp_path: Path) -> None:
    run_id = stored_run(tmp_path / "store")
    repo_id = _repo_id("not-writable")
    HfApi(endpoint=hub.url, token=hub.token).create_repo(repo_id)
    with pytest.raises(PublishError, match=rf"cannot publish to {repo_id}: the token cannot write to it \(HTTP 403") \
            as excinfo:
        publish_adapter((tmp_path / "store").as_uri(), run_id, "demo", repo_id, private=True,
                        token=hub.read_only_token, endpoint=hub.url)
    assert not excinfo.value.transient and "write access to 'acme'" in str(excinfo.value)
    assert len(hub.commits("model", repo_id)) == 1


def test_a_failed_publish_comes_back_as_its_reason_and_a_transient_one_is_retried(hub: HubStandIn,
                                                                                   tmp_path: Path) -> None:
    run_id = stored_run(tmp_path / "store")
    repo_id = _repo_id("flaky")
    HfApi(endpoint=hub.url, token=hub.token).create_repo(repo_id)
    hub.arm_commit_faults("model", repo_id, status=503)
    with pytest.raises(PublishError) as excinfo:
        publish_adapter((tmp_path / "store").as_uri(), run_id, "demo", repo_id, private=True, token=hub.token,
                        endpoint=hub.url)
    failed = Failed(data=excinfo.value)
    assert excinfo.value.transient and publish_adapter_task.retry_condition_fn(None, None, failed) is True
    refused = Failed(data=PublishError("cannot publish to acme/x: the token cannot write to it"))
    assert publish_adapter_task.retry_condition_fn(None, None, refused) is False
    outcome = published_or_failed(repo_id, Failed(data=excinfo.value))
    assert outcome.url is None and outcome.error == str(excinfo.value)
    done = PublishedModel(hub_model_id=repo_id, url="u")
    assert published_or_failed(repo_id, Completed(data=done)) == done


def test_publishing_without_a_token_is_refused_before_renting_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"publish.hub_model_id 'acme/x': publishing needs a Hugging Face token"):
        check_publish_token("acme/x", None)
    check_publish_token("acme/x", "hf_token")


@pytest.mark.parametrize("bad", ["acme", "acme/x/y", "acme/x--y", "acme/x.", "-acme/x"])
def test_a_malformed_hub_model_id_is_refused_by_the_spec(bad: str) -> None:
    with pytest.raises(ValueError, match="hub_model_id"):
        PublishSpec(hub_model_id=bad)


def test_the_summary_says_why_publishing_failed() -> None:
    metrics = TrainMetrics(steps=1, losses=[(1, 1.0)], first_loss=1.0, final_loss=1.0, tokens=1, wall_seconds=1.0,
                           device="cpu")
    report = RunReport(run_name="demo", run_id="r", model="acme/base", model_revision=None, gpu="RTX 4090",
                       gpu_count=1, endpoint_name="e", metrics=metrics, cost_ceiling_usd=1.0, estimated_cost_usd=0.1,
                       adapter_url="file:///s/runs/r/adapter", store_url="file:///s", published_model="acme/x",
                       publish_error="cannot publish to acme/x: the token cannot write to it (HTTP 403)\nmore")
    assert ("| Published model | `acme/x`: **not published** (cannot publish to acme/x: the token cannot write to it "
            "(HTTP 403) more); the run completed anyway |") in summary_markdown(report)


def test_a_dpo_card_names_the_method_its_settings_and_the_held_out_pairs_accuracy() -> None:
    card = model_card(facts(algorithm="dpo", dpo={"beta": 0.1, "loss_type": "sigmoid"},
                            metrics={"losses": [[1, 0.69], [3, 0.2]], "eval_reward_accuracies": [[0, 0.0], [3, 1.0]],
                                     "eval_reward_margins": [[0, 0.0], [3, 2.5]]}))
    assert "trained with DPO (preference tuning on chosen and rejected answers)" in card
    assert "| dpo.beta | `0.1` |" in card and "| dpo.loss_type | `sigmoid` |" in card
    assert "| eval reward accuracy | 0.0000 (step 0) | 1.0000 (step 3) |" in card
    assert "| eval reward margin | 0.0000 (step 0) | 2.5000 (step 3) |" in card
