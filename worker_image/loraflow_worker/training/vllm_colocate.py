"""GRPO's colocated vLLM engine, where loraflow asks more of it than TRL 1.16 does: one weight sync per generation
round however many tool turns the round takes, a count of the syncs for the manifest, and a run that goes on with
transformers' `generate` when the engine cannot be built or loaded (unless the job demands vLLM).

    trainer, plan = build_grpo_trainer(build, plan, required, report)   # build(plan) -> RoundSyncGRPOTrainer
    ...train...
    manifest.vllm_weight_syncs = trainer.weight_syncs.record()

**One sync per round.** With sleep mode (on for every colocated run: `fast_paths.plan_fast_paths`) TRL's
`VLLMGeneration.generate` puts vLLM to sleep at level 2 after every call, which discards its weights
(`trl/generation/vllm_generation.py` 750-752), so the next call re-syncs every weight into it first (589-590). A
tool-using round calls it once for the round (`GRPOTrainer._generate`, `trl/trainer/grpo_trainer.py` 2223) and once
more per tool turn (`_tool_call_loop`, 2124; both through `_generate_single_turn`, 1763): 1 + turns full syncs of
the same weights, each merging the adapter into the bf16 base and unmerging it again, which drifts the base a little
every time. `RoundSyncGRPOTrainer._generate` (one call per round, training or evaluation) syncs and wakes vLLM once,
keeps it awake through the round's turns (TRL's `generate` skips its re-sync, wake and sleep while
`enable_sleep_mode` is off), and puts it to sleep at the round's end as TRL would have after the last turn.

**Degrade, never die, where vLLM is the risk.** vLLM 0.33 is past the versions TRL 1.16 supports (0.22-0.31): TRL
builds the engine and loads weights through vLLM's internals (`llm_engine.model_executor.driver_worker.model_runner`,
`vllm_generation.py` 511), which a vLLM release may move. So the engine is built, and its first weight sync made,
before training; when either fails the trainer is built again without vLLM, from a freshly loaded model (a sync that
failed between PEFT's `merge_adapter` and `unmerge_adapter`, lines 448-469, leaves the adapter merged into the base),
and the manifest's `vllm_colocate`, the progress line and the log say `failed: <error>`. Out-of-memory failures are
not degraded: the control plane's memory ladder moves vLLM's share for them (`memory/out_of_memory.py`). A job whose
`fast_paths.vllm_colocate` is "require" fails instead (`VllmRequired`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
from collections import Counter
from collections.abc import Callable
from typing import Any

from trl import GRPOTrainer

from loraflow_worker.artifacts.manifest import FastPath, VllmWeightSyncs
from loraflow_worker.contract import Progress
from loraflow_worker.memory.out_of_memory import exception_memory_kind
from loraflow_worker.training.fast_paths import FastPathPlan

log = logging.getLogger("loraflow_worker")

VLLM_SETTING = "fast_paths.vllm_colocate"
FAILED = "failed: "
"""How the manifest's `vllm_colocate` reason starts when the engine could not be built or loaded."""
ERROR_CHARS = 600
"""The most of a failure's text the reason keeps: vLLM's errors can quote whole configurations."""
_DISTRIBUTED_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""What TRL sets for vLLM's external launcher while it builds the engine (`VLLMGeneration._init_vllm`): put back as
it was when the engine is given up, so that the trainer built without it sees the process the plan saw."""


class VllmRequired(RuntimeError):
    """The job demands vLLM (`fast_paths.vllm_colocate` "require") and the colocated engine could not be used."""


class SyncCount:
    """Weight syncs into vLLM and vLLM generate calls, by the optimizer step whose completions they made (the step
    the trainer is about to take: `global_step` + 1), evaluation rounds apart."""

    def __init__(self) -> None:
        self.syncs: Counter[int] = Counter()
        self.calls: Counter[int] = Counter()
        self.evaluation_syncs = 0

    def record(self) -> VllmWeightSyncs:
        return VllmWeightSyncs(per_step=dict(sorted(self.syncs.items())),
                               generate_calls_per_step=dict(sorted(self.calls.items())),
                               evaluation_syncs=self.evaluation_syncs)


class RoundSyncGRPOTrainer(GRPOTrainer):
    """TRL's `GRPOTrainer` whose colocated vLLM engine is synced once per generation round (see the module's
    docstring), counting the syncs and generate calls in `weight_syncs`. Without vLLM it is TRL's trainer."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.weight_syncs = SyncCount()
        if self.use_vllm:
            engine = self.vllm_generation
            # On the instance, so that TRL's own calls (`generate`'s re-sync, `_generate_single_turn`'s) count too.
            engine.sync_weights = self._counted(engine.sync_weights, "sync")
            engine.generate = self._counted(engine.generate, "call")

    def _counted(self, method: Callable[..., Any], what: str) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            result = method(*args, **kwargs)
            if not self.model.training:
                self.weight_syncs.evaluation_syncs += what == "sync"
            else:
                (self.weight_syncs.syncs if what == "sync" else self.weight_syncs.calls)[self.state.global_step + 1] += 1
            return result

        return counted

    def _generate(self, prompts: list) -> Any:
        engine = self.vllm_generation if self.use_vllm else None
        if engine is None or engine.mode != "colocate" or not engine.enable_sleep_mode:
            return super()._generate(prompts)
        if engine._llm_weights_sleeping:  # as the last round's end (or `_first_sync`) left it: never woken twice
            engine.sync_weights()  # wakes vLLM's weights and loads the trainer's
        # `_generate_single_turn` then finds the weights loaded for this step and does not sync again.
        self._last_loaded_step = self.state.global_step
        engine.llm.wake_up(tags=["kv_cache"])
        engine.enable_sleep_mode = False  # TRL's `generate` now neither re-syncs, wakes nor sleeps between turns
        try:
            return super()._generate(prompts)
        finally:
            engine.enable_sleep_mode = True
            engine.llm.sleep(level=2)  # what TRL's `generate` did after each turn: weights and KV cache freed
            engine._llm_weights_sleeping = True


def build_grpo_trainer(build: Callable[[FastPathPlan], RoundSyncGRPOTrainer], plan: FastPathPlan, required: bool,
                       report: Callable[[Progress], None]) -> tuple[RoundSyncGRPOTrainer, FastPathPlan]:
    """`build(plan)`, and where the plan colocates vLLM, its first weight sync; when building or syncing fails (but
    for running out of memory), `build` again with vLLM off and the failure in the plan's `vllm_colocate`, which the
    progress and the log say too. `VllmRequired` instead when the job demands vLLM (`required`). Returns the trainer
    and the plan it was built with. `build` must load the model afresh each time."""
    if not plan.trainer_kwargs.get("use_vllm"):
        return build(plan), plan
    environment = {name: os.environ.get(name) for name in _DISTRIBUTED_ENV}
    trainer = None
    try:
        trainer = build(plan)
        _first_sync(trainer)
        return trainer, plan
    except Exception as exc:  # noqa: BLE001 - whatever vLLM raises, the run goes on without it (or fails naming why)
        if exception_memory_kind(exc) is not None:
            raise
        error = " ".join(f"{type(exc).__name__}: {exc}".split())[:ERROR_CHARS]
        if required:
            raise VllmRequired(f"`{VLLM_SETTING}` is 'require', and the colocated vLLM engine could not be used: "
                               f"{error}. Leave `{VLLM_SETTING}` empty to go on with transformers' generate where "
                               "vLLM fails, or set it false") from exc
        if trainer is not None:  # built, but its first sync failed: vLLM's own pool is not torch's to free
            with contextlib.suppress(Exception):
                trainer.vllm_generation.llm.sleep(level=2)
    # Out of the `except`, whose frames hold a trainer that failed to build, and with it its model.
    trainer = None
    _release(environment)
    reason = f"{FAILED}{error}; completions come from transformers' generate (slower)"
    log.warning("vllm_colocate: %s", reason)
    report(Progress(stage="loading", message=f"vllm_colocate: {reason}"))
    fallback = without_vllm(plan, reason)
    return build(fallback), fallback


def without_vllm(plan: FastPathPlan, reason: str) -> FastPathPlan:
    """`plan` with vLLM off for `reason`: TRL generates with the training model."""
    kwargs = {name: value for name, value in plan.trainer_kwargs.items() if not name.startswith("vllm_")}
    fast_paths = {**plan.fast_paths, "vllm_colocate": FastPath(engaged=False, reason=reason)}
    return dataclasses.replace(plan, fast_paths=fast_paths, trainer_kwargs={**kwargs, "use_vllm": False})


def _first_sync(trainer: RoundSyncGRPOTrainer) -> None:
    """Load the trainer's weights into the new engine once, as the first round will (TRL's own method, uncounted),
    and put it back to sleep as TRL built it: a sync that fails, fails here, before training."""
    engine = trainer.vllm_generation
    type(engine).sync_weights(engine)
    if engine.mode == "colocate" and engine.enable_sleep_mode:
        engine.llm.sleep(level=2)
        engine._llm_weights_sleeping = True


def _release(environment: dict[str, str | None]) -> None:
    for name, value in environment.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    gc.collect()
    with contextlib.suppress(Exception):
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
