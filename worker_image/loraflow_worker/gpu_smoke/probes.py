"""The GPU smoke's bf16 probes (`variants.BF16_RUNS`, `--bf16`): what a bf16 GPU does to training that the CPU tests,
in fp32, cannot show. Each runs in a smoke child process of its own on the smoke model and returns (what it saw, an
error or None):

- `cuda_init`: whether importing what the training process imports initialises CUDA (bitsandbytes, through PEFT,
  asks the device's capability), and whether the allocator then runs with expandable segments, read as the worker's
  own plan reads it (`fast_paths.gather_facts`, `plan_fast_paths`).
- `merge_drift`: 200 vLLM weight syncs of a bf16 base with a LoRA and a DoRA adapter: the values of the base that TRL's
  merge and unmerge change (`vllm_generation.py` 448-469), and that the worker's merged temporaries
  (`vllm_colocate.merged_weights`) change, which must be none.
- `packed_logprobs`: each token's log-probability in bf16 under SDPA, its example alone and unpadded against packed
  rows as the worker's collator makes them (`sft.PackedRows`), with Liger's kernels off and on; attention across the
  examples (positions running through the row) as the yardstick a packing that keeps them apart must beat.
- `head_update`: AdamW at 1e-5 for `HEAD_CHECK_STEP` steps on a copy of the LM head in bf16 and in fp32, the same
  gradients: how much of the fp32 copy's update the bf16 copy keeps.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from loraflow_worker.gpu_smoke.variants import HEAD_CHECK_STEP

SYNCS = 200
HEAD_LEARNING_RATE = 1e-5
Finding = tuple[str, "str | None"]


def cuda_init(model_dir: Path, cuda: bool) -> Finding:
    import torch

    from loraflow_worker.training.fast_paths import ALLOC_CONF_ENV, Workload, gather_facts, plan_fast_paths

    at_start = os.environ.get(ALLOC_CONF_ENV)
    # What the training process imports before it trains (`train_job` imports the algorithm's module on its way).
    import loraflow_worker.training.dpo  # noqa: F401
    import loraflow_worker.training.grpo  # noqa: F401
    import loraflow_worker.training.sft  # noqa: F401
    import loraflow_worker.training.train_job  # noqa: F401

    initialised = torch.cuda.is_initialized()
    probe = allocator_getter()
    plan = plan_fast_paths(gather_facts(model_dir, "sft", Workload(batch_size=1, seq_len=16, lora_rank=8)))
    segments = plan.fast_paths["expandable_segments"]
    seen = (f"CUDA initialised by the training process's imports: {'yes' if initialised else 'no'} "
            f"({ALLOC_CONF_ENV} at the process's start: {at_start!r}); expandable segments "
            f"{'engaged' if segments.engaged else 'off'}: {segments.reason}" + (f" [{probe}]" if probe else ""))
    return seen, None


def allocator_getter() -> str | None:
    """Where torch lacks `torch._C._accelerator_getAllocatorSettings`, through which the worker reads what the CUDA
    allocator holds (the 2.12 and 2.13 wheels have it, a lent machine's 2.11 lacks it), put in its place a getter of
    `PYTORCH_CUDA_ALLOC_CONF` (what the allocator holds when it was set before CUDA initialised, as
    `fast_paths.gather_facts` sets it), saying so; None where torch has it or there is no CUDA."""
    import torch
    from packaging.version import Version

    from loraflow_worker.training.fast_paths import ALLOC_CONF_ENV

    if not torch.cuda.is_available() or Version(torch.__version__).release >= (2, 12):
        return None
    torch._C._accelerator_getAllocatorSettings = lambda: os.environ.get(ALLOC_CONF_ENV, "")
    return (f"read from {ALLOC_CONF_ENV}: torch {torch.__version__} has no torch._C._accelerator_getAllocatorSettings "
            "(torch >= 2.12 has)")


def merge_drift(model_dir: Path, cuda: bool) -> Finding:
    import torch

    from loraflow_worker.training.vllm_colocate import merged_weights

    seen, errors = [], []
    for kind in ("lora", "dora"):
        model = _adapted(model_dir, cuda, use_dora=kind == "dora")
        start = _base_weights(model)
        for _ in range(SYNCS):
            for _ in merged_weights(model):
                pass
        worker = _changed(model, start)
        for _ in range(SYNCS):
            for _ in _trl_sync(model):
                pass
        trl = _changed(model, start)
        drift = max(float((weight.float() - start[name].float()).norm() / start[name].float().norm())
                    for name, weight in _base_weights(model).items())
        total = sum(weight.numel() for weight in start.values())
        seen.append(f"{kind}: after {SYNCS} syncs TRL's merge and unmerge changed {trl / total:.1%} of the {total:,} "
                    f"adapted bf16 base values (relative drift of a weight up to {drift:.1e}), the worker's merged "
                    f"temporaries {worker}")
        if worker:
            errors.append(f"the worker's sync changed {worker} {kind} base values: it must write none")
        del model
        if cuda:
            torch.cuda.empty_cache()
    return "; ".join(seen), "; ".join(errors) or None


def _adapted(model_dir: Path, cuda: bool, use_dora: bool) -> Any:
    """The smoke model in bf16 with a LoRA (or DoRA) adapter on every linear layer whose B (and magnitude) moved as
    training moves them, so that merging changes every adapted weight; the adapter in fp32, as PEFT keeps it."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    model = get_peft_model(base.to("cuda" if cuda else "cpu"),
                           LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", use_dora=use_dora))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.01)
            elif "lora_magnitude_vector" in name:
                parameter.mul_(1 + 0.01 * torch.randn_like(parameter))
    return model


def _base_weights(model: Any) -> dict[str, Any]:
    return {name: weight.detach().clone() for name, weight in model.named_parameters() if ".base_layer." in name}


def _changed(model: Any, start: dict[str, Any]) -> int:
    now = dict(model.named_parameters())
    return sum(int((now[name].detach() != weight).sum()) for name, weight in start.items())


def _trl_sync(model: Any) -> Iterator[tuple[str, Any]]:
    """TRL 1.16's own sync source (`VLLMGeneration._iter_named_params`: merge in place, read, unmerge) on one
    process, without the engine it feeds (which a lent machine lacks)."""
    from trl.generation.vllm_generation import VLLMGeneration

    generation = object.__new__(VLLMGeneration)
    generation.model = model
    generation._dist = SimpleNamespace(is_fsdp=False, gather_params=lambda parameters: contextlib.nullcontext())
    return generation._iter_named_params()


def packed_logprobs(model_dir: Path, cuda: bool) -> Finding:
    import importlib.metadata

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from loraflow_worker.self_test.tiny_model import DEFAULT_CORPUS
    from loraflow_worker.training.fast_paths import _engage_liger

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    chats = [json.loads(line)["messages"] for line in DEFAULT_CORPUS.read_text().splitlines() if line.strip()][:8]
    examples = [tokenizer.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"] for chat in chats]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa")
    model = model.to("cuda" if cuda else "cpu").eval()
    seen, errors = [], []
    liger = cuda and _installed("liger-kernel", importlib.metadata)
    for kernels in ("Liger off", "Liger on") if liger else ("Liger off",):
        if kernels == "Liger on":
            engaged = _engage_liger(model)
            if not engaged.engaged:
                seen.append(f"Liger on: not engaged ({engaged.reason})")
                break
        alone = _alone(model, examples)
        packed = _packed(model, examples, tokenizer.pad_token_id, restart=True)
        across = _packed(model, examples, tokenizer.pad_token_id, restart=False)
        (packed_max, packed_mean), (across_max, across_mean) = _difference(packed, alone), _difference(across, alone)
        seen.append(f"{kernels}: |packed - alone| max {packed_max:.2e}, mean {packed_mean:.2e} over "
                    f"{sum(map(len, alone))} tokens of {len(examples)} examples; attention across examples: max "
                    f"{across_max:.2e}, mean {across_mean:.2e}")
        if packed_mean >= across_mean:
            errors.append(f"{kernels}: packed rows differ from the examples alone as much as rows attending across "
                          "their examples do: the positions do not keep the examples apart")
    if not liger:
        seen.append("Liger on: not run (" + ("no CUDA" if not cuda else "liger-kernel not installed") + ")")
    return "; ".join(seen), "; ".join(errors) or None


def _installed(distribution: str, metadata: Any) -> bool:
    try:
        metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return False
    return True


def _token_logprobs(logits: Any, ids: Any) -> Any:
    """log p(token t+1 | tokens up to t) for each position of one example, in fp32."""
    return logits.float().log_softmax(-1)[:-1].gather(-1, ids[1:, None])[:, 0]


def _alone(model: Any, examples: list[list[int]]) -> list[Any]:
    import torch

    device = next(model.parameters()).device
    with torch.no_grad():
        return [_token_logprobs(model(torch.tensor([ids], device=device), use_cache=False).logits[0],
                                torch.tensor(ids, device=device)) for ids in examples]


def _packed(model: Any, examples: list[list[int]], pad_token_id: int, *, restart: bool) -> list[Any]:
    """Each example's token log-probs read from two packed rows (the first half of the examples, then the second)
    as `PackedRows` hands them to the model; with `restart` False the positions run through each row instead, so
    that each example attends to those before it."""
    import torch

    from loraflow_worker.training.sft import PackedRows

    device = next(model.parameters()).device
    half = len(examples) // 2
    rows = [examples[:half], examples[half:]]
    batch = PackedRows(pad_token_id=pad_token_id, return_position_ids=True)(
        [{"input_ids": [token for ids in row for token in ids], "seq_lengths": [len(ids) for ids in row]}
         for row in rows])
    positions = batch["position_ids"] if restart else torch.arange(batch["input_ids"].shape[1]).expand(2, -1)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"].to(device), position_ids=positions.to(device),
                       use_cache=False).logits
    found = []
    for number, row in enumerate(rows):
        start = 0
        for ids in row:
            found.append(_token_logprobs(logits[number, start:start + len(ids)], torch.tensor(ids, device=device)))
            start += len(ids)
    return found


def _difference(found: list[Any], expected: list[Any]) -> tuple[float, float]:
    import torch

    gaps = torch.cat([(a - b).abs() for a, b in zip(found, expected, strict=True)])
    return float(gaps.max()), float(gaps.mean())


def head_update(model_dir: Path, cuda: bool) -> Finding:
    import torch
    from transformers import AutoModelForCausalLM

    device = "cuda" if cuda else "cpu"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device).eval()
    start = model.lm_head.weight.detach().float().clone()
    copies = {dtype: torch.nn.Parameter(start.to(dtype).clone()) for dtype in (torch.bfloat16, torch.float32)}
    optimizers = {dtype: torch.optim.AdamW([copy], lr=HEAD_LEARNING_RATE, weight_decay=0.0)
                  for dtype, copy in copies.items()}
    generator = torch.Generator().manual_seed(0)
    vocabulary = model.config.vocab_size
    for _ in range(HEAD_CHECK_STEP):
        tokens = torch.randint(0, vocabulary, (2, 128), generator=generator).to(device)
        with torch.no_grad():
            hidden = model.model(input_ids=tokens).last_hidden_state.float()
        fp32 = copies[torch.float32]
        loss = torch.nn.functional.cross_entropy((hidden[:, :-1] @ fp32.T).flatten(0, 1), tokens[:, 1:].flatten())
        (gradient,) = torch.autograd.grad(loss, fp32)
        for dtype, copy in copies.items():  # the same gradient for both: only the copy's precision differs
            copy.grad = gradient.to(dtype)
            optimizers[dtype].step()
    moved = {dtype: copy.detach().float() - start for dtype, copy in copies.items()}
    kept = float(moved[torch.bfloat16].norm() / moved[torch.float32].norm())
    share = {dtype: float((delta != 0).float().mean()) for dtype, delta in moved.items()}
    seen = (f"AdamW at lr {HEAD_LEARNING_RATE:g}, {HEAD_CHECK_STEP} steps on the {start.numel():,}-value LM head: the bf16 "
            f"copy moved {share[torch.bfloat16]:.1%} of its values and kept {kept:.1%} of the fp32 copy's update "
            f"(norm); the fp32 copy moved {share[torch.float32]:.1%}")
    return seen, None if share[torch.float32] > 0 else "the fp32 copy did not move: the probe tests nothing"


PROBES: dict[str, Callable[[Path, bool], Finding]] = {
    "cuda_init": cuda_init, "merge_drift": merge_drift, "packed_logprobs": packed_logprobs, "head_update": head_update}
