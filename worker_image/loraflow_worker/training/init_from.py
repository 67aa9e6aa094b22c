"""Starting from an adapter (`lora.init_from`): an earlier run's (`runs/<flow run id>` of the artifact store) or a
PEFT adapter on the Hub, fetched, checked against the run's base model and loaded trainable, so that training goes
on from its weights instead of a new adapter's. Its rank, alpha and target modules are the run's: the control plane
made the job's `[lora]` match them before renting (and refused a conflicting one).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from huggingface_hub import snapshot_download
from huggingface_hub.errors import RepositoryNotFoundError
from peft import PeftModel
from trl.trainer.utils import create_model_from_path

from loraflow_worker.artifacts import ArtifactNotFound, ArtifactStore
from loraflow_worker.contract import JobInput

ADAPTER_FILES = ["adapter_config.json", "adapter_model.safetensors", "adapter_model.bin"]
"""What PEFT loads of an adapter folder (a published one may hold a tokenizer and a card too)."""


def fetch_parent_adapter(job: JobInput, store: ArtifactStore, work_dir: Path) -> Path:
    """The folder of `lora.init_from`'s adapter, fetched into `work_dir`. ValueError naming the field when it is not
    there or was trained on another base model."""
    source, dest = job.lora.init_from, work_dir / "parent-adapter"
    try:
        if source.startswith("runs/"):
            store.download(f"{source}/adapter", dest)
        else:  # HF_ENDPOINT and HF_TOKEN in the worker's environment pick the Hub and the token
            snapshot_download(source, local_dir=dest, allow_patterns=ADAPTER_FILES)
    except (ArtifactNotFound, RepositoryNotFoundError):
        pass  # told below, as a folder without its config
    config_file = dest / "adapter_config.json"
    if not config_file.is_file():
        raise ValueError(f"lora.init_from {source!r} holds no adapter_config.json: give an earlier run's `runs/<id>` "
                         "or a Hub repo of a PEFT adapter")
    base = json.loads(config_file.read_text()).get("base_model_name_or_path")
    if base != job.model.id:
        raise ValueError(f"lora.init_from {source!r} was trained on {base!r}, not on model.id {job.model.id!r}: an "
                         "adapter only fits the base model it was trained on")
    return dest


def with_parent_adapter(base: str | Any, parent: Path, model_init_kwargs: dict[str, Any]) -> PeftModel:
    """The base model (a folder, which TRL would have loaded with `model_init_kwargs`, or a model already loaded, e.g.
    in 4 bits) with the parent adapter loaded trainable."""
    model = create_model_from_path(base, **model_init_kwargs) if isinstance(base, str) else base
    return PeftModel.from_pretrained(model, parent, is_trainable=True)
