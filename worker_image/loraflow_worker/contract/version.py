"""The contract's version, and the base every contract model shares: a worker refuses a job of a version it does
not understand, and a field it does not know is an error, never silently ignored."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

CONTRACT_VERSION = 13
"""Bumped on every change to the contract's models (the handler refuses any other version). 3: `lora.quantization`
and `memory` (forced memory settings). 4: `PreloadInput.remove_others`; `JobInput.worker_env_names`,
`worker_secret_names` (a run's own worker env and secrets) and `fast_paths`; `evaluation` (held-out evaluation),
with `eval_loss` / `eval_reward` in the metrics and the progress. 5: `training.report_to` (W&B and MLflow tracking)
and `JobResult.trackers`. 6: `training.loss_on`, `chat_template` and `packing`; the schedule, optimizer and adapter
variants (`training.lr_scheduler`, `warmup_*`, `weight_decay`, `max_grad_norm`, `optimizer`; `lora.use_dora`,
`use_rslora`, `init`, `loraplus_lr_ratio`, `modules_to_save`) and `TrainMetrics.learning_rates`; data as people have
it (`dataset.config`, `revision`, `format`, `columns`, `mix`; the evaluation file's `format` and `columns`). 7:
`algorithm` "dpo" with its `dpo` section and preference rows; `TrainMetrics.preference`. 8: tools in GRPO
(`grpo.tools`, `environment`, `max_tool_calls` and their store paths) and the run's `trajectories.jsonl`. 9: merge jobs
(`MergeInput` with `"mode": "merge"`, `MergeResult`): a stored run's adapter merged into its bf16 base and published.
10: pinned inputs (`JobInput.inputs`: the store commit and sha256 of the run's files; `worker_env_sha256`: of its
plain worker variables), the adapter's hashes and commit in `JobResult` (`adapter_sha256`, `revision`) and in
`MergeInput` (`adapter_sha256`, `adapter_revision`): someone else who can write the store cannot change a run. 11:
`fast_paths.vllm_colocate` "require" (vLLM or a failed job; empty now goes on with transformers' generate when the
colocated engine fails, its fast path saying `failed: <error>`) and the manifest's `vllm_weight_syncs`. 12:
`training.early_stopping` (`TrainMetrics.early_stopping`: where it stopped and whose adapter was kept) and the
progress's `eval_step`, `eval_reward_accuracy` and `eval_reward_margin`; `JobResult.resumed_from_step`. 13:
`JobInput.checkpoint_key` (checkpoints of one's own: a resume reads only a checkpoint whose record the run signed);
task evaluations and benchmarks (`evaluation.tasks`, `evaluation.benchmarks`; an `[evaluation]` may hold only them)
and their scores (`TrainMetrics.task_scores`, with what answered them, `TaskScore.answered_by`;
`benchmark_scores`); evaluate jobs (`EvaluateInput` with `"mode": "evaluate"`, `EvaluateResult`)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")
