"""Task evaluations answered by vLLM where it runs, transformers otherwise: the choice (no CUDA device, vLLM not
installed, a 4-bit base, an adapter vLLM's LoRA loader refuses, an engine that cannot be built), one engine for the
base and every adapter as a LoRA request, answers equal to transformers' on the same greedy task, the deadline
between batches, the engine shut down on leaving, and the rules vLLM 0.33 holds an adapter's config to.

vLLM cannot run here (no GPU), so in this module only a stand-in takes its place: `vllm` is a package of `LLM`,
`SamplingParams`, `TokensPrompt` and `lora.request.LoRARequest` whose engine generates with transformers and PEFT on
the tiny model, so its answers are real, and which holds the worker to vLLM's rules: LoRA ids from 1, one id per
adapter; a LoRA request only with `enable_lora`, of a rank within `max_lora_rank`, no more adapters than
`max_loras`; the adapter config checks of vLLM's loader; a prompt and its `max_tokens` within `max_model_len`; only the
arguments vLLM 0.33 takes. CUDA is simulated by naming the device ("cuda") and by the free memory torch reports. What
only a GPU shows, vLLM itself answering, is the GPU smoke's `task-eval` check."""

from __future__ import annotations

import dataclasses
import importlib.machinery
import json
import sys
import time
import types
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from worker_test_support import CAPITAL_QUESTIONS, taught_adapter

from loraflow_worker.artifacts import FileStore
from loraflow_worker.contract.task_evaluation import TaskEvaluation
from loraflow_worker.evaluation import answering
from loraflow_worker.evaluation.answering import EvaluationDeadline
from loraflow_worker.evaluation.tasks import AnsweringAdapter, TaskResults, evaluate_task, prepare_tasks
from loraflow_worker.evaluation.vllm_answering import gpu_memory_share, open_answerer, vllm_sampling, why_not_vllm
from loraflow_worker.evaluation.vllm_lora import max_lora_rank, vllm_refusals

GIB = 1024**3
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
PHRASE = "The capital of France is Paris."


# --- the stand-in vLLM (test code only) ------------------------------------------------------------------------------

class LoRARequest:
    """vLLM 0.33's `LoRARequest`: a name, an integer id from 1, a path."""

    def __init__(self, lora_name: str, lora_int_id: int, lora_path: str = "") -> None:
        if lora_int_id < 1:
            raise ValueError(f"id must be > 0, got {lora_int_id}")
        assert lora_path, "lora_path cannot be empty"
        self.lora_name, self.lora_int_id, self.lora_path = lora_name, lora_int_id, lora_path


@dataclasses.dataclass
class SamplingParams:
    """vLLM 0.33's `SamplingParams`, as far as the worker sets it: an argument it does not have is a TypeError."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None


def TokensPrompt(*, prompt_token_ids: list[int]) -> dict:  # noqa: N802 - vLLM's name (a TypedDict)
    return {"prompt_token_ids": prompt_token_ids}


class StandInLLM:
    """Takes `vllm.LLM`'s place: built with the worker's arguments (checked against vLLM 0.33's), loading adapters
    as vLLM's LoRA loader does, generating each request with transformers and PEFT (CPU, float32) the way vLLM's
    sampling parameters say."""

    built: list[StandInLLM] = []
    fail_with: Exception | None = None

    def __init__(self, model: str, *, dtype: str = "auto", seed: int = 0, gpu_memory_utilization: float = 0.92,
                 max_model_len: int | None = None, enforce_eager: bool = False, enable_lora: bool = False,
                 max_loras: int = 1, max_lora_rank: int = 16, limit_mm_per_prompt: dict | None = None) -> None:
        if StandInLLM.fail_with is not None:
            raise StandInLLM.fail_with
        from transformers import AutoModelForCausalLM

        assert max_lora_rank in VLLM_RANKS, f"max_lora_rank {max_lora_rank} is not one vLLM accepts"
        assert 0 < gpu_memory_utilization <= 1 and max_loras >= 1
        self.kwargs = dict(dtype=dtype, seed=seed, gpu_memory_utilization=gpu_memory_utilization,
                           max_model_len=max_model_len, enforce_eager=enforce_eager, enable_lora=enable_lora,
                           max_loras=max_loras, max_lora_rank=max_lora_rank, limit_mm_per_prompt=limit_mm_per_prompt)
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        assert max_model_len is not None and max_model_len <= self.model.config.max_position_embeddings
        self.eos = self.model.generation_config.eos_token_id
        self.loras: dict[int, tuple[str, str]] = {}
        self.generate_calls: list[tuple[int, str | None]] = []
        self.shut_down = False
        self.llm_engine = types.SimpleNamespace(add_lora=self._add_lora,
                                                engine_core=types.SimpleNamespace(shutdown=self._shutdown))
        StandInLLM.built.append(self)

    def _shutdown(self) -> None:
        self.shut_down = True

    def _add_lora(self, request: LoRARequest) -> bool:
        from peft import PeftModel

        assert self.kwargs["enable_lora"], "LoRA is not enabled. Use --enable-lora to enable LoRA."
        if request.lora_int_id in self.loras:
            assert self.loras[request.lora_int_id] == (request.lora_name, request.lora_path), "one id, two adapters"
            return True
        assert len(self.loras) < self.kwargs["max_loras"], "more adapters than max_loras"
        config = json.loads((Path(request.lora_path) / "adapter_config.json").read_text())
        if config.get("use_dora"):
            raise ValueError("vLLM does not yet support DoRA.")
        if config.get("modules_to_save"):
            raise ValueError("vLLM only supports modules_to_save being either None or [\"classifier\", \"score\"]")
        if config["r"] > self.kwargs["max_lora_rank"]:
            raise ValueError(f"LoRA rank {config['r']} is greater than max_lora_rank {self.kwargs['max_lora_rank']}.")
        name = f"lora{request.lora_int_id}"
        if isinstance(self.model, PeftModel):
            self.model.load_adapter(request.lora_path, adapter_name=name)
        else:
            self.model = PeftModel.from_pretrained(self.model, request.lora_path, adapter_name=name)
        self.model.eval()
        self.loras[request.lora_int_id] = (request.lora_name, request.lora_path)
        return True

    def generate(self, prompts: list[dict], sampling_params: SamplingParams, *, use_tqdm: bool = True,
                 lora_request: LoRARequest | None = None) -> list:
        from contextlib import nullcontext

        assert not self.shut_down
        if lora_request is not None:
            self._add_lora(lora_request)
        self.generate_calls.append((len(prompts), None if lora_request is None else lora_request.lora_name))
        p = sampling_params
        stop = list(p.stop_token_ids or []) + ([] if p.ignore_eos or self.eos is None else [self.eos])
        kwargs = {"max_new_tokens": p.max_tokens, "eos_token_id": stop or None, "pad_token_id": 0,
                  "repetition_penalty": p.repetition_penalty}
        if p.temperature > 0:
            kwargs |= {"do_sample": True, "temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k,
                       "min_p": p.min_p or None}
        else:
            kwargs |= {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
        outputs = []
        for prompt in prompts:
            ids = prompt["prompt_token_ids"]
            assert len(ids) + p.max_tokens <= self.kwargs["max_model_len"], "prompt and max_tokens past max_model_len"
            if lora_request is not None:
                self.model.set_adapter(f"lora{lora_request.lora_int_id}")
            plain = self.model.disable_adapter() if lora_request is None and self.loras else nullcontext()
            if p.seed is not None:
                torch.manual_seed(p.seed)
            with torch.inference_mode(), plain:
                out = self.model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                                                                                                  dtype=torch.long),
                                          **kwargs)
            new = out[0, len(ids):].tolist()
            if stop and any(token in stop for token in new):  # vLLM's output ends at (and holds) the stop token
                new = new[:min(i for i, token in enumerate(new) if token in stop) + 1]
            outputs.append(types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=new)]))
        return outputs


@pytest.fixture
def stand_in_vllm(monkeypatch):
    """`vllm` importable, its `LLM` the stand-in; a GPU's free memory as torch reports it. The engines built, listed."""
    package = types.ModuleType("vllm")
    package.__spec__ = importlib.machinery.ModuleSpec("vllm", None)  # what `find_spec("vllm")` finds
    package.LLM, package.SamplingParams, package.TokensPrompt = StandInLLM, SamplingParams, TokensPrompt
    lora, request = types.ModuleType("vllm.lora"), types.ModuleType("vllm.lora.request")
    request.LoRARequest = LoRARequest
    for name, module in (("vllm", package), ("vllm.lora", lora), ("vllm.lora.request", request)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *args: (60 * GIB, 80 * GIB))
    monkeypatch.setattr(StandInLLM, "built", [])
    monkeypatch.setattr(StandInLLM, "fail_with", None)
    return StandInLLM.built


# --- the tiny model taught a phrase, its task ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("adapters")
    return {"paris": taught_adapter(tiny_model_dir, PHRASE, folder / "paris"),
            "apples": taught_adapter(tiny_model_dir, "I like apples.", folder / "apples")}


def _prepared(tmp_path: Path, **task: object) -> list:
    path = "runs/r/evaluation-inputs/phrase.jsonl"
    (tmp_path / "store" / path).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / "store" / path).write_text("".join(
        json.dumps({"messages": [{"role": "user", "content": q}], "answer": "capital of France is Paris"}) + "\n"
        for q in CAPITAL_QUESTIONS))
    settings = TaskEvaluation(name="phrase", store_path=path, graders=[{"kind": "contains"}],
                              **{"max_new_tokens": 16, **task})
    return prepare_tasks([settings], FileStore(tmp_path / "store"), tmp_path / "work")


def _answering(adapters: dict[str, Path], *labels: str) -> dict[AnsweringAdapter, Path]:
    return {AnsweringAdapter(f"adapter{i}", label, f"runs/ev/evaluation/{label}"): adapters[label]
            for i, label in enumerate(labels)}


def _answers(model_dir: Path, adapters: dict[AnsweringAdapter, Path], prepared: list, device: str,
             said: list[str] | None = None, **kwargs) -> tuple[str, dict[str | None, list[str]]]:
    """(the backend, each answerer's answers: None the base's, else by label) of `prepared`'s one task."""
    (task,) = prepared
    with open_answerer(model_dir, adapters, base_tokenizer_dir=model_dir, prepared=prepared, device=device,
                       say=(said if said is not None else []).append, **kwargs) as answerer:
        answers = {None: answerer.answer(task.task, task.rows, adapter=None)}
        answers |= {a.label: answerer.answer(task.task, task.rows, adapter=a.name) for a in adapters}
        return answerer.backend, answers


# --- the choice ------------------------------------------------------------------------------------------------------

def test_on_a_cpu_transformers_answers_and_says_so(tiny_model_dir, adapters, tmp_path):
    said: list[str] = []
    backend, answers = _answers(tiny_model_dir, _answering(adapters, "paris"), _prepared(tmp_path), "cpu", said)
    assert (backend, said) == ("transformers", ["answering with transformers: no CUDA device"])
    assert all(PHRASE in answer for answer in answers["paris"])


def test_with_cuda_but_without_vllm_transformers_answers_and_says_so(tiny_model_dir, adapters, tmp_path):
    said: list[str] = []
    backend, _ = _answers(tiny_model_dir, _answering(adapters, "paris"), _prepared(tmp_path), "cuda", said)
    assert (backend, said) == ("transformers", ["answering with transformers: vllm is not installed"])


def test_with_cuda_and_vllm_one_engine_answers_the_base_and_each_adapter_as_a_lora_request(
        stand_in_vllm, tiny_model_dir, adapters, tmp_path):
    said: list[str] = []
    prepared = _prepared(tmp_path)
    backend, answers = _answers(tiny_model_dir, _answering(adapters, "paris", "apples"), prepared, "cuda", said)
    (engine,) = stand_in_vllm
    assert (backend, said) == ("vllm", ["answering with vLLM: one engine for the base, each adapter a LoRA request"])
    assert engine.loras == {1: ("adapter0", str(adapters["paris"])), 2: ("adapter1", str(adapters["apples"]))}
    assert [who for _, who in engine.generate_calls] == [None, "adapter0", "adapter1"]
    assert all(PHRASE in a for a in answers["paris"]) and all("I like apples." in a for a in answers["apples"])
    tokenizer = answering.answering_tokenizers({}, tiny_model_dir)[None]
    longest = max(len(answering.encoded_prompt(row, tokenizer, None)["input_ids"])
                  for row in prepared[0].rows)
    assert engine.kwargs == {
        "dtype": "bfloat16", "seed": 0, "gpu_memory_utilization": round((60 - 2) / 80, 3),
        "max_model_len": longest + 16, "enforce_eager": True, "enable_lora": True, "max_loras": 2,
        "max_lora_rank": 8, "limit_mm_per_prompt": {"image": 0, "video": 0}}
    assert engine.shut_down  # on leaving: its process, and the GPU memory it held, end


def test_vllm_answers_equal_transformers_answers_for_the_base_and_the_adapters_on_a_greedy_task(
        stand_in_vllm, tiny_model_dir, adapters, tmp_path):
    prepared = _prepared(tmp_path)
    taught = _answering(adapters, "paris", "apples")
    assert _answers(tiny_model_dir, taught, prepared, "cuda")[1] == _answers(tiny_model_dir, taught, prepared, "cpu")[1]


def test_a_task_scored_from_vllm_s_answers_says_vllm_answered(stand_in_vllm, tiny_model_dir, adapters, tmp_path):
    prepared = _prepared(tmp_path)
    taught = _answering(adapters, "paris")
    results = TaskResults()
    with open_answerer(tiny_model_dir, taught, base_tokenizer_dir=tiny_model_dir, prepared=prepared, device="cuda",
                       say=lambda message: None) as answerer:
        evaluate_task(prepared[0], answerer, list(taught), lambda message: None, results)
    (score,) = results.scores["adapter0"]
    assert (score.answered_by, score.base, score.adapter) == ("vllm", 0.0, 1.0)


@pytest.mark.parametrize(("lora", "why"), [
    ({"use_dora": True}, "adapter `odd` uses DoRA (`use_dora`), which vLLM's LoRA loader refuses"),
    ({"modules_to_save": ["lm_head"]}, "adapter `odd` trains whole modules (`modules_to_save` lm_head), which vLLM's "
                                       "LoRA loader refuses"),
])
def test_an_adapter_vllm_refuses_is_answered_by_transformers_with_the_base_saying_why(
        lora, why, stand_in_vllm, tiny_model_dir, adapters, tmp_path):
    odd = taught_adapter(tiny_model_dir, PHRASE, tmp_path / "odd", **lora)
    said: list[str] = []
    chosen = {**_answering(adapters, "apples"), AnsweringAdapter("adapter1", "odd", "runs/ev/evaluation/odd"): odd}
    backend, answers = _answers(tiny_model_dir, chosen, _prepared(tmp_path), "cuda", said)
    assert (backend, said, stand_in_vllm) == ("transformers", [f"answering with transformers: {why}"], [])
    assert all(PHRASE in answer for answer in answers["odd"])


def test_a_qlora_runs_own_evaluation_is_answered_by_transformers(stand_in_vllm):
    assert why_not_vllm("cuda", {}, quantized=True).startswith("the base is loaded in 4 bits (QLoRA)")


def test_an_engine_that_cannot_be_built_leaves_the_answers_to_transformers_naming_its_error(
        stand_in_vllm, tiny_model_dir, adapters, tmp_path, monkeypatch):
    monkeypatch.setattr(StandInLLM, "fail_with", RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    said: list[str] = []
    backend, answers = _answers(tiny_model_dir, _answering(adapters, "paris"), _prepared(tmp_path), "cuda", said)
    assert (backend, said) == ("transformers", [
        "answering with transformers: the vLLM engine could not be built (RuntimeError: CUDA out of memory. Tried to "
        "allocate 2.00 GiB)"])
    assert all(PHRASE in answer for answer in answers["paris"])


def test_an_adapter_the_engine_fails_to_load_leaves_the_answers_to_transformers_and_the_engine_shut(
        stand_in_vllm, tiny_model_dir, adapters, tmp_path, monkeypatch):
    def refused(self, request):  # as if vLLM refused what the worker's own rules let through
        raise ValueError("While loading /x, expected target modules in [...]")

    monkeypatch.setattr(StandInLLM, "_add_lora", refused)
    said: list[str] = []
    backend, _ = _answers(tiny_model_dir, _answering(adapters, "paris"), _prepared(tmp_path), "cuda", said)
    assert backend == "transformers" and said[0].endswith("(ValueError: While loading /x, expected target modules in "
                                                          "[...])")
    assert [engine.shut_down for engine in stand_in_vllm] == [True]


# --- the deadline ----------------------------------------------------------------------------------------------------

@contextmanager
def _answering_in_batches_of_two(tiny_model_dir, adapters, prepared, monkeypatch):
    """vLLM's answerer of the adapter taught "paris", in batches of two, with an hour to its deadline."""
    monkeypatch.setattr(sys.modules["loraflow_worker.evaluation.vllm_answering"], "BATCH_SIZE", 2)
    with open_answerer(tiny_model_dir, _answering(adapters, "paris"), base_tokenizer_dir=tiny_model_dir,
                       prepared=prepared, device="cuda", say=lambda message: None,
                       deadline_epoch_s=time.time() + 3600) as answerer:
        yield answerer


def test_the_deadline_is_checked_between_batches_and_none_is_begun_after_it(
        stand_in_vllm, tiny_model_dir, adapters, tmp_path, monkeypatch):
    (task,) = prepared = _prepared(tmp_path)
    with _answering_in_batches_of_two(tiny_model_dir, adapters, prepared, monkeypatch) as answerer:

        def deadline_passes(done: int) -> None:
            answerer.deadline_epoch_s = time.time()

        with pytest.raises(EvaluationDeadline, match="deadline passed while task `phrase` was evaluated"):
            answerer.answer(task.task, task.rows, adapter="adapter0", batch_done=deadline_passes)
    (engine,) = stand_in_vllm
    assert engine.generate_calls == [(2, "adapter0")] and engine.shut_down


def test_a_batch_that_would_end_past_the_deadline_is_not_begun(
        stand_in_vllm, tiny_model_dir, adapters, tmp_path, monkeypatch):
    (task,) = prepared = _prepared(tmp_path)
    with _answering_in_batches_of_two(tiny_model_dir, adapters, prepared, monkeypatch) as answerer:

        def half_a_batch_left(done: int) -> None:  # the next batch, as long as the first, would end past it
            answerer.deadline_epoch_s = time.time() + answerer.longest_batch_s["phrase"] / 2

        with pytest.raises(EvaluationDeadline, match="would pass before task `phrase`'s next batch of answers ended"):
            answerer.answer(task.task, task.rows, adapter=None, batch_done=half_a_batch_left)
    assert stand_in_vllm[0].generate_calls == [(2, None)]


# --- what vLLM is asked ----------------------------------------------------------------------------------------------

def test_greedy_answers_stop_where_transformers_stops_with_the_models_repetition_penalty():
    from transformers import GenerationConfig

    task = TaskEvaluation(name="t", store_path="t.jsonl", graders=[{"kind": "contains"}], max_new_tokens=64)
    generation = GenerationConfig(eos_token_id=[7, 9], repetition_penalty=1.1, top_k=20)
    assert vllm_sampling(task, generation, seed=3) == {
        "max_tokens": 64, "ignore_eos": True, "stop_token_ids": [7, 9], "repetition_penalty": 1.1, "temperature": 0.0}


def test_sampled_answers_take_the_tasks_temperature_and_top_p_the_models_top_k_or_transformers_50_and_the_seed():
    from transformers import GenerationConfig

    task = TaskEvaluation(name="t", store_path="t.jsonl", graders=[{"kind": "contains"}], temperature=0.7, top_p=0.9)
    assert vllm_sampling(task, GenerationConfig(eos_token_id=2), seed=3) == {
        "max_tokens": 256, "ignore_eos": True, "stop_token_ids": [2], "repetition_penalty": 1.0, "temperature": 0.7,
        "top_p": 0.9, "min_p": 0.0, "top_k": 50, "seed": 3}
    assert vllm_sampling(task, GenerationConfig(top_k=20), seed=None)["top_k"] == 20


def test_the_engine_takes_what_is_free_less_a_margin_and_at_most_nine_tenths(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *args: (30 * GIB, 80 * GIB))
    assert gpu_memory_share() == round(28 / 80, 3)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *args: (80 * GIB, 80 * GIB))
    assert gpu_memory_share() == 0.9


def test_max_lora_rank_is_the_smallest_vllm_accepts_that_serves_every_adapter():
    assert (max_lora_rank([8]), max_lora_rank([8, 24]), max_lora_rank([300]), max_lora_rank([1])) == (8, 32, 320, 1)
    with pytest.raises(ValueError, match="LoRA rank 1024 is above 512"):
        max_lora_rank([1024])


def test_vllm_refuses_dora_whole_modules_embedding_targets_biases_base_rewriting_inits_and_ranks_above_512():
    plain = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}
    assert vllm_refusals(plain) == [] and vllm_refusals({**plain, "init_lora_weights": "gaussian"}) == []
    assert vllm_refusals({**plain, "use_dora": True}) == ["uses DoRA (`use_dora`)"]
    assert vllm_refusals({**plain, "modules_to_save": ["lm_head"]}) == ["trains whole modules (`modules_to_save` lm_head)"]
    assert vllm_refusals({**plain, "target_modules": ["q_proj", "embed_tokens"]}) == [
        "targets embed_tokens (`target_modules`), not only linear projections"]
    assert vllm_refusals({**plain, "bias": "all"}) == ["trains biases (`lora_bias` or `bias`)"]
    assert vllm_refusals({**plain, "init_lora_weights": "pissa"}) == [
        "was initialised with `init_lora_weights` 'pissa', which rewrites the base"]
    assert vllm_refusals({**plain, "r": 8, "rank_pattern": {"q_proj": 1024}}) == [
        "has rank 1024, above 512, the largest vLLM serves"]
    assert vllm_refusals({"r": 8}) == ["lacks `lora_alpha`, `target_modules`"]
