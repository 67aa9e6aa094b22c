"""`/_hub/commit-faults`: a test hook (not Hub API) of the Hub stand-in that arms a repo's next commit
requests to be refused with 429, 5xx or 403, so a test meets the Hub's bad days without making 128 commits.

The hourly commit limit itself is counted where commits are applied (`HubRepos.commit`, under its lock).
Both refuse before anything is applied, so a refused commit changes nothing in the repo.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Literal

from fastapi import APIRouter, Response
from pydantic import BaseModel, ConfigDict, Field

from localpod.hub.repos import RATE_LIMIT_MESSAGE, HubError, HubRepos, RepoRef

CommitFaultStatus = Literal[403, 429, 500, 502, 503, 504]

# The text sent with each status (500's is the Hub's own; 502-504 come from its front proxies). 403 goes
# without X-Error-Code, so the client raises a plain HfHubHTTPError, as for the Hub's own 403s (§8).
_FAULT_MESSAGES = {
    403: "You don't have the rights to commit to this repo: check that the token has write access.",
    500: "Internal Error - We're working hard to fix this as soon as possible!",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
}


class CommitFaultRule(BaseModel):
    """Body of `POST /_hub/commit-faults/{repo_type}/{namespace}/{name}`: the repo's next `count` commit
    requests are refused with `status`. Rules queue up in the order they were posted."""

    model_config = ConfigDict(extra="forbid")
    status: CommitFaultStatus = Field(
        description="429: the commit rate limit's answer; 500/502/503/504: a bad day at the Hub; 403: a token "
        "without write access (not transient: a client must not retry it)."
    )
    count: int = Field(default=1, ge=1, le=1000, description="How many commit requests in a row get this answer.")
    retry_after_s: int | None = Field(
        default=None, ge=0, le=3600,
        description="Sent as the `Retry-After` header (whole seconds, as HTTP has it); omitted: no header.",
    )


class ArmedCommitFault(CommitFaultRule):
    """A queued rule, `count` being what is left of it."""


class CommitFaultQueue(BaseModel):
    """What `/_hub/commit-faults/...` answers: the repo's armed refusals, next first."""

    repo: str = Field(description="`namespace/name`.")
    armed: list[ArmedCommitFault] = Field(description="Rules still to fire, in order.")


class CommitFaults:
    """Armed commit refusals per repo, in memory: a restarted stand-in has none. Thread-safe."""

    def __init__(self, commits_per_hour: int):
        self.commits_per_hour = commits_per_hour
        self._lock = threading.Lock()
        self._queues: dict[str, deque[ArmedCommitFault]] = {}

    def arm(self, ref: RepoRef, rule: CommitFaultRule) -> None:
        with self._lock:
            self._queues.setdefault(ref.url_prefix, deque()).append(ArmedCommitFault(**rule.model_dump()))

    def armed(self, ref: RepoRef) -> list[ArmedCommitFault]:
        with self._lock:
            return [fault.model_copy() for fault in self._queues.get(ref.url_prefix, ())]

    def clear(self, ref: RepoRef) -> None:
        with self._lock:
            self._queues.pop(ref.url_prefix, None)

    def check(self, ref: RepoRef) -> None:
        """Called by every commit request before anything is applied: raises the next armed refusal, if any."""
        with self._lock:
            queue = self._queues.get(ref.url_prefix)
            if not queue:
                return
            fault = queue[0]
            fault.count -= 1
            if fault.count == 0:
                queue.popleft()
        headers = {"Retry-After": str(fault.retry_after_s)} if fault.retry_after_s is not None else {}
        if fault.status == 429:
            raise HubError(429, RATE_LIMIT_MESSAGE.format(n=self.commits_per_hour), headers=headers)
        raise HubError(fault.status, _FAULT_MESSAGES[fault.status], headers=headers)


def commit_faults_router(faults: CommitFaults, repos: HubRepos) -> APIRouter:
    """`/_hub/commit-faults/{repo_type}/{namespace}/{name}`: POST a `CommitFaultRule` to queue refusals,
    GET to see what is left, DELETE to disarm. `repo_type` is `dataset`, `model` or `space` (or plural)."""
    router = APIRouter(prefix="/_hub/commit-faults", tags=["hub stand-in test hooks"])

    def existing(repo_type: str, namespace: str, name: str) -> RepoRef:
        ref = RepoRef.of(repo_type, namespace, name)
        repos.state(ref)  # a typo in a test should fail here, not leave a rule that never fires
        return ref

    def queue(ref: RepoRef) -> CommitFaultQueue:
        return CommitFaultQueue(repo=ref.id, armed=faults.armed(ref))

    @router.post("/{repo_type}/{namespace}/{name}", status_code=201)
    async def arm(repo_type: str, namespace: str, name: str, rule: CommitFaultRule) -> CommitFaultQueue:
        ref = existing(repo_type, namespace, name)
        faults.arm(ref, rule)
        return queue(ref)

    @router.get("/{repo_type}/{namespace}/{name}")
    async def armed(repo_type: str, namespace: str, name: str) -> CommitFaultQueue:
        return queue(existing(repo_type, namespace, name))

    @router.delete("/{repo_type}/{namespace}/{name}", status_code=204)
    async def disarm(repo_type: str, namespace: str, name: str) -> Response:
        faults.clear(existing(repo_type, namespace, name))
        return Response(status_code=204)

    return router
