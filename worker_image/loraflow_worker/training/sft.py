"""LoRA supervised fine-tuning: job input in, trained adapter folder + metrics + manifest out.

Straight-line, like `trl/scripts/sft.py`: load data (holding evaluation examples out, when asked) → the loss put
on what `training.loss_on` names (`sft_loss`) → load model → `SFTTrainer` with a PEFT `LoraConfig`, packing the
examples when asked (`dataset.packing`, `PackedRows`) → train, evaluating the loss on the held-out examples → save the adapter. The same
code runs on CUDA (bf16) and on CPU (tests, local demo) with the GPU-only paths switched off; the manifest records
which were in effect.
Publishing to the artifact store is the handler's job.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import AutoTokenizer, TrainerCallback
from trl import SFTConfig, SFTTrainer
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

from loraflow_worker.artifacts import ArtifactStore
from loraflow_worker.artifacts.manifest import FastPath
from loraflow_worker.contract import JobInput, Progress
from loraflow_worker.dataset.loading import evaluation_split, load_job_dataset
from loraflow_worker.training.fast_paths import FastPathPlan, engage_fast_paths, gather_facts, plan_fast_paths
from loraflow_worker.training.monitor import TrainingMonitor, check_deadline
from loraflow_worker.dataset.packing import packed_rows_reason, packing_problem
from loraflow_worker.training.sft_loss import SftLoss, loss_record, prepare_sft_loss
from loraflow_worker.runtime.model_cache import resolve_base_model
from loraflow_worker.training.run import (
    TrainOutcome,
    job_workload,
    model_and_adapter,
    package_outcome,
    shared_trainer_args,
    train_and_save,
    use_device,
)


def train_sft(job: JobInput, store: ArtifactStore, work_dir: Path, report: Callable[[Progress], None], *,
              callbacks: Sequence[TrainerCallback] = (), resume_from: Path | None = None) -> TrainOutcome:
    """Train a LoRA adapter for `job` inside `work_dir` and save it there. `callbacks` join the
    Trainer's; `resume_from` is a Trainer checkpoint folder to continue from (step, optimizer,
    scheduler, RNG). Raises `DeadlineReached` when the job's deadline passes before training starts; one
    that passes during training stops it with the adapter trained so far (`TrainOutcome.deadline_checkpoint`)."""
    cuda = use_device()
    report(Progress(stage="loading", message=f"loading dataset and model {job.model.id}"))
    loaded = load_job_dataset(job.dataset, store, work_dir, job.training.seed)
    dataset, eval_dataset = evaluation_split(loaded.rows, job, store, work_dir)
    model_path, revision = resolve_base_model(job.model)
    check_deadline(job.deadline_epoch_s)
    facts = gather_facts(model_path, "sft", job_workload(job), job.memory, job.fast_paths)
    if job.training.packing and (problem := packing_problem(facts.model_type)):
        raise ValueError(problem)
    plan = plan_fast_paths(facts)

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    loss = prepare_sft_loss(job, tokenizer, store, dataset, eval_dataset)
    model, peft_config = model_and_adapter(model_path, job, plan, store, work_dir)
    args = sft_config(job, plan, work_dir, loss)
    monitor = TrainingMonitor(report, job.deadline_epoch_s, eval_key="eval_loss" if eval_dataset is not None else None)
    saved_template = tokenizer.chat_template
    if loss.render_with is not None:
        tokenizer.chat_template = loss.render_with
    trainer = PackedCountSFTTrainer(
        model=model,
        args=args,
        train_dataset=loss.train,
        eval_dataset=loss.evaluation,
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=[monitor, *callbacks],
    )
    tokenizer.chat_template = saved_template  # the data is tokenized: the adapter keeps the model's own template
    if job.training.packing:  # TRL refuses a collator of ours with packing, so it replaces TRL's once built
        trainer.data_collator = PackedRows(pad_token_id=tokenizer.pad_token_id, return_position_ids=True,
                                           pad_to_multiple_of=trainer.data_collator.pad_to_multiple_of)
    fast_paths = engage_fast_paths(plan, trainer.model)
    if job.training.packing:
        fast_paths["packing"] = _packing(trainer.train_dataset, len(loss.train), job.training.max_seq_length)
    adapter_dir, wall_seconds = train_and_save(trainer, tokenizer, job, revision, work_dir, resume_from)
    return package_outcome(trainer=trainer, monitor=monitor, job=job, revision=revision, adapter_dir=adapter_dir,
                           wall_seconds=wall_seconds, cuda=cuda, fast_paths=fast_paths, plan=plan, rows=dataset,
                           sources=loaded.sources, loss=loss_record(job, loss, trainer.train_dataset))


def sft_config(job: JobInput, plan: FastPathPlan, work_dir: Path, loss: SftLoss | None = None) -> SFTConfig:
    """The `SFTConfig` of `job` under the fast-path `plan` (which carries the model-loading kwargs) and its `loss`
    masking, writing into `work_dir`: what `train_sft` trains with, in a function of its own so that a GPU's
    configuration can be built and checked without one."""
    return SFTConfig(
        **shared_trainer_args(job, work_dir),
        max_length=job.training.max_seq_length,
        include_num_input_tokens_seen="non_padding",
        # Best-fit decreasing: whole examples per row, their lengths kept (`seq_lengths`) for their positions.
        packing=job.training.packing, packing_strategy="bfd",
        **(loss.config if loss else {}),
        **plan.trainer_kwargs,
    )


class PackedRows(DataCollatorForLanguageModeling):
    """TRL's packed rows as a batch of rows. TRL's own collator for packing flattens the batch into one row (padding-
    free, for FlashAttention's variable-length kernels, which the image lacks); under SDPA attention then spans
    batch_size × max_seq_length tokens at once, its cost growing with that length squared. Here each row keeps its
    examples' positions, restarting at 0, and no attention mask is passed: from the positions transformers masks
    attention across the examples of a row (a short row's padding becomes one-token sequences without loss). Each
    example's first token carries no label: the loss shifts the labels by one, so that label would be predicted from
    the previous example's last token (TRL masks it in its padding-free path only). The batch's real (unpadded)
    token count rides along as `TOKENS`, which `PackedCountSFTTrainer` takes out before the model sees the batch."""

    TOKENS = "loraflow_packed_tokens"

    def torch_call(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        batch = super().torch_call(examples)
        del batch["attention_mask"]  # with one, transformers would not read the positions' boundaries
        batch["labels"][batch["position_ids"] == 0] = -100
        batch[self.TOKENS] = torch.tensor(sum(len(example["input_ids"]) for example in examples))
        return batch


class PackedCountSFTTrainer(SFTTrainer):
    """TRL's `SFTTrainer`, counting the tokens of a batch of packed rows (`PackedRows`) as they are. Without an
    attention mask TRL 1.16 counts a batch's `position_ids.size(1)`, the length of one row (`SFTTrainer.compute_loss`,
    `sft_trainer.py` 1651-1653: its padding-free batch is one row), for its logged `num_tokens`; and transformers counts
    the tokens that are not the pad token (`Trainer._track_num_input_tokens`), which misses a real token equal to it
    (a base model's end-of-text is often its pad). Both take the collator's count instead. Other batches: TRL's."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        tokens = inputs.pop(PackedRows.TOKENS, None)
        counted = self._total_train_tokens
        result = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                      num_items_in_batch=num_items_in_batch)
        if tokens is not None and self.model.training:
            self._total_train_tokens = counted + self._gathered(tokens)
            self._metrics["train"]["num_tokens"] = [self._total_train_tokens]
        return result

    def _track_num_input_tokens(self, inputs):
        if PackedRows.TOKENS not in inputs or self.args.include_num_input_tokens_seen != "non_padding":
            return super()._track_num_input_tokens(inputs)
        self.state.num_input_tokens_seen += self._gathered(inputs[PackedRows.TOKENS])

    def _gathered(self, tokens: torch.Tensor) -> int:
        return int(self.accelerator.gather(tokens.to(self.args.device).reshape(1)).sum().item())


def _packing(prepared: Dataset, examples: int, max_length: int) -> FastPath:
    """Whether the trainer's data was packed (TRL's packing adds each row's `seq_lengths`), for the manifest."""
    if "seq_lengths" not in prepared.column_names:
        return FastPath(engaged=False, reason="TRL did not pack the data")
    return FastPath(engaged=True, reason=packed_rows_reason(examples, len(prepared), max_length))
