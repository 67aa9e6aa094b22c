"""The training process's environment: which of the worker's variables it gets, and which it never does.

The worker's environment is the endpoint's (set by the control plane, possibly with a run's own
additions) plus RunPod's runtime variables. The training process gets it with three changes:

- Credentials: of the secret-looking variables (names with TOKEN, SECRET, KEY, PASSWORD, CREDENTIAL)
  only `FORWARDED_CREDENTIALS` pass. RunPod's own (`RUNPOD_*`, among them the worker's API key) never
  do: the supervisor, not the training process, talks to RunPod.
- Control-plane-owned keys (`CONTROL_PLANE_KEYS`: run id, attempt, artifact store) are set from the
  validated job input, whatever the environment said: a run's env cannot redirect its artifacts.
- Cache settings rooted at the network volume are dropped when no volume is mounted, so the libraries
  fall back to their defaults instead of writing a cache to a path that is not persistent storage.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from loraflow_worker.contract import JobInput

FORWARDED_CREDENTIALS = ("HF_TOKEN", "HF_ENDPOINT", "WANDB_API_KEY")
"""The only credentials (and credential-like settings) the training process receives."""

VOLUME_ROOT = "/runpod-volume"
"""Where RunPod mounts an endpoint's network volume."""

_SECRET_NAME = re.compile(r"TOKEN|SECRET|KEY|PASSWORD|CREDENTIAL", re.IGNORECASE)
_RUNTIME_PREFIX = "RUNPOD_"


def is_secret_name(name: str) -> bool:
    """Whether an environment variable's name says it holds a secret (HF_TOKEN, RUNPOD_AI_API_KEY, ...)."""
    return bool(_SECRET_NAME.search(name))


CONTROL_PLANE_KEYS = ("LORAFLOW_RUN_ID", "LORAFLOW_ATTEMPT", "LORAFLOW_ARTIFACT_STORE")
"""Set in the training process from the job input; the same names in the worker's environment are ignored."""


def child_env(job: JobInput, env: Mapping[str, str] | None = None, *, volume_mounted: bool | None = None) -> dict[str, str]:
    """The environment of `job`'s training process, built from `env` (default: this process's)."""
    result = {
        name: value
        for name, value in without_unmounted_volume(os.environ if env is None else env, volume_mounted=volume_mounted).items()
        if not name.startswith(_RUNTIME_PREFIX)
        and name not in CONTROL_PLANE_KEYS
        and (name in FORWARDED_CREDENTIALS or not is_secret_name(name))
    }
    result.update(zip(CONTROL_PLANE_KEYS, (job.run_id, str(job.attempt), job.artifact_store)))
    # The supervisor reads the console line by line as it is written.
    result["PYTHONUNBUFFERED"] = "1"
    return result


def without_unmounted_volume(env: Mapping[str, str], *, volume_mounted: bool | None = None) -> dict[str, str]:
    """`env` without the settings (HF_HOME, HF_HUB_CACHE, TRANSFORMERS_CACHE, ...) that point into the
    network volume when none is mounted."""
    if volume_mounted is None:
        volume_mounted = os.path.ismount(VOLUME_ROOT)
    return {name: value for name, value in env.items() if volume_mounted or not _under_volume(value)}


def _under_volume(value: str) -> bool:
    return value == VOLUME_ROOT or value.startswith(VOLUME_ROOT + "/")
