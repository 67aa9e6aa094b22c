"""A tool-using GRPO run the tiny model can do: its data, its tool and its reward, shared by the self test and the
tests.

A tiny random model cannot call tools by itself, so it is taught first: an SFT run on chats whose answer is a call of
the tool `record` in the chat template's format (`<tool_call>` JSON), after a system turn that is exactly the one the
template renders for the tool (`TOOLS_TURN`), so that the taught chats look like GRPO's prompts with tools. A GRPO run from that adapter (`lora.init_from`)
with `grpo.tools` then really calls the tool inside the training process: `record` appends its item to the file
`LEDGER_ENV` names (a side effect a test can see) and answers with a receipt, which the reward `receipt` looks for in
the completion (proof that the tool's answer reached the reward).
"""

from __future__ import annotations

import json
from typing import Any

LEDGER_ENV = "TOOL_LEDGER_FILE"
"""The worker environment variable naming the ledger file the tool appends to."""
ITEMS = ("apple", "pear", "plum", "fig")

TOOLS_SOURCE = f'''"""The tiny model's tool: it records an item in a ledger."""

import os


def record(item: str) -> str:
    """Record an item in the ledger.

    Args:
        item: The item to record.
    """
    with open(os.environ["{LEDGER_ENV}"], "a", encoding="utf-8") as ledger:
        ledger.write(item + "\\n")
    return "receipt " + item
'''
"""`tools.py`: the run's `grpo.tools`."""

REWARD_SOURCE = '''"""1 for a completion in which a tool answered with a receipt."""


def receipt(completions, **kwargs):
    return [float(any(message.get("role") == "tool" and str(message.get("content", "")).startswith("receipt")
                      for message in completion)) for completion in completions]
'''
"""`reward.py`: the run's reward `reward.py:receipt`."""


TOOLS_TURN = (
    '# Tools\n<tools>\n{"type": "function", "function": {"name": "record", "description": "Record an item in the '
    'ledger.", "parameters": {"type": "object", "properties": {"item": {"type": "string", "description": "The item to '
    'record."}}, "required": ["item"]}, "return": {"type": "string"}}}\n</tools>\nCall a tool with <tool_call>\n'
    '{"name": <name>, "arguments": <arguments>}\n</tool_call>'
)
"""The system turn the tiny model's chat template renders for `record` (the tests check that it still does)."""


def _call(item: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": "record", "arguments": {"item": item}}) + "\n</tool_call>"


def _ask(item: str) -> dict[str, str]:
    return {"role": "user", "content": f"Record {item}."}


def teaching_rows() -> list[dict[str, Any]]:
    """SFT chats whose answer is the call of `record` with the item asked for."""
    return [{"messages": [{"role": "system", "content": TOOLS_TURN}, _ask(item),
                          {"role": "assistant", "content": _call(item)}]} for item in ITEMS]


def prompt_rows() -> list[dict[str, Any]]:
    """GRPO prompts asking for the same items."""
    return [{"prompt": [_ask(item)]} for item in ITEMS]


def jsonl(rows: list[dict[str, Any]]) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)
