"""What every GPU smoke run trains on: a random-init Qwen3.5 model (or, for the memory calibration, a Qwen3 model of
full-attention layers only) with a real model's vocabulary, and the datasets of the artifact store the runs read."""

from __future__ import annotations

import json
import random
from pathlib import Path

from loraflow_worker.gpu_smoke.variants import Size


TASK_PROMPTS = 24
"""The prompts of `task-eval`'s task: more than one batch of answers (`answering.BATCH_SIZE`)."""


def model_dir(out: Path, full_attention: bool) -> Path:
    """Where in the working folder `out` the smoke model of that architecture is built."""
    return out / ("model-qwen3" if full_attention else "model")


def build_smoke_model(out_dir: Path, size: Size, *, full_attention: bool = False) -> Path:
    """A random-init Qwen3.5 text model (Gated-DeltaNet layers, one full-attention layer in four) of `size`, or with
    `full_attention` a Qwen3 model of the same size (every layer full attention), with a tokenizer trained on the
    shipped chat corpus and padded to the vocabulary, saved into `out_dir` in bf16."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3Config, Qwen3ForCausalLM

    from loraflow_worker.self_test.tiny_model import DEFAULT_CORPUS, IM_END, corpus_from_jsonl, train_tokenizer

    tokenizer = train_tokenizer(corpus_from_jsonl([DEFAULT_CORPUS]), vocab_size=size.vocab)
    head_dim = size.hidden // size.heads
    common = dict(vocab_size=len(tokenizer), hidden_size=size.hidden, intermediate_size=3 * size.hidden,
                  num_hidden_layers=size.layers, num_attention_heads=size.heads,
                  num_key_value_heads=max(1, size.heads // 4), head_dim=head_dim,
                  # Room for a tool-using prompt (its tools' schemas) and its turns on the CPU's short sequences too.
                  max_position_embeddings=max(4 * size.seq_len, 1024), tie_word_embeddings=True,
                  # Logits behind the final norm and a tied head reach about sqrt(hidden) x an embedding's norm: at the
                  # usual 0.02 a narrow (CPU) model's next-token distribution stays near uniform whatever LoRA learns,
                  # so `tools-grpo`'s taught call would never be sampled. 0.02 on the GPU's width.
                  initializer_range=max(0.02, size.hidden ** -0.5),
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    if full_attention:
        model = Qwen3ForCausalLM(Qwen3Config(**common)).to(torch.bfloat16)
    else:
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(
            **common, linear_key_head_dim=head_dim, linear_value_head_dim=head_dim, linear_num_key_heads=size.heads,
            linear_num_value_heads=2 * size.heads, full_attention_interval=4)).to(torch.bfloat16)
    model.generation_config.eos_token_id = [tokenizer.convert_tokens_to_ids(IM_END), tokenizer.eos_token_id]
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def write_datasets(out: Path, size: Size, total_steps: int) -> None:
    """The artifact store the children train from: long chats for SFT (each fills the sequence length), the shipped
    chats for packed SFT (many to a row), their questions for GRPO (and, with their replies as answers, for the task
    evaluation), and for DPO long answers (half the sequence length each) preferred to a refusal; for tool-using GRPO, `tool_use`'s teaching chats, prompts, tool and reward."""
    from loraflow_worker.self_test import tool_use
    from loraflow_worker.self_test.tiny_model import BUILTIN_TEXT, DEFAULT_CORPUS

    words = BUILTIN_TEXT.split()
    rng = random.Random(0)
    chats = [json.loads(line)["messages"] for line in DEFAULT_CORPUS.read_text().splitlines() if line.strip()]
    data = out / "store" / "data"
    data.mkdir(parents=True, exist_ok=True)
    with (data / "sft.jsonl").open("w") as f:
        for i in range(size.batch * total_steps):
            # Each word is at least one token, so this fills max_seq_length (the rest is truncated).
            answer = " ".join(rng.choice(words) for _ in range(size.seq_len))
            f.write(json.dumps({"messages": [chats[i % len(chats)][0], {"role": "assistant", "content": answer}]}) + "\n")
    with (data / "grpo.jsonl").open("w") as f:
        for chat in chats:
            f.write(json.dumps({"messages": chat}) + "\n")
    with (data / "dpo.jsonl").open("w") as f:
        for i in range(size.batch * total_steps):
            answer = " ".join(rng.choice(words) for _ in range(size.seq_len // 2))
            f.write(json.dumps({"prompt": [chats[i % len(chats)][0]],
                                "chosen": [{"role": "assistant", "content": answer}],
                                "rejected": [{"role": "assistant", "content": "I do not know, and I will not guess."}]})
                    + "\n")
    with (data / "chats.jsonl").open("w") as f:  # short chats: a packed row of the sequence length holds many
        for i in range(size.batch * total_steps * max(1, size.seq_len // 32)):
            f.write(json.dumps({"messages": chats[i % len(chats)]}) + "\n")
    with (data / "task.jsonl").open("w") as f:  # the chats' questions, their replies the expected answers
        for chat in chats[:TASK_PROMPTS]:
            f.write(json.dumps({"messages": chat[:1], "answer": chat[1]["content"]}) + "\n")
    (data / "tools-teach.jsonl").write_text(tool_use.jsonl(tool_use.teaching_rows()))
    (data / "tools.jsonl").write_text(tool_use.jsonl(tool_use.prompt_rows()))
    for path, source in (("tools/tools.py", tool_use.TOOLS_SOURCE), ("rewards/reward.py", tool_use.REWARD_SOURCE)):
        (out / "store" / path).parent.mkdir(parents=True, exist_ok=True)
        (out / "store" / path).write_text(source)
