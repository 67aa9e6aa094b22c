"""LoRA GRPO: job input in, trained adapter folder + metrics + manifest out (the GRPO twin of `sft.py`).

Straight-line, like `trl/scripts/grpo.py`: load data (holding evaluation prompts out, when asked) → prompts →
rewards by name → `GRPOTrainer` with a PEFT `LoraConfig` → train, evaluating the mean reward on the held-out
prompts → save the adapter. On a GPU with vLLM installed the completions come from a
vLLM engine colocated with training, seeded from `training.seed` and synced once per generation round with the
adapter merged into temporaries (the base never written); elsewhere, or from where that engine fails to build, load
the weights or generate, from transformers' `generate` (`vllm_colocate.py`). The manifest records which
fast paths were in effect. A job selects this with `algorithm: grpo` and a `grpo` section, e.g.

    {"algorithm": "grpo", "training": {"max_steps": 200, "learning_rate": 1e-5, "batch_size": 16},
     "grpo": {"num_generations": 8, "max_completion_length": 512,
              "rewards": [{"name": "numeric_match", "column": "answer"},
                          {"name": "format", "pattern": "^<think>.*</think>", "weight": 0.2}]}}

With `grpo.tools` or `grpo.environment` (`tools.py`) the model may call tools while it writes: TRL runs them and
the completion (what the rewards see) is the whole exchange, calls, the tools' answers and the final answer. A few
trajectories of each logging step are kept with the run (`trajectories.py`).

Prompts come from the dataset's `prompt` column (text, or chat messages), or else from its chat `messages`
without the last assistant turn, whose text becomes the column `answer` for the match rewards. TRL hands a
reward every column but `prompt` and `completion` (e.g. a prompt-only dataset's `answer`), so the completion
of a prompt/completion dataset becomes the column `answer` too.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from datasets import Dataset
from transformers import AutoTokenizer, PreTrainedTokenizerBase, TrainerCallback
from trl import GRPOConfig

from loraflow_worker.artifacts import ArtifactStore
from loraflow_worker.contract import GrpoSettings, JobInput, Progress
from loraflow_worker.dataset.loading import evaluation_split, load_job_dataset
from loraflow_worker.artifacts.manifest import FastPath
from loraflow_worker.training.fast_paths import FastPathPlan, engage_fast_paths, gather_facts, plan_fast_paths
from loraflow_worker.training.monitor import TrainingMonitor, check_deadline
from loraflow_worker.training.rewards import check_reward_columns, resolve_rewards
from loraflow_worker.training.tools import RunTools, check_tool_template, resolve_tools
from loraflow_worker.training.trajectories import TRAJECTORIES_FILE, TrajectorySampler
from loraflow_worker.training.vllm_colocate import RoundSyncGRPOTrainer, build_grpo_trainer, vllm_engine_kwargs
from loraflow_worker.runtime.model_cache import resolve_base_model
from loraflow_worker.training.run import (
    TrainOutcome,
    job_workload,
    model_and_adapter,
    package_outcome,
    shared_trainer_args,
    train_and_save,
    use_device,
)

ANSWER_COLUMN = "answer"
"""Column that holds the last assistant turn of a chat `messages` dataset (the match rewards' reference)."""

log = logging.getLogger("loraflow_worker")


class RewardLog(TrainerCallback):
    """Collects (step, mean total reward) pairs from the trainer's logs."""

    def __init__(self) -> None:
        self.rewards: list[tuple[int, float]] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "reward" in logs:
            self.rewards.append((state.global_step, float(logs["reward"])))


def train_grpo(job: JobInput, store: ArtifactStore, work_dir: Path, report: Callable[[Progress], None], *,
               callbacks: Sequence[TrainerCallback] = (), resume_from: Path | None = None) -> TrainOutcome:
    """Train a LoRA adapter for `job` (algorithm `grpo`) inside `work_dir` and save it there. `callbacks`
    join the Trainer's; `resume_from` is a Trainer checkpoint folder to continue from. Raises
    `DeadlineReached` when the job's deadline passes before training starts (one that passes during training
    stops it, as in `train_sft`), `RewardError` for a reward that cannot be used."""
    settings: GrpoSettings = job.grpo  # JobInput guarantees it for algorithm `grpo`
    cuda = use_device()
    report(Progress(stage="loading", message=f"loading dataset and model {job.model.id}"))
    loaded = load_job_dataset(job.dataset, store, work_dir, job.training.seed)
    rows, held_out = evaluation_split(loaded.rows, job, store, work_dir)
    model_path, revision = resolve_base_model(job.model)
    check_deadline(job.deadline_epoch_s)

    # TRL pads prompts on the left so that generation continues right after them.
    tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left", truncation_side="left")
    run_tools = RunTools()
    if settings.uses_tools:  # before the prompts are measured: the tools' schemas are part of each prompt
        run_tools = resolve_tools(settings, store, work_dir / "run-files")
        check_tool_template(tokenizer, job.model.id)
    dataset = prompt_dataset(rows, tokenizer, settings.max_prompt_length, run_tools)
    check_reward_columns(settings.rewards, dataset.column_names)
    eval_dataset = None
    if held_out is not None:
        eval_dataset = prompt_dataset(held_out, tokenizer, settings.max_prompt_length, run_tools)
        check_reward_columns(settings.rewards, eval_dataset.column_names)
    reward_funcs, _ = resolve_rewards(settings.rewards, store, work_dir / "run-files")
    plan = plan_fast_paths(gather_facts(model_path, "grpo", job_workload(job), job.memory, job.fast_paths))
    monitor = TrainingMonitor(report, job.deadline_epoch_s,
                              eval_key="eval_reward" if eval_dataset is not None else None)
    reward_log = RewardLog()
    sampler = TrajectorySampler(work_dir / TRAJECTORIES_FILE, job.worker_secret_names)

    def build(plan: FastPathPlan) -> RoundSyncGRPOTrainer:
        # The model is loaded afresh for each build: PEFT wrapped the one of a trainer given up after its vLLM engine
        # failed (`vllm_colocate.build_grpo_trainer`).
        model, peft_config = model_and_adapter(model_path, job, plan, store, work_dir)
        args = grpo_config(job, plan, work_dir)
        # GRPOTrainer builds the vLLM engine.
        with vllm_engine_settings(job.training.seed) if args.use_vllm else contextlib.nullcontext():
            return RoundSyncGRPOTrainer(
                model=model,
                reward_funcs=reward_funcs,
                args=args,
                train_dataset=dataset,
                eval_dataset=eval_dataset,
                processing_class=tokenizer,
                peft_config=peft_config,
                callbacks=[monitor, reward_log, sampler, *callbacks],
                tools=run_tools.tools or None,
                environment_factory=run_tools.environment,
            )

    trainer, plan = build_grpo_trainer(build, plan, "vllm_colocate" in job.fast_paths.required(), report)
    sampler.trainer = trainer
    fast_paths = engage_fast_paths(plan, trainer.model)
    adapter_dir, wall_seconds = train_and_save(trainer, tokenizer, job, revision, work_dir, resume_from)
    if trainer.vllm_failure is not None:  # the engine failed during training: transformers generated from then on
        fast_paths["vllm_colocate"] = FastPath(engaged=False, reason=trainer.vllm_failure)
    outcome = package_outcome(trainer=trainer, monitor=monitor, job=job, revision=revision, adapter_dir=adapter_dir,
                              wall_seconds=wall_seconds, cuda=cuda, fast_paths=fast_paths, plan=plan, rows=rows,
                              sources=loaded.sources, rewards=reward_log.rewards,
                              trajectories=sampler.path if sampler.path.is_file() else None)
    if plan.trainer_kwargs.get("use_vllm"):
        outcome.manifest.vllm_weight_syncs = trainer.weight_syncs.record()
    return outcome


def grpo_config(job: JobInput, plan: FastPathPlan, work_dir: Path) -> GRPOConfig:
    """The `GRPOConfig` of `job` under the fast-path `plan` (which carries the model-loading kwargs and vLLM's
    share of the GPU), writing into `work_dir`: what `train_grpo` trains with, in a function of its own so that a
    GPU's configuration can be built and checked without one."""
    settings: GrpoSettings = job.grpo
    extra: dict[str, Any] = {}
    if plan.trainer_kwargs.get("use_vllm"):
        extra["vllm_max_model_length"] = settings.max_prompt_length + settings.max_completion_length
    return GRPOConfig(
        **shared_trainer_args(job, work_dir),
        num_generations=settings.num_generations,
        max_completion_length=settings.max_completion_length,
        temperature=settings.temperature,
        beta=settings.beta,
        reward_weights=[spec.weight for spec in settings.rewards],
        # Evaluation: one completion per held-out prompt, sampled as in training (`EvaluationSettings`).
        num_generations_eval=1,
        max_tool_calling_iterations=settings.max_tool_calls,
        **extra,
        **plan.trainer_kwargs,
    )


@contextlib.contextmanager
def vllm_engine_settings(seed: int) -> Iterator[None]:
    """Within it, the vLLM engine TRL builds takes `vllm_colocate.vllm_engine_kwargs(seed)` over TRL's own arguments:
    no image or video inputs (`fast_paths.VLLM_TEXT_ONLY`), so vLLM neither loads nor profiles a checkpoint's vision
    tower (Qwen3.5) for a text run; and the run's `training.seed`, where TRL passes its process index (0).

    TRL 1.16 builds the colocated `vllm.LLM` with a fixed list of arguments and has no passthrough for vLLM's own
    (`VLLMGeneration.__init__`, `trl/generation/vllm_generation.py`; GRPOConfig has `vllm_model_impl`,
    `vllm_enable_sleep_mode`, ... but no `vllm_kwargs`), so the `LLM` that module calls is wrapped meanwhile.
    TODO: pass these through GRPOConfig once TRL forwards vLLM engine arguments."""
    from trl.generation import vllm_generation

    build = getattr(vllm_generation, "LLM", None)
    if build is None:  # vLLM did not import: TRL refuses `use_vllm` itself (`VLLMGeneration._init_vllm`)
        yield
        return
    settings = vllm_engine_kwargs(seed)

    def engine(*args: Any, **kwargs: Any) -> Any:
        return build(*args, **{**kwargs, **settings})  # over TRL's: its `seed` is the process index

    vllm_generation.LLM = engine
    try:
        yield
    finally:
        vllm_generation.LLM = build


def prompt_dataset(rows: Dataset, tokenizer: PreTrainedTokenizerBase, max_prompt_length: int,
                   run_tools: RunTools | None = None) -> Dataset:
    """The GRPO prompts of `rows`: its `prompt` column, or its chat `messages` without the last assistant
    turn (that turn's text becomes the column `answer` unless the dataset has one; so does the `completion` of a
    prompt/completion dataset). Prompts longer than `max_prompt_length` tokens (chat template applied, with the
    tools' schemas when the run has tools) are left out, with a warning; a run with tools needs chat prompts."""
    if "completion" in rows.column_names and "prompt" in rows.column_names:
        # TRL's GRPOTrainer leaves a `completion` column out of the rewards' keyword arguments.
        if ANSWER_COLUMN not in rows.column_names:
            rows = rows.map(lambda row: {ANSWER_COLUMN: _text(row["completion"])})
        rows = rows.remove_columns("completion")
    if "prompt" not in rows.column_names:
        if "messages" not in rows.column_names:
            raise ValueError(
                f"a GRPO dataset needs a `prompt` column (text or chat messages) or chat `messages`; this one has "
                f"{', '.join(f'`{c}`' for c in rows.column_names)}"
            )
        has_answer = ANSWER_COLUMN in rows.column_names
        rows = rows.map(lambda row: _split_chat(row["messages"], has_answer), remove_columns=["messages"])

    tools = run_tools.callables() if run_tools is not None else []
    if tools and isinstance(rows[0]["prompt"], str):
        raise ValueError("a GRPO run with `grpo.tools` or `grpo.environment` needs chat prompts (a `prompt` column of "
                         "messages, or chat `messages`): the tools reach the model through its chat template, which "
                         "text prompts do not go through")

    def fits(row: dict[str, Any]) -> bool:
        prompt = row["prompt"]
        if isinstance(prompt, str):
            return len(tokenizer(prompt)["input_ids"]) <= max_prompt_length
        ids = tokenizer.apply_chat_template(prompt, tools=tools or None, add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"]
        return len(ids) <= max_prompt_length

    kept = rows.filter(fits)
    dropped = len(rows) - len(kept)
    if not len(kept):
        raise ValueError(
            f"all {len(rows)} prompts are longer than `grpo.max_prompt_length` ({max_prompt_length} tokens): raise it"
        )
    if dropped:
        log.warning("left out %d of %d prompts longer than grpo.max_prompt_length (%d tokens)", dropped, len(rows), max_prompt_length)
    return kept


def _text(completion: str | list[dict[str, str]]) -> str:
    return completion if isinstance(completion, str) else completion[-1]["content"]


def _split_chat(messages: list[dict[str, str]], has_answer: bool) -> dict[str, Any]:
    if messages and messages[-1]["role"] == "assistant":
        prompt, answer = messages[:-1], messages[-1]["content"]
    else:
        prompt, answer = messages, ""
    return {"prompt": prompt} if has_answer else {"prompt": prompt, ANSWER_COLUMN: answer}
