"""The answers of a base model and of its adapters to a task's prompts from one vLLM engine, where vLLM runs, and the
choice between it and transformers (`answering.py`): `open_answerer`.

One engine holds the base (bf16, as transformers loads it on a GPU) with LoRA on (`enable_lora`), a slot for every
adapter (`max_loras`) at the smallest `max_lora_rank` that serves them all (`vllm_lora.max_lora_rank`); each adapter
answers as a `LoRARequest` (ids from 1, one per adapter), the base with none. The answers mean what transformers'
would: the worker renders and tokenizes every prompt itself, with the tokenizer transformers would use (an adapter
folder's own when it holds one) and the same chat template (`answering.encoded_prompt`), hands vLLM the token ids,
and decodes the answer's ids with that tokenizer; vLLM stops on the end-of-sequence ids of the model's generation
config and samples with its settings as transformers' `generate` reads them (`vllm_sampling`).

Transformers answers instead, and one progress line says why ("answering with transformers: ..."), where:
- there is no CUDA device, or vLLM is not installed;
- the base is loaded in 4 bits (a QLoRA run's own evaluation): vLLM would quantize the base itself (its bitsandbytes
  path, not the one the adapter was trained on), which no GPU run has compared yet: the adapter is asked of the base
  it trained on;
- an adapter is one vLLM's LoRA loader refuses (DoRA, `modules_to_save`, embedding targets, a rank above 512:
  `vllm_lora.vllm_refusals`): every answer of the job then comes from transformers, so that the base and every adapter
  are compared on one backend;
- building the engine or loading an adapter into it fails (an import error, CUDA out of memory, an architecture vLLM
  does not know): the error is named and nothing of the evaluation is lost. Once the engine is built and every
  adapter loaded, a failure while answering is the evaluation's, as one of transformers' would be.

What has not run on a GPU yet: vLLM 0.33 itself answering here. The names and arguments used are vLLM 0.33.0's (read
from its wheel): `vllm.LLM(model, dtype, seed, gpu_memory_utilization, enforce_eager, max_model_len, enable_lora,
max_lora_rank, max_loras, limit_mm_per_prompt)`, `LLM.generate(prompts, sampling_params, use_tqdm=, lora_request=)`,
`LLM.llm_engine.add_lora`, `LLM.llm_engine.engine_core.shutdown()`, `vllm.TokensPrompt(prompt_token_ids=)`,
`vllm.lora.request.LoRARequest(lora_name, lora_int_id, lora_path)`, `vllm.SamplingParams(temperature, top_p, top_k,
min_p, repetition_penalty, max_tokens, stop_token_ids, ignore_eos, seed)`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path
from typing import Any, ClassVar

import torch
from transformers import AutoConfig, GenerationConfig, PreTrainedTokenizerBase

from loraflow_worker.contract.task_evaluation import TaskEvaluation
from loraflow_worker.evaluation.device import free_gpu_memory
from loraflow_worker.evaluation.answering import (
    BATCH_SIZE,
    EvaluationDeadline,
    TaskAnswerer,
    answering_tokenizers,
    encoded_prompt,
    loaded_answerer,
)
from loraflow_worker.evaluation.task_rows import TaskRow
from loraflow_worker.evaluation.tasks import AnsweringAdapter, PreparedTask
from loraflow_worker.evaluation.vllm_lora import adapter_config, adapter_rank, max_lora_rank, vllm_refusals
from loraflow_worker.training.fast_paths import VLLM_TEXT_ONLY

log = logging.getLogger(__name__)

ENGINE_MARGIN_BYTES = 2 * 1024**3
"""GPU memory left out of the engine's share of what is free: its own process's CUDA context and kernels' workspaces,
which it counts after it measures, and what this process allocates meanwhile."""
MAX_SHARE = 0.9
"""The most of the GPU the engine is given, were it all free: vLLM's default (0.92) less room for this process."""
TRANSFORMERS_TOP_K = 50
"""The top-k transformers' `generate` samples with where the model's generation config names none
(`GenerationConfig._get_default_generation_params`)."""
ERROR_CHARS = 600
"""The most of an engine's error the progress line keeps: vLLM's errors can quote whole configurations."""


def why_not_vllm(device: str, adapters: Mapping[AnsweringAdapter, Path], *, quantized: bool) -> str | None:
    """Why transformers rather than vLLM answers on `device` for `adapters` (a 4-bit base when `quantized`), in
    words that follow "answering with transformers: "; None where vLLM answers."""
    if not device.startswith("cuda"):
        return "no CUDA device"
    if find_spec("vllm") is None:
        return "vllm is not installed"
    if quantized:
        return ("the base is loaded in 4 bits (QLoRA): the adapter is asked of the base as it trained on it, which "
                "vLLM's own 4-bit loading is not")
    for adapter, folder in adapters.items():
        if reasons := vllm_refusals(adapter_config(folder)):
            return f"{adapter.called} {' and '.join(reasons)}, which vLLM's LoRA loader refuses"
    return None


@contextmanager
def open_answerer(model_path: Path, adapters: Mapping[AnsweringAdapter, Path], *, base_tokenizer_dir: Path,
                  prepared: Sequence[PreparedTask], device: str, say: Callable[[str], None],
                  chat_template: str | None = None, quantization: object | None = None,
                  deadline_epoch_s: float | None = None, seed: int | None = None) -> Iterator[TaskAnswerer]:
    """An answerer for `prepared`'s tasks: the base at `model_path` with each of `adapters` (by PEFT name) on it,
    from vLLM where it runs on `device` and takes every adapter, else transformers (`loaded_answerer`, `quantization`
    its 4-bit config), saying which (and why not vLLM) through `say`; freed, GPU memory included, on leaving.
    `seed`: sampled answers' seed (greedy ones need none). The base answers with `base_tokenizer_dir`'s tokenizer."""
    adapter_dirs = {adapter.name: folder for adapter, folder in adapters.items()}
    reason = why_not_vllm(device, adapters, quantized=quantization is not None)
    engine = None
    if reason is None:
        tokenizers = answering_tokenizers(adapter_dirs, base_tokenizer_dir)
        try:
            engine = VllmEngine.build(model_path, adapter_dirs, _max_model_len(prepared, tokenizers, chat_template),
                                      seed)
        except Exception as e:  # noqa: BLE001 - whatever vLLM raises, transformers answers instead
            log.exception("the vLLM engine for the task evaluations could not be built")
            reason = f"the vLLM engine could not be built ({' '.join(f'{type(e).__name__}: {e}'.split())[:ERROR_CHARS]})"
        if engine is None:
            free_gpu_memory()  # out of the `except`, whose frames held what the failed engine had built
    if engine is None:
        say(f"answering with transformers: {reason}")
        with loaded_answerer(model_path, adapter_dirs, base_tokenizer_dir=base_tokenizer_dir,
                             chat_template=chat_template, quantization=quantization,
                             deadline_epoch_s=deadline_epoch_s) as answerer:
            yield answerer
        return
    say("answering with vLLM: one engine for the base, "
        + ("the adapter a LoRA request" if len(adapters) == 1 else "each adapter a LoRA request"))
    try:
        yield VllmAnswerer(engine, tokenizers, chat_template, deadline_epoch_s, _generation_config(model_path), seed)
    finally:
        engine.close()


@dataclass
class VllmEngine:
    """A vLLM engine of the base with every adapter loaded, and each adapter's LoRA request by PEFT name."""

    llm: Any
    requests: dict[str, Any]

    @classmethod
    def build(cls, model_path: Path, adapter_dirs: Mapping[str, Path], max_model_len: int,
              seed: int | None) -> VllmEngine:
        """The engine, every adapter loaded into it: an adapter vLLM cannot load fails here, before any answer."""
        from vllm import LLM
        from vllm.lora.request import LoRARequest

        # What training held (model, optimizer state) is garbage once its trainer is: collected before measuring.
        free_gpu_memory()
        llm = LLM(
            model=str(model_path), dtype="bfloat16", seed=seed or 0,
            gpu_memory_utilization=gpu_memory_share(), max_model_len=max_model_len,
            # No torch.compile nor CUDA graph capture: a task evaluation's few hundred answers take less time than
            # they would add to the engine's start (tens of seconds, each time on a fresh worker) and their memory.
            enforce_eager=True,
            enable_lora=True, max_loras=len(adapter_dirs),
            max_lora_rank=max_lora_rank(adapter_rank(adapter_config(folder)) for folder in adapter_dirs.values()),
            **VLLM_TEXT_ONLY)
        engine = cls(llm, {})
        try:
            for number, (name, folder) in enumerate(adapter_dirs.items(), start=1):
                # vLLM tells adapters apart by their integer id, from 1; loaded now, so that one it refuses fails here.
                request = LoRARequest(lora_name=name, lora_int_id=number, lora_path=str(folder))
                llm.llm_engine.add_lora(request)
                engine.requests[name] = request
        except BaseException:
            engine.close()
            raise
        return engine

    def close(self) -> None:
        """End the engine's process (vLLM's engine core runs in its own: its GPU memory goes back to the device with
        it) and free what this process held of it."""
        try:
            self.llm.llm_engine.engine_core.shutdown()
        except Exception:  # noqa: BLE001 - an engine that failed may be half gone: the rest is freed all the same
            log.warning("the vLLM engine did not shut down cleanly", exc_info=True)
        self.llm = None
        free_gpu_memory()


def gpu_memory_share() -> float:
    """vLLM's `gpu_memory_utilization`: the share of the whole GPU the engine may take (weights, activations, KV
    cache). vLLM refuses to start when less than that share is free [vllm/v1/worker/utils.py `request_memory`], and
    this process keeps its CUDA context and whatever it still holds: so what is free now, less a margin
    (`ENGINE_MARGIN_BYTES`), at most `MAX_SHARE`. After training the trainer's model and optimizer are freed, so
    this is most of the GPU; a share too small for the weights fails the build, and transformers answers."""
    free, total = torch.cuda.mem_get_info()
    return round(max(0.01, min(MAX_SHARE, (free - ENGINE_MARGIN_BYTES) / total)), 3)


@dataclass
class VllmAnswerer(TaskAnswerer):
    """The base and its adapters in one vLLM engine, ready to answer: `answering.Answerer`'s interface."""

    engine: VllmEngine
    tokenizers: dict[str | None, PreTrainedTokenizerBase]
    """Each answerer's tokenizer, by adapter name; None: the base's."""
    chat_template: str | None
    deadline_epoch_s: float | None
    generation: GenerationConfig
    """The model's generation config, as transformers' `generate` reads it."""
    seed: int | None
    backend: ClassVar[str] = "vllm"
    longest_batch_s: dict[str, float] = field(default_factory=dict)
    """The longest batch of each task so far, in seconds."""

    def answer(self, task: TaskEvaluation, rows: list[TaskRow], *, adapter: str | None,
               batch_done: Callable[[int], None] = lambda done: None) -> list[str]:
        """`TaskAnswerer.answer`, from the vLLM engine, batch by batch."""
        from vllm import SamplingParams, TokensPrompt

        tokenizer = self.tokenizers[adapter]
        request = None if adapter is None else self.engine.requests[adapter]
        sampling = SamplingParams(**vllm_sampling(task, self.generation, self.seed))
        answers: list[str] = []
        # vLLM's `generate` cannot be stopped once called: the prompts go in batches of BATCH_SIZE, as transformers'
        # do, the deadline checked between them, and a batch that would end past it (if it takes as long as the
        # longest of this task so far) is not begun: its answers would be dropped, and the process may be killed a
        # minute after the deadline (`supervisor.DEADLINE_KILL_GRACE_S`).
        for start in range(0, len(rows), BATCH_SIZE):
            self.check_deadline(task)
            if self.deadline_epoch_s is not None and \
                    time.time() + self.longest_batch_s.get(task.name, 0.0) > self.deadline_epoch_s:
                raise EvaluationDeadline(f"the job's deadline would pass before task `{task.name}`'s next batch of "
                                         "answers ended")
            began = time.monotonic()
            prompts = [TokensPrompt(prompt_token_ids=list(encoded_prompt(row, tokenizer, self.chat_template)
                                                          ["input_ids"]))
                       for row in rows[start:start + BATCH_SIZE]]
            outputs = self.engine.llm.generate(prompts, sampling, use_tqdm=False, lora_request=request)
            self.longest_batch_s[task.name] = max(self.longest_batch_s.get(task.name, 0.0), time.monotonic() - began)
            self.check_deadline(task)  # a batch that ended past the deadline is dropped, as transformers' cut one is
            answers += [tokenizer.decode(list(output.outputs[0].token_ids), skip_special_tokens=True).strip()
                        for output in outputs]
            batch_done(len(answers))
        return answers


def vllm_sampling(task: TaskEvaluation, generation: GenerationConfig, seed: int | None) -> dict[str, Any]:
    """`vllm.SamplingParams`' arguments that answer `task` as transformers' `generate` does with the model's
    `generation` config: greedy at temperature 0, else sampled with the task's temperature and top-p and the model's
    top-k (transformers' 50 where it names none) and min-p, seeded with `seed`; the model's repetition penalty either
    way; at most `max_new_tokens`, stopped by the config's end-of-sequence ids alone (`ignore_eos`: vLLM would also
    stop at its tokenizer's EOS, which transformers does not)."""
    eos = generation.eos_token_id
    settings: dict[str, Any] = {
        "max_tokens": task.max_new_tokens, "ignore_eos": True,
        "stop_token_ids": [] if eos is None else [eos] if isinstance(eos, int) else list(eos),
        "repetition_penalty": generation.repetition_penalty or 1.0,
    }
    if task.temperature <= 0:
        return settings | {"temperature": 0.0}
    return settings | {"temperature": task.temperature, "top_p": task.top_p, "min_p": generation.min_p or 0.0,
                       "top_k": TRANSFORMERS_TOP_K if generation.top_k is None else generation.top_k, "seed": seed}


def _generation_config(model_path: Path) -> GenerationConfig:
    """The generation config transformers gives the model at `model_path`: its `generation_config.json`, else one
    made from its config (`GenerationMixin`'s loading)."""
    try:
        return GenerationConfig.from_pretrained(model_path)
    except OSError:
        return GenerationConfig.from_model_config(AutoConfig.from_pretrained(model_path))


def _max_model_len(prepared: Sequence[PreparedTask], tokenizers: Mapping[str | None, PreTrainedTokenizerBase],
                   chat_template: str | None) -> int:
    """The longest prompt of any task (with any answerer's tokenizer) with its task's `max_new_tokens`: the engine's
    `max_model_len`, rather than the model's whole context, whose KV cache it would otherwise size for."""
    distinct = list({id(t): t for t in tokenizers.values()}.values())
    return max((max(len(encoded_prompt(row, tokenizer, chat_template)["input_ids"])
                    for row in p.rows for tokenizer in distinct) + p.task.max_new_tokens
                for p in prepared if p.rows), default=1)
