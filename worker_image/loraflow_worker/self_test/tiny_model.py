"""Build a tiny Qwen3-architecture model offline: random weights and a tokenizer trained locally.

Local mode, the tests and the demo train this model instead of a real one, so nothing is downloaded
from the Hub. It is small enough to train 50 LoRA steps in a few seconds on one CPU core, and large
enough to memorise the shipped chat dataset.

    python -m loraflow_worker.self_test.tiny_model --out /tmp/tiny-qwen3
    python -m loraflow_worker.self_test.tiny_model --out /tmp/tiny-qwen3 --corpus my-chat.jsonl other.jsonl

The result is an ordinary `save_pretrained` folder: pass its path as the job's `model.id`.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

DEFAULT_CORPUS = Path(__file__).resolve().parents[1] / "data" / "tiny-chat.jsonl"
"""The shipped chat dataset (package data in `loraflow_worker/data/`, so installed workers and the image have it; the
repository's `deployments/data/tiny-chat.jsonl` is a link to it): its texts train the default tokenizer."""

VOCAB_SIZE = 512
SEED = 0
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"

# ChatML, as Qwen models use. The {% generation %} markers let transformers build an assistant-token
# mask, which TRL's `assistant_only_loss=True` requires; they render as nothing otherwise. With tools it renders as
# Qwen2.5 does (the tools' JSON schemas in a system turn, `<tool_call>` JSON in the assistant's turn, the tools'
# answers as `<tool_response>` in a user turn); a chat without tools renders exactly as plain ChatML.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{ '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{ '# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{ '\\n</tools>\\nCall a tool with <tool_call>\\n{\"name\": <name>, \"arguments\": <arguments>}\\n</tool_call>"
    "<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] }}"
    "{%- if message.tool_calls %}{%- for call in message.tool_calls %}"
    "{%- set function = call.function if call.function is defined else call %}"
    "{{ ('\\n' if message['content'] or not loop.first else '') + '<tool_call>\\n{\"name\": \"' + function.name"
    " + '\", \"arguments\": ' + (function.arguments if function.arguments is string else function.arguments | tojson)"
    " + '}\\n</tool_call>' }}"
    "{%- endfor %}{%- endif %}"
    "{{ '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{%- endif %}"
    "{{ '\\n<tool_response>\\n' + (message['content'] | string) + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)

RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {
            "open": "<tool_call>",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}
"""How transformers reads an answer the template's way back into a message with `tool_calls`
(`tokenizer.parse_response`, which TRL's GRPO uses to find the model's tool calls)."""

BUILTIN_TEXT = (
    "The quick brown fox jumps over the lazy dog. A model learns the patterns of its training data, "
    "one token at a time. Questions and answers: what is the answer? The answer is short. "
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 20 30 40 50 60 70 80 90 100. "
    "user assistant system: you are a helpful assistant."
)


def build_tiny_model(out_dir: Path, corpus: Iterable[str]) -> Path:
    """Train a byte-level BPE tokenizer on `corpus` (+ a built-in text), build a 2-layer Qwen3 with
    random weights (fixed seed), save both into `out_dir` and return it. Deterministic for a given corpus."""
    out_dir = Path(out_dir)
    tokenizer = train_tokenizer(corpus)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        # Larger than Qwen's 0.02 so that a random 64-wide model starts with useful signal: LoRA SFT
        # then takes the loss from ~6.4 to ~1.3 in 50 steps.
        initializer_range=0.1,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(SEED)
    model = Qwen3ForCausalLM(config)
    model.generation_config.eos_token_id = [tokenizer.convert_tokens_to_ids(IM_END), tokenizer.eos_token_id]
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def corpus_from_jsonl(paths: Iterable[Path]) -> list[str]:
    """Texts of chat (`messages`), prompt/completion or `text` rows of JSONL files."""
    texts: list[str] = []
    for path in paths:
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            row = json.loads(line)
            texts.extend(f"{m['role']}\n{m['content']}" for m in row.get("messages", []))
            texts.extend(row[key] for key in ("text", "prompt", "completion") if isinstance(row.get(key), str))
    return texts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build a tiny random-weight Qwen3 model and its tokenizer.")
    parser.add_argument("--out", type=Path, required=True, help="Folder to write the model into.")
    parser.add_argument(
        "--corpus",
        type=Path,
        nargs="+",
        default=[DEFAULT_CORPUS],
        help=f"JSONL files whose texts train the tokenizer (default: {DEFAULT_CORPUS}).",
    )
    args = parser.parse_args(argv)
    missing = [str(p) for p in args.corpus if not p.is_file()]
    if missing:
        parser.error(f"corpus file(s) not found: {', '.join(missing)}; pass existing JSONL files with --corpus")
    out = build_tiny_model(args.out, corpus_from_jsonl(args.corpus))
    print(out)


def train_tokenizer(corpus: Iterable[str], vocab_size: int = VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (ChatML template) trained on `corpus` + a built-in text, `VOCAB_SIZE` tokens
    learnt. A larger `vocab_size` pads the vocabulary with filler tokens no text encodes to (they still decode),
    so that a model can have a real model's vocabulary (Qwen's 151,936) and the cost of its embedding and LM
    head without a corpus to learn that many merges from. Deterministic for a given corpus."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[ENDOFTEXT, IM_START, IM_END],
        # Every byte is in the vocabulary, so any text encodes (no unknown token needed).
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator([BUILTIN_TEXT, *corpus], trainer)
    if vocab_size > bpe.get_vocab_size():
        bpe = _pad_vocabulary(bpe, vocab_size)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token=ENDOFTEXT,
        pad_token=ENDOFTEXT,
        extra_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        response_template=RESPONSE_TEMPLATE,
        model_max_length=1024,
    )



def _pad_vocabulary(bpe: Tokenizer, size: int) -> Tokenizer:
    # Filler tokens are plain vocabulary entries without merges: encoding never produces them. Their text is
    # printable ASCII, which byte-level decoding maps to itself.
    spec = json.loads(bpe.to_str())
    vocab = spec["model"]["vocab"]
    for token_id in range(len(vocab), size):
        vocab[f"<|filler_{token_id}|>"] = token_id
    return Tokenizer.from_str(json.dumps(spec))


if __name__ == "__main__":
    main()
