"""The tiny offline model: builds deterministically, loads with the standard classes, speaks ChatML; its corpus
ships in the worker's package; its tokenizer can take a real model's vocabulary size."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import loraflow_worker
from loraflow_worker.self_test.tiny_model import DEFAULT_CORPUS as TINY_CHAT
from loraflow_worker.self_test.tiny_model import VOCAB_SIZE, corpus_from_jsonl, main, train_tokenizer

WORKER_IMAGE = Path(__file__).resolve().parents[1]
REPOSITORY_DATASET = WORKER_IMAGE.parent / "deployments" / "data" / "tiny-chat.jsonl"


def _first_chat():
    return json.loads(TINY_CHAT.read_text().splitlines()[0])["messages"]


def test_tiny_model_loads_with_auto_classes(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)

    assert model.config.model_type == "qwen3"
    assert model.config.num_hidden_layers == 2 and model.config.hidden_size == 64
    assert len(tokenizer) == VOCAB_SIZE == model.config.vocab_size
    assert tokenizer.eos_token == tokenizer.pad_token == "<|endoftext|>"
    ids = tokenizer("What is the capital of France?", return_tensors="pt").input_ids
    assert model(ids).logits.shape == (1, ids.shape[1], VOCAB_SIZE)


def test_chat_template_renders_chatml(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = tokenizer.apply_chat_template(_first_chat(), tokenize=False)
    assert text == (
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\nThe capital of France is Paris.<|im_end|>\n"
    )
    prompt = tokenizer.apply_chat_template(_first_chat()[:1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")


def test_chat_template_marks_assistant_tokens_for_assistant_only_loss(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    out = tokenizer.apply_chat_template(_first_chat(), tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    masked = [tok for tok, m in zip(out["input_ids"], out["assistant_masks"]) if m]
    assert tokenizer.decode(masked) == "The capital of France is Paris.<|im_end|>"


def test_tokenizer_is_trained_on_the_corpus(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    # Byte-level would be 31 tokens; merges learnt from the dataset make common words single tokens.
    assert len(tokenizer("The capital of France is Paris.").input_ids) <= 12
    assert tokenizer.decode(tokenizer("Grüße, 東京!").input_ids) == "Grüße, 東京!"  # any text encodes


def test_cli_build_is_deterministic(tiny_model_dir, tmp_path):
    main(["--out", str(tmp_path / "again"), "--corpus", str(TINY_CHAT)])
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "again")
    first = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    for (name, a), (_, b) in zip(first.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name
    assert (tmp_path / "again" / "tokenizer.json").read_bytes() == (tiny_model_dir / "tokenizer.json").read_bytes()


def test_the_corpus_is_package_data_and_the_repositorys_tiny_chat_dataset():
    assert TINY_CHAT == Path(loraflow_worker.__file__).parent / "data" / "tiny-chat.jsonl"
    assert TINY_CHAT.read_bytes() == REPOSITORY_DATASET.read_bytes()  # one dataset, two places: keep them equal


def test_the_worker_wheel_carries_the_corpus(tmp_path):
    # The image installs the worker from its wheel and its build context has no deployments/ folder.
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", str(tmp_path),
         str(WORKER_IMAGE)], capture_output=True, text=True, timeout=240,
    )
    assert done.returncode == 0, done.stderr
    (wheel,) = tmp_path.glob("loraflow_worker-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        assert archive.read("loraflow_worker/data/tiny-chat.jsonl") == TINY_CHAT.read_bytes()


def test_a_padded_vocabulary_encodes_as_the_learnt_one_and_decodes_its_fillers():
    corpus = corpus_from_jsonl([TINY_CHAT])
    learnt, padded = train_tokenizer(corpus), train_tokenizer(corpus, vocab_size=2048)
    assert (len(learnt), len(padded)) == (VOCAB_SIZE, 2048)
    text = "The capital of France is Paris. <|filler_2047|>"
    assert padded(text).input_ids == learnt(text).input_ids  # no text encodes to a filler
    assert padded.decode([2047, 600]) == "<|filler_2047|><|filler_600|>"
