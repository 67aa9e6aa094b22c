"""Which names a run may put in its worker's environment (`[worker] env` and `secrets`), read the same way by the
run spec (before anything is rented) and the worker (which refuses a job that lists another)."""

from __future__ import annotations

import re
from collections.abc import Iterable

ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]{0,127}$"
"""An environment variable's name as a shell accepts it: letters, digits and `_`, not starting with a digit."""
MAX_WORKER_ENV = 64
"""Variables a run may add to its worker's environment, plain and secret each."""
# The one list of the names a run cannot set in its worker's environment (`[worker] env` and `secrets`), with why:
# the control plane sets them, or they would change how the worker itself runs (which interpreter and libraries,
# which GPU, where its files go, where pip installs from). The run spec refuses them before anything is rented;
# the worker refuses a job that lists them. Compared without regard to case.
RESERVED_ENV_NAMES: dict[str, str] = {
    "HF_TOKEN": "loraflow gives the worker the run's Hugging Face token, from `hub_token_secret`",
    "HUGGING_FACE_HUB_TOKEN": "loraflow gives the worker the run's Hugging Face token, from `hub_token_secret`",
    "HF_TOKEN_PATH": "loraflow gives the worker the run's Hugging Face token, from `hub_token_secret`",
    "HF_ENDPOINT": "loraflow points the worker at the Hub its control plane uses",
    "HF_HOME": "the worker keeps Hub files where it reads them (the network volume's cache or its own disk)",
    "CUDA_VISIBLE_DEVICES": "the worker trains on the GPU RunPod gives it",
    "CUDA_DEVICE_ORDER": "the worker trains on the GPU RunPod gives it",
    "PYTORCH_CUDA_ALLOC_CONF": "the worker sets the CUDA allocator before CUDA starts, as "
                               "`fast_paths.expandable_segments` says",
    "PATH": "the worker runs the image's programs",
    "HOME": "the worker's files live where the image puts them",
    "TMPDIR": "the worker's scratch files live on its container disk",
}
RESERVED_ENV_PREFIXES: dict[str, str] = {
    "HF_HUB_": "the Hub client's settings (offline mode, cache, transfers) are the worker's",
    "RUNPOD_": "RunPod sets them (the worker's own API key among them)",
    "LORAFLOW_": "loraflow's own settings, set by the control plane or the image",
    "NVIDIA_": "the container runtime's GPU settings are RunPod's",
    "LD_": "the dynamic linker's settings would change which libraries the worker loads",
    "PYTHON": "the interpreter's settings are the image's",
    "PIP_": "`extra_packages` install from the image's package index settings only",
}


def worker_env_name(name: str) -> str:
    """`name` as one of a run's own worker variables (`[worker] env` or `secrets`); ValueError naming it and why not."""
    if not re.match(ENV_NAME_PATTERN, name):
        raise ValueError(f"`{name}` is not an environment variable name: use letters, digits and `_`, not starting "
                         "with a digit (at most 128 characters)")
    upper = name.upper()
    reason = RESERVED_ENV_NAMES.get(upper) or next(
        (why for prefix, why in RESERVED_ENV_PREFIXES.items() if upper.startswith(prefix)), None)
    if reason is not None:
        raise ValueError(f"`{name}` cannot be set by a run ({reason}): remove it")
    return name


SECRET_REFERENCE_MARKS = ("{{", "RUNPOD_SECRET_")
"""What makes an env value a RunPod secret reference: RunPod replaces `{{ RUNPOD_SECRET_<name> }}` anywhere in an
endpoint's env value with that account secret when a worker boots, so a run's plain variable holding one would hand
its code another person's secret. Only loraflow's own code writes references (compared without regard to case)."""


def secret_reference_problem(name: str, value: str) -> str | None:
    """Why the run's plain variable `name` cannot hold `value` (it would refer to an account secret); None when it
    can."""
    upper = value.upper()
    if any(mark in upper for mark in SECRET_REFERENCE_MARKS):
        return (f"`worker.env.{name}` holds `{{{{` or `RUNPOD_SECRET_`: RunPod would put an account secret in its "
                "place when the worker boots, and a run may only receive its own secrets: name a Prefect Secret block "
                "of yours in `worker.secrets` instead, or remove the braces")
    return None


def worker_env_overlap(env_names: Iterable[str], secret_names: Iterable[str]) -> str | None:
    """Why the same name cannot be both a plain variable and a secret, or None when no name is both."""
    both = sorted(set(env_names) & set(secret_names))
    if not both:
        return None
    return (f"{', '.join(f'`{name}`' for name in both)} {'is' if len(both) == 1 else 'are'} in both `env` and `secrets`: "
            "keep each name in one (`secrets` for a credential)")
