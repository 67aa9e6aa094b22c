"""LoRA supervised fine-tuning: job input in, trained adapter folder + metrics + manifest out.

Straight-line, like `trl/scripts/sft.py`: load data (holding evaluation examples out, when asked) → load
model → `SFTTrainer` with a PEFT `LoraConfig` → train, evaluating the loss on the held-out examples → save the
adapter. The same code runs on CUDA (bf16) and on CPU (tests, local
demo) with the GPU-only paths switched off; the manifest records which were in effect.
Publishing to the artifact store is the handler's job.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from transformers import AutoTokenizer, TrainerCallback
from trl import SFTConfig, SFTTrainer

from loraflow_worker.artifacts import ArtifactStore
from loraflow_worker.contract import JobInput, Progress
from loraflow_worker.training.data import evaluation_split, load_job_dataset
from loraflow_worker.training.fast_paths import FastPathPlan, engage_fast_paths, gather_facts, plan_fast_paths
from loraflow_worker.training.monitor import TrainingMonitor, check_deadline
from loraflow_worker.training.run import (
    TrainOutcome,
    job_workload,
    load_model,
    lora_config,
    package_outcome,
    resolve_base_model,
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
    plan = plan_fast_paths(gather_facts(model_path, "sft", job_workload(job), job.memory, job.fast_paths))

    args = sft_config(job, plan, work_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    monitor = TrainingMonitor(report, job.deadline_epoch_s, eval_key="eval_loss" if eval_dataset is not None else None)
    trainer = SFTTrainer(
        model=load_model(model_path, job, plan),
        args=args,
        train_dataset=dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        peft_config=lora_config(job),
        callbacks=[monitor, *callbacks],
    )
    fast_paths = engage_fast_paths(plan, trainer.model)
    adapter_dir, wall_seconds = train_and_save(trainer, tokenizer, job, revision, work_dir, resume_from)
    return package_outcome(trainer=trainer, monitor=monitor, job=job, revision=revision, adapter_dir=adapter_dir,
                           wall_seconds=wall_seconds, cuda=cuda, fast_paths=fast_paths, plan=plan, rows=dataset,
                           sources=loaded.sources)


def sft_config(job: JobInput, plan: FastPathPlan, work_dir: Path) -> SFTConfig:
    """The `SFTConfig` of `job` under the fast-path `plan` (which carries the model-loading kwargs), writing into
    `work_dir`: what `train_sft` trains with, in a function of its own so that a GPU's configuration can be
    built and checked without one."""
    return SFTConfig(
        **shared_trainer_args(job, work_dir),
        max_length=job.training.max_seq_length,
        include_num_input_tokens_seen="non_padding",
        **plan.trainer_kwargs,
    )
