"""The model behind the stand-in's `vllm serve`: the base and every `--lora-modules` adapter, loaded with transformers
and PEFT on the CPU before the server answers anything, and greedy or sampled generation, one request at a time.

Loading fails where vLLM's does, with vLLM's words [V = vllm-project/vllm, code-read; serving.md §2, §6, §7]:
- `--max-model-len` above what the model's config allows (unless `VLLM_ALLOW_LONG_MAX_MODEL_LEN=1`);
- an adapter without `--enable-lora`: "LoRA is not enabled. Use --enable-lora to enable LoRA." [V
  vllm/v1/worker/lora_model_runner_mixin.py];
- an adapter path with no adapter in it: "Loading lora NAME failed: No adapter found for PATH" [V vllm/exceptions.py
  LoRAAdapterNotFoundError]; a path that is neither absolute, `~`-relative nor an existing relative path is taken as a
  Hub repo id and downloaded with `snapshot_download(repo_id=...)`, no revision, the token from the environment; a
  download refused (HTTP error, an invalid repo id) is logged and the raw string kept, so the load then fails as above
  [V vllm/lora/utils.py get_adapter_absolute_path];
- an adapter config vLLM refuses: missing `r`/`lora_alpha`/`target_modules`, `modules_to_save` (but a classifier's),
  DoRA, a LoRA bias, an init that rewrites the base (PiSSA, OLoRA, CorDA, LoftQ), or a rank above `--max-lora-rank`: "LoRA rank 32 is greater than max_lora_rank 16." [V vllm/lora/peft_helper.py];
- a name given twice [V vllm/entrypoints/openai/models/serving.py load_lora_adapter].
Each stops `vllm serve` at startup (`init_static_loras` raises on the first adapter that fails).

What it does not copy: vLLM's engine. No batching (one generation at a time, under a lock), no KV-cache sizing, no
CUDA graphs; the weights run in float32 whatever `--dtype` says; which modules an adapter targets is not checked
(vLLM refuses modules it cannot serve).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from huggingface_hub import snapshot_download
from huggingface_hub.errors import HfHubHTTPError, HFValidationError
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

if TYPE_CHECKING:
    from serve import LoRAModule

log = logging.getLogger("vllm_standin.engine")

MAX_LEN_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_target_positions",
                "max_sequence_length")
"""Config attributes vLLM derives the model's length from (the smallest present wins) [V vllm/config/model.py]."""
DEFAULT_MAX_LEN = 2048  # vLLM's assumption for a config that names none of them


@dataclass(frozen=True)
class Adapter:
    name: str
    path: str
    """As `--lora-modules` gave it (`/v1/models` shows it as the card's `root`)."""
    parent: str
    peft_name: str
    """Its name inside the PEFT model (PEFT's names cannot hold every character a served name may)."""


@dataclass(frozen=True)
class Sampling:
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]


@dataclass(frozen=True)
class Generated:
    text: str
    tokens: int
    finish_reason: str
    """`stop` (a stop token or string) or `length` (`max_tokens` reached)."""
    stop_reason: int | str | None
    """vLLM's: the stop string or stop token id that ended it; None for the tokenizer's EOS or `length`."""
    pieces: tuple[str, ...] = ()
    """`text` cut where its tokens end: what a stream sends, one chunk each."""


class Engine:
    """The loaded model; `generate` is safe to call from several threads (they take turns)."""

    def __init__(self, *, model: str, revision: str | None, tokenizer: str | None, tokenizer_revision: str | None,
                 served_names: list[str], max_model_len: int | None, chat_template: str | None,
                 trust_remote_code: bool, seed: int | None) -> None:
        self.model_path = model
        self.served_names = served_names
        log.info("loading the base model %s%s", model, f" at revision {revision}" if revision else "")
        self.tokenizer = AutoTokenizer.from_pretrained(
            tokenizer or model, revision=tokenizer_revision or (None if tokenizer else revision),
            trust_remote_code=trust_remote_code)
        if chat_template is not None:  # a file, or the template itself in one line [V cli_args.py --chat-template]
            template = Path(chat_template)
            self.tokenizer.chat_template = template.read_text() if template.is_file() else chat_template
        self.model: Any = AutoModelForCausalLM.from_pretrained(model, revision=revision, dtype=torch.float32,
                                                               trust_remote_code=trust_remote_code)
        self.model.eval()
        self.max_model_len = _max_model_len(self.model.config, max_model_len)
        self.eos_id = self.tokenizer.eos_token_id
        # vLLM stops on the tokenizer's EOS and on every EOS id of generation_config.json (those as stop tokens).
        extra = self.model.generation_config.eos_token_id
        extra = [] if extra is None else [extra] if isinstance(extra, int) else list(extra)
        self.stop_ids = [i for i in dict.fromkeys([self.eos_id, *extra]) if i is not None]
        self.seed = seed
        self.adapters: dict[str, Adapter] = {}
        self._lock = threading.Lock()

    def load_adapters(self, modules: list[LoRAModule], *, enable_lora: bool, max_lora_rank: int) -> None:
        """Load every adapter, in order; the first that fails raises (and stops the server's start)."""
        for module in modules:
            if not enable_lora:
                raise RuntimeError("LoRA is not enabled. Use --enable-lora to enable LoRA.")
            if module.name in self.adapters:
                raise ValueError(f"The lora adapter '{module.name}' has already been loaded. If you want to load the "
                                 "adapter in place, set 'load_inplace' to True.")
            local = adapter_dir(module.path)
            try:
                config = json.loads((Path(local) / "adapter_config.json").read_text())
            except (FileNotFoundError, NotADirectoryError) as e:
                raise FileNotFoundError(f"Loading lora {module.name} failed: No adapter found for {module.path}") from e
            check_adapter_config(config, max_lora_rank)
            peft_name = f"lora{len(self.adapters)}"
            if isinstance(self.model, PeftModel):
                self.model.load_adapter(local, adapter_name=peft_name)
            else:
                self.model = PeftModel.from_pretrained(self.model, local, adapter_name=peft_name)
            self.model.eval()
            # `base_model_name` only names the card's parent, and only when it is a served name: vLLM never checks
            # the adapter's own base [V models/serving.py].
            parent = module.base_model_name if module.base_model_name in self.served_names else self.served_names[0]
            self.adapters[module.name] = Adapter(module.name, module.path, parent, peft_name)
            log.info("Loaded new LoRA adapter: name '%s', path '%s'", module.name, module.path)

    def generate(self, prompt_ids: list[int], adapter: Adapter | None, sampling: Sampling) -> Generated:
        """Greedy unless `sampling.temperature` > 0; stops at a stop token or string, or after `max_tokens`."""
        kwargs: dict[str, Any] = {"max_new_tokens": sampling.max_tokens, "eos_token_id": self.stop_ids,
                                  "pad_token_id": self.eos_id if self.tokenizer.pad_token_id is None
                                  else self.tokenizer.pad_token_id}
        if sampling.temperature > 0:
            kwargs |= {"do_sample": True, "temperature": sampling.temperature, "top_p": sampling.top_p,
                       "top_k": max(sampling.top_k, 0)}  # vLLM's -1 (and 0) mean no top-k
        else:  # no sampling settings left over from generation_config.json: they would only warn
            kwargs |= {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
        if sampling.stop:
            kwargs |= {"stop_strings": list(sampling.stop), "tokenizer": self.tokenizer}
        ids = torch.tensor([prompt_ids], dtype=torch.long)
        with self._lock:
            seed = sampling.seed if sampling.seed is not None else self.seed
            if seed is not None:
                torch.manual_seed(seed)
            if adapter is not None:
                self.model.set_adapter(adapter.peft_name)
            plain = self.model.disable_adapter() if adapter is None and isinstance(self.model, PeftModel) else nullcontext()
            with torch.inference_mode(), plain:
                out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs)
        new = out[0, len(prompt_ids):].tolist()
        return self._finish(new, sampling.stop)

    def _finish(self, new: list[int], stop: tuple[str, ...]) -> Generated:
        if new and new[-1] in self.stop_ids:
            text = self.tokenizer.decode(new[:-1], skip_special_tokens=True)
            return Generated(text, len(new), "stop", None if new[-1] == self.eos_id else new[-1],
                             self._pieces(new[:-1], text))
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        found = [(text.find(s), s) for s in stop if s and s in text]
        if found:  # the stop string itself is not part of the answer
            at, string = min(found)
            return Generated(text[:at], len(new), "stop", string, self._pieces(new, text[:at]))
        return Generated(text, len(new), "length", None, self._pieces(new, text))

    def _pieces(self, ids: list[int], text: str) -> tuple[str, ...]:
        """`text` as the tokens `ids` add to it one after the other (a token that ends inside a character adds
        nothing until the next completes it, as vLLM's incremental detokenizer holds it back)."""
        pieces, sent = [], ""
        for end in range(1, len(ids) + 1):
            now = self.tokenizer.decode(ids[:end], skip_special_tokens=True)[:len(text)]
            if len(now) > len(sent) and now.startswith(sent) and not now.endswith("\ufffd"):
                pieces.append(now[len(sent):])
                sent = now
        if sent != text:
            pieces.append(text[len(sent):])
        return tuple(pieces)


def adapter_dir(path: str) -> str:
    """Where an adapter's files are: an absolute path as it is (existing or not), `~` expanded, an existing relative
    path made absolute; anything else is a Hub repo id, downloaded (no revision, the token from the environment). A
    refused download keeps the raw string, which then holds no adapter [V vllm/lora/utils.py]."""
    if os.path.isabs(path):
        return path
    if path.startswith("~"):
        return os.path.expanduser(path)
    if os.path.exists(path):
        return os.path.abspath(path)
    try:
        return snapshot_download(repo_id=path)
    except (HfHubHTTPError, HFValidationError):
        log.exception("Error downloading the HuggingFace model")
        return path


def check_adapter_config(config: dict[str, Any], max_lora_rank: int) -> None:
    """vLLM's checks of an adapter's `adapter_config.json` before it loads any weight [V vllm/lora/peft_helper.py]."""
    missing = {"r", "lora_alpha", "target_modules"} - config.keys()
    if missing:
        raise ValueError(f"Missing required configuration fields: {missing}")
    problems = []
    if unsupported := [m for m in config.get("modules_to_save") or [] if m not in ("classifier", "score")]:
        problems.append('vLLM only supports modules_to_save being either None or ["classifier", "score"] for '
                        f"classification models. Unsupported modules_to_save: {unsupported}")
    if config.get("use_dora"):
        problems.append("vLLM does not yet support DoRA.")
    if config.get("lora_bias"):
        problems.append("vLLM does not support LoRA bias (lora_bias).")
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower() not in ("gaussian", "eva", "orthogonal", "mica", "lora_ga"):
        problems.append(f"vLLM does not support init_lora_weights={init!r}. Inits such as PiSSA, OLoRA, CorDA and "
                        "LoftQ modify the base model weights when PEFT loads the adapter.")
    if config["r"] > max_lora_rank:
        problems.append(f"LoRA rank {config['r']} is greater than max_lora_rank {max_lora_rank}.")
    if problems:
        raise ValueError(" ".join(problems))


def _max_model_len(config: Any, asked: int | None) -> int:
    found = [int(v) for key in MAX_LEN_KEYS if isinstance(v := getattr(config, key, None), int | float) and v > 0]
    derived = min(found) if found else DEFAULT_MAX_LEN
    if asked is None:
        return derived
    if asked > derived and os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN") != "1":
        key = next((k for k in MAX_LEN_KEYS if getattr(config, k, None) == derived), None)
        # vLLM's words, as its startup failure logs them.
        raise ValueError(f"User-specified max_model_len ({asked}) is greater than the derived max_model_len "
                         f"({key}={derived} or model_max_length=None in model's config.json). To allow overriding this "
                         "maximum, set the env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1.")
    return asked
