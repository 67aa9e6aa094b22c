"""A sample of what GRPO generated, kept with the run: at each logging step a few trajectories of the latest batch
(the prompt, the completion with its tool calls and the tools' answers, the final answer, the rewards), secrets
redacted, one JSON line each in `trajectories.jsonl`, which the run stores beside its metrics.

TRL keeps the latest generation batch in `GRPOTrainer._logs` (TRL 1.16: `prompt`, `completion` and per-reward
`rewards`, filled whether or not `log_completions` prints them); this reads it when the trainer logs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers import TrainerCallback

from loraflow_worker.contract import TRAJECTORIES_FILE
from loraflow_worker.runtime.redaction import redact_record

if TYPE_CHECKING:
    from trl import GRPOTrainer

__all__ = ["TRAJECTORIES_FILE", "TrajectorySampler", "trajectory"]  # the file keeps its contract name in the work dir
SAMPLES_PER_LOG = 4
"""Trajectories kept per logging step: enough to see what the model does, few enough to read."""


class TrajectorySampler(TrainerCallback):
    """Appends `SAMPLES_PER_LOG` trajectories of the latest batch to `path` at each training log."""

    def __init__(self, path: Path, secret_names: list[str]) -> None:
        self.path = path
        self.secret_names = secret_names
        self.trainer: GRPOTrainer | None = None  # set once the trainer exists: it is built with this callback

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.trainer is None or not logs or "reward" not in logs:  # evaluation logs carry `eval_reward`
            return
        recent = self.trainer._logs
        prompts, completions = list(recent["prompt"]), list(recent["completion"])
        rewards = {name: list(values) for name, values in recent["rewards"].items()}
        # The trainer's own weights, by reward name: an environment's `get_reward` is a reward TRL adds.
        weights = dict(zip(self.trainer.reward_func_names, self.trainer.reward_weights.tolist(), strict=True))
        # Spread over the batch: its completions come in groups of the same prompt.
        every = max(1, len(prompts) // SAMPLES_PER_LOG)
        with self.path.open("a", encoding="utf-8") as out:
            for i in range(0, len(prompts), every)[:SAMPLES_PER_LOG]:
                by_reward = {name: values[i] for name, values in rewards.items() if i < len(values)}
                out.write(self._redacted(trajectory(state.global_step, prompts[i], completions[i], by_reward,
                                                    weights)) + "\n")

    def _redacted(self, record: dict[str, Any]) -> str:
        return json.dumps(redact_record(record, self.secret_names), ensure_ascii=False, default=str)


def trajectory(step: int, prompt: Any, completion: Any, rewards: dict[str, float],
               weights: dict[str, float]) -> dict[str, Any]:
    """One trajectory as stored: the step, the prompt's last user turn, the tool calls with their answers in order,
    the final answer, and the total reward (weighted as the trainer sums them) with each reward's value."""
    messages = completion if isinstance(completion, list) else [{"role": "assistant", "content": completion}]
    calls: list[dict[str, Any]] = []
    answer = ""
    for message in messages:
        if message.get("role") == "tool":
            pending = next((call for call in calls if call["name"] == message.get("name") and "result" not in call),
                           None)
            if pending is None:
                pending = {"name": message.get("name")}
                calls.append(pending)
            pending["result"] = message.get("content")
            continue
        for call in message.get("tool_calls") or []:
            function = call.get("function", call)
            calls.append({"name": function.get("name"), "arguments": function.get("arguments")})
        answer = message.get("content") or answer
    total = sum(weights.get(name, 1.0) * value for name, value in rewards.items() if value == value)  # NaN: skipped
    return {"step": step, "prompt": _last_user_turn(prompt), "tool_calls": calls, "answer": answer,
            "reward": total, "rewards": rewards}


def _last_user_turn(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    users = [m.get("content") for m in prompt if m.get("role") == "user"]
    return str(users[-1]) if users else ""
