"""The preflight's checks of the Hugging Face Hub: the token can download the model, read the dataset, and write
to (or create) the `hf://datasets/<org>/<repo>` artifact store."""

from __future__ import annotations

import os
from pathlib import Path

from huggingface_hub import HfApi
from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError
from loraflow_worker.contract import ModelSource, RowFormat, SourceFields

from tasks.placement.plan import resolve_model
from tasks.preflight.report import Check
from tasks.settings import Settings
from tasks.storage.artifacts import check_dataset_jsonl
from tasks.storage.hub_datasets import check_hub_dataset

# --- 6. The Hub token's access -------------------------------------------------------------------------


def _hub(settings: Settings) -> HfApi:
    return HfApi(endpoint=settings.hf_endpoint, token=settings.hf_token.get_secret_value() if settings.hf_token else None)


def check_model(model: ModelSource, settings: Settings, disk_gb: int) -> Check:
    """The model resolves as a run resolves it: a Hub id the token can download (pinned to a commit, within the
    disk), or a local directory (local mode only)."""
    name = "hub: model"
    try:
        resolved = resolve_model(model, settings, disk_gb=disk_gb)
    except ValueError as e:
        return Check(name=name, status="FAIL", found=str(e),
                     fix=f"set model.id to a Hub model the token (HF_TOKEN, or the Secret block '{settings.hf_token_block}') can read, "
                     "with model.revision a branch, tag or commit of it, or to a local model directory in local mode")
    if resolved.revision is None:
        if settings.workers_are_runpods():
            return Check(name=name, status="FAIL", found=f"{resolved.id} is a directory of this machine, which "
                         "RunPod's workers cannot read", fix="push the model to the Hub and set model.id to its id")
        return Check(name=name, status="ok", found=f"local directory {resolved.id} (local mode)")
    return Check(name=name, status="ok", found=f"{resolved.id} at commit {resolved.revision[:12]}, readable with "
                 f"{'the token' if settings.hf_token else 'no token (public)'}, fits compute.disk_gb {disk_gb}")


def check_dataset_file(field: str, local_file: str, rows: RowFormat, algorithm: str) -> Check:
    """A local JSONL file of the run's data (named by its spec `field`: `dataset`, `dataset.mix[1]`, `evaluation`)
    whose every line converts from its format (`rows`) into one the algorithm trains on."""
    name = "dataset file" if field == "dataset" else f"{field} file"
    try:
        examples = check_dataset_jsonl(Path(local_file), algorithm, f"{field}.local_file", rows.format, rows.columns)
    except ValueError as e:
        return Check(name=name, status="FAIL", found=str(e),
                     fix=f"fix the file (one JSON example per line in {field}.format, as its help says), or "
                     f"{field}.format and {field}.columns")
    return Check(name=name, status="ok", found=f"{local_file}: {examples} {algorithm} examples (the run publishes it "
                 "to its artifact store)")


def check_dataset(field: str, source: SourceFields, algorithm: str, settings: Settings) -> Check:
    """A Hub dataset of the run's data (named by its spec `field`) that the token can read at its revision, config and
    split, whose first rows convert into a format the algorithm trains on (`check_hub_dataset`)."""
    name = f"hub: {field}"
    try:
        checked = check_hub_dataset(source, field, algorithm, settings)
    except ValueError as e:
        return Check(name=name, status="FAIL", found=str(e),
                     fix=f"check {field}.hub_id, .revision, .config, .split, .format and .columns against the dataset "
                     f"on the Hub; a private or gated dataset needs a token (HF_TOKEN, or the Secret block "
                     f"'{settings.hf_token_block}') whose account can read it")
    return Check(name=name, status="ok", found=checked.describe(source.hub_id))


WRITE_ROLES = {"admin", "write", "contributor"}
"""Org roles that may create repos in the org and write to them (`contributor`: to the repos it created)."""


def judge_hub_write(whoami: dict, namespace: str, repo_id: str, exists: bool) -> str | None:
    """Why the token behind `whoami` (the Hub's `/api/whoami-v2` answer) cannot write to the dataset repo
    `repo_id` of `namespace` (or create it, when it does not exist); None when it can."""
    user = whoami.get("name")
    token = (whoami.get("auth") or {}).get("accessToken") or {}
    role = token.get("role")
    if role == "read":
        return f"the token ({token.get('displayName', 'unnamed')}) is read-only"
    if role == "fineGrained":
        scoped = (token.get("fineGrained") or {}).get("scoped") or []
        targets = {(namespace, ("user", "org"))} | ({(repo_id, ("dataset",))} if exists else set())
        if not any("repo.write" in s.get("permissions", []) and (s.get("entity") or {}).get("name") == target
                   and (s.get("entity") or {}).get("type") in types for s in scoped for target, types in targets):
            where = f"{namespace}" + (f" or on {repo_id}" if exists else "")
            return f"the fine-grained token ({token.get('displayName', 'unnamed')}) has no repo.write on {where}"
    if namespace == user:
        return None
    orgs = {o.get("name"): o.get("roleInOrg") for o in whoami.get("orgs") or []}
    if namespace not in orgs:
        return (f"{namespace} is neither the token's user ({user}) nor one of its orgs "
                f"({', '.join(o for o in orgs if o) or 'none'})")
    if orgs[namespace] is not None and orgs[namespace] not in WRITE_ROLES:
        return f"{user} has the role {orgs[namespace]!r} in {namespace}, which cannot write"
    return None


def check_store(store: str, settings: Settings) -> Check:
    """The token may write to the `hf://` store (or create it), or the `file://` folder is writable; read-only."""
    name = "artifact store"
    if store.startswith("file://"):
        return _check_folder_store(store, settings)
    repo_id = store.removeprefix("hf://datasets/")
    namespace = repo_id.split("/", 1)[0]
    if settings.hf_token is None:
        return Check(name=name, status="FAIL", found=f"{store}: no Hub token, and the store must be written",
                     fix=f"set HF_TOKEN (or a Prefect Secret block named '{settings.hf_token_block}') to a token with "
                     f"write access to {namespace}")
    api = _hub(settings)
    try:
        api.repo_info(repo_id, repo_type="dataset")
        exists = True
    except RepositoryNotFoundError:
        exists = False
    state = "exists" if exists else "does not exist yet (the first run creates it, private)"
    try:
        whoami = api.whoami()
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else None
        if status == 401:
            return Check(name=name, status="FAIL", found=f"{store} {state}; the Hub refused the token (401)",
                         fix="set HF_TOKEN (or the Secret block) to a valid token with write access")
        return Check(name=name, status="warn", found=f"{store} {state}; who the token belongs to could not be read "
                     f"(GET {api.endpoint}/api/whoami-v2 answered {status}), so its write access is unknown",
                     fix=f"check on the Hub (Settings → Access Tokens) that the token may write to {namespace}")
    problem = judge_hub_write(whoami, namespace, repo_id, exists)
    if problem:
        what = "write to it" if exists else f"create it in {namespace}"
        return Check(name=name, status="FAIL", found=f"{store} {state}; the token cannot {what}: {problem}",
                     fix=f"use a token with write access to {namespace} (a write token of a member with the write or "
                     "admin role), or an artifact_store in a namespace the token can write")
    return Check(name=name, status="ok", found=f"{store} {state}; the token ({whoami.get('name')}) may "
                 f"{'write to it' if exists else 'create it'}")


def _check_folder_store(store: str, settings: Settings) -> Check:
    name = "artifact store"
    path = Path(store.removeprefix("file://"))
    if settings.workers_are_runpods():
        return Check(name=name, status="FAIL", found=f"{store} is a folder of this machine, which RunPod's workers "
                     "cannot write", fix="use hf://datasets/<org>/<repo> (file:// is for local mode, with localpod)")
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        return Check(name=name, status="FAIL", found=f"{existing} is a file, not a folder",
                     fix="set artifact_store to a folder path")
    if not os.access(existing, os.W_OK | os.X_OK):
        return Check(name=name, status="FAIL", found=f"{existing} is not writable by this user",
                     fix=f"make {existing} writable, or set artifact_store to a folder this user can write")
    where = "exists" if existing == path else f"will be created under {existing}"
    return Check(name=name, status="ok", found=f"{path} {where}, writable")
