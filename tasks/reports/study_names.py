"""How a study names its children and shows their values: in run names (`sweep-lr0p0001-s2`), in the table and log
(`training.learning_rate=0.0001, training.seed=2`) and in refusals (`child 2 (...)`)."""

from __future__ import annotations

import re
from typing import Any

NAME_MAX = 40  # RunSpec.name's limit: it is part of the endpoint names
_NAME_PART = re.compile(r"[^a-z0-9]+")


def child_name(study: str, varied: dict[str, Any], index: int, taken: set[str]) -> str:
    """`<study>-<field><value>-...`, each varied field by its last part's initials (`training.learning_rate` is
    `lr`, `training.seed` `s`); `<study>-c<index>` when that is longer than a run name may be, or taken, or nothing
    varies (a search's children, whose values are Optuna's, are numbered)."""
    parts = [study]
    for path, value in varied.items():
        parts.append(_short_field(path) + _name_value(value))
    name = "-".join(parts)
    if len(name) > NAME_MAX or name in taken or not varied:
        name = f"{study[:NAME_MAX - len(str(index)) - 2]}-c{index}"
    return name


def _short_field(path: str) -> str:
    last = path.split(".")[-1]
    return "".join(word[0] for word in last.split("_") if word)


def _name_value(value: Any) -> str:
    if isinstance(value, float):  # 0.0003 → 0p0003, 1e-05 → 1em05: no dot in a run name, and no two values alike
        return f"{value:g}".replace(".", "p").replace("e-", "em").replace("e+", "e")
    return _NAME_PART.sub("-", _value_text(value).lower()).strip("-") or "x"


def _value_text(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}".replace("+", "")
    if isinstance(value, list):
        return "-".join(_value_text(v) for v in value)
    return str(value)


def describe_values(values: dict[str, Any]) -> str:
    """`training.learning_rate=0.0001, training.seed=2`: a child's values as the study's table and log show them."""
    return ", ".join(f"{path}={_value_text(value)}" for path, value in values.items())


def child_label(index: int, values: dict[str, Any]) -> str:
    """`child 2 (training.learning_rate=0.0001)`: a child as the study's refusals name it."""
    return f"child {index} ({describe_values(values) or 'the run spec'})"
