"""DPO's section of a job: how strongly the adapter may move from its reference, and the preference loss."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from loraflow_worker.contract.lora_settings import LoraSettings, reference_problems
from loraflow_worker.contract.training_settings import TrainingSettings, sft_only_settings
from loraflow_worker.contract.version import _Strict

DpoLoss = Literal["sigmoid", "hinge", "ipo", "robust", "bco_pair", "sppo_hard", "nca_pair", "apo_zero", "apo_down",
                  "discopop", "sigmoid_norm"]
"""TRL's paired DPO losses (`DPOConfig.loss_type`); its unpaired and SFT-mixing ones are left out."""
REFUSED_DPO_LOSSES = {
    "exo_pair": "TRL 1.16's DPOTrainer refuses it when training starts unless `label_smoothing` is above 0 (the EXO "
                "paper's 1e-3), and loraflow does not take a label smoothing",
}
"""TRL's paired losses a run cannot use, and why."""


class DpoSettings(_Strict):
    """Direct preference optimisation: the adapter learns to prefer each row's `chosen` answer over its `rejected`
    one, measured against a reference that does not train: the base model with the adapter switched off (no second
    copy of the weights), or, with `lora.init_from`, a frozen copy of the adapter the run starts from."""

    beta: float = Field(
        default=0.1, gt=0.0, le=10.0,
        description="How far the adapter may move from the reference (TRL's `beta`): higher keeps it closer. "
        "0.1 is TRL's and the DPO paper's default; 0.01-0.5 is the usual range.",
    )
    loss_type: DpoLoss = Field(
        default="sigmoid",
        description="The preference loss, by TRL's name: `sigmoid` (the DPO paper's), `ipo` (IPO, for pairs whose "
        "preference is noisy), `hinge` (SLiC), `robust` (label noise), `apo_zero` / `apo_down` (anchored), and the "
        "others TRL names.",
    )

    @field_validator("loss_type", mode="before")
    @classmethod
    def _why_a_loss_is_refused(cls, name: object) -> object:
        # Before the Literal's own check, so a TRL loss loraflow refuses gets its reason.
        if isinstance(name, str) and name in REFUSED_DPO_LOSSES:
            raise ValueError(f"`dpo.loss_type` '{name}' cannot be used: {REFUSED_DPO_LOSSES[name]}; use one of "
                             f"{', '.join(DpoLoss.__args__)}")
        return name


def dpo_setting_problems(algorithm: str, dpo: DpoSettings | None, training: TrainingSettings,
                         lora: LoraSettings) -> list[str]:
    """What is wrong with a job's DPO settings for `algorithm` and its adapter (empty when nothing); shared by both
    sides."""
    if algorithm != "dpo":
        return [] if dpo is None else [
            f"`dpo` is set but algorithm is '{algorithm}': remove the `dpo` section or set algorithm to 'dpo'"
        ]
    problems = reference_problems(lora, "algorithm 'dpo'")
    if sft_only := sft_only_settings(training):
        problems.append(f"{', '.join(sft_only)}: sft only (DPO's loss is on the chosen and rejected answers, rendered "
                        "with the model's own chat template); remove them")
    return problems
