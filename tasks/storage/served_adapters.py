"""The LoRA adapters a serve puts on its endpoint, resolved before anything is rented: where RunPod's vLLM worker reads
each one (`--lora-modules name=path`: a Hub model repo id, or a local folder), the name it answers to, its rank (from
its `adapter_config.json`, which sets `MAX_LORA_RANK`), and what it was trained on.

An adapter's source is one of:
- `runs/<run id>`: a completed run in the serve's artifact store. The worker reads adapters from the Hub or from its
  own disk, not from a folder of a dataset repo, so from an `hf://` store the run is published first, to the private
  model repo `<the store's org>/loraflow-<run id>` (`publish.publish_adapter`: one commit, nothing committed again when
  it is there already). From a `file://` store (local mode), the worker reads its folder `<store>/runs/<id>/adapter`:
  localpod's workers share this machine's disk, as a local path on `--lora-modules` is read by vLLM.
- `<org>/<name>`: a Hub model repo holding a PEFT adapter; the worker downloads it with the serve's token.
- a local folder holding a PEFT adapter, in local mode only (RunPod's workers cannot see this machine).

Every adapter's config is held to what the pinned vLLM loads (`vllm_refusals`, the one rule the publish card states
too): an adapter it would refuse stops `vllm serve` at startup on every worker RunPod starts, a billed crash loop, so
it is refused here, before anything is rented. vLLM never checks an adapter against the base it serves (serving.md
§2): a run's recorded base, or a Hub adapter's `base_model_name_or_path` naming a Hub model, that is not the serve's
base is refused here too (a local folder's path is only a warning: it may name the folder it was trained from).

A Hub adapter is read at the commit its repo holds when the serve is checked (`ServedAdapter.revision`); vLLM
downloads `--lora-modules` repos with no revision (serving.md §2), so the serve's watch compares that commit with the
repo's on every reading and says when it moves. A stored run is served from its own private repo, which nothing but
the run's publish writes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import unquote, urlparse

from huggingface_hub import HfApi, hf_hub_download
from huggingface_hub.errors import HfHubHTTPError
from loraflow_worker.artifacts import ArtifactNotFound, open_store
from loraflow_worker.contract import run_prefix
from loraflow_worker.contract.lora_settings import BASE_REWRITING_INITS
from loraflow_worker.evaluation.vllm_lora import (
    REQUIRED_FIELDS,
    VLLM_LORA_RANKS,
    adapter_rank,
    base_rewriting_init,
    embedding_targets,
    trains_biases,
    unimplemented_variants,
    unloaded_saved_modules,
)
from pydantic import BaseModel, Field

ADAPTER_CONFIG = "adapter_config.json"
RUN_SOURCE = re.compile(r"^runs/(?P<run_id>[A-Za-z0-9][A-Za-z0-9._-]*)/?$")
PUBLISHED_REPO = "{org}/loraflow-{run_id}"
"""The private Hub model repo a stored run's adapter is published to for serving."""
VLLM_DEFAULT_MAX_LORA_RANK = 16  # vLLM's default `--max-lora-rank` (serving.md §2)
PROMPT_KEYS = ("prompt", "instruction", "question")


class AdapterRefused(ValueError):
    """An adapter of `serve.adapters` cannot be served as given: nothing was rented. The message names the entry."""


class ServedAdapter(BaseModel):
    """One adapter as the endpoint serves it."""

    name: str = Field(description="The model name it answers to (`\"model\"` of a request).")
    source: str = Field(description="As the serve file gave it.")
    path: str = Field(description="What the worker loads: a Hub model repo id, or a local folder (local mode).")
    rank: int = Field(description="Its LoRA rank: the largest of `r` and `rank_pattern` in its adapter_config.json.")
    revision: str | None = Field(default=None, description="The commit of its Hub repo read when the serve was "
                                 "checked; None for a folder or a run not yet published.")
    run_id: str | None = Field(default=None, description="The stored run it comes from, if any.")
    trained_on: str | None = Field(default=None, description="The base it was trained on, when known.")
    publish_from: str | None = Field(
        default=None, description="The hf:// store a run is published from to `path` before the endpoint is made; "
        "None when the worker reads it where it is.")


def default_adapter_name(source: str) -> str:
    """An adapter's model name when the serve file gives none: the last part of its source."""
    return PurePosixPath(source.rstrip("/")).name


def vllm_refusals(config: dict[str, Any]) -> list[str]:
    """Why the pinned vLLM's LoRA loader refuses an adapter with this `adapter_config.json`, each reason naming its
    field, in a serve's words; empty when it loads. The rule is the worker's (`loraflow_worker.evaluation.vllm_lora`,
    vLLM's own checks, which stop `vllm serve` at startup), so a serve refuses what the worker's answering does."""
    reasons = []
    if missing := [key for key in REQUIRED_FIELDS if key not in config]:
        reasons.append(f"{', '.join(f'`{k}`' for k in missing)} missing: vLLM requires r, lora_alpha and "
                       "target_modules")
    if config.get("use_dora"):
        reasons.append("`use_dora` is set: vLLM does not load DoRA adapters")
    if unloaded_saved_modules(config):
        reasons.append(f"`modules_to_save` is {config['modules_to_save']}: vLLM loads LoRA weights only, not whole "
                       "trained modules")
    if trains_biases(config):
        reasons.append("`lora_bias` or `bias` is set: vLLM does not load trained biases")
    if init := base_rewriting_init(config):
        reasons.append(f"`init_lora_weights` is {init!r}: vLLM does not load an adapter whose init rewrites the base "
                       "(PiSSA, OLoRA, CorDA, LoftQ) until PEFT converts it to a plain LoRA "
                       "(`path_initial_model_for_weight_conversion`, as loraflow stores its own)")
    if unimplemented := unimplemented_variants(config):
        reasons.append(f"it uses {', '.join(unimplemented)}, which vLLM does not implement")
    if embedding := embedding_targets(config.get("target_modules")):
        reasons.append(f"`target_modules` includes {', '.join(embedding)}: vLLM applies LoRA to linear projections, "
                       "not to the embeddings or the output head")
    try:
        rank = adapter_rank(config)
    except ValueError:
        rank = None
    if rank is not None and rank > VLLM_LORA_RANKS[-1]:
        reasons.append(f"`r` {rank} is above {VLLM_LORA_RANKS[-1]}, the largest MAX_LORA_RANK vLLM accepts")
    return reasons


def run_adapter_refusals(lora: dict[str, Any]) -> list[str]:
    """`vllm_refusals` of the adapter a run's `[lora]` section makes, before or without reading its
    adapter_config.json: PEFT's names for its fields, and the rank the worker stores (`stored_rank`)."""
    return vllm_refusals({"r": stored_rank(lora) or VLLM_DEFAULT_MAX_LORA_RANK,
                          "lora_alpha": lora.get("alpha", 1), "use_dora": lora.get("use_dora"),
                          "target_modules": lora.get("target_modules", "all-linear"),
                          "modules_to_save": lora.get("modules_to_save")})


def stored_rank(lora: dict[str, Any]) -> int | None:
    """The rank of the adapter a run's `[lora]` section stores: `lora.rank`, twice that for an init that rewrites the
    base (the worker stores a PiSSA or OLoRA adapter converted to a plain LoRA of twice the rank)."""
    rank = lora.get("rank")
    if not isinstance(rank, int):
        return None
    return rank * 2 if str(lora.get("init", "default")).startswith(BASE_REWRITING_INITS) else rank


def is_local_path(source: str) -> bool:
    return source.startswith(("/", "./", "../", "~"))


def resolve_adapter(source: str, name: str | None, *, base_model: str, store_url: str | None, token: str | None,
                    hub_endpoint: str | None, local_ok: bool, field: str) -> ServedAdapter:
    """`source` as the endpoint will serve it (see the module docstring); `field` names the entry in refusals.
    `local_ok`: the workers run on this machine (localpod), so local folders may be served."""
    name = name or default_adapter_name(source)
    if (run := RUN_SOURCE.match(source)) is not None:
        return _stored_run(run["run_id"], name, source, base_model=base_model, store_url=store_url, token=token,
                           hub_endpoint=hub_endpoint, local_ok=local_ok, field=field)
    if is_local_path(source):
        folder = Path(source).expanduser().resolve()
        if not local_ok:
            raise AdapterRefused(f"{field}: {source!r} is a folder of this machine, which RunPod's workers cannot "
                                 "read: push the adapter to the Hub and name its repo, or serve the run (`runs/<id>`)")
        return ServedAdapter(name=name, source=source, path=str(folder), **_config_facts(
            lambda: json.loads((folder / ADAPTER_CONFIG).read_text()), field, source))
    if re.fullmatch(r"[\w.-]+/[\w.-]+", source) is None:
        raise AdapterRefused(f"{field}: {source!r} is neither `runs/<run id>`, a Hub repo id `<org>/<name>` nor a "
                             "local folder")

    revision = None

    def hub_config() -> dict[str, Any]:
        nonlocal revision
        revision = hub_revision(source, token=token, hub_endpoint=hub_endpoint)
        path = hf_hub_download(source, ADAPTER_CONFIG, revision=revision, endpoint=hub_endpoint, token=token)
        return json.loads(Path(path).read_text())

    facts = _config_facts(hub_config, field, source)
    trained_on = facts["trained_on"]
    if trained_on and trained_on != base_model and re.fullmatch(r"[\w.-]+/[\w.-]+", trained_on) \
            and not is_local_path(trained_on):
        raise AdapterRefused(f"{field}: {source!r} is an adapter of {trained_on} (its {ADAPTER_CONFIG}'s "
                             f"base_model_name_or_path), not of serve.base_model {base_model!r}: vLLM would load it "
                             "onto the wrong base without a word; serve it with its own base")
    return ServedAdapter(name=name, source=source, path=source, revision=revision, **facts)


def hub_revision(repo: str, *, token: str | None, hub_endpoint: str | None) -> str:
    """The commit a Hub model repo's main branch points at now."""
    return str(HfApi(endpoint=hub_endpoint, token=token).model_info(repo).sha)


def _stored_run(run_id: str, name: str, source: str, *, base_model: str, store_url: str | None, token: str | None,
                hub_endpoint: str | None, local_ok: bool, field: str) -> ServedAdapter:
    if store_url is None:
        raise AdapterRefused(f"{field}: {source!r} is a stored run, and the serve names no artifact_store: set it to "
                             "the store the run wrote")
    hub = store_url.startswith("hf://")
    if not hub and not local_ok:
        raise AdapterRefused(f"{field}: {source!r} is in {store_url}, a folder of this machine, which RunPod's workers "
                             "cannot read: serve runs of an hf:// store")
    store = open_store(store_url, token if hub else None, endpoint=hub_endpoint)
    prefix = run_prefix(run_id)
    try:
        manifest = store.read_json(f"{prefix}/manifest.json")
        config = store.read_json(f"{prefix}/adapter/{ADAPTER_CONFIG}")
    except ArtifactNotFound as e:
        raise AdapterRefused(f"{field}: run {run_id} has no stored adapter in {store_url}: only a completed run "
                             "can be served") from e
    trained_on = str(manifest.get("base_model_id") or "")
    if trained_on and trained_on != base_model:
        raise AdapterRefused(f"{field}: run {run_id} trained an adapter of {trained_on}, not of serve.base_model "
                             f"{base_model!r} (vLLM would load it onto the wrong base): serve it with its own base")
    facts = _config_facts(lambda: config, field, source)
    facts["trained_on"] = trained_on or facts["trained_on"]
    if hub:
        org = store_url.removeprefix("hf://datasets/").split("/")[0]
        return ServedAdapter(name=name, source=source, path=PUBLISHED_REPO.format(org=org, run_id=run_id),
                             run_id=run_id, publish_from=store_url, **facts)
    folder = Path(unquote(urlparse(store_url).path)) / prefix / "adapter"
    return ServedAdapter(name=name, source=source, path=str(folder), run_id=run_id, **facts)


def _config_facts(read: Any, field: str, source: str) -> dict[str, Any]:
    try:
        config = read()
    except (OSError, ValueError, HfHubHTTPError) as e:
        raise AdapterRefused(f"{field}: {source!r} has no readable {ADAPTER_CONFIG} ({type(e).__name__}: "
                             f"{str(e)[:200]}): name a folder or Hub repo holding a PEFT adapter (a private repo needs "
                             "hub_token_secret)") from e
    try:
        rank = adapter_rank(config)
    except ValueError as e:
        raise AdapterRefused(f"{field}: {source!r}'s {ADAPTER_CONFIG} is not a LoRA adapter's ({e})") from e
    if reasons := vllm_refusals(config):
        raise AdapterRefused(f"{field}: vLLM refuses the adapter {source!r} ({'; '.join(reasons)}), and every worker "
                             "would stop while it starts: train it without that, or merge it into the base "
                             "(`merge_and_unload()`) and serve the merged model")
    return {"rank": rank, "trained_on": config.get("base_model_name_or_path")}


def run_prompts(store_url: str, run_id: str, token: str | None, hub_endpoint: str | None, limit: int) -> list[str]:
    """Up to `limit` prompts of a stored run's evaluation file (`evaluation.store_path`, its held-out examples): the
    first user turn of each chat, or its `prompt`. Empty when the run held its evaluation out of the dataset (a
    `fraction`: the rows are not stored apart) or had none."""
    store = open_store(store_url, token if store_url.startswith("hf://") else None, endpoint=hub_endpoint)
    try:
        job = store.read_json(f"{run_prefix(run_id)}/manifest.json").get("job") or {}
        path = (job.get("evaluation") or {}).get("store_path")
        text = store.read_bytes(path).decode() if path else ""
    except (ArtifactNotFound, AttributeError, UnicodeDecodeError):
        return []
    prompts = []
    for line in text.splitlines():
        if len(prompts) >= limit:
            break
        try:
            prompt = _first_prompt(json.loads(line))
        except ValueError:
            continue
        if prompt:
            prompts.append(prompt)
    return prompts


def _first_prompt(row: Any) -> str | None:
    if not isinstance(row, dict):
        return None
    messages = row.get("messages") or (row["prompt"] if isinstance(row.get("prompt"), list) else None)
    if isinstance(messages, list):
        return next((m["content"] for m in messages if isinstance(m, dict) and m.get("role") == "user"
                     and isinstance(m.get("content"), str)), None)
    return next((row[k] for k in PROMPT_KEYS if isinstance(row.get(k), str) and row[k].strip()), None)
