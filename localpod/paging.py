"""Pages of a list answer, as RunPod's newer API docs describe them: `cursor` and `limit` query parameters
(limit 1000 by default), and `pagination: {nextCursor}` in the answer while more items follow.

The vendored OpenAPI document predates pagination; its list responses (`ListEndpointsResponse`,
`ListNetworkVolumesResponse`) do not forbid other properties, so an answer with `pagination` still matches
them. A cursor here is the offset of the page's first item: opaque to clients, as RunPod's is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

from fastapi import Request

from localpod.problems import ProblemError

DEFAULT_PAGE_SIZE = 1000
"""RunPod's page size when a list request sets no `limit`."""

T = TypeVar("T")


def page(items: Sequence[T], request: Request, page_size: int) -> tuple[list[T], dict[str, Any]]:
    """The items of the page the request asks for, and the fields to add to the answer: `pagination` with the
    next page's cursor while items remain, nothing on the last page. `limit` above `page_size` is cut to it."""
    start = _whole(request, "cursor", default=0, low=0)
    size = min(_whole(request, "limit", default=page_size, low=1), page_size)
    if start > len(items):
        raise ProblemError(400, f"cursor {start} is past the list's end ({len(items)} items): start again without "
                                "a cursor")
    end = start + size
    return list(items[start:end]), ({"pagination": {"nextCursor": str(end)}} if end < len(items) else {})


def _whole(request: Request, name: str, *, default: int, low: int) -> int:
    text = request.query_params.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        value = low - 1
    if value < low:
        raise ProblemError(400, f"{name}: {text!r} is not valid: give a whole number of at least {low}, or omit it")
    return value
