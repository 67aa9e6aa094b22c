"""GRPO: a short CPU run on the tiny model learns a dense reward; the rewards; prompts; refused specs.

The run (module fixture) trains 20 steps of 8 prompts × 4 completions × 12 tokens with the built-in
`digit_fraction` reward, which the tiny model can learn in that many steps (a sparse reward cannot).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from peft import PeftModel
from pydantic import ValidationError
from transformers import AutoModelForCausalLM, AutoTokenizer

from loraflow_worker.artifacts import open_store
from loraflow_worker.contract import JobInput, RewardSpec
from loraflow_worker.contract.reward_names import BUILTIN_REWARD_PARAMS
from loraflow_worker.training.grpo import prompt_dataset, train_grpo, vllm_engine_settings
from loraflow_worker.artifacts.manifest import rows_sha256
from loraflow_worker.training.rewards import (
    BUILTIN_REWARDS,
    RewardError,
    check_reward_columns,
    digit_fraction,
    exact_match,
    format_reward,
    length_penalty,
    normalized_match,
    numeric_match,
    resolve_rewards,
)
from loraflow_worker.training.run import TrainOutcome
from loraflow_worker.self_test.tiny_model import DEFAULT_CORPUS

STEPS = 20


def _grpo_job(model_dir: Path, store_root: Path, run_id: str = "g", **grpo) -> dict:
    dataset_path = f"runs/{run_id}/dataset/train.jsonl"
    (store_root / dataset_path).parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(DEFAULT_CORPUS, store_root / dataset_path)
    return {
        "run_id": run_id,
        "algorithm": "grpo",
        "model": {"id": str(model_dir)},
        "dataset": {"store_path": dataset_path},
        "training": {"max_steps": STEPS, "learning_rate": 3e-2, "batch_size": 32, "seed": 42},
        "grpo": {"num_generations": 4, "max_completion_length": 12, "rewards": [{"name": "digit_fraction"}], **grpo},
        "artifact_store": store_root.as_uri(),
    }


@dataclass
class GrpoRun:
    job: JobInput
    outcome: TrainOutcome
    progress: list


@pytest.fixture(scope="module")
def grpo_run(tiny_model_dir, tmp_path_factory) -> GrpoRun:
    store_root = tmp_path_factory.mktemp("store")
    work_dir = tmp_path_factory.mktemp("work")
    job = JobInput.model_validate(_grpo_job(tiny_model_dir, store_root))
    progress: list = []
    outcome = train_grpo(job, open_store(job.artifact_store), work_dir, progress.append)
    return GrpoRun(job, outcome, progress)


def test_mean_reward_rises_over_the_run(grpo_run):
    rewards = [reward for _, reward in grpo_run.outcome.metrics.rewards]
    assert [step for step, _ in grpo_run.outcome.metrics.rewards] == list(range(1, STEPS + 1))
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.25, rewards


def test_metrics_describe_the_run(grpo_run):
    metrics = grpo_run.outcome.metrics
    assert metrics.steps == STEPS and metrics.device == "cpu"
    assert len(metrics.losses) == STEPS
    # Each step: 8 prompts of over 5 tokens each, 4 completions of up to 12 tokens.
    assert metrics.tokens > STEPS * 32 * 5
    assert [u.stage for u in grpo_run.progress][0] == "loading"
    assert grpo_run.progress[-1].step == STEPS


def test_training_progress_updates_carry_the_latest_mean_reward(grpo_run):
    training = [update for update in grpo_run.progress if update.stage == "training"]
    assert training and all(update.reward is not None for update in training)
    assert training[-1].reward == grpo_run.outcome.metrics.rewards[-1][1]


def test_adapter_loads_with_peft_and_changes_the_output(grpo_run, tiny_model_dir):
    adapter_dir = grpo_run.outcome.adapter_dir
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tiny_model_dir)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(adapter_dir)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of Peru?"}], add_generation_prompt=True,
        return_tensors="pt", return_dict=True,
    )["input_ids"]
    with torch.no_grad():
        base_logits = base(ids).logits
        tuned_logits = PeftModel.from_pretrained(base, adapter_dir)(ids).logits
    assert (tuned_logits - base_logits).abs().max() > 1e-2


def test_manifest_of_a_cpu_run_records_no_fast_path_and_the_data_hash(grpo_run):
    manifest = grpo_run.outcome.manifest
    assert manifest.job.algorithm == "grpo" and manifest.seed == 42
    assert manifest.fast_paths["vllm_colocate"].reason == "no CUDA device"
    assert all(not p.engaged and p.reason == "no CUDA device" for p in manifest.fast_paths.values())
    rows = [json.loads(line) for line in DEFAULT_CORPUS.read_text().splitlines() if line.strip()]
    assert manifest.dataset_sha256 == rows_sha256(rows)


def test_a_grpo_job_without_grpo_settings_is_refused_naming_the_field(tiny_model_dir, tmp_path):
    job = _grpo_job(tiny_model_dir, tmp_path)
    del job["grpo"]
    with pytest.raises(ValidationError, match="algorithm is 'grpo' but `grpo` is not set: add a `grpo` section"):
        JobInput.model_validate(job)


def test_grpo_settings_on_an_sft_job_are_refused_with_the_fix(tiny_model_dir, tmp_path):
    job = _grpo_job(tiny_model_dir, tmp_path) | {"algorithm": "sft"}
    with pytest.raises(ValidationError, match="`grpo` is set but algorithm is 'sft': remove the `grpo` section or set algorithm to 'grpo'"):
        JobInput.model_validate(job)


def test_a_batch_that_splits_a_prompt_group_is_refused_with_both_values(tiny_model_dir, tmp_path):
    job = _grpo_job(tiny_model_dir, tmp_path, num_generations=3)
    with pytest.raises(ValidationError, match=r"\(32 × 1 = 32 completions per step\) must be a multiple of `grpo.num_generations` \(3\)"):
        JobInput.model_validate(job)


def test_a_single_generation_per_prompt_is_refused_naming_the_field(tiny_model_dir, tmp_path):
    with pytest.raises(ValidationError) as refused:
        JobInput.model_validate(_grpo_job(tiny_model_dir, tmp_path, num_generations=1))
    assert refused.value.errors()[0]["loc"] == ("grpo", "num_generations")


def test_reward_entries_are_checked_against_the_built_ins(tiny_model_dir, tmp_path):
    cases = {
        "exact_match": ("reward `exact_match` needs `column`", {}),
        "digit_fraction": ("reward `digit_fraction` takes no parameters, not `pattern`", {"pattern": "x"}),
        "my_rewards:score": ("user reward `my_rewards:score` takes no `column`", {"column": "answer"}),
        "no_such_reward": ("unknown reward `no_such_reward`: use one of digit_fraction, exact_match, format,", {}),
        "format": ("`pattern` '(unclosed' is not a valid regular expression", {"pattern": "(unclosed"}),
    }
    for name, (message, params) in cases.items():
        with pytest.raises(ValidationError) as refused:
            JobInput.model_validate(_grpo_job(tiny_model_dir, tmp_path, rewards=[{"name": name, **params}]))
        assert refused.value.errors()[0]["loc"] == ("grpo", "rewards", 0), name
        assert message in str(refused.value), name


def test_every_builtin_reward_in_the_contract_has_an_implementation():
    assert set(BUILTIN_REWARDS) == set(BUILTIN_REWARD_PARAMS)


def test_match_rewards_compare_the_final_answer_with_the_reference_column():
    completions = ["The answer is Paris.", "  Paris ", "berlin"]
    assert exact_match(completions, column="answer", answer=["Paris"] * 3) == [0.0, 1.0, 0.0]
    assert exact_match(completions, column="answer", pattern=r"answer is (\w+)", answer=["Paris"] * 3) == [1.0, 0.0, 0.0]
    assert normalized_match(["The Paris!", "a paris", "Rome"], column="answer", answer=["paris"] * 3) == [1.0, 1.0, 0.0]


def test_numeric_match_reads_the_last_numbers_of_completion_and_reference():
    completions = ["so 3 + 4 = 7", "total: 1,234.0 apples", "no idea", "7.0000001"]
    references = ["Natalia sold 3 + 4 clips.\n#### 7", "1234", "7", "#### 7"]
    assert numeric_match(completions, column="solution", solution=references) == [1.0, 1.0, 0.0, 1.0]
    assert numeric_match(["7.5"], column="a", a=["7"], tolerance=0.1) == [0.0]


def test_format_length_and_digit_rewards():
    chat = [[{"role": "assistant", "content": "<think>hm</think> 42"}], [{"role": "assistant", "content": "42"}]]
    assert format_reward(chat, pattern=r"^<think>.*</think>") == [1.0, 0.0]
    assert length_penalty([[1] * 4, [1] * 6, [1] * 100], target_length=4) == [0.0, -0.5, -1.0]
    assert digit_fraction(["12ab", "   ", "9 9"]) == [0.5, 0.0, 1.0]


def test_rewards_resolve_through_the_built_ins_or_an_importable_function():
    specs = [
        RewardSpec(name="exact_match", column="answer", weight=2.0),
        RewardSpec(name="loraflow_worker.training.rewards:digit_fraction", weight=0.5),
    ]
    functions, weights = resolve_rewards(specs)
    assert weights == [2.0, 0.5]
    assert functions[0](["x"], answer=["x"]) == [1.0]
    assert functions[1] is digit_fraction


def test_a_user_reward_that_cannot_be_imported_names_the_fix():
    with pytest.raises(RewardError, match=r"module `no_such_pkg.scoring` cannot be imported on the worker .*extra_packages"):
        resolve_rewards([RewardSpec(name="no_such_pkg.scoring:score")])
    with pytest.raises(RewardError, match=r"`nothing_here` does not exist in module `loraflow_worker.training.rewards`"):
        resolve_rewards([RewardSpec(name="loraflow_worker.training.rewards:nothing_here")])


def test_a_reward_reading_a_missing_column_fails_before_training():
    with pytest.raises(RewardError, match=r"reads column `solution`.* its columns are `prompt`, `answer`: set `column`"):
        check_reward_columns([RewardSpec(name="numeric_match", column="solution")], ["prompt", "answer"])


def test_chat_rows_become_prompts_without_the_last_assistant_turn(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = Dataset.from_list([
        {"messages": [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris."}]},
        {"messages": [{"role": "user", "content": "Say hi."}]},
    ])
    prompts = prompt_dataset(rows, tokenizer, max_prompt_length=64)
    assert prompts.column_names == ["prompt", "answer"]
    assert prompts[0] == {"prompt": [{"role": "user", "content": "Capital of France?"}], "answer": "Paris."}
    assert prompts[1]["answer"] == ""


def test_prompts_longer_than_the_limit_are_left_out(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = Dataset.from_list([{"prompt": "short"}, {"prompt": "a much longer prompt " * 20}])
    assert prompt_dataset(rows, tokenizer, max_prompt_length=16)["prompt"] == ["short"]
    with pytest.raises(ValueError, match=r"all 2 prompts are longer than `grpo.max_prompt_length` \(1 tokens\): raise it"):
        prompt_dataset(rows, tokenizer, max_prompt_length=1)


def test_a_dataset_without_prompts_is_refused_naming_its_columns(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    with pytest.raises(ValueError, match=r"needs a `prompt` column .* this one has `text`"):
        prompt_dataset(Dataset.from_list([{"text": "hello"}]), tokenizer, max_prompt_length=16)


def test_the_colocated_vllm_engine_is_built_without_image_or_video_inputs_and_with_the_runs_seed(monkeypatch):
    # vLLM is not installed here: a recorder stands in for the `LLM` TRL's generation module builds its engine with.
    from trl.generation import vllm_generation

    built = []
    monkeypatch.setattr(vllm_generation, "LLM", lambda **kwargs: built.append(kwargs), raising=False)
    recorder = vllm_generation.LLM
    with vllm_engine_settings(seed=7):
        # TRL 1.16 passes its process index as the seed (`VLLMGeneration._init_vllm`): 0 on one GPU.
        vllm_generation.LLM(model="/models/qwen3.5", gpu_memory_utilization=0.2, seed=0)
    assert built == [{"limit_mm_per_prompt": {"image": 0, "video": 0}, "model": "/models/qwen3.5",
                      "gpu_memory_utilization": 0.2, "seed": 7}]
    assert vllm_generation.LLM is recorder  # restored once the trainer is built
