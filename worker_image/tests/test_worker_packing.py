"""Packing (`training.packing`): a packed row gives each example the loss it has alone and unpadded (positions restart
per example, so transformers masks attention across them); a packed run completes and its manifest says packing was
engaged; a Gated-DeltaNet hybrid, whose linear-attention layers would run across examples, is refused."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

from loraflow_worker.artifacts import open_store
from loraflow_worker.contract import JobInput
from loraflow_worker.self_test.tiny_model import DEFAULT_CORPUS
from loraflow_worker.training.loss_mask import ChatTemplate, mask_chat
from loraflow_worker.training.packing import packing_problem
from loraflow_worker.training.sft import train_sft

CHATS = [json.loads(line)["messages"] for line in DEFAULT_CORPUS.read_text().splitlines() if line.strip()]


def examples(tokenizer, count: int = 4) -> list[dict[str, list[int]]]:
    """The first chats of different lengths, labelled on their answers as training labels them."""
    rows = []
    for messages in CHATS[:count]:
        chat = mask_chat(tokenizer, messages, ChatTemplate(tokenizer.chat_template, "the tiny model's"))
        rows.append({"input_ids": chat.input_ids,
                     "labels": [t if m else -100 for t, m in zip(chat.input_ids, chat.assistant_masks)]})
    return rows


def per_example_losses(logits: torch.Tensor, labels: torch.Tensor, starts: list[int], ends: list[int]) -> list[float]:
    """Each example's mean next-token loss over its labelled tokens, read from one (possibly packed) row."""
    losses = []
    for start, end in zip(starts, ends):
        target = labels[0, start + 1:end]
        predicted = logits[0, start:end - 1]
        losses.append(torch.nn.functional.cross_entropy(predicted, target, ignore_index=-100).item())
    return losses


@pytest.fixture(scope="module")
def model_and_rows(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    return model, examples(tokenizer), tokenizer.pad_token_id


def unpadded_losses(model, rows) -> list[float]:
    losses = []
    with torch.no_grad():
        for row in rows:
            ids, labels = torch.tensor([row["input_ids"]]), torch.tensor([row["labels"]])
            losses += per_example_losses(model(ids).logits, labels, [0], [len(row["input_ids"])])
    return losses


def packed_row(rows, pad_token_id):
    batch = DataCollatorForLanguageModeling(pad_token_id=pad_token_id, padding_free=True)(rows)
    ends = list(torch.cumsum(torch.tensor([len(r["input_ids"]) for r in rows]), 0).tolist())
    starts = [0, *ends[:-1]]
    return batch, starts, ends


def test_a_packed_row_gives_each_example_its_unpadded_loss(model_and_rows):
    model, rows, pad = model_and_rows
    assert len({len(r["input_ids"]) for r in rows}) > 1  # examples of different lengths
    batch, starts, ends = packed_row(rows, pad)
    assert "attention_mask" not in batch and batch["position_ids"][0, starts].tolist() == [0] * len(rows)
    # As TRL's SFTTrainer calls the model (no cache: transformers detects packed rows only without one).
    with torch.no_grad():
        packed = per_example_losses(model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits,
                                    batch["labels"], starts, ends)
    assert packed == pytest.approx(unpadded_losses(model, rows), abs=1e-4)


def test_the_same_row_with_attention_across_examples_gives_other_losses(model_and_rows):
    # What the restarting positions prevent: without them the later examples see the earlier ones.
    model, rows, pad = model_and_rows
    batch, starts, ends = packed_row(rows, pad)
    running = torch.arange(batch["input_ids"].shape[1])[None]
    with torch.no_grad():
        leaked = per_example_losses(model(input_ids=batch["input_ids"], position_ids=running, use_cache=False).logits,
                                    batch["labels"], starts, ends)
    alone = unpadded_losses(model, rows)
    assert leaked[0] == pytest.approx(alone[0], abs=1e-4)
    assert max(abs(a - b) for a, b in zip(leaked[1:], alone[1:])) > 1e-2


def test_a_packed_run_completes_and_its_manifest_says_packing_was_engaged(tiny_model_dir, tmp_path):
    store = tmp_path / "store"
    (store / "runs/pk/dataset").mkdir(parents=True)
    (store / "runs/pk/dataset/train.jsonl").write_text(DEFAULT_CORPUS.read_text())
    job = JobInput.model_validate({
        "run_id": "pk", "model": {"id": str(tiny_model_dir)}, "artifact_store": store.as_uri(),
        "dataset": {"store_path": "runs/pk/dataset/train.jsonl"},
        "training": {"max_steps": 12, "learning_rate": 1e-2, "batch_size": 2, "max_seq_length": 128,
                     "packing": True, "checkpoint_every_minutes": None},
    })
    outcome = train_sft(job, open_store(job.artifact_store), tmp_path / "work", lambda progress: None)
    packing = outcome.manifest.fast_paths["packing"]
    assert packing.engaged, packing.reason
    assert packing.reason.startswith(f"{len(CHATS)} examples in ") and "rows of at most 128 tokens" in packing.reason
    assert outcome.metrics.steps == 12 and outcome.metrics.final_loss < outcome.metrics.first_loss
    assert 0 < outcome.manifest.loss.token_share < 1  # the loss stays on the answers when packed


def test_packing_is_refused_for_a_gated_deltanet_hybrid_without_its_boundary_kernels():
    assert packing_problem("qwen3") is None and packing_problem("qwen3_next", boundary_kernels=True) is None
    problem = packing_problem("qwen3_next")
    assert problem.startswith("training.packing: `qwen3_next` is a Gated-DeltaNet hybrid")
    assert "causal-conv1d" in problem and problem.endswith("set training.packing = false")


def test_the_image_has_no_causal_conv1d_as_the_refusal_says():
    # The control plane refuses hybrids before renting on this fact; an image that gains the kernel changes it.
    from pathlib import Path

    lock = (Path(__file__).resolve().parents[1] / "requirements-gpu.lock").read_text()
    assert "\ncausal-conv1d==" not in lock and "\nflash-linear-attention==" in lock
