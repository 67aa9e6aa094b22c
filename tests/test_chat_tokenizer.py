"""The fast path of the first-chats check reads a model's tokenizer without transformers and renders, tokenizes and
masks its chats exactly as transformers' own tokenizer does (the one training uses), for templates with and without
generation markers, with special tokens, `tojson` and loop controls."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from loraflow_worker.dataset.loss_mask import ChatTemplate, mask_chat
from transformers import AutoTokenizer

from tasks.preflight.chat_tokenizer import ChatTokenizer
from tasks.preflight.chats import first_chats
from tests.conftest import DATASET

CHATML = (  # ChatML without generation markers: its assistant mask is derived from each turn's prefix
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
FEATURES = (  # the special tokens as variables, transformers' `tojson`, loop controls, trimmed blocks
    "{{ bos_token }}{% for message in messages %}\n"
    "  {% if message['role'] == 'system' %}{% continue %}{% endif %}\n"
    "  {{ message['role'] }}: {{ message['content'] | tojson }}\n"
    "  {% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}{{ eos_token }}"
    "{% endgeneration %}{% endif %}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)
CHATS = [*first_chats(DATASET)[:5],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "<b>Café</b> & \"quotes\"?"},
          {"role": "assistant", "content": "Ça va — <ok>."}, {"role": "user", "content": "Again"},
          {"role": "assistant", "content": "Oui."}]]


def model_folder(tiny_model: Path, folder: Path, template: str | None, bos: str | None = None) -> Path:
    shutil.copytree(tiny_model, folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if template is not None:
        tokenizer.chat_template = template
        (folder / "chat_template.jinja").unlink(missing_ok=True)
    if bos is not None:
        tokenizer.bos_token = bos
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(params=["own", "chatml", "features"])
def folder(request, tiny_model, tmp_path) -> Path:
    template = {"own": None, "chatml": CHATML, "features": FEATURES}[request.param]
    return model_folder(tiny_model, tmp_path / request.param, template, bos="<|im_start|>")


def test_the_fast_tokenizer_renders_every_chat_as_transformers_does(folder):
    slow, fast = AutoTokenizer.from_pretrained(folder), ChatTokenizer.read(folder)
    assert fast.chat_template == slow.chat_template and fast.special_tokens == slow.special_tokens_map
    for chat in CHATS:
        for prompt in (False, True):
            assert fast.apply_chat_template(chat, tokenize=False, add_generation_prompt=prompt) == \
                slow.apply_chat_template(chat, tokenize=False, add_generation_prompt=prompt)


def test_the_fast_tokenizer_tokenizes_with_the_offsets_transformers_gives(folder):
    slow, fast = AutoTokenizer.from_pretrained(folder), ChatTokenizer.read(folder)
    for chat in CHATS:
        text = slow.apply_chat_template(chat, tokenize=False)
        expected = slow(text, add_special_tokens=False, return_offsets_mapping=True)
        got = fast(text, add_special_tokens=False, return_offsets_mapping=True)
        assert got["input_ids"] == expected["input_ids"]
        assert got["offset_mapping"] == [tuple(pair) for pair in expected["offset_mapping"]]


def test_the_fast_tokenizer_masks_the_assistant_turns_as_transformers_does(folder):
    slow, fast = AutoTokenizer.from_pretrained(folder), ChatTokenizer.read(folder)
    template = ChatTemplate(slow.chat_template, "the model's own")
    for chat in CHATS:
        expected = mask_chat(slow, chat, template)
        assert sum(expected.assistant_masks) > 0
        assert mask_chat(fast, chat, template) == expected


def test_named_and_legacy_special_tokens_are_read_as_transformers_reads_them(tiny_model, tmp_path):
    folder = model_folder(tiny_model, tmp_path / "legacy", None)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("added_tokens_decoder", None)
    config["bos_token"] = "<|im_start|>"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "special_tokens_map.json").write_text(json.dumps(
        {"unk_token": {"content": "<|im_end|>", "lstrip": False, "normalized": False, "rstrip": False,
                       "single_word": False}, "eos_token": "<|im_end|>"}))
    expected = AutoTokenizer.from_pretrained(folder).special_tokens_map
    assert ChatTokenizer.read(folder).special_tokens == expected
    assert expected["unk_token"] == expected["eos_token"] == "<|im_end|>" and expected["bos_token"] == "<|im_start|>"


def test_a_model_without_tokenizer_json_has_no_fast_tokenizer(tiny_model, tmp_path):
    folder = model_folder(tiny_model, tmp_path / "vocab-only", None)
    (folder / "tokenizer.json").unlink()
    assert ChatTokenizer.read(folder) is None
