"""`<prefix>/heartbeat.json`: a training run's sign of life in the artifact store.

Written when training begins and then at most every `INTERVAL_S`, one commit each (see checkpoints.py
for the Hub commit budget). Whoever finds a run without `DONE` can tell from it whether the run was
still making progress, and at which step it stopped.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime

from transformers import TrainerCallback

from loraflow_worker.artifacts import ArtifactStore, ArtifactStoreError

INTERVAL_S = 300.0
"""Least time between two heartbeats: 12 commits an hour at most."""

log = logging.getLogger("loraflow_worker")


class Heartbeat(TrainerCallback):
    """Stores step, loss and time at the start of training and then every `interval_s`."""

    def __init__(self, store: ArtifactStore, run_prefix: str, attempt: int, *, interval_s: float = INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic):
        self.store = store
        self.path = f"{run_prefix}/heartbeat.json"
        self.attempt = attempt
        self.interval_s = interval_s
        self.clock = clock
        self._last: float | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        self._beat(state)

    def on_step_end(self, args, state, control, **kwargs):
        if self.clock() - self._last >= self.interval_s:
            self._beat(state)

    def _beat(self, state) -> None:
        self._last = self.clock()
        losses = [entry["loss"] for entry in state.log_history if "loss" in entry]
        beat = {
            "attempt": self.attempt,
            "step": state.global_step,
            "total_steps": state.max_steps,
            "loss": losses[-1] if losses else None,
            "time": datetime.now(UTC).isoformat(timespec="seconds"),
        }
        try:
            self.store.put({self.path: json.dumps(beat).encode()}, message=f"heartbeat at step {state.global_step}")
        except ArtifactStoreError as e:
            if not e.transient:
                raise  # the final publish would fail the same way, after all the training
            log.warning("heartbeat at step %d not stored (training goes on): %s", state.global_step, e)
