"""LoRA direct preference optimisation: job input in, trained adapter folder + metrics + manifest out.

Straight-line, like `trl/scripts/dpo.py`: load the preference pairs (holding evaluation pairs out, when asked) and
check each → load model → `DPOTrainer` with a PEFT `LoraConfig` → train, evaluating the held-out pairs' loss, reward
accuracy and margin → save the adapter. The reference the adapter is measured against costs no second copy of the
weights: TRL computes it with the adapter switched off (the base model), or, for a run that goes on training an
earlier adapter (`lora.init_from`), with a frozen copy of that adapter loaded beside it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from datasets import Dataset
from transformers import AutoTokenizer, TrainerCallback
from trl import DPOConfig, DPOTrainer

from loraflow_worker.artifacts import ArtifactStore
from loraflow_worker.contract import DpoSettings, JobInput, Progress
from loraflow_worker.contract.dataset_formats import preference_problem
from loraflow_worker.dataset.loading import evaluation_split, load_job_dataset
from loraflow_worker.training.fast_paths import FastPathPlan, engage_fast_paths, gather_facts, plan_fast_paths
from loraflow_worker.training.monitor import TrainingMonitor, check_deadline
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


def train_dpo(job: JobInput, store: ArtifactStore, work_dir: Path, report: Callable[[Progress], None], *,
              callbacks: Sequence[TrainerCallback] = (), resume_from: Path | None = None) -> TrainOutcome:
    """Train a LoRA adapter for `job` on its preference pairs inside `work_dir` and save it there (`train_sft`'s
    contract: `callbacks`, `resume_from`, the deadline)."""
    cuda = use_device()
    report(Progress(stage="loading", message=f"loading preference pairs and model {job.model.id}"))
    loaded = load_job_dataset(job.dataset, store, work_dir, job.training.seed)
    check_pairs(loaded.rows, "dataset")
    rows, held_out = evaluation_split(loaded.rows, job, store, work_dir)
    if held_out is not None and job.evaluation.fraction is None:  # a held-out share was checked with the dataset
        check_pairs(held_out, "evaluation file")
    model_path, revision = resolve_base_model(job.model)
    check_deadline(job.deadline_epoch_s)
    plan = plan_fast_paths(gather_facts(model_path, "dpo", job_workload(job), job.memory, job.fast_paths))

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model, peft_config = model_and_adapter(model_path, job, plan, store, work_dir)
    monitor = TrainingMonitor(report, job.deadline_epoch_s, eval_key="eval_loss" if held_out is not None else None,
                              eval_extras=("eval_reward_accuracies", "eval_reward_margins"))
    trainer = DPOTrainer(
        model=model,
        args=dpo_config(job, plan, work_dir),
        train_dataset=rows,
        eval_dataset=held_out,
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=[monitor, *callbacks],
    )
    fast_paths = engage_fast_paths(plan, trainer.model)
    adapter_dir, wall_seconds = train_and_save(trainer, tokenizer, job, revision, work_dir, resume_from)
    return package_outcome(trainer=trainer, monitor=monitor, job=job, revision=revision, adapter_dir=adapter_dir,
                           wall_seconds=wall_seconds, cuda=cuda, fast_paths=fast_paths, plan=plan, rows=rows,
                           sources=loaded.sources)


def dpo_config(job: JobInput, plan: FastPathPlan, work_dir: Path) -> DPOConfig:
    """The `DPOConfig` of `job` under the fast-path `plan`, writing into `work_dir` (a function of its own, as
    `sft_config`, so that a GPU's configuration can be built and checked without one)."""
    settings = job.dpo or DpoSettings()
    return DPOConfig(
        **shared_trainer_args(job, work_dir),
        # Prompt and answer together, as SFT's `max_seq_length`; TRL keeps the prompt's start and cuts the answers.
        max_length=job.training.max_seq_length,
        # Counted as SFT counts them (the Trainer's default counts none): the metrics' tokens and the progress's
        # tokens/s, which the GPU smoke's `dpo` variant reads.
        include_num_input_tokens_seen="non_padding",
        beta=settings.beta,
        loss_type=[settings.loss_type],
        **plan.trainer_kwargs,
    )


def check_pairs(rows: Dataset, field: str) -> None:
    """ValueError naming the first row (of `field`'s data, counted from 1) that is no preference pair, and its
    field: a missing `rejected`, two equal answers."""
    for number, row in enumerate(rows, start=1):
        problem = preference_problem(row)
        if problem is not None:
            raise ValueError(f"{field}, row {number}: {problem}")
