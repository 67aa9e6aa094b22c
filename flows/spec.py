"""The `train` flow's parameter: one run of LoRA fine-tuning, as the Prefect UI form shows it.

The same model loads from a TOML run file (`deployments/*.toml`):

    .venv/bin/python -c "from flows.spec import load_run_file; print(load_run_file('deployments/local.toml'))"

Unknown keys, wrong types and out-of-range values are refused before anything is spent, with the
field named. Secrets are never fields here: the spec is shown in the UI and stored with the run.
"""

from __future__ import annotations

import math
import re
import tomllib
from pathlib import Path
from typing import Annotated, Literal

from loraflow_worker.contract import (
    MAX_EXTRA_PACKAGES,
    MAX_WORKER_ENV,
    EvaluationSettings,
    MixSource,
    RowFormat,
    SourceFields,
    FastPathSettings,
    DpoSettings,
    GrpoSettings,
    JobInput,
    LoraSettings,
    ModelSource,
    TrainingSettings,
    dpo_setting_problems,
    grpo_setting_problems,
    optimisation_problems,
    plain_requirements,
    worker_env_name,
    worker_env_overlap,
)
from loraflow_worker.contract.dataset_formats import DatasetFormat, columns_problem
from loraflow_worker.contract.sources import MAX_MIX_SOURCES
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from tasks.placement.plan import job_limits_s, max_deadline_minutes
from tasks.runpod.catalog import resolve_gpu
from tasks.runpod.models import RUNPOD_MAX_EXECUTION_TIMEOUT_S, RUNPOD_MAX_JOB_TTL_S
from tasks.storage.hub_datasets import FIRST_ROWS

BLOCK_NAME_PATTERN = r"^[a-z0-9-]+$"
"""Prefect's rule for a block's name: lowercase letters, digits and dashes (`prefect/types/names.py`)."""
ARTIFACT_STORE_PATTERN = r"^(file:///.+|hf://datasets/[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*)$"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


_LOCAL_FILE_DESCRIPTION = (
    "Path of a JSONL file on the machine that runs the flow, one example per line in `format`. With `auto`, one of "
    "TRL's conversational formats: `{\"messages\": [...]}` (SFT, GRPO), `{\"prompt\": [...], \"completion\": [...]}` "
    "(SFT, GRPO) or prompt-only `{\"prompt\": [...], ...}` (GRPO; other columns such as `answer` reach the rewards). "
    "Every line is converted and checked before anything is rented, and the file is published to the run's artifact "
    "store for the worker. Relative paths are resolved from the working directory."
)


class _SourceSpec(_Section):
    """One source of training rows: a Hub dataset or a local JSONL file, in a format, with the dataset's own column
    names."""

    hub_id: str | None = Field(
        default=None, max_length=512, pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]*$",
        description="Hugging Face Hub dataset id, e.g. `trl-lib/Capybara`. Leave empty to use `local_file`. Checked "
        "before anything is rented: the dataset, its `revision`, `config` and `split` exist (configs and splits as "
        "its README's `configs:` declares them, or as `datasets` finds them by file name), and the first "
        f"{FIRST_ROWS} rows convert and have the format the algorithm trains on when the split's first file is JSON "
        "Lines (other files, "
        "e.g. Parquet, are read by the worker only); the run trains on the commit the revision names then.",
    )
    config: str | None = Field(
        default=None, max_length=256, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
        description="The Hub dataset's config (subset), e.g. `main` for `openai/gsm8k`: "
        "`load_dataset(hub_id, config, split=split, revision=revision)`. Empty: the dataset's only or default config "
        "(a dataset with several and no default is refused, naming them). Hub datasets only.",
    )
    revision: str | None = Field(
        default=None, max_length=256,
        description="The Hub dataset's revision: a branch, tag or commit sha. Empty: its default branch. Either way "
        "the run is pinned to the commit it names when the run starts, and the manifest records it. Hub datasets only.",
    )
    split: str = Field(default="train", max_length=128, pattern=r"^[A-Za-z0-9_.\[\]:%-]+$",
                       description="Split of the Hub dataset to train on (`datasets` slicing such as `train[:1000]` "
                       "works).")
    local_file: str | None = Field(default=None, max_length=4096, description=_LOCAL_FILE_DESCRIPTION)
    # The job's own fields: the same choices, defaults and descriptions.
    format: DatasetFormat = RowFormat.model_fields["format"]
    columns: dict[str, str] = RowFormat.model_fields["columns"]

    @model_validator(mode="after")
    def _columns_of_the_format(self) -> _SourceSpec:
        problem = columns_problem(self.format, self.columns)
        if problem:
            raise ValueError(problem)
        return self

    def row_format(self) -> RowFormat:
        """How this source's rows are laid out, as the job says it."""
        return RowFormat(format=self.format, columns=self.columns)

    def hub_source(self) -> SourceFields:
        """This Hub source as the job names it (a local file is named by its copy in the store instead)."""
        return SourceFields(hub_id=self.hub_id, config=self.config, revision=self.revision, split=self.split,
                            format=self.format, columns=self.columns)

    def _one_source_problem(self) -> str | None:
        if (self.hub_id is None) == (self.local_file is None):
            return "set exactly one of `hub_id` (a Hub dataset) or `local_file` (a JSONL file)"
        hub_only = [f"`{name}`" for name in ("config", "revision") if getattr(self, name) is not None]
        if self.local_file is not None and hub_only:
            return (f"{' and '.join(hub_only)} {'apply' if len(hub_only) > 1 else 'applies'} to a Hub dataset "
                    "(`hub_id`) only: remove it for `local_file`")
        return None


class MixEntrySpec(_SourceSpec):
    """One source of a mixture (`[[dataset.mix]]`): a Hub dataset or a local file, with its share of the
    examples."""

    fraction: float = MixSource.model_fields["fraction"]

    @model_validator(mode="after")
    def _one_source(self) -> MixEntrySpec:
        problem = self._one_source_problem()
        if problem:
            raise ValueError(problem)
        return self


class DatasetSpec(_SourceSpec):
    """Training data: a Hub dataset or a local JSONL file (published to the run's artifact store so the worker can
    read it), or a mixture of such sources (`[[dataset.mix]]`). Rows come in TRL's conversational formats, or as
    Alpaca or ShareGPT rows (`format`), with your own column names (`columns`); the worker converts them to TRL's
    formats before training. Every source is checked before anything is rented, and a refusal names the source,
    the row and the field."""

    mix: list[MixEntrySpec] = Field(
        default_factory=list, max_length=MAX_MIX_SOURCES,
        description="A mixture of sources (`[[dataset.mix]]` entries, each with the fields above and a `fraction`), "
        "in place of a single source: set either `mix` or the fields above, not both. The fractions are sampling "
        "probabilities that sum to 1: each training example is drawn at random (seeded with `training.seed`, so the "
        "same seed gives the same mixture) from entry i with probability `fraction` i, until one entry has no "
        "examples left (`datasets.interleave_datasets` with `first_exhausted`, LLaMA-Factory's `interleave_under`): "
        "no example repeats, and the mixture is as large as the first source to run out allows. Sources in `messages` "
        "and prompt-completion shapes mix as `messages` (Alpaca rows with ShareGPT ones, say), prompt-only ones only "
        "with each other (refused before renting where the rows were read); only the columns every source has are "
        "kept. The manifest records how many examples each entry gave.",
    )

    @field_validator("mix")
    @classmethod
    def _fractions_sum_to_one(cls, mix: list[MixEntrySpec]) -> list[MixEntrySpec]:
        if len(mix) == 1:
            raise ValueError("a mix needs at least 2 sources; give a single source as `dataset.hub_id` or "
                             "`dataset.local_file` instead")
        total = sum(entry.fraction for entry in mix)
        if mix and not math.isclose(total, 1.0, abs_tol=1e-6):
            raise ValueError(f"the fractions of `dataset.mix` are sampling probabilities and must sum to 1; these sum "
                             f"to {total:g} ({', '.join(f'{e.fraction:g}' for e in mix)}): scale them")
        return mix

    @model_validator(mode="after")
    def _one_source(self) -> DatasetSpec:
        if self.mix:
            # By value, not by what was set: Prefect hands the flow its spec as JSON with every field written out.
            beside = [name for name, field in _SourceSpec.model_fields.items()
                      if getattr(self, name) != field.get_default(call_default_factory=True)]
            if beside:
                raise ValueError(f"{', '.join(f'`dataset.{f}`' for f in beside)} beside `dataset.mix`: each mix entry "
                                 "is a source of its own; move them into the `[[dataset.mix]]` entries")
            return self
        problem = self._one_source_problem()
        if problem:
            raise ValueError(problem)
        return self

    def sources(self) -> list[tuple[str, _SourceSpec]]:
        """(the spec field that names it, the source) of each source rows come from: the mix's entries, or this."""
        if self.mix:
            return [(f"dataset.mix[{i}]", entry) for i, entry in enumerate(self.mix)]
        return [("dataset", self)]


class EvaluationSpec(_Section):
    """Held-out evaluation while training, as hosted fine-tuning reports validation loss: before the first step,
    every `every_steps` steps and after the last. SFT: the loss on the held-out examples (`eval_loss`). GRPO: the
    mean total reward (rewards summed with their weights) of ONE completion per held-out prompt, sampled as training
    samples (`grpo.temperature`, up to `grpo.max_completion_length` tokens; not greedy), so a noisy estimate that a
    larger `max_samples` steadies (`eval_reward`). Stored in the run's `metrics.json`, shown in the progress line,
    the summary and its curve. Evaluation time is inside the run's deadline, so inside its cost ceiling."""

    fraction: float | None = Field(
        default=None, gt=0.0, lt=0.5,
        description="Hold this share of the dataset out for evaluation (e.g. 0.1), picked at random with "
        "`training.seed`, so every attempt holds out the same rows; the rest is trained on. Set `fraction` or "
        "`local_file`, not both.",
    )
    local_file: str | None = Field(
        default=None, max_length=4096,
        description="A JSONL file of evaluation examples on the machine that runs the flow, in the formats "
        "`dataset.local_file` takes, read as `format` and `columns` say (checked the same way before anything is "
        "rented, and published to the run's artifact store with the dataset); the whole dataset is trained on. "
        "Relative paths are resolved from the working directory.",
    )
    format: DatasetFormat = Field(
        default="auto", description="The format of `local_file`'s rows, as `dataset.format` (`auto`, `alpaca`, "
        "`sharegpt`).")
    columns: dict[str, str] = Field(
        default_factory=dict, max_length=8,
        description="`local_file`'s own column names, as `dataset.columns` (the format's names → the file's).")
    # The job's own fields: the same defaults, bounds and descriptions.
    every_steps: int = EvaluationSettings.model_fields["every_steps"]
    max_samples: int = EvaluationSettings.model_fields["max_samples"]

    @model_validator(mode="after")
    def _one_source(self) -> EvaluationSpec:
        if (self.fraction is None) == (self.local_file is None):
            raise ValueError("set exactly one of `fraction` (a held-out share of the dataset, e.g. 0.1) or "
                             "`local_file` (a JSONL file of evaluation examples)")
        if self.local_file is None and (self.format != "auto" or self.columns):
            raise ValueError("`evaluation.format` and `evaluation.columns` describe `evaluation.local_file`: the "
                             "held-out `fraction` is in the dataset's format already; remove them")
        problem = columns_problem(self.format, self.columns)
        if problem:
            raise ValueError(problem)
        return self


def _as_list(value: object) -> object:
    return [value] if isinstance(value, str) else value


class ComputeSpec(_Section):
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


class AttemptsSpec(_Section):
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


class PublishSpec(_Section):
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
        if self.hub_model_id is None and self.merged_model_id is None:
            raise ValueError("[publish] names no repo: set publish.hub_model_id (the adapter) or "
                             "publish.merged_model_id (the merged model), or both, or remove [publish]")
        if self.hub_model_id is not None and self.hub_model_id == self.merged_model_id:
            raise ValueError(f"publish.hub_model_id and publish.merged_model_id are both {self.hub_model_id!r}: the "
                             "adapter and the merged model need repos of their own; rename one")
        return self

    @property
    def repos(self) -> dict[str, str]:
        """The repos the run publishes to, by their field (`publish.hub_model_id`, `publish.merged_model_id`)."""
        return {f"publish.{name}": repo for name, repo in (("hub_model_id", self.hub_model_id),
                                                           ("merged_model_id", self.merged_model_id)) if repo}


class WorkerSpec(_Section):
    """The run's own variables in its worker's environment, e.g. the URL and the key of an LLM judge that a reward
    calls: the training process, and so every reward, reads each as `os.environ["NAME"]`. Names that loraflow or
    RunPod set, or that would change how the worker itself runs (`HF_TOKEN`, `HF_ENDPOINT`, `HF_HUB_*`, `RUNPOD_*`,
    `LORAFLOW_*`, `CUDA_VISIBLE_DEVICES`, `NVIDIA_*`, `PYTORCH_CUDA_ALLOC_CONF`, `PYTHON*`, `PATH`, `LD_*`, `PIP_*`,
    ...), are refused before anything is rented."""

    env: dict[str, Annotated[str, Field(max_length=4096)]] = Field(
        default_factory=dict, max_length=MAX_WORKER_ENV,
        description="Plain variables, `NAME = \"value\"`. Visible to anyone who can read the run's parameters or the "
        "account's endpoints: never a credential (put those in `secrets`).",
    )
    secrets: dict[str, Annotated[str, Field(max_length=100, pattern=BLOCK_NAME_PATTERN)]] = Field(
        default_factory=dict, max_length=MAX_WORKER_ENV,
        description="Secret variables, `NAME = \"<Prefect Secret block name>\"` (the block's name, not the value). "
        "The flow reads each block where it runs and hands the value to the workers through a RunPod account secret: "
        "it is never in the run's parameters, logs or artifacts, the endpoint's env or the stored files, and the worker "
        "redacts it from its console and errors. A block that cannot be read, or holds fewer than 4 characters, is "
        "refused before anything is rented.",
    )

    @field_validator("env", "secrets")
    @classmethod
    def _names_a_run_may_set(cls, variables: dict[str, str]) -> dict[str, str]:
        for name in variables:
            worker_env_name(name)
        return variables

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


class RunSpec(_Section):
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
        default=None,
        description="Held-out evaluation: the eval loss (SFT; DPO with the held-out pairs' reward accuracy and margin) "
        "or mean eval reward (GRPO) at the start, every N steps and at the end, on a seeded share of the dataset or a "
        "file of its own. Empty: no evaluation.",
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
        # Fields validate in order (algorithm, training and evaluation first); validated when unset too.
        if all(name in info.data for name in ("algorithm", "training", "evaluation")):
            problems = optimisation_problems(info.data["algorithm"], info.data["training"], info.data["evaluation"],
                                             fast_paths)
            if problems:
                raise ValueError("; ".join(problems))
        return fast_paths

    @field_validator("grpo")
    @classmethod
    def _knobs_match_the_algorithm(cls, grpo: GrpoSettings | None, info: ValidationInfo) -> GrpoSettings | None:
        # Fields validate in order (algorithm and training first), so this error carries the field `grpo`.
        if "algorithm" not in info.data or "training" not in info.data:
            return grpo
        algorithm, training = info.data["algorithm"], info.data["training"]
        problems = grpo_setting_problems(algorithm, grpo, training)
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
        if "algorithm" in info.data and "training" in info.data:
            problems = dpo_setting_problems(info.data["algorithm"], dpo, info.data["training"])
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


class RunOverrides(_Section):
    """Flat changes to a run's spec, one per parameter of the `train` flow beside `spec`, so that
    `prefect deployment run train/qwen --param max_steps=5` changes one field (a `--param spec=...`
    replaces the whole spec). None leaves the field as the spec has it. The descriptions are the
    flow's parameter descriptions (its docstring, which Prefect shows in the run form)."""

    run_file: str | None = Field(
        default=None, max_length=4096,
        description="A TOML run file (e.g. `deployments/qwen.toml`) whose spec replaces `spec` before the other "
        "overrides apply. Relative paths are resolved from the flow's working directory.",
    )
    name: str | None = Field(default=None, description="Replaces the spec's `name` (the run's label).")
    model: str | None = Field(
        default=None, description="Replaces the base model: a Hub model id (`Qwen/Qwen3-0.6B`, default branch) or a "
        "local model directory (local mode).",
    )
    dataset: str | None = Field(
        default=None, description="Replaces the training data: a local JSONL file (a path ending in `.jsonl` or "
        "`.json`, or starting with `/`, `./`, `../` or `~`) or else a Hub dataset id (its `train` split).",
    )
    gpu: list[str] | None = Field(
        default=None, description="Replaces `compute.gpu`: GPU classes in the order to try them, e.g. "
        "`[\"h100\", \"a100 sxm\"]`.",
    )
    max_steps: int | None = Field(default=None, description="Replaces `training.max_steps` (optimizer steps).")
    learning_rate: float | None = Field(default=None, description="Replaces `training.learning_rate`.")
    hub_token_secret: str | None = Field(
        default=None, description="Replaces `hub_token_secret`: the Prefect Secret block holding your Hugging Face "
        "token, for this run.",
    )


# Where each override goes in the spec.
OVERRIDE_PATHS: dict[str, tuple[str, ...]] = {
    "name": ("name",), "model": ("model",), "dataset": ("dataset",), "gpu": ("compute", "gpu"),
    "max_steps": ("training", "max_steps"), "learning_rate": ("training", "learning_rate"),
    "hub_token_secret": ("hub_token_secret",),
}
_LOCAL_FILE = re.compile(r"^(/|\./|\.\./|~)|\.jsonl?$")


def apply_overrides(spec: RunSpec, overrides: RunOverrides) -> RunSpec:
    """`spec` (or the spec of `overrides.run_file`) with each set override in its field, validated as
    a run file is. `SpecError` names the parameter behind each problem (`parameter max_steps ...`).

    The fields the spec set stay set, so rules that depend on what was set (e.g. `training.max_seq_length`
    refused for grpo) judge the merged spec as they would a run file.
    """
    if overrides.run_file is not None:
        try:
            spec = load_run_file(overrides.run_file)
        except SpecError as e:
            raise SpecError(f"parameter run_file: {e}") from e
    data = spec.model_dump(mode="json", exclude_unset=True)
    for parameter, path in OVERRIDE_PATHS.items():
        value = getattr(overrides, parameter)
        if value is None:
            continue
        section = data
        for key in path[:-1]:
            section = section.setdefault(key, {})
        section[path[-1]] = _source(parameter, value)
    try:
        return RunSpec.model_validate(data)
    except ValidationError as e:
        raise SpecError(_describe_override_error(e, overrides)) from e


def _source(parameter: str, value: object) -> object:
    if parameter == "model":
        return {"id": value}
    if parameter == "dataset":
        return {"local_file": str(Path(str(value)).expanduser())} if _LOCAL_FILE.search(str(value)) \
            else {"hub_id": value}
    return value


def _describe_override_error(error: ValidationError, overrides: RunOverrides) -> str:
    source = f"the spec{f' of {overrides.run_file}' if overrides.run_file else ''} with its overrides"
    lines = [f"{error.error_count()} problem(s) in {source}:"]
    for e in error.errors():
        where = ".".join(str(p) for p in e["loc"]) or "(top level)"
        given = [name for name, path in OVERRIDE_PATHS.items()
                 if getattr(overrides, name) is not None and tuple(e["loc"][:len(path)]) == path]
        message = "unknown field (check its spelling and section)" if e["type"] == "extra_forbidden" else e["msg"]
        if given:
            lines.append(f"  - parameter {given[0]}={getattr(overrides, given[0])!r} ({where}): {message}")
        else:
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


class ReconcilePolicy(_Section):
    """What the `reconcile` flow deletes. Endpoints without loraflow's name prefix are never touched, nor those
    tagged with another control plane's namespace (`LORAFLOW_NAMESPACE` or the Prefect Variable
    `loraflow-namespace`)."""

    dry_run: bool = Field(default=False, description="Report what would be deleted, delete nothing.")
    silent_after_minutes: float = Field(
        default=10, ge=0.1, le=7 * 24 * 60,
        description="Delete the endpoints of a run that has sent no heartbeat event for this long, or for 3 × its "
        "own heartbeat interval if longer: its process is gone. A live run sends Prefect's flow-run heartbeat every "
        "PREFECT_FLOWS_HEARTBEAT_FREQUENCY (default 180 s) and, while it watches its job, loraflow's endpoint "
        "heartbeat every LORAFLOW_HEARTBEAT_SECONDS (default 60 s); logging settings change neither. A value below "
        "3 × the longer of the two where the reconcile runs (9 min with the defaults) is refused.",
    )
    idle_grace_minutes: int = Field(
        default=45, ge=5, le=7 * 24 * 60,
        description="Delete an endpoint older than this that has no queued or running job.",
    )
    min_age_minutes: float = Field(
        default=2, ge=0, le=24 * 60,
        description="Never delete an endpoint younger than this: its run may not have sent a heartbeat for it yet.",
    )
    secret_retain_days: float = Field(
        default=14, ge=7, le=3650,
        description="Delete this control plane's account secrets (one per distinct Hub token or run secret) that "
        "no endpoint refers to and no run used for this long; at least 7 days, a run's longest life. Another "
        "control plane's secrets are never touched.",
    )
