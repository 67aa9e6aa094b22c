"""LoRA GRPO: job input in, trained adapter folder + metrics + manifest out (the GRPO twin of `sft.py`).

Straight-line, like `trl/scripts/grpo.py`: load data → prompts → rewards by name → `GRPOTrainer` with a
PEFT `LoraConfig` → train → save the adapter. On a GPU with vLLM installed the completions come from a
vLLM engine colocated with training; elsewhere from transformers' `generate`. The manifest records which
fast paths were in effect. A job selects this with `algorithm: grpo` and a `grpo` section, e.g.

    {"algorithm": "grpo", "training": {"max_steps": 200, "learning_rate": 1e-5, "batch_size": 16},
     "grpo": {"num_generations": 8, "max_completion_length": 512,
              "rewards": [{"name": "numeric_match", "column": "answer"},
                          {"name": "format", "pattern": "^<think>.*</think>", "weight": 0.2}]}}

Prompts come from the dataset's `prompt` column (text, or chat messages), or else from its chat `messages`
without the last assistant turn, whose text becomes the column `answer` for the match rewards.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoTokenizer, PreTrainedTokenizerBase, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from loraflow_worker.artifacts import ArtifactStore
from loraflow_worker.checkpoints import save_settings
from loraflow_worker.contract import CONTRACT_VERSION, GrpoSettings, JobInput, Progress, TrainMetrics
from loraflow_worker.fast_paths import engage_fast_paths, gather_facts, plan_fast_paths
from loraflow_worker.manifest import RunManifest, library_versions, rows_sha256, training_config_sha256
from loraflow_worker.rewards import check_reward_columns, resolve_rewards
from loraflow_worker.sft import TrainOutcome, _device_name, _load_dataset, _resolve_model
from loraflow_worker.training_monitor import DeadlineReached, TrainingMonitor, check_deadline

ANSWER_COLUMN = "answer"
"""Column that holds the last assistant turn of a chat `messages` dataset (the match rewards' reference)."""

log = logging.getLogger("loraflow_worker")


class RewardLog(TrainerCallback):
    """Collects (step, mean total reward) pairs from the trainer's logs."""

    def __init__(self) -> None:
        self.rewards: list[tuple[int, float]] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "reward" in logs:
            self.rewards.append((state.global_step, float(logs["reward"])))


def train_grpo(job: JobInput, store: ArtifactStore, work_dir: Path, report: Callable[[Progress], None], *,
               callbacks: Sequence[TrainerCallback] = (), resume_from: Path | None = None) -> TrainOutcome:
    """Train a LoRA adapter for `job` (algorithm `grpo`) inside `work_dir` and save it there. `callbacks`
    join the Trainer's; `resume_from` is a Trainer checkpoint folder to continue from. Raises
    `DeadlineReached` when the job's deadline passes first, `RewardError` for a reward that cannot be used."""
    settings: GrpoSettings = job.grpo  # JobInput guarantees it for algorithm `grpo`
    cuda = torch.cuda.is_available()
    if not cuda:
        # The CPU path serves tests and demos next to other processes; one thread is fastest for a tiny model.
        torch.set_num_threads(1)
    report(Progress(stage="loading", message=f"loading dataset and model {job.model.id}"))
    rows = _load_dataset(job.dataset, store, work_dir)
    model_path, revision = _resolve_model(job.model)
    check_deadline(job.deadline_epoch_s)

    # TRL pads prompts on the left so that generation continues right after them.
    tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left", truncation_side="left")
    dataset = prompt_dataset(rows, tokenizer, settings.max_prompt_length)
    check_reward_columns(settings.rewards, dataset.column_names)
    reward_funcs, weights = resolve_rewards(settings.rewards)
    plan = plan_fast_paths(gather_facts(model_path, "grpo"))
    os.environ.update(plan.env)  # before the first CUDA allocation: the allocator reads it once

    t = job.training
    extra: dict[str, Any] = {}
    if plan.trainer_kwargs.get("use_vllm"):
        extra["vllm_max_model_length"] = settings.max_prompt_length + settings.max_completion_length
    args = GRPOConfig(
        output_dir=str(work_dir / "trainer"),
        per_device_train_batch_size=t.batch_size,
        gradient_accumulation_steps=t.gradient_accumulation_steps,
        learning_rate=t.learning_rate,
        num_train_epochs=t.epochs,
        max_steps=t.max_steps or -1,
        seed=t.seed,
        logging_steps=t.logging_steps,
        **save_settings(t),
        report_to="none",
        disable_tqdm=True,
        num_generations=settings.num_generations,
        max_completion_length=settings.max_completion_length,
        temperature=settings.temperature,
        beta=settings.beta,
        reward_weights=weights,
        **extra,
        **plan.trainer_kwargs,
    )
    lora = LoraConfig(
        r=job.lora.rank,
        lora_alpha=job.lora.alpha,
        lora_dropout=job.lora.dropout,
        target_modules=job.lora.target_modules,
        task_type="CAUSAL_LM",
    )
    monitor = TrainingMonitor(report, job.deadline_epoch_s)
    reward_log = RewardLog()
    trainer = GRPOTrainer(
        model=str(model_path),
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=lora,
        callbacks=[monitor, reward_log, *callbacks],
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
        rewards=reward_log.rewards,
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
        dataset_sha256=rows_sha256(rows),
        config_sha256=training_config_sha256(job),
    )
    return TrainOutcome(adapter_dir=adapter_dir, metrics=metrics, manifest=manifest)


def prompt_dataset(rows: Dataset, tokenizer: PreTrainedTokenizerBase, max_prompt_length: int) -> Dataset:
    """The GRPO prompts of `rows`: its `prompt` column, or its chat `messages` without the last assistant
    turn (that turn's text becomes the column `answer` unless the dataset has one). Prompts longer than
    `max_prompt_length` tokens (chat template applied) are left out, with a warning."""
    if "prompt" not in rows.column_names:
        if "messages" not in rows.column_names:
            raise ValueError(
                f"a GRPO dataset needs a `prompt` column (text or chat messages) or chat `messages`; this one has "
                f"{', '.join(f'`{c}`' for c in rows.column_names)}"
            )
        has_answer = ANSWER_COLUMN in rows.column_names
        rows = rows.map(lambda row: _split_chat(row["messages"], has_answer), remove_columns=["messages"])

    def fits(row: dict[str, Any]) -> bool:
        prompt = row["prompt"]
        if isinstance(prompt, str):
            return len(tokenizer(prompt)["input_ids"]) <= max_prompt_length
        ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        return len(ids) <= max_prompt_length

    kept = rows.filter(fits)
    dropped = len(rows) - len(kept)
    if not len(kept):
        raise ValueError(
            f"all {len(rows)} prompts are longer than `grpo.max_prompt_length` ({max_prompt_length} tokens): raise it"
        )
    if dropped:
        log.warning("left out %d of %d prompts longer than grpo.max_prompt_length (%d tokens)", dropped, len(rows), max_prompt_length)
    return kept


def _split_chat(messages: list[dict[str, str]], has_answer: bool) -> dict[str, Any]:
    if messages and messages[-1]["role"] == "assistant":
        prompt, answer = messages[:-1], messages[-1]["content"]
    else:
        prompt, answer = messages, ""
    return {"prompt": prompt} if has_answer else {"prompt": prompt, ANSWER_COLUMN: answer}
