"""The answers of the base and of the kept adapter to a task's prompts, with transformers: the base loaded again as
training loaded it (bf16 on a GPU, 4 bits for QLoRA), the stored adapter on it with PEFT, the base's answers with the
adapter switched off (`disable_adapter()`). Chat prompts are rendered with the run's chat template and the assistant
turn opened (`add_generation_prompt`), as training rendered its chats; text prompts go in as they are."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from loraflow_worker.artifacts import ArtifactStore
from loraflow_worker.contract import JobInput
from loraflow_worker.contract.task_evaluation import TaskEvaluation
from loraflow_worker.evaluation.task_rows import TaskRow
from loraflow_worker.training.run import quantization_config
from loraflow_worker.training.sft_loss import trl_template

BATCH_SIZE = 16
"""Prompts answered at once: a batch is the unit between two deadline checks and progress updates."""


class EvaluationDeadline(RuntimeError):
    """The job's deadline passed while the tasks were being answered or graded."""


def deadline_passed(job: JobInput) -> bool:
    return job.deadline_epoch_s is not None and time.time() >= job.deadline_epoch_s


@dataclass
class Answerer:
    """The base with the kept adapter on it, ready to answer."""

    model: PeftModel
    tokenizer: PreTrainedTokenizerBase
    chat_template: str | None
    deadline_epoch_s: float | None

    def answer(self, task: TaskEvaluation, rows: list[TaskRow], *, adapter: bool,
               batch_done: Callable[[int], None] = lambda done: None) -> list[str]:
        """The answers to `rows`' prompts: the adapter's, or (`adapter=False`) the base's. `batch_done` hears how many
        are answered after each batch. EvaluationDeadline when the job's deadline passes before the last batch."""
        answers: list[str] = []
        switched = nullcontext() if adapter else self.model.disable_adapter()
        with switched, torch.inference_mode():
            for start in range(0, len(rows), BATCH_SIZE):
                self.check_deadline(task)
                batch = self._generate(task, rows[start:start + BATCH_SIZE])
                self.check_deadline(task)  # a batch the deadline cut short (`max_time`) holds cut answers
                answers += batch
                batch_done(len(answers))
        return answers

    def check_deadline(self, task: TaskEvaluation) -> None:
        """EvaluationDeadline once the job's deadline has passed."""
        if self.deadline_epoch_s is not None and time.time() >= self.deadline_epoch_s:
            raise EvaluationDeadline(f"the job's deadline passed while task `{task.name}` was evaluated")

    def _generate(self, task: TaskEvaluation, rows: list[TaskRow]) -> list[str]:
        # A rendered chat holds its special tokens already; a text prompt gets the model's (a BOS, where it has one).
        encoded = [self.tokenizer(self._render(row), add_special_tokens=not row.chat) for row in rows]
        # Left padding (the tokenizer's side): every prompt ends where its answer begins.
        inputs = self.tokenizer.pad(encoded, return_tensors="pt").to(self.model.device)
        sampling = dict(do_sample=True, temperature=task.temperature, top_p=task.top_p) if task.temperature > 0 else \
            dict(do_sample=False, temperature=None, top_p=None, top_k=None)
        if self.deadline_epoch_s is not None:
            # transformers' `max_time` ends generation after that many seconds: a long batch stops at the deadline,
            # within the supervisor's grace for storing the run.
            sampling["max_time"] = max(self.deadline_epoch_s - time.time(), 0.0)
        output = self.model.generate(**inputs, max_new_tokens=task.max_new_tokens,
                                     pad_token_id=self.tokenizer.pad_token_id, **sampling)
        new_tokens = output[:, inputs["input_ids"].shape[1]:]
        return [text.strip() for text in self.tokenizer.batch_decode(new_tokens, skip_special_tokens=True)]

    def _render(self, row: TaskRow) -> str:
        if not row.chat:
            return row.prompt
        return self.tokenizer.apply_chat_template(row.prompt, chat_template=self.chat_template, tokenize=False,
                                                  add_generation_prompt=True)


def run_chat_template(job: JobInput, store: ArtifactStore) -> str | None:
    """The template chats are rendered with: `training.chat_template` (a stored `.jinja` file or TRL's template of that
    name), else None: the model's own."""
    given = job.training.chat_template
    if given is None:
        return None
    if given.endswith((".jinja", ".j2")):
        return store.read_bytes(given).decode("utf-8")
    return trl_template(given)


@contextmanager
def loaded_answerer(job: JobInput, model_path: Path, adapter_dir: Path, store: ArtifactStore) -> Iterator[Answerer]:
    """The base at `model_path` with the adapter of `adapter_dir` on it, freed (GPU memory included) on leaving."""
    # What training held (model, optimizer state) is garbage once its trainer is: collect it before loading again.
    gc.collect()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.empty_cache()
    kwargs: dict = {"dtype": torch.bfloat16 if cuda else torch.float32}
    if (quantization := quantization_config(job)) is not None:
        kwargs["quantization_config"] = quantization
    if cuda:
        kwargs["device_map"] = {"": 0}
    base = AutoModelForCausalLM.from_pretrained(model_path, **kwargs)
    model = PeftModel.from_pretrained(base, adapter_dir)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(adapter_dir, padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    try:
        yield Answerer(model, tokenizer, run_chat_template(job, store), job.deadline_epoch_s)
    finally:
        del model, base
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
