"""Installing a job's extra pip packages before its training process starts.

Transient index failures (connection errors, timeouts, HTTP 429/5xx) are retried with backoff; anything
else (no such package, no matching version, a conflict) fails at once with pip's own error lines. The
image's training stack is held at its installed versions with a constraints file, so an extra package
cannot replace torch under the trainer.

Tests and air-gapped images pass pip options through `LORAFLOW_PIP_ARGS`, e.g.
`--no-index --find-links /wheels`.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from loraflow_worker.runtime.environment import is_secret_name, off_the_volume

PIP_ARGS_ENV = "LORAFLOW_PIP_ARGS"
"""Extra pip options (shell syntax) for every install, e.g. `--no-index --find-links /wheels`."""
ATTEMPTS = 3
BACKOFF_S = (10.0, 30.0)
"""Waits before the second and third attempt."""
PINNED = ("torch", "transformers", "trl", "peft", "accelerate", "datasets", "tokenizers", "vllm", "runpod",
          "pydantic", "huggingface_hub")
"""Packages an extra package may not upgrade or downgrade (those of them that are installed)."""

# pip at -vv logs each HTTP response (urllib3) and each connection retry; at its default verbosity an
# index answering 503 looks exactly like a package that does not exist ("from versions: none").
_TRANSIENT = re.compile(
    r'HTTP/1\.1" (?:429|5\d\d)|too many (?:429|5\d\d) error responses|Retrying \(Retry\(|NewConnectionError|'
    r"ConnectTimeoutError|ReadTimeoutError|Read timed out|Connection reset|Connection aborted|"
    r"Temporary failure in name resolution|IncompleteRead"
)
_ERROR_LINES = 15

log = logging.getLogger("loraflow_worker")


class PackageInstallError(RuntimeError):
    """The job's extra packages could not be installed; the message carries pip's error lines."""


def install_extra_packages(requirements: Sequence[str], work_dir: Path, *,
                           backoff_s: Sequence[float] = BACKOFF_S) -> None:
    """pip-install `requirements` into this interpreter's environment; returns when they are installed.
    Nothing happens for an empty list."""
    if not requirements:
        return
    constraints = work_dir / "pip-constraints.txt"
    constraints.write_text("".join(f"{name}=={version}\n" for name, version in _installed(PINNED).items()))
    command = [sys.executable, "-m", "pip", "install", "-vv", "--disable-pip-version-check", "--no-input",
               "--progress-bar", "off", "--constraint", str(constraints),
               *shlex.split(os.environ.get(PIP_ARGS_ENV, "")), *requirements]
    env = {name: value for name, value in off_the_volume(os.environ).items() if not is_secret_name(name)}
    for attempt in range(1, ATTEMPTS + 1):
        started = time.monotonic()
        done = subprocess.run(command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, errors="replace", check=False)
        if done.returncode == 0:
            log.info("installed %s in %.0f s", " ".join(requirements), time.monotonic() - started)
            return
        transient = bool(_TRANSIENT.search(done.stdout))
        if not transient or attempt == ATTEMPTS:
            kind = "the package index kept failing" if transient else "pip could not install them"
            raise PackageInstallError(
                f"extra_packages {list(requirements)}: {kind} (attempt {attempt} of {ATTEMPTS}):\n"
                + _error_lines(done.stdout)
            )
        wait = backoff_s[min(attempt - 1, len(backoff_s) - 1)]
        log.warning("pip install failed with a transient index error (attempt %d of %d); retrying in %.0f s",
                    attempt, ATTEMPTS, wait)
        time.sleep(wait)


def _installed(names: Sequence[str]) -> dict[str, str]:
    versions = {}
    for name in names:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def _error_lines(output: str) -> str:
    """pip's own error lines (at -vv the rest is debug noise), or the last lines when it printed none."""
    lines = output.splitlines()
    errors = [line for line in lines if line.startswith("ERROR:")]
    return "\n".join((errors or lines)[-_ERROR_LINES:])
