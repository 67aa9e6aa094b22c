"""The run manifest (`runs/<id>/manifest.json`): what produced an adapter, and on what.

Light (pydantic only) so the control plane can read it. Unknown fields are ignored on reading, so a
newer worker's manifest still loads in an older control plane.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from loraflow_worker.contract import JobInput


class FastPath(BaseModel):
    """Whether one speed-up was actually in effect, and why (kernels can fail to engage silently)."""

    engaged: bool = Field(description="True when the fast path was in effect during training.")
    reason: str = Field(description="Why it was or was not engaged, e.g. `no CUDA device`.")


class RunManifest(BaseModel):
    """Everything needed to know how an adapter was made, stored beside it."""

    contract_version: int = Field(description="Job contract version the worker spoke.")
    job: JobInput = Field(description="The validated job input that produced the adapter.")
    base_model_id: str = Field(description="Base model: a Hub model id, or a local folder in local mode.")
    base_model_revision: str | None = Field(
        description="Hub commit sha the base model was downloaded at; None for a local folder."
    )
    device: str = Field(description="Device trained on, e.g. `cpu` or `cuda:0 (NVIDIA H100 80GB HBM3)`.")
    seed: int = Field(description="Random seed used for data order and adapter initialisation.")
    libraries: dict[str, str] = Field(description="Versions of the training libraries, by package name.")
    fast_paths: dict[str, FastPath] = Field(
        description="Speed-ups by name (`bf16`, `liger_kernel`, `flash_linear_attention`) and whether each engaged."
    )
