"""A tool GRPO run's prompts measured as the worker measures them (`loraflow_worker.training.grpo.prompt_dataset`):
each chat prompt rendered by the model's chat template with the tools' JSON schemas and a generation prompt, in
tokens, against `grpo.max_prompt_length`.

The schemas alone can take hundreds of tokens, and the worker leaves out every prompt longer than the limit (and
fails when none is left): a limit that fitted the prompts without tools silently trains on fewer of them, or fails
once the GPU is rented. So a run whose longest local prompt is above the limit is refused before renting, naming both
numbers. (A Hub dataset's prompts are the worker's to measure.)
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loraflow_worker.contract.dataset_formats import to_trl_row

MAX_PROMPTS = 20_000
"""How many prompts of the local files are measured (rendering and encoding one takes about a millisecond); a larger
file is measured on its first ones."""


def local_prompts(files: Sequence[tuple[str, str, dict[str, str]]]) -> list[tuple[str, list[dict[str, Any]]]]:
    """(where: `line N of PATH`, chat prompt) of each chat prompt in the local files (path, format, columns; checked
    already), split as the worker splits them: the `prompt` messages, or the `messages` without a last assistant
    turn. Text prompts are left out: with tools the worker refuses them, and the run check says so."""
    prompts = []
    for path, data_format, columns in files:
        with Path(path).open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, start=1):
                if len(prompts) >= MAX_PROMPTS:
                    return prompts
                if not line.strip():
                    continue
                row = to_trl_row(json.loads(line), data_format, columns)
                prompt = row.get("prompt", row.get("messages"))
                if isinstance(prompt, list):
                    if "prompt" not in row and prompt and prompt[-1].get("role") == "assistant":
                        prompt = prompt[:-1]
                    prompts.append((f"line {number} of {path}", prompt))
    return prompts


def prompt_tokens(tokenizer: Any, prompt: list[dict[str, Any]], schemas: list[dict[str, Any]] | None) -> int:
    """The prompt's length in tokens as the worker's GRPO sees it: the chat template applied with the tools' schemas
    and a generation prompt."""
    encoded = tokenizer.apply_chat_template(prompt, tools=schemas or None, add_generation_prompt=True, tokenize=True,
                                            return_dict=True)
    return len(encoded["input_ids"])


def prompt_length_problem(tokenizer: Any, schemas: list[dict[str, Any]],
                          prompts: Sequence[tuple[str, list[dict[str, Any]]]], max_prompt_length: int) -> str | None:
    """Why `max_prompt_length` cannot hold the longest of `prompts` with the tools' `schemas`; None when it can."""
    lengths = [(prompt_tokens(tokenizer, prompt, schemas), where, prompt) for where, prompt in prompts]
    if not lengths:
        return None
    longest, where, prompt = max(lengths, key=lambda item: item[0])
    if longest <= max_prompt_length:
        return None
    schema_tokens = longest - prompt_tokens(tokenizer, prompt, None)
    over = sum(1 for tokens, _, _ in lengths if tokens > max_prompt_length)
    return (f"grpo.max_prompt_length {max_prompt_length} is below the longest prompt ({where}): {longest} tokens with "
            f"the tools' schemas rendered by the model's chat template ({schema_tokens} of them the schemas'); "
            f"{over} of {len(lengths)} prompts are longer than the limit, and the worker would leave them out. Raise "
            f"grpo.max_prompt_length to at least {longest}, or shorten the prompts")
