"""The serve file (`ServeSpec`): what the `serve` flow's form shows and a TOML serve file holds: a base model, its
LoRA adapters, the GPUs, how long and for how much."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from flows.forms.run import SpecError, describe_validation_error, read_run_file
from tasks.storage.served_adapters import default_adapter_name

DEFAULT_PROMPTS = ["Say hello in one sentence.", "What is 12 times 7? Answer with the number."]
"""What "try it" asks when the serve file names no prompts and no adapter's run stored evaluation prompts."""
MAX_PROMPTS = 5
DEFAULT_MAX_MODEL_LEN = 8192
"""`serve.max_model_len` when the serve file names none and the base's context is longer."""
_ADAPTER_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"


class AdapterSpec(BaseModel):
    """One adapter to serve: where it is, and the model name it answers to."""

    model_config = ConfigDict(extra="forbid")

    source: str = Field(min_length=1, max_length=1024, description="`runs/<run id>` (a completed run of "
                        "`artifact_store`), a Hub model repo `<org>/<name>` holding a PEFT adapter, or (local mode "
                        "only) a folder holding one.")
    name: str | None = Field(default=None, pattern=_ADAPTER_NAME, description="The model name a request asks "
                             "for (`\"model\"`). Default: the last part of `source` (the run id for `runs/<id>`).")


class ServeSettings(BaseModel):
    """What to serve, on what, for how long and for how much."""

    model_config = ConfigDict(extra="forbid")

    base_model: str = Field(min_length=1, description="The base model: a Hub model id (pinned to its current "
                            "commit when the serve starts), or a local folder (local mode).")
    adapters: list[AdapterSpec] = Field(
        min_length=1, max_length=16,
        description="The LoRA adapters, all of `base_model`, served from one endpoint: each a source string "
        "(`runs/<id>`, `<org>/<repo>`, a folder) or `{ name = \"...\", source = \"...\" }`. A run of an hf:// store is "
        "published first, to the private model repo `<store org>/loraflow-<run id>`.")
    gpu: list[str] = Field(default=["RTX 4090", "A100 SXM"], min_length=1, description="GPU classes to choose from "
                           "(names or aliases of the train form's `compute.gpu`): the cheapest one whose memory holds "
                           "the base in bf16, the adapters and a KV cache of `max_model_len` tokens, in stock.")
    max_workers: int = Field(default=1, ge=1, le=30, description="The most workers (one GPU each) the endpoint runs "
                             "at once: `workers.max`, held as this many slots of the endpoint limit while it lives.")
    idle_timeout_s: int = Field(default=60, ge=1, le=3600, description="Seconds an idle worker stays up (and bills) "
                                "before it stops: a request after that waits for a cold start.")
    hours: float = Field(gt=0, le=168, description="How long the endpoint may live, from the start of the serve: "
                         "then it is deleted (the reconcile flow deletes it too once its name's expiry has passed).")
    budget_usd: float = Field(gt=0, description="The endpoint is deleted once it has cost this much (RunPod's billed "
                              "cost, or loraflow's own count of worker time × price when that is more).")
    max_model_len: int | None = Field(
        default=None, ge=64, le=1_048_576, description="`MAX_MODEL_LEN`: the longest prompt + answer in tokens; sizes "
        f"the KV cache the GPU must hold. Empty: {DEFAULT_MAX_MODEL_LEN}, or the base's context where that is shorter.")
    prompts: list[str] | None = Field(
        default=None, max_length=MAX_PROMPTS, description="What \"try it\" asks, through the base and each adapter, "
        "once the endpoint answers. Default: an adapter run's evaluation prompts, else two fixed ones.")
    max_tokens: int = Field(default=128, ge=1, le=4096, description="The longest answer \"try it\" asks for, in tokens.")
    cold_start_minutes: float = Field(
        default=20, ge=1, le=120, description="How long the first request may wait for a worker to answer (image "
        "pull, the base's download, vLLM's startup); workers that crash while starting end the serve sooner.")

    @field_validator("adapters", mode="before")
    @classmethod
    def _sources(cls, value: Any) -> Any:
        return [{"source": item} if isinstance(item, str) else item for item in value] if isinstance(value, list) else value

    @model_validator(mode="after")
    def _distinct_names(self) -> "ServeSettings":
        names = [a.name or default_adapter_name(a.source) for a in self.adapters]
        bad = [n for n in names if not re.match(_ADAPTER_NAME, n)]
        if bad:
            raise ValueError(f"adapters: {bad} cannot be model names (letters, digits, `.`, `_`, `-`): give each a name")
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice or self.base_model in names:
            raise ValueError(f"adapters: the names {twice or [self.base_model]} are taken twice (the base answers to "
                             "base_model): give the adapters distinct names")
        return self

    @model_validator(mode="after")
    def _answers_fit_the_context(self) -> "ServeSettings":
        if self.max_model_len is not None and self.max_tokens >= self.max_model_len:
            raise ValueError(f"max_tokens {self.max_tokens} leaves no room for a prompt within max_model_len "
                             f"{self.max_model_len} (vLLM refuses a request whose prompt and max_tokens pass it): "
                             "lower max_tokens or raise max_model_len")
        return self


class ServeSpec(BaseModel):
    """A serve file: a name, the store its runs' adapters are read from, the Hub token, and `[serve]`."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$", description="The serve's label: in its endpoint's "
                      "name, its flow run's tag `serve:<name>` and `--stop <name>`.")
    artifact_store: str | None = Field(default=None, description="The artifact store (`hf://datasets/<org>/<repo>` or "
                                       "`file:///path`) that `runs/<id>` adapters are read from.")
    hub_token_secret: str | None = Field(default=None, description="Prefect Secret block holding your Hugging Face "
                                         "token: it reads the base and adapters, publishes runs, and reaches the "
                                         "workers as a RunPod account secret. Default: the flow's HF_TOKEN.")
    serve: ServeSettings


def load_serve_file(path: str | Path) -> ServeSpec:
    """Parse and validate a TOML serve file; `SpecError` names every bad field."""
    try:
        return ServeSpec.model_validate(read_run_file(Path(path)))
    except ValidationError as e:
        raise SpecError(describe_validation_error(e, str(path))) from e
