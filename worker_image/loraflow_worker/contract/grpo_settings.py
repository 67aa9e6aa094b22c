"""GRPO's section of a job: the group of completions, the rewards that score them, and the tools the model may call
while it writes them. Each training method that has settings of its own has its module here (`grpo_settings.py`,
`dpo_settings.py`), as the run form has a section."""

from __future__ import annotations

import re

from pydantic import Field, model_validator

from loraflow_worker.contract.reward_names import (
    BUILTIN_REWARD_PARAMS,
    ENVIRONMENT_NAME_PATTERN,
    REWARD_STORE_PATH_PATTERN,
    TOOLS_FILE_PATTERN,
    reward_kind,
)
from loraflow_worker.contract.fast_path_settings import FastPathSettings
from loraflow_worker.contract.memory_settings import MemorySettings
from loraflow_worker.contract.lora_settings import LoraSettings, reference_problems
from loraflow_worker.contract.training_settings import TrainingSettings, sft_only_settings
from loraflow_worker.contract.version import _Strict

_REWARD_PARAMS = ("column", "pattern", "target_length", "tolerance")


class RewardSpec(_Strict):
    """One reward function of a GRPO run and its weight in the total reward."""

    name: str = Field(
        min_length=1,
        max_length=256,
        description="A built-in reward (`exact_match`, `normalized_match`, `numeric_match`, `format`, "
        "`length_penalty`, `digit_fraction`); a user reward `package.module:function` importable on the "
        "worker (e.g. installed with `extra_packages`); or your own reward file `path/to/file.py:function` "
        "(`.py` required; a relative path starts at the flow's working directory), which the run uploads to its "
        "artifact store and the worker imports from there. A user reward is called as TRL calls reward functions, "
        "with `prompts`, `completions`, `completion_ids` and every dataset column as keyword arguments.",
    )
    weight: float = Field(default=1.0, ge=-1000.0, le=1000.0, description="Factor of this reward in the summed reward.")
    column: str | None = Field(
        default=None,
        min_length=1,
        max_length=256,
        description="Match rewards: the dataset column holding the reference answer. The last assistant turn of a "
        "chat `messages` dataset, and the completion of a prompt/completion dataset, is the column `answer`.",
    )
    pattern: str | None = Field(
        default=None,
        min_length=1,
        max_length=1000,
        description="A Python regular expression. `format`: the reward is 1 when it is found in the completion "
        "(anchor it with `^...$` to require the whole text). Match rewards: extracts the final answer from the "
        "completion (its first group, or the whole match); the last match counts. Unset: the whole completion "
        "(`numeric_match`: its last number).",
    )
    target_length: int | None = Field(
        default=None,
        ge=1,
        le=262_144,
        description="`length_penalty`: completions up to this many tokens get 0; longer ones get minus the "
        "excess as a fraction of this length, down to -1.",
    )
    tolerance: float | None = Field(
        default=None, ge=0.0, description="`numeric_match`: largest absolute difference that still counts as equal (default 1e-6)."
    )
    store_path: str | None = Field(
        default=None,
        max_length=1024,
        pattern=REWARD_STORE_PATH_PATTERN,
        description="Reward files only: where the file is in the artifact store. The run sets it when it uploads "
        "the file; leave it empty.",
    )

    @model_validator(mode="after")
    def _known_reward_and_its_parameters(self) -> RewardSpec:
        given = [p for p in _REWARD_PARAMS if getattr(self, p) is not None]
        kind = reward_kind(self.name)
        if kind == "builtin":
            required, optional = BUILTIN_REWARD_PARAMS[self.name]
            for param in required:
                if getattr(self, param) is None:
                    raise ValueError(f"reward `{self.name}` needs `{param}`: set it in this reward's entry")
            for param in given:
                if param not in required + optional:
                    takes = ", ".join(f"`{p}`" for p in required + optional) or "no parameters"
                    raise ValueError(f"reward `{self.name}` takes {takes}, not `{param}`: remove `{param}`")
        elif kind in ("module", "file"):
            if given:
                raise ValueError(
                    f"user reward `{self.name}` takes no `{given[0]}`: user rewards receive every dataset column "
                    "as a keyword argument; remove it"
                )
        else:
            valid = ", ".join(sorted(BUILTIN_REWARD_PARAMS))
            raise ValueError(f"unknown reward `{self.name}`: use one of {valid}, `package.module:function` for a user "
                             "reward, or `path/to/file.py:function` for a reward file")
        if self.store_path is not None and kind != "file":
            raise ValueError(f"reward `{self.name}`: `store_path` is for reward files (`path/to/file.py:function`) "
                             "only: remove it")
        if self.pattern is not None:
            try:
                re.compile(self.pattern)
            except re.error as e:
                raise ValueError(f"reward `{self.name}`: `pattern` {self.pattern!r} is not a valid regular expression: {e}") from e
        return self


class GrpoSettings(_Strict):
    """GRPO (group relative policy optimisation, TRL `GRPOTrainer`): for each prompt the model writes
    `num_generations` completions, the rewards score them, and the adapter learns from each completion's
    reward relative to its group. Learning rate, steps, batch size and seed come from the training settings;
    `batch_size` counts completions, so `batch_size × gradient_accumulation_steps` must be a multiple of
    `num_generations`."""

    num_generations: int = Field(default=8, ge=2, le=256, description="Completions per prompt (the group size). At least 2.")
    max_prompt_length: int = Field(
        default=512,
        ge=8,
        le=262_144,
        description="Prompt tokens (chat template applied). Longer prompts are left out of training, with a warning.",
    )
    max_completion_length: int = Field(default=512, ge=1, le=262_144, description="Tokens generated per completion at most.")
    temperature: float = Field(default=1.0, gt=0.0, le=10.0, description="Sampling temperature of the completions.")
    beta: float = Field(
        default=0.0,
        ge=0.0,
        le=100.0,
        description="KL coefficient: how strongly the adapter is held near the base model. 0 (TRL's default) "
        "skips the reference model entirely. Above 0, not with `lora.init` `pissa` or `olora` (the reference, the "
        "model with the adapter switched off, would be their residual base).",
    )
    rewards: list[RewardSpec] = Field(min_length=1, max_length=32, description="The reward functions, summed with their weights.")
    tools: str | None = Field(
        default=None,
        max_length=1024,
        pattern=TOOLS_FILE_PATTERN,
        description="A tools file `path/to/tools.py` (a relative path starts at the flow's working directory): its "
        "public functions are the tools the model may call while it writes a completion (TRL's `tools=`). Each needs "
        "type hints and a docstring with an `Args:` line per parameter: the chat template shows the model their "
        "JSON schema. They run inside the training process, with the run's `[worker] env` and secrets; one that "
        "raises answers the call with its error. The model's chat template must render tools.",
    )
    environment: str | None = Field(
        default=None,
        max_length=1024,
        pattern=ENVIRONMENT_NAME_PATTERN,
        description="An environment `path/to/file.py:ClassName` (TRL's `environment_factory=`): one instance per "
        "completion, `reset(**row)` called with the prompt's dataset row before it, and its public methods are the "
        "tools (typed and documented as for `tools`). A `get_reward()` method, if any, is one more reward.",
    )
    max_tool_calls: int | None = Field(
        default=None,
        ge=1,
        le=1000,
        description="Tool-calling turns per completion at most (TRL's `max_tool_calling_iterations`); unset: until "
        "the model answers without a call or reaches `max_completion_length`. Needs `tools` or `environment`.",
    )
    tools_store_path: str | None = Field(
        default=None,
        max_length=1024,
        pattern=REWARD_STORE_PATH_PATTERN,
        description="Where the tools file is in the artifact store. The run sets it when it uploads the file; leave it "
        "empty.",
    )
    environment_store_path: str | None = Field(
        default=None,
        max_length=1024,
        pattern=REWARD_STORE_PATH_PATTERN,
        description="Where the environment's file is in the artifact store. The run sets it when it uploads the "
        "file; leave it empty.",
    )

    @model_validator(mode="after")
    def _tool_settings_go_together(self) -> GrpoSettings:
        if self.max_tool_calls is not None and self.tools is None and self.environment is None:
            raise ValueError("`max_tool_calls` is set but there are no tools: set `tools` or `environment`, or remove "
                             "`max_tool_calls`")
        if self.tools_store_path is not None and self.tools is None:
            raise ValueError("`tools_store_path` is set without `tools`: remove it")
        if self.environment_store_path is not None and self.environment is None:
            raise ValueError("`environment_store_path` is set without `environment`: remove it")
        return self

    @property
    def uses_tools(self) -> bool:
        """Whether the model may call tools while it writes (a tools file or an environment)."""
        return self.tools is not None or self.environment is not None


def grpo_setting_problems(algorithm: str, grpo: GrpoSettings | None, training: TrainingSettings,
                          lora: LoraSettings) -> list[str]:
    """What is wrong with a job's GRPO settings for `algorithm` and its adapter (empty when nothing). Shared by the
    worker's `JobInput` and the control plane's run spec, so both refuse the same jobs with the same words."""
    if algorithm != "grpo":
        return [] if grpo is None else [
            f"`grpo` is set but algorithm is '{algorithm}': remove the `grpo` section or set algorithm to 'grpo'"
        ]
    if grpo is None:
        return ["algorithm is 'grpo' but `grpo` is not set: add a `grpo` section with at least one reward"]
    problems = []
    if grpo.beta > 0:  # TRL builds no reference at beta 0
        problems += reference_problems(lora, f"algorithm 'grpo' and `grpo.beta` {grpo.beta:g} (its KL term)",
                                       "set `grpo.beta` to 0 (no reference, no KL term)")
    if sft_only := sft_only_settings(training):
        problems.append(f"{', '.join(sft_only)}: sft only (GRPO's loss is on the completions it generates from the "
                        "model's own chat template, a group per prompt); remove them")
        return problems
    completions = training.batch_size * training.gradient_accumulation_steps
    if completions % grpo.num_generations:
        problems.append(
            f"`training.batch_size` × `training.gradient_accumulation_steps` ({training.batch_size} × "
            f"{training.gradient_accumulation_steps} = {completions} completions per step) must be a multiple of "
            f"`grpo.num_generations` ({grpo.num_generations}): every prompt's group must fit in one step; "
            f"e.g. set batch_size to {grpo.num_generations * max(1, round(training.batch_size / grpo.num_generations))}"
        )
    return problems


def colocated_vllm_problems(algorithm: str, lora: LoraSettings, fast_paths: FastPathSettings,
                            memory: MemorySettings | None = None) -> list[str]:
    """What a GRPO job trains that a colocated vLLM would not generate with (empty when nothing, or when vLLM does not
    colocate: `fast_paths.vllm_colocate` or `memory.vllm_colocate` false, or a 4-bit base, which never colocates).
    Shared by the worker's `JobInput` and the control plane's run spec."""
    if algorithm != "grpo" or not lora.modules_to_save or fast_paths.vllm_colocate is False:
        return []
    if lora.quantization == "4bit" or (memory is not None and memory.vllm_colocate is False):
        return []
    # vLLM generates from its own copy of the weights, which TRL refreshes before each round under the base's names
    # (`VLLMGeneration._iter_named_params`). Whether that copy is the model that trains cannot be known before renting:
    # it depends on whether the model ties its head to its input embeddings, which only its config says.
    setting = "empty: where it fits" if fast_paths.vllm_colocate is None else repr(fast_paths.vllm_colocate)
    return [f"`lora.modules_to_save` ({', '.join(lora.modules_to_save)}) with vLLM colocated for GRPO's completions "
            f"(`fast_paths.vllm_colocate` {setting}): vLLM generates from its own copy of the weights, and on a "
            "model whose head is tied to its input embeddings (Qwen3 up to 4B, among others) it keeps the two tied, "
            "so it skips a trained `lm_head` and makes a trained `embed_tokens` its head as well; with `lora.init_from` "
            "and `grpo.beta` > 0, TRL's reference copies go to vLLM under names it does not know. The completions "
            "would come from another model than the one training: set `fast_paths.vllm_colocate = false` (the "
            "training model generates them, more slowly), or leave `lora.modules_to_save` out"]
