"""SFT's loss in the worker: the chat template a run's chats are rendered with, the TRL settings and the data that put
the loss on the tokens `training.loss_on` names, and the share of tokens that carried it (the manifest's `loss`).

The mask itself (`loraflow_worker.dataset.loss_mask`) is the control plane's too: what it checked on the run's first examples before renting
is what training does here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import pyarrow.compute as pc
import trl
from datasets import Dataset
from transformers import PreTrainedTokenizerBase

from loraflow_worker.artifacts import ArtifactStore
from loraflow_worker.artifacts.manifest import LossRecord
from loraflow_worker.contract import JobInput, trl_training_template
from loraflow_worker.dataset.loss_mask import ChatTemplate, LossMaskError, check_first_chats, has_generation_markers, \
    mask_chat, refusal

CHECKED_EXAMPLES = 20
"""Examples rendered and masked before the model loads, so that a run whose mask would be empty fails in seconds."""


@dataclass
class SftLoss:
    """How an SFT run puts its loss where `training.loss_on` says."""

    config: dict[str, Any]
    """`SFTConfig` settings: `assistant_only_loss`, `completion_only_loss`."""
    train: Dataset
    evaluation: Dataset | None
    template: ChatTemplate | None
    masked_by: str
    render_with: str | None = None
    """The template the tokenizer must carry while TRL prepares the data (a training version with markers), when it
    is not the one the adapter is saved with."""


def trl_template(name: str) -> str:
    """The text of one of TRL's chat templates, by name (a file of its `chat_templates` folder)."""
    return (Path(trl.__file__).parent / "chat_templates" / f"{name}.jinja").read_text(encoding="utf-8")


def chat_template(job: JobInput, tokenizer: PreTrainedTokenizerBase, store: ArtifactStore) -> ChatTemplate | None:
    """The template the run renders its chats with: `training.chat_template` (a TRL template's name, or a `.jinja` file
    the control plane stored with the run's inputs), else the model's own where it marks the assistant turns, else
    TRL's training version of it, else the model's own (its assistant turns found by each turn's prefix). None when the
    model has no chat template and the run gives none."""
    given = job.training.chat_template
    if given is not None:
        if given.endswith((".jinja", ".j2")):
            text = store.read_bytes(given).decode("utf-8")
            return ChatTemplate(text, f"training.chat_template ({PurePosixPath(given).name})")
        return ChatTemplate(trl_template(given), f"training.chat_template `{given}`")
    own = tokenizer.chat_template
    if isinstance(own, dict):  # a template shipped as named variants: transformers renders `default`
        own = own.get("default")
    if own is None:
        return None
    if job.training.loss_on == "all" or has_generation_markers(own):
        return ChatTemplate(own, "the model's own chat template")
    trained = trl_training_template(own)
    if trained is not None:
        return ChatTemplate(trl_template(trained), f"TRL's `{trained}`, the training version of the model's template")
    return ChatTemplate(own, "the model's own chat template (no generation markers, no TRL training version)")


def prepare_sft_loss(job: JobInput, tokenizer: PreTrainedTokenizerBase, store: ArtifactStore, train: Dataset,
                     evaluation: Dataset | None) -> SftLoss:
    """The trainer settings and data for the run's `loss_on`. `LossMaskError` (a message naming `loss_on`,
    `chat_template` and the fix) when the run's first chats would have no token with loss, before the model loads."""
    template = chat_template(job, tokenizer, store)
    columns = set(train.column_names)
    if "messages" in columns and template is None:
        raise LossMaskError("the model has no chat template to render the `messages` chats with: give "
                            "training.chat_template (a TRL template's name, e.g. `qwen3_training`, or a .jinja file)")
    if template is not None and job.training.chat_template is not None:
        # The run's template is also the saved adapter's: what it was trained to read is what serves it.
        tokenizer.chat_template = template.text
    if job.training.loss_on == "all":
        return SftLoss(dict(assistant_only_loss=False, completion_only_loss=False), train, evaluation, template,
                       "nothing: every token carries the loss")
    if "prompt" in columns and "completion" in columns:
        return SftLoss(dict(assistant_only_loss=False, completion_only_loss=True), train, evaluation, template,
                       "the prompt of each prompt/completion example")
    if "messages" not in columns:
        return SftLoss(dict(assistant_only_loss=False, completion_only_loss=False), train, evaluation, template,
                       "nothing: plain text has no prompt")
    first = train.select(range(min(CHECKED_EXAMPLES, len(train))))["messages"]
    try:
        check_first_chats(tokenizer, first, template, job.training.max_seq_length)
    except LossMaskError as e:
        raise LossMaskError(refusal(str(e), template)) from e
    if template.masking == "markers":
        # TRL renders with the tokenizer's template and masks by its markers (`assistant_only_loss`).
        return SftLoss(dict(assistant_only_loss=True, completion_only_loss=False), train, evaluation, template,
                       "the chat template's generation markers", render_with=template.text)
    return SftLoss(dict(assistant_only_loss=False, completion_only_loss=False), _masked(train, tokenizer, template),
                   _masked(evaluation, tokenizer, template) if evaluation is not None else None, template,
                   "each assistant turn's rendered prefix")


def _masked(rows: Dataset, tokenizer: PreTrainedTokenizerBase, template: ChatTemplate) -> Dataset:
    # Tokenized rows with `assistant_masks`: TRL skips its own tokenization and builds the labels from the mask.
    def mask(row: dict[str, Any]) -> dict[str, list[int]]:
        try:
            chat = mask_chat(tokenizer, row["messages"], template, row.get("tools"))
        except LossMaskError as e:
            raise LossMaskError(refusal(str(e), template)) from e
        return {"input_ids": chat.input_ids, "assistant_masks": chat.assistant_masks}

    return rows.map(mask, remove_columns=rows.column_names)


def loss_record(job: JobInput, loss: SftLoss, prepared: Dataset) -> LossRecord:
    """What the manifest says of the run's loss: `prepared` is the trainer's training data (tokenized, its `labels`
    -100 where no loss is)."""
    labels = pc.list_flatten(prepared.data.column("labels"))
    total = len(labels)
    carried = pc.sum(pc.not_equal(labels, -100)).as_py() or 0
    return LossRecord(loss_on=job.training.loss_on, masked_by=loss.masked_by,
                      chat_template=loss.template.source if loss.template else None,
                      token_share=carried / total if total else 0.0)
