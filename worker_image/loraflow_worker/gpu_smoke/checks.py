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
- `task_answering` (`task-eval`): the run's task evaluation after training, as the worker makes it, answered by vLLM
  where it runs (CUDA and vllm installed; transformers elsewhere, as it should be), its scores beside those of
  transformers' answers to the same task, the share of identical answers, and the GPU memory the engine gave back.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from loraflow_worker.gpu_smoke.variants import HEAD_CHECK_STEP

SCORE_TOLERANCE = 0.15
"""How far a score from vLLM's answers may be from transformers': bf16 kernels differ, and a random model's near-even
logits let a greedy answer turn on a rounding, so answers differ where scores should not much."""

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


def task_answering(job: Any, work_dir: Path, adapter_dir: Path, steps: int) -> tuple[str, str | None]:
    """The run's task evaluation after training as the worker makes it (`evaluate_after_training`), then the same
    task answered by transformers (`loaded_answerer`): which answered the run's (vLLM where CUDA and vllm are there,
    else transformers, with the progress line that says why), how far its scores are from transformers', how many
    answers are identical, and the GPU memory free before and after (an engine that kept its memory fails)."""
    from importlib.util import find_spec

    import torch

    from loraflow_worker.artifacts import open_store
    from loraflow_worker.evaluation.after_training import ADAPTER, evaluate_after_training, prepare_evaluation
    from loraflow_worker.evaluation.answering import loaded_answerer
    from loraflow_worker.evaluation.tasks import AnsweringAdapter, TaskResults, evaluate_task
    from loraflow_worker.runtime.model_cache import resolve_base_model

    cuda = torch.cuda.is_available()
    expected = "vllm" if cuda and find_spec("vllm") is not None else "transformers"
    store = open_store(job.artifact_store)
    prepared = prepare_evaluation(job, store, work_dir)
    said: list[str] = []
    free_before = torch.cuda.mem_get_info()[0] if cuda else 0
    evaluated = evaluate_after_training(job, store, work_dir, adapter_dir, prepared,
                                        lambda progress: said.append(progress.message), steps)
    free_after = torch.cuda.mem_get_info()[0] if cuda else 0
    reference = TaskResults()
    with loaded_answerer(resolve_base_model(job.model)[0], {ADAPTER: adapter_dir}, base_tokenizer_dir=adapter_dir) \
            as answerer:
        for task in prepared:
            evaluate_task(task, answerer, [AnsweringAdapter(ADAPTER, None, "reference")], lambda message: None,
                          reference)
    theirs = {score.metric: score for score in reference.scores[ADAPTER]}
    gap = max((abs(getattr(score, side) - getattr(theirs[score.metric], side)) for score in evaluated.task_scores
               for side in ("base", "adapter")), default=0.0)
    same = {side: sum(mine[side] == other[side] for mine, other in zip(_answers(evaluated.files), _answers(
        reference.files))) for side in ("base", "adapter")}
    answered = sorted({score.answered_by or "?" for score in evaluated.task_scores})
    how = next((line for line in said if line.startswith("answering with")), "no line said what answered")
    seen = (f"answered by {', '.join(answered) or 'nothing'} ({how}); scores at most {gap:.3f} from transformers'; "
            f"identical answers: base {same['base']}, adapter {same['adapter']} of {len(_answers(reference.files))}"
            + (f"; GPU memory free {free_before / 2**30:.1f} GiB before, {free_after / 2**30:.1f} GiB after" if cuda
               else ""))
    if evaluated.stopped:
        return seen, f"the evaluation stopped: {evaluated.stopped}"
    if answered != [expected]:
        return seen, f"expected {expected} to answer"
    if gap > SCORE_TOLERANCE:
        return seen, f"a score differs from transformers' by more than {SCORE_TOLERANCE}"
    if cuda and free_after < free_before - 2**30:
        return seen, "the evaluation left more than 1 GiB of GPU memory taken: the vLLM engine kept its memory"
    return seen, None


def _answers(files: dict[str, bytes]) -> list[dict[str, Any]]:
    """The stored answers samples' rows, in the task file's order."""
    import json

    rows = [json.loads(line) for data in files.values() for line in data.decode().splitlines() if line]
    return sorted(rows, key=lambda row: row["row"])
