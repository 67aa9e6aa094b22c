"""Removing secrets from text that leaves the worker (job errors, console tails, progress messages)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

from loraflow_worker.runtime.environment import is_secret_name

REDACTED = "***"

# Shorter values (flags like "1", "true") would blank out ordinary words; real secrets are longer.
_MIN_SECRET_LENGTH = 8
# Token shapes redacted even when the token is in no environment variable (read from a file, say):
# Hugging Face user/org tokens, RunPod API keys, and the password in a URL's user info.
_TOKEN_SHAPES = re.compile(r"\bhf_[A-Za-z0-9]{30,}|\brpa_[A-Za-z0-9]{20,}|(?<=://)[^/\s:@]+:[^/\s@]+(?=@)")


def redact_secrets(text: str, env: Mapping[str, str] | None = None, secret_names: Iterable[str] = ()) -> str:
    """`text` with every secret replaced by `***`: the values of the secret-looking variables of `env`
    (default: this process's environment; the forwarded credentials HF_TOKEN and WANDB_API_KEY are among
    them), the values of the variables `secret_names` names whatever their names look like (a job's
    `worker_secret_names`: the run's own secrets), and known token shapes."""
    for value in secret_values(env, secret_names):
        text = text.replace(value, REDACTED)
    return _TOKEN_SHAPES.sub(REDACTED, text)


def secret_values(env: Mapping[str, str] | None = None, secret_names: Iterable[str] = ()) -> list[str]:
    """The values `redact_secrets` removes from text (token shapes aside), longest first: a secret that contains
    another is then removed whole."""
    env = os.environ if env is None else env
    named = set(secret_names)
    # A run's own secret is redacted whatever its length: it was declared a secret (the control plane refuses short ones).
    secrets = {value for name, value in env.items()
               if (name in named and value) or (is_secret_name(name) and len(value) >= _MIN_SECRET_LENGTH)}
    return sorted(secrets, key=len, reverse=True)


def redact_record(value: Any, secret_names: Iterable[str] = ()) -> Any:
    """`value` (JSON-like: texts in dicts and lists) with every text in it redacted (`redact_secrets`): before JSON
    escapes a secret's characters."""
    if isinstance(value, str):
        return redact_secrets(value, secret_names=secret_names)
    if isinstance(value, dict):
        return {key: redact_record(item, secret_names) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact_record(item, secret_names) for item in value]
    return value
