"""GRPO with a colocated vLLM engine, on the CPU: weights sent as merged temporaries that leave a bf16 base
bit-identical however many syncs (where TRL's merge and unmerge drift it), one weight sync per generation round however
many tool turns or evaluation batches it takes, an engine seeded from the run's seed, and a run that goes on with
transformers' generate when the engine cannot be built, loaded or generate (or fails, when the job demands vLLM).

vLLM cannot run here, so two things stand in for what only a GPU gives (test code only):
- the plan: `grpo.plan_fast_paths` plans as on a GPU where vLLM fits (colocate, sleep mode), the CPU plan otherwise;
- for the sync tests, the engine: `StandInEngine` takes the place of `vllm.LLM` where TRL's `VLLMGeneration` builds
  and calls it, and holds TRL to vLLM's sleep-mode rules (generate only with the weights loaded since the last level-2
  sleep and awake, no wake of what is awake);
- for the 200-sync tests, the receiver: a list takes what vLLM's `load_weights` would.
Everything between is real: the worker's `train_grpo`, TRL 1.16's `GRPOTrainer` and `VLLMGeneration` (its
construction, its `sync_weights` with PEFT's merge and unmerge, its `generate`, its tool loop). What only a GPU run
shows: that vLLM 0.33 itself builds, sleeps, wakes and loads weights as the stand-in assumes (the GPU smoke's
`tools-grpo` variant and the self test on a GPU check the counts there).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from loraflow_worker.artifacts import open_store
from loraflow_worker.artifacts.manifest import FastPath
from loraflow_worker.contract import JobInput
from loraflow_worker.self_test import tool_use
from loraflow_worker.training import grpo
from loraflow_worker.training.grpo import train_grpo
from loraflow_worker.training.vllm_colocate import VllmRequired, merged_weights, vllm_engine_kwargs

STEPS = 2
DISTRIBUTED_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
TRL_NO_VLLM = "ImportError: vLLM is not available and `use_vllm` is set to True"
"""What TRL 1.16 raises building the engine where vLLM does not import (`VLLMGeneration._init_vllm`)."""


@pytest.fixture(autouse=True)
def distributed_env_kept():
    """TRL sets these for vLLM's launcher while it builds the engine and leaves them: later tests must not see them."""
    before = {name: os.environ.get(name) for name in DISTRIBUTED_ENV}
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture
def planned_as_on_a_gpu(monkeypatch):
    """The worker's plan as a GPU where vLLM fits would make it: the CPU plan with vLLM colocated in sleep mode."""
    plan_fast_paths = grpo.plan_fast_paths

    def planned(facts):
        # The job's demand is checked against this plan, not the CPU's (which never colocates).
        plan = plan_fast_paths(dataclasses.replace(facts, required=frozenset()))
        plan.fast_paths["vllm_colocate"] = FastPath(engaged=True, reason="planned as on a GPU (test)")
        plan.trainer_kwargs.update(use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=True,
                                   vllm_gpu_memory_utilization=0.3)
        return plan

    monkeypatch.setattr(grpo, "plan_fast_paths", planned)


def _job(model_dir: Path, store_root: Path, run_id: str, *, tools: bool = False, rows: int = 8,
         **overrides) -> JobInput:
    def stored(path: str, text: str) -> str:
        (store_root / path).parent.mkdir(parents=True, exist_ok=True)
        (store_root / path).write_text(text)
        return path

    rows = tool_use.prompt_rows() if tools else [{"prompt": [{"role": "user", "content": f"Count to {n}."}]}
                                                  for n in range(rows)]
    settings = {"num_generations": 4, "max_completion_length": 480,
                "rewards": [{"name": "reward.py:receipt",
                             "store_path": stored(f"runs/{run_id}/rewards/reward.py", tool_use.REWARD_SOURCE)}]}
    if tools:
        settings |= {"tools": "tools.py", "max_tool_calls": 2,
                     "tools_store_path": stored(f"runs/{run_id}/tools/tools.py", tool_use.TOOLS_SOURCE)}
    return JobInput.model_validate({
        "run_id": run_id, "algorithm": "grpo", "model": {"id": str(model_dir)},
        "dataset": {"store_path": stored(f"runs/{run_id}/dataset/train.jsonl", tool_use.jsonl(rows))},
        "training": {"max_steps": STEPS, "learning_rate": 1e-3, "batch_size": 8, "seed": 3},
        "grpo": settings, "artifact_store": store_root.as_uri(), **overrides})


def _train(job: JobInput, work_dir: Path, progress: list | None = None):
    return train_grpo(job, open_store(job.artifact_store), work_dir, (progress if progress is not None else []).append)


class StandInEngine:
    """Stands in for `vllm.LLM` where TRL 1.16 uses it in colocate mode: built with TRL's arguments, asleep (level 2
    discards the weights) and awake by tags, loading weights through `llm_engine.model_executor.driver_worker.
    model_runner.model.load_weights`, generating from token ids. It calls the tool `record` (`tool_use`) in its first
    `calls` turns and then answers, and counts weight syncs (passes over the weights) and generate calls."""

    def __init__(self, tokenizer, calls: int, **kwargs):
        self.tokenizer, self.calls = tokenizer, calls
        self.built_with = kwargs
        self.weights_awake = self.kv_awake = True
        self.loaded = False  # the weights loaded since the last level-2 sleep
        self.first_name: str | None = None
        self.syncs = 0
        self.generate_calls = 0
        self.levels: list[int] = []
        runner = SimpleNamespace(model=SimpleNamespace(load_weights=self._load_weights))
        executor = SimpleNamespace(driver_worker=SimpleNamespace(model_runner=runner))
        self.llm_engine = SimpleNamespace(model_executor=executor,
                                          model_config=SimpleNamespace(max_model_len=kwargs["max_model_len"]))

    def sleep(self, level: int) -> None:
        assert level in (1, 2)
        self.weights_awake = self.kv_awake = False
        self.loaded = self.loaded and level == 1  # level 1 keeps the weights in host memory, level 2 discards them
        self.levels.append(level)

    def wake_up(self, tags: list[str]) -> None:
        for tag in tags:
            awake = {"weights": self.weights_awake, "kv_cache": self.kv_awake}[tag]
            assert not awake, f"woke vLLM's {tag}, which were awake"
        self.weights_awake = self.weights_awake or "weights" in tags
        self.kv_awake = self.kv_awake or "kv_cache" in tags

    def _load_weights(self, weights) -> None:
        assert self.weights_awake, "loaded weights into vLLM while they slept"
        ((name, _),) = weights
        self.first_name = self.first_name or name
        self.syncs += name == self.first_name
        self.loaded = True

    def reset_prefix_cache(self) -> None:
        pass

    def generate(self, prompts, sampling_params, use_tqdm):
        assert self.loaded and self.weights_awake and self.kv_awake, "generated with vLLM's weights or KV cache asleep"
        self.generate_calls += 1
        outputs = []
        for prompt in prompts:
            text = self.tokenizer.decode(prompt["prompt_token_ids"])
            item = re.findall(r"Record (\w+)\.", text)[-1] if "Record " in text else "fig"
            calls = "<tools>" in text and text.count("receipt ") < self.calls  # a prompt with tools, calls left
            answer = tool_use._call(item) if calls else "Done."
            ids = self.tokenizer.encode(answer + "<|im_end|>", add_special_tokens=False)
            logprobs = [{token: SimpleNamespace(rank=1, logprob=-1.0)} for token in ids]
            outputs.append(SimpleNamespace(prompt_token_ids=prompt["prompt_token_ids"],
                                           outputs=[SimpleNamespace(token_ids=ids, logprobs=logprobs)]))
        return outputs


@pytest.fixture
def stand_in_engine(monkeypatch, planned_as_on_a_gpu, tiny_model_dir):
    """vLLM importable as far as TRL's generation module asks, its `LLM` the stand-in; the engines built, listed."""
    from transformers import AutoTokenizer
    from trl.generation import vllm_generation

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    built: list[StandInEngine] = []

    def engine(**kwargs):
        built.append(StandInEngine(tokenizer, calls=2, **kwargs))
        return built[-1]

    monkeypatch.setattr(vllm_generation, "is_vllm_available", lambda *args, **kwargs: True)
    monkeypatch.setattr(vllm_generation, "LLM", engine, raising=False)
    monkeypatch.setattr(vllm_generation, "SamplingParams", lambda **kwargs: kwargs, raising=False)
    return built


@pytest.fixture
def ledger(monkeypatch, tmp_path) -> Path:
    path = tmp_path / "ledger.txt"
    monkeypatch.setenv(tool_use.LEDGER_ENV, str(path))
    return path


@pytest.mark.timeout(600)
def test_a_tool_round_syncs_the_weights_into_vllm_once_however_many_turns_it_takes(
        stand_in_engine, ledger, tiny_model_dir, tmp_path):
    outcome = _train(_job(tiny_model_dir, tmp_path / "store", "tool-syncs", tools=True), tmp_path / "work")
    (engine,) = stand_in_engine
    syncs = outcome.manifest.vllm_weight_syncs
    # Each round: the prompt's turn, then one turn after each of the two tool calls (TRL 1.16 alone syncs all three).
    assert syncs.generate_calls_per_step == {step: 3 for step in range(1, STEPS + 1)}
    assert syncs.per_step == {step: 1 for step in range(1, STEPS + 1)}
    assert engine.generate_calls == 3 * STEPS and len(ledger.read_text().split()) == 2 * 8 * STEPS
    assert engine.syncs == STEPS + 1  # and the check before training: the first sync fails there, if it fails
    assert outcome.manifest.fast_paths["vllm_colocate"] == FastPath(engaged=True, reason="planned as on a GPU (test)")


@pytest.mark.timeout(600)
def test_vllm_sleeps_between_rounds_and_is_built_for_text_only_seeded_with_the_runs_seed(
        stand_in_engine, ledger, tiny_model_dir, tmp_path):
    _train(_job(tiny_model_dir, tmp_path / "store", "tool-sleep", tools=True), tmp_path / "work")
    (engine,) = stand_in_engine
    assert not (engine.weights_awake or engine.kv_awake)  # the memory is training's between rounds
    assert engine.built_with["enable_sleep_mode"] is True
    assert engine.built_with["limit_mm_per_prompt"] == {"image": 0, "video": 0}
    assert engine.built_with["seed"] == 3  # the job's training.seed; TRL alone passes 0 (its process index)


def test_the_engine_is_seeded_from_training_seed_and_takes_no_images():
    assert vllm_engine_kwargs(1234) == {"seed": 1234, "limit_mm_per_prompt": {"image": 0, "video": 0}}


@pytest.mark.timeout(600)
def test_a_round_without_tools_syncs_once_too(stand_in_engine, tiny_model_dir, tmp_path):
    outcome = _train(_job(tiny_model_dir, tmp_path / "store", "plain-syncs"), tmp_path / "work")
    syncs = outcome.manifest.vllm_weight_syncs
    assert syncs.per_step == syncs.generate_calls_per_step == {step: 1 for step in range(1, STEPS + 1)}


@pytest.mark.timeout(600)
def test_an_evaluation_syncs_once_however_many_batches_it_takes_and_is_counted_apart_from_the_steps(
        stand_in_engine, tiny_model_dir, tmp_path):
    # 20 prompts, 8 held out: each evaluation generates for 8 prompts in 2 batches of 4 (the micro-batch).
    job = _job(tiny_model_dir, tmp_path / "store", "eval-syncs", rows=20, memory={"micro_batch_size": 4},
               evaluation={"fraction": 0.4, "every_steps": 1})
    syncs = _train(job, tmp_path / "work").manifest.vllm_weight_syncs
    (engine,) = stand_in_engine
    # Before the first step, after the first and after the last: one sync each (TRL alone: one per batch).
    assert syncs.evaluation_syncs == 3
    assert syncs.per_step == {step: 1 for step in range(1, STEPS + 1)}
    assert engine.syncs == 1 + STEPS + 3  # with the check before training
    # Between an evaluation's batches vLLM keeps the step's weights in host memory (level 1); a training round ends
    # at level 2, as TRL's does.
    assert engine.levels.count(1) == 3 * 2 and engine.levels[-1] == 1


@pytest.mark.timeout(600)
def test_an_engine_that_cannot_be_built_leaves_the_run_to_transformers_generate_saying_why(
        planned_as_on_a_gpu, tiny_model_dir, tmp_path):
    # vLLM is not installed here: TRL's own engine construction refuses, as it would where vLLM does not import.
    progress: list = []
    outcome = _train(_job(tiny_model_dir, tmp_path / "store", "no-engine"), tmp_path / "work", progress)
    assert outcome.metrics.steps == STEPS
    vllm = outcome.manifest.fast_paths["vllm_colocate"]
    assert not vllm.engaged and vllm.reason.startswith(f"failed: {TRL_NO_VLLM}"), vllm.reason
    assert vllm.reason.endswith("; completions come from transformers' generate (slower)")
    assert outcome.manifest.vllm_weight_syncs is None
    said = [update.message for update in progress if update.message.startswith("vllm_colocate: failed: ")]
    assert said == [f"vllm_colocate: {vllm.reason}"]
    assert not any(name in os.environ for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))  # as before the engine


@pytest.mark.timeout(600)
def test_the_manifest_stored_with_the_run_says_the_engine_failed(planned_as_on_a_gpu, tiny_model_dir, tmp_path):
    from worker_test_support import CountingStore, train_in_process

    store = CountingStore(tmp_path / "store")
    job = _job(tiny_model_dir, store.root, "no-engine-stored")
    train_in_process({"input": job.model_dump(mode="json")}, store, tmp_path / "work", [])
    manifest = json.loads((store.root / "runs/no-engine-stored/manifest.json").read_text())
    assert manifest["fast_paths"]["vllm_colocate"]["reason"].startswith(f"failed: {TRL_NO_VLLM}")


@pytest.mark.timeout(600)
def test_a_job_that_requires_vllm_fails_naming_the_setting_when_the_engine_cannot_be_built(
        planned_as_on_a_gpu, tiny_model_dir, tmp_path):
    job = _job(tiny_model_dir, tmp_path / "store", "must-vllm", fast_paths={"vllm_colocate": "require"})
    with pytest.raises(VllmRequired, match=re.escape(
            f"`fast_paths.vllm_colocate` is 'require', and the colocated vLLM engine could not be used: {TRL_NO_VLLM}")):
        _train(job, tmp_path / "work")


@pytest.mark.timeout(600)
def test_a_job_that_requires_vllm_fails_before_loading_the_model_where_vllm_is_not_planned(tiny_model_dir, tmp_path):
    job = _job(tiny_model_dir, tmp_path / "store", "must-vllm-cpu", fast_paths={"vllm_colocate": "require"})
    with pytest.raises(ValueError, match=r"`fast_paths.vllm_colocate` is 'require', but it is not used for this run: "
                                         r"no CUDA device"):
        _train(job, tmp_path / "work")


@pytest.mark.timeout(600)
def test_a_first_weight_sync_that_fails_leaves_the_run_to_transformers_generate(
        stand_in_engine, monkeypatch, tiny_model_dir, tmp_path):
    # As if vLLM had moved the internals TRL loads weights through (`llm_engine.model_executor...`).
    from trl.generation import vllm_generation

    build = vllm_generation.LLM

    def moved(**kwargs):
        engine = build(**kwargs)
        engine.llm_engine = SimpleNamespace(model_config=engine.llm_engine.model_config)
        return engine

    monkeypatch.setattr(vllm_generation, "LLM", moved)
    outcome = _train(_job(tiny_model_dir, tmp_path / "store", "no-sync"), tmp_path / "work")
    vllm = outcome.manifest.fast_paths["vllm_colocate"]
    assert vllm.reason.startswith("failed: AttributeError: 'types.SimpleNamespace' object has no attribute "
                                  "'model_executor'"), vllm.reason
    assert outcome.metrics.steps == STEPS and outcome.manifest.vllm_weight_syncs is None
    (engine,) = stand_in_engine
    assert not engine.weights_awake  # what the failed engine held is given back before training


def test_the_self_test_fails_a_grpo_job_whose_colocated_vllm_failed(capsys):
    from loraflow_worker.self_test.__main__ import _check_vllm

    reason = f"failed: {TRL_NO_VLLM}; completions come from transformers' generate (slower)"
    with pytest.raises(RuntimeError, match=r"the grpo job's colocated vLLM engine failed \(the job went on with "
                                           r"transformers' generate\): failed: ImportError"):
        _check_vllm("grpo", {"fast_paths": {"vllm_colocate": {"engaged": False, "reason": reason}}})
    assert capsys.readouterr().out == f"grpo job: vllm_colocate off ({reason})\n"


def test_the_self_test_fails_a_grpo_job_that_synced_per_tool_turn(capsys):
    from loraflow_worker.self_test.__main__ import _check_vllm

    manifest = {"fast_paths": {"vllm_colocate": {"engaged": True, "reason": "colocated"}},
                "vllm_weight_syncs": {"per_step": {"1": 1, "2": 3}, "generate_calls_per_step": {"1": 2, "2": 3}}}
    with pytest.raises(RuntimeError, match=r"synced its weights into vLLM other than once per step"):
        _check_vllm("grpo-tools", manifest)
    assert "weight syncs per step {'1': 1, '2': 3}, vLLM generate calls per step" in capsys.readouterr().out


@pytest.mark.timeout(600)
def test_a_vllm_generate_that_fails_during_training_leaves_the_rest_to_transformers_generate_saying_where(
        stand_in_engine, monkeypatch, tiny_model_dir, tmp_path):
    _engine_failing_on_its_second_generate(monkeypatch, RuntimeError("EngineCore encountered an issue"))
    progress: list = []
    outcome = _train(_job(tiny_model_dir, tmp_path / "store", "dies-mid-run"), tmp_path / "work", progress)
    assert outcome.metrics.steps == STEPS
    reason = ("failed: RuntimeError: EngineCore encountered an issue at step 2; completions from then on come from "
              "transformers' generate (slower)")
    assert outcome.manifest.fast_paths["vllm_colocate"] == FastPath(engaged=False, reason=reason)
    assert [update.message for update in progress if "vllm_colocate" in update.message] == [f"vllm_colocate: {reason}"]
    syncs = outcome.manifest.vllm_weight_syncs  # what vLLM did before it failed
    assert syncs.per_step == {1: 1, 2: 1} and syncs.generate_calls_per_step == {1: 1}
    (engine,) = stand_in_engine
    assert not (engine.weights_awake or engine.kv_awake)  # what the failed engine held is given back to training


@pytest.mark.timeout(600)
def test_a_weight_sync_that_fails_during_training_leaves_the_rest_to_transformers_generate_and_vllm_asleep(
        stand_in_engine, monkeypatch, tiny_model_dir, tmp_path):
    from trl.generation import vllm_generation

    build = vllm_generation.LLM

    def failing(**kwargs):  # the check before training loads the weights; the first round's sync fails
        engine = build(**kwargs)
        load = engine.llm_engine.model_executor.driver_worker.model_runner.model.load_weights

        def load_once(weights):
            if engine.syncs and engine.first_name == weights[0][0]:
                raise RuntimeError("weight loader moved")
            load(weights)

        engine.llm_engine.model_executor.driver_worker.model_runner.model.load_weights = load_once
        return engine

    monkeypatch.setattr(vllm_generation, "LLM", failing)
    outcome = _train(_job(tiny_model_dir, tmp_path / "store", "sync-dies-mid-run"), tmp_path / "work")
    assert outcome.metrics.steps == STEPS
    assert outcome.manifest.fast_paths["vllm_colocate"].reason.startswith(
        "failed: RuntimeError: weight loader moved at step 1; completions from then on come from transformers'")
    (engine,) = stand_in_engine
    assert not (engine.weights_awake or engine.kv_awake)  # woken for the sync that failed, put back to sleep


@pytest.mark.timeout(600)
def test_a_vllm_generate_that_fails_during_training_fails_a_job_that_requires_vllm(
        stand_in_engine, monkeypatch, tiny_model_dir, tmp_path):
    _engine_failing_on_its_second_generate(monkeypatch, RuntimeError("EngineCore encountered an issue"))
    job = _job(tiny_model_dir, tmp_path / "store", "must-vllm-mid-run", fast_paths={"vllm_colocate": "require"})
    with pytest.raises(VllmRequired, match=re.escape(
            "`fast_paths.vllm_colocate` is 'require', and the colocated vLLM engine failed at step 2: RuntimeError: "
            "EngineCore encountered an issue.")):
        _train(job, tmp_path / "work")


@pytest.mark.timeout(600)
def test_a_vllm_generate_that_runs_out_of_memory_fails_the_run_for_the_memory_ladder(
        stand_in_engine, monkeypatch, tiny_model_dir, tmp_path):
    _engine_failing_on_its_second_generate(monkeypatch, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    with pytest.raises(torch.OutOfMemoryError):
        _train(_job(tiny_model_dir, tmp_path / "store", "oom-mid-run"), tmp_path / "work")


def _engine_failing_on_its_second_generate(monkeypatch, error: Exception) -> None:
    """The stand-in engine, generating once and then raising `error`, as a vLLM engine that died mid-run would."""
    from trl.generation import vllm_generation

    build = vllm_generation.LLM

    def failing(**kwargs):
        engine = build(**kwargs)
        generate = engine.generate

        def generate_once(*args, **kwargs):
            if engine.generate_calls:
                raise error
            return generate(*args, **kwargs)

        engine.generate = generate_once
        return engine

    monkeypatch.setattr(vllm_generation, "LLM", failing)


@pytest.fixture(scope="module")
def bf16_adapters(tiny_model_dir):
    """The tiny model in bf16 (as on a GPU) with a trained-looking LoRA and DoRA adapter each (B and the magnitude
    moved from their start, so that merging changes every adapted weight); the adapters in fp32, as PEFT keeps them."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)  # as the worker runs on a CPU (`run.use_device`): small matrices, no thread to wait on
    adapted = {}
    for kind in ("lora", "dora"):
        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
        model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear",
                                                use_dora=kind == "dora"))
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "lora_B" in name:
                    parameter.normal_(0, 0.05)
                elif "lora_magnitude_vector" in name:
                    parameter.mul_(1 + 0.05 * torch.randn_like(parameter))
        adapted[kind] = model
    return adapted


def _base(model) -> dict[str, torch.Tensor]:
    return {name: parameter.detach().clone() for name, parameter in model.named_parameters() if "lora_" not in name}


def _trl_sync_weights(model):
    """TRL 1.16's own sync source (`VLLMGeneration._iter_named_params`: merge, read, unmerge) for `model` on one
    process, without the engine it feeds."""
    from trl.generation.vllm_generation import VLLMGeneration

    generation = object.__new__(VLLMGeneration)  # vLLM is not installed: its construction would refuse
    generation.model = model
    generation._dist = SimpleNamespace(is_fsdp=False, gather_params=lambda parameters: contextlib.nullcontext())
    return generation._iter_named_params()


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_200_syncs_of_the_worker_leave_a_bf16_base_bit_identical(bf16_adapters, kind):
    model = bf16_adapters[kind]
    before = _base(model)
    assert {tensor.dtype for tensor in before.values()} == {torch.bfloat16}
    received: list = []  # what vLLM's `load_weights` would take
    for _ in range(200):
        received = list(merged_weights(model))
    after = _base(model)
    assert all(torch.equal(after[name], before[name]) for name in before)
    assert len(received) == len([name for name in before if "original_module" not in name])


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_the_worker_sends_vllm_the_weights_merge_and_unload_makes_under_trls_names(bf16_adapters, kind):
    model = bf16_adapters[kind]
    sent = list(merged_weights(model))
    assert [name for name, _ in sent] == [name for name, _ in _trl_sync_weights(copy.deepcopy(model))]
    merged = dict(copy.deepcopy(model).merge_and_unload().named_parameters())
    assert sent and sorted(name for name, _ in sent) == sorted(merged)
    for name, tensor in sent:
        assert tensor.dtype == merged[name].dtype == torch.bfloat16
        torch.testing.assert_close(tensor, merged[name])  # bf16's tolerance
    base = {name.removeprefix("base_model.model.").replace(".base_layer", ""): tensor
            for name, tensor in _base(model).items()}
    assert any(not torch.equal(tensor, base[name]) for name, tensor in sent), "no weight had the adapter merged in"


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_trls_own_merge_and_unmerge_sync_drifts_a_bf16_base(bf16_adapters, kind):
    # What the worker's sync replaces: the test above would fail on it.
    model = copy.deepcopy(bf16_adapters[kind])
    before = _base(model)
    for _ in range(200):
        for _ in _trl_sync_weights(model):
            pass
    after = _base(model)
    changed = sum(int((after[name] != before[name]).sum()) for name in before)
    adapted_values = sum(tensor.numel() for name, tensor in before.items() if "base_layer" in name)
    assert changed / adapted_values > 0.05, f"{changed} of {adapted_values} adapted base values changed"
