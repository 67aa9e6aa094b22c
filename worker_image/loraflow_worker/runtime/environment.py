"""The training process's environment: which of the worker's variables it gets, and which it never does.

The worker's environment is the endpoint's (set by the control plane, with the run's own `[worker] env` and
`secrets`) plus RunPod's runtime variables. The training process gets it with three changes:

- Credentials: of the secret-looking variables (names with TOKEN, SECRET, KEY, PASSWORD, CREDENTIAL)
  only `FORWARDED_CREDENTIALS` and the run's own variables the job lists by name (`worker_env_names`,
  `worker_secret_names`: e.g. a judge's API key for a reward) pass. RunPod's own (`RUNPOD_*`, among them the
  worker's API key) never do: the supervisor, not the training process, talks to RunPod.
- Control-plane-owned keys (`CONTROL_PLANE_KEYS`: run id, attempt, artifact store) are set from the
  validated job input, whatever the environment said: a run's env cannot redirect its artifacts.
- Settings that point into the network volume (HF_HOME, TRITON_CACHE_DIR, PIP_CACHE_DIR, ...) are
  dropped, mounted or not: the volume is shared by every run in its datacenter, so only Hub model files
  go there, and the worker puts them there itself (model_cache.py). A compiler or pip cache on it would
  let one tenant plant code that the next one runs.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from loraflow_worker.contract import JobInput
from loraflow_worker.runtime.model_cache import VOLUME_PATH_ENV, volume_path

FORWARDED_CREDENTIALS = ("HF_TOKEN", "HF_ENDPOINT", "WANDB_API_KEY")
"""The only credentials (and credential-like settings) the training process receives."""

_SECRET_NAME = re.compile(r"TOKEN|SECRET|KEY|PASSWORD|CREDENTIAL", re.IGNORECASE)
_RUNTIME_PREFIX = "RUNPOD_"


def is_secret_name(name: str) -> bool:
    """Whether an environment variable's name says it holds a secret (HF_TOKEN, RUNPOD_AI_API_KEY, ...)."""
    return bool(_SECRET_NAME.search(name))


CONTROL_PLANE_KEYS = ("LORAFLOW_RUN_ID", "LORAFLOW_ATTEMPT", "LORAFLOW_ARTIFACT_STORE")
"""Set in the training process from the job input; the same names in the worker's environment are ignored."""


def child_env(job: JobInput, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of `job`'s training process, built from `env` (default: this process's)."""
    # The contract refuses a run's names among RunPod's, loraflow's and the Hub's, so listing cannot let them in.
    listed = {*FORWARDED_CREDENTIALS, *job.worker_env_names, *job.worker_secret_names}
    result = {
        name: value
        for name, value in off_the_volume(os.environ if env is None else env).items()
        if not name.startswith(_RUNTIME_PREFIX)
        and name not in CONTROL_PLANE_KEYS
        and (name in listed or not is_secret_name(name))
    }
    result.update(zip(CONTROL_PLANE_KEYS, (job.run_id, str(job.attempt), job.artifact_store)))
    # The supervisor reads the console line by line as it is written.
    result["PYTHONUNBUFFERED"] = "1"
    return result


def off_the_volume(env: Mapping[str, str]) -> dict[str, str]:
    """`env` without the settings whose value points into the network volume (`LORAFLOW_VOLUME_PATH`
    itself stays: it is how the training process finds the volume's Hub cache)."""
    volume = str(volume_path(env))  # a Path: no trailing slash
    return {
        name: value for name, value in env.items()
        if name == VOLUME_PATH_ENV or not (value == volume or value.startswith(volume + "/"))
    }
