"""The `train` flow's single-field parameters beside `spec` (`--param max_steps=5`), and how they change a run spec.

A change is validated as a run file is, and a refusal names the parameter that caused it.
"""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from flows.forms.run import RunSpec, SpecError, load_run_file
from tasks.preflight.server_rules import check_inside_inputs_dir
from tasks.settings import Settings


class RunOverrides(BaseModel):
    """Flat changes to a run's spec, one per parameter of the `train` flow beside `spec`, so that
    `prefect deployment run train/qwen --param max_steps=5` changes one field (a `--param spec=...`
    replaces the whole spec). None leaves the field as the spec has it. The descriptions are the
    flow's parameter descriptions (its docstring, which Prefect shows in the run form)."""

    model_config = ConfigDict(extra="forbid")

    run_file: str | None = Field(
        default=None, max_length=4096,
        description="A TOML run file (e.g. `deployments/qwen.toml`) whose spec replaces `spec` before the other "
        "overrides apply. Relative paths are resolved from the flow's working directory.",
    )
    name: str | None = Field(default=None, description="Replaces the spec's `name` (the run's label).")
    model: str | None = Field(
        default=None, description="Replaces the base model: a Hub model id (`Qwen/Qwen3-0.6B`, default branch) or a "
        "local model directory (local mode).",
    )
    dataset: str | None = Field(
        default=None, description="Replaces the training data: a local JSONL file (a path ending in `.jsonl` or "
        "`.json`, or starting with `/`, `./`, `../` or `~`) or else a Hub dataset id (its `train` split).",
    )
    gpu: list[str] | None = Field(
        default=None, description="Replaces `compute.gpu`: GPU classes in the order to try them, e.g. "
        "`[\"h100\", \"a100 sxm\"]`.",
    )
    max_steps: int | None = Field(default=None, description="Replaces `training.max_steps` (optimizer steps).")
    learning_rate: float | None = Field(default=None, description="Replaces `training.learning_rate`.")
    hub_token_secret: str | None = Field(
        default=None, description="Replaces `hub_token_secret`: the Prefect Secret block holding your Hugging Face "
        "token, for this run.",
    )


# Where each override goes in the spec.
OVERRIDE_PATHS: dict[str, tuple[str, ...]] = {
    "name": ("name",), "model": ("model",), "dataset": ("dataset",), "gpu": ("compute", "gpu"),
    "max_steps": ("training", "max_steps"), "learning_rate": ("training", "learning_rate"),
    "hub_token_secret": ("hub_token_secret",),
}
_LOCAL_FILE = re.compile(r"^(/|\./|\.\./|~)|\.jsonl?$")


def apply_overrides(spec: RunSpec, overrides: RunOverrides) -> RunSpec:
    """`spec` (or the spec of `overrides.run_file`) with each set override in its field, validated as
    a run file is. `SpecError` names the parameter behind each problem (`parameter max_steps ...`).

    The fields the spec set stay set, so rules that depend on what was set (e.g. `training.max_seq_length`
    refused for grpo) judge the merged spec as they would a run file.
    """
    if overrides.run_file is not None:
        check_inside_inputs_dir("parameter run_file", overrides.run_file, Settings())
        try:
            spec = load_run_file(overrides.run_file)
        except SpecError as e:
            raise SpecError(f"parameter run_file: {e}") from e
    data = spec.model_dump(mode="json", exclude_unset=True)
    for parameter, path in OVERRIDE_PATHS.items():
        value = getattr(overrides, parameter)
        if value is None:
            continue
        section = data
        for key in path[:-1]:
            section = section.setdefault(key, {})
        section[path[-1]] = _source(parameter, value)
    try:
        return RunSpec.model_validate(data)
    except ValidationError as e:
        raise SpecError(_describe_override_error(e, overrides)) from e


def _source(parameter: str, value: object) -> object:
    if parameter == "model":
        return {"id": value}
    if parameter == "dataset":
        return {"local_file": str(Path(str(value)).expanduser())} if _LOCAL_FILE.search(str(value)) \
            else {"hub_id": value}
    return value


def _describe_override_error(error: ValidationError, overrides: RunOverrides) -> str:
    source = f"the spec{f' of {overrides.run_file}' if overrides.run_file else ''} with its overrides"
    lines = [f"{error.error_count()} problem(s) in {source}:"]
    for e in error.errors():
        where = ".".join(str(p) for p in e["loc"]) or "(top level)"
        given = [name for name, path in OVERRIDE_PATHS.items()
                 if getattr(overrides, name) is not None and tuple(e["loc"][:len(path)]) == path]
        message = "unknown field (check its spelling and section)" if e["type"] == "extra_forbidden" else e["msg"]
        if given:
            lines.append(f"  - parameter {given[0]}={getattr(overrides, given[0])!r} ({where}): {message}")
        else:
            lines.append(f"  - {where}: {message}")
    return "\n".join(lines)
