"""LoRA supervised fine-tuning: job input in, trained adapter folder + metrics + manifest out.

Straight-line, like `trl/scripts/sft.py`: load data → load model → `SFTTrainer` with a PEFT
`LoraConfig` → train → save the adapter. The same code runs on CUDA (bf16) and on CPU (tests, local
demo) with the GPU-only paths switched off; the manifest records which were in effect.
Publishing to the artifact store is the handler's job.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from datasets import Dataset, load_dataset
from huggingface_hub import HfApi, snapshot_download
from peft import LoraConfig
from transformers import AutoTokenizer, TrainerCallback
from trl import SFTConfig, SFTTrainer

from loraflow_worker.artifacts import ArtifactStore
from loraflow_worker.checkpoints import save_settings
from loraflow_worker.contract import CONTRACT_VERSION, DatasetSource, JobInput, ModelSource, Progress, TrainMetrics
from loraflow_worker.fast_paths import engage_fast_paths, gather_facts, plan_fast_paths
from loraflow_worker.manifest import RunManifest, library_versions, rows_sha256, training_config_sha256
from loraflow_worker.training_monitor import DeadlineReached, TrainingMonitor, check_deadline


@dataclass
class TrainOutcome:
    """A finished training run, saved locally and ready to publish."""

    adapter_dir: Path
    metrics: TrainMetrics
    manifest: RunManifest


def train_sft(job: JobInput, store: ArtifactStore, work_dir: Path, report: Callable[[Progress], None], *,
              callbacks: Sequence[TrainerCallback] = (), resume_from: Path | None = None) -> TrainOutcome:
    """Train a LoRA adapter for `job` inside `work_dir` and save it there. `callbacks` join the
    Trainer's; `resume_from` is a Trainer checkpoint folder to continue from (step, optimizer,
    scheduler, RNG). Raises `DeadlineReached` when the job's deadline passes first."""
    cuda = torch.cuda.is_available()
    if not cuda:
        # The CPU path serves tests and demos next to other processes; one thread is fastest for a tiny model.
        torch.set_num_threads(1)
    report(Progress(stage="loading", message=f"loading dataset and model {job.model.id}"))
    dataset = _load_dataset(job.dataset, store, work_dir)
    model_path, revision = _resolve_model(job.model)
    check_deadline(job.deadline_epoch_s)
    plan = plan_fast_paths(gather_facts(model_path, "sft"))
    os.environ.update(plan.env)  # before the first CUDA allocation: the allocator reads it once

    t = job.training
    args = SFTConfig(
        output_dir=str(work_dir / "trainer"),
        per_device_train_batch_size=t.batch_size,
        gradient_accumulation_steps=t.gradient_accumulation_steps,
        learning_rate=t.learning_rate,
        num_train_epochs=t.epochs,
        max_steps=t.max_steps or -1,
        max_length=t.max_seq_length,
        seed=t.seed,
        logging_steps=t.logging_steps,
        **save_settings(t),
        report_to="none",
        disable_tqdm=True,
        include_num_input_tokens_seen="non_padding",
        **plan.trainer_kwargs,
    )
    lora = LoraConfig(
        r=job.lora.rank,
        lora_alpha=job.lora.alpha,
        lora_dropout=job.lora.dropout,
        target_modules=job.lora.target_modules,
        task_type="CAUSAL_LM",
    )
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    monitor = TrainingMonitor(report, job.deadline_epoch_s)
    trainer = SFTTrainer(
        model=str(model_path),
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=lora,
        callbacks=[monitor, *callbacks],
    )
    fast_paths = engage_fast_paths(plan, trainer.model)
    started = time.monotonic()
    trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
    wall_seconds = time.monotonic() - started
    if monitor.deadline_hit:
        raise DeadlineReached(
            f"deadline reached at step {trainer.state.global_step} of {trainer.state.max_steps}: the job's "
            f"deadline_epoch_s ({job.deadline_epoch_s}) passed before training finished; no adapter was saved"
        )

    adapter_dir = work_dir / "adapter"
    # Point the adapter at the Hub model and commit, not at this worker's download folder.
    trainer.model.peft_config["default"].base_model_name_or_path = job.model.id
    trainer.model.peft_config["default"].revision = revision
    trainer.model.save_pretrained(adapter_dir)
    tokenizer.save_pretrained(adapter_dir)

    device = _device_name(cuda)
    metrics = TrainMetrics(
        steps=trainer.state.global_step,
        losses=monitor.losses,
        first_loss=monitor.losses[0][1] if monitor.losses else None,
        final_loss=monitor.losses[-1][1] if monitor.losses else None,
        tokens=int(trainer.state.num_input_tokens_seen),
        wall_seconds=wall_seconds,
        device=device,
    )
    manifest = RunManifest(
        contract_version=CONTRACT_VERSION,
        job=job,
        base_model_id=job.model.id,
        base_model_revision=revision,
        device=device,
        seed=t.seed,
        libraries=library_versions(),
        fast_paths=fast_paths,
        cuda_version=torch.version.cuda if cuda else None,
        dataset_sha256=rows_sha256(dataset),
        config_sha256=training_config_sha256(job),
    )
    return TrainOutcome(adapter_dir=adapter_dir, metrics=metrics, manifest=manifest)


def _load_dataset(source: DatasetSource, store: ArtifactStore, work_dir: Path) -> Dataset:
    if source.hub_id is not None:
        return load_dataset(source.hub_id, split=source.split)
    local_file = work_dir / "data" / "train.jsonl"
    local_file.parent.mkdir(parents=True, exist_ok=True)
    local_file.write_bytes(store.read_bytes(source.store_path))
    # A single JSONL file is one split, which the `json` builder names "train".
    return load_dataset("json", data_files=str(local_file), split="train", cache_dir=str(work_dir / "datasets-cache"))


def _resolve_model(source: ModelSource) -> tuple[Path, str | None]:
    """The local folder holding the base model, and the Hub commit it came from (None for a local folder)."""
    if Path(source.id).is_dir():
        return Path(source.id), None
    # Pin the commit first and download exactly it, so the manifest names what was trained on even if
    # the branch moves meanwhile. HF_ENDPOINT / HF_TOKEN in the worker's environment pick the Hub.
    sha = HfApi().model_info(source.id, revision=source.revision).sha
    return Path(snapshot_download(source.id, revision=sha)), sha


def _device_name(cuda: bool) -> str:
    return f"cuda:0 ({torch.cuda.get_device_name(0)})" if cuda else "cpu"
