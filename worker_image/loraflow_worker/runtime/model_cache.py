"""Where base models are cached, and which of a model repo's files are fetched.

RunPod mounts an endpoint's network volume at `/runpod-volume`. loraflow keeps one volume per datacenter
as a Hugging Face Hub cache (`<volume>/huggingface/hub`) of the models users train: preload jobs fill it
(preload.py), and a training job on an endpoint with the volume attached downloads its base model there,
so a warm model costs no download. Without a volume, training uses the container's own cache as before. A model
read from the volume is checked against the Hub's hashes first (cache_check.py): other runs can write the volume.

Only Hub model files go on the volume. Triton, Inductor and torch-extension caches and pip's cache hold
code that runs, and the volume is shared by every run in its datacenter: one tenant could plant code for
the next. Those caches stay on the container's disk, and `environment.py` drops any setting that points
into the volume.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from huggingface_hub import HfApi, snapshot_download
from huggingface_hub.utils import filter_repo_objects

from loraflow_worker.contract import ModelSource
from loraflow_worker.runtime.cache_check import check_snapshot

VOLUME_ROOT = "/runpod-volume"
"""Where RunPod mounts an endpoint's network volume."""
VOLUME_PATH_ENV = "LORAFLOW_VOLUME_PATH"
"""Names the volume's folder instead of `VOLUME_ROOT`. A local RunPod stand-in, whose workers are plain
processes, sets it only when the endpoint has a volume attached: naming it is what attaches it."""

OTHER_RUNTIME_PATTERNS = ("original/*", "*.gguf", "*.onnx", "*.msgpack", "*.h5", "*.tflite", "*.ot", "*.ckpt")
"""Copies of the weights for other runtimes (Meta's original checkpoints, llama.cpp, ONNX, Flax,
TensorFlow, TFLite, rust-bert, Lightning): transformers loads none of them, and they can double a repo."""
PICKLE_WEIGHT_PATTERNS = ("*.bin", "*.pth", "*.pt")
"""PyTorch pickle weights: fetched only from repos without safetensors (older models have nothing else)."""
MISTRAL_CONSOLIDATED_PATTERN = "consolidated*.safetensors"
"""Mistral's repos carry their whole model again as `consolidated.safetensors` (mistral-inference's
format) beside the `model-*.safetensors` shards transformers loads: 14.5 GB extra for Mistral-7B-v0.3."""

log = logging.getLogger("loraflow_worker")


def volume_path(env: Mapping[str, str] | None = None) -> Path:
    """Where the network volume is, if the endpoint has one: `LORAFLOW_VOLUME_PATH`, else `/runpod-volume`."""
    env = os.environ if env is None else env
    return Path(env.get(VOLUME_PATH_ENV) or VOLUME_ROOT)


def attached_volume(env: Mapping[str, str] | None = None) -> Path | None:
    """The network volume's folder when one is attached, else None. The folder must exist and be a mount
    point or named by `LORAFLOW_VOLUME_PATH`: a bare `/runpod-volume` folder is the container's own disk,
    and a model "cached" there would vanish with the worker."""
    env = os.environ if env is None else env
    path = volume_path(env)
    if path.is_dir() and (bool(env.get(VOLUME_PATH_ENV)) or os.path.ismount(path)):
        return path
    return None


def hub_cache_dir(volume: Path) -> Path:
    """The Hugging Face Hub cache on the volume (the layout of `HF_HUB_CACHE`)."""
    return volume / "huggingface" / "hub"


def download_ignore_patterns(filenames: Iterable[str]) -> list[str]:
    """What not to fetch of a model repo whose files are `filenames` (`HfApi.model_info().siblings`):
    `ignore_patterns` for `snapshot_download`. Keeps the weights transformers loads, the tokenizer and
    the configs. Preload and training use the same filter, so a preloaded model is complete for training."""
    names = list(filenames)
    ignored = list(OTHER_RUNTIME_PATTERNS)
    safetensors = [n for n in names if n.endswith(".safetensors") and not n.startswith("original/")]
    if safetensors:
        ignored += PICKLE_WEIGHT_PATTERNS
        if any(not Path(n).name.startswith("consolidated") for n in safetensors):
            ignored.append(MISTRAL_CONSOLIDATED_PATTERN)
    return ignored


def fetch_model(repo_id: str, sha: str, filenames: Iterable[str], cache_dir: Path | None) -> Path:
    """Download commit `sha` of model `repo_id` (whose files are `filenames`) into `cache_dir` (None:
    huggingface_hub's default cache), without the files `download_ignore_patterns` leaves out; returns
    the snapshot folder. Files already in the cache are not downloaded again."""
    return Path(snapshot_download(repo_id, revision=sha, cache_dir=cache_dir,
                                  ignore_patterns=download_ignore_patterns(filenames)))


def training_cache_dir() -> Path | None:
    """Where a training job downloads its base model: the volume's Hub cache when a volume is attached
    (a preloaded model is then read, not downloaded), else None (the container's own cache)."""
    volume = attached_volume()
    if volume is None:
        if os.environ.get(VOLUME_PATH_ENV):
            log.warning("%s=%s is not a folder: the base model goes to the container's own cache",
                        VOLUME_PATH_ENV, os.environ[VOLUME_PATH_ENV])
        return None
    log.info("base model cache: the network volume's %s", hub_cache_dir(volume))
    return hub_cache_dir(volume)


def resolve_base_model(source: ModelSource) -> tuple[Path, str | None]:
    """The local folder holding the base model, and the Hub commit it came from (None for a local folder): what
    a training job trains on and a merge job merges into."""
    if Path(source.id).is_dir():
        return Path(source.id), None
    # Pin the commit first and download exactly it, so the manifest names what was trained on even if
    # the branch moves meanwhile. HF_ENDPOINT / HF_TOKEN in the worker's environment pick the Hub. The files'
    # metadata carries their hashes, which a model on the shared volume is checked against (cache_check.py).
    info = HfApi().model_info(source.id, revision=source.revision, files_metadata=True)
    siblings = info.siblings or []
    filenames = [sibling.rfilename for sibling in siblings]
    cache = training_cache_dir()
    snapshot = fetch_model(source.id, info.sha, filenames, cache)
    if cache is not None:
        downloaded = filter_repo_objects(siblings, ignore_patterns=download_ignore_patterns(filenames),
                                         key=lambda sibling: sibling.rfilename)
        check_snapshot(source.id, info.sha, snapshot, cache, downloaded)
    return snapshot, info.sha
