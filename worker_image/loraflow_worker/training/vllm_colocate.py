"""GRPO's colocated vLLM engine, where loraflow asks more of it than TRL 1.16 does: weights sent to vLLM without
touching the base model, one weight sync per generation round however many tool turns or evaluation batches the
round takes, a count of the syncs for the manifest, an engine seeded from `training.seed`, and a run that goes on with
transformers' `generate` when the engine cannot be built, loaded or generate (unless the job demands vLLM).

    trainer, plan = build_grpo_trainer(build, plan, required, report)   # build(plan) -> RoundSyncGRPOTrainer
    ...train...
    manifest.vllm_weight_syncs = trainer.weight_syncs.record()

**A sync that leaves the base as it was.** TRL's sync (`VLLMGeneration._iter_named_params`,
`trl/generation/vllm_generation.py` 448-469) merges the adapter into the base in place, hands vLLM the merged
weights and unmerges: PEFT adds the fp32 delta into the bf16 weight (`peft/tuners/lora/layer.py` 1008) and subtracts
a bf16-rounded copy of it (1036), so every sync nudges the base for good (19-58 % of a bf16 base's values changed
after 200 syncs, DoRA as badly), and the base is also GRPO's KL reference when `grpo.beta` > 0. The worker's engine
gets `merged_weights` instead: each adapted weight merged into a new tensor (W + scale·B·A, or DoRA's
m/‖W + scale·B·A‖ · (W + scale·B·A), computed as PEFT's merge computes it), one layer at a time, the base never
written.

**One sync per round.** With sleep mode (on for every colocated run: `fast_paths.plan_fast_paths`) TRL's
`VLLMGeneration.generate` puts vLLM to sleep at level 2 after every call, which discards its weights (750-752), so
the next call re-syncs every weight into it first (589-590). A tool-using round calls it once for the round
(`GRPOTrainer._generate`, `trl/trainer/grpo_trainer.py` 2223) and once more per tool turn (`_tool_call_loop`, 2124),
and an evaluation makes a round of each of its batches (`_prepare_inputs`, 1565). `RoundSyncGRPOTrainer._generate`
syncs and wakes vLLM once per round, keeps it awake through the round's turns (TRL's `generate` skips its re-sync,
wake and sleep while `enable_sleep_mode` is off), and puts it to sleep at the round's end: at level 2 after a
training round, as TRL would have; at level 1 after an evaluation batch (the weights kept in host memory, the KV cache
freed), so that the evaluation's next batch, at the same step, wakes them rather than syncing again.

**Seeded.** TRL builds the engine with `seed=accelerator.process_index // tensor_parallel_size` (`_init_vllm`): 0 on
one GPU, whatever `training.seed` says, and vLLM seeds the process's torch generators with it when it starts.
`vllm_engine_kwargs` puts the run's seed in its place (`grpo.vllm_engine_settings` passes it).

**Degrade, never die, where vLLM is the risk.** vLLM 0.33 is past the versions TRL 1.16 supports (0.22-0.31): TRL
builds the engine and loads weights through vLLM's internals (`llm_engine.model_executor.driver_worker.model_runner`,
`vllm_generation.py` 511), which a vLLM release may move. So the engine is built, and its first weight sync made,
before training; when either fails the trainer is built again without vLLM, from a freshly loaded model, and the
manifest's `vllm_colocate`, the progress line and the log say `failed: <error>`. A vLLM call that fails during
training (a sync, a wake, a sleep, a generate) does the same from there on: the round is generated again, from its
start, by transformers' `generate`, and the reason names the step. Out-of-memory failures are not degraded: the
control plane's memory ladder moves vLLM's share for them (`memory/out_of_memory.py`). A job whose
`fast_paths.vllm_colocate` is "require" fails instead (`VllmRequired`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers import GenerationConfig, ProcessorMixin
from trl import GRPOTrainer

from loraflow_worker.artifacts.manifest import FastPath, VllmWeightSyncs
from loraflow_worker.contract import Progress
from loraflow_worker.memory.out_of_memory import exception_memory_kind
from loraflow_worker.training.fast_paths import VLLM_TEXT_ONLY, FastPathPlan

log = logging.getLogger("loraflow_worker")

VLLM_SETTING = "fast_paths.vllm_colocate"
FAILED = "failed: "
"""How the manifest's `vllm_colocate` reason starts when the engine could not be built, loaded or used."""
ERROR_CHARS = 600
"""The most of a failure's text the reason keeps: vLLM's errors can quote whole configurations."""
_DISTRIBUTED_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""What TRL sets for vLLM's external launcher while it builds the engine (`VLLMGeneration._init_vllm`): put back as
it was when the engine is given up, so that the trainer built without it sees the process the plan saw."""


class VllmRequired(RuntimeError):
    """The job demands vLLM (`fast_paths.vllm_colocate` "require") and the colocated engine could not be used."""


class VllmFailed(RuntimeError):
    """A call into the colocated vLLM engine raised (for anything but memory); the original is its `__cause__`."""


def vllm_engine_kwargs(seed: int) -> dict[str, Any]:
    """What the worker puts over TRL's own arguments to `vllm.LLM`: no image or video inputs (`VLLM_TEXT_ONLY`), and
    the run's `training.seed` where TRL passes its process index (0 on one GPU)."""
    return {**VLLM_TEXT_ONLY, "seed": seed}


def merged_weights(model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """`model`'s weights (a PEFT model) as vLLM loads them, under the names TRL's sync gives them
    (`VLLMGeneration._iter_named_params`): each weight of an adapted layer with the active adapters merged into a new
    tensor (`merged_weight`), the other parameters as they are, the adapter's own parameters and the frozen
    originals of `modules_to_save` left out. Lazy: one merged tensor exists at a time. Nothing of `model` is written."""
    from peft.tuners.lora import LoraLayer

    adapted: dict[int, tuple[Any, str]] = {}
    for module in model.modules():
        if isinstance(module, LoraLayer):
            base = module.get_base_layer()
            adapted[id(base.weight)] = (module, "weight")
            if getattr(base, "bias", None) is not None:
                adapted[id(base.bias)] = (module, "bias")
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            name = name.removeprefix("base_model.model.").replace(".base_layer", "")
            if model.prefix in name or "original_module" in name:
                continue
            name = name.replace("_checkpoint_wrapped_module.", "").replace("modules_to_save.default.", "")
            layer, part = adapted.get(id(parameter), (None, None))
            if layer is None:
                yield name, parameter.detach()
            elif part == "weight":
                yield name, merged_weight(layer)
            else:
                yield name, _merged_bias(layer)


def merged_weight(layer: Any) -> torch.Tensor:
    """The weight of a PEFT LoRA `layer` with its active adapters merged, in a new tensor of the base's dtype: what
    `merge_adapter` (hence `merge_and_unload`) would write into the base, computed as PEFT's unsafe merge computes it
    (the fp32 delta added, one rounding), DoRA's as `DoraLinearVariant.merge_unsafe` does; other variants through
    their own `merge_safe`, which returns a new tensor. Raises `ValueError` for a quantized base (4 bits: vLLM does
    not colocate with one) or a DoRA variant on anything but a linear layer."""
    from peft.tuners.lora.variants import DoraLinearVariant
    from peft.utils.other import transpose

    weight = layer.get_base_layer().weight.detach()
    if not weight.is_floating_point():
        raise ValueError(f"cannot merge an adapter into a quantized {type(layer.get_base_layer()).__name__} weight for "
                         "vLLM")
    merged = weight
    for adapter in _unmerged_adapters(layer):
        delta = layer.get_delta_weight(adapter)
        variant = layer.lora_variant.get(adapter)
        if variant is None:
            merged = (merged + delta).to(weight.dtype)
        elif type(variant) is DoraLinearVariant:  # its subclasses (embeddings, convolutions) merge otherwise
            magnitude = layer.lora_magnitude_vector[adapter]
            # The norm of the unmerged weight with this adapter, as `forward` and PEFT's merge compute it.
            norm = magnitude.get_weight_norm(weight, transpose(delta, layer.fan_in_fan_out), scaling=1).detach()
            factor = transpose((magnitude.weight / norm).view(-1, 1), layer.fan_in_fan_out)
            merged = (factor * (merged + delta)).to(weight.dtype)
        elif "Dora" in type(variant).__name__:
            raise ValueError(f"cannot merge DoRA into a {type(layer.get_base_layer()).__name__} for vLLM: only linear "
                             "layers")
        else:
            merged = variant.merge_safe(layer, adapter, merged)
    return merged


def _merged_bias(layer: Any) -> torch.Tensor:
    bias = layer.get_base_layer().bias.detach()
    for adapter in _unmerged_adapters(layer):
        if layer.lora_bias.get(adapter):
            bias = (bias + layer.lora_B[adapter].bias * layer.scaling[adapter]).to(bias.dtype)
    return bias


def _unmerged_adapters(layer: Any) -> list[str]:
    """The adapters `merge_adapter` would merge into `layer`: its active ones, unless they are merged already."""
    if layer.merged:
        return []
    return [adapter for adapter in layer.active_adapters if adapter in layer.lora_A]


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
    """TRL's `GRPOTrainer` whose colocated vLLM engine gets merged temporaries (`merged_weights`), is synced once per
    generation round and, when a call into it fails, is given up for transformers' `generate` (see the module's
    docstring), counting the syncs and generate calls in `weight_syncs`. Without vLLM it is TRL's trainer.
    `vllm_required` (the job demands vLLM) and `report` (progress) are set by `build_grpo_trainer`;
    `vllm_failure` is the manifest's `vllm_colocate` reason once the engine failed during training."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.weight_syncs = SyncCount()
        self.vllm_required = False
        self.report: Callable[[Progress], None] = lambda progress: None
        self.vllm_failure: str | None = None
        self._offloaded_at_step: int | None = None
        """The step whose weights vLLM holds in host memory (level-1 sleep after an evaluation batch), if any."""
        if self.use_vllm:
            self._attach_engine(self.vllm_generation)

    def _attach_engine(self, engine: Any) -> None:
        """Make `engine` (TRL's `VLLMGeneration`) the worker's: weights sent as merged temporaries, its syncs and
        generate calls counted, and its failures raised as `VllmFailed`. On the instance, so that TRL's own calls
        (`generate`'s re-sync, `_generate_single_turn`'s) go through them too."""
        from accelerate.utils import is_peft_model

        if is_peft_model(engine.model):
            engine._iter_named_params = lambda: merged_weights(engine.model)
        engine.sync_weights = self._counted(engine.sync_weights, "sync")
        engine.generate = self._counted(engine.generate, "call")

    def _counted(self, method: Callable[..., Any], what: str) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            result = _vllm_call(method, *args, **kwargs)
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
        evaluating = not self.model.training
        step = self.state.global_step
        if engine._llm_weights_sleeping:  # as the last round's end (or `_first_sync`) left it: never woken twice
            if evaluating and self._offloaded_at_step == step:
                _vllm_call(engine.llm.wake_up, tags=["weights"])  # this step's weights, back from host memory
                engine._llm_weights_sleeping = False
            else:
                engine.sync_weights()  # wakes vLLM's weights and loads the trainer's
        self._offloaded_at_step = None
        # `_generate_single_turn` then finds the weights loaded for this step and does not sync again.
        self._last_loaded_step = step
        _vllm_call(engine.llm.wake_up, tags=["kv_cache"])
        engine.enable_sleep_mode = False  # TRL's `generate` now neither re-syncs, wakes nor sleeps between turns
        try:
            result = super()._generate(prompts)
        except BaseException:
            engine.enable_sleep_mode = True
            with contextlib.suppress(Exception):  # the round failed: free what vLLM holds, as far as it still can
                engine.llm.sleep(level=2)
            engine._llm_weights_sleeping = True
            raise
        engine.enable_sleep_mode = True
        # Level 2 (TRL's) frees weights and KV cache; level 1 keeps the weights in host memory for the evaluation's
        # next batch, which has the same weights.
        _vllm_call(engine.llm.sleep, level=1 if evaluating else 2)
        engine._llm_weights_sleeping = True
        self._offloaded_at_step = step if evaluating else None
        return result

    def _generate_and_score_completions(self, inputs: list) -> Any:
        try:
            return super()._generate_and_score_completions(inputs)
        except VllmFailed as failure:
            self._give_up_vllm(failure.__cause__ or failure)
        # Out of the `except`: the round starts again (its environments reset), generated by transformers.
        return super()._generate_and_score_completions(inputs)

    def _give_up_vllm(self, error: BaseException) -> None:
        """Go on with transformers' `generate` after vLLM raised `error` during training, saying so in the progress,
        the log and (`vllm_failure`) the manifest; `VllmRequired` instead when the job demands vLLM."""
        text = _describe(error)
        where = f"at step {self.state.global_step + 1}" + (" (evaluation)" if not self.model.training else "")
        if self.vllm_required:
            raise VllmRequired(f"`{VLLM_SETTING}` is 'require', and the colocated vLLM engine failed {where}: {text}. "
                               f"Leave `{VLLM_SETTING}` empty to go on with transformers' generate where vLLM fails, "
                               "or set it false") from error
        engine = self.vllm_generation
        if not engine._llm_weights_sleeping:  # it failed awake (a sync or wake between rounds): free what it holds
            with contextlib.suppress(Exception):
                engine.llm.sleep(level=2)
                engine._llm_weights_sleeping = True
        self.use_vllm = False
        self._offloaded_at_step = None
        self._transformers_generation()
        self.vllm_failure = f"{FAILED}{text} {where}; completions from then on come from transformers' generate (slower)"
        log.warning("vllm_colocate: %s", self.vllm_failure)
        self.report(Progress(stage="training", message=f"vllm_colocate: {self.vllm_failure}"))

    def _transformers_generation(self) -> None:
        """The generation settings TRL 1.16's `GRPOTrainer.__init__` makes when it is built without vLLM
        (`grpo_trainer.py` 1154-1175), which `_generate_single_turn` reads once `use_vllm` is off."""
        kwargs: dict[str, Any] = {
            "max_new_tokens": self.max_completion_length, "do_sample": True,
            "pad_token_id": self._tokenizer.pad_token_id, "bos_token_id": self._tokenizer.bos_token_id,
            "eos_token_id": self.eos_token_ids, "temperature": self.temperature, "top_p": self.top_p,
            "top_k": self.top_k, "min_p": self.min_p, "repetition_penalty": self.repetition_penalty,
            "cache_implementation": self.args.cache_implementation,
        }
        if isinstance(self.processing_class, ProcessorMixin):
            kwargs["suppress_tokens"] = [self.model.config.image_token_id]
        kwargs.update(self.args.generation_kwargs or {})
        self.generation_config = GenerationConfig(**kwargs, disable_compile=True)
        self.generation_kwargs = kwargs


def _vllm_call(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`call(*args, **kwargs)`, a call into vLLM: what it raises becomes `VllmFailed`, but for running out of memory
    (the control plane's memory ladder handles that) and a `VllmFailed` already raised by a call within it."""
    try:
        return call(*args, **kwargs)
    except VllmFailed:
        raise
    except Exception as exc:
        if exception_memory_kind(exc) is not None:
            raise
        raise VllmFailed(_describe(exc)) from exc


def _describe(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:ERROR_CHARS]


def build_grpo_trainer(build: Callable[[FastPathPlan], RoundSyncGRPOTrainer], plan: FastPathPlan, required: bool,
                       report: Callable[[Progress], None]) -> tuple[RoundSyncGRPOTrainer, FastPathPlan]:
    """`build(plan)`, and where the plan colocates vLLM, its first weight sync; when building or syncing fails (but
    for running out of memory), `build` again with vLLM off and the failure in the plan's `vllm_colocate`, which the
    progress and the log say too. `VllmRequired` instead when the job demands vLLM (`required`). Returns the trainer
    and the plan it was built with, the trainer told `required` and `report` for a failure during training. `build`
    must load the model afresh each time (PEFT wrapped the failed trainer's)."""
    if not plan.trainer_kwargs.get("use_vllm"):
        return build(plan), plan
    environment = {name: os.environ.get(name) for name in _DISTRIBUTED_ENV}
    trainer = None
    try:
        trainer = build(plan)
        _first_sync(trainer)
        trainer.vllm_required, trainer.report = required, report
        return trainer, plan
    except Exception as exc:  # noqa: BLE001 - whatever vLLM raises, the run goes on without it (or fails naming why)
        if exception_memory_kind(exc) is not None:
            raise
        error = _describe(exc)
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
    """Load the trainer's weights into the new engine once, as the first round will (TRL's own method, uncounted,
    sending the worker's merged weights), and put it back to sleep as TRL built it: a sync that fails, fails here,
    before training."""
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
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
