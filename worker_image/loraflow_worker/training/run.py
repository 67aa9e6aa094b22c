"""What every algorithm's training run shares: its inputs (base model, LoRA shape, the TrainingArguments
the job's settings decide, the workload the fast paths plan for; the data is `data.py`'s), running the trainer to its
end or the job's deadline, and packaging the saved adapter (final, or trained so far) with its metrics and manifest.
`sft.py` and `grpo.py` hold only what differs: the dataset's shape, the TRL config and trainer."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from datasets import Dataset
from peft import LoraConfig, prepare_model_for_kbit_training
from peft.optimizers import create_loraplus_optimizer
from peft.utils import ModulesToSaveWrapper
from transformers import BitsAndBytesConfig, PreTrainedModel, PreTrainedTokenizerBase, Trainer, TrainingArguments
from trl.trainer.utils import create_model_from_path

from loraflow_worker.artifacts.manifest import (
    FastPath,
    LossRecord,
    RunManifest,
    SourceRows,
    library_versions,
    rows_sha256,
    training_config_sha256,
)
from loraflow_worker.contract import CONTRACT_VERSION, JobInput, TrainMetrics
from loraflow_worker.runtime.environment import ALLOC_CONF_ENV
from loraflow_worker.training.checkpoints import save_settings
from loraflow_worker.training.early_stopping import EarlyStopping
from loraflow_worker.training.fast_paths import FastPathPlan, Workload, cuda_allocator_settings
from loraflow_worker.training.monitor import TrainingMonitor
from loraflow_worker.training.tracking import tracker_run_name

if TYPE_CHECKING:
    from loraflow_worker.artifacts import ArtifactStore


@dataclass
class TrainOutcome:
    """A training run that ended, at its last step or at the job's deadline, saved locally and ready to publish."""

    adapter_dir: Path
    metrics: TrainMetrics
    manifest: RunManifest
    total_steps: int
    """Optimizer steps the run was to take (`metrics.steps` is how many it took)."""
    deadline_checkpoint: Path | None
    """When the job's deadline stopped training: the Trainer's checkpoint folder of the last step taken (the
    adapter is then the one trained so far). None when training finished."""
    trajectories: Path | None = None
    """GRPO: the sample of trajectories kept at each logging step (`trajectories.TRAJECTORIES_FILE`), if any."""


TRAINED_ADAPTER = "default"
"""The adapter a run trains, by PEFT's name: a new one (TRL's `get_peft_model`) or `lora.init_from`'s
(`PeftModel.from_pretrained`), both PEFT's default name."""


def use_device() -> bool:
    """Whether CUDA is there; on CPU (tests, demos beside other processes) one thread is fastest for a tiny model."""
    cuda = torch.cuda.is_available()
    if not cuda:
        torch.set_num_threads(1)
    return cuda


def quantization_config(job: JobInput) -> BitsAndBytesConfig | None:
    """How the base is loaded for QLoRA (`lora.quantization` 4bit): nf4 with double quantization, computing in bf16
    (the QLoRA paper's recipe); None for a bf16 base."""
    if job.lora.quantization != "4bit":
        return None
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch.bfloat16)


def load_model(model_path: Path, job: JobInput, plan: FastPathPlan) -> str | PreTrainedModel:
    """What the trainer gets as `model`: the folder, which TRL loads with the plan's `model_init_kwargs`; or, for
    QLoRA, the base loaded in 4 bits and prepared for k-bit training (PEFT's `prepare_model_for_kbit_training`: the
    weights it does not quantize in fp32, input gradients for checkpointing), which TRL's own loading does not do."""
    quantization = quantization_config(job)
    if quantization is None:
        return str(model_path)
    model = create_model_from_path(str(model_path), **plan.model_init_kwargs, quantization_config=quantization)
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=plan.trainer_kwargs["gradient_checkpointing"])


def keep_trainable_in_fp32(model: torch.nn.Module) -> None:
    """Put every trainable tensor of `model` (a PEFT model, its trainer built, its optimizer not yet) in fp32: the
    adapter's matrices and the copies of `lora.modules_to_save` (PEFT's `ModulesToSaveWrapper`). In bf16 a small
    learning rate's update rounds away: AdamW's step, about the learning rate, is under half of bf16's spacing for every
    |w| above lr × 2^9 (0.1 at 2e-4, 0.005 at 1e-5), and the Trainer keeps no fp32 master copy. Who leaves them in
    bf16: PEFT deep-copies a saved module in the base's dtype (a bf16 base's; PEFT upcasts only its tuner layers), and
    TRL 1.16's trainers cast every trainable parameter of a quantized model to bf16 (the QLoRA paper's recipe, which
    trained at 1e-4 to 2e-4), sparing DoRA's magnitudes for this very reason (TRL #7268). The forward still computes in
    bf16 under autocast; a copy whose frozen original is in bf16 hands its output on in bf16, as the original did
    (`_compute_in`), so the layers after it see what they saw before. Tensors start from their values as they were
    (a cast to bf16 already rounded them; a `lora.init_from` adapter's copies hold its trained values)."""
    for wrapper in model.modules():
        if isinstance(wrapper, ModulesToSaveWrapper):
            frozen = next(wrapper.original_module.parameters(), None)
            for trained in wrapper.modules_to_save.values():
                if frozen is not None and frozen.dtype != torch.float32 and any(
                        p.requires_grad and p.dtype != torch.float32 for p in trained.parameters()):
                    _compute_in(trained, frozen.dtype)
    for parameter in model.parameters():
        if parameter.requires_grad and parameter.dtype != torch.float32:
            parameter.data = parameter.data.float()


def _compute_in(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Make `module`, about to hold fp32 weights, take its floating inputs in fp32 (outside autocast a bf16 input and
    an fp32 weight do not multiply: transformers' generate calls the LM head there) and hand its floating outputs on
    in `dtype`, the dtype of the frozen module it copies."""

    def to_fp32(_module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)

    def to_dtype(_module: torch.nn.Module, _args: tuple[Any, ...], output: Any) -> Any:
        return output.to(dtype) if isinstance(output, torch.Tensor) and output.is_floating_point() else output

    module.register_forward_pre_hook(to_fp32)
    module.register_forward_hook(to_dtype)


TRAINABLE_GROUPS = {"lora_magnitude_vector": "dora_magnitude", "lora_": "lora", "modules_to_save": "modules_to_save"}
"""Parameter-name parts that say which group a trainable tensor belongs to, in the order they are tried."""


def trainable_dtypes(model: torch.nn.Module) -> dict[str, str]:
    """The dtype of each group of `model`'s trainable tensors (`TRAINABLE_GROUPS`; `other` for the rest), for the
    manifest: e.g. `{"lora": "float32", "modules_to_save": "float32"}`; a group in several dtypes lists them all."""
    found: dict[str, set[str]] = {}
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            group = next((g for part, g in TRAINABLE_GROUPS.items() if part in name), "other")
            found.setdefault(group, set()).add(str(parameter.dtype).removeprefix("torch."))
    return {group: ", ".join(sorted(dtypes)) for group, dtypes in sorted(found.items())}


def model_and_adapter(model_path: Path, job: JobInput, plan: FastPathPlan, store: ArtifactStore,
                      work_dir: Path) -> tuple[Any, LoraConfig | None]:
    """The trainer's `model` and `peft_config`: the base and a new adapter's config; or, with `lora.init_from`, the
    base with that adapter loaded trainable, and no config (TRL trains the PEFT model it is given)."""
    if job.lora.init_from is None:
        return load_model(model_path, job, plan), lora_config(job)
    from loraflow_worker.training.init_from import fetch_parent_adapter, with_parent_adapter

    parent = fetch_parent_adapter(job, store, work_dir)
    # The base is loaded here with the plan's kwargs; TRL, handed a model, would only warn about them.
    plan.trainer_kwargs.pop("model_init_kwargs", None)
    return with_parent_adapter(load_model(model_path, job, plan), parent, plan.model_init_kwargs), None


def lora_config(job: JobInput) -> LoraConfig:
    lora = job.lora
    return LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        use_dora=lora.use_dora,
        use_rslora=lora.use_rslora,
        # PEFT's default initialisation is `True` (A random, B zero).
        init_lora_weights=True if lora.init == "default" else lora.init,
        modules_to_save=list(lora.modules_to_save) or None,
        task_type="CAUSAL_LM",
    )


class LoraPlusOptimizer:
    """LoRA+ as a transformers optimizer factory (`trainer_optimizer.is_optimizer_factory`: the Trainer instantiates
    it, then calls it with the model it trains): PEFT's `create_loraplus_optimizer` over the PEFT model, with the
    optimizer class `training.optimizer` (or the plan) chose."""

    def __call__(self, model: torch.nn.Module, **kwargs: Any) -> torch.optim.Optimizer:
        return create_loraplus_optimizer(model, **kwargs)


def loraplus_optimizer(args: TrainingArguments, job: JobInput) -> tuple[type, dict[str, Any]]:
    """What the Trainer's `optimizer_cls_and_kwargs` holds for a LoRA+ job: the factory, and PEFT's arguments. The
    optimizer class and its own arguments (betas, eps, bitsandbytes' `optim_bits`, ...) are the ones transformers
    would build for `args.optim` (`Trainer.get_optimizer_cls_and_kwargs`)."""
    optimizer_cls, optimizer_kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
    optimizer_kwargs.pop("lr", None)
    return LoraPlusOptimizer, dict(
        optimizer_cls=optimizer_cls, lr=args.learning_rate, loraplus_lr_ratio=job.lora.loraplus_lr_ratio,
        loraplus_weight_decay=args.weight_decay, **optimizer_kwargs,
    )


def micro_batching(job: JobInput) -> tuple[int, int]:
    """(sequences per device step, gradient accumulation steps): the job's, or a forced micro-batch
    (`memory.micro_batch_size`) with the accumulation that keeps the effective batch (the contract checked that it
    divides it)."""
    t = job.training
    micro = job.memory.micro_batch_size if job.memory else None
    if micro is None:
        return t.batch_size, t.gradient_accumulation_steps
    return micro, t.batch_size * t.gradient_accumulation_steps // micro


def shared_trainer_args(job: JobInput, work_dir: Path) -> dict[str, Any]:
    """The TrainingArguments every algorithm takes from the job's training and evaluation settings. The optimizer
    (`optim`) is the fast-path plan's, which takes the job's `training.optimizer` when it names one."""
    t = job.training
    micro, accumulation = micro_batching(job)
    evaluation = {} if job.evaluation is None else dict(
        # Before the first step, every `every_steps` and after the last (transformers adds that one itself).
        eval_strategy="steps", eval_steps=job.evaluation.every_steps, eval_on_start=True,
        # An evaluation batch is no larger than a training micro-batch, which the memory plan fits; and only the
        # loss is kept, not every batch's logits (a vocabulary's width per token).
        per_device_eval_batch_size=micro, prediction_loss_only=True,
    )
    return dict(
        output_dir=str(work_dir / "trainer"),
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=accumulation,
        learning_rate=t.learning_rate,
        lr_scheduler_type=t.lr_scheduler,
        warmup_steps=t.warmup,
        weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm,
        num_train_epochs=t.epochs,
        max_steps=t.max_steps or -1,
        seed=t.seed,
        logging_steps=t.logging_steps,
        **save_settings(t),
        # TRL's own W&B and MLflow callbacks; tracking.py set their environment before training.
        report_to=list(t.report_to) or "none",
        run_name=tracker_run_name(job),
        disable_tqdm=True,
        **evaluation,
    )


PREFERENCE_LOGS = {"reward_accuracies": "rewards/accuracies", "reward_margins": "rewards/margins",
                   "eval_reward_accuracies": "eval_rewards/accuracies", "eval_reward_margins": "eval_rewards/margins"}
"""`TrainMetrics`' DPO series and the names TRL's DPOTrainer logs them under."""


def preference_series(log_history: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """DPO's accuracy and margin series, training and held-out, from the Trainer's log history (which a resumed run
    restores from its checkpoint), one value per step."""
    return {field: sorted({entry["step"]: float(entry[key]) for entry in log_history
                           if entry.get(key) is not None}.items())
            for field, key in PREFERENCE_LOGS.items()}


def job_workload(job: JobInput) -> Workload:
    """What one micro-batch of `job` asks of GPU memory, for the fast-path plan. A GRPO micro-batch holds
    `batch_size` (or the forced micro-batch's) completions of prompt + completion tokens; a generation round makes
    `batch_size × gradient_accumulation_steps` of them (TRL's `generation_batch_size`, which a forced micro-batch
    keeps)."""
    t = job.training
    micro, _ = micro_batching(job)
    lora = dict(lora_rank=job.lora.rank, lora_dropout=job.lora.dropout, quantization=job.lora.quantization,
                optimizer=t.optimizer, use_dora=job.lora.use_dora, modules_to_save=tuple(job.lora.modules_to_save))
    if job.algorithm == "grpo":
        g = job.grpo
        return Workload(batch_size=micro, seq_len=g.max_prompt_length + g.max_completion_length,
                        generations=t.batch_size * t.gradient_accumulation_steps, **lora)
    return Workload(batch_size=micro, seq_len=t.max_seq_length, **lora)


def check_modules_to_save(model: torch.nn.Module, names: list[str]) -> None:
    """Raise `ValueError` naming `lora.modules_to_save` when one of `names` matched no module of `model` (a PEFT model):
    PEFT 0.21 ignores such a name silently, and the run would train without it."""
    wrapped = [name for name, module in model.named_modules() if isinstance(module, ModulesToSaveWrapper)]
    # PEFT matches a name against the end of each module's full name (`_set_trainable`).
    missing = [name for name in names if not any(full == name or full.endswith(f".{name}") for full in wrapped)]
    if missing:
        raise ValueError(f"`lora.modules_to_save` names {', '.join(missing)}, which the model does not have: name "
                         f"modules of the base model, e.g. lm_head or embed_tokens")


def train_and_save(trainer: Trainer, tokenizer: PreTrainedTokenizerBase, job: JobInput, revision: str | None,
                   work_dir: Path, resume_from: Path | None) -> tuple[Path, float]:
    """Train (from `resume_from` when given) and save the adapter; returns (adapter folder, wall seconds).
    When the job's deadline stopped training first (`TrainingMonitor.deadline_hit`), the adapter saved is the
    one trained so far, and the Trainer has checkpointed the last step (see `package_outcome`). With early stopping
    (an `EarlyStopping` among the trainer's callbacks), the adapter saved is the best evaluation's."""
    check_modules_to_save(trainer.model, job.lora.modules_to_save)
    keep_trainable_in_fp32(trainer.model)
    if job.lora.loraplus_lr_ratio is not None:
        # GRPOTrainer (TRL 1.16) takes no `optimizer_cls_and_kwargs` argument; the Trainer reads the attribute when it
        # builds the optimizer (`Trainer.create_optimizer`), for SFT and GRPO alike.
        trainer.optimizer_cls_and_kwargs = loraplus_optimizer(trainer.args, job)
    initial_adapter = None
    if job.lora.rewrites_base:
        # PiSSA and OLoRA move the adapter's initial value out of the base weights. The adapter as initialised (saved
        # before any checkpoint is loaded into it) lets PEFT convert the trained one into a plain LoRA of the
        # unchanged base (`save_pretrained(path_initial_model_for_weight_conversion=...)`).
        initial_adapter = work_dir / "initial-adapter"
        trainer.model.peft_config[TRAINED_ADAPTER].init_lora_weights = True  # PEFT's recipe: it must not re-initialise
        trainer.model.save_pretrained(initial_adapter)
        trainer.model.peft_config[TRAINED_ADAPTER].init_lora_weights = job.lora.init
    started = time.monotonic()
    trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
    wall_seconds = time.monotonic() - started
    if (stopping := EarlyStopping.of(trainer)) is not None:
        # `training.early_stopping`: the run keeps its best evaluation's adapter, saved below like any other.
        stopping.restore_best(trainer.model, trainer.state.global_step)
    adapter_dir = work_dir / "adapter"
    # Point the adapter at the Hub model and commit, not at this worker's download folder.
    trainer.model.peft_config[TRAINED_ADAPTER].base_model_name_or_path = job.model.id
    trainer.model.peft_config[TRAINED_ADAPTER].revision = revision
    # PEFT's default ("auto") fetches the base model's config.json from the Hub, at its main branch, to see
    # whether the vocabulary was resized: a download even when the model came from the volume. loraflow never resizes
    # it, and LoRA never targets the embeddings (`lora.target_modules` refuses them), so there are none to save.
    trainer.model.save_pretrained(
        # Only the trained adapter: with `lora.init_from`, DPO and GRPO (beta > 0) load their frozen reference beside
        # it as a second adapter, `ref`, which PEFT would save into `ref/`, pointing at this worker's base folder.
        adapter_dir, selected_adapters=[TRAINED_ADAPTER],
        save_embedding_layers=False,
        path_initial_model_for_weight_conversion=str(initial_adapter) if initial_adapter else None,
    )
    tokenizer.save_pretrained(adapter_dir)
    return adapter_dir, wall_seconds


def package_outcome(*, trainer: Trainer, monitor: TrainingMonitor, job: JobInput, revision: str | None,
                    adapter_dir: Path, wall_seconds: float, cuda: bool, fast_paths: dict[str, FastPath],
                    plan: FastPathPlan, rows: Dataset, sources: list[SourceRows],
                    rewards: list[tuple[int, float]] | None = None, loss: LossRecord | None = None,
                    trajectories: Path | None = None) -> TrainOutcome:
    """The metrics and the reproducibility record (manifest) of a run that ended, and where its deadline
    checkpoint is when the deadline ended it."""
    device = f"cuda:0 ({torch.cuda.get_device_name(0)})" if cuda else "cpu"
    evaluations = {monitor.eval_key: monitor.evaluations} if monitor.eval_key else {}
    if job.algorithm == "dpo":
        evaluations |= preference_series(trainer.state.log_history)
    stopping = EarlyStopping.of(trainer)
    metrics = TrainMetrics(
        steps=trainer.state.global_step,
        losses=monitor.losses,
        learning_rates=monitor.learning_rates,
        rewards=rewards or [],
        **evaluations,
        first_loss=monitor.losses[0][1] if monitor.losses else None,
        final_loss=monitor.losses[-1][1] if monitor.losses else None,
        tokens=int(trainer.state.num_input_tokens_seen),
        wall_seconds=wall_seconds,
        device=device,
        early_stopping=stopping.record(trainer.state.global_step, trainer.state.max_steps) if stopping else None,
    )
    manifest = RunManifest(
        contract_version=CONTRACT_VERSION,
        job=job,
        base_model_id=job.model.id,
        base_model_revision=revision,
        device=device,
        seed=job.training.seed,
        libraries=library_versions(),
        fast_paths=fast_paths,
        memory_plan=plan.memory,
        forced_memory_settings=sorted(job.memory.model_dump(exclude_none=True)) if job.memory else [],
        loss=loss,
        cuda_version=torch.version.cuda if cuda else None,
        cuda_allocator_settings=cuda_allocator_settings() if cuda else None,
        cuda_alloc_conf=os.environ.get(ALLOC_CONF_ENV),
        trainable_dtypes=trainable_dtypes(trainer.model),
        dataset_sources=sources,
        dataset_sha256=rows_sha256(rows),
        config_sha256=training_config_sha256(job),
    )
    # TrainingMonitor asked for this save at the deadline; the Trainer writes it as `checkpoint-<step>`.
    deadline_checkpoint = Path(trainer.args.output_dir) / f"checkpoint-{trainer.state.global_step}"
    return TrainOutcome(adapter_dir=adapter_dir, metrics=metrics, manifest=manifest, total_steps=trainer.state.max_steps,
                        deadline_checkpoint=deadline_checkpoint if monitor.deadline_hit else None,
                        trajectories=trajectories)
