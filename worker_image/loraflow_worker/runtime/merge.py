"""A merge job: a stored run's LoRA adapter merged into its base model and published as a plain Hub model repo.

The control plane sends (on a CPU endpoint, `tasks/jobs/merge.py`)

    {"contract_version": 13, "mode": "merge", "run_id": "<flow run id>", "run_name": "capybara",
     "artifact_store": "hf://datasets/acme/runs", "base_model": {"id": "Qwen/Qwen3-8B", "revision": "<sha>"},
     "merged_model_id": "acme/qwen3-capybara", "adapter_repo": "acme/qwen3-capybara-lora"}

and the worker: downloads the base (pinned commit; the volume's Hub cache when one is attached) and the adapter
(`runs/<id>/adapter`, at the store commit the run recorded, `adapter_revision`, each file checked against the
`adapter_sha256` the run recorded: an adapter someone changed in the store since is refused, `ArtifactChanged`); loads the base in bf16 on the CPU, whatever the run trained on (a QLoRA adapter is merged
into the bf16 base, never into a 4-bit one); puts PEFT's unmerged adapter on top and takes its logits on a few
fixed inputs; `merge_and_unload()`s and takes the merged model's logits on the same inputs; compares them
(`compare_logits`: beyond the tolerance the job fails and nothing is published); unties the head from the input
embeddings in the config when the adapter trained either (`lora.modules_to_save`), so that transformers and vLLM load
the trained one; saves the merged model (safetensors) and the tokenizer; loads what it saved back, as a user would,
and compares its logits again (what is published is the files, not the model in memory); and commits them with a
model card and a record (`loraflow-merge.json`) to the repo in ONE commit titled with the run id, with the worker's
`HF_TOKEN` (the run's token, from a RunPod account secret).

Why a CPU worker of its own rather than the training GPU before teardown: merging and uploading (16 GB for an 8B
model) are CPU- and network-bound, and on the training worker they would bill minutes at a GPU's rate (~20-50× a
CPU worker's); a study knows its best child only after every child's worker is gone, and a merge job can merge any
stored adapter later. The cost is a second download of the base.

A redelivered job finds its commit in the repo's history (the title names the run) and returns that commit's
record without merging again. The job runs in the handler's process: the endpoint serves this one job.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi, ModelCard, ModelCardData
from huggingface_hub.errors import RemoteEntryNotFoundError, RepositoryNotFoundError

from loraflow_worker.artifacts import open_store
from loraflow_worker.artifacts.pins import download_pinned
from loraflow_worker.contract import LogitsCheck, MergeInput, MergeResult, Progress, run_prefix
from loraflow_worker.contract.merge import DEFAULT_LOGITS_RTOL
from loraflow_worker.runtime.model_cache import resolve_base_model

BF16_RESOLUTION = 2.0**-8
"""bf16's relative resolution (8 significant bits): logits that differ by less than this share of their scale are the
same number in bf16."""
MERGE_TITLE = "loraflow run {run_id}: merged model"
"""Title of the merge's commit; the run id in it is how a redelivered job knows the merge is published already."""
RECORD_FILE = "loraflow-merge.json"
"""What the repo's merged model came from, its logits check, and the files loraflow put there (the next merge
replaces them)."""
CARD_FILE = "README.md"
HUB_BRANCH = "main"
MAX_SHARD_SIZE = "2GB"
"""Safetensors shard size: the shard being written is held in memory once more, which the CPU worker's sizing
counts (`tasks/jobs/merge.py`)."""
PROBE_TEXTS = (
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Question: What is 17 times 3?\nAnswer:",
)
"""The fixed inputs the logits check runs on: prose, code, a question."""
MAX_PROBE_TOKENS = 32
DATA_CENTER_ENV = "RUNPOD_DC_ID"
_TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")

log = logging.getLogger("loraflow_worker")


class MergeMismatch(RuntimeError):
    """The merged model's logits differ from base + adapter's beyond the tolerance: nothing was published."""


def merge_adapter(job: MergeInput, work_dir: Path, report: Callable[[Progress], None]) -> MergeResult:
    """Merge, check, publish (see the module docstring); returns the result, or the earlier commit's when the repo
    has this run's merge already. Raises `MergeMismatch` when the logits check fails, `ArtifactChanged` when the
    stored adapter is not the one the run recorded, and the Hub's or the store's errors as they come."""
    import torch

    started = time.monotonic()
    api = HfApi(library_name="loraflow")  # HF_ENDPOINT and HF_TOKEN from the worker's environment
    store = open_store(job.artifact_store)
    adapter_path = f"{run_prefix(job.run_id)}/adapter"
    adapter = job.adapter_repo or store.display_url(adapter_path)
    earlier = earlier_merge(api, job)
    if earlier is not None:
        log.info("%s already holds run %s's merge: %s", job.merged_model_id, job.run_id, earlier.commit_url)
        return earlier
    report(Progress(stage="loading", message=f"merge: downloading the adapter and the base model {job.base_model.id}"))
    # The adapter first: one that changed since the run stored it is refused before the base's gigabytes come down.
    adapter_dir = download_pinned(store, adapter_path, work_dir / "adapter", revision=job.adapter_revision,
                                  sha256=job.adapter_sha256, since="after the run stored it")
    base_dir, revision = resolve_base_model(job.base_model)
    report(Progress(stage="loading", message="merge: loading the base in bf16 on the CPU, the adapter on top"))
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer_dir = adapter_dir if all((adapter_dir / f).is_file() for f in _TOKENIZER_FILES) else base_dir
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.bfloat16, device_map="cpu")
    base_ties_head = ties_head_to_embeddings(base)
    inputs = probe_inputs(tokenizer)
    unmerged = PeftModel.from_pretrained(base, adapter_dir)
    reference = probe_logits(unmerged, inputs)
    with unmerged.disable_adapter():
        base_only = probe_logits(unmerged, inputs)
    report(Progress(stage="saving", message="merge: merging the adapter into the weights"))
    merged = unmerged.merge_and_unload(safe_merge=True)
    check = compare_logits(reference, probe_logits(merged, inputs), job.logits_tolerance, base=base_only)
    log.info("merge: logits check over %d inputs: max |difference| %.3g, tolerance %.3g, the adapter's effect %.3g",
             check.inputs, check.max_abs_difference, check.tolerance, check.adapter_effect)
    if not check.passed:
        raise MergeMismatch(
            f"the merged model's logits differ from base + adapter's by up to {check.max_abs_difference:.4g} on "
            f"{check.inputs} fixed inputs, beyond the tolerance {check.tolerance:.4g} or half the adapter's own effect "
            f"{check.adapter_effect:.4g} (logits' scale {check.reference_max_abs:.4g}): the merge is wrong, and "
            f"nothing was published to {job.merged_model_id}")
    untied_head = untie_a_trained_head(merged) and base_ties_head
    out = work_dir / "merged"
    merged.save_pretrained(out, max_shard_size=MAX_SHARD_SIZE)
    tokenizer.save_pretrained(out)
    del merged, unmerged, base  # the saved model is loaded back next, and the upload needs the memory no more
    gc.collect()
    report(Progress(stage="saving", message="merge: loading the saved model back to check its logits again"))
    check = saved_logits_check(out, inputs, reference, job.logits_tolerance, base=base_only)
    log.info("merge: logits check of the saved model: max |difference| %.3g, tolerance %.3g",
             check.max_abs_difference, check.tolerance)
    if not check.passed:
        raise MergeMismatch(
            f"the merged model as saved, loaded back from its files, gives logits that differ from base + adapter's by "
            f"up to {check.max_abs_difference:.4g} on {check.inputs} fixed inputs, beyond the tolerance "
            f"{check.tolerance:.4g} or half the adapter's own effect {check.adapter_effect:.4g}, though the model in "
            f"memory matched: the saved files are not the merged model (e.g. a trained head missing from them, the "
            f"config tying the head to the input embeddings), and nothing was published to {job.merged_model_id}")
    weights = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    result = MergeResult(
        run_id=job.run_id, merged_model_id=job.merged_model_id, url=f"{api.endpoint}/{job.merged_model_id}",
        commit_url="", base_model=job.base_model.id, base_model_revision=revision, adapter=adapter,
        logits_check=check, merged_bytes=weights, seconds=0.0, data_center=os.environ.get(DATA_CENTER_ENV))
    (out / CARD_FILE).write_text(merged_card(job, result, untied_head=untied_head))
    report(Progress(stage="saving", message=f"merge: uploading {weights / 1e9:.2f} GB to {job.merged_model_id}"))
    commit_url = upload(api, job, out, result)
    return result.model_copy(update={"commit_url": commit_url, "seconds": round(time.monotonic() - started, 1)})


def ties_head_to_embeddings(model: Any) -> bool:
    """Whether `model`'s config ties its LM head to its input embeddings (`tie_word_embeddings`, on the model's config
    or, for a model with a text part, on the text config)."""
    return any(getattr(config, "tie_word_embeddings", False) for config in _configs(model))


def untie_a_trained_head(merged: Any) -> bool:
    """Whether the merged model's LM head differs from its input embeddings, and if so, its config made to say so
    (`tie_word_embeddings` false), so that both weights are saved and loaded as they are. An adapter that trained the
    head or the embeddings (`lora.modules_to_save`) of a tied model leaves two different weights; with a config that
    still ties them, vLLM skips `lm_head.weight` and serves the embeddings as the head (transformers 5.20 keeps the two
    apart only when it finds both in the files, and warns): the trained head would be lost where it is served. PEFT
    0.21 unties when the two tensors are not the same memory; this checks the values, on every config of the
    model."""
    import torch

    head, embeddings = merged.get_output_embeddings(), merged.get_input_embeddings()
    if head is None or embeddings is None:
        return False
    if head.weight.shape == embeddings.weight.shape and torch.equal(head.weight, embeddings.weight):
        return False
    for config in _configs(merged):
        if getattr(config, "tie_word_embeddings", False):
            config.tie_word_embeddings = False
    return True


def _configs(model: Any) -> list[Any]:
    config = model.config
    text = config.get_text_config()
    return [config] if text is config else [config, text]


def saved_logits_check(folder: Path, inputs: Sequence[Any], reference: Sequence[Any], tolerance: float | None,
                       base: Sequence[Any] | None = None) -> LogitsCheck:
    """`compare_logits` for the merged model as saved in `folder`: loaded back as a user loads it (transformers, bf16,
    on the CPU), its logits on `inputs` against `reference` (base + unmerged adapter's on the same inputs)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, device_map="cpu")
    try:
        return compare_logits(reference, probe_logits(model, inputs), tolerance, base=base)
    finally:
        del model
        gc.collect()


def probe_inputs(tokenizer: Any) -> list[Any]:
    """`PROBE_TEXTS` as token id tensors (one batch each, at most `MAX_PROBE_TOKENS` tokens)."""
    import torch

    return [torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"][:MAX_PROBE_TOKENS]])
            for text in PROBE_TEXTS]


def probe_logits(model: Any, inputs: Sequence[Any]) -> list[Any]:
    """The model's logits on each input, as float32 (bf16 models compute in bf16; the comparison in float32)."""
    import torch

    with torch.no_grad():
        return [model(input_ids=ids).logits.float() for ids in inputs]


def compare_logits(reference: Sequence[Any], merged: Sequence[Any], tolerance: float | None,
                   base: Sequence[Any] | None = None) -> LogitsCheck:
    """The merged model's logits against the reference's (base + unmerged adapter), input by input. `tolerance`:
    the largest absolute difference allowed; None: `DEFAULT_LOGITS_RTOL` × the reference's largest magnitude. `base`:
    the base's own logits (the adapter switched off), so that a merge that left the base as it was fails even when
    the adapter moves the logits by less than the tolerance's share of their scale."""
    compared = [merged] + ([base] if base is not None else [])
    if any(len(reference) != len(other) or any(r.shape != o.shape for r, o in zip(reference, other))
           for other in compared):
        raise ValueError("the reference and merged logits must come from the same inputs")
    difference = max(float((r - m).abs().max()) for r, m in zip(reference, merged))
    scale = max(float(r.abs().max()) for r in reference)
    allowed = DEFAULT_LOGITS_RTOL * scale if tolerance is None else tolerance
    effect = max(float((r - b).abs().max()) for r, b in zip(reference, base)) if base is not None else None
    # An adapter that moves the logits by less than bf16's resolution at their scale cannot be told apart after a
    # merge in bf16: there only the tolerance holds.
    carried_over = effect is None or effect <= BF16_RESOLUTION * scale or difference <= effect / 2
    return LogitsCheck(inputs=len(reference), tokens=sum(int(r.shape[-2]) for r in reference),
                       max_abs_difference=difference, reference_max_abs=scale, tolerance=allowed,
                       adapter_effect=effect, passed=difference <= allowed and carried_over)


def merged_card(job: MergeInput, result: MergeResult, *, untied_head: bool = False) -> str:
    """The repo's `README.md`: front matter (`base_model`, `library_name: transformers`), and what was merged, from
    which run, the logits check (and what a QLoRA adapter's covers), whether the head was untied from the input
    embeddings (`untied_head`), and how to load and serve it."""
    base, repo, check = result.base_model, job.merged_model_id, result.logits_check
    hub_base = not base.startswith("/")  # a local folder in local mode: named in the text only
    data = ModelCardData(base_model=base if hub_base else None, base_model_relation="merge" if hub_base else None,
                         library_name="transformers", tags=["loraflow", "lora", "merged"],
                         pipeline_tag="text-generation")
    pinned = f" at revision `{result.base_model_revision}`" if result.base_model_revision else ""
    adapter = f"`{result.adapter}`" if job.adapter_repo else f"`{result.adapter}` (the run's artifact store)"
    verdict = "passed" if check.passed else "failed"
    lines = [
        f"# {repo}", "",
        f"`{base}`{pinned} with the LoRA adapter of loraflow run `{job.run_name}` (`{job.run_id}`) merged into its "
        "weights, in bf16: a plain model that transformers and vLLM load without PEFT.", "",
        "| | |", "|---|---|",
        f"| base model | `{base}`{pinned} |",
        f"| adapter | {adapter} |",
        f"| run | `{job.run_name}` (`{job.run_id}`) |",
        "| merged | bf16, on a CPU worker (`merge_and_unload`) |",
        f"| logits check | max absolute difference {check.max_abs_difference:.4g} against base + adapter (PEFT, "
        f"unmerged) over {check.inputs} fixed inputs ({check.tokens} tokens), tolerance {check.tolerance:.4g}"
        + (f"; the adapter moves the base's logits by up to {check.adapter_effect:.4g}"
           if check.adapter_effect is not None else "") + ": "
        f"{verdict} |", "",
        "The logits check compares the merged model as published: its saved files, loaded back with transformers.", "",
    ]
    if job.quantization == "4bit":
        lines += ["The adapter was trained on the base quantized to 4 bits (QLoRA); it is merged into the bf16 base, "
                  "as QLoRA adapters are meant to be served. The logits check covers that merge's arithmetic: the "
                  "merged model against the bf16 base with the adapter on top. It does not compare with the 4-bit "
                  "model the adapter was trained against, whose outputs differ from the bf16 base's by the "
                  "quantization's error: the merged model can answer a little differently from the model the run "
                  "evaluated.", ""]
    if untied_head:
        lines += ["The adapter trained the LM head or the input embeddings (`modules_to_save`) of a base that ties the "
                  "two: the merged model's config unties them (`tie_word_embeddings: false`) and holds both weights, "
                  "so that transformers and vLLM load the trained ones.", ""]
    lines += ["## Load it", "", "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
              f'model = AutoModelForCausalLM.from_pretrained("{repo}")',
              f'tokenizer = AutoTokenizer.from_pretrained("{repo}")', "```", "",
              "## Serve it with vLLM", "", "```bash", f"vllm serve {repo}", "```", "",
              "A private repo needs `HF_TOKEN` set where it is loaded."]
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines) + "\n"))


def earlier_merge(api: HfApi, job: MergeInput) -> MergeResult | None:
    """The result recorded by this run's earlier merge commit in the repo, or None when there is none."""
    title = MERGE_TITLE.format(run_id=job.run_id)
    try:
        commit = next((c for c in api.list_repo_commits(job.merged_model_id) if c.title == title), None)
    except RepositoryNotFoundError:
        return None
    if commit is None:
        return None
    try:
        record = json.loads(Path(api.hf_hub_download(job.merged_model_id, RECORD_FILE, revision=commit.commit_id))
                            .read_text())
        return MergeResult.model_validate(record["result"]).model_copy(update={
            "already_merged": True, "commit_url": f"{api.endpoint}/{job.merged_model_id}/commit/{commit.commit_id}"})
    except (RemoteEntryNotFoundError, KeyError, ValueError) as e:  # a commit of this title, not ours: merge again
        log.warning("%s has a commit titled %r without a readable %s (%s): merging again", job.merged_model_id, title,
                    RECORD_FILE, e)
        return None


def upload(api: HfApi, job: MergeInput, folder: Path, result: MergeResult) -> str:
    """Commit `folder` (the merged model, tokenizer and card) and the record to the repo, in one commit, removing
    the files an earlier loraflow merge put there that this one does not replace; returns the commit's URL."""
    files = {p.relative_to(folder).as_posix(): p for p in sorted(folder.rglob("*")) if p.is_file()}
    names = sorted([*files, RECORD_FILE])
    record = {"run_id": job.run_id, "run_name": job.run_name, "files": names,
              "result": result.model_dump(mode="json")}
    try:
        api.repo_info(job.merged_model_id)
        stale = _stale_files(api, job.merged_model_id, set(names))
    except RepositoryNotFoundError:
        api.create_repo(job.merged_model_id, private=job.private, exist_ok=True)
        stale = []
    operations: list[CommitOperationAdd | CommitOperationDelete] = [CommitOperationDelete(p) for p in stale]
    operations += [CommitOperationAdd(name, str(path)) for name, path in files.items()]
    operations.append(CommitOperationAdd(RECORD_FILE, json.dumps(record, indent=2).encode()))
    commit = api.create_commit(job.merged_model_id, operations, commit_message=MERGE_TITLE.format(run_id=job.run_id),
                               commit_description=f"Run {job.run_name} ({job.run_id}) merged into {job.base_model.id} "
                               "by loraflow.", revision=HUB_BRANCH)
    return commit.commit_url


def _stale_files(api: HfApi, repo_id: str, new_files: set[str]) -> list[str]:
    """Files the repo's loraflow record lists that this merge does not write (e.g. shards of another size)."""
    try:
        record = json.loads(Path(api.hf_hub_download(repo_id, RECORD_FILE, revision=HUB_BRANCH)).read_text())
    except RemoteEntryNotFoundError:
        return []
    listed = record.get("files") if isinstance(record, dict) and isinstance(record.get("files"), list) else []
    present = set(api.list_repo_files(repo_id, revision=HUB_BRANCH))
    return sorted(p for p in listed if isinstance(p, str) and p in present and p not in new_files)
