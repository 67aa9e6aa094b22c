"""The formats a run's data may come in, and their conversion to TRL's conversational formats.

ONE implementation for both sides: the control plane converts and checks a source's rows (every line of a local
file, the first lines of a Hub dataset's JSONL file) before anything is rented, and the worker converts every row
(`Dataset.map`) before training, so that TRL and everything after it see TRL's formats only.

- `auto`: the rows already are in one of TRL's conversational formats (`messages`; `prompt` and `completion`;
  prompt-only `prompt`, for GRPO; `prompt`, `chosen` and `rejected`, for DPO); `columns` may rename the dataset's
  own columns to those names.
- `alpaca`: `instruction`, optional `input`, `output`, optional `system`. Becomes a conversational prompt-completion
  row: the prompt is the system turn (when given) and one user turn, the instruction followed by the input after a
  blank line (as Alpaca's own template puts `### Input:` after `### Instruction:`); the completion is the output as
  one assistant turn. Prompt-completion rather than `messages` because an Alpaca row is one question and one answer:
  TRL then trains on the completion with any chat template (no generation markers needed), and GRPO takes the prompt
  and keeps the output as the `answer` its rewards see.
- `sharegpt`: `conversations`, a list of `{"from": ..., "value": ...}` turns. Becomes `messages` (ShareGPT data is
  multi-turn), each `from` mapped to a chat role by `SHAREGPT_ROLES`.

Columns that are not the format's are kept as they are (GRPO's rewards read them, e.g. `answer`).

Light (the standard library only): the control plane imports it without `datasets` or torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

DatasetFormat = Literal["auto", "alpaca", "sharegpt"]

FORMAT_NAMES: dict[str, tuple[str, ...]] = {
    "auto": ("messages", "prompt", "completion", "chosen", "rejected"),
    "alpaca": ("instruction", "input", "output", "system"),
    "sharegpt": ("conversations", "from", "value"),
}
"""The names `columns` may map, per format: its columns (and, for `sharegpt`, the keys of each turn)."""

SHAREGPT_ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant",
    "system": "system",
    "tool": "tool",
}
"""ShareGPT's speakers as chat roles: the original ShareGPT dumps say `human`/`gpt`/`system`; later sets (and
Axolotl's and LLaMA-Factory's readers) also take the chat names `user`/`assistant` and `tool`."""

TRL_FORMATS = {
    "messages": '{"messages": [{"role": ..., "content": ...}, ...]}',
    "prompt-completion": '{"prompt": [{"role": ..., "content": ...}, ...], "completion": [{"role": "assistant", '
                         '"content": ...}]}',
    "prompt-only": '{"prompt": [{"role": ..., "content": ...}, ...], <extra columns for the rewards, e.g. "answer">}',
    "preference": '{"prompt": [{"role": ..., "content": ...}, ...], "chosen": [{"role": "assistant", "content": ...}], '
                  '"rejected": [{"role": "assistant", "content": ...}]} (or the three as plain text)',
}
"""TRL's conversational dataset formats, as a line of a JSONL file (TRL's docs: "Dataset formats and types")."""

ALGORITHM_FORMATS = {"sft": ("messages", "prompt-completion"), "grpo": ("prompt-only", "prompt-completion", "messages"),
                     "dpo": ("preference",)}
"""What each algorithm trains on. SFT learns the completion (or the assistant turns). GRPO generates from the
prompt and hands every other column to the rewards; the worker turns the last assistant turn of `messages`, and
the completion of a prompt/completion row, into the column `answer` (TRL would hide `completion` from rewards). DPO
learns from pairs of answers to one prompt."""

MESSAGE_COLUMNS = {"messages": ("messages",), "prompt-completion": ("prompt", "completion"), "prompt-only": ("prompt",),
                   "preference": ("prompt", "chosen", "rejected")}
"""The columns of each TRL format that hold chat messages."""


class RowError(ValueError):
    """A row that cannot be converted: `field` is where in the row (the dataset's own names, e.g.
    `conversations[2].from`), `problem` what is wrong there."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"`{field}`: {problem}")
        self.field, self.problem = field, problem


def columns_problem(data_format: str, columns: Mapping[str, str]) -> str | None:
    """Why `columns` cannot rename `data_format`'s names; None when it can."""
    valid = FORMAT_NAMES[data_format]
    unknown = sorted(set(columns) - set(valid))
    if unknown:
        return (f"`columns` names {', '.join(f'`{n}`' for n in unknown)}, which format `{data_format}` does not have; "
                f"its names are {', '.join(f'`{n}`' for n in valid)} (map each to your dataset's own name)")
    targets = list(columns.values())
    repeated = sorted({t for t in targets if targets.count(t) > 1})
    if repeated:
        return f"`columns` maps several names to {', '.join(f'`{t}`' for t in repeated)}: give each its own column"
    return None


def to_trl_row(row: Mapping[str, Any], data_format: str, columns: Mapping[str, str]) -> dict[str, Any]:
    """`row` in TRL's conversational format: converted from `data_format`, its own column names taken through
    `columns` (the format's name → the dataset's). RowError names the field (in the dataset's names) and the
    problem."""
    name = {n: columns.get(n, n) for n in FORMAT_NAMES[data_format]}
    if data_format == "auto":
        renamed = {trl: name[trl] for trl in FORMAT_NAMES["auto"] if name[trl] != trl}
        return {**{k: v for k, v in row.items() if k not in renamed.values()},
                **{trl: row[own] for trl, own in renamed.items() if own in row}}
    own = {name[n] for n in FORMAT_NAMES[data_format] if n not in ("from", "value")}
    extra = {k: v for k, v in row.items() if k not in own}
    if data_format == "alpaca":
        return {**extra, **_alpaca(row, name)}
    return {**extra, "messages": _sharegpt(row, name)}


def trl_format(row: Any) -> str | None:
    """Which of TRL's conversational formats `row` is in, by its columns (`TRL_FORMATS`); None for none."""
    if not isinstance(row, Mapping):
        return None
    if "messages" in row:
        return "messages"
    if "chosen" in row or "rejected" in row:
        return "preference"
    if "prompt" in row:
        return "prompt-completion" if "completion" in row else "prompt-only"
    return None


def mixed_format(formats: Mapping[str, str | None]) -> str | None:
    """The TRL format a mix trains as, given each source's (by its name): their one format, or `messages` when chats
    mix with prompt-completion pairs (a pair is a chat of its prompt and its completion). ValueError naming every
    source for formats that do not mix."""
    found = set(formats.values())
    if found == {"messages", "prompt-completion"}:
        return "messages"
    if len(found) > 1:
        raise ValueError("the sources of a mix must be in formats that mix (`messages` and prompt-completion do; "
                         "prompt-only does only with prompt-only): " +
                         "; ".join(f"{name} is {f or 'in none of them'}" for name, f in formats.items()))
    return next(iter(found), None)


def preference_problem(row: Mapping[str, Any]) -> RowError | None:
    """What makes `row` (in TRL's names) no preference pair DPO can learn from: a missing or empty `prompt`, `chosen`
    or `rejected`, the three not all chats or all text, or the same answer twice; None for a good pair."""
    for column in MESSAGE_COLUMNS["preference"]:
        value = row.get(column)
        if value is None or value == "" or value == []:
            return RowError(column, "missing or empty: a preference row has a `prompt` and two answers to it, "
                            "`chosen` (preferred) and `rejected`")
        if not (isinstance(value, str) or is_messages(value)):
            return RowError(column, 'neither text nor a non-empty list of {"role": ..., "content": ...} messages')
    if len({isinstance(row[column], str) for column in MESSAGE_COLUMNS["preference"]}) > 1:
        return RowError("prompt", "`prompt`, `chosen` and `rejected` must all be chats or all be text")
    if row["chosen"] == row["rejected"]:
        return RowError("rejected", "the same answer as `chosen`: a pair of equal answers teaches no preference")
    return None


def is_messages(value: Any) -> bool:
    """Whether `value` is a non-empty list of chat messages with text content."""
    return isinstance(value, list) and bool(value) and all(
        isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
    )


def _alpaca(row: Mapping[str, Any], name: dict[str, str]) -> dict[str, Any]:
    instruction = _text(row, name["instruction"], required=True)
    given = _text(row, name["input"], required=False)
    output = _text(row, name["output"], required=True)
    system = _text(row, name["system"], required=False)
    prompt = [{"role": "system", "content": system}] if system else []
    prompt.append({"role": "user", "content": f"{instruction}\n\n{given}" if given else instruction})
    return {"prompt": prompt, "completion": [{"role": "assistant", "content": output}]}


def _sharegpt(row: Mapping[str, Any], name: dict[str, str]) -> list[dict[str, str]]:
    turns_column, speaker, text = name["conversations"], name["from"], name["value"]
    if turns_column not in row:
        raise RowError(turns_column, f"missing: a sharegpt row has a list of `{{\"{speaker}\": ..., \"{text}\": ...}}` "
                       f"turns there (map another column with `columns.conversations`)")
    turns = row[turns_column]
    if not isinstance(turns, list) or not turns:
        raise RowError(turns_column, f"not a non-empty list of `{{\"{speaker}\": ..., \"{text}\": ...}}` turns")
    messages = []
    for i, turn in enumerate(turns):
        where = f"{turns_column}[{i}]"
        if not isinstance(turn, Mapping):
            raise RowError(where, f"not a `{{\"{speaker}\": ..., \"{text}\": ...}}` turn")
        role = SHAREGPT_ROLES.get(turn.get(speaker)) if isinstance(turn.get(speaker), str) else None
        if role is None:
            raise RowError(f"{where}.{speaker}", f"{turn.get(speaker)!r} is not a speaker loraflow knows; use one of "
                           f"{', '.join(SHAREGPT_ROLES)} (map other keys with `columns.from` and `columns.value`)")
        if not isinstance(turn.get(text), str):
            raise RowError(f"{where}.{text}", "missing or not text")
        messages.append({"role": role, "content": turn[text]})
    return messages


def _text(row: Mapping[str, Any], column: str, *, required: bool) -> str | None:
    value = row.get(column)
    if value is None or value == "":
        if required:
            raise RowError(column, "missing or empty")
        return None
    if not isinstance(value, str):
        raise RowError(column, f"not text (a {type(value).__name__})")
    return value
