"""The RunPod error tree. `client.raise_for_status` is the only place that builds these from responses."""

from __future__ import annotations

import re


class RunpodError(Exception):
    """Anything that went wrong talking to RunPod or running a job there."""


class RunpodAPIError(RunpodError):
    """RunPod answered with an error status."""

    def __init__(self, message: str, *, status: int, body: str = "", request_id: str | None = None):
        super().__init__(message)
        self.status = status
        self.body = body
        self.request_id = request_id


class BadRequestError(RunpodAPIError):
    """400/422: RunPod refused the request as invalid. Not transient: fix the request."""


class AuthError(RunpodAPIError):
    """401/403: the API key is missing, wrong or lacks access."""


class NotFoundError(RunpodAPIError):
    """404: the resource does not exist (for a delete, that is success)."""


class ConflictError(RunpodAPIError):
    """409: the request conflicts with the resource's current state."""


class RateLimitError(RunpodAPIError):
    """429: too many requests. Transient."""

    def __init__(self, message: str, *, retry_after: float | None = None, **kwargs):
        super().__init__(message, **kwargs)
        self.retry_after = retry_after


class ServerError(RunpodAPIError):
    """5xx: RunPod failed. Transient."""


class RunpodConnectionError(RunpodError):
    """The request did not get an answer (DNS, refused, reset). Transient."""


class RunpodTimeoutError(RunpodConnectionError):
    """The request timed out. Transient; for a create or a submit the outcome is unknown."""


class QuotaExceededError(BadRequestError):
    """The account's worker quota (sum of `workers.max` over all endpoints) would be exceeded. Not
    transient in the retry sense (an immediate retry fails the same way), but it passes once other
    endpoints go: runs wait for it (`tasks.lifecycle.quota.wait_for_runpod_quota`) rather than fail."""

    @property
    def quota(self) -> int | None:
        """The quota RunPod named (`... quota (30)` or `... quota of 10`), if it did."""
        return named_quota(f"{self} {self.body}")


# RunPod words its quota refusal two ways (issue 37): "Max workers across all endpoints must not exceed your workers
# quota (30)" and "Max workers across all endpoints will exceed your worker quota of 10 ... at most 9".
_QUOTA_REFUSAL = re.compile(r"exceed your workers? quota(?:\s*\((?P<paren>\d+)\)|\s+of\s+(?P<of>\d+))?",
                            re.IGNORECASE)


def is_quota_refusal(text: str) -> bool:
    """Whether RunPod's answer text is its worker-quota refusal, in either wording."""
    return _QUOTA_REFUSAL.search(text) is not None


def named_quota(text: str) -> int | None:
    """The quota a quota refusal names, the number after `quota` (`quota (30)`, `quota of 10`); None if none."""
    match = _QUOTA_REFUSAL.search(text)
    number = match and (match.group("paren") or match.group("of"))
    return int(number) if number else None


class EndpointMismatchError(RunpodError):
    """RunPod made an endpoint unlike the request (`tasks.runpod.endpoint_match`); it was deleted. Not transient:
    the same request would be answered the same way."""

    def __init__(self, message: str, *, endpoint_id: str, differences: list[str]):
        super().__init__(message)
        self.endpoint_id = endpoint_id
        self.differences = differences


class JobFailedError(RunpodError):
    """The job ran and failed: the training failed, not the API. Carries the worker's error text."""

    def __init__(self, message: str, *, job_id: str, status: str, error: str | None, console_tail: str | None = None):
        super().__init__(message)
        self.job_id = job_id
        self.status = status
        self.error = error
        self.console_tail = console_tail


TRANSIENT_ERRORS: tuple[type[Exception], ...] = (RateLimitError, ServerError, RunpodConnectionError)
"""The one definition of "worth retrying": 429, 5xx, transport errors and timeouts."""


def is_transient(exc: BaseException) -> bool:
    return isinstance(exc, TRANSIENT_ERRORS)
