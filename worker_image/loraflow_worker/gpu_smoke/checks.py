"""What the check variants read in their run's process (`variants.CHECK_VARIANTS`): each a watcher started before
training, whose `result()` is (what it saw, an error or None).

- `PackedLabels` (`packed`): every batch the SFT trainer computes its loss on, as the GPU path hands it over (after
  the collator, on the device): every position 0 of a packed row (an example's start, or padding) has the label -100,
  so no example's first token is trained from the example before it.
- `HeadMoved` (`modules-to-save`, `modules-to-save-1e-5`): the share of the `modules_to_save` copies' values that
  differ from their start after `HEAD_CHECK_STEP` optimizer steps (bf16 on a GPU: an update below a value's last bit
  leaves it as it was), their dtype and their relative change (the norm of the change over the norm at the start).
- `teach_tool_call` and `tool_syncs` (`tools-grpo`): an SFT run teaches the model the tool call (a random model never
  calls), the GRPO run goes on from its adapter with the tool, and its manifest's vLLM weight syncs are read: one
  per step, however many tool turns each round took.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from loraflow_worker.gpu_smoke.variants import HEAD_CHECK_STEP

TEACHING_STEPS = 150
"""SFT steps that teach a model the tool call (the self test's `TEACHING_STEPS`, which teach the tiny model)."""


class PackedLabels:
    """Watches `trl.SFTTrainer.compute_loss` in this process (a class attribute: the worker's trainer calls TRL's)."""

    def __init__(self) -> None:
        from trl import SFTTrainer

        self.batches = self.examples = self.following = self.unmasked = self.without_positions = 0
        compute_loss = SFTTrainer.compute_loss
        watcher = self

        def checking(trainer, model, inputs, *args, **kwargs):
            watcher.see(inputs)
            return compute_loss(trainer, model, inputs, *args, **kwargs)

        SFTTrainer.compute_loss = checking

    def see(self, inputs: dict[str, Any]) -> None:
        self.batches += 1
        positions, labels = inputs.get("position_ids"), inputs.get("labels")
        if positions is None or labels is None:
            self.without_positions += 1
            return
        starts = (positions[:, :-1] == 0) & (positions[:, 1:] == 1)  # padding is position 0 too, followed by 0
        self.examples += int(starts.sum())
        self.following += int(starts[:, 1:].sum())  # an example after another in its row
        self.unmasked += int((labels[positions == 0] != -100).sum())

    def result(self) -> tuple[str, str | None]:
        seen = (f"{self.examples} packed examples in {self.batches} batches, {self.following} of them after another "
                f"in their row; position-0 labels other than -100: {self.unmasked}")
        if self.without_positions:
            return seen, f"{self.without_positions} batch(es) reached the loss without position_ids or labels"
        if not self.following:
            return seen, "no row packed two examples: the check tests nothing"
        if self.unmasked:
            return seen, f"{self.unmasked} packed example start(s) carry a label: trained from the example before"
        return seen, None


class HeadMoved(TrainerCallback):
    """The share of the `modules_to_save` copies' values that moved in the first `HEAD_CHECK_STEP` steps."""

    def __init__(self) -> None:
        self.start: dict[str, Any] = {}
        self.moved: float | None = None
        self.change: float | None = None
        self.dtypes: set[str] = set()
        self.values = 0

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.start = {name: weight.detach().clone() for name, weight in model.named_parameters()
                      if "modules_to_save" in name and weight.requires_grad}
        self.dtypes = {str(weight.dtype).removeprefix("torch.") for weight in self.start.values()}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step != HEAD_CHECK_STEP or not self.start:
            return
        weights = dict(model.named_parameters())
        moved = sum(int((weights[name].detach() != start).sum()) for name, start in self.start.items())
        self.values = sum(start.numel() for start in self.start.values())
        self.moved = moved / self.values
        change = sum(float((weights[name].detach().float() - start.float()).norm() ** 2) for name, start in self.start.items())
        self.change = (change / sum(float(start.float().norm() ** 2) for start in self.start.values())) ** 0.5

    def result(self) -> tuple[str, str | None]:
        if not self.start:
            return "no trainable modules_to_save copy", "the run trained no modules_to_save copy"
        if self.moved is None:
            return "not read", f"the run ended before step {HEAD_CHECK_STEP}: give it at least {HEAD_CHECK_STEP} steps"
        seen = (f"{self.moved:.1%} of the modules_to_save copy's {self.values:,} values moved after {HEAD_CHECK_STEP} "
                f"steps ({', '.join(sorted(self.start))}; {', '.join(sorted(self.dtypes))}; relative change "
                f"{self.change:.1e})")
        return seen, None if self.moved > 0 else "the modules_to_save copy did not move: it is not training"


def teach_tool_call(out: Path, model_dir: Path, run_id: str) -> str:
    """Train the tool call into an adapter (SFT on `tool_use`'s teaching chats) and store it as the run `run_id` of
    the smoke's store, as a finished run's adapter is: the `lora.init_from` of the tool-using GRPO run."""
    from loraflow_worker.artifacts import open_store
    from loraflow_worker.contract import JobInput
    from loraflow_worker.training.sft import train_sft

    job = JobInput.model_validate({
        "run_id": run_id, "model": {"id": str(model_dir)}, "dataset": {"store_path": "data/tools-teach.jsonl"},
        "training": {"max_steps": TEACHING_STEPS, "learning_rate": 1e-2, "batch_size": 4},
        "lora": {"rank": 8, "alpha": 16}, "artifact_store": (out / "store").as_uri()})
    outcome = train_sft(job, open_store(job.artifact_store), out / "work" / run_id, lambda progress: None)
    shutil.copytree(outcome.adapter_dir, out / "store" / "runs" / run_id / "adapter", dirs_exist_ok=True)
    return f"runs/{run_id}"


def tool_syncs(manifest: Any, ledger: Path, steps: int) -> tuple[str, str | None]:
    """What the tool-using GRPO run's manifest says of vLLM's weight syncs, with the tool calls the ledger counted;
    an error where vLLM generated and a step had other than one sync, or no round had a tool turn."""
    calls = len(ledger.read_text().split()) if ledger.is_file() else 0
    vllm = manifest.fast_paths["vllm_colocate"]
    syncs = manifest.vllm_weight_syncs
    if syncs is None:
        return f"{calls} tool calls; no vLLM weight syncs to count (vllm_colocate off: {vllm.reason})", None
    per_step = [syncs.per_step.get(step, 0) for step in range(1, steps + 1)]
    turns = [syncs.generate_calls_per_step.get(step, 0) for step in range(1, steps + 1)]
    seen = (f"vLLM weight syncs per step {per_step}, generate calls per step {turns}, {calls} tool calls, "
            f"{syncs.evaluation_syncs} evaluation syncs")
    if any(count != 1 for count in per_step):
        return seen, "a step had other than one weight sync into vLLM: one per generation round is expected"
    if all(count <= 1 for count in turns):
        return seen, "no round had a tool turn (the taught model made no call): the sync count proves nothing"
    return seen, None
