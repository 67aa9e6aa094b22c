"""A merge job's input and result: a stored run's adapter merged into its base model (bf16) and published as a
Hub model repo that `transformers` and vLLM load without PEFT.

The control plane runs it on a CPU endpoint sized from the model's bytes (`tasks/jobs/merge.py` says why a CPU
worker and not the training GPU): nothing in a merge needs a GPU.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from loraflow_worker.contract.sources import ModelSource
from loraflow_worker.contract.stored_inputs import Sha256
from loraflow_worker.contract.version import CONTRACT_VERSION, _Strict

HUB_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
"""`<namespace>/<name>`, as the Hub names a repo (the control plane's `PublishSpec` checks the same rule)."""
DEFAULT_LOGITS_RTOL = 0.02
"""The default tolerance of the logits check, as a share of the largest logit magnitude on the probe inputs. Both
sides run in bf16 (about 3 significant digits), and the merged weights are rounded to bf16 once more, so they differ
by bf16 noise: well under 1 % of the logits' scale on the tiny test model and on real ones. A merge that went wrong
(a wrong scaling, the wrong base, a 4-bit base) moves logits by the adapter's whole effect, far more."""


class MergeInput(_Strict):
    """A merge job's `input`: merge run `run_id`'s stored adapter (`runs/<run_id>/adapter` in `artifact_store`) into
    its base model, check the merged model's logits against base + adapter, and publish it to `merged_model_id`."""

    contract_version: int = Field(default=CONTRACT_VERSION, description="Version of this contract.")
    mode: Literal["merge"] = Field(description="`merge`: what makes this a merge job.")
    run_id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._-]+$",
                        description="The run whose adapter is merged (its Prefect flow run id).")
    run_name: str = Field(min_length=1, max_length=200, description="The run's name, for the model card.")
    artifact_store: str = Field(min_length=1, max_length=1024,
                                description="The run's artifact store URL: `file:///abs/path` or "
                                "`hf://datasets/<org>/<repo>`.")
    base_model: ModelSource = Field(description="The base model the adapter was trained on (the run's manifest: a "
                                    "Hub id pinned to a commit, or a local folder in local mode).")
    adapter_revision: str | None = Field(
        default=None, min_length=1, max_length=100,
        description="The store commit that holds the run's adapter (the run's `JobResult.revision`): the adapter is read "
        "there, not at `main`. None: the latest (a `file://` store, or a result that names no commit).")
    adapter_sha256: dict[str, Sha256] = Field(
        default_factory=dict,
        description="Path relative to the adapter folder → sha256 of each adapter file, as the run stored it (its "
        "`JobResult.adapter_sha256`): the merge refuses an adapter that differs. Empty: nothing to check (a run stored "
        "before contract version 10).")
    quantization: Literal["none", "4bit"] = Field(
        default="none", description="The run's `lora.quantization`. A QLoRA adapter (`4bit`) is merged into the bf16 "
        "base all the same, never into a 4-bit one: merged 4-bit weights would be requantized, and neither "
        "transformers nor vLLM would load them as a plain model.")
    merged_model_id: str = Field(description="The Hub model repo to publish the merged model to, `<org>/<name>`.")
    private: bool = Field(default=True, description="Create the repo private. An existing repo keeps its visibility.")
    adapter_repo: str | None = Field(
        default=None, description="Where the card says the adapter is: the run's published adapter repo "
        "(`publish.hub_model_id`); None: its URL in the artifact store.")
    logits_tolerance: float | None = Field(
        default=None, ge=0,
        description="Largest absolute difference allowed between the merged model's logits and base + adapter's on "
        f"the probe inputs; None: {DEFAULT_LOGITS_RTOL:g} × the largest logit magnitude (bf16 noise passes, a "
        "wrong merge does not). Beyond it the merge fails and nothing is published.")
    deadline_epoch_s: float | None = Field(
        default=None, description="Unix time by which the worker must have answered; None means no deadline.")

    @field_validator("merged_model_id", "adapter_repo")
    @classmethod
    def _hub_repo_id(cls, repo_id: str | None) -> str | None:
        if repo_id is not None and (not HUB_REPO_ID.match(repo_id) or "--" in repo_id or ".." in repo_id):
            raise ValueError(f"{repo_id!r} is not a Hub repo id (`<org>/<name>`)")
        return repo_id


class LogitsCheck(_Strict):
    """The merged model's logits against base + adapter (PEFT, unmerged) on the same fixed inputs."""

    inputs: int = Field(description="Probe inputs compared.")
    tokens: int = Field(description="Token positions compared, over all inputs.")
    max_abs_difference: float = Field(description="Largest absolute difference between the two models' logits.")
    reference_max_abs: float = Field(description="Largest logit magnitude of base + adapter: the logits' scale.")
    tolerance: float = Field(description="Largest difference allowed (absolute).")
    adapter_effect: float | None = Field(
        default=None, description="Largest absolute difference between base + adapter and the base alone (the adapter "
        "switched off): what the merge must carry over. A check whose tolerance is above it cannot tell a merged model "
        "from the base; None: not measured.")
    passed: bool = Field(description="`max_abs_difference` is within `tolerance` and, where the adapter moves the logits "
                         "by more than bf16's resolution at their scale, under half of `adapter_effect` (the merge "
                         "carried the adapter over, not just left the base within the tolerance).")


class MergeResult(_Strict):
    """What the worker returns as a merge job's `output`."""

    contract_version: int = Field(default=CONTRACT_VERSION, description="Version of this contract.")
    run_id: str = Field(description="The run whose adapter was merged.")
    merged_model_id: str = Field(description="The Hub model repo the merged model is in.")
    url: str = Field(description="The repo's page.")
    commit_url: str = Field(description="The commit that holds this run's merged model.")
    already_merged: bool = Field(
        default=False, description="The repo already had this run's merge commit (a redelivered job): nothing was "
        "merged or committed again; the figures are that commit's.")
    base_model: str = Field(description="The base model's Hub id (or local folder).")
    base_model_revision: str | None = Field(description="The base model's commit; None for a local folder.")
    adapter: str = Field(description="Where the adapter is: its Hub repo, or its URL in the artifact store.")
    logits_check: LogitsCheck
    merged_bytes: int = Field(description="Bytes of the merged model's weight files.")
    seconds: float = Field(description="Seconds the job took.")
    data_center: str | None = Field(default=None, description="The worker's datacenter (`RUNPOD_DC_ID`); None when "
                                    "not set.")
