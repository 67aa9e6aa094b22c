"""The built-in graders of a task's answers: each scores one answer against the row's expected answer in [0, 1], as
`GraderSettings.kind` describes (`exact_match`, `contains`, `regex`, `numeric`, `f1`)."""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from collections.abc import Callable

from loraflow_worker.contract.task_evaluation import GraderSettings

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_NUMBER = re.compile(r"[-+]?(?:\d+(?:,\d{3})*(?:\.\d+)?|\.\d+)")


def normalize_answer(text: str) -> str:
    """SQuAD's normalisation (its v1.1 evaluation script): lowercase, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in string.punctuation)
    return " ".join(_ARTICLES.sub(" ", text).split())


def _prepared(text: str, grader: GraderSettings) -> str:
    return normalize_answer(text) if grader.normalize else text.strip()


def exact_match(answer: str, expected: str, grader: GraderSettings) -> float:
    return float(_prepared(answer, grader) == _prepared(expected, grader))


def contains(answer: str, expected: str, grader: GraderSettings) -> float:
    return float(_prepared(expected, grader) in _prepared(answer, grader))


def regex(answer: str, expected: str, grader: GraderSettings) -> float:
    """With `pattern`: its first group (or whole match), at its first match in the answer, equals the expected answer.
    Without: the expected answer, itself a pattern, is found in the answer (as written: patterns are not
    normalised)."""
    if grader.pattern is None:
        return float(re.search(expected, answer, re.DOTALL) is not None)
    found = re.search(grader.pattern, answer, re.DOTALL)
    if found is None:
        return 0.0
    part = found.group(1) if found.re.groups else found.group(0)
    return exact_match(part or "", expected, grader)


def last_number(text: str) -> float | None:
    """The last number written in `text` (thousands separators allowed: `1,234.5`); None when there is none."""
    numbers = _NUMBER.findall(text)
    if not numbers:
        return None
    value = float(numbers[-1].replace(",", ""))
    return value if math.isfinite(value) else None


def numeric(answer: str, expected: str, grader: GraderSettings) -> float:
    """The last number of the answer (or of `pattern`'s first group, or whole match) is within `tolerance` of the
    expected answer's last number (so a GSM8K answer `... #### 72` works as it is)."""
    if grader.pattern is not None:
        found = re.search(grader.pattern, answer, re.DOTALL)
        if found is None:
            return 0.0
        answer = (found.group(1) if found.re.groups else found.group(0)) or ""
    got, want = last_number(answer), last_number(expected)
    return float(got is not None and want is not None and abs(got - want) <= grader.tolerance)


def f1(answer: str, expected: str, grader: GraderSettings) -> float:
    """SQuAD's token F1: the harmonic mean of the precision and recall of the answer's tokens against the expected
    answer's (tokens counted with their repeats)."""
    answer_tokens, expected_tokens = _prepared(answer, grader).split(), _prepared(expected, grader).split()
    common = sum((Counter(answer_tokens) & Counter(expected_tokens)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(answer_tokens), common / len(expected_tokens)
    return 2 * precision * recall / (precision + recall)


BUILTIN_GRADERS: dict[str, Callable[[str, str, GraderSettings], float]] = {
    "exact_match": exact_match, "contains": contains, "regex": regex, "numeric": numeric, "f1": f1,
}


def expected_text(expected: object) -> str:
    """A row's expected answer as text (a task file may give a number)."""
    if isinstance(expected, float) and expected.is_integer():
        return str(int(expected))
    return str(expected)


def grade_builtin(grader: GraderSettings, answers: list[str], expected: list[object]) -> list[float]:
    """The scores of `answers` against the rows' `expected` answers by the built-in `grader`."""
    function = BUILTIN_GRADERS[grader.kind]
    return [function(answer, expected_text(want), grader) for answer, want in zip(answers, expected, strict=True)]
