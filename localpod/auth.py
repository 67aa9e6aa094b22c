"""Who may call what: the account's bearer key for the control plane and job API, and per-worker
keys for the worker protocol."""

from __future__ import annotations

import hmac

from fastapi import Request

from localpod.problems import ProblemError
from localpod.state.account import get_state


def require_api_key(request: Request) -> None:
    """FastAPI dependency: the request must carry `Authorization: Bearer <account key>`."""
    header = request.headers.get("authorization")
    if not header:
        raise ProblemError(401, "missing bearer token")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise ProblemError(401, "malformed bearer token")
    if not hmac.compare_digest(token.strip().encode(), get_state(request).config.api_key.encode()):
        raise ProblemError(401, "invalid bearer token")


def presented_key(request: Request) -> str | None:
    """The key a worker sent. runpod 1.12 workers send the raw key (`Authorization: <key>`, no
    scheme); a `Bearer` prefix is accepted too."""
    header = request.headers.get("authorization", "").strip()
    if not header:
        return None
    scheme, _, rest = header.partition(" ")
    return rest.strip() if scheme.lower() == "bearer" and rest.strip() else header


def keys_match(presented: str | None, expected: str) -> bool:
    return presented is not None and hmac.compare_digest(presented.encode(), expected.encode())
