"""Watching a training run from inside the trainer: losses, evaluations, progress updates, the job's deadline."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

from transformers import TrainerCallback

from loraflow_worker.contract import EVAL_METRICS, PROGRESS_EVAL_FIELDS, Progress

PROGRESS_INTERVAL_S = 2.0
"""Least time between two training progress updates (the first and last are always sent)."""


EVAL_PROGRESS = {EVAL_METRICS[metric].log_key: field for field, metric in PROGRESS_EVAL_FIELDS.items()}
"""The key TRL's trainer logs each evaluation metric under → the `Progress` field of its latest value."""


class DeadlineReached(RuntimeError):
    """The job's `deadline_epoch_s` passed before training finished."""


def check_deadline(deadline_epoch_s: float | None) -> None:
    """Raise `DeadlineReached` if the deadline has already passed."""
    if deadline_epoch_s is not None and time.time() >= deadline_epoch_s:
        raise DeadlineReached(
            f"deadline reached before training started: the job's deadline_epoch_s ({deadline_epoch_s}) has passed"
        )


class TrainingMonitor(TrainerCallback):
    """Collects (step, loss) and (step, learning rate) pairs, the latest mean reward (GRPO logs one) and, given `eval_key`, the (step, value)
    pairs of that evaluation metric (`eval_loss` for SFT, `eval_reward` for GRPO); sends progress, with the latest
    evaluation's values (`eval_key`'s and `eval_extras`') and its step, at most every
    `PROGRESS_INTERVAL_S` (plus the first logged loss, each evaluation and the end), and stops training once the
    deadline passes (`deadline_hit` tells), having the Trainer checkpoint that last step first, and not evaluate
    it, so that the run can resume there within the supervisor's grace.

    A run resumed from a checkpoint keeps the losses and evaluations logged before it: the Trainer restores its log
    history from the checkpoint's `trainer_state.json` before training begins."""

    def __init__(self, report: Callable[[Progress], None], deadline_epoch_s: float | None,
                 eval_key: Literal["eval_loss", "eval_reward"] | None = None, eval_extras: tuple[str, ...] = ()):
        self.report = report
        self.deadline_epoch_s = deadline_epoch_s
        self.eval_key = eval_key
        # What each update carries of the latest evaluation: `eval_key`'s value and the extras' (`EVAL_METRICS`
        # names: DPO's held-out reward accuracy and margin), by their progress fields, and its step.
        self._eval_logs = {EVAL_METRICS[metric].log_key for metric in (eval_key, *eval_extras) if metric}
        self._latest_eval: dict[str, float] = {}
        self._eval_step: int | None = None
        self.losses: list[tuple[int, float]] = []
        self.learning_rates: list[tuple[int, float]] = []
        self._evaluations: dict[int, float] = {}  # by step: a resumed run evaluates its first step again
        self.reward: float | None = None
        self.reward_accuracy: float | None = None
        self._accuracy_held_out = False
        self.deadline_hit = False
        self._last_sent = 0.0
        self._logged = False
        self._started: tuple[float, int, int] | None = None  # (time, step, tokens) when this attempt began

    @property
    def evaluations(self) -> list[tuple[int, float]]:
        """(step, value) of `eval_key`, in step order, one per step."""
        return sorted(self._evaluations.items())

    def on_train_begin(self, args, state, control, **kwargs):
        self.losses = [(entry["step"], float(entry["loss"])) for entry in state.log_history if "loss" in entry]
        self.learning_rates = [(entry["step"], float(entry["learning_rate"])) for entry in state.log_history
                               if "learning_rate" in entry]
        self._evaluations = {entry["step"]: float(entry[self.eval_key]) for entry in state.log_history
                             if self.eval_key in entry and entry[self.eval_key] is not None}
        for entry in state.log_history:
            self._note_evaluation(entry["step"], entry)
        self._started = (time.monotonic(), state.global_step, state.num_input_tokens_seen)
        # The first update goes out with the first logged loss (on_log), not before it.
        self._last_sent = time.monotonic()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "reward" in logs:
            self.reward = float(logs["reward"])
        # DPO: the held-out pairs' accuracy once there is one, else the training pairs'.
        if logs and logs.get("eval_rewards/accuracies") is not None:
            self.reward_accuracy, self._accuracy_held_out = float(logs["eval_rewards/accuracies"]), True
        elif logs and logs.get("rewards/accuracies") is not None and not self._accuracy_held_out:
            self.reward_accuracy = float(logs["rewards/accuracies"])
        if logs and "learning_rate" in logs:
            self.learning_rates.append((state.global_step, float(logs["learning_rate"])))
        if logs and "loss" in logs:
            self.losses.append((state.global_step, float(logs["loss"])))
            if not self._logged:  # the first loss of this attempt goes out at once
                self._logged = True
                self._send(state)
        if logs and self.eval_key is not None and logs.get(self.eval_key) is not None:
            self._evaluations[state.global_step] = float(logs[self.eval_key])
        if logs and self._note_evaluation(state.global_step, logs):
            self._send(state)  # an evaluation is rare news: out at once

    def _note_evaluation(self, step: int, logs: dict) -> bool:
        """Keep the evaluation metrics `logs` holds (none: False) as the latest, at `step`."""
        # TRL logs None for a metric no batch had a value for (a reward that returned None for every prompt).
        values = {EVAL_PROGRESS[key]: float(logs[key]) for key in self._eval_logs if logs.get(key) is not None}
        if values:
            self._latest_eval, self._eval_step = values, step
        return bool(values)

    def on_step_end(self, args, state, control, **kwargs):
        passed = self.deadline_epoch_s is not None and time.time() >= self.deadline_epoch_s
        if passed:
            # An evaluation now would eat into the grace in which the results or the checkpoint must be stored.
            control.should_evaluate = False
        # At the last step training stops anyway (DefaultFlowCallback, which runs first, said so): its results are
        # complete and get published, deadline or not.
        if passed and not control.should_training_stop:
            self.deadline_hit = True
            control.should_training_stop = True
            # Saved before the loop ends, within the supervisor's kill grace; train_job.py stores it.
            control.should_save = True
        if time.monotonic() - self._last_sent >= PROGRESS_INTERVAL_S:
            self._send(state)

    def on_train_end(self, args, state, control, **kwargs):
        self._send(state)

    def _send(self, state) -> None:
        self._last_sent = time.monotonic()
        loss = self.losses[-1][1] if self.losses else None
        started_at, first_step, first_tokens = self._started
        elapsed, steps_done = self._last_sent - started_at, state.global_step - first_step
        tokens_per_second = eta_seconds = None
        if elapsed > 0 and steps_done > 0:
            tokens_per_second = round((state.num_input_tokens_seen - first_tokens) / elapsed, 1)
            eta_seconds = round(max(state.max_steps - state.global_step, 0) * elapsed / steps_done, 1)
        self.report(Progress(stage="training", step=state.global_step, total_steps=state.max_steps, loss=loss,
                             reward=self.reward, reward_accuracy=self.reward_accuracy,
                             tokens_per_second=tokens_per_second, eta_seconds=eta_seconds,
                             eval_step=self._eval_step, **self._latest_eval))
