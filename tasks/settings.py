"""Where loraflow finds its secrets and service URLs: the environment, or a Prefect Secret block.

Secrets are never run parameters: the run spec is shown in the UI and stored with the run.
"""

from __future__ import annotations

import hmac
import re
import secrets
import string
import threading
from collections.abc import Callable
from fnmatch import fnmatchcase
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlparse

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from tasks.runpod.client import API_URL, JOB_URL, RunpodClient
from tasks.runpod.endpoints import NAMESPACE_PATTERN

SLOT_LEASE_SECONDS = 120
"""A crashed holder's slot frees after this (+ ≤15 s) once the server's repossessor sees the lease
expire; the holder renews it in the background while alive."""
NAMESPACE_VARIABLE = "loraflow-namespace"
"""The Prefect Variable that holds a control plane's endpoint-name tag when LORAFLOW_NAMESPACE is unset."""
KEY_BLOCK_PREFIX = "loraflow-secret-key-"
"""The Prefect Secret block of a namespace's key of secret names is this prefix and the namespace
(`tasks/lifecycle/secret_key.py`): `loraflow-secret-key-ab12cd`."""


T = TypeVar("T")
_run_reads: dict[tuple[str, str], object] = {}
_run_read_locks: dict[tuple[str, str], threading.Lock] = {}
_run_reads_lock = threading.Lock()


def read_once_per_run(what: str, read: Callable[[], T]) -> T:
    """`read()`'s answer, asked once per flow run (`what` names the Prefect block or variable read); outside a run,
    every time. A run's checks and steps each ask for its Hub token, several at once: each a request the Prefect
    server answers in 0.05-0.2 s on a loaded machine, before the run's endpoint is rented. A failed read is not kept:
    the next asks again."""
    from prefect.runtime import flow_run

    run_id = flow_run.id
    if run_id is None:
        return read()
    key = (run_id, what)
    with _run_reads_lock:
        lock = _run_read_locks.setdefault(key, threading.Lock())
    with lock:  # the run's concurrent checks wait for the one read
        if key not in _run_reads:
            _run_reads[key] = read()
        return _run_reads[key]  # type: ignore[return-value]


class HubTokenError(ValueError):
    """The Prefect Secret block a run names for its Hugging Face token cannot be read, or is not the run's to use."""


class Settings(BaseSettings):
    """Read from environment variables (names in capitals, e.g. `RUNPOD_API_KEY`)."""

    model_config = SettingsConfigDict(extra="ignore", env_ignore_empty=True)

    runpod_api_key: SecretStr | None = Field(
        default=None, description="RunPod API key. When unset, the Prefect Secret block `runpod_api_key_block` is read."
    )
    runpod_api_key_block: str = Field(default="runpod-api-key", description="Name of a Prefect Secret block holding the RunPod API key.")
    runpod_api_url: str = Field(default=API_URL, description="RunPod control-plane API v2 base URL (localpod's in local mode).")
    runpod_job_url: str = Field(default=JOB_URL, description="RunPod job API base URL (localpod's in local mode).")
    hf_token: SecretStr | None = Field(
        default=None,
        description="Hugging Face token for private models and the hf:// artifact store. When unset, the Prefect "
        "Secret block `hf_token_block` is read if it exists. A run whose `hub_token_secret` names a Secret block "
        "uses that block's token instead. Workers get it through a RunPod account secret.",
    )
    hf_token_block: str = Field(default="hf-token", description="Name of a Prefect Secret block holding the Hugging Face token.")
    hf_endpoint: str | None = Field(default=None, description="Hugging Face Hub URL; unset means huggingface.co.")
    loraflow_worker_image: str | None = Field(
        default=None,
        description="Worker image the endpoints run, as pushed after `make image` (`<registry>/<repository>:<tag>`). "
        "Required: without a real image a job sits in RunPod's queue until the run gives the GPU up.",
    )
    loraflow_image_min_cuda: str = Field(
        default="13.0", pattern=r"^\d+\.\d+$",
        description="Lowest host CUDA version the worker image runs on (its torch build): endpoints ask for at "
        "least this and at least the GPU's own minimum.",
    )
    loraflow_heartbeat_seconds: int = Field(
        default=60, ge=1, le=3600,
        description="A run watching its job sends a `loraflow.endpoint.heartbeat` Prefect event at least this often, "
        "so the reconciler can tell a live run from one whose process died, whatever the logging settings (set the "
        "reconcile policy's silent_after_minutes well above this).",
    )
    loraflow_namespace: str | None = Field(
        default=None, pattern=rf"^{NAMESPACE_PATTERN}$",
        description="This control plane's tag in endpoint names (1-8 of a-z, 0-9). Unset: the value of the Prefect "
        f"Variable `{NAMESPACE_VARIABLE}`, generated on first use, so every process that talks to the same Prefect "
        "server or Cloud workspace shares it. Set it on a server whose database was copied from another's (both "
        "would share one tag otherwise), or to keep a tag across a server rebuilt from scratch.",
    )
    loraflow_inputs_dir: Path | None = Field(
        default=None,
        description="On a team server: the folder every local path of a run (dataset, evaluation, mix, reward, "
        "tools, environment and chat template files, a local model, a run file) must resolve inside, symlinks "
        "resolved, or the run is refused before anything is rented. Unset: any path this process can read (one "
        "person's machine).",
    )
    loraflow_require_run_token: bool = Field(
        default=False,
        description="On a team server (`1`): refuse, before anything is rented, a run that names no "
        "`hub_token_secret` of its own, rather than run it on this process's Hugging Face token, which would reach "
        "its workers and open every hf:// store that token can.",
    )
    loraflow_max_run_usd: float | None = Field(
        default=None, gt=0,
        description="The operator's cap on any run's cost ceiling (price × workers × deadline), a study's children "
        "and the merge worker included: a run above it is refused before anything is rented, whatever its own "
        "budget_usd says.",
    )
    loraflow_max_study_usd: float | None = Field(
        default=None, gt=0,
        description="The operator's cap on a whole study's spend: its `study.budget_usd`, or where it names none (or "
        "a larger one) its children's cost ceilings together. A study above it is refused before any child starts.",
    )
    loraflow_optuna_storage: SecretStr | None = Field(
        default=None,
        description="Where a study's search (`search = \"tpe\"`) keeps its Optuna study: an SQLAlchemy URL, on a team "
        "a database of its own on the team's PostgreSQL (`postgresql+psycopg://USER:PASSWORD@HOST:5432/optuna`; "
        "not the Prefect server's database, whose schema is Prefect's), which a study on a Prefect server elsewhere "
        "than this machine needs. Unset: `loraflow/optuna.db`, an SQLite file under Prefect's home (`PREFECT_HOME`). "
        "A secret: the URL may hold a password.",
    )
    loraflow_slot_lease_seconds: int = Field(
        # Prefect's server refuses leases shorter than 60 s (422).
        default=SLOT_LEASE_SECONDS, ge=60, le=3600,
        description="Lease of a run's endpoint slot: a crashed run's slot frees this long (+ up to 15 s) after its "
        "last renewal. Shorter frees slots sooner; longer survives longer server hiccups.",
    )

    def workers_are_runpods(self) -> bool:
        """Whether the endpoints are RunPod's (not localpod's), whose workers cannot see this machine's files."""
        host = urlparse(self.runpod_api_url).hostname or ""
        return host == "runpod.io" or host.endswith((".runpod.io", ".runpod.ai"))

    def worker_image(self) -> str:
        """The worker image; an error naming the setting and the fix when it is not set."""
        if not self.loraflow_worker_image:
            raise RuntimeError(
                "no worker image: build it with `make image`, push it to a registry RunPod can pull from, and set "
                "LORAFLOW_WORKER_IMAGE=<registry>/<repository>:<tag> where the flow runs"
            )
        return self.loraflow_worker_image

    def api_key(self) -> str:
        """The RunPod key from the environment, else from the Prefect Secret block."""
        if self.runpod_api_key is not None:
            return self.runpod_api_key.get_secret_value()
        from prefect.blocks.system import Secret

        try:
            return str(Secret.load(self.runpod_api_key_block).get())
        except ValueError as e:
            raise RuntimeError(
                f"no RunPod API key: set RUNPOD_API_KEY or create a Prefect Secret block named "
                f"'{self.runpod_api_key_block}'"
            ) from e

    def control_plane_namespace(self) -> str:
        """The tag this control plane puts in its endpoint names; its reconciler deletes no other tag's.

        `LORAFLOW_NAMESPACE` when set; else the Prefect Variable `loraflow-namespace`, created with a random
        tag if missing (never overwritten: when two processes race to create it, both read back the winner).
        The Variable lives in the Prefect database, so the tag follows the server or Cloud workspace
        whatever URL a process reaches it by (a hash of the API URL would not: one server has several
        URLs, and a script's ephemeral server a new port each time), survives restarts, and differs
        between servers that do not share a database (an ephemeral server's is under its PREFECT_HOME).
        """
        if self.loraflow_namespace is not None:
            return self.loraflow_namespace
        from prefect import get_client
        from prefect.client.schemas.actions import VariableCreate
        from prefect.exceptions import ObjectAlreadyExists

        def read() -> object:
            with get_client(sync_client=True) as client:
                variable = client.read_variable_by_name(NAMESPACE_VARIABLE)
                if variable is None:
                    tag = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(6))
                    try:
                        client.create_variable(VariableCreate(name=NAMESPACE_VARIABLE, value=tag))
                    except ObjectAlreadyExists:
                        pass  # another process created it first: use theirs
                    variable = client.read_variable_by_name(NAMESPACE_VARIABLE)
            return None if variable is None else variable.value

        value = read_once_per_run(f"variable {NAMESPACE_VARIABLE}", read)
        if not isinstance(value, str) or not re.fullmatch(NAMESPACE_PATTERN, value):
            raise RuntimeError(
                f"the Prefect Variable {NAMESPACE_VARIABLE!r} must hold 1-8 of a-z, 0-9 (it holds {value!r}): "
                "fix it, or set LORAFLOW_NAMESPACE"
            )
        return value

    def server_blocks(self) -> dict[str, str]:
        """The Prefect Secret blocks this control plane reads for itself, by name (a `*` pattern for a family), each
        with what it holds: no run, serve, study or preload may name one for its own use (`server_block_problem`).
        The configured names and their defaults both: the defaults are what the docs tell an operator to create, and
        a process started without the workers' settings reads them."""
        blocks = {KEY_BLOCK_PREFIX + "*": "the key of this server's secret names, which keeps the account's "
                                          "secrets from telling whose token is whose"}
        for field, holds in (("runpod_api_key_block", "the RunPod API key"),
                             ("hf_token_block", "this control plane's own Hugging Face token")):
            for name in (type(self).model_fields[field].default, getattr(self, field)):
                blocks[name] = f"{holds} ({field.upper()})"
        return blocks

    def server_block_problem(self, field: str, block: str) -> str | None:
        """Why the Secret block `block`, named by the run field `field`, is not the run's to use (one of
        `server_blocks`); None when it may be."""
        for pattern, holds in self.server_blocks().items():
            if fnmatchcase(block, pattern):
                return (f"{field}: the Prefect Secret block {block!r} is this server's own ({holds}), which no run "
                        "may hand its workers or use: save your own value in a Secret block of another name and name "
                        "that one")
        return None

    def own_hub_token(self) -> str | None:
        """This control plane's own Hugging Face token: the environment's, else the Secret block `hf_token_block`'s,
        else None."""
        if self.hf_token is not None:
            return self.hf_token.get_secret_value()
        from prefect.blocks.system import Secret

        def read() -> str | None:
            try:
                return str(Secret.load(self.hf_token_block).get())
            except ValueError:  # no such block: public models and file:// stores need no token
                return None

        return read_once_per_run(f"block {self.hf_token_block}, or none", read)

    def hub_token(self, run_block: str | None = None) -> str | None:
        """The Hugging Face token: from the Prefect Secret block a run names (`run_block`, the run field
        `hub_token_secret`) when it names one, else `own_hub_token`. A named block that cannot be read, that is one
        of the server's own (`server_blocks`), or (with `loraflow_require_run_token`) that holds the control plane's
        own token raises `HubTokenError`, naming the field and the block: a run must not fall back to, or borrow,
        another person's token."""
        if run_block is None:
            return self.own_hub_token()
        if problem := self.server_block_problem("hub_token_secret", run_block):
            raise HubTokenError(problem)
        from prefect.blocks.system import Secret

        try:
            token = read_once_per_run(f"block {run_block}", lambda: str(Secret.load(run_block).get()))
        except Exception as e:  # missing (ValueError), not a Secret block, or the Prefect API unreachable
            raise HubTokenError(
                f"hub_token_secret: the Prefect Secret block {run_block!r} cannot be read ({type(e).__name__}: "
                f"{str(e)[:300]}): create it (Prefect UI: Blocks → Secret, or `Secret(value=...).save("
                f"{run_block!r})` from `prefect.blocks.system`) on the Prefect server this run uses, or unset "
                "hub_token_secret to use the HF_TOKEN of the process running the flow"
            ) from e
        if not token:
            raise HubTokenError(f"hub_token_secret: the Prefect Secret block {run_block!r} holds an empty value: "
                                "store the Hugging Face token in it")
        # Compared in constant time, and neither value is ever shown.
        if self.loraflow_require_run_token and (own := self.own_hub_token()) \
                and hmac.compare_digest(token.encode(), own.encode()):
            raise HubTokenError(
                f"hub_token_secret: the Prefect Secret block {run_block!r} holds this control plane's own Hugging "
                "Face token, and this server runs no run on it (LORAFLOW_REQUIRE_RUN_TOKEN=1): store your own token "
                "in the block"
            )
        return token

    def store_token(self, store_url: str, run_block: str | None = None) -> str | None:
        """The Hub token for an artifact store: for an hf:// store `hub_token(run_block)` (on a team server the store
        may be the starter's private repo, which only their token can write); None for a file:// store."""
        return self.hub_token(run_block) if store_url.startswith("hf://") else None

    def with_hub_token(self, run_block: str | None = None) -> Settings:
        """These settings with `hf_token` set to `hub_token(run_block)` when there is one."""
        token = self.hub_token(run_block)
        return self if token is None else self.model_copy(update={"hf_token": SecretStr(token)})

    def worker_env(self) -> dict[str, str]:
        """The worker's plain environment: what it needs to reach the Hub, secrets excepted (the token goes
        through a RunPod account secret, `tasks/runpod/secrets.py`)."""
        return {"HF_ENDPOINT": self.hf_endpoint} if self.hf_endpoint else {}


def make_client(settings: Settings | None = None) -> RunpodClient:
    """A RunPod client with the key and URLs of `settings` (this process's environment by default)."""
    settings = settings or Settings()
    return RunpodClient(settings.api_key(), api_url=settings.runpod_api_url, job_url=settings.runpod_job_url)


def startup_problem(*, worker_image: bool = False) -> str | None:
    """What a flow started from the command line lacks (the RunPod key; with `worker_image`, the image), in one
    line that names the fix; None when nothing. Checked before the flow starts, so the answer is that line, not a
    failed run with a traceback in its log. (A run started from a deployment reports the same from inside.)"""
    settings = Settings()
    try:
        settings.api_key()
        if worker_image:
            settings.worker_image()
    except RuntimeError as e:  # also Prefect's, when its temporary server does not come up
        return str(e)
    return None
