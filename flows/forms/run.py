"""The `train` flow's parameter: one run of LoRA fine-tuning, as the Prefect UI form shows it.

The same model loads from a TOML run file (`deployments/*.toml`):

    .venv/bin/python -c "from flows.forms.run import load_run_file; print(load_run_file('deployments/local.toml'))"

Unknown keys, wrong types and out-of-range values are refused before anything is spent, with the
field named. Secrets are never fields here: the spec is shown in the UI and stored with the run.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Annotated, Literal

from loraflow_worker.contract import (
    MAX_EXTRA_PACKAGES,
    MAX_WORKER_ENV,
    FastPathSettings,
    DpoSettings,
    GrpoSettings,
    JobInput,
    LoraSettings,
    ModelSource,
    TrainingSettings,
    colocated_vllm_problems,
    dpo_setting_problems,
    early_stopping_problems,
    grpo_setting_problems,
    optimisation_problems,
    plain_requirements,
    secret_reference_problem,
    worker_env_name,
    worker_env_overlap,
)
from loraflow_worker.contract.reward_names import reward_kind, split_file_reward
from pydantic import (
    BeforeValidator,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from flows.forms.run_data import DatasetSpec, EvaluationSpec, Section
from tasks.placement.plan import job_limits_s, max_deadline_minutes
from tasks.runpod.catalog import resolve_gpu
from tasks.runpod.models import RUNPOD_MAX_EXECUTION_TIMEOUT_S, RUNPOD_MAX_JOB_TTL_S

BLOCK_NAME_PATTERN = r"^[a-z0-9-]+$"
"""Prefect's rule for a block's name: lowercase letters, digits and dashes (`prefect/types/names.py`)."""
ARTIFACT_STORE_PATTERN = r"^(file:///.+|hf://datasets/[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*)$"


def _as_list(value: object) -> object:
    return [value] if isinstance(value, str) else value


class ComputeSpec(Section):
    """Which GPUs to rent. Each run gets its own endpoint with one worker."""

    gpu: Annotated[list[str], BeforeValidator(_as_list)] = Field(
        default=["RTX 4090"], min_length=1, max_length=8,
        description="GPU class, or an ordered fallback list tried when RunPod has no capacity "
        "(e.g. `[\"H100\", \"A100 SXM\"]`). Aliases like `4090` or `h100` work.",
    )
    gpu_count: int = Field(
        default=1, ge=1, json_schema_extra={"maximum": 1},
        description="GPUs per worker. The worker trains on one GPU, so this is 1.",
    )
    disk_gb: int = Field(default=40, ge=10, le=1000, description="Container disk per worker, in GB (model, data, checkpoints).")

    @field_validator("gpu")
    @classmethod
    def _known_gpus(cls, names: list[str]) -> list[str]:
        return [resolve_gpu(n).name for n in names]

    @field_validator("gpu_count")
    @classmethod
    def _one_gpu(cls, count: int) -> int:
        if count > 1:
            raise ValueError(
                f"compute.gpu_count {count}: the worker trains on one GPU, so the other {count - 1} would be billed "
                "and idle; use 1"
            )
        return count


class AttemptsSpec(Section):
    """When to give up on an attempt and start another (on a new endpoint, resuming from the last
    checkpoint). Code failures are never retried."""

    max_attempts: int = Field(default=3, ge=1, le=10, description="Attempts per run, the first included.")
    queue_minutes: float = Field(
        default=20, ge=1, le=24 * 60,
        description="Longest wait for a worker to take the job before the GPU counts as out of capacity and the "
        "next GPU of compute.gpu is tried. A cold pull of the worker image also waits here.",
    )
    startup_minutes: float = Field(
        default=30, ge=1, le=24 * 60,
        description="Longest time from the job starting to its first training step (model and data download).",
    )
    stall_minutes: float = Field(
        default=15, ge=1, le=24 * 60, description="Longest time without training progress before the attempt counts as stalled."
    )


HUB_MODEL_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$"
"""A Hub repo id, `<namespace>/<name>`: each part starts with a letter or digit, then letters, digits, `.`, `_`,
`-`, at most 96 characters (the Hub's rule; it also refuses `--` and `..` and a trailing `-` or `.`)."""


class PublishServe(Section):
    """`[publish.serve]`: once the run has completed and published, serve its adapter on its base with the `serve`
    flow ([serving](serving.md)), as a subflow of the run: the run prints the OpenAI base URL and lives on until the
    serve ends (its `hours`, its budget, a cancel, `python -m flows.serve --stop <run name>`). The adapter answers
    to the run's name; it is the run's own, `runs/<id>` of its store (from an hf:// store, the private model repo
    `<org>/loraflow-<run id>`), never `hub_model_id`, which later runs commit to. An adapter vLLM refuses (DoRA,
    `modules_to_save`, ...) is not served, and a failed serve leaves the run completed: either says why, as a warning.
    `serve = true` takes every default."""

    hours: float = Field(default=1, gt=0, le=168, description="How long the endpoint may live, from the start of the "
                         "serve: then it is deleted.")
    budget_usd: float | None = Field(default=None, gt=0, le=100_000, description="The endpoint is deleted once it "
                                     "has cost this much. Empty: the run's `budget_usd` (one of the two is needed).")
    gpu: list[str] | None = Field(default=None, min_length=1, description="GPU classes to serve on, the cheapest "
                                  "that holds the model first. Empty: `compute.gpu`.")
    max_workers: int = Field(default=1, ge=1, le=30, description="The most workers the endpoint runs at once, held "
                             "as slots of the endpoint limit while it lives.")
    idle_timeout_s: int = Field(default=60, ge=1, le=3600, description="Seconds an idle worker stays up (and bills) "
                                "before it stops.")
    max_model_len: int | None = Field(default=None, ge=64, le=1_048_576, description="The longest prompt + answer "
                                      "in tokens. Empty: `training.max_seq_length` (for GRPO, its prompt and "
                                      "completion lengths together).")


class PublishSpec(Section):
    """Publish the run once it has completed, by name, to Hub model repos: the adapter (`hub_model_id`: the adapter
    files and a model card — base model, training settings, final metrics, curve, how to load and serve it — in one
    commit, so that `PeftModel.from_pretrained(base, "<org>/<name>")` and vLLM's `--lora-modules` load it), and/or the
    base with the adapter merged into it (`merged_model_id`: a plain bf16 model that transformers and vLLM load
    without PEFT, merged on a RunPod CPU worker and checked against base + adapter). At least one of the two. Needs a
    token that can write to `<org>` (checked before renting: present). An existing repo gets a new commit; a failed
    publish or merge leaves the run completed and the summary says why."""

    hub_model_id: str | None = Field(
        default=None, max_length=193, pattern=HUB_MODEL_ID_PATTERN,
        description="The Hub model repo to publish the adapter to, `<org>/<name>` (e.g. `acme/qwen3-capybara-lora`): "
        "created when missing, given a new commit when it exists. The run's token (`hub_token_secret`, else HF_TOKEN) "
        "must be able to write to it. Empty: the adapter stays in the artifact store (set `merged_model_id` then).",
    )
    merged_model_id: str | None = Field(
        default=None, max_length=193, pattern=HUB_MODEL_ID_PATTERN,
        description="The Hub model repo to publish the base model with the adapter merged into it to, `<org>/<name>` "
        "(e.g. `acme/qwen3-capybara`): merged in bf16 (a QLoRA adapter too) on a RunPod CPU worker sized from the "
        "model, its logits checked against base + adapter, published with a card naming the base, the adapter and "
        "the run. Costs a CPU worker for the download, the merge and the upload. Empty: no merged model.",
    )
    private: bool = Field(
        default=True,
        description="Create the repos private (only their owners see them). An existing repo keeps its visibility.",
    )
    serve: PublishServe | None = Field(
        default=None,
        description="Serve the adapter once published (`serve = true`, or its settings: `{ hours = 2, budget_usd = 5 "
        "}`): the run prints the OpenAI base URL and ends when the serve does. Empty: nothing is served.",
    )

    @field_validator("serve", mode="before")
    @classmethod
    def _true_takes_the_defaults(cls, value: object) -> object:
        return {} if value is True else None if value is False else value

    @field_validator("hub_model_id", "merged_model_id")
    @classmethod
    def _hub_naming_rules(cls, repo_id: str | None, info: ValidationInfo) -> str | None:
        for part in (repo_id or "").split("/"):
            if "--" in part or ".." in part or part.endswith(("-", ".")):
                raise ValueError(f"publish.{info.field_name} {repo_id!r}: the Hub refuses names with `--` or `..` or "
                                 "ending in `-` or `.`; rename it")
        return repo_id

    @model_validator(mode="after")
    def _one_repo_at_least(self) -> PublishSpec:
        if self.hub_model_id is None and self.merged_model_id is None and self.serve is None:
            raise ValueError("[publish] names no repo and serves nothing: set publish.hub_model_id (the adapter), "
                             "publish.merged_model_id (the merged model) or publish.serve, or remove [publish]")
        if self.hub_model_id is not None and self.hub_model_id == self.merged_model_id:
            raise ValueError(f"publish.hub_model_id and publish.merged_model_id are both {self.hub_model_id!r}: the "
                             "adapter and the merged model need repos of their own; rename one")
        return self

    @property
    def repos(self) -> dict[str, str]:
        """The repos the run publishes to, by their field (`publish.hub_model_id`, `publish.merged_model_id`)."""
        return {f"publish.{name}": repo for name, repo in (("hub_model_id", self.hub_model_id),
                                                           ("merged_model_id", self.merged_model_id)) if repo}


class WorkerSpec(Section):
    """The run's own variables in its worker's environment, e.g. the URL and the key of an LLM judge that a reward
    calls: the training process, and so every reward, reads each as `os.environ["NAME"]`. Names that loraflow or
    RunPod set, or that would change how the worker itself runs (`HF_TOKEN`, `HF_ENDPOINT`, `HF_HUB_*`, `RUNPOD_*`,
    `LORAFLOW_*`, `CUDA_VISIBLE_DEVICES`, `NVIDIA_*`, `PYTORCH_CUDA_ALLOC_CONF`, `PYTHON*`, `PATH`, `LD_*`, `PIP_*`,
    ...), are refused before anything is rented."""

    env: dict[str, Annotated[str, Field(max_length=4096)]] = Field(
        default_factory=dict, max_length=MAX_WORKER_ENV,
        description="Plain variables, `NAME = \"value\"`. Visible to anyone who can read the run's parameters or the "
        "account's endpoints: never a credential (put those in `secrets`). A value holding `{{` or `RUNPOD_SECRET_` "
        "is refused: RunPod would put an account secret in its place.",
    )
    secrets: dict[str, Annotated[str, Field(max_length=100, pattern=BLOCK_NAME_PATTERN)]] = Field(
        default_factory=dict, max_length=MAX_WORKER_ENV,
        description="Secret variables, `NAME = \"<Prefect Secret block name>\"` (the block's name, not the value). "
        "The flow reads each block where it runs and hands the value to the workers through a RunPod account secret: "
        "it is never in the run's parameters, logs or artifacts, the endpoint's env or the stored files, and the worker "
        "redacts it from its console and errors. A block that cannot be read, or holds fewer than 8 characters, is "
        "refused before anything is rented.",
    )

    @field_validator("env", "secrets")
    @classmethod
    def _names_a_run_may_set(cls, variables: dict[str, str]) -> dict[str, str]:
        for name in variables:
            worker_env_name(name)
        return variables

    @field_validator("env")
    @classmethod
    def _no_secret_references(cls, env: dict[str, str]) -> dict[str, str]:
        problems = [problem for name, value in env.items() if (problem := secret_reference_problem(name, value))]
        if problems:
            raise ValueError("; ".join(problems))
        return env

    @model_validator(mode="after")
    def _plain_or_secret_not_both(self) -> WorkerSpec:
        problem = worker_env_overlap(self.env, self.secrets)
        if problem:
            raise ValueError(problem)
        return self


TRACKER_CREDENTIALS = ("WANDB_API_KEY", "MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_PASSWORD")
"""The trackers' credentials (`training.report_to`): only ever `worker.secrets`."""
MLFLOW_SERVER_URI = re.compile(r"^(https?://[^\s]+|databricks(://[^\s]*)?)$")
"""What the worker's MLflow (the client alone, mlflow-skinny) can record to: a tracking server or Databricks."""


def tracking_problems(report_to: list[str], worker: WorkerSpec) -> list[str]:
    """Why the run's trackers could not record what `worker` gives them; empty when they can."""
    problems = [f"`worker.env.{name}` is a credential: name a Prefect Secret block for it in `worker.secrets` "
                "instead (a plain variable shows in the run's parameters and on the endpoint)"
                for name in worker.env if name.upper() in TRACKER_CREDENTIALS]
    uri = worker.env.get("MLFLOW_TRACKING_URI")
    if "mlflow" in report_to and uri is not None and not MLFLOW_SERVER_URI.match(uri):
        problems.append(f"`worker.env.MLFLOW_TRACKING_URI` ({uri!r}) is not an MLflow tracking server: the worker records "
                        "to `http(s)://` servers or Databricks only (a path or database on the worker is gone when it "
                        "stops); give the server's URL, or leave it out to store a file store with the run")
    return problems


class RunSpec(Section):
    """One LoRA fine-tuning run."""

    name: str = Field(
        default="run", min_length=1, max_length=40, pattern=r"^[a-z0-9][a-z0-9-]*$",
        description="A short label for the run (lowercase letters, digits, dashes): shown in reports and "
        "endpoint names.",
    )
    algorithm: Literal["sft", "grpo", "dpo"] = Field(
        default="sft",
        description="Training algorithm: `sft` (supervised fine-tuning on chats or prompt/completion pairs), `grpo` "
        "(reinforcement learning from rewards on the dataset's prompts; fill in the GRPO section) or `dpo` (preference "
        "tuning on rows of a `prompt` and a `chosen` and a `rejected` answer; the DPO section is optional).",
    )
    model: ModelSource = Field(description="The base model.")
    dataset: DatasetSpec = Field(description="The training data.")
    lora: LoraSettings = Field(default_factory=LoraSettings, description="The LoRA adapter's shape.")
    training: TrainingSettings = Field(default_factory=TrainingSettings, description="Optimisation settings.")
    grpo: GrpoSettings | None = Field(
        default=None, validate_default=True,
        description="GRPO settings (group size, lengths, temperature, KL coefficient, rewards): required when the "
        "algorithm is `grpo`, refused otherwise.",
    )
    dpo: DpoSettings | None = Field(
        default=None, validate_default=True,
        description="DPO settings (`beta`, `loss_type`) when the algorithm is `dpo` (empty: their defaults), refused "
        "otherwise. The reference is the base model (the adapter switched off), or the adapter of `lora.init_from`.",
    )
    evaluation: EvaluationSpec | None = Field(
        default=None, validate_default=True,
        description="Held-out evaluation: the eval loss (SFT; DPO with the held-out pairs' reward accuracy and margin) "
        "or mean eval reward (GRPO) at the start, every N steps and at the end, on a seeded share of the dataset or a "
        "file of its own; and after training, task evaluations and benchmarks asked of the base and the adapter. "
        "Empty: no evaluation.",
    )
    extra_packages: list[str] = Field(default_factory=list, max_length=MAX_EXTRA_PACKAGES,
                                      description=JobInput.model_fields["extra_packages"].description)
    worker: WorkerSpec = Field(
        default_factory=WorkerSpec,
        description="The run's own worker environment: plain variables (`env`) and secrets from Prefect Secret blocks "
        "(`secrets`) that the training process and its rewards read.",
    )
    fast_paths: FastPathSettings = Field(
        default_factory=FastPathSettings, validate_default=True,
        description="GPU kernels and memory savers switched off (false) or forced on (true) for this run; each left "
        "empty is automatic.",
    )
    compute: ComputeSpec = Field(default_factory=ComputeSpec, description="GPUs to rent.")
    attempts: AttemptsSpec = Field(default_factory=AttemptsSpec, description="Retries of failed attempts.")
    artifact_store: str = Field(
        max_length=1024, pattern=ARTIFACT_STORE_PATTERN,
        description="Where the adapter, metrics and checkpoints go: `hf://datasets/<org>/<repo>` (a private "
        "Hub dataset repo, made private if it exists) or `file:///abs/path` (local mode).",
    )
    hub_token_secret: str | None = Field(
        default=None, max_length=100, pattern=BLOCK_NAME_PATTERN,
        description="Name of a Prefect Secret block holding this run's Hugging Face token (on a shared server, "
        "your own): the workers and the model checks before renting use it. Checked before anything is rented. "
        "Unset: the HF_TOKEN of the process running the flow (else its `hf-token` Secret block).",
    )
    publish: PublishSpec | None = Field(
        default=None,
        description="Publish the adapter (`hub_model_id`) and/or the base with the adapter merged into it "
        "(`merged_model_id`) as Hub model repos once the run has completed. Empty: the adapter stays in the "
        "artifact store only.",
    )
    deadline_minutes: int = Field(
        default=120, ge=5, json_schema_extra={"maximum": max_deadline_minutes()},
        description="Wall-clock limit for the whole run, queueing included. The worker stops at the "
        f"deadline, so it also caps the bill. At most {max_deadline_minutes()} (RunPod's 7-day job limits, "
        "less loraflow's teardown margins).",
    )
    budget_usd: float | None = Field(
        default=None, gt=0, le=100_000,
        description="Refuse to start when the run's worst-case cost (GPU price × GPUs × deadline) is "
        "above this. Empty means no budget check.",
    )

    _plain_requirements = field_validator("extra_packages")(plain_requirements)

    @model_validator(mode="after")
    def _a_serve_has_a_budget(self) -> RunSpec:
        if self.publish is not None and self.publish.serve is not None and self.publish.serve.budget_usd is None \
                and self.budget_usd is None:
            raise ValueError("publish.serve needs a budget: set publish.serve.budget_usd (e.g. `serve = { hours = 1, "
                             "budget_usd = 5 }`) or the run's budget_usd, which it then takes")
        return self

    def local_paths(self) -> list[tuple[str, str]]:
        """(field, path as written) of every file or folder of this machine the run reads: its local dataset, mix and
        evaluation files, task files and their graders' files, a benchmarks' task folder, reward, tools and environment
        files, a chat template file and a local model."""
        paths = [(f"{name}.local_file", source.local_file) for name, source in self.dataset.sources()
                 if source.local_file is not None]
        if self.evaluation is not None and self.evaluation.local_file is not None:
            paths.append(("evaluation.local_file", self.evaluation.local_file))
        if self.evaluation is not None:
            paths += self.evaluation.task_paths()
        if self.grpo is not None:
            paths += [(f"grpo.rewards[{i}].name", split_file_reward(reward.name)[0])
                      for i, reward in enumerate(self.grpo.rewards) if reward_kind(reward.name) == "file"]
            if self.grpo.tools is not None:
                paths.append(("grpo.tools", self.grpo.tools))
            if self.grpo.environment is not None and ":" in self.grpo.environment:
                paths.append(("grpo.environment", self.grpo.environment.rsplit(":", 1)[0]))
        if self.training.chat_template is not None and self.training.chat_template.endswith((".jinja", ".j2")):
            paths.append(("training.chat_template", self.training.chat_template))
        if self.model.id.startswith(("/", ".", "~")) or Path(self.model.id).expanduser().is_dir():
            paths.append(("model.id", self.model.id))
        return paths

    @field_validator("deadline_minutes")
    @classmethod
    def _within_runpod_limits(cls, minutes: int) -> int:
        timeout_s, ttl_s = job_limits_s(minutes * 60)
        for what, value_s, limit_s in (("execution timeout", timeout_s, RUNPOD_MAX_EXECUTION_TIMEOUT_S),
                                       ("job TTL", ttl_s, RUNPOD_MAX_JOB_TTL_S)):
            if value_s > limit_s:
                raise ValueError(
                    f"deadline_minutes {minutes} needs a RunPod {what} of {value_s} s (the deadline plus loraflow's "
                    f"teardown margin), above RunPod's maximum of {limit_s} s; set deadline_minutes to at most "
                    f"{max_deadline_minutes()}"
                )
        return minutes

    @field_validator("evaluation")
    @classmethod
    def _early_stopping_has_its_evaluation(cls, evaluation: EvaluationSpec | None,
                                           info: ValidationInfo) -> EvaluationSpec | None:
        # Validated when unset too: `training.early_stopping` without an `[evaluation]` is the refusal.
        if all(name in info.data for name in ("algorithm", "training")):
            problems = early_stopping_problems(info.data["algorithm"], info.data["training"], evaluation)
            if problems:
                raise ValueError("; ".join(problems))
        return evaluation

    @field_validator("worker")
    @classmethod
    def _trackers_get_what_they_need(cls, worker: WorkerSpec, info: ValidationInfo) -> WorkerSpec:
        # A field validator (training validates first) so that the error carries the field `worker`.
        training = info.data.get("training")
        problems = tracking_problems(training.report_to if training else [], worker)
        if problems:
            raise ValueError("; ".join(problems))
        return worker

    @field_validator("fast_paths")
    @classmethod
    def _optimisation_fits_the_run(cls, fast_paths: FastPathSettings, info: ValidationInfo) -> FastPathSettings:
        # Fields validate in order (algorithm, lora, training and evaluation first); validated when unset too.
        problems = []
        if all(name in info.data for name in ("algorithm", "training", "evaluation")):
            problems += optimisation_problems(info.data["algorithm"], info.data["training"], info.data["evaluation"],
                                              fast_paths)
        if all(name in info.data for name in ("algorithm", "lora")):
            problems += colocated_vllm_problems(info.data["algorithm"], info.data["lora"], fast_paths)
        if problems:
            raise ValueError("; ".join(problems))
        return fast_paths

    @field_validator("grpo")
    @classmethod
    def _knobs_match_the_algorithm(cls, grpo: GrpoSettings | None, info: ValidationInfo) -> GrpoSettings | None:
        # Fields validate in order (algorithm, lora and training first), so this error carries the field `grpo`.
        if any(name not in info.data for name in ("algorithm", "lora", "training")):
            return grpo
        algorithm, training = info.data["algorithm"], info.data["training"]
        problems = grpo_setting_problems(algorithm, grpo, training, info.data["lora"])
        if algorithm == "grpo" and "max_seq_length" in training.model_fields_set:
            problems.append(
                "`training.max_seq_length` applies to sft only: for grpo set `grpo.max_prompt_length` and "
                "`grpo.max_completion_length`, and remove `training.max_seq_length`"
            )
        if problems:
            raise ValueError("; ".join(problems))
        return grpo


    @field_validator("dpo")
    @classmethod
    def _dpo_matches_the_algorithm(cls, dpo: DpoSettings | None, info: ValidationInfo) -> DpoSettings | None:
        if all(name in info.data for name in ("algorithm", "lora", "training")):
            problems = dpo_setting_problems(info.data["algorithm"], dpo, info.data["training"], info.data["lora"])
            if problems:
                raise ValueError("; ".join(problems))
        return dpo


class SpecError(ValueError):
    """A run file that cannot be used, with every problem named by its field."""


def describe_validation_error(error: ValidationError, source: str) -> str:
    lines = [f"{source}: {error.error_count()} problem(s) in the run spec:"]
    for e in error.errors():
        where = ".".join(str(p) for p in e["loc"]) or "(top level)"
        message = e["msg"]
        if e["type"] == "extra_forbidden":
            message = "unknown field (check its spelling and section)"
        lines.append(f"  - {where}: {message}")
    return "\n".join(lines)


def read_run_file(path: Path) -> dict:
    """A TOML run file's tables, not yet validated; `SpecError` when it is missing or not TOML."""
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError as e:
        raise SpecError(f"run file {path} does not exist") from e
    except tomllib.TOMLDecodeError as e:
        raise SpecError(f"{path} is not valid TOML: {e}") from e


def load_run_file(path: str | Path) -> RunSpec:
    """Parse and validate a TOML run file; `SpecError` names every bad field."""
    path = Path(path)
    data = read_run_file(path)
    try:
        return RunSpec.model_validate(data)
    except ValidationError as e:
        raise SpecError(describe_validation_error(e, str(path))) from e
