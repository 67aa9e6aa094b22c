"""The training process's environment: which of the worker's variables it gets, and which it never does.

The worker's environment is the endpoint's (set by the control plane, with the run's own `[worker] env` and
`secrets`) plus RunPod's runtime variables. The training process gets it with three changes:

- Credentials: of the secret-looking variables (names with TOKEN, SECRET, KEY, PASSWORD, CREDENTIAL)
  only `FORWARDED_CREDENTIALS` and the run's own variables the job lists by name (`worker_env_names`,
  `worker_secret_names`: e.g. a judge's API key for a reward) pass. RunPod's own (`RUNPOD_*`, among them the
  worker's API key) never do: the supervisor, not the training process, talks to RunPod.
- The run's plain variables must hold what the control plane checked (`JobInput.worker_env_sha256`), or the job is
  refused (`check_run_env`): RunPod puts an account secret in place of `{{ RUNPOD_SECRET_<name> }}` anywhere in an
  env value when the worker boots, so a plain variable must never refer to one, nor change after the run started.
- Control-plane-owned keys (`CONTROL_PLANE_KEYS`: run id, attempt, artifact store) are set from the
  validated job input, whatever the environment said: a run's env cannot redirect its artifacts.
- The CUDA allocator's setting (`PYTORCH_CUDA_ALLOC_CONF`, `allocator_conf`) is added unless the worker's environment
  has one: the allocator reads it once, when CUDA initialises, and the training process initialises CUDA as it imports
  its stack (PEFT imports bitsandbytes, which asks the GPU's capability), before any of its own code could set it.
- Settings that point into the network volume (HF_HOME, TRITON_CACHE_DIR, PIP_CACHE_DIR, ...) are
  dropped, mounted or not: the volume is shared by every run in its datacenter, so only Hub model files
  go there, and the worker puts them there itself (model_cache.py). A compiler or pip cache on it would
  let one tenant plant code that the next one runs. "Point into" is read as the kernel and a shell would
  resolve the path (`off_the_volume`), not as the text starts.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping, Set

from loraflow_worker.artifacts.pins import sha256_hex
from loraflow_worker.contract import EvaluateInput, JobInput, secret_reference_problem
from loraflow_worker.runtime.model_cache import VOLUME_PATH_ENV, volume_path

ALLOC_CONF_ENV = "PYTORCH_CUDA_ALLOC_CONF"
EXPANDABLE_SEGMENTS = "expandable_segments:True"
FORWARDED_CREDENTIALS = ("HF_TOKEN", "HF_ENDPOINT", "WANDB_API_KEY")
"""The only credentials (and credential-like settings) the training process receives."""

_SECRET_NAME = re.compile(r"TOKEN|SECRET|KEY|PASSWORD|CREDENTIAL", re.IGNORECASE)
_RUNTIME_PREFIX = "RUNPOD_"

log = logging.getLogger("loraflow_worker")


def is_secret_name(name: str) -> bool:
    """Whether an environment variable's name says it holds a secret (HF_TOKEN, RUNPOD_AI_API_KEY, ...)."""
    return bool(_SECRET_NAME.search(name))


CONTROL_PLANE_KEYS = ("LORAFLOW_RUN_ID", "LORAFLOW_ATTEMPT", "LORAFLOW_ARTIFACT_STORE")
"""Set in the training process from the job input; the same names in the worker's environment are ignored."""


class RunEnvRefused(ValueError):
    """A run's plain worker variable is not what the control plane checked: the job is refused before training."""


def child_env(job: JobInput, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of `job`'s training process, built from `env` (default: this process's). Raises
    `RunEnvRefused` when a plain variable of the run is not the value the control plane checked (`check_run_env`)."""
    env = os.environ if env is None else env
    check_run_env(job, env)
    result = _inherited(env, {*job.worker_env_names, *job.worker_secret_names})
    result.update(zip(CONTROL_PLANE_KEYS, (job.run_id, str(job.attempt), job.artifact_store)))
    if ALLOC_CONF_ENV not in result and (conf := allocator_conf(job.fast_paths.switched_off())) is not None:
        result[ALLOC_CONF_ENV] = conf
    return result


def evaluate_env(job: EvaluateInput, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of an evaluate job's process (its graders are a teammate's code, as a run's rewards are): the
    worker's, less RunPod's own variables, the credentials other than `FORWARDED_CREDENTIALS` and the job's own
    secrets (`worker_secret_names`: a judge's key), and the settings that point into the volume."""
    return _inherited(os.environ if env is None else env, set(job.worker_secret_names))


def _inherited(env: Mapping[str, str], own: Set[str]) -> dict[str, str]:
    """What a child process of the worker inherits of `env`, with the job's `own` variables passed."""
    # The contract refuses a job's names among RunPod's, loraflow's and the Hub's, so listing cannot let them in.
    listed = {*FORWARDED_CREDENTIALS, *own}
    result = {
        name: value
        for name, value in off_the_volume(env).items()
        if not name.startswith(_RUNTIME_PREFIX)
        and name not in CONTROL_PLANE_KEYS
        and (name in listed or not is_secret_name(name))
    }
    # The supervisor reads the console line by line as it is written.
    result["PYTHONUNBUFFERED"] = "1"
    return result


def allocator_conf(disabled: Set[str]) -> str | None:
    """The `PYTORCH_CUDA_ALLOC_CONF` the worker gives training, before CUDA initialises: expandable segments (less
    fragmentation), unless the run disables them (`disabled`: the fast paths it switches off). With vLLM's sleep mode
    too: vLLM 0.33's sleep-mode pool turns them off around its own allocations and restores the setting after
    (`CuMemAllocator.use_memory_pool`, `vllm/device_allocator/cumem.py`)."""
    if "expandable_segments" in disabled:
        return None
    return EXPANDABLE_SEGMENTS


def check_run_env(job: JobInput, env: Mapping[str, str]) -> None:
    """`RunEnvRefused` naming `worker.env.<NAME>` when one of the run's plain variables (`worker_env_names`) is missing
    from `env`, refers to an account secret, or holds another value than the one whose sha256 the control plane sent
    (`worker_env_sha256`): someone changed the endpoint's env, or RunPod put a secret in it. The value is never
    shown."""
    for name in job.worker_env_names:
        value = env.get(name)
        if value is not None and (problem := secret_reference_problem(name, value)):
            raise RunEnvRefused(f"{problem} (refused by the worker, before training)")
        # surrogateescape: a value that is not UTF-8 hashes as its bytes, as the control plane hashed them.
        if value is None or sha256_hex(value.encode(errors="surrogateescape")) != job.worker_env_sha256[name]:
            state = "is not set" if value is None else "holds another value than the one the control plane checked"
            raise RunEnvRefused(
                f"`worker.env.{name}` {state} in the worker's environment: the endpoint's env changed after the run "
                "was started (its value is not shown: it may hold a secret). Start the run again; if it happens "
                "again, check who can edit the run's endpoints in the RunPod account")


def off_the_volume(env: Mapping[str, str]) -> dict[str, str]:
    """`env` without the settings whose value points into the network volume (`LORAFLOW_VOLUME_PATH`
    itself stays: it is how the training process finds the volume's Hub cache).

    A value points into the volume when any path in it (`_PATH_SEPARATORS` splits lists, `--flag=path` and
    `file:` URLs) leads there once `.`, `..`, repeated slashes and symlinks are resolved, as the kernel, a shell
    or Python would: `/./runpod-volume/x`, `//runpod-volume/x`, `/runpod-volume/`, `file:///runpod-volume/w`,
    `/usr/lib:/runpod-volume/site`, `../../../runpod-volume/x` and a symlink into the volume all do."""
    volume = _resolved_forms(str(volume_path(env)))
    kept: dict[str, str] = {}
    dropped = []
    for name, value in env.items():
        if name != VOLUME_PATH_ENV and _points_into(value, volume):
            dropped.append(name)
        else:
            kept[name] = value
    if dropped:
        log.info("left out of the environment of the processes the worker starts: %s (they point into the network "
                 "volume at %s, which every run in the datacenter shares)", ", ".join(sorted(dropped)),
                 volume_path(env))
    return kept


_PATH_SEPARATORS = re.compile(r"[\s:;,=\"']+")
"""What separates the paths inside one value: `:` in PATH-like lists (and after a URL's `file` scheme, leaving
`///path`), spaces in LD_PRELOAD and in argument strings, `=` in `--flag=path`, quotes around a path."""


def _points_into(value: str, volume: set[str]) -> bool:
    return any(_within(place, root) for token in _PATH_SEPARATORS.split(value) if token
               for place in _landing_places(token) for root in volume)


def _landing_places(token: str) -> set[str]:
    """Where `token`, read as a path, can lead. An absolute path leads where it reads once normalised (Linux takes
    a leading `//` as `/`, which `os.path.normpath` keeps) and where the kernel takes it (symlinks followed, so `..`
    after a symlink climbs from its target). A relative path is read from a folder this module does not know (the
    job's work folder, the handler's): it counts only when it climbs out (`../..`), since from a deep enough folder
    that reaches `/`, and from there it leads where its remaining components say."""
    if token.startswith("/"):
        return _resolved_forms(token)
    parts = os.path.normpath(token).split("/")
    if parts[0] != "..":
        return set()
    # normpath leaves `..` only at the front.
    return _resolved_forms("/" + "/".join(part for part in parts if part != ".."))


def _resolved_forms(path: str) -> set[str]:
    """`path` (absolute) normalised lexically, and with its symlinks resolved."""
    absolute = "/" + path.lstrip("/")
    return {os.path.normpath(absolute), os.path.realpath(absolute)}


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")
