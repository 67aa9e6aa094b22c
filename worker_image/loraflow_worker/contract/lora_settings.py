"""The LoRA adapter's shape, its initialisation, and where it may start from (`lora.init_from`): `[lora]` of a run."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from loraflow_worker.contract.version import _Strict

LoraInit = Literal["default", "gaussian", "pissa", "olora", "orthogonal", "mica"]
"""`lora.init` values taken as they are; `pissa_niter_<n>` (PiSSA by fast SVD) is accepted besides."""
PISSA_NITER = re.compile(r"^pissa_niter_[0-9]+$")
REFUSED_LORA_INITS = {
    "eva": "EVA initialises from the activations of a pass over the data (`peft.initialize_lora_eva_weights`), "
           "which loraflow does not run",
    "corda": "CorDA needs a preprocessing pass over the data (`peft.tuners.lora.corda.preprocess_corda`), which "
             "loraflow does not run",
    "loftq": "LoftQ needs a `loftq_config` (and quantizes the base itself), which loraflow does not take",
    "lora_ga": "LoRA-GA needs the gradients of a pass over the data before training, which loraflow does not run",
}
"""PEFT 0.21's other `init_lora_weights` values, and why a run cannot use them."""
REFUSED_TARGET_MODULES = {
    "lm_head": "TRL 1.16's trainers compute the log-probabilities from `lm_head.weight` directly (their fused LM head), "
               "so an adapter on the output head would never train: TRL refuses it when training starts",
    "embed_tokens": "on a tied-embedding model (Qwen's small ones among them) the input embeddings share their weight "
                    "with the output head, so the adapter, trained through the inputs only, would change the head "
                    "too once merged (PEFT warns of it)",
}
"""PEFT's embedding layer names (`EMBEDDING_LAYER_NAMES`) as LoRA targets, and why a run cannot name them."""
BASE_REWRITING_INITS = ("pissa", "olora")
"""Inits that rewrite the base weights (base = residual): their adapter is converted to a plain LoRA when saved."""

INIT_FROM_PATTERN = r"^(runs/[A-Za-z0-9_][A-Za-z0-9._-]*|[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*)$"
"""`lora.init_from`: an earlier run of the store, `runs/<flow run id>` (one folder name, not `.` or `..`, so that it
stays inside `runs/`), or a Hub repo `<org>/<name>`. `init_from_problem` adds the Hub's own rules on repo names."""
INIT_FROM_FORMS = ("an earlier run of this run's artifact store, `runs/<flow run id>`, or a PEFT adapter on the Hub, "
                   "`<org>/<name>` (letters, digits, `.`, `_` and `-`, without `--` or `..`)")


class LoraSettings(_Strict):
    """LoRA adapter shape (PEFT `LoraConfig`)."""

    rank: int = Field(default=16, ge=1, le=1024, description="LoRA rank `r`: adapter width. Larger learns more, costs more memory.")
    alpha: int = Field(default=32, ge=1, le=4096, description="LoRA alpha: the adapter's output is scaled by alpha / rank.")
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0, description="Dropout on the LoRA input during training (0 to disable).")
    target_modules: list[str] | Literal["all-linear"] = Field(
        default="all-linear",
        description="Module names to adapt (e.g. `[\"q_proj\", \"v_proj\"]`), or `all-linear` for every "
        "linear layer except the output head. Not `lm_head` or `embed_tokens`: train those in full with "
        "`modules_to_save`.",
    )
    quantization: Literal["none", "4bit"] = Field(
        default="none",
        description="`none`: the base model in bf16. `4bit`: QLoRA — the base loaded in 4 bits (nf4, double "
        "quantization, bf16 compute) through bitsandbytes, to fit a larger model on one GPU. GRPO with `4bit` needs "
        "`memory.vllm_colocate` false.",
    )
    use_dora: bool = Field(
        default=False,
        description="DoRA (PEFT `use_dora`): each adapted weight split into a magnitude and a direction, LoRA training "
        "the direction. Often closer to full fine-tuning at low rank; slower steps and more activation memory.",
    )
    use_rslora: bool = Field(
        default=False,
        description="rsLoRA (PEFT `use_rslora`): scale the adapter by alpha / sqrt(rank) instead of alpha / rank, so "
        "that a high rank still learns.",
    )
    init: str = Field(
        default="default",
        description="How the adapter starts (PEFT `init_lora_weights`). `default`: A random, B zero (the adapter starts "
        "as a no-op). `gaussian`: A Gaussian scaled by the rank. `pissa`: A and B from the principal singular vectors "
        "of each weight (SVD), the base keeping the residual; `pissa_niter_<n>` (e.g. `pissa_niter_16`) the same by "
        "a fast randomised SVD of n iterations, for large models. `olora`: from a QR decomposition of each weight, "
        "the base keeping the residual. `orthogonal`: A and B orthogonal, the base untouched (an even `rank`). `mica`: B "
        "from the singular vectors of each weight's smallest singular values and frozen, A zero and trained. "
        "PiSSA and OLoRA adapters are stored converted to a plain LoRA of twice the rank, which loads on the "
        "unchanged base model (so not with `use_dora` or `modules_to_save`, which the conversion would drop); nor with "
        "DPO, or GRPO at `grpo.beta` > 0, whose reference (the model with the adapter switched off) they would make "
        "the residual base instead of the starting model.",
    )
    loraplus_lr_ratio: float | None = Field(
        default=None,
        ge=1.0,
        le=1024.0,
        description="LoRA+ (PEFT `create_loraplus_optimizer`): the B matrices learn at this multiple of "
        "`training.learning_rate` (the paper suggests 16; lower the learning rate a little with it). Works with every "
        "`training.optimizer`. Empty: one learning rate for all.",
    )
    init_from: str | None = Field(
        default=None,
        max_length=200,
        pattern=INIT_FROM_PATTERN,
        description="Start from a trained adapter instead of a new one, and go on training it: an earlier run's, "
        "`runs/<flow run id>` of this run's artifact store, or a PEFT adapter on the Hub, `<org>/<name>` (read with "
        "the run's Hub token). Checked before renting: it exists and was trained on `model.id`. Its rank, alpha, "
        "target modules, DoRA and rsLoRA become the run's; a `[lora]` setting given otherwise is refused, naming both. "
        "The manifest and the model card name it.",
    )
    modules_to_save: list[str] = Field(
        default_factory=list,
        max_length=64,
        description="Modules trained in full besides the adapter and stored with it (PEFT `modules_to_save`), e.g. "
        "`[\"lm_head\"]` or `[\"embed_tokens\"]` to learn new tokens. Each is a full trainable copy, with its "
        "gradients and optimizer state: Qwen3-4B's LM head (a 151,936-token vocabulary × 2,560) is 389 million values. "
        "The copies train in fp32 (bf16's rounding would swallow a small learning rate's updates). GRPO takes them only with `fast_paths.vllm_colocate = false`: a "
        "colocated vLLM would not generate with them on a tied-embedding model. Empty: only the adapter trains.",
    )

    @field_validator("init")
    @classmethod
    def _an_init_peft_can_run_here(cls, init: str) -> str:
        if init in LoraInit.__args__ or PISSA_NITER.match(init):
            return init
        if init in REFUSED_LORA_INITS:
            raise ValueError(f"`lora.init` '{init}' cannot be used: {REFUSED_LORA_INITS[init]}; use one of "
                             f"{', '.join(LoraInit.__args__)} or pissa_niter_<n>")
        raise ValueError(f"`lora.init` '{init}' is not an initialisation PEFT knows: use one of "
                         f"{', '.join(LoraInit.__args__)} or pissa_niter_<n> (e.g. pissa_niter_16)")

    @field_validator("init_from", mode="before")
    @classmethod
    def _init_from_names_a_run_or_a_hub_adapter(cls, value: object) -> object:
        # Before the pattern: its own refusal would quote the regex, where this one says what to write.
        if isinstance(value, str) and (problem := init_from_problem(value)):
            raise ValueError(problem)
        return value

    @field_validator("target_modules")
    @classmethod
    def _no_embedding_layer_targets(cls, targets: list[str] | str) -> list[str] | str:
        if problem := target_modules_problem(targets):
            it = "it" if sum(name.rsplit(".", 1)[-1] in REFUSED_TARGET_MODULES for name in targets) == 1 else "them"
            raise ValueError(f"{problem}: remove {it} from `lora.target_modules`, and name {it} in "
                             f"`lora.modules_to_save` to train a full copy instead")
        return targets

    @field_validator("modules_to_save")
    @classmethod
    def _each_module_once(cls, names: list[str]) -> list[str]:
        if len(set(names)) != len(names) or any(not name.strip() for name in names):
            raise ValueError("`lora.modules_to_save`: name each module once, by a non-empty name (e.g. `lm_head`)")
        return names

    @model_validator(mode="after")
    def _init_fits_the_adapter(self) -> LoraSettings:
        if self.init == "orthogonal" and self.rank % 2:
            raise ValueError(f"`lora.init` 'orthogonal' needs an even `lora.rank` (PEFT splits one orthogonal basis "
                             f"between A and B); got {self.rank}: use {self.rank + 1} or another init")
        if self.init.startswith(("pissa", "mica")) and self.quantization == "4bit":
            raise ValueError(f"`lora.init` '{self.init}' takes an SVD of the base weights, which PEFT does only in bf16 "
                             f"or fp32, not of a 4-bit base (`lora.quantization` '4bit'): use `olora`, `default`, or "
                             f"quantization 'none'")
        if self.init_from is not None and self.init != "default":
            raise ValueError(f"`lora.init` '{self.init}' initialises a new adapter, but `lora.init_from` "
                             f"({self.init_from}) starts from a trained one: remove one of them")
        if self.rewrites_base and (self.use_dora or self.modules_to_save):
            lost = "DoRA's magnitudes (`lora.use_dora`)" if self.use_dora else "the `lora.modules_to_save` weights"
            raise ValueError(f"`lora.init` '{self.init}' with {lost}: the adapter is stored converted to a plain LoRA "
                             f"of the unchanged base, and PEFT's conversion (`subtract_mutated_init`) keeps only the A "
                             f"and B matrices, so {lost.split(' (')[0]} would be lost; use another init, or leave "
                             f"{'`lora.use_dora`' if self.use_dora else '`lora.modules_to_save`'} out")
        return self

    @property
    def rewrites_base(self) -> bool:
        """Whether the init rewrites the base weights (PiSSA, OLoRA), so that the stored adapter must be converted."""
        return self.init.startswith(BASE_REWRITING_INITS)


def reference_problems(lora: LoraSettings, measured: str, other_fix: str | None = None) -> list[str]:
    """Why `lora.init` cannot be measured against TRL's reference (empty when it can). `measured` says what compares
    the policy with the reference (e.g. "algorithm 'dpo'"), `other_fix` a fix besides another init."""
    if not lora.rewrites_base:
        return []
    # TRL's reference for a new adapter is the policy with the adapter switched off (`use_adapter(model, None)`, i.e.
    # `disable_adapter`): no second copy of the weights. PiSSA and OLoRA move the adapter's starting value out of the
    # base weights, so what is left with the adapter off is the residual, not the model training starts from.
    fixes = "set `lora.init` to 'default' or 'gaussian' (a new adapter that starts as a no-op, so that the base is the "
    fixes += "starting model)" + (f", or {other_fix}" if other_fix else "")
    return [f"`lora.init` '{lora.init}' with {measured}: TRL's reference is the model with the adapter switched off, "
            f"which after '{lora.init}' initialisation is the residual base (the weights less the adapter's starting "
            f"value), not the model training starts from, so the reference's log-probabilities, and the rewards, "
            f"margins, KL and loss built on them, would be meaningless; {fixes}"]


def target_modules_problem(targets: list[str] | str, field: str = "`lora.target_modules`") -> str | None:
    """Why `targets` (`lora.target_modules`, or the target modules of the adapter `field` names) cannot be a run's,
    naming the field; None when it can. PEFT matches a name against the end of each module's dotted name, so
    `model.lm_head` names the head too; `all-linear` leaves the output head out (PEFT's
    `_maybe_include_all_linear_layers`)."""
    if isinstance(targets, str):
        return None
    refused = [name for name in targets if name.rsplit(".", 1)[-1] in REFUSED_TARGET_MODULES]
    if not refused:
        return None
    reasons = "; ".join(f"{name}: {REFUSED_TARGET_MODULES[name.rsplit('.', 1)[-1]]}" for name in refused)
    return f"{field} names {', '.join(refused)}, which LoRA cannot adapt here ({reasons})"


def init_from_problem(value: str) -> str | None:
    """Why `value` cannot be `lora.init_from` (the whole refusal: the field, the value and the forms it takes), or
    None when it can."""
    if value.startswith("runs/"):
        if re.fullmatch(INIT_FROM_PATTERN, value):
            return None
        why = "is not one run of the store (`runs/` and one flow run id, not `.` or `..`)"
    else:
        parts = value.split("/")
        # The Hub's own rules (huggingface_hub `validate_repo_id`), so that a bad id is refused here and not by the
        # Hub client mid-check: each part at most 96 characters, ending in a letter, digit or `_`; no `--` or `..`;
        # no `.git` at the end.
        if (len(parts) == 2 and all(_HUB_NAME.fullmatch(part) for part in parts) and "--" not in value
                and ".." not in value and not value.endswith(".git")):
            return None
        why = "is neither a run of the store nor a Hub repo id"
    return f"`lora.init_from` {value!r} {why}: give {INIT_FROM_FORMS}"


_HUB_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9_])?")
