"""The `vllm serve` arguments RunPod's vLLM worker builds from its environment, for the flags the stand-in models.

The real rules [W src/args_builder.py; serving.md §2], which this follows:

1. An environment variable named as the UPPER_SNAKE of a `vllm serve` flag becomes that flag (`MAX_MODEL_LEN=512` →
   `--max-model-len 512`); an empty value is no flag. A boolean flag becomes `--flag` for true/1/yes/on and
   `--no-flag` for false/0/no/off; any other value stops the worker at startup (`ValueError`). `MODEL`, `HOST`,
   `PORT`, `API_KEY`, `CONFIG` and `HELP` never do (the wrapper owns them).
2. The historical aliases win over the scan: `MODEL_NAME` → `--model`, `MODEL_REVISION` → `--revision`,
   `TOKENIZER_NAME` → `--tokenizer`, `OPENAI_SERVED_MODEL_NAME_OVERRIDE` → `--served-model-name`,
   `CUSTOM_CHAT_TEMPLATE` → `--chat-template`.
3. `VLLM_EXTRA_ARGS` is shell-split and appended last, so it wins where a flag comes twice (`--lora-modules` included:
   vLLM keeps the last occurrence's list only).

What the stand-in leaves out: the real scan covers ~150 flags (GPU memory, parallelism, KV cache, ...); this one
reads only the flags `serve.py` models, so other variables change nothing here, and a flag of `VLLM_EXTRA_ARGS`
the stand-in does not model is accepted and named in the log as ignored. `VLLM_CONFIG_FILE` (→ `--config`) is not
read. And `HF_TOKEN` is not made into `--hf-token`: the real scan does (the name matches the flag) and the real
`main.py` logs the whole command, token included (code) [W src/args_builder.py, src/main.py]; the stand-in's server
reads the token from its environment, as `huggingface_hub` does, and nothing it logs shows it.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping

TRUE = frozenset({"true", "1", "yes", "on"})
FALSE = frozenset({"false", "0", "no", "off"})

VALUE_FLAGS = (
    "--model", "--revision", "--tokenizer", "--tokenizer-revision", "--served-model-name", "--max-model-len",
    "--max-loras", "--max-lora-rank", "--max-cpu-loras", "--lora-dtype", "--lora-modules", "--dtype", "--seed",
    "--chat-template",
)  # fmt: skip
"""Value flags of the real allowlist that `serve.py` reads (`--hf-token` is one too, left out on purpose: above)."""

BOOL_FLAGS = ("--enable-lora", "--trust-remote-code")
"""`--flag` / `--no-flag` flags (argparse's BooleanOptionalAction in vLLM) that `serve.py` reads."""

RESERVED = frozenset({"HOST", "PORT", "API_KEY", "MODEL", "CONFIG", "HELP"})

ALIASES = {
    "MODEL_NAME": "--model",
    "MODEL_REVISION": "--revision",
    "TOKENIZER_NAME": "--tokenizer",
    "OPENAI_SERVED_MODEL_NAME_OVERRIDE": "--served-model-name",
    "CUSTOM_CHAT_TEMPLATE": "--chat-template",
}

SECRET_FLAGS = frozenset({"--hf-token"})
"""Flags whose value `redacted` hides (one may still come through `VLLM_EXTRA_ARGS`)."""


def env_name(flag: str) -> str:
    """`--max-lora-rank` → `MAX_LORA_RANK`."""
    return flag.removeprefix("--").replace("-", "_").upper()


def build_args(env: Mapping[str, str] | None = None) -> list[str]:
    """The `vllm serve` arguments (after `--host`/`--port`) for this environment."""
    env = os.environ if env is None else env
    flags: dict[str, str | None] = {}
    for flag in sorted(VALUE_FLAGS + BOOL_FLAGS):
        name = env_name(flag)
        if name not in RESERVED and name in env:
            _set(flags, flag, env[name])
    for name, flag in ALIASES.items():  # after the scan: an alias wins
        if name in env:
            _set(flags, flag, env[name])
    argv: list[str] = []
    for flag, value in flags.items():
        argv += [flag] if value is None else [flag, value]
    return argv + shlex.split(env.get("VLLM_EXTRA_ARGS", ""))


def redacted(argv: list[str]) -> list[str]:
    """`argv` as it may be logged: the value of a secret flag replaced by `***`."""
    shown: list[str] = []
    hide_next = False
    for arg in argv:
        flag, eq, _ = arg.partition("=")
        if hide_next:
            shown.append("***")
        elif eq and flag in SECRET_FLAGS:
            shown.append(f"{flag}=***")
        else:
            shown.append(arg)
        hide_next = not eq and arg in SECRET_FLAGS
    return shown


def _set(flags: dict[str, str | None], flag: str, raw: str) -> None:
    value = raw.strip()
    if not value:
        return
    if flag in BOOL_FLAGS:
        if value.lower() in TRUE:
            flags.pop(f"--no-{flag.removeprefix('--')}", None)
            flags[flag] = None
        elif value.lower() in FALSE:
            flags.pop(flag, None)
            flags[f"--no-{flag.removeprefix('--')}"] = None
        else:
            raise ValueError(f"invalid boolean value {raw!r} for {flag}")
    else:
        flags[flag] = value
