"""Values reach workers as RunPod account secrets, one secret per distinct value, never as a value in an
endpoint's env.

An endpoint's env is returned by every `GET /v2/serverless` and shown in RunPod's console to everyone on
the account. An account secret is write-only; the env refers to it as `{{ RUNPOD_SECRET_<name> }}` and
RunPod puts the value in when a worker boots.

An account is shared by people whose values differ (each has their own Hub token), and a secret given a
new value hands every worker that boots later the new one, a teammate's running or retried run included.
So a secret's name carries its value's fingerprint, `loraflow-<purpose>-<namespace>-<fingerprint>`: two
values are two secrets, one value is one secret whoever stores it, and no secret ever changes its value. The
fingerprint is an HMAC of the value keyed per namespace (the caller passes the key: `tasks/lifecycle/secret_key.py`
keeps it), so that someone who can list the account's secrets cannot test a guess of a value against its name.
Secrets of a namespace that no endpoint refers to and no run used within the retention are deleted
(`prune_unused_secrets`); a later run with the same value creates its secret again.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta
from typing import Literal, NamedTuple

from pydantic import BaseModel, Field

from tasks.runpod import errors
from tasks.runpod.client import RunpodClient
from tasks.runpod.endpoints import NAMESPACE_PATTERN
from tasks.runpod.models import RUNPOD_MAX_JOB_TTL_S, CreateSecret, Secret

SECRET_PREFIX = "loraflow-"
"""Every account secret loraflow creates starts with this; pruning never touches any other."""
MAX_SECRET_NAME = 191
"""RunPod's longest secret name (its API v2 reference: 1-191 of letters, digits and `_.-/`, not starting with
a digit or with RUNPOD)."""
PURPOSE_PATTERN = r"[a-z0-9]+(?:-[a-z0-9]+)*"
"""What a secret is for, in its name: e.g. `hf-token`."""
HUB_TOKEN_PURPOSE = "hf-token"
FINGERPRINT_HEX = 16
"""Hex digits of the fingerprint kept in a name: 64 bits tell a namespace's values apart."""

LONGEST_RUN = timedelta(seconds=RUNPOD_MAX_JOB_TTL_S)
"""A run stores its secrets when it starts, and its endpoints refer to them until its deadline, at most RunPod's
7-day job TTL; between two attempts (a slot wait) no endpoint refers to them. Pruning keeps every secret used
within this long, whatever the retention asked."""

_NAME = re.compile(
    rf"^{SECRET_PREFIX}(?P<purpose>{PURPOSE_PATTERN})-(?P<namespace>{NAMESPACE_PATTERN})"
    rf"-(?P<fingerprint>[0-9a-f]{{{FINGERPRINT_HEX}}})$"
)
# The one secret per control plane of before, its value rotated by whoever ran last: pruned like the others.
_ROTATED_NAME = re.compile(rf"^{SECRET_PREFIX}{HUB_TOKEN_PURPOSE}-(?P<namespace>{NAMESPACE_PATTERN})$")
# RunPod's reference syntax; the name's characters as RunPod allows them.
_REFERENCE = re.compile(r"\{\{\s*RUNPOD_SECRET_([a-zA-Z_][a-zA-Z0-9_.\-/]*)\s*\}\}")


class SecretName(NamedTuple):
    """What a loraflow secret's name says about it."""

    purpose: str
    namespace: str
    fingerprint: str | None
    """None for a name from before one secret per value (`loraflow-hf-token-<namespace>`). Names from before the
    keyed fingerprint (a plain SHA-256 prefix) look the same: they are recognised, and pruned once unused."""


def secret_reference(name: str) -> str:
    """What an env value holds to receive the account secret `name` at worker boot."""
    return f"{{{{ RUNPOD_SECRET_{name} }}}}"


def referenced_secrets(env: Mapping[str, str]) -> set[str]:
    """The names of the account secrets an env refers to."""
    return {name for text in env.values() for name in _REFERENCE.findall(text)}


def fingerprint(value: str, key: bytes) -> str:
    """Tells two values apart without revealing either, nor letting a guess of one be tested without `key`: 16 hex
    digits of HMAC-SHA256 of `value` keyed with `key` (the namespace's)."""
    return hmac.new(key, value.encode(), hashlib.sha256).hexdigest()[:FINGERPRINT_HEX]


def value_secret_name(purpose: str, namespace: str, value: str, *, key: bytes) -> str:
    """`loraflow-<purpose>-<namespace>-<fingerprint of value under key>`: the secret that holds `value`."""
    if not re.fullmatch(PURPOSE_PATTERN, purpose):
        raise ValueError(f"secret purpose {purpose!r} must be lowercase letters and digits in dash-separated words")
    if not re.fullmatch(NAMESPACE_PATTERN, namespace):
        raise ValueError(f"namespace {namespace!r} must match {NAMESPACE_PATTERN}")
    if not key:
        raise ValueError("the key of the secret names is empty: pass the namespace's key "
                         "(`tasks.lifecycle.secret_key.secret_name_key`)")
    name = f"{SECRET_PREFIX}{purpose}-{namespace}-{fingerprint(value, key)}"
    if len(name) > MAX_SECRET_NAME:
        raise ValueError(f"secret purpose {purpose!r} is too long: the name {name!r} exceeds RunPod's "
                         f"{MAX_SECRET_NAME} characters")
    return name


def parse_secret_name(name: str) -> SecretName | None:
    """The parts of a name loraflow gives its secrets; None for any other name."""
    if match := _NAME.match(name):
        return SecretName(match["purpose"], match["namespace"], match["fingerprint"])
    if match := _ROTATED_NAME.match(name):
        return SecretName(HUB_TOKEN_PURPOSE, match["namespace"], None)
    return None


def find_secret(client: RunpodClient, name: str) -> Secret | None:
    return next((s for s in client.list_secrets() if s.name == name), None)


def ensure_value_secret(client: RunpodClient, name: str, value: str, description: str) -> Secret:
    """The account secret `name`, created with `value` when missing. An existing one is never changed: its
    name carries its value's fingerprint. Safe to call again, and against another process creating the
    same secret at the same moment."""
    secret = find_secret(client, name)
    if secret is not None:
        return secret
    try:
        return client.create_secret(CreateSecret(name=name, value=value, description=description))
    except errors.ConflictError:
        secret = find_secret(client, name)  # created meanwhile by another run with the same value
        if secret is None:
            raise
        return secret


def value_secret_env(client: RunpodClient, env_name: str, value: str, *, purpose: str, namespace: str,
                     key: bytes) -> dict[str, str]:
    """The worker env entry that gives it `value` under `env_name`: `{env_name: "{{ RUNPOD_SECRET_<name> }}"}`,
    the secret `loraflow-<purpose>-<namespace>-<fingerprint>` (keyed with the namespace's `key`) created first when
    missing."""
    name = value_secret_name(purpose, namespace, value, key=key)
    ensure_value_secret(client, name, value, description=f"loraflow {purpose} for {env_name} (its name's fingerprint: "
                                                         "HMAC-SHA256 keyed per namespace); never changed")
    return {env_name: secret_reference(name)}


class SecretVerdict(BaseModel):
    """What pruning did with one of the namespace's secrets, and why."""

    name: str = Field(description="The secret's name.")
    secret_id: str = Field(description="RunPod's id of the secret.")
    last_used: datetime | None = Field(
        description="Its newest recorded use, else its creation; None when RunPod reported neither.")
    action: Literal["kept", "deleted", "would delete", "delete failed"] = Field(
        description="`would delete`: a dry run's deletion.")
    reason: str = Field(description="Why, with the figures.")


def prune_unused_secrets(client: RunpodClient, namespace: str, *, retain_days: float, now: datetime,
                         last_used: Mapping[str, datetime], dry_run: bool = False) -> list[SecretVerdict]:
    """Delete the secrets of `namespace` that no endpoint of the account refers to and that were neither
    used (`last_used`: name → newest use, e.g. `tasks.lifecycle.secret_retention.newest_secret_uses`) nor created
    within `retain_days` (at least `LONGEST_RUN`). Another namespace's secrets and names loraflow did not
    make are never touched. A 404 on delete counts as deleted. One verdict per secret of the namespace.

    The secrets are listed before the endpoints, so a secret an endpoint created meanwhile refers to was
    used (recorded) before that endpoint existed."""
    ours = [s for s in client.list_secrets() if (parsed := parse_secret_name(s.name)) and parsed.namespace == namespace]
    if not ours:
        return []
    referenced = set().union(*(referenced_secrets(e.env) for e in client.list_endpoints()))
    keep_for = max(timedelta(days=retain_days), LONGEST_RUN)
    verdicts = []
    for secret in ours:
        used = _newest(last_used.get(secret.name), _created(secret))
        if secret.name in referenced:
            action, reason = "kept", "an endpoint's env refers to it"
        elif used is None:
            action, reason = "kept", "RunPod reports no creation time and no use is recorded: its age is unknown"
        elif now - used < keep_for:
            action, reason = "kept", f"used or created {_days(now - used)} ago, within the retention of {_days(keep_for)}"
        elif dry_run:
            action, reason = "would delete", f"unused for {_days(now - used)} (retention {_days(keep_for)})"
        else:
            action, reason = _delete(client, secret.id, now - used, keep_for)
        verdicts.append(SecretVerdict(name=secret.name, secret_id=secret.id, last_used=used, action=action,
                                      reason=reason))
    return verdicts


def _delete(client: RunpodClient, secret_id: str, idle: timedelta,
            keep_for: timedelta) -> tuple[Literal["deleted", "delete failed"], str]:
    try:
        client.delete_secret(secret_id)
    except errors.NotFoundError:
        pass  # gone already: what the delete was for
    except errors.RunpodError as e:
        return "delete failed", f"unused for {_days(idle)}, but the delete failed: {e}"
    return "deleted", f"unused for {_days(idle)} (retention {_days(keep_for)})"


def _created(secret: Secret) -> datetime | None:
    try:
        return datetime.fromisoformat(secret.created_at) if secret.created_at else None
    except ValueError:  # a format this parser does not know: treated as unknown, which keeps the secret
        return None


def _newest(*times: datetime | None) -> datetime | None:
    known: Iterable[datetime] = [t for t in times if t is not None]
    return max(known, default=None)


def _days(span: timedelta) -> str:
    return f"{span.total_seconds() / 86400:.1f} days"
