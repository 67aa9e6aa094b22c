"""The tools of a tool-using GRPO run: what the model may call while it writes a completion.

`grpo.tools` names a file whose public functions are the tools (TRL's `tools=`); `grpo.environment` names a class
(`file.py:ClassName`) of which TRL makes one instance per completion, its public methods the tools
(`environment_factory=`). Both files come from the run's artifact store, as reward files do. TRL runs the tools in
this process, so they see the run's `[worker] env` and secrets, and answers a call that raises with the error
(`{"error": ...}`) instead of ending the run.

Before the trainer is built, each tool's JSON schema is made as the chat template will make it (transformers'
`get_json_schema`), and the model's chat template must render a tool conversation and have a way back from text to
tool calls (a `response_template`): what fails here is refused with the tool's or the template's name, not deep
inside TRL.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loraflow_worker.contract import GrpoSettings
from loraflow_worker.contract.reward_names import ENVIRONMENT_HOOKS, split_file_reward
from loraflow_worker.training.user_files import UserFileError, import_stored_file

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from loraflow_worker.artifacts import ArtifactStore


class ToolError(ValueError):
    """A run's tools cannot be used as named: file missing, tool undocumented, template without tools."""


@dataclass
class RunTools:
    """What the trainer takes: standalone tools and the environment's class (either may be empty)."""

    tools: list[Callable[..., Any]] = field(default_factory=list)
    environment: type | None = None

    def callables(self) -> list[Callable[..., Any]]:
        """Every tool the chat template shows the model: the standalone ones and the environment's methods (on the
        class: a schema skips `self` there as on a bound method)."""
        methods = environment_methods(self.environment) if self.environment is not None else []
        return [*self.tools, *methods]


def resolve_tools(settings: GrpoSettings, store: ArtifactStore, files_dir: Path) -> RunTools:
    """The tools of `settings`, imported from the run's store into `files_dir`, each checked as the chat template
    will show it. ToolError naming `grpo.tools` / `grpo.environment` and the tool otherwise."""
    run_tools = RunTools()
    if settings.tools is not None:
        module = _import(settings.tools, settings.tools_store_path, "grpo.tools", store, files_dir)
        run_tools.tools = [value for name, value in vars(module).items()
                           if inspect.isfunction(value) and value.__module__ == module.__name__
                           and not name.startswith("_")]
        if not run_tools.tools:
            raise ToolError(f"grpo.tools `{settings.tools}`: the file defines no public function: define the tools "
                            "as top-level functions whose names do not start with `_`")
        _check_schemas(run_tools.tools, f"grpo.tools `{settings.tools}`")
    if settings.environment is not None:
        _, class_name = split_file_reward(settings.environment)
        module = _import(settings.environment, settings.environment_store_path, "grpo.environment", store, files_dir)
        environment = vars(module).get(class_name)
        where = f"grpo.environment `{settings.environment}`"
        if not inspect.isclass(environment):
            found = "is not a class" if class_name in vars(module) else "does not exist"
            raise ToolError(f"{where}: `{class_name}` {found} in the file")
        if not callable(getattr(environment, "reset", None)):
            raise ToolError(f"{where}: `{class_name}` has no `reset` method: TRL calls `reset(**row)` before each "
                            "completion; define it")
        methods = environment_methods(environment)
        if not methods:
            raise ToolError(f"{where}: `{class_name}` has no public method besides reset and get_reward: its public "
                            "methods are the tools")
        _check_schemas(methods, where)
        run_tools.environment = environment
    return run_tools


def environment_methods(environment: type) -> list[Callable[..., Any]]:
    """The tools of an environment class: its public methods but `reset` and `get_reward`, as TRL lists them (on the
    class, so that properties are not evaluated)."""
    return [method for name, method in inspect.getmembers(environment, predicate=inspect.isfunction)
            if not name.startswith("_") and name not in ENVIRONMENT_HOOKS]


def check_tool_template(tokenizer: PreTrainedTokenizerBase, model_id: str) -> None:
    """ToolError unless the model's chat template renders a tool conversation and transformers can read tool calls
    back from the model's text (a `response_template`, the tokenizer's own or the one TRL sets for the templates it
    knows)."""
    from trl.chat_template_utils import add_response_schema, supports_tool_calling

    if not supports_tool_calling(tokenizer):
        raise ToolError(
            f"the chat template of {model_id} does not render tools (a call, its arguments and the tool's answer must "
            "all appear in the rendered chat): use a model whose template renders tools (Qwen2.5, Qwen3, Llama 3.1, "
            "...) or give the model one with tools in its tokenizer"
        )
    if getattr(tokenizer, "response_template", None) is None and getattr(tokenizer, "response_schema", None) is None:
        try:
            add_response_schema(tokenizer)
        except ValueError as e:
            raise ToolError(
                f"the model's tool calls cannot be read back from its text: the tokenizer of {model_id} has no "
                "`response_template` and TRL knows no parser for its chat template; add a `response_template` to its "
                f"tokenizer_config.json (transformers' response parsing) ({e})"
            ) from e


def _import(name: str, store_path: str | None, field_name: str, store: ArtifactStore, files_dir: Path):
    if store_path is None:
        raise ToolError(f"{field_name} `{name}`: it is not in the run's artifact store (its store path is empty); "
                        "start the run with the train flow, which uploads the file")
    try:
        return import_stored_file(store, store_path, files_dir)
    except UserFileError as e:
        raise ToolError(f"{field_name} `{name}`: {e}") from e


def _check_schemas(tools: list[Callable[..., Any]], where: str) -> None:
    from transformers.utils import get_json_schema

    for tool in tools:
        try:
            get_json_schema(tool)
        except Exception as e:  # noqa: BLE001 - transformers' parsing errors name what is missing; the tool's name goes with it
            raise ToolError(f"{where}: tool `{tool.__name__}` cannot be shown to the model: {e}; give every parameter "
                            "a type hint and the docstring an `Args:` line per parameter") from e
