"""Training tokens per second with `training.packing` against the same run padded, measured in one run.

    .venv-worker/bin/python bench/packing.py --steps 20

Builds a small model offline (the tiny model's tokenizer; `--hidden` wide, so that as in real models its linear layers,
not attention, take most of a step: at the tiny model's width of 64 attention over a 512-token row dominates and
packing's longer rows cost more than the padding they save) and a chat dataset of mixed lengths (most chats short, a few long, as instruction
data is), then trains the same SFT job twice in this process, padded (each batch padded to its longest chat) and
packed (chats packed into rows of `max_seq_length`), in alternating order `--repeats` times, and prints each run's
real (non-padding) tokens per second and the median packed/padded ratio. Both count the same tokens: the chats' own,
never the padding. Runs in the worker's environment (it trains in process, as the worker does).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "worker_image"))  # run as a script from anywhere

from loraflow_worker.artifacts import open_store  # noqa: E402
from loraflow_worker.contract import JobInput  # noqa: E402
from loraflow_worker.self_test.tiny_model import DEFAULT_CORPUS, build_tiny_model, corpus_from_jsonl  # noqa: E402
from loraflow_worker.training.sft import train_sft  # noqa: E402

WORDS = "the a model learns answer question short long data token step loss rate batch train".split()


def mixed_chats(count: int, seed: int = 0) -> list[dict]:
    """Chats whose lengths follow instruction data's shape: four in five short, one in five up to ten times longer."""
    rng = random.Random(seed)

    def text(words: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(words))

    chats = []
    for _ in range(count):
        words = rng.randint(5, 25) if rng.random() < 0.8 else rng.randint(60, 250)
        chats.append({"messages": [{"role": "user", "content": text(max(3, words // 3))},
                                   {"role": "assistant", "content": text(words)}]})
    return chats


def widened(tiny: Path, out: Path, hidden: int) -> Path:
    """The tiny model's tokenizer on a random Qwen3 of width `hidden` (2 layers, MLP 3 × wider)."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiny)
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=3 * hidden,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                         max_position_embeddings=1024, tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def train(model: Path, folder: Path, chats: list[dict], steps: int, packing: bool) -> float:
    """Real tokens per second of one run."""
    store = folder / "store"
    (store / "runs/b/dataset").mkdir(parents=True)
    (store / "runs/b/dataset/train.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    job = JobInput.model_validate({
        "run_id": "b", "model": {"id": str(model)}, "artifact_store": store.as_uri(),
        "dataset": {"store_path": "runs/b/dataset/train.jsonl"},
        "training": {"max_steps": steps, "batch_size": 8, "max_seq_length": 512, "packing": packing,
                     "checkpoint_every_minutes": None},
    })
    outcome = train_sft(job, open_store(job.artifact_store), folder / "work", lambda progress: None)
    print(f"  tokens {outcome.metrics.tokens} in {outcome.metrics.wall_seconds:.1f} s", flush=True)
    return outcome.metrics.tokens / outcome.metrics.wall_seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="Optimizer steps per run (default 20).")
    parser.add_argument("--repeats", type=int, default=2, help="Padded/packed pairs, alternating (default 2).")
    parser.add_argument("--chats", type=int, default=400, help="Chats in the dataset (default 400).")
    parser.add_argument("--hidden", type=int, default=256, help="The model's width (default 256).")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="loraflow-bench-packing-") as tmp:
        root = Path(tmp)
        model = widened(build_tiny_model(root / "tiny", corpus_from_jsonl([DEFAULT_CORPUS])), root / "model", args.hidden)
        chats = mixed_chats(args.chats)
        rates: dict[bool, list[float]] = {False: [], True: []}
        started = time.monotonic()
        for repeat in range(args.repeats):
            for packing in ((False, True) if repeat % 2 == 0 else (True, False)):
                rate = train(model, root / f"run-{repeat}-{packing}", chats, args.steps, packing)
                rates[packing].append(rate)
                print(f"{'packed' if packing else 'padded'}  {rate:8.0f} tokens/s", flush=True)
        padded, packed = statistics.median(rates[False]), statistics.median(rates[True])
        print(f"packed/padded: x{packed / padded:.2f} tokens/s ({packed:.0f} vs {padded:.0f}, medians of "
              f"{args.repeats}; width {args.hidden}, {args.steps} steps of 8 rows each; {time.monotonic() - started:.0f} s in all)")


if __name__ == "__main__":
    main()
