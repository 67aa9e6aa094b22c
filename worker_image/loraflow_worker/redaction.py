"""Removing secrets from text that leaves the worker (job errors, console tails)."""

from __future__ import annotations

import os
import re

REDACTED = "***"

# HF_TOKEN, HUGGING_FACE_HUB_TOKEN, RUNPOD_AI_API_KEY, RUNPOD_API_KEY, AWS_SECRET_ACCESS_KEY, ...
_SECRET_NAME = re.compile(r"TOKEN|SECRET|KEY|PASSWORD", re.IGNORECASE)
# Shorter values (flags like "1", "true") would blank out ordinary words; real secrets are longer.
_MIN_SECRET_LENGTH = 8


def redact_secrets(text: str) -> str:
    """`text` with the value of every secret-looking environment variable replaced by `***`."""
    secrets = [
        value
        for name, value in os.environ.items()
        if _SECRET_NAME.search(name) and len(value) >= _MIN_SECRET_LENGTH
    ]
    # Longest first, so a secret that contains another is removed whole.
    for value in sorted(secrets, key=len, reverse=True):
        text = text.replace(value, REDACTED)
    return text
