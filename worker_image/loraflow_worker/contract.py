"""The job contract between the control plane and the worker.

The control plane builds a `JobInput`, sends it as the RunPod job's `input`, and reads a
`JobResult` back from the job's `output`; or, to warm a datacenter's network volume, a `PreloadInput`
(`"mode": "preload"`) and a `PreloadResult`. Both sides validate with these models, so a typo is caught
before a GPU is billed, and a worker refuses a job whose `contract_version` it does not understand.

This module must stay light (pydantic only): the control plane imports it without the training stack.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import re

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from loraflow_worker.reward_names import BUILTIN_REWARD_PARAMS, REWARD_STORE_PATH_PATTERN, reward_kind

CONTRACT_VERSION = 5
"""Bumped on every change to the contract's models (the handler refuses any other version). 3: `lora.quantization`
and `memory` (forced memory settings). 4: `PreloadInput.remove_others`; `JobInput.worker_env_names`,
`worker_secret_names` (a run's own worker env and secrets) and `fast_paths`; `evaluation` (held-out evaluation),
with `eval_loss` / `eval_reward` in the metrics and the progress. 5: `training.report_to` (W&B and MLflow tracking)
and `JobResult.trackers`."""

MAX_EXTRA_PACKAGES = 20
MAX_PRELOAD_MODELS = 100
_HUB_MODEL_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
"""`name` or `namespace/name`: what a Hub model id can be, and no local path (`/x`, `./x`, `a/b/c`) is."""
_REQUIREMENT = re.compile(
    r"^[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?"  # project name (PEP 508)
    r"(?:\[[A-Za-z0-9._-]+(?:,[A-Za-z0-9._-]+)*\])?"  # extras
    r"(?:(?:==|!=|<=|>=|~=|<|>)[A-Za-z0-9.*+!]+(?:,(?:==|!=|<=|>=|~=|<|>)[A-Za-z0-9.*+!]+)*)?$"  # versions
)
"""A plain requirement: name, extras, version specifiers. No URLs, paths, markers or pip options, so a job
cannot point pip at another index or pass it flags."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


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


class LoraSettings(_Strict):
    """LoRA adapter shape (PEFT `LoraConfig`)."""

    rank: int = Field(default=16, ge=1, le=1024, description="LoRA rank `r`: adapter width. Larger learns more, costs more memory.")
    alpha: int = Field(default=32, ge=1, le=4096, description="LoRA alpha: the adapter's output is scaled by alpha / rank.")
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0, description="Dropout on the LoRA input during training (0 to disable).")
    target_modules: list[str] | Literal["all-linear"] = Field(
        default="all-linear",
        description="Module names to adapt (e.g. `[\"q_proj\", \"v_proj\"]`), or `all-linear` for every "
        "linear layer except the output head.",
    )
    quantization: Literal["none", "4bit"] = Field(
        default="none",
        description="`none`: the base model in bf16. `4bit`: QLoRA — the base loaded in 4 bits (nf4, double "
        "quantization, bf16 compute) through bitsandbytes, to fit a larger model on one GPU. GRPO with `4bit` needs "
        "`memory.vllm_colocate` false.",
    )


class TrainingSettings(_Strict):
    """Optimisation settings shared by every algorithm."""

    learning_rate: float = Field(default=2e-4, gt=0.0, le=1.0, description="Peak learning rate of the adapter weights.")
    epochs: float = Field(default=1.0, gt=0.0, le=1000.0, description="Passes over the dataset. Ignored when `max_steps` is set.")
    max_steps: int | None = Field(
        default=None, ge=1, le=10_000_000, description="Stop after this many optimizer steps. None trains for `epochs`."
    )
    batch_size: int = Field(default=8, ge=1, le=4096, description="Examples per device per optimizer step.")
    gradient_accumulation_steps: int = Field(default=1, ge=1, le=1024, description="Micro-batches summed per optimizer step.")
    max_seq_length: int = Field(default=1024, ge=8, le=262_144, description="Tokens per example; longer examples are truncated.")
    seed: int = Field(default=42, ge=0, le=2**31 - 1, description="Random seed for data order and adapter initialisation.")
    logging_steps: int = Field(default=1, ge=1, le=100_000, description="Record loss every this many steps.")
    checkpoint_every_steps: int | None = Field(
        default=None,
        ge=1,
        le=10_000_000,
        description="Save a resumable checkpoint (adapter, optimizer, scheduler, RNG) to the artifact store "
        "every this many optimizer steps, so a new attempt of the run resumes there. At most one checkpoint "
        "is stored per minute (the Hub's commit quota); a save that comes sooner stays local. None: no "
        "step-based checkpoints (`checkpoint_every_minutes` may still save some).",
    )
    checkpoint_every_minutes: int | None = Field(
        default=15,
        ge=1,
        le=10_080,
        description="Save a resumable checkpoint to the artifact store once this many minutes have passed since "
        "training began or since the last checkpoint, whichever came later, so a preempted or failed attempt "
        "loses at most this much training. Works alongside `checkpoint_every_steps`: a checkpoint is saved "
        "when either says so. The default 15 costs about 4 commits an hour of the artifact repo's quota (the "
        "Hub allows about 128 per hour per repo, shared by the runs that write to it). None: no time-based "
        "checkpoints.",
    )
    keep_checkpoints: int = Field(
        default=1, ge=1, le=100,
        description="Checkpoints kept in the artifact store; older ones are deleted in the commit that adds a new one.",
    )
    report_to: list[Literal["wandb", "mlflow"]] = Field(
        default_factory=list,
        max_length=2,
        description="Trackers that record the training (and evaluation) metrics, through TRL's own integrations. "
        "`wandb`: online when the run's `[worker] secrets` give `WANDB_API_KEY`, else offline; the project is "
        "`WANDB_PROJECT` from `[worker] env` (default `loraflow`). `mlflow`: to the tracking server at "
        "`MLFLOW_TRACKING_URI` from `[worker] env` (its credentials, e.g. `MLFLOW_TRACKING_TOKEN`, in `[worker] "
        "secrets`), else to a file store; the experiment is `MLFLOW_EXPERIMENT_NAME` (default `loraflow`). Each "
        "attempt is one tracker run named `<run id>-a<attempt>`. Either way the tracker's local files are stored "
        "with the run under `tracking/a<attempt>/`, and the summary links the tracker's run. Empty: no tracker.",
    )

    @field_validator("report_to")
    @classmethod
    def _each_tracker_once(cls, trackers: list[str]) -> list[str]:
        if len(set(trackers)) != len(trackers):
            raise ValueError("name each tracker once")
        return trackers


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
        "skips the reference model entirely.",
    )
    rewards: list[RewardSpec] = Field(min_length=1, max_length=32, description="The reward functions, summed with their weights.")


def grpo_setting_problems(algorithm: str, grpo: GrpoSettings | None, training: TrainingSettings) -> list[str]:
    """What is wrong with a job's GRPO settings for `algorithm` (empty when nothing). Shared by the worker's
    `JobInput` and the control plane's run spec, so both refuse the same jobs with the same words."""
    if algorithm != "grpo":
        return [] if grpo is None else [
            f"`grpo` is set but algorithm is '{algorithm}': remove the `grpo` section or set algorithm to 'grpo'"
        ]
    if grpo is None:
        return ["algorithm is 'grpo' but `grpo` is not set: add a `grpo` section with at least one reward"]
    completions = training.batch_size * training.gradient_accumulation_steps
    if completions % grpo.num_generations:
        return [
            f"`training.batch_size` × `training.gradient_accumulation_steps` ({training.batch_size} × "
            f"{training.gradient_accumulation_steps} = {completions} completions per step) must be a multiple of "
            f"`grpo.num_generations` ({grpo.num_generations}): every prompt's group must fit in one step; "
            f"e.g. set batch_size to {grpo.num_generations * max(1, round(training.batch_size / grpo.num_generations))}"
        ]
    return []


class EvaluationSettings(_Strict):
    """Held-out evaluation while training: before the first step, every `every_steps` optimizer steps and after
    the last (the Trainer's `eval_on_start` and step strategy), on at most `max_samples` examples that are not
    trained on. SFT records the loss on them (`eval_loss`). GRPO records the mean total reward (the rewards summed
    with their weights, as in training) of ONE completion per evaluation prompt, sampled the way training samples
    (temperature `grpo.temperature`, at most `grpo.max_completion_length` tokens; not greedy): a noisy estimate,
    which a larger `max_samples` steadies (`eval_reward`)."""

    fraction: float | None = Field(
        default=None,
        gt=0.0,
        lt=0.5,
        description="Hold this share of the training dataset out for evaluation, picked at random with "
        "`training.seed` (the same seed holds the same rows out on every attempt); the rest is trained on. "
        "Give `fraction` or `store_path`, not both.",
    )
    store_path: str | None = Field(
        default=None,
        max_length=1024,
        description="Path of a JSONL file of evaluation examples inside the artifact store, in the training "
        "dataset's formats (set by the control plane when it publishes `evaluation.local_file`).",
    )
    every_steps: int = Field(
        default=50, ge=1, le=10_000_000,
        description="Evaluate every this many optimizer steps, besides once before the first step and once after "
        "the last.",
    )
    max_samples: int = Field(
        default=200, ge=1, le=100_000,
        description="Evaluate on at most this many examples (a seeded sample of the held-out ones), so that "
        "evaluation stays a small share of the run's time and cost.",
    )

    @model_validator(mode="after")
    def _exactly_one_source(self) -> EvaluationSettings:
        if (self.fraction is None) == (self.store_path is None):
            raise ValueError("give exactly one of `fraction` (a held-out share of the dataset) or `store_path` "
                             "(an evaluation file in the store)")
        return self


class MemorySettings(_Strict):
    """Memory settings forced on an attempt instead of the worker's memory plan (each None: the plan decides). The
    control plane sets them after an out-of-memory attempt; the run manifest records which were forced."""

    gradient_checkpointing: bool | None = Field(
        default=None, description="Force gradient checkpointing on (recompute activations: less memory, ~30% slower) or off."
    )
    micro_batch_size: int | None = Field(
        default=None,
        ge=1,
        le=4096,
        description="Sequences per device step. The worker sets the gradient accumulation steps so that micro-batch × "
        "accumulation is the run's effective batch (`training.batch_size` × `training.gradient_accumulation_steps`), "
        "which it must divide.",
    )
    vllm_gpu_memory_utilization: float | None = Field(
        default=None,
        gt=0.0,
        lt=1.0,
        description="GRPO: the share of the GPU's memory the colocated vLLM engine takes, instead of the planned one.",
    )
    vllm_colocate: bool | None = Field(
        default=None,
        description="GRPO: false turns vLLM colocation off, so the training model generates the completions "
        "(transformers' `generate`: slower, but no memory set aside for vLLM). None: vLLM colocates where the "
        "memory plan says it fits. True is refused: to force vLLM's share, set `vllm_gpu_memory_utilization`.",
    )


def memory_setting_problems(algorithm: str, lora: LoraSettings, training: TrainingSettings,
                            memory: MemorySettings | None) -> list[str]:
    """What is wrong with a job's forced memory settings and its quantization (empty when nothing). Shared by the
    worker's `JobInput` and the control plane, so both refuse the same jobs with the same words."""
    memory = memory or MemorySettings()
    problems = []
    effective = training.batch_size * training.gradient_accumulation_steps
    micro = memory.micro_batch_size
    if micro is not None and effective % micro:
        divisors = [d for d in range(1, effective + 1) if effective % d == 0]
        problems.append(
            f"`memory.micro_batch_size` ({micro}) must divide the effective batch, `training.batch_size` × "
            f"`training.gradient_accumulation_steps` ({training.batch_size} × {training.gradient_accumulation_steps} = "
            f"{effective} sequences per optimizer step), so that micro-batches × accumulation steps keep it: use one of "
            f"{', '.join(map(str, divisors))}"
        )
    vllm_set = [f"`memory.{name}`" for name in ("vllm_gpu_memory_utilization", "vllm_colocate") if getattr(memory, name) is not None]
    if algorithm != "grpo" and vllm_set:
        problems.append(f"{' and '.join(vllm_set)} {'applies' if len(vllm_set) == 1 else 'apply'} to GRPO only "
                        f"(algorithm is '{algorithm}'): remove {'it' if len(vllm_set) == 1 else 'them'}")
    if memory.vllm_colocate is True:
        problems.append("`memory.vllm_colocate` can only turn colocation off (false): vLLM colocates wherever the memory "
                        "plan says it fits; to force its share, set `memory.vllm_gpu_memory_utilization` instead")
    if memory.vllm_colocate is False and memory.vllm_gpu_memory_utilization is not None:
        problems.append("`memory.vllm_gpu_memory_utilization` is set but `memory.vllm_colocate` is false: there is no "
                        "colocated vLLM to give a share to; remove one of them")
    if lora.quantization == "4bit" and algorithm == "grpo" and memory.vllm_colocate is not False:
        # TRL loads a colocated vLLM with the adapter merged into the base; into a 4-bit base that merge misbehaves.
        problems.append(
            "`lora.quantization` '4bit' with algorithm 'grpo' needs vLLM colocation off: TRL merges the adapter into the "
            "4-bit base to load it into vLLM, which misbehaves. Set `memory.vllm_colocate` to false (the training model "
            "generates the completions), or `lora.quantization` to 'none'"
        )
    return problems


FORCIBLE_FAST_PATHS = ("gradient_checkpointing", "paged_adamw_8bit")
"""The fast paths a run may force on (`true`): the memory trade-offs. Kernels are on wherever they can be."""


class FastPathSettings(_Strict):
    """GPU fast paths (kernels and memory savers) switched on or off for this run. Each left empty is automatic: the
    worker uses what the GPU, the installed kernels and its memory plan allow. False switches one off (an A/B
    measurement, a kernel bug in the field); true forces a memory saver on. The run manifest records, for every fast
    path, whether it engaged and why. On a CPU (local mode) none engages."""

    bf16: bool | None = Field(
        default=None, description="bf16 mixed precision, on GPUs that have bf16 tensor cores (Ampere, sm_80, and newer). "
        "False trains in fp32: more memory, slower.")
    liger_kernel: bool | None = Field(
        default=None, description="Liger's Triton kernels for the model's layers (RMSNorm, SwiGLU, RoPE), where Liger "
        "supports the model type. False: transformers' own layers.")
    flash_linear_attention: bool | None = Field(
        default=None, description="flash-linear-attention kernels for Gated-DeltaNet layers (Qwen3.5, Qwen3-Next). False: "
        "transformers' torch loop, several times slower.")
    causal_conv1d: bool | None = Field(
        default=None, description="causal-conv1d's kernel for the short convolution of Gated-DeltaNet layers. False: "
        "transformers' torch conv1d (a small share of the step).")
    gradient_checkpointing: bool | None = Field(
        default=None, description="Recompute activations in the backward pass: less memory, about 30% slower. Empty: the "
        "memory plan decides; true forces it on, false off. After an out-of-memory attempt the control plane's memory "
        "settings take precedence.")
    fused_adamw: bool | None = Field(
        default=None, description="torch's AdamW with its fused CUDA kernel. False: torch's plain AdamW.")
    paged_adamw_8bit: bool | None = Field(
        default=None, description="bitsandbytes' 8-bit paged AdamW: less optimizer memory. Empty: used when the memory plan "
        "finds memory short; true forces it (the image must have bitsandbytes), false never.")
    expandable_segments: bool | None = Field(
        default=None, description="The CUDA allocator's expandable segments (`PYTORCH_CUDA_ALLOC_CONF="
        "expandable_segments:True`, set before CUDA starts): less fragmentation. False: the allocator's defaults.")
    vllm_colocate: bool | None = Field(
        default=None, description="GRPO: completions generated by a vLLM engine colocated on the training GPU, asleep "
        "while training steps (far faster than transformers' generate). Empty: where the memory plan says it fits. "
        "False: transformers' generate.")

    @field_validator("bf16", "liger_kernel", "flash_linear_attention", "causal_conv1d", "fused_adamw",
                     "expandable_segments", "vllm_colocate")
    @classmethod
    def _only_memory_savers_can_be_forced(cls, value: bool | None, info: ValidationInfo) -> bool | None:
        if value is True:
            raise ValueError(
                f"`{info.field_name}` cannot be forced on: it is used wherever the GPU and the image allow it; leave it "
                f"empty (automatic) or set false to switch it off. Only {' and '.join(FORCIBLE_FAST_PATHS)} can be true"
            )
        return value

    def switched_off(self) -> frozenset[str]:
        """The fast paths this run switches off."""
        return frozenset(name for name, value in self if value is False)

    def switched_on(self) -> frozenset[str]:
        """The memory savers this run forces on."""
        return frozenset(name for name, value in self if value is True)


ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]{0,127}$"
"""An environment variable's name as a shell accepts it: letters, digits and `_`, not starting with a digit."""
MAX_WORKER_ENV = 64
"""Variables a run may add to its worker's environment, plain and secret each."""
# The one list of the names a run cannot set in its worker's environment (`[worker] env` and `secrets`), with why:
# the control plane sets them, or they would change how the worker itself runs (which interpreter and libraries,
# which GPU, where its files go, where pip installs from). The run spec refuses them before anything is rented;
# the worker refuses a job that lists them. Compared without regard to case.
RESERVED_ENV_NAMES: dict[str, str] = {
    "HF_TOKEN": "loraflow gives the worker the run's Hugging Face token, from `hub_token_secret`",
    "HUGGING_FACE_HUB_TOKEN": "loraflow gives the worker the run's Hugging Face token, from `hub_token_secret`",
    "HF_TOKEN_PATH": "loraflow gives the worker the run's Hugging Face token, from `hub_token_secret`",
    "HF_ENDPOINT": "loraflow points the worker at the Hub its control plane uses",
    "HF_HOME": "the worker keeps Hub files where it reads them (the network volume's cache or its own disk)",
    "CUDA_VISIBLE_DEVICES": "the worker trains on the GPU RunPod gives it",
    "CUDA_DEVICE_ORDER": "the worker trains on the GPU RunPod gives it",
    "PYTORCH_CUDA_ALLOC_CONF": "the worker sets the CUDA allocator before CUDA starts, as "
                               "`fast_paths.expandable_segments` says",
    "PATH": "the worker runs the image's programs",
    "HOME": "the worker's files live where the image puts them",
    "TMPDIR": "the worker's scratch files live on its container disk",
}
RESERVED_ENV_PREFIXES: dict[str, str] = {
    "HF_HUB_": "the Hub client's settings (offline mode, cache, transfers) are the worker's",
    "RUNPOD_": "RunPod sets them (the worker's own API key among them)",
    "LORAFLOW_": "loraflow's own settings, set by the control plane or the image",
    "NVIDIA_": "the container runtime's GPU settings are RunPod's",
    "LD_": "the dynamic linker's settings would change which libraries the worker loads",
    "PYTHON": "the interpreter's settings are the image's",
    "PIP_": "`extra_packages` install from the image's package index settings only",
}


def worker_env_name(name: str) -> str:
    """`name` as one of a run's own worker variables (`[worker] env` or `secrets`); ValueError naming it and why not."""
    if not re.match(ENV_NAME_PATTERN, name):
        raise ValueError(f"`{name}` is not an environment variable name: use letters, digits and `_`, not starting "
                         "with a digit (at most 128 characters)")
    upper = name.upper()
    reason = RESERVED_ENV_NAMES.get(upper) or next(
        (why for prefix, why in RESERVED_ENV_PREFIXES.items() if upper.startswith(prefix)), None)
    if reason is not None:
        raise ValueError(f"`{name}` cannot be set by a run ({reason}): remove it")
    return name


def worker_env_overlap(env_names: Iterable[str], secret_names: Iterable[str]) -> str | None:
    """Why the same name cannot be both a plain variable and a secret, or None when no name is both."""
    both = sorted(set(env_names) & set(secret_names))
    if not both:
        return None
    return (f"{', '.join(f'`{name}`' for name in both)} {'is' if len(both) == 1 else 'are'} in both `env` and `secrets`: "
            "keep each name in one (`secrets` for a credential)")


def plain_requirements(packages: list[str]) -> list[str]:
    """`extra_packages` as the worker installs them; ValueError for anything but a plain pip requirement."""
    for package in packages:
        if len(package) > 200 or not _REQUIREMENT.match(package.replace(" ", "")):
            raise ValueError(
                f"{package!r} is not a plain pip requirement: use `name`, `name==1.2.3` or "
                "`name[extra]>=1,<2` (no URLs, paths, markers or options)"
            )
    return [package.replace(" ", "") for package in packages]


class JobInput(_Strict):
    """What the control plane asks the worker to do: the RunPod job's `input`."""

    contract_version: int = Field(default=CONTRACT_VERSION, description="Version of this contract.")
    mode: Literal["train"] = Field(
        default="train", description="What the worker should do: `train` (the default when left out). Preload jobs "
        "send a `PreloadInput` instead."
    )
    run_id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._-]+$", description="The Prefect flow run id.")
    attempt: int = Field(default=1, ge=1, le=100, description="Attempt number of this run (1 for the first try).")
    algorithm: Literal["sft", "grpo"] = Field(default="sft", description="Training algorithm: `sft` or `grpo`.")
    model: ModelSource
    dataset: DatasetSource
    lora: LoraSettings = Field(default_factory=LoraSettings)
    training: TrainingSettings = Field(default_factory=TrainingSettings)
    grpo: GrpoSettings | None = Field(
        default=None, validate_default=True, description="GRPO settings: required when `algorithm` is `grpo`, refused otherwise."
    )
    evaluation: EvaluationSettings | None = Field(
        default=None, description="Held-out evaluation while training; None: no evaluation."
    )
    artifact_store: str = Field(
        min_length=1,
        max_length=1024,
        description="Artifact store URL: `file:///abs/path` or `hf://datasets/<org>/<repo>`.",
    )
    deadline_epoch_s: float | None = Field(
        default=None,
        description="Unix time by which the worker must have stopped; None means no deadline. Training that "
        "reaches it stores the adapter trained so far and a checkpoint to resume from, then fails the job.",
    )
    memory: MemorySettings | None = Field(
        default=None,
        validate_default=True,
        description="Memory settings the control plane forces after an out-of-memory attempt (None: the worker's memory "
        "plan decides everything).",
    )
    extra_packages: list[str] = Field(
        default_factory=list,
        max_length=MAX_EXTRA_PACKAGES,
        description="pip requirements installed on the worker before training, e.g. `[\"sympy==1.13.3\"]`: "
        "name, optional extras and version specifiers only (no URLs or pip options). The image's training "
        "stack (torch, transformers, ...) is held at its installed versions.",
    )

    worker_env_names: list[str] = Field(
        default_factory=list,
        max_length=MAX_WORKER_ENV,
        description="Names of the run's own plain variables in the endpoint's env (`[worker] env`): the worker hands "
        "exactly these, whatever their names look like, to the training process beside what it always hands on.",
    )
    worker_secret_names: list[str] = Field(
        default_factory=list,
        max_length=MAX_WORKER_ENV,
        description="Names, never values, of the run's secrets (`[worker] secrets`), which RunPod puts in the worker's "
        "env from account secrets: the worker hands them to the training process and removes their values from "
        "everything it stores or returns (console, errors).",
    )
    fast_paths: FastPathSettings = Field(
        default_factory=FastPathSettings, description="Fast paths switched on or off for this run (empty: automatic)."
    )

    _plain_requirements = field_validator("extra_packages")(plain_requirements)

    @field_validator("grpo")
    @classmethod
    def _grpo_settings_match_the_algorithm(cls, grpo: GrpoSettings | None, info: ValidationInfo) -> GrpoSettings | None:
        # A field validator (fields validate in order: algorithm and training first) so errors carry `grpo`.
        if "algorithm" in info.data and "training" in info.data:
            problems = grpo_setting_problems(info.data["algorithm"], grpo, info.data["training"])
            if problems:
                raise ValueError("; ".join(problems))
        return grpo

    @field_validator("worker_env_names", "worker_secret_names")
    @classmethod
    def _names_a_run_may_set(cls, names: list[str]) -> list[str]:
        return [worker_env_name(name) for name in names]

    @field_validator("worker_secret_names")
    @classmethod
    def _plain_or_secret_not_both(cls, names: list[str], info: ValidationInfo) -> list[str]:
        problem = worker_env_overlap(info.data.get("worker_env_names", []), names)
        if problem:
            raise ValueError(problem)
        return names

    @field_validator("memory")
    @classmethod
    def _memory_settings_fit_the_job(cls, memory: MemorySettings | None, info: ValidationInfo) -> MemorySettings | None:
        # Validated for an unset `memory` too (`validate_default`): the 4-bit GRPO refusal needs no memory settings.
        if all(name in info.data for name in ("algorithm", "lora", "training")):
            problems = memory_setting_problems(info.data["algorithm"], info.data["lora"], info.data["training"], memory)
            if problems:
                raise ValueError("; ".join(problems))
        return memory


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


class TrainMetrics(_Strict):
    """Summary of a finished training run, as stored in `metrics.json`."""

    steps: int = Field(description="Optimizer steps taken.")
    losses: list[tuple[int, float]] = Field(description="(step, training loss) pairs, in step order.")
    rewards: list[tuple[int, float]] = Field(
        default_factory=list, description="GRPO: (step, mean total reward of the step's completions) pairs; empty for SFT."
    )
    eval_loss: list[tuple[int, float]] = Field(
        default_factory=list,
        description="SFT with `evaluation`: (step, loss on the held-out examples) pairs in step order, from step 0 "
        "(before training) to the last step; empty otherwise.",
    )
    eval_reward: list[tuple[int, float]] = Field(
        default_factory=list,
        description="GRPO with `evaluation`: (step, mean total reward of one sampled completion per held-out prompt) "
        "pairs in step order, from step 0 to the last step; empty otherwise.",
    )
    first_loss: float | None = Field(description="Loss at the first logged step.")
    final_loss: float | None = Field(description="Loss at the last logged step.")
    tokens: int = Field(description="Training tokens processed (non-padding).")
    wall_seconds: float = Field(description="Seconds spent in training.")
    device: str = Field(description="Device trained on, e.g. `cpu` or `cuda:0 (NVIDIA H100 80GB HBM3)`.")


class TrackerRun(_Strict):
    """Where one tracker recorded an attempt (`training.report_to`)."""

    tracker: Literal["wandb", "mlflow"] = Field(description="The tracker.")
    run_id: str = Field(description="The tracker's own id of the run.")
    run_name: str = Field(description="The run's name in the tracker: `<run id>-a<attempt>`.")
    url: str | None = Field(
        default=None, description="The run's page in the tracker (W&B online, an MLflow tracking server); None when "
        "the run was recorded locally only (W&B offline, an MLflow file store).")
    store_path: str | None = Field(
        default=None, description="Folder of the tracker's local files inside the artifact store (the offline W&B "
        "run or the MLflow file store); None when none were stored.")
    note: str = Field(default="", description="How to open what was stored, or why something was not.")


class JobResult(_Strict):
    """What the worker returns as the job's `output` when training completed."""

    contract_version: int = Field(default=CONTRACT_VERSION)
    run_id: str
    attempt: int
    status: Literal["completed"] = "completed"
    run_prefix: str = Field(description="Path of this run's folder inside the artifact store, e.g. `runs/<run_id>`.")
    adapter_path: str = Field(description="Path of the adapter folder inside the artifact store.")
    metrics: TrainMetrics
    trackers: list[TrackerRun] = Field(
        default_factory=list, description="Where the trackers of `training.report_to` recorded this attempt.")


class PartialResult(_Strict):
    """What a run stopped by its job's deadline stored, as `<run_prefix>/partial/result.json`. The run is not
    complete (there is no `DONE`): a new attempt resumes from `checkpoint_path`."""

    contract_version: int = Field(default=CONTRACT_VERSION)
    run_id: str = Field(description="The Prefect flow run id.")
    attempt: int = Field(description="The attempt that stored this.")
    step: int = Field(description="Optimizer steps taken when training stopped.")
    total_steps: int = Field(description="Optimizer steps the run was to take.")
    loss: float | None = Field(description="The last logged training loss; None when none was logged.")
    stopped_because: str = Field(description="Why training stopped before its last step.")
    adapter_path: str = Field(description="Folder of the adapter trained so far, inside the artifact store.")
    checkpoint_path: str = Field(description="Folder of the checkpoint of `step` inside the artifact store.")


class Progress(_Strict):
    """A progress update the worker sends while training (`runpod.serverless.progress_update`)."""

    kind: Literal["progress"] = "progress"
    stage: Literal["loading", "training", "saving"] = Field(description="What the worker is doing.")
    step: int = Field(default=0, description="Optimizer steps done.")
    total_steps: int | None = Field(default=None, description="Optimizer steps planned, when known.")
    loss: float | None = Field(default=None, description="Latest training loss.")
    reward: float | None = Field(default=None, description="Latest mean total reward (GRPO).")
    eval_loss: float | None = Field(
        default=None, description="Latest loss on the held-out examples (SFT with evaluation).")
    eval_reward: float | None = Field(
        default=None, description="Latest mean reward on the held-out prompts (GRPO with evaluation).")
    tokens_per_second: float | None = Field(default=None, description="Training tokens per second in this attempt so far.")
    eta_seconds: float | None = Field(default=None, description="Estimated seconds until training ends.")
    message: str = Field(default="", max_length=2000, description="Free text for the log.")


def run_prefix(run_id: str) -> str:
    """The folder of a run inside the artifact store. Both sides derive it the same way."""
    return f"runs/{run_id}"
