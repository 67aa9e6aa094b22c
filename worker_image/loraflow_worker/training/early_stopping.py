"""Early stopping (`training.early_stopping`): training stops once `patience` held-out evaluations in a row have not
improved on the best by more than `min_delta`, and the run keeps the adapter of its best evaluation.

transformers' own `EarlyStoppingCallback` needs `load_best_model_at_end`, which makes the Trainer save a full
checkpoint at every evaluation and reads the metric from `evaluate()`'s return value; GRPO's `eval_reward` only exists
in what TRL logs, and every checkpoint here is stored in the artifact store (`checkpoints.py`). So the rule is applied
to the logged evaluations (`on_log`, as `TrainingMonitor` reads them), and each improvement snapshots only the trained
adapter's weights, a few MB, into the work folder (`BEST_ADAPTER_FILE`). Training ended, `restore_best` loads the
snapshot back into the model before the adapter is saved the usual way (`run.train_and_save`: PiSSA's conversion,
the Hub base id), so the stored adapter is the best evaluation's whether the run stopped or trained to its end.

The snapshot travels in every checkpoint (`on_save`, before `CheckpointUploader` stores it): an attempt that resumes
from a checkpoint takes the best evaluation's adapter up again with the evaluations of the log history. It is one file
beside the Trainer's, not a folder: transformers loads any folder of a checkpoint that holds adapter weights as one
more adapter when it resumes (`Trainer._load_from_checkpoint`'s `adapter_subdirs`).
"""

from __future__ import annotations

import logging
import math
import shutil
from pathlib import Path

import torch
from peft import get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load_file, save_file
from transformers import Trainer, TrainerCallback

from loraflow_worker.contract import EVAL_METRICS, EarlyStopped, EarlyStoppingSettings

BEST_ADAPTER_FILE = "best-evaluation-adapter.safetensors"
"""The best evaluation's adapter weights, in the work folder and in each checkpoint folder."""

log = logging.getLogger("loraflow_worker")


class EarlyStopping(TrainerCallback):
    """Applies `settings` to the evaluations of `metric` (the algorithm's, unless the settings name one) that the
    Trainer logs, snapshotting the adapter `adapter_name` (PEFT's name of the trained one) into `work_dir` at each
    improvement; `stopped_at` is the step it stopped training at (None: it did not)."""

    def __init__(self, settings: EarlyStoppingSettings, algorithm: str, work_dir: Path, adapter_name: str):
        self.settings = settings
        self.metric = settings.metric_for(algorithm)
        self.better, self.log_key = EVAL_METRICS[self.metric].better, EVAL_METRICS[self.metric].log_key
        self.snapshot = work_dir / BEST_ADAPTER_FILE
        self.adapter_name = adapter_name
        self.best: tuple[int, float] | None = None
        self.waited = 0
        """Evaluations since the best one that did not improve on it."""
        self.stopped_at: int | None = None
        self._evaluated: set[int] = set()

    @staticmethod
    def of(trainer: Trainer) -> EarlyStopping | None:
        """The trainer's early stopping, when its run has one."""
        return next((cb for cb in trainer.callback_handler.callbacks if isinstance(cb, EarlyStopping)), None)

    def improves(self, value: float) -> bool:
        """Whether `value` beats the best so far by more than `min_delta` (the first evaluation always does)."""
        if math.isnan(value):
            return False
        if self.best is None:
            return True
        best = self.best[1]
        delta = self.settings.min_delta
        return value < best - delta if self.better == "lower" else value > best + delta

    def _count(self, step: int, value: float) -> bool:
        """Apply the rule to the evaluation of `step`; True when it is the new best."""
        self._evaluated.add(step)
        if self.improves(value):
            self.best, self.waited = (step, value), 0
            return True
        if self.best is not None:  # a first evaluation without a number has nothing to fall short of
            self.waited += 1
        return False

    def on_train_begin(self, args, state, control, **kwargs):
        # A resumed attempt: the evaluations before its checkpoint are in the log history the Trainer restored from
        # it, the best one's adapter in the checkpoint's snapshot.
        self.best, self.waited, self.stopped_at, self._evaluated = None, 0, None, set()
        for entry in sorted(state.log_history, key=lambda entry: entry["step"]):
            if entry.get(self.log_key) is not None and entry["step"] not in self._evaluated:
                self._count(entry["step"], float(entry[self.log_key]))
        if self.best is None or state.global_step == 0:
            return
        saved = Path(args.output_dir) / f"checkpoint-{state.global_step}" / BEST_ADAPTER_FILE
        if saved.is_file():
            shutil.copyfile(saved, self.snapshot)
            return
        log.warning("the checkpoint of step %d holds no adapter of the best evaluation (step %d): early stopping "
                    "starts again from this attempt's evaluations", state.global_step, self.best[0])
        self.best, self.waited = None, 0

    def on_log(self, args, state, control, logs=None, model=None, **kwargs):
        value = (logs or {}).get(self.log_key)
        # A resumed attempt evaluates its first step again: that evaluation was counted before its checkpoint.
        if value is None or state.global_step in self._evaluated:
            return
        if self._count(state.global_step, float(value)):
            self._save_snapshot(model)
        elif self.waited >= self.settings.patience:
            self.stopped_at = state.global_step
            control.should_training_stop = True
            log.info("early stopping at step %d: %s; the adapter of step %d is kept", state.global_step,
                     self.reason(), self.best[0])

    def on_save(self, args, state, control, **kwargs):
        if self.snapshot.is_file():
            checkpoint = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            if checkpoint.is_dir():
                shutil.copyfile(self.snapshot, checkpoint / BEST_ADAPTER_FILE)

    def reason(self) -> str:
        return (f"{self.metric} did not improve by more than {self.settings.min_delta:g} for "
                f"{self.settings.patience} evaluation{'s' if self.settings.patience > 1 else ''}")

    def _save_snapshot(self, model: torch.nn.Module) -> None:
        weights = get_peft_model_state_dict(model, adapter_name=self.adapter_name, save_embedding_layers=False)
        # Copies on the CPU: no tensor shares storage with another (safetensors refuses that), and training goes on
        # changing the model's own.
        save_file({name: tensor.detach().to("cpu", copy=True).contiguous() for name, tensor in weights.items()},
                  self.snapshot)

    def restore_best(self, model: torch.nn.Module, step: int) -> None:
        """Load the best evaluation's adapter into `model`, which training left at `step`."""
        if self.best is None or self.best[0] == step:
            return  # no evaluation gave a number, or the model is the best one's already
        result = set_peft_model_state_dict(model, load_file(self.snapshot), adapter_name=self.adapter_name)
        if result.unexpected_keys:
            raise RuntimeError(f"the best evaluation's adapter (step {self.best[0]}) does not fit the model: "
                               f"{', '.join(result.unexpected_keys[:5])}")
        log.info("the adapter of step %d (%s %.4f, the best evaluation) replaces the one of step %d", self.best[0],
                 self.metric, self.best[1], step)

    def record(self, step: int, total_steps: int) -> EarlyStopped:
        """What early stopping did, for the run's metrics."""
        return EarlyStopped(
            metric=self.metric, patience=self.settings.patience, min_delta=self.settings.min_delta,
            stopped=self.stopped_at is not None, step=step, total_steps=total_steps,
            best_step=self.best[0] if self.best else None, best_value=self.best[1] if self.best else None,
            reason=self.reason() if self.stopped_at is not None else None,
        )
