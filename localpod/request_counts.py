"""`GET /_localpod/requests`: how many requests each route has served since the server started, for the
benchmarks' request rates (the control plane's polls, the workers' pings and job-takes). Not part of
RunPod's API, so it needs no key. `DELETE` starts the counts again.

Counted by a plain ASGI wrapper around the app (cheaper than Starlette's `BaseHTTPMiddleware`, which
would add a task per request to a server the benchmarks load on purpose).
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from fastapi import APIRouter, Request

router = APIRouter(prefix="/_localpod", tags=["localpod"])


class RequestCounts:
    """Requests served per `METHOD route-template`, since `since` (Unix time)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.since = time.time()

    def reset(self) -> None:
        self.counts, self.since = Counter(), time.time()


class CountRequests:
    """ASGI middleware: after each HTTP request, count it under the route the router matched."""

    def __init__(self, app: Any, counts: RequestCounts) -> None:
        self.app, self.counts = app, counts

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        try:
            await self.app(scope, receive, send)
        finally:
            if scope["type"] == "http":
                route = getattr(scope.get("route"), "path", "(no route)")  # set in place by Starlette's router
                self.counts.counts[f"{scope['method']} {route}"] += 1


@router.get("/requests")
async def get_requests(request: Request) -> dict[str, Any]:
    counts: RequestCounts = request.app.state.request_counts
    return {"since": counts.since, "now": time.time(), "total": sum(counts.counts.values()),
            "by_route": dict(counts.counts.most_common())}


@router.delete("/requests", status_code=204)
async def reset_requests(request: Request) -> None:
    request.app.state.request_counts.reset()
