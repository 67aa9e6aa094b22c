"""The rules a shared server holds every run to, whoever fills in the form: each refused before anything is rented,
naming the run's field and the operator's setting.

- `LORAFLOW_INPUTS_DIR`: every file a run ships (dataset, evaluation, mix, reward, tools, environment and chat
  template files, and a run file) resolves inside the inputs folder, symlinks resolved, so a run field cannot reach
  the control plane's own files (its keys, another person's data) and copy them into a store the run names.
- `LORAFLOW_REQUIRE_RUN_TOKEN`: a run names its own Hub token (`hub_token_secret`) rather than run on the control
  plane's, which would reach its workers and open every `hf://` store that token can.
- `LORAFLOW_MAX_RUN_USD`: no run's cost ceiling passes the operator's cap, whatever its own budget says
  (`tasks/placement/cost.py` applies it; a serve's and a preload sweep's too); `LORAFLOW_MAX_STUDY_USD`: no study's
  whole spend passes the operator's cap for a study.
- Whatever the settings: no field that names a Prefect Secret block (`hub_token_secret`, `worker.secrets`) names one
  the control plane reads for itself (`Settings.server_blocks`: the RunPod key's, its own Hub token's, the key of
  secret names'), which the run would otherwise hand its workers; and with RunPod's workers, a `file://` store or a
  local model is refused, since the workers cannot see this machine (the adapter would be written inside a container
  and lost with it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from tasks.settings import Settings


class ServerRuleError(ValueError):
    """A run this server's rules refuse; the message names every field and setting that refused it."""


def outside_inputs_dir(field: str, path_text: str, inputs_dir: Path, base_dir: Path) -> str | None:
    """Why `path_text` (the run field `field`; a relative path starts at `base_dir`) is not inside `inputs_dir` once
    every symlink is resolved; None when it is."""
    folder = inputs_dir.expanduser().resolve()
    resolved = (base_dir / Path(path_text).expanduser()).resolve()
    if resolved == folder or resolved.is_relative_to(folder):
        return None
    shown = "" if str(resolved) == path_text else f" (resolved: {resolved})"
    return (f"{field} {path_text!r}{shown} is outside this server's inputs folder {folder} (LORAFLOW_INPUTS_DIR): put "
            "the file there and name it by its path inside it")


def check_inside_inputs_dir(field: str, path_text: str, settings: Settings, base_dir: Path | None = None) -> None:
    """`ServerRuleError` when the server has an inputs folder and `path_text` resolves outside it."""
    if settings.loraflow_inputs_dir is not None:
        problem = outside_inputs_dir(field, path_text, settings.loraflow_inputs_dir, base_dir or Path.cwd())
        if problem:
            raise ServerRuleError(problem)


def server_block_problems(hub_token_secret: str | None, worker_secrets: Mapping[str, str],
                          settings: Settings) -> list[str]:
    """Why the Secret blocks a run names (its token's, its `worker.secrets`) are not the run's to use: each one of
    this control plane's own (`Settings.server_blocks`), by field. Empty when none is."""
    named = [("hub_token_secret", hub_token_secret)] if hub_token_secret is not None else []
    named += [(f"worker.secrets.{env_name}", block) for env_name, block in worker_secrets.items()]
    return [problem for field, block in named if (problem := settings.server_block_problem(field, block))]


def operator_rule_problems(local_paths: Sequence[tuple[str, str]], *, hub_token_secret: str | None,
                           settings: Settings, base_dir: Path | None = None,
                           worker_secrets: Mapping[str, str] | None = None) -> list[str]:
    """Why this server refuses a run with these local paths ((field, path) pairs: `RunSpec.local_paths`), token
    block and `worker_secrets` (ENV_NAME → block): the operator's settings, and the server's own Secret blocks
    (`server_block_problems`); empty when it does not."""
    problems = server_block_problems(hub_token_secret, worker_secrets or {}, settings)
    if settings.loraflow_inputs_dir is not None:
        # A local model is read where it lies by localpod's workers, never copied into a store, and RunPod's are
        # refused it (`host_only_problems`): the folder holds what a run ships.
        problems += [p for field, path in local_paths if field != "model.id"
                     and (p := outside_inputs_dir(field, path, settings.loraflow_inputs_dir, base_dir or Path.cwd()))]
    if settings.loraflow_require_run_token and hub_token_secret is None:
        problems.append("hub_token_secret is empty, and this server runs no run on its own Hugging Face token "
                        "(LORAFLOW_REQUIRE_RUN_TOKEN=1): save your token in a Prefect Secret block and name it in "
                        "hub_token_secret")
    return problems


def host_only_problems(local_paths: Sequence[tuple[str, str]], *, artifact_store: str, settings: Settings) -> list[str]:
    """Why RunPod's workers could not use this run's store or model (they cannot see this machine); empty with
    localpod's workers, which run here."""
    if not settings.workers_are_runpods():
        return []
    problems = [f"model.id {path!r} is a folder of this machine, which RunPod's workers cannot read: push the model "
                "to the Hub and set model.id to its id" for field, path in local_paths if field == "model.id"]
    if artifact_store.startswith("file:"):
        problems.append(f"artifact_store {artifact_store!r} is a folder of this machine, which RunPod's workers "
                        "cannot write (the adapter would be lost with the worker's container): use "
                        "hf://datasets/<org>/<repo> (file:// is for local mode, with localpod)")
    return problems


def check_server_rules(local_paths: Sequence[tuple[str, str]], *, artifact_store: str, hub_token_secret: str | None,
                       settings: Settings | None = None, base_dir: Path | None = None,
                       worker_secrets: Mapping[str, str] | None = None) -> None:
    """`ServerRuleError` naming every problem of `operator_rule_problems` and `host_only_problems`."""
    settings = settings or Settings()
    problems = (operator_rule_problems(local_paths, hub_token_secret=hub_token_secret, settings=settings,
                                       base_dir=base_dir, worker_secrets=worker_secrets)
                + host_only_problems(local_paths, artifact_store=artifact_store, settings=settings))
    if problems:
        raise ServerRuleError("refused by this server's rules, before anything was rented: " + "; ".join(problems))
