"""Writes `docs/run-form.md`, the reference of every field of loraflow's run form and of the other flows'
parameters, from the pydantic models the flows validate them with (names, types, defaults, bounds and
descriptions all come from `model_fields`; nothing is written by hand).

    .venv/bin/python docs/run_form.py           # rewrite docs/run-form.md
    .venv/bin/python docs/run_form.py --check   # exit 1 when docs/run-form.md is not what the models say

`tests/test_docs.py` runs the check, so a field added or changed without regenerating the page fails the tests.
"""

from __future__ import annotations

import inspect
import json
import re
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "run-form.md"
COMMAND = ".venv/bin/python docs/run_form.py"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import annotated_types  # noqa: E402  (after the repository is on the path)
from pydantic import BaseModel  # noqa: E402
from pydantic.fields import FieldInfo  # noqa: E402


@dataclass(frozen=True)
class Form:
    """One flow parameter that is a pydantic model, documented as one part of the page."""

    title: str
    model: type[BaseModel]
    intro: str
    prefix: str = ""  # what the field names start with ("" for run files, whose keys are the names)


def forms() -> list[Form]:
    from flows.preload import PreloadSpec
    from flows.reconcile import ReconcilePolicy
    from flows.forms.evaluate import EvaluateSpec
    from flows.forms.serve import ServeSpec
    from flows.forms.overrides import RunOverrides
    from flows.forms.run import RunSpec
    from flows.forms.study import StudySettings
    from flows.volumes import VolumesPolicy

    return [
        Form("The run spec", RunSpec,
             "The `train` flow's `spec` parameter: what the Prefect UI's run form shows, what a run file "
             "(`deployments/*.toml`) holds and what `--param spec=...` replaces as a whole. A dotted name is a key in "
             "a TOML section: `training.learning_rate` is `learning_rate` under `[training]`, and "
             "`grpo.rewards[].name` is the `name` of each entry of `rewards` under `[grpo]`."),
        Form("The train flow's single-field parameters", RunOverrides,
             "The `train` flow's parameters beside `spec`."),
        Form("The study flow's `[study]` section", StudySettings,
             "The `study` flow's `spec` parameter is a run spec (above), the children's common fields, with this "
             "`[study]` section beside them ([studies](studies.md)).",
             prefix="study."),
        Form("The serve file", ServeSpec,
             "The `serve` flow's `spec` parameter, and a serve file (`deployments/qwen-serve.toml`): a base model and "
             "its LoRA adapters on RunPod's vLLM worker for a number of hours ([serving](serving.md)). A dotted name is "
             "a key in a TOML section: `serve.hours` is `hours` under `[serve]`."),
        Form("The evaluate file", EvaluateSpec,
             "The `evaluate` flow's `spec` parameter, and an evaluate file (`deployments/qwen-evaluate.toml`): a base "
             "model and its LoRA adapters asked the same tasks and benchmarks on one rented GPU, or through a serving "
             "endpoint's OpenAI route, and ranked ([evaluation](evaluation.md#compare-adapters-the-evaluate-flow)). "
             "`evaluate.tasks[]` and `evaluate.benchmarks` take what a run's `evaluation.tasks[]` and "
             "`evaluation.benchmarks` take (above)."),
        Form("The reconcile flow's policy", ReconcilePolicy,
             "The `reconcile` flow's `policy` parameter.",
             prefix="policy."),
        Form("The preload flow's spec", PreloadSpec,
             "The `preload` flow's `spec` parameter: which models to keep warm in which datacenters' network volumes.",
             prefix="spec."),
        Form("The volumes flow's policy", VolumesPolicy,
             "The `volumes` flow's `policy` parameter: which network volumes to keep.",
             prefix="policy."),
    ]


# --- types -------------------------------------------------------------------------------------------------------

def _model_in(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """The pydantic model a field holds (directly, optionally, or as a list of them), and whether it is a list."""
    if get_origin(annotation) is Annotated:
        return _model_in(get_args(annotation)[0])
    if get_origin(annotation) in (Union, types.UnionType):
        inner = [a for a in get_args(annotation) if a is not type(None)]
        return _model_in(inner[0]) if len(inner) == 1 else (None, False)
    if get_origin(annotation) is list:
        model, _ = _model_in(get_args(annotation)[0])
        return model, model is not None
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return annotation, False
    return None, False


def type_name(annotation: Any) -> str:
    """A readable type: `int`, `list[str]`, `"sft" | "grpo"`; None is left out of unions (see the default)."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return type_name(args[0])
    if origin in (Union, types.UnionType):
        return " | ".join(type_name(a) for a in args if a is not type(None))
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (list, tuple, dict):
        return f"{origin.__name__}[{', '.join(type_name(a) for a in args)}]"
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return "table"
    return getattr(annotation, "__name__", str(annotation))


def _base_kind(annotation: Any) -> str:
    """What a length bound counts: characters of a string, items of a list, entries of a map."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _base_kind(get_args(annotation)[0])
    if origin in (Union, types.UnionType):
        kinds = {_base_kind(a) for a in get_args(annotation) if a is not type(None)}
        return kinds.pop() if len(kinds) == 1 else "items"
    if annotation is str:
        return "characters"
    if origin is dict:
        return "entries"
    return "items"


# --- values ------------------------------------------------------------------------------------------------------

def number(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    if isinstance(value, int):
        return f"{value:,}"
    return repr(value)


def value_text(value: Any) -> str:
    """A value as a run file (TOML) writes it."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(value_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{}" if not value else "{ " + ", ".join(f"{k} = {value_text(v)}" for k, v in value.items()) + " }"
    if isinstance(value, BaseModel):
        return value_text(value.model_dump(mode="json"))
    return str(value)


def default_text(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    return value_text(field.get_default(call_default_factory=True, validated_data={}))


def _count(n: int, kind: str) -> str:
    return f"{number(n)} {kind if n != 1 else kind.removesuffix('s')}"


def _bounds(metadata: list[Any], kind: str) -> list[str]:
    out = []
    for item in metadata:
        if isinstance(item, annotated_types.Ge):
            out.append(f"≥ {number(item.ge)}")
        elif isinstance(item, annotated_types.Gt):
            out.append(f"> {number(item.gt)}")
        elif isinstance(item, annotated_types.Le):
            out.append(f"≤ {number(item.le)}")
        elif isinstance(item, annotated_types.Lt):
            out.append(f"< {number(item.lt)}")
        elif isinstance(item, annotated_types.MultipleOf):
            out.append(f"a multiple of {number(item.multiple_of)}")
        elif isinstance(item, annotated_types.MinLen):
            out.append(f"at least {_count(item.min_length, kind)}")
        elif isinstance(item, annotated_types.MaxLen):
            out.append(f"at most {_count(item.max_length, kind)}")
        elif getattr(item, "pattern", None) is not None:
            out.append(f"matches `{item.pattern}`")
    return out


def constraints_text(field: FieldInfo) -> str:
    out = _bounds(field.metadata, _base_kind(field.annotation))
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    for key, sign in (("minimum", "≥"), ("maximum", "≤")):
        if key in extra:
            out.append(f"{sign} {number(extra[key])}")
    # Bounds on each item of a list or each value of a map (`dict[str, Annotated[str, Field(max_length=...)]]`).
    annotation = field.annotation
    if get_origin(annotation) in (Union, types.UnionType):
        inner = [a for a in get_args(annotation) if a is not type(None)]
        annotation = inner[0] if len(inner) == 1 else annotation
    if get_origin(annotation) in (list, dict):
        item = get_args(annotation)[-1]
        if get_origin(item) is Annotated:
            metadata = []
            for extra_item in get_args(item)[1:]:
                metadata += extra_item.metadata if isinstance(extra_item, FieldInfo) else [extra_item]
            each = "each value" if get_origin(annotation) is dict else "each item"
            out += [f"{each} {bound}" for bound in _bounds(metadata, _base_kind(get_args(item)[0]))]
    return ", ".join(out)


# --- the page ----------------------------------------------------------------------------------------------------

def cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def doc_of(model: type[BaseModel]) -> str:
    return inspect.cleandoc(model.__doc__ or "")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _section_note(field: FieldInfo) -> str:
    if field.is_required():
        return "Required."
    if field.default is None:
        return "Optional: left out, it is unset."
    return "May be left out: its fields' defaults apply."


def render_model(model: type[BaseModel], prefix: str, title: str, depth: int, lines: list[str],
                 toc: list[tuple[int, str]], note: str = "") -> None:
    """A table of `model`'s plain fields under `title`, then one part per field that is itself a model."""
    lines += [f"{'#' * depth} {title}", ""]
    toc.append((depth, title))
    if note:
        lines += [note, ""]
    if doc_of(model):
        lines += [doc_of(model), ""]
    plain = [(name, field) for name, field in model.model_fields.items() if _model_in(field.annotation)[0] is None]
    nested = [(name, field) for name, field in model.model_fields.items() if _model_in(field.annotation)[0] is not None]
    if plain:
        lines += ["| field | type | default | constraints | description |", "|---|---|---|---|---|"]
        for name, field in plain:
            lines.append(f"| `{prefix}{name}` | `{cell(type_name(field.annotation))}` | `{cell(default_text(field))}` | "
                         f"{cell(constraints_text(field))} | {cell(field.description or '(no description)')} |")
        lines.append("")
    for name, field in nested:
        sub, is_list = _model_in(field.annotation)
        dotted = f"{prefix}{name}"
        heading = f"`[[{dotted}]]`" if is_list else f"`[{dotted}]`"
        parts = [field.description or "", _section_note(field)]
        if is_list:
            bounds = constraints_text(field)
            parts.append(f"A list of tables, one per entry ({bounds})." if bounds else "A list of tables, one per entry.")
        render_model(sub, f"{dotted}[]." if is_list else f"{dotted}.", heading, min(depth + 1, 4), lines, toc,
                     " ".join(p for p in parts if p))


def render() -> str:
    lines: list[str] = []
    toc: list[tuple[int, str]] = []
    for form in forms():
        render_model(form.model, form.prefix, form.title, 2, lines, toc, form.intro)
    head = [
        "# Run form reference",
        "",
        "Every field of the `train` flow's run form (its `spec`, as the Prefect UI and run files give it), the "
        "`train` flow's single-field parameters, and the `reconcile`, `preload` and `volumes` flows' parameters: "
        "each field's name, type, default, constraints and description.",
        "",
        f"<!-- Generated from the pydantic models by docs/run_form.py; do not edit by hand. Regenerate with "
        f"`{COMMAND}`. -->",
        "",
        "A section whose default is `unset` is left out of a run file; `required` fields have no default. A run is "
        "checked against these models before anything is rented, and rules that join several fields (exactly one "
        "dataset source, GRPO's batch a multiple of its group size, ...) are named in the section texts. How the "
        "sections are used: [what a run trains](training.md); a first run: [running on RunPod](running-on-runpod.md).",
        "",
    ]
    head += [f"{'  ' * (depth - 2)}- [{title.replace('`', '')}](#{slug(title)})" for depth, title in toc]
    return "\n".join(head + [""] + lines).rstrip() + "\n"


def main(argv: list[str]) -> int:
    page = render()
    if "--check" in argv:
        if not PAGE.exists() or PAGE.read_text() != page:
            print(f"{PAGE.relative_to(ROOT)} is stale: regenerate it with `{COMMAND}`", file=sys.stderr)
            return 1
        print(f"{PAGE.relative_to(ROOT)} is current")
        return 0
    PAGE.write_text(page)
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
