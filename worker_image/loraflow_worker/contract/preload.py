"""A preload job's input and result: Hub models downloaded into a datacenter's network volume, so that training
jobs on endpoints with that volume attached read them from there."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from loraflow_worker.contract.sources import ModelSource
from loraflow_worker.contract.version import CONTRACT_VERSION, _Strict

MAX_PRELOAD_MODELS = 100
_HUB_MODEL_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
"""`name` or `namespace/name`: what a Hub model id can be, and no local path (`/x`, `./x`, `a/b/c`) is."""


class PreloadInput(_Strict):
    """A preload job's `input`: download Hub models into the network volume's Hugging Face cache, so that
    training jobs on endpoints with that volume attached read them from there instead of downloading them."""

    contract_version: int = Field(default=CONTRACT_VERSION, description="Version of this contract.")
    mode: Literal["preload"] = Field(description="`preload`: what makes this a preload job.")
    run_id: str = Field(
        min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._-]+$", description="An id for this preload sweep, used in logs."
    )
    models: list[ModelSource] = Field(
        min_length=1,
        max_length=MAX_PRELOAD_MODELS,
        description="Hub models to cache, in this order, each at its revision (None: the default branch). Local "
        "paths are refused: only Hub models can be preloaded.",
    )
    deadline_epoch_s: float | None = Field(
        default=None,
        description="Unix time by which the worker must have answered; None means no deadline. Models not cached "
        "by then are reported `failed` with `deadline reached`.",
    )
    remove_others: bool = Field(
        default=False,
        description="Delete every model the volume's Hub cache holds that `models` does not list, before downloading "
        "(a sweep's list is the whole of what the volume should keep: models no longer swept stop filling it).",
    )

    @field_validator("models")
    @classmethod
    def _hub_models_only(cls, models: list[ModelSource]) -> list[ModelSource]:
        for model in models:
            if not _HUB_MODEL_ID.match(model.id) or ".." in model.id:
                raise ValueError(f"{model.id!r} is not a Hub model id (`namespace/name`): only Hub models can be preloaded")
        return models


class PreloadModelResult(_Strict):
    """What a preload job did with one model."""

    id: str = Field(description="The Hub model id, as requested.")
    requested_revision: str | None = Field(description="The revision requested (None: the default branch).")
    revision: str | None = Field(description="The commit sha the revision resolved to; None when it could not be resolved.")
    status: Literal["cached", "downloaded", "failed"] = Field(
        description="`cached`: the volume already held every file; `downloaded`: the missing files were downloaded; "
        "`failed`: see `error` (the volume may hold part of the model, which the next preload completes)."
    )
    size_bytes: int = Field(description="Bytes of the model's files kept on the volume (0 when failed).")
    bytes_downloaded: int = Field(description="Bytes this job downloaded for the model (0 when cached).")
    seconds: float = Field(description="Seconds spent on the model.")
    error: str | None = Field(default=None, description="Why the model failed (`deadline reached`, not found, gated, ...).")


class PreloadResult(_Strict):
    """What the worker returns as a preload job's `output`. Models that failed are reported here; the job
    itself fails only when it could not run at all (no volume, invalid input)."""

    contract_version: int = Field(default=CONTRACT_VERSION, description="Version of this contract.")
    run_id: str = Field(description="The preload sweep's id, from the input.")
    data_center: str | None = Field(description="The worker's datacenter (RunPod's `RUNPOD_DC_ID`); None when not set.")
    volume_path: str = Field(description="Where the network volume is mounted on the worker.")
    models: list[PreloadModelResult] = Field(description="One entry per requested model, in the input's order.")
