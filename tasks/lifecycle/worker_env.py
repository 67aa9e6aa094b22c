"""A run's own worker secrets (`worker.secrets` in the run spec): each value is read from the Prefect Secret block
the run names, where the flow runs, and reaches the workers as a RunPod account secret that the endpoint's env
refers to (`tasks/runpod/secrets.py`: one secret per distinct value, never changed). The value is never a
parameter, a log line, an artifact, an endpoint's env or a stored file; the run's parameters hold only the block's
name. (Plain `worker.env` values go into the endpoint's env as they are.)"""

from __future__ import annotations

from collections.abc import Mapping

from tasks.runpod.client import RunpodClient
from tasks.runpod.secrets import value_secret_env

RUN_SECRET_PURPOSE = "run-secret"
"""What the account secrets of runs' own secrets are for, in their names: `loraflow-run-secret-<namespace>-<fp>`."""
MIN_SECRET_CHARS = 4
"""The shortest value a run's secret may have: the worker redacts the run's secrets by value from its console and
errors (`loraflow_worker.runtime.redaction`), and a value of a few letters would blank out ordinary words there."""


class RunSecretError(ValueError):
    """A Prefect Secret block that a run's `worker.secrets` names cannot be used; the message names the field and the
    block, never the value."""


def read_run_secrets(secrets: Mapping[str, str]) -> dict[str, str]:
    """ENV_NAME → the value of the Prefect Secret block `secrets` names for it (the run's `worker.secrets`). Raises
    `RunSecretError` for a block that cannot be read (missing, not a Secret block, the Prefect API unreachable), that
    holds JSON rather than text, or a value shorter than `MIN_SECRET_CHARS`. Reads the Prefect API once per block."""
    from prefect.blocks.system import Secret

    values = {}
    for env_name, block in secrets.items():
        field = f"worker.secrets.{env_name}"
        try:
            value = Secret.load(block).get()
        except Exception as e:  # missing (ValueError), not a Secret block, or the Prefect API unreachable
            raise RunSecretError(
                f"{field}: the Prefect Secret block {block!r} cannot be read ({type(e).__name__}: {str(e)[:300]}): "
                f"create it (Prefect UI: Blocks → Secret, or `Secret(value=...).save({block!r})` from "
                "`prefect.blocks.system`) on the Prefect server this run uses, or remove the entry"
            ) from e
        if not isinstance(value, str):
            raise RunSecretError(f"{field}: the Prefect Secret block {block!r} holds a JSON {type(value).__name__}, not "
                                 "text: store the secret's value as a plain string")
        if len(value) < MIN_SECRET_CHARS:
            raise RunSecretError(
                f"{field}: the Prefect Secret block {block!r} holds {len(value)} characters, fewer than "
                f"{MIN_SECRET_CHARS}: the worker removes a secret's value from its console and errors, which would "
                "blank out ordinary words; a real credential is longer (use `worker.env` for a plain setting)"
            )
        values[env_name] = value
    return values


def run_secret_env(client: RunpodClient, secrets: Mapping[str, str], namespace: str) -> dict[str, str]:
    """The endpoint env entries of a run's secrets: ENV_NAME → `{{ RUNPOD_SECRET_<name> }}`, each value stored in the
    account secret `loraflow-run-secret-<namespace>-<fingerprint>` (created when missing, never changed). Raises
    `RunSecretError` as `read_run_secrets` does, before any secret is created."""
    env: dict[str, str] = {}
    for env_name, value in read_run_secrets(secrets).items():
        env |= value_secret_env(client, env_name, value, purpose=RUN_SECRET_PURPOSE, namespace=namespace)
    return env
