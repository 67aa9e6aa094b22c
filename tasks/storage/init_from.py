"""A run that starts from a trained adapter (`lora.init_from`), checked before renting: the adapter is there (an
earlier run's in the artifact store, or a PEFT adapter on the Hub), it was trained on the run's base model, and its
shape becomes the run's (`[lora]`'s rank, alpha, target modules, DoRA, rsLoRA), a different one set in the run
refused naming both. The worker loads it (`loraflow_worker.training.init_from`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from huggingface_hub import hf_hub_download
from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, RepositoryNotFoundError
from loraflow_worker.artifacts import ArtifactNotFound, ArtifactStoreError, open_store
from loraflow_worker.contract import LoraSettings, ModelSource
from loraflow_worker.contract.lora_settings import init_from_problem, target_modules_problem

from tasks.settings import Settings


def read_parent_config(init_from: str, store_url: str, settings: Settings) -> dict[str, Any]:
    """The `adapter_config.json` of `lora.init_from`. ValueError naming the field when it cannot be read (the spec
    refuses a malformed value first, with the same message)."""
    if problem := init_from_problem(init_from):
        raise ValueError(problem)
    token = settings.hf_token.get_secret_value() if settings.hf_token else None
    try:
        if init_from.startswith("runs/"):
            return open_store(store_url, token if store_url.startswith("hf://") else None).read_json(
                f"{init_from}/adapter/adapter_config.json")
        path = hf_hub_download(init_from, "adapter_config.json", endpoint=settings.hf_endpoint, token=token)
        return json.loads(Path(path).read_text())
    except (ArtifactNotFound, EntryNotFoundError, RepositoryNotFoundError) as e:
        where = f"artifact_store {store_url}" if init_from.startswith("runs/") else "the Hub"
        raise ValueError(f"lora.init_from {init_from!r}: no adapter there in {where} ({type(e).__name__}); give an "
                         "earlier run of this store as `runs/<flow run id>` (one that completed), or a Hub repo of a "
                         "PEFT adapter that the run's token can read") from e
    except HfHubHTTPError as e:
        raise ValueError(f"lora.init_from {init_from!r}: the Hub refused its adapter_config.json: {e}") from e
    except ArtifactStoreError as e:  # a path the store refuses, no access, the network: the store's own words
        again = " (a passing failure: try the run again)" if e.transient else ""
        raise ValueError(f"lora.init_from {init_from!r}: its adapter_config.json cannot be read from artifact_store "
                         f"{store_url}{again}: {e}") from e


def adopt_parent_adapter(lora: LoraSettings, model: ModelSource, config: dict[str, Any]) -> LoraSettings:
    """`lora` with the parent adapter's shape. ValueError when it was trained on another base than `model` (a
    resolved source) or `lora` sets a different shape: a setting left at its default takes the adapter's."""
    base = config.get("base_model_name_or_path")
    if base != model.id:
        raise ValueError(f"lora.init_from {lora.init_from!r} was trained on {base!r}, not on model.id {model.id!r}: "
                         "an adapter only fits the base model it was trained on")
    targets = config.get("target_modules")
    shape = {"rank": config.get("r"), "alpha": config.get("lora_alpha"),
             "target_modules": sorted(targets) if isinstance(targets, list) else targets,
             "use_dora": bool(config.get("use_dora")), "use_rslora": bool(config.get("use_rslora"))}
    defaults = LoraSettings()
    conflicts = [f"lora.{name} {_shown(getattr(lora, name))} (the adapter has {_shown(value)})"
                 for name, value in shape.items()
                 if not _same(getattr(lora, name), value) and not _same(getattr(lora, name), getattr(defaults, name))]
    if conflicts:
        raise ValueError(f"lora.init_from {lora.init_from!r} goes on training an adapter of its own shape, but the run "
                         f"sets {'; '.join(conflicts)}: remove those settings or set them to the adapter's")
    if problem := target_modules_problem(shape["target_modules"] or [],
                                         f"lora.init_from {lora.init_from!r}'s `target_modules`"):
        raise ValueError(f"{problem}: start a new adapter (leave `lora.init_from` empty), with `lora.modules_to_save` "
                         "for the layers to train in full")
    return lora.model_copy(update=shape)


def _same(a: Any, b: Any) -> bool:
    return sorted(a) == sorted(b) if isinstance(a, list) and isinstance(b, list) else a == b


def _shown(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (list, str)) else str(value)
