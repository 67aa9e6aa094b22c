"""A GRPO run's tools, checked before anything is rented: `grpo.tools` (a file whose public functions are the tools)
and `grpo.environment` (`file.py:Class`, whose public methods are), and whether the model's chat template can show
the model a tool conversation at all.

Each tool must be one that transformers can render into the chat template (`get_json_schema`: a type hint per
parameter, a docstring with an `Args:` line for each), or TRL fails on the worker after the GPU is paid for. The
file is the user's code and this process holds the control plane's keys, so nothing of it runs here: its source is
read (`tool_schemas`), and what only running it could tell is left to the worker, which imports it and checks every
tool as the job starts; the check then says so in its `note`. `check_tools_task` runs both checks for the flow.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
from huggingface_hub.errors import HfHubHTTPError
from loraflow_worker.contract import GrpoSettings, ModelSource
from loraflow_worker.contract.reward_names import split_file_reward
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from tasks.preflight.chat_tokenizer import ChatTokenizer
from tasks.preflight.chats import tokenizer_folder
from tasks.preflight.tool_prompts import local_prompts, prompt_length_problem
from tasks.preflight.tool_schemas import ToolsRead, read_environment, read_tools_file
from tasks.settings import Settings


@dataclass(frozen=True)
class ToolsCheck:
    """What the check found: the files (resolved), the tools' names in the order TRL lists them, and a warning to
    log when the worker is left to check what only running a file could tell."""

    tools_file: Path | None = None
    environment_file: Path | None = None
    environment_class: str | None = None
    tool_names: list[str] = field(default_factory=list)
    tools_file_names: list[str] = field(default_factory=list)
    note: str | None = None
    schemas: list[dict[str, Any]] | None = None
    """Each tool's JSON schema as the chat template receives it; None when the worker is left to judge some tool."""

    def describe(self) -> str:
        """One line for the log: `tools: lookup, add (from tools.py)`."""
        parts = []
        if self.tools_file is not None:
            parts.append(f"{', '.join(self.tools_file_names)} (from {self.tools_file.name})")
        if self.environment_file is not None:
            methods = self.tool_names[len(self.tools_file_names):]
            parts.append(f"{', '.join(methods)} (from {self.environment_file.name}:{self.environment_class})")
        return "tools: " + ("; ".join(parts) or "none")


def check_tools(tools: str | None, environment: str | None, base_dir: Path,
                read_from: dict[str, Path] | None = None) -> ToolsCheck:
    """Check `grpo.tools` and `grpo.environment` (relative paths start at `base_dir`) from their source, running
    nothing of them. ValueError naming the field, the file, the tool and the fix for anything TRL or transformers
    would refuse on the worker. `read_from` (field → file): the copy of a field's file that was read once for the
    run's checks and its store, read here in its place; messages name the run's own path."""
    read_from = read_from or {}
    tools_file = environment_file = class_name = None
    tools_names: list[str] = []
    env_names: list[str] = []
    notes = []
    schemas: list[dict[str, Any]] | None = []
    if tools is not None:
        tools_file = read_from.get("grpo.tools") or _existing(tools, "grpo.tools", tools, base_dir)
        found = _read("grpo.tools", tools, lambda: read_tools_file(tools_file))
        tools_names, notes = found.names, notes + _notes("grpo.tools", tools, found)
        schemas = None if found.schemas is None else [*schemas, *found.schemas]
    if environment is not None:
        try:
            path_text, class_name = split_file_reward(environment)
        except ValueError as e:
            raise ValueError(f"grpo.environment `{environment}` is not `path/to/file.py:ClassName`: name the file "
                             "and its class so") from e
        environment_file = (read_from.get("grpo.environment")
                            or _existing(path_text, "grpo.environment", environment, base_dir))
        found = _read("grpo.environment", environment, lambda: read_environment(environment_file, class_name))
        env_names, notes = found.names, notes + _notes("grpo.environment", environment, found)
        schemas = None if found.schemas is None or schemas is None else [*schemas, *found.schemas]
    if twice := sorted(set(tools_names) & set(env_names)):
        raise ValueError(f"grpo.tools `{tools}` and grpo.environment `{environment}` both have a tool "
                         f"`{twice[0]}`: the model calls tools by name; rename one")
    return ToolsCheck(tools_file=tools_file, environment_file=environment_file, environment_class=class_name,
                      tool_names=tools_names + env_names, tools_file_names=tools_names,
                      note=" ".join(notes) or None, schemas=schemas)


def tool_template_problem(render: Callable[[list[dict], list[dict]], str], template_name: str) -> str | None:
    """None when the chat template (`render(messages, tools)` gives its text) renders a whole tool conversation: the
    call's name and arguments and the tool's answer, as TRL's `supports_tool_calling` requires; else the refusal.
    A template that raises on the conversation does not render tools."""
    name, key, value, answer = "tool_name_7c1e", "tool_arg_key_3b9d", "tool_arg_value_e52a", "tool_answer_91f0"
    tools = [{"type": "function", "function": {
        "name": name, "description": "A tool.",
        "parameters": {"type": "object", "properties": {key: {"type": "string", "description": "An argument."}},
                       "required": [key]}}}]

    def conversation(arguments: dict | str) -> list[dict]:
        call = {"type": "function", "function": {"name": name, "arguments": arguments}}
        return [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": name, "content": answer}]

    fix = "pick a model whose chat template renders tool calls and tool results (or run GRPO without tools)"
    try:
        try:
            text = render(conversation({key: value}), tools)
        except TypeError:
            # Some templates (DeepSeek-V3's) take the arguments as a JSON string only; TRL retries so too.
            text = render(conversation(json.dumps({key: value})), tools)
    except (jinja2.TemplateError, TypeError) as e:
        return (f"chat template {template_name} cannot render a tool conversation (it raised {type(e).__name__}: "
                f"{e}): GRPO with `grpo.tools` or `grpo.environment` needs one; {fix}")
    parts = {"the tool call's name": name, "its argument's name": key, "its argument's value": value,
             "the tool's answer": answer}
    if dropped := [what for what, sentinel in parts.items() if sentinel not in text]:
        return (f"chat template {template_name} does not render tool conversations: its text leaves out "
                f"{', '.join(dropped)}, so the model would never see them; GRPO with `grpo.tools` or "
                f"`grpo.environment` needs a template that does; {fix}")
    return None


def _existing(path_text: str, field_name: str, value: str, base_dir: Path) -> Path:
    path = (base_dir / path_text).resolve()
    if not path.is_file():
        raise ValueError(f"{field_name} `{value}`: {path} does not exist or is not a file; fix the path (a relative "
                         f"path starts at {base_dir.resolve()})")
    return path


def _read(field_name: str, value: str, read: Callable[[], ToolsRead]) -> ToolsRead:
    try:
        return read()
    except ValueError as e:
        raise ValueError(f"{field_name} `{value}`: {e}") from None


def _notes(field_name: str, value: str, found: ToolsRead) -> list[str]:
    """The warnings for the log: what the worker is left to check, and the file's own."""
    notes = [f"{field_name} `{value}`: {warning}" for warning in found.warnings]
    if found.unread:
        notes.append(f"{field_name} `{value}` was read without running it, and only running it tells "
                     f"({'; '.join(found.unread)}): the worker checks those tools as the job starts, and the prompts "
                     "were not measured against grpo.max_prompt_length with the tools' schemas. Tools that are plain "
                     "`def`s with hints of built-in, `typing` or the file's own types are checked here")
    return notes


def check_tool_template(folder: Path, model_id: str, measure: Callable[[Any], str | None] = lambda _: None) -> None:
    """ValueError (the refusal) unless the chat template of the tokenizer in `folder` renders a tool conversation, and
    `measure(tokenizer)` (the prompts' lengths: `tool_prompts.prompt_length_problem`) finds nothing to refuse. Its fast
    path (`ChatTokenizer`) passes it; a refusal is judged again with transformers' own tokenizer."""
    def problem(tokenizer: Any) -> str | None:
        return tool_template_problem(
            lambda messages, tools: tokenizer.apply_chat_template(messages, tools=tools, tokenize=False),
            f"of {model_id}") or measure(tokenizer)

    try:
        light = ChatTokenizer.read(folder)
        if light is not None and problem(light) is None:
            return
    except Exception:  # noqa: BLE001, S110 - whatever stopped the fast path, transformers judges the run below
        pass
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    from transformers import AutoTokenizer

    if found := problem(AutoTokenizer.from_pretrained(folder)):
        raise ValueError(found)


@task(name="check-tools", cache_policy=NO_CACHE)
def check_tools_task(grpo: GrpoSettings, base_dir: str, model: ModelSource, hub_token_secret: str | None = None,
                     prompt_files: list[tuple[str, str, dict[str, str]]] | None = None,
                     read_from: dict[str, str] | None = None) -> ToolsCheck:
    """A tool-using GRPO run's tools (`check_tools`: read, never run) and the model's chat
    template, which must render them and, with the tools' schemas, fit the run's longest prompt of its local files
    (`prompt_files`: path, format, columns) in `grpo.max_prompt_length`. `read_from`: as `check_tools` takes it."""
    logger = get_run_logger()
    found = check_tools(grpo.tools, grpo.environment, Path(base_dir),
                        {field: Path(path) for field, path in (read_from or {}).items()})
    if found.note:
        logger.warning("%s", found.note)
    try:
        folder = tokenizer_folder(model, Settings().with_hub_token(hub_token_secret))
    except (OSError, ValueError, HfHubHTTPError) as e:  # as the chats' check: one that cannot run leaves it to the worker
        logger.warning("The chat template was not checked for tools before renting: %s's tokenizer could not be "
                       "read (%s: %s); the worker checks it as it starts", model.id, type(e).__name__, e)
    else:
        prompts = local_prompts(prompt_files or []) if found.schemas is not None else []
        check_tool_template(folder, model.id, lambda tokenizer: prompt_length_problem(
            tokenizer, found.schemas or [], prompts, grpo.max_prompt_length))
        if prompts and found.schemas is not None:
            logger.info("The longest of %d prompts fits grpo.max_prompt_length (%d tokens) with the tools' schemas",
                        len(prompts), grpo.max_prompt_length)
    logger.info("GRPO with %s", found.describe())
    return found
