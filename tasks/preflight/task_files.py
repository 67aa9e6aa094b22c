"""A run's task evaluations and benchmarks (`[[evaluation.tasks]]`, `[evaluation.benchmarks]`), checked before anything
is rented: every row of a task file read, the fields its graders need there, a function grader found in its file with
a signature the worker can call, a judge's key among the worker's secrets, a benchmarks' task folder holding the
harness's YAML files.

A grader's file is the user's code, run on the worker: here it is parsed (`ast`), never imported or executed, as the
reward files are (`tasks.storage.rewards`).
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from huggingface_hub.errors import HfHubHTTPError
from loraflow_worker.contract import GraderSettings, ModelSource
from loraflow_worker.contract.benchmark_tasks import harness_task_names, unknown_benchmark_tasks
from loraflow_worker.contract.task_evaluation import (
    BENCHMARK_TASK_NAME,
    PROMPT_COLUMNS,
    function_reference,
    task_prompt,
)
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from tasks.placement.plan import model_context
from tasks.preflight.chat_tokenizer import ChatTokenizer
from tasks.preflight.chats import tokenizer_folder
from tasks.settings import Settings
from tasks.storage.rewards import top_level_function
from tasks.storage.run_files import RunFile

ANSWER_COLUMN = "answer"
_NUMBER = re.compile(r"^\s*[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?\s*$")


@dataclass(frozen=True)
class TaskFileRead:
    """What a task file holds: its rows, the columns besides the prompt (what a function grader is handed), and the
    longest prompt (as messages), whose tokens with `max_new_tokens` must fit the model."""

    rows: int
    columns: frozenset[str]
    longest_prompt: list[dict[str, Any]] = field(default_factory=list)


def check_task_file(path: Path, where: str, graders: Sequence[GraderSettings],
                    shown: str | None = None) -> TaskFileRead:
    """Every row of a task file (JSONL: `messages` or `prompt`, and `answer` when a grader needs one; `path`: the copy
    read, `shown`: the path as the run names it); ValueError naming `where` (`evaluation.tasks[i].local_file`) and the
    line."""
    shown = shown or str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{where} {shown}: {type(e).__name__}: {e}; give a JSONL file of UTF-8 text") from e
    needs_answer = [g.label for g in graders if g.needs_answer]
    rows, columns, longest, longest_chars = 0, set(), [], -1
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        at = f"{where} line {number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{at}: not JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{at}: a row is a JSON object with `messages` or `prompt`, not {type(row).__name__}")
        given = task_prompt(row, at)
        prompt = [{"role": "user", "content": given}] if isinstance(given, str) else given
        if needs_answer:
            _check_answer(row, at, needs_answer, graders)
        columns.update(name for name in row if name not in PROMPT_COLUMNS)
        chars = sum(len(str(message.get("content", ""))) for message in prompt)
        if chars > longest_chars:
            longest, longest_chars = prompt, chars
        rows += 1
    if rows == 0:
        raise ValueError(f"{where} {shown}: no rows; give one JSON object a line")
    return TaskFileRead(rows, frozenset(columns), longest)


def _check_answer(row: dict[str, Any], at: str, needs_answer: list[str], graders: Sequence[GraderSettings]) -> None:
    answer = row.get(ANSWER_COLUMN)
    if answer is None or isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        got = "no `answer`" if answer is None else f"`answer` {json.dumps(answer)[:80]}"
        raise ValueError(f"{at}: {got}; the graders {', '.join(needs_answer)} compare each answer with the row's "
                         "expected `answer` (text or a number): add it to every row, or grade with `judge` or a "
                         "function only")
    for grader in graders:
        if grader.kind == "numeric" and isinstance(answer, str) and not _NUMBER.match(answer):
            raise ValueError(f"{at}: `answer` {answer[:80]!r} is not a number, and the `{grader.label}` grader "
                             "compares numbers")
        if grader.kind == "regex" and grader.pattern is None:
            try:
                re.compile(str(answer))
            except re.error as e:
                raise ValueError(f"{at}: `answer` {str(answer)[:80]!r} is not a regular expression ({e}), and the "
                                 f"`{grader.label}` grader has no `pattern`, so searches the answer for it") from None


GRADER_ARGUMENTS = ("prompts", "completions")
"""What a function grader is always called with, as a reward function is (and `answer`, and each other column of
the task file, by name)."""


def check_grader_function(reference: str, file: RunFile, where: str, columns: Collection[str]) -> None:
    """The file of a function grader (`file.py:function`), as it was read (`file`), parsed as text: the function
    defined at its top level, able to take `prompts`, `completions` and the task file's other `columns` by name.
    ValueError naming `where`."""
    function = function_reference(reference)[1]
    definition = top_level_function(file, function, f"{where} `{reference}`: grader file")
    if definition is None:
        return  # bound otherwise (an import, `grade = make_grader()`): its signature is the worker's to see
    problem = _signature_problem(definition, {*GRADER_ARGUMENTS, *columns})
    if problem:
        raise ValueError(f"{where} `{reference}`: {problem}; a grader is called as a reward function is: "
                         f"`def {function}(prompts, completions, **kwargs) -> list[float]` (the task file's other "
                         "columns, `answer` among them, in kwargs)")


def _signature_problem(definition: ast.FunctionDef | ast.AsyncFunctionDef, given: set[str]) -> str | None:
    arguments = definition.args
    if isinstance(definition, ast.AsyncFunctionDef):
        return "it is `async def`; graders are called and their scores read at once"
    if arguments.posonlyargs:
        return f"it takes `{arguments.posonlyargs[0].arg}` by position only; graders are called by keyword"
    named = arguments.args + arguments.kwonlyargs
    defaults = {a.arg for a in arguments.args[len(arguments.args) - len(arguments.defaults):]} | {
        a.arg for a, default in zip(arguments.kwonlyargs, arguments.kw_defaults) if default is not None}
    missing = [a.arg for a in named if a.arg not in given and a.arg not in defaults]
    if missing:
        return f"it needs `{missing[0]}`, which neither the worker nor the task file gives"
    if arguments.kwarg is None:
        unnamed = sorted(given - {a.arg for a in named})
        if unnamed:
            return f"it takes no `{unnamed[0]}` and no `**kwargs`"
    return None


def check_judge_key(grader: GraderSettings, where: str, worker_secrets: Collection[str]) -> None:
    """A judge's `judge_api_key_env` is one of the run's `[worker] secrets` (the worker reads the key there)."""
    key = grader.judge_api_key_env
    if grader.kind == "judge" and key is not None and key not in worker_secrets:
        held = ", ".join(sorted(worker_secrets)) or "none"
        raise ValueError(f"{where}.judge_api_key_env `{key}` is not one of the run's `[worker] secrets` ({held}): add "
                         f"`{key} = \"<a secret block's name>\"` under `[worker] secrets`")


class _HarnessYamlLoader(yaml.SafeLoader):
    """Reads a harness task YAML as data: its own tags (`!function utils.process_docs`) are read as nothing."""


_HarnessYamlLoader.add_multi_constructor("!", lambda loader, suffix, node: None)


def private_benchmark_tasks(files: dict[str, Path], task_dir: str,
                            where: str = "evaluation.benchmarks.task_dir") -> set[str]:
    """The task and group names the harness YAML files of the benchmarks' task folder define (`files`: its files as
    they were read, by their path inside it), read as data; ValueError naming `where` when it holds no YAML file or
    one does not parse."""
    yaml_files = {name: path for name, path in sorted(files.items()) if name.endswith((".yaml", ".yml"))}
    if not yaml_files:
        raise ValueError(f"{where} {task_dir}: holds no .yaml file; the harness reads each task from one")
    names = set()
    for name, path in yaml_files.items():
        try:
            document = yaml.load(path.read_text(encoding="utf-8"), Loader=_HarnessYamlLoader)  # noqa: S506
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
            raise ValueError(f"{where}: {name} is not YAML the harness reads: {e}") from e
        if isinstance(document, dict):
            for key in ("task", "group", "tag"):
                value = document.get(key)
                names.update([value] if isinstance(value, str) else
                             [v for v in value if isinstance(v, str)] if isinstance(value, list) else [])
    return names


def check_benchmark_names(names: Sequence[str], private: Collection[str],
                          where: str = "evaluation.benchmarks.tasks") -> None:
    """The benchmark task names a run asks for, each one the image's harness knows (its task list, shipped with the
    contract) or the run's own task folder defines (`private`). The one place the names are judged before renting."""
    defined = f"; your task folder defines {', '.join(sorted(private))}" if private else ""
    bad = [name for name in names if not BENCHMARK_TASK_NAME.match(name)]
    if bad:
        raise ValueError(f"{where}: {', '.join(repr(n) for n in bad)} is not an lm-evaluation-harness task name "
                         f"(letters, digits, `_`, `.`, `:`, `-`, `(`, `)`){defined}")
    if unknown := unknown_benchmark_tasks(names, private):
        raise ValueError(f"{where}: {', '.join(repr(n) for n in unknown)}: no such task, group or tag in the image's "
                         f"lm-evaluation-harness ({len(harness_task_names())} names; `lm_eval --tasks list` prints "
                         f"them){defined}; fix the name, or define the task in `{where.removesuffix('.tasks')}.task_dir`")


def prompt_tokens(tokenizer: ChatTokenizer, prompt: list[dict[str, Any]]) -> int:
    """The tokens of a prompt as the worker asks it: rendered with the model's chat template, the assistant's turn
    opened (`add_generation_prompt`), as training renders chats; the messages' text alone for a model without one."""
    if tokenizer.chat_template is None:
        return len(tokenizer("\n".join(str(m.get("content", "")) for m in prompt))["input_ids"])
    return len(tokenizer.apply_chat_template(prompt, add_generation_prompt=True))


def length_problem(where: str, prompt_length: int, max_new_tokens: int, context: int) -> str | None:
    """Why a task's longest prompt and its answers do not fit the model's context; None when they do."""
    if prompt_length + max_new_tokens <= context:
        return None
    room = context - prompt_length
    fix = f"lower {where}.max_new_tokens to {room} or less" if room > 0 else "shorten the task's prompts"
    return (f"{where}: its longest prompt is {prompt_length} tokens, and with max_new_tokens {max_new_tokens} its "
            f"answers would pass the model's context of {context} tokens: {fix}")


@task(name="check-task-lengths", cache_policy=NO_CACHE)
def check_task_lengths_task(model: ModelSource, prompts: list[tuple[str, list[dict[str, Any]], int]],
                            hub_token_secret: str | None = None) -> None:
    """Each task's longest prompt (`prompts`: the task's field, its longest prompt, its `max_new_tokens`) with its
    answer within the model's context, counted with the model's tokenizer; left to the worker where the tokenizer
    or the context cannot be read here."""
    if not prompts:
        return
    try:
        folder = tokenizer_folder(model, Settings().with_hub_token(hub_token_secret))
        config_file = folder / "config.json"
        config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
        tokenizer = ChatTokenizer.read(folder)
    except (OSError, ValueError, HfHubHTTPError) as e:
        get_run_logger().warning("The task prompts' lengths were not checked before renting: %s's tokenizer could not "
                                 "be read (%s: %s)", model.id, type(e).__name__, str(e)[:300])
        return
    context = model_context(config)
    if context is None or tokenizer is None:
        return  # the context or a tokenizer.json is not known: the worker's generation says
    problems = []
    for where, prompt, max_new_tokens in prompts:
        try:
            length = prompt_tokens(tokenizer, prompt)
        except Exception:  # noqa: BLE001, S112 - a template this reading cannot render is the worker's to render
            continue
        problem = length_problem(where, length, max_new_tokens, context)
        if problem:
            problems.append(problem)
    if problems:
        raise ValueError("; ".join(problems))
