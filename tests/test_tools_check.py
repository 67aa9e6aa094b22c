"""A GRPO run's tools (`grpo.tools = "tools.py"`, `grpo.environment = "env.py:Class"`) are checked before anything
is rented: every tool must be one transformers can show the model (a type hint per parameter, a docstring with an
`Args:` line for each), an environment needs `reset` and a tool method. The file, the user's code, is read from its
source and never run here (the attacks on that: `test_tools_attacks.py`); what only running it could tell is left to
the worker, with a note. The model's chat template must render a whole tool conversation."""

from __future__ import annotations

from pathlib import Path

import jinja2
import pytest

from tasks.preflight.tools import check_tools, tool_template_problem

GOOD_TOOLS = '''
from os.path import join  # imported: not a tool


def lookup(city: str, metric: bool = True) -> str:
    """Look up the weather of a city.

    Args:
        city: The city's name.
        metric: Whether to answer in degrees Celsius.
    """
    return _fetch(city)


async def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def _fetch(city: str) -> str:
    return "sunny"
'''

GOOD_ENVIRONMENT = '''
class Shop:
    def __init__(self):
        self.basket = []

    def reset(self, **row) -> None:
        self.basket = []

    def buy(self, item: str) -> str:
        """Put an item in the basket.

        Args:
            item: What to buy.
        """
        self.basket.append(item)
        return "ok"

    def get_reward(self) -> float:
        return float(len(self.basket))

    def _total(self) -> int:
        return len(self.basket)
'''


def write(folder: Path, name: str, source: str) -> str:
    (folder / name).write_text(source, encoding="utf-8")
    return name


def test_a_good_tools_file_passes_and_lists_its_own_public_functions(tmp_path):
    check = check_tools(write(tmp_path, "tools.py", GOOD_TOOLS), None, tmp_path)

    assert check.tool_names == ["lookup", "add"]
    assert check.tools_file == (tmp_path / "tools.py").resolve()
    assert check.environment_file is None
    assert check.note is None
    assert check.describe() == "tools: lookup, add (from tools.py)"


def test_a_good_environment_passes_with_its_public_methods_but_reset_and_get_reward(tmp_path):
    check = check_tools(None, write(tmp_path, "env.py", GOOD_ENVIRONMENT) + ":Shop", tmp_path)

    assert check.tool_names == ["buy"]
    assert check.environment_file == (tmp_path / "env.py").resolve()
    assert check.describe() == "tools: buy (from env.py:Shop)"


def test_a_tool_parameter_without_a_type_hint_is_refused_naming_the_function(tmp_path):
    source = GOOD_TOOLS.replace("def lookup(city: str,", "def lookup(city,")

    with pytest.raises(ValueError) as refused:
        check_tools(write(tmp_path, "tools.py", source), None, tmp_path)

    message = str(refused.value)
    assert message.startswith("grpo.tools `tools.py`: tool `lookup` cannot be shown to the model")
    assert "city is missing a type hint" in message
    assert "give every parameter a type hint" in message


def test_a_parameter_missing_from_the_docstring_args_is_refused_naming_function_and_parameter(tmp_path):
    source = GOOD_TOOLS.replace("        b: The second number.\n", "")

    with pytest.raises(ValueError, match=r"grpo.tools `tools.py`: tool `add` cannot be shown to the model: .*'b'"):
        check_tools(write(tmp_path, "tools.py", source), None, tmp_path)


def test_a_tools_file_without_a_public_function_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"grpo.tools `tools.py`: .* defines no public function: define at least one"):
        check_tools(write(tmp_path, "tools.py", "from os.path import join\n\ndef _hidden() -> None: ...\n"), None,
                    tmp_path)


def test_a_missing_tools_file_is_refused_naming_the_field_and_the_path(tmp_path):
    with pytest.raises(ValueError, match=r"grpo.tools `nowhere.py`: .*nowhere.py does not exist.*fix the path"):
        check_tools("nowhere.py", None, tmp_path)


def test_an_environment_without_reset_is_refused(tmp_path):
    source = GOOD_ENVIRONMENT.replace("def reset(", "def restart(")

    with pytest.raises(ValueError, match=r"grpo.environment `env.py:Shop`: class `Shop` has no `reset` method"):
        check_tools(None, write(tmp_path, "env.py", source) + ":Shop", tmp_path)


def test_an_environment_class_the_file_lacks_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"grpo.environment `env.py:Store`: .* has no `Store` \(its classes: `Shop`\)"):
        check_tools(None, write(tmp_path, "env.py", GOOD_ENVIRONMENT) + ":Store", tmp_path)


def test_a_file_whose_import_would_raise_is_read_not_run(tmp_path):
    source = GOOD_TOOLS + "\nLIMIT = 1 / 0\n"

    check = check_tools(write(tmp_path, "tools.py", source), None, tmp_path)

    assert check.tool_names == ["lookup", "add"] and check.note is None  # the worker imports it, and says so


def test_a_file_that_is_not_valid_python_is_refused_naming_the_line(tmp_path):
    with pytest.raises(ValueError, match=r"grpo.tools `tools.py`: .*tools.py is not valid Python \(line 3: "):
        check_tools(write(tmp_path, "tools.py", "def lookup(city: str) -> str:\n    pass\n  oops\n"), None, tmp_path)


def test_a_sibling_module_it_imports_is_named_in_a_warning_as_it_is_not_shipped_with_the_file(tmp_path):
    write(tmp_path, "weather_data.py", "CITIES = ['Oslo']\n")
    source = "from weather_data import CITIES\n" + GOOD_TOOLS

    check = check_tools(write(tmp_path, "tools.py", source), None, tmp_path)

    assert "line 1 imports `weather_data`, a module beside it here that the run does not ship" in check.note


def test_a_file_importing_a_module_not_installed_here_is_read_all_the_same(tmp_path):
    source = "import loraflow_only_on_the_worker\n" + GOOD_TOOLS

    check = check_tools(write(tmp_path, "tools.py", source), None, tmp_path)

    assert check.tool_names == ["lookup", "add"] and check.note is None
    assert [schema["function"]["name"] for schema in check.schemas] == ["lookup", "add"]


def test_a_bad_tool_in_a_file_importing_a_module_not_installed_here_is_refused_by_name(tmp_path):
    source = "import loraflow_only_on_the_worker\n" + GOOD_TOOLS.replace("metric: bool = True", "metric=True")

    with pytest.raises(ValueError, match=r"tool `lookup` cannot be shown to the model: Argument metric is missing a "
                                         r"type hint"):
        check_tools(write(tmp_path, "tools.py", source), None, tmp_path)


def test_an_environment_importing_a_module_not_installed_here_is_read_all_the_same(tmp_path):
    source = "import loraflow_only_on_the_worker\n" + GOOD_ENVIRONMENT

    check = check_tools(None, write(tmp_path, "env.py", source) + ":Shop", tmp_path)

    assert check.tool_names == ["buy"] and check.note is None


def test_a_decorated_tool_is_left_to_the_worker_naming_its_line(tmp_path):
    source = "import functools\n" + GOOD_TOOLS.replace("def lookup(", "@functools.cache\ndef lookup(")

    check = check_tools(write(tmp_path, "tools.py", source), None, tmp_path)

    assert check.tool_names == ["add"] and check.schemas is None
    assert "line 6: `lookup` has a decorator, which only running the file applies" in check.note
    assert "the worker checks those tools as the job starts" in check.note


def test_a_hint_naming_another_packages_type_is_left_to_the_worker(tmp_path):
    source = "from pydantic import HttpUrl\n" + GOOD_TOOLS.replace("city: str,", "city: HttpUrl,")

    check = check_tools(write(tmp_path, "tools.py", source), None, tmp_path)

    assert check.schemas is None and "the hints of `lookup` name `HttpUrl`, known only by running the file" in check.note


def test_a_hint_naming_nothing_the_file_defines_is_refused(tmp_path):
    source = GOOD_TOOLS.replace("city: str,", "city: Town,")

    with pytest.raises(ValueError, match=r"tool `lookup` cannot be shown to the model: its hint `Town` \(line \d+\): "
                                         r"`Town` is not defined in the file"):
        check_tools(write(tmp_path, "tools.py", source), None, tmp_path)


def test_an_environment_inheriting_from_another_packages_class_is_left_to_the_worker(tmp_path):
    source = "from shop_lib import BaseShop\n" + GOOD_ENVIRONMENT.replace("class Shop:", "class Shop(BaseShop):")

    check = check_tools(None, write(tmp_path, "env.py", source) + ":Shop", tmp_path)

    assert check.schemas is None
    assert "class `Shop` inherits from `BaseShop`, which is not a class of the file" in check.note


BIG_SHOP = '''

class BigShop(Shop):
    def buy(self, item: str) -> str:
        return super().buy(item) + "!"

    def weigh(self, item: str) -> float:
        """Weigh an item.

        Args:
            item: What to weigh.
        """
        return 1.0
'''


def test_an_environment_inherits_tools_and_their_docstrings_from_a_class_of_the_file(tmp_path):
    check = check_tools(None, write(tmp_path, "env.py", GOOD_ENVIRONMENT + BIG_SHOP) + ":BigShop", tmp_path)

    assert check.tool_names == ["buy", "weigh"]
    assert check.schemas[0]["function"]["description"] == "Put an item in the basket."


CHATML_WITH_TOOLS = """
{%- if tools %}<|im_start|>system
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "tool" %}<|im_start|>user
<tool_response>{{ message.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}
{%- for call in message.tool_calls or [] %}
<tool_call>{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}</tool_call>
{%- endfor %}<|im_end|>
{% endif %}
{%- endfor %}
"""

CHATML_WITHOUT_TOOL_MESSAGES = """
{%- for message in messages if message.role != "tool" %}<|im_start|>{{ message.role }}
{{ message.content }}
{%- for call in message.tool_calls or [] %}
<tool_call>{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}</tool_call>
{%- endfor %}<|im_end|>
{% endfor %}
"""


def renderer(template: str):
    compiled = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(template)
    return lambda messages, tools: compiled.render(messages=messages, tools=tools)


def test_a_chat_template_that_renders_a_tool_conversation_passes():
    assert tool_template_problem(renderer(CHATML_WITH_TOOLS), "chatml-tools") is None


def test_a_chat_template_that_drops_tool_messages_is_refused_naming_it():
    problem = tool_template_problem(renderer(CHATML_WITHOUT_TOOL_MESSAGES), "chatml-plain")

    assert problem is not None
    assert problem.startswith("chat template chatml-plain does not render tool conversations: its text leaves out "
                              "the tool's answer")
    assert "pick a model whose chat template renders tool calls and tool results" in problem


def test_a_chat_template_that_raises_on_a_tool_conversation_is_refused():
    strict = "{% for m in messages %}{% if m.role == 'tool' %}{{ raise('no tools') }}{% endif %}{% endfor %}"

    problem = tool_template_problem(renderer(strict), "strict")

    assert problem is not None and problem.startswith("chat template strict cannot render a tool conversation")


def _tokenizer_files(model: Path, folder: Path, chat_template: str | None = None) -> Path:
    import json
    import shutil

    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (model / name).exists():
            shutil.copy(model / name, folder / name)
    if chat_template is not None:
        (folder / "chat_template.jinja").unlink(missing_ok=True)
        config = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": chat_template}))
    return folder


def test_the_tiny_models_chat_template_renders_tools(tiny_model, tmp_path):
    from tasks.preflight.tools import check_tool_template

    check_tool_template(_tokenizer_files(tiny_model, tmp_path / "tok"), "tiny")


def test_a_model_whose_template_drops_tool_calls_is_refused_naming_it(tiny_model, tmp_path):
    from tasks.preflight.tools import check_tool_template

    plain = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + (m['content'] or '') + '<|im_end|>\\n' }}"
             "{% endfor %}")
    with pytest.raises(ValueError, match=r"chat template of tiny does not render tool conversations: its text leaves "
                                         r"out the tool call's name"):
        check_tool_template(_tokenizer_files(tiny_model, tmp_path / "tok", plain), "tiny")


def _prompt_file(path: Path, words: list[int]) -> Path:
    """A prompt-only JSONL file, one chat prompt per entry of `words` with that many words."""
    import json

    path.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": " ".join(["weather"] * n)}]}) + "\n"
                            for n in words))
    return path


def test_the_tools_schemas_come_back_with_the_check(tmp_path):
    found = check_tools(write(tmp_path, "tools.py", GOOD_TOOLS), None, tmp_path)
    assert [schema["function"]["name"] for schema in found.schemas] == ["lookup", "add"]


def test_a_tool_run_whose_longest_prompt_fits_the_limit_with_the_schemas_passes(tiny_model, tmp_path):
    from tasks.preflight.tool_prompts import local_prompts, prompt_length_problem
    from tasks.preflight.tools import check_tool_template

    schemas = check_tools(write(tmp_path, "tools.py", GOOD_TOOLS), None, tmp_path).schemas
    prompts = local_prompts([(str(_prompt_file(tmp_path / "p.jsonl", [3, 5])), "auto", {})])
    check_tool_template(_tokenizer_files(tiny_model, tmp_path / "tok"), "tiny",
                        lambda tokenizer: prompt_length_problem(tokenizer, schemas, prompts, 4096))


def test_a_tool_run_whose_prompts_with_the_schemas_pass_the_limit_is_refused_naming_both_numbers(tiny_model,
                                                                                                   tmp_path):
    from tasks.preflight.tool_prompts import local_prompts, prompt_length_problem, prompt_tokens
    from tasks.preflight.tools import check_tool_template

    schemas = check_tools(write(tmp_path, "tools.py", GOOD_TOOLS), None, tmp_path).schemas
    prompts = local_prompts([(str(_prompt_file(tmp_path / "p.jsonl", [3, 40, 5])), "auto", {})])
    folder = _tokenizer_files(tiny_model, tmp_path / "tok")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    bare = prompt_tokens(tokenizer, prompts[1][1], None)
    longest = prompt_tokens(tokenizer, prompts[1][1], schemas)
    assert bare < longest  # the schemas are what pushes it over
    with pytest.raises(ValueError) as refused:
        check_tool_template(folder, "tiny", lambda tok: prompt_length_problem(tok, schemas, prompts, bare))
    message = str(refused.value)
    assert f"grpo.max_prompt_length {bare}" in message and f"{longest} tokens" in message, message
    assert f"line 2 of {tmp_path / 'p.jsonl'}" in message and f"at least {longest}" in message, message


def test_a_chat_datasets_prompt_is_its_messages_without_the_last_answer(tmp_path):
    import json

    from tasks.preflight.tool_prompts import local_prompts

    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    (tmp_path / "chats.jsonl").write_text(json.dumps({"messages": chat}) + "\n\n" + json.dumps({"prompt": "text"}))
    assert local_prompts([(str(tmp_path / "chats.jsonl"), "auto", {})]) == [
        (f"line 1 of {tmp_path / 'chats.jsonl'}", chat[:1])]
