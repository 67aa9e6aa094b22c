"""A run's own worker secrets (`worker.secrets` in the run spec): each value is read from the Prefect Secret block
the run names, where the flow runs, and reaches the workers as a RunPod account secret that the endpoint's env
refers to (`tasks/runpod/secrets.py`: one secret per distinct value, never changed). The value is never a
parameter, a log line, an artifact, an endpoint's env or a stored file; the run's parameters hold only the block's
name. (Plain `worker.env` values go into the endpoint's env as they are, never holding a secret reference:
`endpoint_env`.)"""

from __future__ import annotations

from collections.abc import Mapping

from loraflow_worker.contract import secret_reference_problem

from tasks.runpod.client import RunpodClient
from tasks.runpod.secrets import parse_secret_name, referenced_secrets, secret_reference, value_secret_env
from tasks.settings import Settings

RUN_SECRET_PURPOSE = "run-secret"
"""What the account secrets of runs' own secrets are for, in their names: `loraflow-run-secret-<namespace>-<fp>`."""
MIN_SECRET_CHARS = 8
"""The shortest value a run's secret may have: the worker redacts the run's secrets by value from its console and
errors (`loraflow_worker.runtime.redaction`), where a value of a few letters would blank out ordinary words; and a
value that short can be found by trying, however its name or the account hides it."""


class RunSecretError(ValueError):
    """A Prefect Secret block that a run's `worker.secrets` names cannot be used; the message names the field and the
    block, never the value."""


def read_run_secrets(secrets: Mapping[str, str]) -> dict[str, str]:
    """ENV_NAME → the value of the Prefect Secret block `secrets` names for it (the run's `worker.secrets`). Raises
    `RunSecretError` for one of the server's own blocks (`Settings.server_blocks`: refused before any block is read),
    a block that cannot be read (missing, not a Secret block, the Prefect API unreachable), that holds JSON rather
    than text, or a value shorter than `MIN_SECRET_CHARS`. Reads the Prefect API once per block."""
    from prefect.blocks.system import Secret

    settings = Settings()
    if problems := [problem for env_name, block in secrets.items()
                    if (problem := settings.server_block_problem(f"worker.secrets.{env_name}", block))]:
        raise RunSecretError("; ".join(problems))
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
                f"{MIN_SECRET_CHARS}: a value that short is easily guessed, and the worker removes a secret's value "
                "from its console and errors, which would blank out ordinary words; store the whole credential (a "
                "real one is longer), or use `worker.env` for a plain setting"
            )
        values[env_name] = value
    return values


def run_secret_env(client: RunpodClient, secrets: Mapping[str, str], namespace: str, key: bytes) -> dict[str, str]:
    """The endpoint env entries of a run's secrets: ENV_NAME → `{{ RUNPOD_SECRET_<name> }}`, each value stored in the
    account secret `loraflow-run-secret-<namespace>-<fingerprint>` (keyed with the namespace's `key`; created when
    missing, never changed). Raises `RunSecretError` as `read_run_secrets` does, before any secret is created."""
    env: dict[str, str] = {}
    for env_name, value in read_run_secrets(secrets).items():
        env |= value_secret_env(client, env_name, value, purpose=RUN_SECRET_PURPOSE, namespace=namespace, key=key)
    return env


def endpoint_env(plain: Mapping[str, str], references: Mapping[str, str]) -> dict[str, str]:
    """The env an endpoint gets: `plain` values (the control plane's settings and the run's `worker.env`) as they
    are, and loraflow's own `references` (ENV_NAME → `{{ RUNPOD_SECRET_<name> }}`). Checked here, where the env is
    built, whatever let the values through: RunPod replaces a secret reference anywhere in a value at worker boot, so
    a plain value holding one is refused, and a reference is only ever a whole value naming a secret loraflow made."""
    for name, value in plain.items():
        if problem := secret_reference_problem(name, value):
            raise ValueError(problem)
    for name, value in references.items():
        secrets = referenced_secrets({name: value})
        if len(secrets) != 1 or value != secret_reference(secret := secrets.pop()) or parse_secret_name(secret) is None:
            raise ValueError(f"the endpoint env's {name} is not one of loraflow's own secret references")
    return {**plain, **references}
