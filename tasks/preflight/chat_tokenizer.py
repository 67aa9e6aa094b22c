"""A model's tokenizer as far as rendering and masking its chats goes, read from its files with `tokenizers` and
Jinja alone: importing transformers costs a second of every chat SFT run's start, for a check that passes almost
always.

It renders as transformers' `apply_chat_template` does (a sandboxed Jinja environment with `trim_blocks` and
`lstrip_blocks`, loop controls, a `tojson` that does not escape HTML, `raise_exception`, `strftime_now`, the named
special tokens as variables, `{% generation %}` spans for the assistant mask) and encodes with the model's own
`tokenizer.json`. It is a fast path, not the judge: `check_chats_task` accepts what it passes and asks transformers
again before refusing anything, so a difference between the two can only let a run through to the worker's own
check, never refuse a good one.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
"""The named special tokens transformers passes to a chat template (`special_tokens_map`)."""


class ChatTokenizer:
    """The slice of a transformers tokenizer that `loraflow_worker.dataset.loss_mask` uses: `chat_template`,
    `apply_chat_template` and `__call__` with offsets."""

    def __init__(self, tokenizer: Tokenizer, chat_template: str | dict[str, str] | None,
                 special_tokens: dict[str, str]):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.special_tokens = special_tokens
        self._compiled: dict[str, jinja2.Template] = {}

    @classmethod
    def read(cls, folder: Path) -> ChatTokenizer | None:
        """The tokenizer in `folder` (a model's files); None where it has no `tokenizer.json`, which only
        transformers' own classes can build from the older vocabulary files."""
        if not (folder / "tokenizer.json").is_file():
            return None
        config_file = folder / "tokenizer_config.json"
        config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
        special = {key: config[key] for key in SPECIAL_TOKENS if config.get(key) is not None}
        if any(not isinstance(value, str) for value in special.values()):
            raise ValueError("tokenizer_config.json names a special token by other than a string")  # as transformers
        legacy = folder / "special_tokens_map.json"
        if "added_tokens_decoder" not in config and legacy.is_file():  # as transformers: the legacy file's only then
            special |= {key: value["content"] if isinstance(value, dict) else str(value)
                        for key, value in json.loads(legacy.read_text(encoding="utf-8")).items()
                        if key in SPECIAL_TOKENS and value is not None}
        return cls(Tokenizer.from_file(str(folder / "tokenizer.json")), _chat_templates(folder, config), special)

    def apply_chat_template(self, conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                            chat_template: str | None = None, tokenize: bool = True, return_dict: bool = False,
                            return_assistant_tokens_mask: bool = False, add_generation_prompt: bool = False,
                            ) -> str | dict[str, list[int]]:
        text = chat_template if chat_template is not None else self._default_template()
        template = self._compiled.get(text) or self._compiled.setdefault(text, _compile(text))
        variables = {**self.special_tokens, "messages": conversation, "tools": tools, "documents": None,
                     "add_generation_prompt": add_generation_prompt}
        spans: list[tuple[int, int]] = []
        with template.environment.tracking(spans if return_assistant_tokens_mask else None) as rendered:
            rendered.extend(template.generate(**variables))
        if not tokenize:
            return "".join(rendered)
        encoded = self("".join(rendered), add_special_tokens=False, return_offsets_mapping=True)
        if not (return_dict and return_assistant_tokens_mask):
            return {"input_ids": encoded["input_ids"]} if return_dict else encoded["input_ids"]
        return {"input_ids": encoded["input_ids"], "assistant_masks": _mask(encoded["offset_mapping"], spans)}

    def __call__(self, text: str, add_special_tokens: bool = True,
                 return_offsets_mapping: bool = False) -> dict[str, list[Any]]:
        encoding = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        out: dict[str, list[Any]] = {"input_ids": list(encoding.ids)}
        if return_offsets_mapping:
            out["offset_mapping"] = list(encoding.offsets)
        return out

    def _default_template(self) -> str:
        if isinstance(self.chat_template, dict):
            return self.chat_template["default"]
        if self.chat_template is None:
            raise ValueError("the tokenizer has no chat template")
        return self.chat_template


def _chat_templates(folder: Path, config: dict[str, Any]) -> str | dict[str, str] | None:
    """As transformers reads them: `chat_template.jinja` and `additional_chat_templates/*.jinja` over the config's
    `chat_template` (a string, or a list of named templates)."""
    files = {}
    if (folder / "chat_template.jinja").is_file():
        files["default"] = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    for extra in sorted((folder / "additional_chat_templates").glob("*.jinja")):
        files[extra.name.removesuffix(".jinja")] = extra.read_text(encoding="utf-8")
    if files:
        return files["default"] if list(files) == ["default"] else files
    own = config.get("chat_template")
    if isinstance(own, list):
        return {entry["name"]: entry["template"] for entry in own}
    return own


def _mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for the tokens from the one holding a span's first character through the one holding its last (transformers'
    `char_to_token` rule: a span starting on no token ends the marking)."""
    def token_at(char: int) -> int | None:
        return next((i for i, (start, end) in enumerate(offsets) if start <= char < end), None)

    mask = [0] * len(offsets)
    for start, end in spans:
        first, last = token_at(start), token_at(end - 1)
        if first is None:
            break
        for i in range(first, last + 1 if last else len(offsets)):
            mask[i] = 1
    return mask


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: records where each such block's text lands in the rendering."""

    tags = {"generation"}

    def __init__(self, environment: jinja2.Environment):
        super().__init__(environment)
        self._rendered: list[str] | None = None
        self._spans: list[tuple[int, int]] | None = None
        environment.extend(tracking=self.tracking)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_block"), [], [], body).set_lineno(lineno)

    def _block(self, caller: Any) -> str:
        text = caller()
        if self._rendered is not None and self._spans is not None:
            start = sum(map(len, self._rendered))  # the blocks streamed so far by `generate`
            self._spans.append((start, start + len(text)))
        return text

    @contextmanager
    def tracking(self, spans: list[tuple[int, int]] | None) -> Iterator[list[str]]:
        rendered: list[str] = []
        self._rendered, self._spans = rendered, spans
        try:
            yield rendered
        finally:
            self._rendered = self._spans = None


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # transformers' filter: Jinja's own escapes HTML characters, which chat templates must not.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _compile(template: str) -> jinja2.Template:
    # An environment per template and tokenizer: the generation tracker holds one rendering's state.
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[_Generation, jinja2.ext.loopcontrols])
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    return environment.from_string(template)
