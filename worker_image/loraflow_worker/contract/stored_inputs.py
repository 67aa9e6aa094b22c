"""Pins on what a run stored: the files the control plane put in the artifact store for a job, as their hashes and
the commit that holds them, so that someone else who can write the store cannot change a run once it started."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from loraflow_worker.contract.version import _Strict

Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$", description="A sha256, as 64 lowercase hex digits.")]


class StoredInputs(_Strict):
    """The run's own files as the control plane stored them for the job (`JobInput.inputs`): the worker reads each at
    `revision` and refuses one whose sha256 is not the one recorded here."""

    revision: str | None = Field(
        default=None, min_length=1, max_length=100,
        description="The store commit at which the control plane stored the run's files; the worker reads them there, "
        "not at `main`. None for a `file://` store, which has no revisions (the hashes protect it).")
    sha256: dict[str, Sha256] = Field(
        default_factory=dict,
        description="Store path → sha256 of every file the control plane stored for the run: the dataset files, the "
        "evaluation file, the mix's files, the reward files, the tools and environment files and the chat template. "
        "Every store path the job names must be here.")
