"""A local dataset file is checked against TRL's conversational formats before anything is rented: SFT trains on
`messages` or prompt/completion lines, GRPO on prompt-only lines (extra columns go to the rewards), prompt/completion
or `messages`. A refusal names `dataset.local_file`, the line and the shapes that would do."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tasks.storage.artifacts import DATASET_FORMATS, check_dataset_jsonl

USER = [{"role": "user", "content": "What is 2 + 2?"}]
ASSISTANT = [{"role": "assistant", "content": "4"}]
MESSAGES = {"messages": USER + ASSISTANT}
PROMPT_COMPLETION = {"prompt": USER, "completion": ASSISTANT}
PROMPT_ONLY = {"prompt": USER, "answer": "4"}


def jsonl(tmp_path: Path, *rows: object) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.parametrize("row", [MESSAGES, PROMPT_COMPLETION], ids=["messages", "prompt-completion"])
def test_sft_accepts_messages_and_prompt_completion_lines(tmp_path, row):
    assert check_dataset_jsonl(jsonl(tmp_path, row, row, row), "sft") == 3


@pytest.mark.parametrize("row", [PROMPT_ONLY, PROMPT_COMPLETION, MESSAGES], ids=["prompt-only", "prompt-completion", "messages"])
def test_grpo_accepts_prompt_only_prompt_completion_and_messages_lines(tmp_path, row):
    assert check_dataset_jsonl(jsonl(tmp_path, row, row), "grpo") == 2


def test_blank_lines_are_not_examples(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(MESSAGES) + "\n\n" + json.dumps(MESSAGES) + "\n")
    assert check_dataset_jsonl(path, "sft") == 2


def test_sft_refuses_a_prompt_only_line_naming_the_line_and_the_shapes_it_takes(tmp_path):
    path = jsonl(tmp_path, MESSAGES, PROMPT_ONLY)
    with pytest.raises(ValueError) as refused:
        check_dataset_jsonl(path, "sft")
    message = str(refused.value)
    assert message.startswith(f"dataset.local_file {path}, line 2: a prompt-only line, which sft does not train on")
    assert DATASET_FORMATS["messages"] in message and DATASET_FORMATS["prompt-completion"] in message


def test_a_line_without_messages_or_prompt_is_refused_with_the_grpo_shapes(tmp_path):
    with pytest.raises(ValueError, match=r"line 1: no `messages` or `prompt`; expected \{\"prompt\": .*\"answer\"") as refused:
        check_dataset_jsonl(jsonl(tmp_path, {"text": "hello"}), "grpo")
    assert DATASET_FORMATS["prompt-only"] in str(refused.value)


@pytest.mark.parametrize("row, column", [
    ({"prompt": "What is 2 + 2?"}, "prompt"),
    ({"prompt": USER, "completion": []}, "completion"),
    ({"messages": [{"role": "user"}]}, "messages"),
    ({"prompt": [{"role": "user", "content": ["parts"]}]}, "prompt"),
], ids=["text-prompt", "empty-completion", "no-content", "non-text-content"])
def test_a_column_that_is_not_a_list_of_chat_messages_is_named(tmp_path, row, column):
    with pytest.raises(ValueError, match=rf"line 1: `{column}` is not a non-empty list of .* messages with text content"):
        check_dataset_jsonl(jsonl(tmp_path, row), "grpo")


def test_lines_that_change_format_or_columns_are_refused_naming_both_lines(tmp_path):
    with pytest.raises(ValueError, match=r"line 2: a prompt-completion line .* but line 1 is a messages line"):
        check_dataset_jsonl(jsonl(tmp_path, MESSAGES, PROMPT_COMPLETION), "sft")
    with pytest.raises(ValueError, match=r"line 3: a prompt-only line with columns `prompt`, but line 1 is a prompt-only "
                                         r"line with columns `answer`, `prompt`: every line needs the same"):
        check_dataset_jsonl(jsonl(tmp_path, PROMPT_ONLY, PROMPT_ONLY, {"prompt": USER}), "grpo")


def test_a_line_that_is_not_json_is_named(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(MESSAGES) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"line 2: not JSON"):
        check_dataset_jsonl(path, "sft")


def test_a_missing_or_empty_file_is_refused_naming_the_field(tmp_path):
    with pytest.raises(ValueError, match=r"dataset.local_file .*nope.jsonl does not exist"):
        check_dataset_jsonl(tmp_path / "nope.jsonl", "sft")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match=r"dataset.local_file .*empty.jsonl has no examples"):
        check_dataset_jsonl(tmp_path / "empty.jsonl", "grpo")


def test_the_shipped_tiny_chat_dataset_trains_both_algorithms():
    shipped = Path(__file__).resolve().parent.parent / "deployments" / "data" / "tiny-chat.jsonl"
    assert check_dataset_jsonl(shipped, "sft") == check_dataset_jsonl(shipped, "grpo") > 0
