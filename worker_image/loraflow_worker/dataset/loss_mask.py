"""Which tokens of a chat carry the loss, decided the same way before renting (the control plane) and while training
(the worker): the assistant turns, found by the chat template's `{% generation %}` markers where it has them, else
by rendering each assistant turn's prefix.

SFT on chat data learns the answers, not the prompts (Axolotl's `train_on_inputs: false`, hosted fine-tuning).
transformers marks a template's assistant tokens only between `{% generation %}` and `{% endgeneration %}`, which
few model templates have; TRL ships training templates with them for the families it knows. For any other template
the mask is derived: the tokens after `render(turns before it, add_generation_prompt=True)` up to the end of
`render(turns up to it)` are the turn's, which holds when each rendering is a prefix of the next (the template
does not rewrite earlier turns once later ones follow). A template that does is refused, naming
`training.chat_template`, rather than trained on a wrong mask.

Light on purpose: a tokenizer and the standard library, no torch or TRL, so the control plane imports it to check a
run's first examples before anything is rented.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")
"""transformers' `{% generation %}` tag, with Jinja's whitespace-trim variants (as TRL's `has_generation_markers`)."""

Masking = Literal["markers", "prefixes"]


class LossMaskError(ValueError):
    """A chat whose assistant tokens cannot be told apart, or that has none within `training.max_seq_length`."""


@dataclass(frozen=True)
class ChatTemplate:
    """The template a run's chats are rendered with, and how their assistant tokens are found."""

    text: str
    source: str
    """Where it came from, for the manifest and the errors: e.g. "the tokenizer's own", "TRL's training template for
    this model family", "training.chat_template `qwen3_training`"."""

    @property
    def masking(self) -> Masking:
        """`markers`: transformers' assistant mask (the template marks the turns); `prefixes`: derived by rendering
        each turn's prefix."""
        return "markers" if has_generation_markers(self.text) else "prefixes"


def has_generation_markers(template: str) -> bool:
    return GENERATION_MARKER.search(template) is not None


@dataclass(frozen=True)
class MaskedChat:
    input_ids: list[int]
    assistant_masks: list[int]
    """1 for a token of an assistant turn (the loss is on it), 0 elsewhere."""


def mask_chat(tokenizer: Any, messages: Sequence[dict[str, Any]], template: ChatTemplate,
              tools: list[Any] | None = None) -> MaskedChat:
    """The chat's token ids and its assistant mask under `template`. `LossMaskError` when the template rewrites an
    earlier turn once a later one follows (its mask cannot be derived) or the chat has no assistant turn."""
    if not any(m.get("role") == "assistant" for m in messages):
        raise LossMaskError("the chat has no assistant turn, so no token would carry the loss")
    if template.masking == "markers":
        out = tokenizer.apply_chat_template(list(messages), tools=tools, chat_template=template.text, tokenize=True,
                                            return_dict=True, return_assistant_tokens_mask=True)
        return MaskedChat(list(out["input_ids"]), list(out["assistant_masks"]))
    return _mask_by_prefixes(tokenizer, list(messages), template, tools)


def _mask_by_prefixes(tokenizer: Any, messages: list[dict[str, Any]], template: ChatTemplate,
                      tools: list[Any] | None) -> MaskedChat:
    def render(turns: list[dict[str, Any]], prompt: bool) -> str:
        return tokenizer.apply_chat_template(turns, tools=tools, chat_template=template.text, tokenize=False,
                                             add_generation_prompt=prompt)

    full = render(messages, False)
    spans: list[tuple[int, int]] = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before, through = render(messages[:i], True), render(messages[: i + 1], False)
        if not (through.startswith(before) and full.startswith(through)):
            raise LossMaskError(
                f"{template.source} renders turn {i + 1} (assistant) differently once the turns after it follow, so "
                "its tokens cannot be told from the prompt's by rendering each turn's prefix"
            )
        spans.append((len(before), len(through)))
    # The template writes the special tokens itself (as `apply_chat_template` tokenizes: no BOS added again).
    encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(start <= begin < end for start, end in spans)) for begin, _ in encoded["offset_mapping"]]
    return MaskedChat(list(encoded["input_ids"]), mask)


def check_first_chats(tokenizer: Any, chats: Sequence[Sequence[dict[str, Any]]], template: ChatTemplate,
                      max_length: int) -> float:
    """Mask each of `chats` (a run's first examples) as training will; the share of their tokens (within
    `max_length`, where training truncates) that carry the loss. `LossMaskError` naming the example when one has no
    assistant token within `max_length` or its mask cannot be derived."""
    masked = carried = 0
    for number, messages in enumerate(chats, start=1):
        try:
            chat = mask_chat(tokenizer, messages, template)
        except LossMaskError as e:
            raise LossMaskError(f"example {number}: {e}") from e
        kept = chat.assistant_masks[:max_length]
        if not any(kept):
            where = "" if any(chat.assistant_masks) else " at all"
            raise LossMaskError(
                f"example {number}: no token of an assistant turn{where} within training.max_seq_length "
                f"({max_length}) under {template.source} ({len(chat.input_ids)} tokens)"
            )
        masked += len(kept)
        carried += sum(kept)
    return carried / masked if masked else 0.0


def refusal(problem: str, template: ChatTemplate) -> str:
    """The whole message for a run refused over its loss mask: what went wrong and the three ways out."""
    return (f"training.loss_on \"completion\" trains on the assistant turns only, but {problem}. Give "
            "training.chat_template a template that marks the assistant turns with {% generation %} ... "
            "{% endgeneration %} (a TRL training template's name such as `qwen3_training`, or a .jinja file), make "
            "sure each example has an assistant answer within training.max_seq_length, or set training.loss_on = "
            f"\"all\" to train on every token (chat template: {template.source})")
