"""A preflight check's verdict, and the table and summary line the checks make together."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

from pydantic import BaseModel, Field

Status = Literal["ok", "warn", "FAIL"]

NAME_WIDTH = 28
"""Width of the check-name column in the printed lines (the longest name, `runpod key: network volumes`)."""

class Check(BaseModel):
    """One line of the preflight."""

    name: str = Field(description="What was checked, e.g. `runpod key: endpoints` or `gpu RTX 4090: cuda`.")
    status: Status = Field(
        description="ok; warn: a run can go ahead, but not as well as it could (a GPU it would skip, a static price, "
        "a figure that could not be read); FAIL: a run would be refused, or would fail after renting."
    )
    found: str = Field(description="What the check found, in one line.")
    fix: str | None = Field(default=None, description="What to do about a warn or a FAIL; None for ok.")

    def line(self) -> str:
        """`STATUS  name  found — fix: ...`, on one line."""
        text = f"{self.status:<4}  {self.name:<{NAME_WIDTH}}  {_one_line(self.found)}"
        return f"{text} — fix: {_one_line(self.fix)}" if self.fix else text


def _one_line(text: str) -> str:
    return " ".join(text.split())


def guarded(name: str, check: Callable[[], Check | list[Check]]) -> list[Check]:
    """The check's lines; an error it raises becomes its FAIL line, so one broken check never hides the others.

    Catching every exception is the point here: the preflight reports what went wrong instead of stopping at it.
    """
    try:
        result = check()
    except Exception as e:  # any kind: see the docstring
        return [Check(name=name, status="FAIL", found=f"the check itself failed: {type(e).__name__}: {e}",
                      fix="read the error; a transient one (a timeout, a 5xx) passes when the preflight runs again")]
    return result if isinstance(result, list) else [result]


def failed(checks: Sequence[Check]) -> list[Check]:
    return [c for c in checks if c.status == "FAIL"]


def summary(checks: Sequence[Check]) -> str:
    """`12 checks: 9 ok, 2 warn, 1 FAIL (worker image)`."""
    counts = {s: sum(c.status == s for c in checks) for s in ("ok", "warn", "FAIL")}
    text = f"{len(checks)} checks: {counts['ok']} ok, {counts['warn']} warn, {counts['FAIL']} FAIL"
    return text + (f" ({', '.join(c.name for c in failed(checks))})" if counts["FAIL"] else "")


def table_rows(checks: Sequence[Check]) -> list[dict[str, str]]:
    """The Prefect table artifact's rows."""
    return [{"status": c.status, "check": c.name, "found": c.found, "fix": c.fix or ""} for c in checks]
