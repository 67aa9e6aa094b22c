"""The job contract between the control plane and the worker.

The control plane builds a `JobInput`, sends it as the RunPod job's `input`, and reads a
`JobResult` back from the job's `output`; or, to warm a datacenter's network volume, a `PreloadInput`
(`"mode": "preload"`) and a `PreloadResult`; or, to publish a run's adapter merged into its base, a `MergeInput`
(`"mode": "merge"`) and a `MergeResult`; or, to compare a base and its adapters on tasks and benchmarks, an
`EvaluateInput` (`"mode": "evaluate"`) and an `EvaluateResult`. Both sides validate with these models, so a typo is caught
before a GPU is billed, and a worker refuses a job whose `contract_version` it does not understand.

It owns the version (`version`), what a run trains on (`sources`) and the formats its rows may come in, converted to
TRL's by one implementation that both sides run (`dataset_formats`), the job's sections (`lora_settings`, `training_settings`,
one `<method>_settings` per method with settings of its own, `memory_settings`, `fast_path_settings`), the names
a run may put in its worker's environment (`env_names`), the pins on the files the control plane stored for a job
(`stored_inputs`), the job itself (`job`), what comes back (`results`), preload jobs (`preload`), merge jobs (`merge`:
a run's adapter merged into its base and published), how a reward is named (`reward_names`) and the chat templates the
image's TRL has training versions of (`chat_templates`), and task evaluations and benchmarks with their scores
(`task_evaluation`), evaluate jobs (`evaluate`), with the benchmark task names the image's lm-evaluation-harness knows (`benchmark_tasks`). The
models are re-exported here:
`from loraflow_worker.contract import JobInput`.

It must stay light (pydantic and the standard library only) and import nothing else of the worker: the
control plane imports it without the training stack.
"""

from loraflow_worker.contract.chat_templates import TRL_TRAINING_TEMPLATES, trl_training_template
from loraflow_worker.contract.dpo_settings import DpoSettings, dpo_setting_problems
from loraflow_worker.contract.env_names import (
    ENV_NAME_PATTERN,
    MAX_WORKER_ENV,
    RESERVED_ENV_NAMES,
    RESERVED_ENV_PREFIXES,
    secret_reference_problem,
    worker_env_name,
    worker_env_overlap,
)
from loraflow_worker.contract.evaluate import (
    MAX_EVALUATED_ADAPTERS,
    AdapterScores,
    EvaluatedAdapter,
    EvaluateInput,
    EvaluateResult,
)
from loraflow_worker.contract.fast_path_settings import FORCIBLE_FAST_PATHS, FastPathSettings
from loraflow_worker.contract.grpo_settings import (
    GrpoSettings,
    RewardSpec,
    colocated_vllm_problems,
    grpo_setting_problems,
)
from loraflow_worker.contract.job import MAX_EXTRA_PACKAGES, JobInput, plain_requirements
from loraflow_worker.contract.lora_settings import LoraSettings
from loraflow_worker.contract.merge import LogitsCheck, MergeInput, MergeResult
from loraflow_worker.contract.memory_settings import MemorySettings, memory_setting_problems
from loraflow_worker.contract.preload import MAX_PRELOAD_MODELS, PreloadInput, PreloadModelResult, PreloadResult
from loraflow_worker.contract.results import (
    TRAJECTORIES_FILE,
    PROGRESS_EVAL_FIELDS,
    EarlyStopped,
    JobResult,
    PartialResult,
    Progress,
    TrackerRun,
    TrainMetrics,
    run_prefix,
)
from loraflow_worker.contract.task_evaluation import (
    BUILTIN_GRADERS,
    BenchmarkScore,
    BenchmarkSettings,
    GraderSettings,
    TaskEvaluation,
    TaskScore,
    function_reference,
    task_score,
)
from loraflow_worker.contract.sources import DatasetSource, MixSource, ModelSource, RowFormat, SourceFields
from loraflow_worker.contract.stored_inputs import StoredInputs
from loraflow_worker.contract.training_settings import (
    EVAL_METRICS,
    EarlyStoppingSettings,
    EvaluationSettings,
    TrainingSettings,
    early_stopping_problems,
    optimisation_problems,
)
from loraflow_worker.contract.version import CONTRACT_VERSION

__all__ = [
    "MAX_EVALUATED_ADAPTERS",
    "AdapterScores",
    "EvaluatedAdapter",
    "EvaluateInput",
    "EvaluateResult",
    "BUILTIN_GRADERS",
    "BenchmarkScore",
    "BenchmarkSettings",
    "GraderSettings",
    "TaskEvaluation",
    "TaskScore",
    "function_reference",
    "task_score",
    "DpoSettings",
    "dpo_setting_problems",
    "CONTRACT_VERSION",
    "ENV_NAME_PATTERN",
    "FORCIBLE_FAST_PATHS",
    "MAX_EXTRA_PACKAGES",
    "MAX_PRELOAD_MODELS",
    "MAX_WORKER_ENV",
    "RESERVED_ENV_NAMES",
    "RESERVED_ENV_PREFIXES",
    "TRL_TRAINING_TEMPLATES",
    "DatasetSource",
    "MixSource",
    "RowFormat",
    "SourceFields",
    "EVAL_METRICS",
    "PROGRESS_EVAL_FIELDS",
    "EarlyStopped",
    "EarlyStoppingSettings",
    "EvaluationSettings",
    "FastPathSettings",
    "GrpoSettings",
    "JobInput",
    "JobResult",
    "LogitsCheck",
    "LoraSettings",
    "MemorySettings",
    "MergeInput",
    "MergeResult",
    "ModelSource",
    "PartialResult",
    "PreloadInput",
    "PreloadModelResult",
    "PreloadResult",
    "Progress",
    "RewardSpec",
    "StoredInputs",
    "TrackerRun",
    "TrainMetrics",
    "TrainingSettings",
    "colocated_vllm_problems",
    "early_stopping_problems",
    "grpo_setting_problems",
    "memory_setting_problems",
    "optimisation_problems",
    "plain_requirements",
    "run_prefix",
    "TRAJECTORIES_FILE",
    "trl_training_template",
    "secret_reference_problem",
    "worker_env_name",
    "worker_env_overlap",
]
