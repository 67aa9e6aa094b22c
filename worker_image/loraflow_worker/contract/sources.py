"""What a run trains on: the base model and the dataset."""

from __future__ import annotations

from pydantic import Field, model_validator

from loraflow_worker.contract.version import _Strict


class ModelSource(_Strict):
    """The base model to fine-tune."""

    id: str = Field(
        min_length=1,
        max_length=512,
        description="Hugging Face Hub model id (`Qwen/Qwen3-0.6B`), or a local directory path in local "
        "mode (the worker must be able to read it).",
    )
    revision: str | None = Field(
        default=None,
        max_length=256,
        description="Hub revision (branch, tag or commit sha). None means the repo's default branch; "
        "the run manifest records the commit actually used.",
    )


class DatasetSource(_Strict):
    """Where the training examples come from: a Hub dataset, or a file in the run's artifact store."""

    hub_id: str | None = Field(
        default=None,
        max_length=512,
        description="Hugging Face Hub dataset id, e.g. `trl-lib/Capybara`. Leave empty when using a "
        "file in the artifact store.",
    )
    split: str = Field(default="train", max_length=128, description="Dataset split to train on.")
    store_path: str | None = Field(
        default=None,
        max_length=1024,
        description="Path of a JSONL file inside the artifact store (set by the control plane when it "
        "publishes a local dataset file).",
    )

    @model_validator(mode="after")
    def _exactly_one_source(self) -> DatasetSource:
        if (self.hub_id is None) == (self.store_path is None):
            raise ValueError("give exactly one of `hub_id` (a Hub dataset) or `store_path` (a file in the store)")
        return self
