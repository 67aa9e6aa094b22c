"""Publish a completed run's adapter as a Hugging Face Hub *model* repo, by name (the run's `[publish]`).

The adapter files from the run's store (`runs/<id>/adapter`, read at the commit the run recorded and each checked
against the sha256 the worker recorded of it: an adapter someone swapped in the store since is refused, and nothing
is published), a model card (`README.md`), the training curve
(`curve.png`, when stored) and a provenance record (`loraflow-run.json`) go to `<org>/<name>` in ONE commit
(`create_commit` with operations: the Hub counts commits, about 128 per hour per repo). A missing repo is
created (private unless `private=False`); an existing one gets a new commit and keeps its visibility. Then
`PeftModel.from_pretrained(base, "<org>/<name>")` loads it and vLLM serves it with `--lora-modules`.

Publishing twice is avoided by the repo's commit history: a commit whose title names the run id
(`PUBLISH_TITLE`) means this run is published already, and nothing is committed again. That covers a
retried task whose commit landed although its answer was lost, and a retried flow run. (A record file
would not: a later run publishing to the same repo replaces it.)

What a run needs to publish is checked before renting where it can be (`check_publish_token`: a token);
whether the token may write to `<org>` shows only when publishing. A failed publish never fails the run: the
summary and `loraflow.run.finished` carry the reason (`PublishedModel.error`). Transient Hub failures (429,
5xx, no answer) are retried by the Prefect task; a refusal (401/403: a read token, another org) is not.
"""

from __future__ import annotations

import contextlib
import json
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi, ModelCard, ModelCardData
from huggingface_hub.errors import HfHubHTTPError, RemoteEntryNotFoundError, RepositoryNotFoundError
from loraflow_worker.artifacts import ArtifactChanged, ArtifactNotFound, ArtifactStoreError, open_store
from loraflow_worker.artifacts.pins import download_pinned
from loraflow_worker.contract import JobResult, run_prefix
from prefect import task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel, Field

from tasks.reports.summary import CURVE_FILE
from tasks.settings import Settings
from tasks.storage.artifacts import read_job_result
from tasks.storage.served_adapters import run_adapter_refusals, stored_rank

PUBLISH_TITLE = "loraflow run {run_id}: adapter and model card"
"""Title of the publishing commit; the run id in it is how a retry knows the run is published already."""
CARD_FILE = "README.md"  # the Hub shows a repo's README.md as its model card, YAML front matter as metadata
RUN_RECORD_FILE = "loraflow-run.json"
"""Which run the repo's files came from, and which files loraflow put there (the next publish replaces them)."""
ADAPTER_CONFIG = "adapter_config.json"
VLLM_DEFAULT_MAX_LORA_RANK = 16
"""vLLM's `--max-lora-rank` default (its engine arguments): a higher rank must be asked for when serving."""
HUB_BRANCH = "main"


class PublishError(Exception):
    """Publishing failed; the message says what to check. `transient`: the same call may pass later."""

    def __init__(self, message: str, *, transient: bool = False):
        super().__init__(message)
        self.transient = transient


class PublishedModel(BaseModel):
    """Where a run's adapter was published, or why it was not."""

    hub_model_id: str = Field(description="The Hub model repo, `<org>/<name>`.")
    url: str | None = Field(default=None, description="The repo's page; None when publishing failed.")
    commit_url: str | None = Field(default=None, description="The commit that holds this run's adapter.")
    already_published: bool = Field(
        default=False, description="The repo already had this run's commit (a retry): nothing was committed again.")
    error: str | None = Field(default=None, description="Why publishing failed; None when it succeeded.")


class CardFacts(BaseModel):
    """What the model card says, read from the run's stored manifest and metrics."""

    hub_model_id: str
    run_id: str
    run_name: str
    base_model: str = Field(description="A Hub model id, or a local path (local mode).")
    base_model_revision: str | None = None
    algorithm: str = "sft"
    dataset_hub_id: str | None = Field(default=None, description="None: a file published with the run, or a mix.")
    dataset_mix: list[tuple[str | None, float]] = Field(
        default_factory=list, description="A mix's sources: (Hub dataset id, or None for a file; fraction).")
    lora: dict[str, Any] = Field(default_factory=dict)
    training: dict[str, Any] = Field(default_factory=dict)
    grpo: dict[str, Any] | None = None
    dpo: dict[str, Any] | None = None
    metrics: dict[str, Any] = Field(default_factory=dict, description="`metrics.json` as stored.")
    has_curve: bool = False

    @property
    def base_is_hub_id(self) -> bool:
        # A local base model is resolved to an absolute path before the run (tasks/placement/plan.py).
        return not self.base_model.startswith("/")


def check_publish_token(hub_model_id: str, token: str | None, *, field: str = "publish.hub_model_id") -> None:
    """Before renting: publishing (the adapter, or the merged model) needs a token (the Hub refuses anonymous
    writes). ValueError naming the field."""
    if token is None:
        raise ValueError(
            f"{field} {hub_model_id!r}: publishing needs a Hugging Face token that can write to "
            f"{hub_model_id.split('/')[0]!r}: set HF_TOKEN where the flow runs, or name a Prefect Secret block "
            "holding one in hub_token_secret (or remove [publish])"
        )


def model_card(facts: CardFacts) -> str:
    """The repo's `README.md`: YAML front matter (`base_model`, `library_name: peft`, `tags`, `datasets`) and a
    body with the training settings, the final metrics, the curve, and how to load and serve the adapter."""
    data = ModelCardData(
        # The Hub checks `base_model` names a Hub model: a local path (local mode) is named in the text only.
        base_model=facts.base_model if facts.base_is_hub_id else None,
        library_name="peft",
        tags=["loraflow", "lora", facts.algorithm],
        datasets=[facts.dataset_hub_id] if facts.dataset_hub_id else
        [hub_id for hub_id, _ in facts.dataset_mix if hub_id] or None,
        pipeline_tag="text-generation",
    )
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n{_card_body(facts)}"))


def publish_adapter(store_url: str, run_id: str, run_name: str, hub_model_id: str, *, private: bool,
                    token: str | None, endpoint: str | None = None, result: JobResult | None = None) -> PublishedModel:
    """Publish the completed run `run_id` of `store_url` to the Hub model repo `hub_model_id`, in one commit (see
    the module docstring): nothing is committed when the repo has this run's commit already. `token`: the run's
    Hub token (it reads an `hf://` store and writes the model repo); `endpoint`: the Hub (default: HF_ENDPOINT);
    `result`: the run's result (the flow's `RunResults.result`, from the job's own output), whose `revision` and
    `adapter_sha256` pin the adapter; None: the `result.json` the run stored. Raises `PublishError`."""
    api = HfApi(endpoint=endpoint, token=token, library_name="loraflow")
    with _publish_errors(hub_model_id, token):
        store = open_store(store_url, token if store_url.startswith("hf://") else None, endpoint=endpoint)
        result = result or read_job_result(store, run_id)
        facts = read_card_facts(store, run_id, run_name, hub_model_id)
        existed = _ensure_repo(api, hub_model_id, private=private)
        page = f"{api.endpoint}/{hub_model_id}"
        title = PUBLISH_TITLE.format(run_id=run_id)
        if existed:
            earlier = next((c for c in api.list_repo_commits(hub_model_id) if c.title == title), None)
            if earlier is not None:
                return PublishedModel(hub_model_id=hub_model_id, url=page, already_published=True,
                                      commit_url=f"{page}/commit/{earlier.commit_id}")
        with tempfile.TemporaryDirectory(prefix="loraflow-publish-") as tmp:
            files = _repo_files(store, facts, result, Path(tmp))
            operations: list[CommitOperationAdd | CommitOperationDelete] = [
                CommitOperationDelete(path) for path in (_stale_files(api, hub_model_id, set(files)) if existed else [])
            ]
            operations += [CommitOperationAdd(path, content) for path, content in files.items()]
            commit = api.create_commit(hub_model_id, operations, commit_message=title, revision=HUB_BRANCH,
                                       commit_description=f"Run {run_name} ({run_id}), published by loraflow.")
    return PublishedModel(hub_model_id=hub_model_id, url=page, commit_url=commit.commit_url)


def read_card_facts(store: Any, run_id: str, run_name: str, hub_model_id: str) -> CardFacts:
    """The card's facts from the run's `manifest.json` and `metrics.json`, read defensively (a missing
    or odd field leaves its line out), and whether `curve.png` is stored."""
    prefix = run_prefix(run_id)
    manifest = _read_json(store, f"{prefix}/manifest.json")
    job = manifest.get("job") if isinstance(manifest.get("job"), dict) else {}
    dataset = job.get("dataset") if isinstance(job.get("dataset"), dict) else {}
    model = job.get("model") if isinstance(job.get("model"), dict) else {}
    return CardFacts(
        hub_model_id=hub_model_id, run_id=run_id, run_name=run_name,
        base_model=str(manifest.get("base_model_id") or model.get("id") or "unknown"),
        base_model_revision=manifest.get("base_model_revision") or model.get("revision"),
        algorithm=str(job.get("algorithm") or "sft"),
        dataset_hub_id=dataset.get("hub_id") or None,
        dataset_mix=[(entry.get("hub_id") or None, float(entry.get("fraction") or 0))
                     for entry in dataset.get("mix") or [] if isinstance(entry, dict)],
        lora=_dict(job.get("lora")), training=_dict(job.get("training")),
        grpo=_dict(job.get("grpo")) or None,
        dpo=_dict(job.get("dpo")) or None,
        metrics=_read_json(store, f"{prefix}/metrics.json"),
        has_curve=store.exists(f"{prefix}/{CURVE_FILE}"),
    )


def series(metrics: dict[str, Any], key: str) -> list[tuple[int, float]]:
    """A (step, value) series of `metrics.json` (`losses`, `rewards`, `eval_loss`, `eval_reward`, DPO's
    `eval_reward_accuracies`...); malformed
    points are skipped, a missing series is empty."""
    points = metrics.get(key)
    if not isinstance(points, list):
        return []
    return [(int(p[0]), float(p[1])) for p in points
            if isinstance(p, (list, tuple)) and len(p) == 2 and all(isinstance(v, (int, float)) for v in p)]


def published_or_failed(hub_model_id: str, run: Any) -> PublishedModel:
    """A finished publish task's state as a `PublishedModel`: its result, or the error that failed it."""
    if run.is_completed():
        return run.result()
    error = run.result(raise_on_failure=False)
    return PublishedModel(hub_model_id=hub_model_id, error=str(error) or type(error).__name__)


def _retry_transient(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect `retry_condition_fn`: retry only what may pass later (429, 5xx, no answer)."""
    return isinstance(state.data, PublishError) and state.data.transient


@task(name="publish-adapter", cache_policy=NO_CACHE, retries=3, retry_delay_seconds=[5, 30, 60],
      retry_jitter_factor=0.5, retry_condition_fn=_retry_transient)
def publish_adapter_task(store_url: str, run_id: str, run_name: str, hub_model_id: str, private: bool,
                         hub_token_secret: str | None = None, result: JobResult | None = None) -> PublishedModel:
    """`publish_adapter` with the run's Hub token (`hub_token_secret`'s block, else the flow's `HF_TOKEN`)."""
    settings = Settings()
    return publish_adapter(store_url, run_id, run_name, hub_model_id, private=private,
                           token=settings.hub_token(hub_token_secret), endpoint=settings.hf_endpoint, result=result)


def publish_run_adapter(store_url: str, run_id: str, run_name: str, hub_model_id: str, private: bool,
                        hub_token_secret: str | None = None, result: JobResult | None = None) -> PublishedModel:
    """Run the publish task inside a flow; a failure (after its retries) comes back as `PublishedModel.error`,
    so the run completes whatever the Hub said. `result`: the run's result, which pins its adapter (see
    `publish_adapter`)."""
    state = publish_adapter_task(store_url, run_id, run_name, hub_model_id, private, hub_token_secret, result,
                                 return_state=True)
    return published_or_failed(hub_model_id, state)


def _ensure_repo(api: HfApi, repo_id: str, *, private: bool) -> bool:
    """Create the model repo when missing; True when it existed (then its visibility is left as it is)."""
    try:
        api.repo_info(repo_id)
        return True
    except RepositoryNotFoundError:
        # Not `create_repo(exist_ok=True)` alone: on a 403 the client falls back to reading the repo and, with a
        # custom HF_ENDPOINT, fails to parse its own URL (huggingface_hub 2.4.0); asking first avoids that path.
        api.create_repo(repo_id, private=private, exist_ok=True)
        return False


def _repo_files(store: Any, facts: CardFacts, result: JobResult, tmp: Path) -> dict[str, bytes | Path]:
    """The commit's files: the adapter folder (as the run stored it: `result` pins it; PEFT's own README replaced by
    the card), the card, the curve, the record. `adapter_config.json` names the Hub base model, so
    `AutoPeftModelForCausalLM` finds it by id."""
    prefix = run_prefix(facts.run_id)
    adapter = download_pinned(store, f"{prefix}/adapter", tmp / "adapter", revision=result.revision,
                              sha256=result.adapter_sha256, since="after the run stored it")
    files: dict[str, bytes | Path] = {
        p.relative_to(adapter).as_posix(): p for p in sorted(adapter.rglob("*")) if p.is_file()
    }
    if ADAPTER_CONFIG not in files:
        raise PublishError(f"{store.display_url(prefix + '/adapter')} has no {ADAPTER_CONFIG}: not a PEFT adapter")
    if facts.base_is_hub_id:
        # The worker saved the path it loaded the base from (a cache or volume folder on its host).
        config = json.loads(Path(files[ADAPTER_CONFIG]).read_text())
        config["base_model_name_or_path"] = facts.base_model
        if facts.base_model_revision:
            config["revision"] = facts.base_model_revision
        files[ADAPTER_CONFIG] = json.dumps(config, indent=2).encode()
    files[CARD_FILE] = model_card(facts).encode()
    if facts.has_curve:
        files[CURVE_FILE] = store.read_bytes(f"{prefix}/{CURVE_FILE}")
    record = {"run_id": facts.run_id, "run_name": facts.run_name, "algorithm": facts.algorithm,
              "base_model": facts.base_model, "base_model_revision": facts.base_model_revision,
              "files": sorted([*files, RUN_RECORD_FILE])}
    files[RUN_RECORD_FILE] = json.dumps(record, indent=2).encode()
    return files


def _stale_files(api: HfApi, repo_id: str, new_files: set[str]) -> list[str]:
    """Files an earlier loraflow publish put in the repo (its `loraflow-run.json` lists them) that this one does
    not replace: removed in the same commit, so the repo never mixes two adapters. Other files are kept."""
    try:
        with tempfile.TemporaryDirectory(prefix="loraflow-publish-record-") as tmp:
            record = json.loads(Path(api.hf_hub_download(repo_id, RUN_RECORD_FILE, revision=HUB_BRANCH,
                                                         cache_dir=tmp)).read_text())
    except RemoteEntryNotFoundError:
        return []
    listed = record.get("files") if isinstance(record, dict) and isinstance(record.get("files"), list) else []
    present = set(api.list_repo_files(repo_id, revision=HUB_BRANCH))
    return sorted(p for p in listed if isinstance(p, str) and p in present and p not in new_files)


@contextlib.contextmanager
def _publish_errors(repo_id: str, token: str | None) -> Iterator[None]:
    """The one place that turns Hub and store errors into `PublishError`s that say what to check."""
    org = repo_id.split("/")[0]
    try:
        yield
    except PublishError:
        raise
    except ArtifactChanged as e:
        raise PublishError(f"cannot publish to {repo_id}: the run's adapter is not the one it trained: {e}") from e
    except RepositoryNotFoundError as e:
        raise PublishError(_scrub(f"cannot publish to {repo_id}: the Hub hides it from this token (HTTP "
                                  f"{_status(e)}); check the token and that it can read and write {org!r} ({e})",
                                  token)) from e
    except HfHubHTTPError as e:
        status = _status(e)
        if status in (401, 403):
            raise PublishError(_scrub(
                f"cannot publish to {repo_id}: the token cannot write to it (HTTP {status}: {_first_line(e)}); give "
                f"the run a token with write access to {org!r} (hub_token_secret, or HF_TOKEN where the flow runs), "
                "or publish to a repo it can write", token)) from e
        transient = status is None or status in (408, 429) or status >= 500
        raise PublishError(_scrub(f"cannot publish to {repo_id}: the Hub answered HTTP {status} "
                                  f"({_first_line(e)})", token), transient=transient) from e
    except httpx2.TransportError as e:
        raise PublishError(f"cannot publish to {repo_id}: the Hub could not be reached ({type(e).__name__}); "
                           "check the network and HF_ENDPOINT", transient=True) from e
    except ArtifactNotFound as e:
        raise PublishError(f"cannot publish to {repo_id}: the run's files are not in its store ({e})") from e
    except ArtifactStoreError as e:
        raise PublishError(_scrub(f"cannot publish to {repo_id}: the run's store cannot be read ({e})", token),
                           transient=e.transient) from e


def _card_body(facts: CardFacts) -> str:
    repo, base = facts.hub_model_id, facts.base_model
    method = {"sft": "supervised fine-tuning (SFT)", "grpo": "GRPO (reinforcement learning from rewards)",
              "dpo": "DPO (preference tuning on chosen and rejected answers)"}.get(facts.algorithm, facts.algorithm)
    pinned = f" at revision `{facts.base_model_revision}`" if facts.base_model_revision else ""
    lines = [f"# {repo}", "",
             f"A LoRA adapter for `{base}`{pinned}, trained with {method} by loraflow (run `{facts.run_name}`, "
             f"`{facts.run_id}`).", ""]
    if not facts.base_is_hub_id:
        lines += [f"The base model was a local folder (`{base}`): load that model, or the Hub model it was made "
                  "from, as the base below.", ""]
    parent = facts.lora.get("init_from")
    if parent:
        where = "an earlier run in the same artifact store" if str(parent).startswith("runs/") else "a Hub adapter"
        lines += [f"Training went on from the adapter `{parent}` ({where}; `lora.init_from`).", ""]
    dataset = f"`{facts.dataset_hub_id}`" if facts.dataset_hub_id else "a JSONL file published with the run"
    if facts.dataset_mix:
        dataset = "a mix of " + ", ".join(f"{f'`{hub_id}`' if hub_id else 'a JSONL file published with the run'} "
                                          f"({fraction:g})" for hub_id, fraction in facts.dataset_mix)
    lines += ["## Training", "", "| setting | value |", "|---|---|",
              f"| base model | `{base}`{pinned} |",
              f"| dataset | {dataset} |",
              f"| algorithm | {facts.algorithm} |"]
    for section, values in (("lora", facts.lora), ("training", facts.training), ("grpo", facts.grpo or {}),
                            ("dpo", facts.dpo or {})):
        for key, value in values.items():
            if value is None or key == "rewards":
                continue
            if (section, key) in (("grpo", "tools"), ("grpo", "environment")) and isinstance(value, str):
                value = _file_name_only(value)
            lines.append(f"| {section}.{key} | {_cell(value)} |")
    if facts.grpo and isinstance(facts.grpo.get("rewards"), list):
        names = [f"{_file_name_only(str(r.get('name')))} × {r.get('weight', 1.0)}" for r in facts.grpo["rewards"]
                 if isinstance(r, dict)]
        lines.append(f"| grpo.rewards | {_cell(', '.join(names))} |")
    lines += ["", "## Results", "", "| metric | first | final |", "|---|---|---|"]
    m = facts.metrics
    for label, key in (("training loss", "losses"), ("eval loss", "eval_loss"), ("mean reward", "rewards"),
                       ("eval reward", "eval_reward"), ("eval reward accuracy", "eval_reward_accuracies"),
                       ("eval reward margin", "eval_reward_margins")):
        points = series(m, key)
        if points:
            lines.append(f"| {label} | {points[0][1]:.4f} (step {points[0][0]}) | {points[-1][1]:.4f} "
                         f"(step {points[-1][0]}) |")
    lines.append("")
    facts_line = [f"{m['steps']} optimizer steps" if isinstance(m.get("steps"), int) else "",
                  f"{m['tokens']:,} training tokens" if isinstance(m.get("tokens"), int) else "",
                  f"{m['wall_seconds']:.0f} s of training" if isinstance(m.get("wall_seconds"), (int, float)) else "",
                  f"on {m['device']}" if isinstance(m.get("device"), str) else ""]
    if any(facts_line):
        lines += [", ".join(part for part in facts_line if part) + ".", ""]
    if facts.has_curve:
        lines += [f"![Training curve]({CURVE_FILE})", ""]
    rank = stored_rank(facts.lora)
    max_rank = f" --max-lora-rank {rank}" if isinstance(rank, int) and rank > VLLM_DEFAULT_MAX_LORA_RANK else ""
    served_name = repo.split("/")[1]
    revision = f', revision="{facts.base_model_revision}"' if facts.base_model_revision else ""
    pinned_flag = f" --revision {facts.base_model_revision}" if facts.base_model_revision else ""
    lines += [
        "## Load it with PEFT", "",
        "```python",
        "from peft import PeftModel",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        f'base = AutoModelForCausalLM.from_pretrained("{base}"{revision})',
        f'model = PeftModel.from_pretrained(base, "{repo}")',
        f'tokenizer = AutoTokenizer.from_pretrained("{repo}")',
        "```", "",
        "## Serve it with vLLM", "",
    ]
    unservable = run_adapter_refusals(facts.lora)  # the serve's own rule
    if unservable:
        lines += [
            f"vLLM's LoRA loader refuses this adapter ({'; '.join(unservable)}). Merge it into the base "
            "(`model.merge_and_unload()` on the model loaded above, then `save_pretrained`) and serve the merged "
            "model instead.",
        ]
        return "\n".join(lines) + "\n"
    lines += [
        "vLLM serves LoRA adapters on top of their base model (`--enable-lora`); `--lora-modules name=path` takes a "
        "Hub id as the path:", "",
        "```bash",
        f"vllm serve {base}{pinned_flag} --enable-lora --lora-modules {served_name}={repo}{max_rank}",
        "```", "",
        f"Requests to the OpenAI-compatible API then name the model `{served_name}`. A private repo needs `HF_TOKEN` "
        "set where vLLM runs.",
    ]
    return "\n".join(lines) + "\n"


def _file_name_only(name: str) -> str:
    """A user file's reference (`path/to/reward.py:score`, `path/to/tools.py`) as its file name (`reward.py:score`):
    the card is public, and the path is the control plane host's (`/home/alice/secret-project/...`). Other names
    (built-in and module rewards) as they are."""
    match = re.fullmatch(r"(?P<path>.*\.py)(?P<attribute>:[A-Za-z_][A-Za-z0-9_]*)?", name)
    if match is None:
        return name
    return re.split(r"[\\/]", match["path"])[-1] + (match["attribute"] or "")


def _cell(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return f"`{text}`".replace("|", "\\|")


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _read_json(store: Any, path: str) -> dict[str, Any]:
    try:
        value = store.read_json(path)
    except (ArtifactNotFound, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _status(error: HfHubHTTPError) -> int | None:
    return error.response.status_code if error.response is not None else None


def _first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def _scrub(message: str, token: str | None) -> str:
    # The Hub's messages do not echo the token; a message must never carry it, whatever the server says.
    return message.replace(token, "***") if token else message
