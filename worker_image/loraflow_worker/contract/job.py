"""A training job: what the control plane asks the worker to do, as the RunPod job's `input`."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator

from loraflow_worker.contract.dpo_settings import DpoSettings, dpo_setting_problems
from loraflow_worker.contract.env_names import MAX_WORKER_ENV, worker_env_name, worker_env_overlap
from loraflow_worker.contract.fast_path_settings import FastPathSettings
from loraflow_worker.contract.grpo_settings import GrpoSettings, colocated_vllm_problems, grpo_setting_problems
from loraflow_worker.contract.memory_settings import MemorySettings, memory_setting_problems
from loraflow_worker.contract.sources import DatasetSource, ModelSource
from loraflow_worker.contract.stored_inputs import Sha256, StoredInputs
from loraflow_worker.contract.task_evaluation import task_files
from loraflow_worker.contract.lora_settings import LoraSettings
from loraflow_worker.contract.training_settings import (
    EvaluationSettings,
    TrainingSettings,
    early_stopping_problems,
    optimisation_problems,
)
from loraflow_worker.contract.version import CONTRACT_VERSION, _Strict

MAX_EXTRA_PACKAGES = 20
_REQUIREMENT = re.compile(
    r"^[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?"  # project name (PEP 508)
    r"(?:\[[A-Za-z0-9._-]+(?:,[A-Za-z0-9._-]+)*\])?"  # extras
    r"(?:(?:==|!=|<=|>=|~=|<|>)[A-Za-z0-9.*+!]+(?:,(?:==|!=|<=|>=|~=|<|>)[A-Za-z0-9.*+!]+)*)?$"  # versions
)
"""A plain requirement: name, extras, version specifiers. No URLs, paths, markers or pip options, so a job
cannot point pip at another index or pass it flags."""


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
    algorithm: Literal["sft", "grpo", "dpo"] = Field(
        default="sft", description="Training algorithm: `sft`, `grpo` or `dpo` (preference pairs)."
    )
    model: ModelSource
    dataset: DatasetSource
    lora: LoraSettings = Field(default_factory=LoraSettings)
    training: TrainingSettings = Field(default_factory=TrainingSettings)
    grpo: GrpoSettings | None = Field(
        default=None, validate_default=True, description="GRPO settings: required when `algorithm` is `grpo`, refused otherwise."
    )
    dpo: DpoSettings | None = Field(
        default=None, validate_default=True,
        description="DPO settings when `algorithm` is `dpo` (None: their defaults), refused otherwise.",
    )
    evaluation: EvaluationSettings | None = Field(
        default=None, validate_default=True, description="Held-out evaluation while training; None: no evaluation."
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
    worker_env_sha256: dict[str, Sha256] = Field(
        default_factory=dict,
        description="For each name of `worker_env_names`, the sha256 of the value the control plane checked: the worker "
        "refuses the job when the value in its environment is another (RunPod puts account secrets in place of "
        "`{{ RUNPOD_SECRET_<name> }}` anywhere in an env value, which a plain variable must never receive).",
    )
    worker_secret_names: list[str] = Field(
        default_factory=list,
        max_length=MAX_WORKER_ENV,
        description="Names, never values, of the run's secrets (`[worker] secrets`), which RunPod puts in the worker's "
        "env from account secrets: the worker hands them to the training process and removes their values from "
        "everything it stores or returns (console, errors).",
    )
    fast_paths: FastPathSettings = Field(
        default_factory=FastPathSettings, validate_default=True,
        description="Fast paths switched on or off for this run (empty: automatic)."
    )
    inputs: StoredInputs | None = Field(
        default=None,
        description="The run's files as the control plane stored them (the commit that holds them, their sha256): the "
        "worker reads each at that commit and refuses one that changed since. None: nothing pinned (a job written by "
        "hand).",
    )

    checkpoint_key: str | None = Field(
        default=None, min_length=32, max_length=128, repr=False,
        description="The run's checkpoint key, which the control plane derives for the run (the same for every "
        "attempt) from a key of its own: the worker signs its record of each checkpoint with it and resumes only "
        "from a checkpoint whose record it signs, so a checkpoint someone else put in the run's store is never "
        "loaded. None: no checkpoint is the run's own, and every attempt trains from the start.",
    )

    def input_files(self) -> dict[str, str]:
        """Store path → the field that names it, for every file of the run that the worker reads from the store."""
        return _input_files(self.dataset, self.training, self.grpo, self.evaluation)

    _plain_requirements = field_validator("extra_packages")(plain_requirements)

    @field_validator("grpo")
    @classmethod
    def _grpo_settings_match_the_algorithm(cls, grpo: GrpoSettings | None, info: ValidationInfo) -> GrpoSettings | None:
        # A field validator (fields validate in order: algorithm, lora and training first) so errors carry `grpo`.
        if all(name in info.data for name in ("algorithm", "lora", "training")):
            problems = grpo_setting_problems(info.data["algorithm"], grpo, info.data["training"], info.data["lora"])
            if problems:
                raise ValueError("; ".join(problems))
        return grpo

    @field_validator("dpo")
    @classmethod
    def _dpo_settings_match_the_algorithm(cls, dpo: DpoSettings | None, info: ValidationInfo) -> DpoSettings | None:
        if all(name in info.data for name in ("algorithm", "lora", "training")):
            problems = dpo_setting_problems(info.data["algorithm"], dpo, info.data["training"], info.data["lora"])
            if problems:
                raise ValueError("; ".join(problems))
        return dpo

    @field_validator("evaluation")
    @classmethod
    def _early_stopping_has_its_evaluation(cls, evaluation: EvaluationSettings | None,
                                           info: ValidationInfo) -> EvaluationSettings | None:
        # Validated when unset too (`validate_default`): early stopping without an evaluation is the refusal.
        if all(name in info.data for name in ("algorithm", "training")):
            problems = early_stopping_problems(info.data["algorithm"], info.data["training"], evaluation)
            if problems:
                raise ValueError("; ".join(problems))
        return evaluation

    @field_validator("worker_env_names", "worker_secret_names")
    @classmethod
    def _names_a_run_may_set(cls, names: list[str]) -> list[str]:
        return [worker_env_name(name) for name in names]

    @field_validator("worker_env_sha256")
    @classmethod
    def _a_hash_for_each_plain_variable(cls, hashes: dict[str, str], info: ValidationInfo) -> dict[str, str]:
        if "worker_env_names" in info.data and set(hashes) != set(info.data["worker_env_names"]):
            raise ValueError(f"names {sorted(hashes)}, but `worker_env_names` lists {info.data['worker_env_names']}: "
                             "give the sha256 of each listed variable's value, and of no other")
        return hashes

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

    @field_validator("fast_paths")
    @classmethod
    def _optimisation_fits_the_job(cls, fast_paths: FastPathSettings, info: ValidationInfo) -> FastPathSettings:
        # Validated for unset `fast_paths` too (`validate_default`): the scheduler's needs are the job's other sections.
        problems = []
        if all(name in info.data for name in ("algorithm", "training", "evaluation")):
            problems += optimisation_problems(info.data["algorithm"], info.data["training"], info.data["evaluation"],
                                              fast_paths)
        if all(name in info.data for name in ("algorithm", "lora", "memory")):
            problems += colocated_vllm_problems(info.data["algorithm"], info.data["lora"], fast_paths,
                                                info.data["memory"])
        if problems:
            raise ValueError("; ".join(problems))
        return fast_paths

    @field_validator("inputs")
    @classmethod
    def _every_file_pinned(cls, inputs: StoredInputs | None, info: ValidationInfo) -> StoredInputs | None:
        # A file the job names but the pins leave out would be read unchecked.
        if inputs is not None and all(name in info.data for name in ("dataset", "training", "grpo", "evaluation")):
            files = _input_files(info.data["dataset"], info.data["training"], info.data["grpo"],
                                 info.data["evaluation"])
            missing = [f"{field} ({path})" for path, field in files.items() if path not in inputs.sha256]
            if missing:
                raise ValueError(f"no sha256 for {', '.join(missing)}: the control plane pins every file it stores "
                                 "for the run; give each store path's hash in `inputs.sha256`")
        return inputs


def _input_files(dataset: DatasetSource, training: TrainingSettings, grpo: GrpoSettings | None,
                 evaluation: EvaluationSettings | None) -> dict[str, str]:
    files = {source.store_path: field for field, source in
             [("dataset", dataset), *((f"dataset.mix[{i}]", entry) for i, entry in enumerate(dataset.mix))]
             if source.store_path is not None}
    if evaluation is not None and evaluation.store_path is not None:
        files[evaluation.store_path] = "evaluation"
    if evaluation is not None:
        files |= task_files(evaluation.tasks, "evaluation.tasks")
    if training.chat_template is not None and training.chat_template.endswith((".jinja", ".j2")):
        files[training.chat_template] = "training.chat_template"
    if grpo is not None:
        files |= {reward.store_path: f"grpo.rewards[{i}]" for i, reward in enumerate(grpo.rewards)
                  if reward.store_path is not None}
        files |= {path: field for field, path in (("grpo.tools", grpo.tools_store_path),
                                                  ("grpo.environment", grpo.environment_store_path)) if path}
    return files
