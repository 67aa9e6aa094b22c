"""The answers of a base model and of its adapters to a task's prompts, with transformers: the base loaded once (bf16
on a GPU, 4 bits for a QLoRA run's own evaluation), every adapter on it with PEFT, each answering in turn
(`set_adapter`), the base's answers with the adapters switched off (`disable_adapter()`). Chat prompts are rendered
with the chat template given (a run's), else each tokenizer's own, and the assistant turn opened
(`add_generation_prompt`), as training rendered its chats; text prompts go in as they are. Where vLLM runs, one vLLM
engine answers instead, with the same prompts and tokenizers (`vllm_answering.py`, which chooses between the two)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from loraflow_worker.artifacts import ArtifactStore
from loraflow_worker.contract.task_evaluation import TaskEvaluation
from loraflow_worker.evaluation.device import free_gpu_memory
from loraflow_worker.evaluation.task_rows import TaskRow
from loraflow_worker.training.sft_loss import trl_template

BATCH_SIZE = 16
"""Prompts answered at once: a batch is the unit between two deadline checks and progress updates."""


class EvaluationDeadline(RuntimeError):
    """The job's deadline passed while the tasks were being answered or graded."""


def deadline_passed(deadline_epoch_s: float | None) -> bool:
    return deadline_epoch_s is not None and time.time() >= deadline_epoch_s


class TaskAnswerer:
    """What answers a task's prompts: transformers (`Answerer`) or vLLM (`vllm_answering.VllmAnswerer`), before the
    job's deadline (`deadline_epoch_s`)."""

    backend: ClassVar[str]
    """What answers (`TaskScore.answered_by`)."""
    deadline_epoch_s: float | None

    def answer(self, task: TaskEvaluation, rows: list[TaskRow], *, adapter: str | None,
               batch_done: Callable[[int], None] = lambda done: None) -> list[str]:
        """The answers to `rows`' prompts: the adapter's of that name, or (`adapter=None`) the base's. `batch_done`
        hears how many are answered after each batch. EvaluationDeadline when the job's deadline passes before the
        last batch."""
        raise NotImplementedError

    def check_deadline(self, task: TaskEvaluation) -> None:
        """EvaluationDeadline once the job's deadline has passed."""
        if deadline_passed(self.deadline_epoch_s):
            raise EvaluationDeadline(f"the job's deadline passed while task `{task.name}` was evaluated")


@dataclass
class Answerer(TaskAnswerer):
    """The base with its adapters on it, ready to answer."""

    model: PeftModel
    tokenizers: dict[str | None, PreTrainedTokenizerBase]
    """Each answerer's tokenizer, by adapter name; None: the base's."""
    chat_template: str | None
    deadline_epoch_s: float | None
    backend: ClassVar[str] = "transformers"

    def answer(self, task: TaskEvaluation, rows: list[TaskRow], *, adapter: str | None,
               batch_done: Callable[[int], None] = lambda done: None) -> list[str]:
        """`TaskAnswerer.answer`, with transformers' `generate`, batch by batch."""
        answers: list[str] = []
        if adapter is not None:
            self.model.set_adapter(adapter)
        switched = nullcontext() if adapter is not None else self.model.disable_adapter()
        tokenizer = self.tokenizers[adapter]
        with switched, torch.inference_mode():
            for start in range(0, len(rows), BATCH_SIZE):
                self.check_deadline(task)
                batch = self._generate(task, rows[start:start + BATCH_SIZE], tokenizer)
                self.check_deadline(task)  # a batch the deadline cut short (`max_time`) holds cut answers
                answers += batch
                batch_done(len(answers))
        return answers

    def _generate(self, task: TaskEvaluation, rows: list[TaskRow], tokenizer: PreTrainedTokenizerBase) -> list[str]:
        encoded = [encoded_prompt(row, tokenizer, self.chat_template) for row in rows]
        # Left padding (the tokenizer's side): every prompt ends where its answer begins.
        inputs = tokenizer.pad(encoded, return_tensors="pt").to(self.model.device)
        sampling = dict(do_sample=True, temperature=task.temperature, top_p=task.top_p) if task.temperature > 0 else \
            dict(do_sample=False, temperature=None, top_p=None, top_k=None)
        if self.deadline_epoch_s is not None:
            # transformers' `max_time` ends generation after that many seconds: a long batch stops at the deadline,
            # within the supervisor's grace for storing the run.
            sampling["max_time"] = max(self.deadline_epoch_s - time.time(), 0.0)
        output = self.model.generate(**inputs, max_new_tokens=task.max_new_tokens,
                                     pad_token_id=tokenizer.pad_token_id, **sampling)
        new_tokens = output[:, inputs["input_ids"].shape[1]:]
        return [text.strip() for text in tokenizer.batch_decode(new_tokens, skip_special_tokens=True)]


def encoded_prompt(row: TaskRow, tokenizer: PreTrainedTokenizerBase, chat_template: str | None) -> Any:
    """A row's prompt as the model is asked it, tokenized (`input_ids`, `attention_mask`): a chat rendered with
    `chat_template` (None: the tokenizer's own) and the assistant's turn opened, a text prompt as it is."""
    if not row.chat:
        # A text prompt gets the model's special tokens (a BOS, where it has one); a rendered chat holds its own.
        return tokenizer(row.prompt, add_special_tokens=True)
    text = tokenizer.apply_chat_template(row.prompt, chat_template=chat_template, tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)


def run_chat_template(given: str | None, store: ArtifactStore) -> str | None:
    """The template chats are rendered with: a run's `training.chat_template` (a stored `.jinja` file or TRL's
    template of that name), else None: the model's own."""
    if given is None:
        return None
    if given.endswith((".jinja", ".j2")):
        return store.read_bytes(given).decode("utf-8")
    return trl_template(given)


@contextmanager
def loaded_answerer(model_path: Path, adapter_dirs: Mapping[str, Path], *, base_tokenizer_dir: Path,
                    chat_template: str | None = None, quantization: object | None = None,
                    deadline_epoch_s: float | None = None) -> Iterator[Answerer]:
    """The base at `model_path` (quantized with `quantization`, a transformers quantization config, when given) with
    each adapter of `adapter_dirs` (PEFT adapter name → folder) on it, freed (GPU memory included) on leaving. The
    base answers with the tokenizer of `base_tokenizer_dir`, an adapter with its folder's own when it holds one."""
    # What training held (model, optimizer state) is garbage once its trainer is: collect it before loading again.
    free_gpu_memory()
    cuda = torch.cuda.is_available()
    kwargs: dict = {"dtype": torch.bfloat16 if cuda else torch.float32}
    if quantization is not None:
        kwargs["quantization_config"] = quantization
    if cuda:
        kwargs["device_map"] = {"": 0}
    base = AutoModelForCausalLM.from_pretrained(model_path, **kwargs)
    (first, first_dir), *others = adapter_dirs.items()
    model = PeftModel.from_pretrained(base, first_dir, adapter_name=first)
    for name, folder in others:
        model.load_adapter(folder, adapter_name=name)
    model.eval()
    tokenizers = answering_tokenizers(adapter_dirs, base_tokenizer_dir)
    try:
        yield Answerer(model, tokenizers, chat_template, deadline_epoch_s)
    finally:
        del model, base
        free_gpu_memory()


def answering_tokenizers(adapter_dirs: Mapping[str, Path],
                         base_tokenizer_dir: Path) -> dict[str | None, PreTrainedTokenizerBase]:
    """Each answerer's tokenizer, by adapter name (None: the base's, from `base_tokenizer_dir`): an adapter's folder's
    own when it holds one, else the base's."""
    tokenizers = {None: _tokenizer(base_tokenizer_dir)}
    tokenizers |= {name: _tokenizer(folder) if (folder / "tokenizer_config.json").is_file() else tokenizers[None]
                   for name, folder in adapter_dirs.items()}
    return tokenizers


def _tokenizer(folder: Path) -> PreTrainedTokenizerBase:
    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
