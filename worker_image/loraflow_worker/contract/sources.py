"""What a run trains on: the base model and the dataset (one source, or a mixture of sources)."""

from __future__ import annotations

import math

from pydantic import Field, field_validator, model_validator

from loraflow_worker.contract.dataset_formats import DatasetFormat, columns_problem
from loraflow_worker.contract.version import _Strict

MAX_MIX_SOURCES = 16


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


class RowFormat(_Strict):
    """How a source's rows are laid out: the format and the dataset's own column names. The worker converts them to
    TRL's conversational formats (`dataset_formats.to_trl_row`) before training."""

    format: DatasetFormat = Field(
        default="auto",
        description="`auto`: rows in TRL's conversational formats (`messages`, or `prompt` and `completion`, or "
        "prompt-only `prompt`). `alpaca`: `instruction`, optional `input`, `output`, optional `system`; trained as a "
        "prompt (system, then the instruction and the input as one user turn) and a completion (the output). "
        "`sharegpt`: `conversations`, a list of `{\"from\": ..., \"value\": ...}` turns (`from`: human or user, gpt "
        "or assistant, system, tool); trained as `messages`.",
    )
    columns: dict[str, str] = Field(
        default_factory=dict,
        max_length=8,
        description="The format's names → the dataset's own, for those that differ, e.g. `{messages = "
        "\"conversation\"}`, or for alpaca `{instruction = \"question\", output = \"answer\"}`; for sharegpt also the "
        "turns' keys, `{conversations = \"dialog\", from = \"speaker\", value = \"text\"}`. Empty: the format's own "
        "names.",
    )

    @model_validator(mode="after")
    def _columns_of_the_format(self) -> RowFormat:
        problem = columns_problem(self.format, self.columns)
        if problem:
            raise ValueError(problem)
        return self


class SourceFields(RowFormat):
    """One source of rows: a Hub dataset (at a config, revision and split), or a JSONL file in the artifact store."""

    hub_id: str | None = Field(
        default=None,
        max_length=512,
        description="Hugging Face Hub dataset id, e.g. `trl-lib/Capybara`. Leave empty when using a "
        "file in the artifact store.",
    )
    config: str | None = Field(
        default=None, max_length=256,
        description="The Hub dataset's config (subset), e.g. `main`: `load_dataset(hub_id, config, ...)`. None: the "
        "dataset's only (or default) config.",
    )
    revision: str | None = Field(
        default=None, max_length=256,
        description="The Hub dataset's revision (branch, tag or commit sha). None: its default branch.",
    )
    split: str = Field(default="train", max_length=128, description="Dataset split to train on.")
    store_path: str | None = Field(
        default=None,
        max_length=1024,
        description="Path of a JSONL file inside the artifact store (set by the control plane when it "
        "publishes a local dataset file).",
    )

    def _one_source_problem(self) -> str | None:
        if (self.hub_id is None) == (self.store_path is None):
            return "give exactly one of `hub_id` (a Hub dataset) or `store_path` (a file in the store)"
        hub_only = [f"`{name}`" for name in ("config", "revision") if getattr(self, name) is not None]
        if self.store_path is not None and hub_only:
            return (f"{' and '.join(hub_only)} {'apply' if len(hub_only) > 1 else 'applies'} to a Hub dataset "
                    "(`hub_id`) only: remove it for a file")
        return None


class MixSource(SourceFields):
    """One source of a mixture, with its share of the examples."""

    fraction: float = Field(
        gt=0.0, le=1.0,
        description="The probability that each training example is drawn from this source (the fractions of a mix "
        "sum to 1).",
    )

    @model_validator(mode="after")
    def _one_source(self) -> MixSource:
        problem = self._one_source_problem()
        if problem:
            raise ValueError(problem)
        return self


class DatasetSource(SourceFields):
    """Where the training examples come from: a Hub dataset, a file in the run's artifact store, or a mixture of
    such sources (`mix`)."""

    mix: list[MixSource] = Field(
        default_factory=list,
        max_length=MAX_MIX_SOURCES,
        description="A mixture of sources, in place of the fields above: examples are drawn at random (seeded with "
        "`training.seed`) from source i with probability `fraction` i, until one source has no examples left "
        "(`datasets.interleave_datasets`, stopping strategy `first_exhausted`): no example is repeated, and the "
        "mixture is as large as the first source to run out allows. The manifest records how many examples each "
        "source gave.",
    )

    @field_validator("mix")
    @classmethod
    def _fractions_sum_to_one(cls, mix: list[MixSource]) -> list[MixSource]:
        if len(mix) == 1:
            raise ValueError("a mix needs at least 2 sources; give a single source without `mix`")
        total = sum(source.fraction for source in mix)
        if mix and not math.isclose(total, 1.0, abs_tol=1e-6):
            raise ValueError(f"the fractions of a mix are probabilities and must sum to 1; these sum to {total:g} "
                             f"({', '.join(f'{s.fraction:g}' for s in mix)})")
        return mix

    @model_validator(mode="after")
    def _exactly_one_source(self) -> DatasetSource:
        if self.mix:
            # By value, not by what was set: the job arrives as JSON with every field written out.
            beside = [name for name, field in SourceFields.model_fields.items()
                      if getattr(self, name) != field.get_default(call_default_factory=True)]
            if beside:
                raise ValueError(f"{', '.join(f'`{f}`' for f in beside)} beside `mix`: each mix entry is a source of "
                                 "its own; move them into the entries")
            return self
        problem = self._one_source_problem()
        if problem:
            raise ValueError(problem)
        return self

    def sources(self) -> list[SourceFields]:
        """The sources rows come from: the mix's entries, or this one source."""
        return list(self.mix) or [self]
