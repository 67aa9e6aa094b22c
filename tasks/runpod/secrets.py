"""The Hub token reaches workers as a RunPod account secret, never as a value in an endpoint's env.

An endpoint's env is returned by every `GET /v2/serverless` and shown in RunPod's console to everyone
on the account. An account secret is write-only; the env refers to it as `{{ RUNPOD_SECRET_<name> }}`
and RunPod puts the value in when a worker boots.

RunPod never returns a secret's value, so whether the stored value is the current token is told by a
fingerprint (a truncated SHA-256) kept in the secret's description.
"""

from __future__ import annotations

import hashlib
import logging

from tasks.runpod import errors
from tasks.runpod.client import RunpodClient
from tasks.runpod.models import CreateSecret, Secret, UpdateSecret

log = logging.getLogger("loraflow.secrets")


def secret_reference(name: str) -> str:
    """What an env value holds to receive the account secret `name` at worker boot."""
    return f"{{{{ RUNPOD_SECRET_{name} }}}}"


def fingerprint(value: str) -> str:
    """Tells two values apart without revealing either: 16 hex digits of SHA-256."""
    return hashlib.sha256(value.encode()).hexdigest()[:16]


def _description(value: str) -> str:
    return f"Hugging Face token for loraflow workers (sha256 {fingerprint(value)})"


def find_secret(client: RunpodClient, name: str) -> Secret | None:
    return next((s for s in client.list_secrets() if s.name == name), None)


def ensure_secret(client: RunpodClient, name: str, value: str) -> Secret:
    """The account secret `name` holds `value` afterwards: created when missing, its value rotated when
    the fingerprint in its description differs (RunPod applies a new value when a worker next boots, so
    workers already running keep the token they booted with). Safe to call again, and against another
    process creating the same secret at the same moment."""
    wanted = _description(value)
    secret = find_secret(client, name)
    if secret is None:
        try:
            return client.create_secret(CreateSecret(name=name, value=value, description=wanted))
        except errors.ConflictError:
            secret = find_secret(client, name)  # created meanwhile by another run
            if secret is None:
                raise
    if secret.description != wanted:
        log.info("Rotating RunPod secret %s to the current Hugging Face token", name)
        secret = client.update_secret(secret.id, UpdateSecret(value=value, description=wanted))
    return secret


def hub_token_env(client: RunpodClient, secret_name: str, token: str | None) -> dict[str, str]:
    """The worker env entry that gives it the Hub token: `HF_TOKEN` referring to the account secret
    `secret_name`, first stored from `token` when one is known here; without a token here, an existing
    secret of that name (made in RunPod's console) is used; with neither, no token."""
    if token is not None:
        ensure_secret(client, secret_name, token)
    elif find_secret(client, secret_name) is None:
        return {}
    return {"HF_TOKEN": secret_reference(secret_name)}
