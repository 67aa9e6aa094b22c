"""The knobs every trainer has (`training.lr_scheduler`, `warmup_ratio` / `warmup_steps`, `weight_decay`,
`max_grad_norm`, `optimizer`; `lora.use_dora`, `use_rslora`, `init`, `loraplus_lr_ratio`, `modules_to_save`): their
defaults change nothing, the names they take are the installed transformers' and PEFT's, what cannot work is refused
naming the field, and what they set reaches the TRL configs of both algorithms."""

from __future__ import annotations

import inspect

import pytest
from peft import LoraConfig
from pydantic import ValidationError
from transformers import TrainingArguments
from transformers.trainer_utils import SchedulerType
from transformers.training_args import OptimizerNames

from loraflow_worker.contract import JobInput, LoraSettings
from loraflow_worker.contract.dpo_settings import REFUSED_DPO_LOSSES, DpoLoss
from loraflow_worker.contract.lora_settings import REFUSED_LORA_INITS, REFUSED_TARGET_MODULES, LoraInit
from loraflow_worker.contract.training_settings import (
    REFUSED_LR_SCHEDULERS,
    REFUSED_OPTIMIZERS,
    LrScheduler,
    Optimizer,
)
from loraflow_worker.training.fast_paths import FastPathPlan
from loraflow_worker.training.grpo import grpo_config
from loraflow_worker.training.run import lora_config, shared_trainer_args
from loraflow_worker.training.sft import sft_config

GRPO = {"num_generations": 4, "rewards": [{"name": "format", "pattern": "x"}]}
CPU_PLAN = FastPathPlan({}, {"use_cpu": True, "bf16": False, "gradient_checkpointing": False})


def _job(**fields) -> JobInput:
    return JobInput.model_validate({"run_id": "r", "model": {"id": "org/model"}, "dataset": {"hub_id": "org/data"},
                                    "artifact_store": "file:///srv/store", **fields})


def _refusal(**fields) -> str:
    with pytest.raises(ValidationError) as refused:
        _job(**fields)
    return str(refused.value)


def test_every_scheduler_name_is_transformers_own_and_each_is_taken_or_refused_with_a_reason():
    taken, refused = set(LrScheduler.__args__), set(REFUSED_LR_SCHEDULERS)
    assert taken | refused == {name.value for name in SchedulerType} and not taken & refused


def test_every_optimizer_name_is_transformers_own_and_each_is_taken_or_refused_with_a_reason():
    taken, refused = set(Optimizer.__args__), set(REFUSED_OPTIMIZERS)
    assert taken | refused == {name.value for name in OptimizerNames} and not taken & refused


def test_every_init_is_one_peft_names():
    peft_names = str(inspect.signature(LoraConfig).parameters["init_lora_weights"].annotation)
    for name in [*LoraInit.__args__[1:], *REFUSED_LORA_INITS]:
        assert f"'{name}'" in peft_names + LoraConfig.__doc__, name  # LoRA-GA is named in the docstring only


def test_the_defaults_are_what_transformers_and_peft_use_when_nothing_is_set(tmp_path):
    args, defaults = shared_trainer_args(_job(), tmp_path), TrainingArguments(output_dir="unused")
    for name in ("lr_scheduler_type", "warmup_steps", "weight_decay", "max_grad_norm"):
        assert args[name] == getattr(defaults, name), name
    assert "optim" not in args  # the fast-path plan's, as before
    config, peft_defaults = lora_config(_job()), LoraConfig()
    for name in ("use_dora", "use_rslora", "init_lora_weights", "modules_to_save"):
        assert getattr(config, name) == getattr(peft_defaults, name), name


def test_a_refused_scheduler_gives_its_reason_naming_the_field():
    message = _refusal(training={"lr_scheduler": "cosine_with_min_lr"})
    assert "training.lr_scheduler" in message and "`training.lr_scheduler` 'cosine_with_min_lr' cannot be used" in message
    assert "use `cosine`" in message


def test_an_unknown_scheduler_is_refused_naming_the_field():
    assert "training.lr_scheduler" in _refusal(training={"lr_scheduler": "exponential"})


def test_an_optimizer_needing_what_the_image_lacks_is_refused_with_the_reason():
    message = _refusal(training={"optimizer": "galore_adamw"})
    assert "`training.optimizer` 'galore_adamw' cannot be used" in message and "optim_target_modules" in message


def test_warmup_as_a_share_and_as_steps_together_is_refused_naming_both():
    message = _refusal(training={"warmup_ratio": 0.1, "warmup_steps": 10})
    assert "`training.warmup_ratio` (0.1) or `training.warmup_steps` (10), not both" in message


def test_a_warmup_as_long_as_the_run_is_refused():
    assert "must be fewer than `training.max_steps` (10)" in _refusal(training={"warmup_steps": 10, "max_steps": 10})


def test_a_warmup_on_the_constant_schedule_is_refused_pointing_at_constant_with_warmup():
    message = _refusal(training={"lr_scheduler": "constant", "warmup_ratio": 0.1})
    assert "has no warmup" in message and "use `constant_with_warmup`" in message


def test_reduce_on_plateau_without_evaluation_is_refused_naming_both_sections():
    message = _refusal(training={"lr_scheduler": "reduce_lr_on_plateau"})
    assert "`training.lr_scheduler` 'reduce_lr_on_plateau'" in message and "an `evaluation` section" in message


def test_reduce_on_plateau_with_evaluation_is_taken(tmp_path):
    job = _job(training={"lr_scheduler": "reduce_lr_on_plateau"}, evaluation={"fraction": 0.1})
    assert shared_trainer_args(job, tmp_path)["lr_scheduler_type"] == "reduce_lr_on_plateau"


def test_an_optimizer_chosen_twice_is_refused_naming_both_fields():
    message = _refusal(training={"optimizer": "adamw_torch"}, fast_paths={"paged_adamw_8bit": False})
    assert "`training.optimizer` ('adamw_torch')" in message and "`fast_paths.paged_adamw_8bit`" in message


def test_a_refused_init_gives_its_reason_naming_the_field():
    message = str(_lora_refusal(init="eva"))
    assert "`lora.init` 'eva' cannot be used" in message and "pissa_niter_<n>" in message


def test_fast_svd_pissa_is_taken_with_its_iterations():
    assert LoraSettings(init="pissa_niter_16").init == "pissa_niter_16"
    assert "`lora.init` 'pissa_niter_x' is not an initialisation PEFT knows" in _lora_refusal(init="pissa_niter_x")


def test_an_orthogonal_init_of_odd_rank_is_refused_with_an_even_one():
    assert "needs an even `lora.rank`" in _lora_refusal(init="orthogonal", rank=7)


def test_pissa_on_a_4bit_base_is_refused_pointing_at_olora():
    message = _lora_refusal(init="pissa_niter_4", quantization="4bit")
    assert "`lora.quantization` '4bit'" in message and "use `olora`" in message


@pytest.mark.parametrize("also, named", [({"use_dora": True}, "`lora.use_dora`"),
                                         ({"modules_to_save": ["lm_head"]}, "`lora.modules_to_save`")])
def test_a_base_rewriting_init_with_what_its_conversion_drops_is_refused_naming_both(also, named):
    message = _lora_refusal(init="olora", **also)
    assert "`lora.init` 'olora' with" in message and named in message and "keeps only the A and B matrices" in message


def test_a_loraplus_ratio_below_one_is_refused():
    assert "loraplus_lr_ratio" in _lora_refusal(loraplus_lr_ratio=0.5)


def test_a_module_to_save_named_twice_is_refused():
    assert "`lora.modules_to_save`: name each module once" in _lora_refusal(modules_to_save=["lm_head", "lm_head"])


@pytest.mark.parametrize("init", ["pissa", "pissa_niter_4", "olora"])
def test_a_base_rewriting_init_with_dpo_is_refused_naming_the_init_the_algorithm_and_the_fix(init):
    # DPO's reference is the model with the adapter off: after PiSSA or OLoRA, the residual base.
    message = _refusal(algorithm="dpo", lora={"init": init})
    assert f"`lora.init` '{init}' with algorithm 'dpo'" in message and "residual base" in message
    assert "set `lora.init` to 'default' or 'gaussian'" in message


def test_a_base_rewriting_init_with_grpos_kl_term_is_refused_naming_the_init_beta_and_both_fixes():
    message = _refusal(algorithm="grpo", grpo={**GRPO, "beta": 0.04}, lora={"init": "olora"})
    assert "`lora.init` 'olora' with algorithm 'grpo' and `grpo.beta` 0.04" in message and "residual base" in message
    assert "set `lora.init` to 'default' or 'gaussian'" in message and "set `grpo.beta` to 0" in message


def test_a_base_rewriting_init_with_grpo_without_a_reference_is_taken():
    assert _job(algorithm="grpo", grpo=GRPO, lora={"init": "pissa"}).lora.init == "pissa"


def test_modules_to_save_with_grpos_colocated_vllm_are_refused_naming_both_fields_and_the_fix():
    message = _refusal(algorithm="grpo", grpo=GRPO, lora={"modules_to_save": ["lm_head"]})
    assert "`lora.modules_to_save` (lm_head) with vLLM colocated" in message and "`fast_paths.vllm_colocate`" in message
    assert "tied to its input embeddings" in message and "set `fast_paths.vllm_colocate = false`" in message


@pytest.mark.parametrize("vllm_off", [{"fast_paths": {"vllm_colocate": False}},
                                      {"memory": {"vllm_colocate": False}},
                                      {"lora": {"modules_to_save": ["lm_head"], "quantization": "4bit"},
                                       "memory": {"vllm_colocate": False}}])
def test_modules_to_save_with_grpo_generating_without_vllm_are_taken(vllm_off):
    fields = {"algorithm": "grpo", "grpo": GRPO, "lora": {"modules_to_save": ["lm_head"]}, **vllm_off}
    assert _job(**fields).lora.modules_to_save == ["lm_head"]


def _lora_refusal(**fields) -> str:
    with pytest.raises(ValidationError) as refused:
        LoraSettings(**fields)
    return str(refused.value)


@pytest.mark.parametrize("build, algorithm", [(sft_config, "sft"), (grpo_config, "grpo")])
def test_both_algorithms_train_with_the_schedule_and_optimisation_settings(build, algorithm, tmp_path):
    job = _job(algorithm=algorithm, grpo=GRPO if algorithm == "grpo" else None,
               training={"lr_scheduler": "cosine", "warmup_ratio": 0.1, "weight_decay": 0.01, "max_grad_norm": 0.5})
    config = build(job, CPU_PLAN, tmp_path)
    assert (config.lr_scheduler_type, config.warmup_steps, config.weight_decay, config.max_grad_norm) == (
        SchedulerType.COSINE, 0.1, 0.01, 0.5)


def test_warmup_steps_reach_the_trainer_as_whole_steps(tmp_path):
    assert sft_config(_job(training={"warmup_steps": 5}), CPU_PLAN, tmp_path).get_warmup_steps(100) == 5


def test_the_refused_lora_targets_are_pefts_embedding_layer_names():
    from peft.utils.constants import EMBEDDING_LAYER_NAMES

    assert set(REFUSED_TARGET_MODULES) == set(EMBEDDING_LAYER_NAMES)


@pytest.mark.parametrize("named, target", [(["q_proj", "lm_head"], "lm_head"), (["model.lm_head"], "model.lm_head"),
                                           (["embed_tokens", "v_proj"], "embed_tokens")])
def test_lora_on_the_lm_head_or_the_embeddings_is_refused_naming_the_field_and_modules_to_save(named, target):
    message = _lora_refusal(target_modules=named)
    assert f"`lora.target_modules` names {target}, which LoRA cannot adapt here" in message
    assert "remove it from `lora.target_modules`, and name it in `lora.modules_to_save`" in message


def test_all_linear_leaves_the_lm_head_out_as_trl_requires(tiny_model_dir):
    # TRL 1.16 refuses an adapter on the output head when its trainer starts (`sft_trainer.py`, `dpo_trainer.py`,
    # `grpo_trainer.py`: `get_output_embeddings()` a `BaseTunerLayer`); PEFT's all-linear skips it.
    from peft import get_peft_model
    from peft.tuners.tuners_utils import BaseTunerLayer
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), lora_config(_job()))
    assert not isinstance(model.get_output_embeddings(), BaseTunerLayer)
    assert any(isinstance(module, BaseTunerLayer) for module in model.modules())


def test_every_dpo_loss_is_trls_and_exo_pair_is_refused_with_its_reason():
    from trl import DPOConfig

    trl_losses = DPOConfig.__dataclass_fields__["loss_type"].metadata["help"]
    for name in [*DpoLoss.__args__, *REFUSED_DPO_LOSSES]:
        assert f"'{name}'" in trl_losses, name
    message = _refusal(algorithm="dpo", dpo={"loss_type": "exo_pair"})
    assert "`dpo.loss_type` 'exo_pair' cannot be used" in message and "label_smoothing" in message


def test_the_adapter_settings_reach_peft():
    config = lora_config(_job(lora={"use_dora": True, "use_rslora": True, "init": "gaussian",
                                    "modules_to_save": ["lm_head"]}))
    assert (config.use_dora, config.use_rslora, config.init_lora_weights) == (True, True, "gaussian")
    assert config.modules_to_save == ["lm_head"]
