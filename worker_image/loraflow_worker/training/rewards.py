"""GRPO reward functions: the built-ins for common verifiable tasks, user rewards by `module:function`, and
reward files (`path/to/file.py:function`) that the run ships in its artifact store.

Every reward has TRL's reward-function signature: called once per batch with `prompts`, `completions`
(strings, or `[{"role": "assistant", "content": ...}]` for chat prompts), `completion_ids` and every
dataset column as keyword arguments; it returns one float per completion. A job names its rewards in
`grpo.rewards` (see `contract.RewardSpec`); `resolve_rewards` turns those entries into callables through
the plain dict `BUILTIN_REWARDS`, binding each entry's parameters.

A user reward is any such function importable on the worker, e.g. `my_rewards.math:boxed_answer` from a
package listed in the job's `extra_packages`:

    def boxed_answer(completions, answer, **kwargs) -> list[float]:
        return [1.0 if f"\\boxed{{{a}}}" in c else 0.0 for c, a in zip(completions, answer)]

The same function in a file of its own needs no package: name it `rewards/math.py:boxed_answer` and the
control plane uploads the file to the run's store (`RewardSpec.store_path`), from where the worker imports it.
"""

from __future__ import annotations

import functools
import importlib
import math
import re
import string
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loraflow_worker.contract import RewardSpec
from loraflow_worker.contract.reward_names import BUILTIN_REWARD_PARAMS, reward_kind, split_file_reward
from loraflow_worker.training.user_files import UserFileError, import_stored_function

if TYPE_CHECKING:
    from loraflow_worker.artifacts import ArtifactStore

RewardFunc = Callable[..., list[float]]

DEFAULT_NUMERIC_TOLERANCE = 1e-6
_NUMBER = re.compile(r"[-+]?(?:\d+(?:,\d{3})*(?:\.\d+)?|\.\d+)")
_ARTICLES = re.compile(r"\b(a|an|the)\b")


class RewardError(ValueError):
    """A reward cannot be used as named: unknown name, user reward not importable, missing dataset column."""


def exact_match(completions: Sequence[Any], *, column: str, pattern: str | None = None, **columns: Any) -> list[float]:
    """1 when the completion's final answer equals the reference in `column` (surrounding spaces ignored), else 0."""
    references = _column(columns, column, "exact_match")
    return [float(_answer(c, pattern) == str(ref).strip()) for c, ref in zip(completions, references, strict=True)]


def normalized_match(completions: Sequence[Any], *, column: str, pattern: str | None = None, **columns: Any) -> list[float]:
    """Like `exact_match`, after lower-casing and removing punctuation, articles and extra spaces (SQuAD's rule)."""
    references = _column(columns, column, "normalized_match")
    return [
        float(_normalize(_answer(c, pattern)) == _normalize(str(ref)))
        for c, ref in zip(completions, references, strict=True)
    ]


def numeric_match(
    completions: Sequence[Any], *, column: str, pattern: str | None = None, tolerance: float | None = None, **columns: Any
) -> list[float]:
    """1 when the last number of the completion's final answer equals the last number of the reference in
    `column` (so a GSM8K answer `... #### 72` works as is) within `tolerance`, else 0."""
    references = _column(columns, column, "numeric_match")
    tolerance = DEFAULT_NUMERIC_TOLERANCE if tolerance is None else tolerance
    rewards = []
    for completion, reference in zip(completions, references, strict=True):
        got, want = _last_number(_answer(completion, pattern)), _last_number(str(reference))
        rewards.append(float(got is not None and want is not None and abs(got - want) <= tolerance))
    return rewards


def format_reward(completions: Sequence[Any], *, pattern: str, **_: Any) -> list[float]:
    """1 when `pattern` is found in the completion (anchor it to require the whole text), else 0."""
    regex = re.compile(pattern, re.DOTALL)
    return [float(regex.search(_text(c)) is not None) for c in completions]


def length_penalty(completion_ids: Sequence[Sequence[int]], *, target_length: int, **_: Any) -> list[float]:
    """0 up to `target_length` tokens, then minus the excess as a fraction of `target_length`, down to -1."""
    return [-min(1.0, max(0, len(ids) - target_length) / target_length) for ids in completion_ids]


def digit_fraction(completions: Sequence[Any], **_: Any) -> list[float]:
    """The fraction of the completion's non-space characters that are digits (0 for an empty completion):
    a dense shaping reward for tasks whose answers are numbers; pair it with `numeric_match`."""
    rewards = []
    for completion in completions:
        chars = [ch for ch in _text(completion) if not ch.isspace()]
        rewards.append(sum(ch.isdigit() for ch in chars) / len(chars) if chars else 0.0)
    return rewards


BUILTIN_REWARDS: dict[str, RewardFunc] = {
    "exact_match": exact_match,
    "normalized_match": normalized_match,
    "numeric_match": numeric_match,
    "format": format_reward,
    "length_penalty": length_penalty,
    "digit_fraction": digit_fraction,
}


def resolve_rewards(specs: Sequence[RewardSpec], store: ArtifactStore | None = None,
                    files_dir: Path | None = None) -> tuple[list[RewardFunc], list[float]]:
    """The reward callables of a job's `grpo.rewards`, parameters bound, and their weights (same order). Reward
    files are read from `store` (at their `store_path`) into `files_dir` and imported from there."""
    functions = []
    for spec in specs:
        kind = reward_kind(spec.name)
        if kind == "builtin":
            params = {p: getattr(spec, p) for p in sum(BUILTIN_REWARD_PARAMS[spec.name], ()) if getattr(spec, p) is not None}
            # functools.partial keeps the function's name, which TRL logs the reward under (`rewards/<name>/mean`).
            functions.append(functools.partial(BUILTIN_REWARDS[spec.name], **params))
        elif kind == "file":
            functions.append(_load_reward_file(spec, store, files_dir))
        elif kind == "module":
            functions.append(_import_user_reward(spec.name))
        else:
            valid = ", ".join(sorted(BUILTIN_REWARDS))
            raise RewardError(f"unknown reward `{spec.name}`: use one of {valid}, or `package.module:function` for a user reward")
    return functions, [spec.weight for spec in specs]


def check_reward_columns(specs: Sequence[RewardSpec], columns: Sequence[str]) -> None:
    """Fail before training when a reward names a dataset column the dataset does not have."""
    for spec in specs:
        if spec.column is not None and spec.column not in columns:
            raise RewardError(
                f"reward `{spec.name}` reads column `{spec.column}`, which the dataset does not have; its columns "
                f"are {', '.join(f'`{c}`' for c in columns)}: set `column` to one of them"
            )


def _import_user_reward(name: str) -> RewardFunc:
    module_name, _, attribute = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise RewardError(
            f"user reward `{name}`: module `{module_name}` cannot be imported on the worker ({e}); add the package "
            "that provides it to the job's `extra_packages`"
        ) from e
    function = vars(module).get(attribute)
    if not callable(function):
        found = "is not callable" if attribute in vars(module) else "does not exist"
        raise RewardError(f"user reward `{name}`: `{attribute}` {found} in module `{module_name}` ({module.__file__})")
    return function


def _load_reward_file(spec: RewardSpec, store: ArtifactStore | None, files_dir: Path | None) -> RewardFunc:
    """Fetch a reward file from the run's store and import it as a module of its own; its function."""
    if spec.store_path is None or store is None or files_dir is None:
        raise RewardError(
            f"reward file `{spec.name}`: it is not in the run's artifact store (`store_path` is empty); start the run "
            "with the train flow, which uploads the file, or package it and name it `package.module:function`"
        )
    _, attribute = split_file_reward(spec.name)
    try:
        return import_stored_function(store, spec.store_path, attribute, files_dir)
    except UserFileError as e:
        raise RewardError(f"reward file `{spec.name}`: {e}") from e


def _column(columns: dict[str, Any], column: str, reward: str) -> list[Any]:
    if column not in columns:
        # TRL passes every dataset column except `prompt`; check_reward_columns normally catches this first.
        raise RewardError(f"reward `{reward}` reads column `{column}`, which the batch does not have")
    return columns[column]


def _text(completion: Any) -> str:
    """A completion's text: TRL passes strings for text prompts and a list of messages for chat prompts (one, or with
    tools the whole exchange: calls, the tools' answers, the final answer), whose last assistant message is the
    answer."""
    if isinstance(completion, str):
        return completion
    answers = [message for message in completion if message.get("role", "assistant") == "assistant"]
    return (answers[-1].get("content") or "") if answers else ""


def _answer(completion: Any, pattern: str | None) -> str:
    text = _text(completion)
    if pattern is None:
        return text.strip()
    matches = list(re.finditer(pattern, text, re.DOTALL))
    if not matches:
        return ""
    last = matches[-1]
    return (last.group(1) if last.re.groups else last.group(0)).strip()


def _normalize(text: str) -> str:
    text = "".join(ch for ch in text.lower() if ch not in string.punctuation)
    return " ".join(_ARTICLES.sub(" ", text).split())


def _last_number(text: str) -> float | None:
    numbers = _NUMBER.findall(text)
    if not numbers:
        return None
    value = float(numbers[-1].replace(",", ""))
    return value if math.isfinite(value) else None
