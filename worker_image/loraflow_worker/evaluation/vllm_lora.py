"""What the pinned vLLM (0.33) takes of a LoRA adapter, read from its `adapter_config.json`: the `max_lora_rank` an
engine must be started with to serve it, and why its LoRA loader would refuse it. Task answering and the benchmarks
start their engines with these rules; the control plane holds a served adapter to the same ones
(`tasks/storage/served_adapters.py`). Light: no torch, no vLLM."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

REQUIRED_FIELDS = ("r", "lora_alpha", "target_modules")  # PEFTHelper.from_dict's [vllm/lora/peft_helper.py]
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's MaxLoRARanks [vllm/config/lora.py]
"""The `max_lora_rank` values vLLM accepts; it refuses a LoRA whose rank is above the one it was started with."""
EMBEDDING_MODULES = ("embed_tokens", "lm_head", "wte", "word_embeddings", "embed_in", "embed_out")
"""Input-embedding and output-head module names of the Hub's causal LMs: vLLM's LoRA layers are the linear
projections, and it refuses an adapter whose weights target these ("expected target modules in [...]",
vllm/lora/lora_model.py)."""
WEIGHT_ONLY_INITS = ("gaussian", "eva", "orthogonal", "mica", "lora_ga")
"""The string `init_lora_weights` vLLM loads (they only set the adapter's first weights); the others (PiSSA, OLoRA,
CorDA, LoftQ) rewrite the base when PEFT loads the adapter, and vLLM refuses them [vllm/lora/peft_helper.py]."""
SAVED_MODULES = ("classifier", "score")
"""The only `modules_to_save` vLLM loads (a classification model's head) [vllm/lora/peft_helper.py]."""
UNIMPLEMENTED_VARIANTS = {"alora_invocation_tokens": "aLoRA", "layer_replication": "layer replication",
                          "use_bdlora": "BD-LoRA", "use_qalora": "QALoRA"}
"""PEFT variants vLLM refuses, by their adapter_config.json field [vllm/lora/peft_helper.py `_validate_features`]."""


def adapter_config(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "adapter_config.json").read_text())


def adapter_rank(config: dict[str, Any]) -> int:
    """The rank vLLM checks against `max_lora_rank`: `r`, or a larger one of `rank_pattern` (per-module ranks)."""
    ranks = [config.get("r"), *(config.get("rank_pattern") or {}).values()]
    ints = [r for r in ranks if isinstance(r, int) and not isinstance(r, bool)]
    if not ints:
        raise ValueError("no integer `r` in it")
    return max(ints)


def max_lora_rank(ranks: Iterable[int]) -> int:
    """The smallest `max_lora_rank` vLLM accepts that serves every one of `ranks` (its LoRA slots are allocated at
    this rank, so no larger one is asked for). ValueError above the largest."""
    largest = max(ranks, default=1)
    allowed = [value for value in VLLM_LORA_RANKS if value >= largest]
    if not allowed:
        raise ValueError(f"LoRA rank {largest} is above {VLLM_LORA_RANKS[-1]}, the largest max_lora_rank vLLM accepts: "
                         "serve a lower-rank adapter")
    return allowed[0]


def vllm_refusals(config: dict[str, Any]) -> list[str]:
    """Why vLLM 0.33's LoRA loader refuses an adapter with this `adapter_config.json`, each in a few words naming
    its field ("uses DoRA (`use_dora`)"); empty when it loads it. vLLM's own checks [vllm/lora/peft_helper.py
    `from_dict`, `_validate_features`, `validate_legal`; vllm/config/lora.py; vllm/lora/lora_model.py]."""
    reasons = []
    if missing := [key for key in REQUIRED_FIELDS if key not in config]:
        reasons.append(f"lacks {', '.join(f'`{key}`' for key in missing)}")
    if config.get("use_dora"):
        reasons.append("uses DoRA (`use_dora`)")
    if saved := unloaded_saved_modules(config):
        reasons.append(f"trains whole modules (`modules_to_save` {', '.join(saved)})")
    if embedding := embedding_targets(config.get("target_modules")):
        reasons.append(f"targets {', '.join(embedding)} (`target_modules`), not only linear projections")
    if trains_biases(config):
        reasons.append("trains biases (`lora_bias` or `bias`)")
    if init := base_rewriting_init(config):
        reasons.append(f"was initialised with `init_lora_weights` {init!r}, which rewrites the base")
    if unimplemented_variants(config):
        reasons.append("uses a PEFT variant vLLM does not implement (aLoRA, layer replication, BD-LoRA or QALoRA)")
    if "r" in config:
        rank = adapter_rank(config)
        if rank > VLLM_LORA_RANKS[-1]:
            reasons.append(f"has rank {rank}, above {VLLM_LORA_RANKS[-1]}, the largest vLLM serves")
    return reasons


def unloaded_saved_modules(config: dict[str, Any]) -> list[str]:
    """The adapter's `modules_to_save` that vLLM does not load (any but a classifier's head)."""
    return [m for m in config.get("modules_to_save") or [] if m not in SAVED_MODULES]


def trains_biases(config: dict[str, Any]) -> bool:
    return bool(config.get("lora_bias")) or config.get("bias", "none") != "none"


def base_rewriting_init(config: dict[str, Any]) -> str | None:
    """The adapter's `init_lora_weights` when it is one that rewrites the base (PiSSA, OLoRA, CorDA, LoftQ, not
    converted to a plain LoRA by PEFT); None otherwise."""
    init = config.get("init_lora_weights", True)
    return init if isinstance(init, str) and init.lower() not in WEIGHT_ONLY_INITS else None


def unimplemented_variants(config: dict[str, Any]) -> list[str]:
    """The PEFT variants the adapter uses that vLLM does not implement, by name."""
    return [name for field, name in UNIMPLEMENTED_VARIANTS.items() if config.get(field)]


def embedding_targets(targets: Any) -> list[str]:
    """The input-embedding and output-head modules `target_modules` names (`EMBEDDING_MODULES`)."""
    names = [targets] if isinstance(targets, str) else targets if isinstance(targets, list) else []
    # A string is PEFT's regex over module names (`all-linear` leaves the head out): the names it spells out.
    return sorted({m for name in names if isinstance(name, str) for m in EMBEDDING_MODULES
                   if re.search(rf"(^|[^A-Za-z0-9_]){m}($|[^A-Za-z0-9_])", name)})
