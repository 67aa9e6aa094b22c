"""A chat SFT run's first examples, rendered and masked before renting as the worker will train them
(`loraflow_worker.dataset.loss_mask`): a run whose loss would be on no token of an answer is refused here, naming
`training.loss_on`, `training.chat_template` and the fix, instead of failing on a rented GPU.

The tokenizer is the model's own (its files at the run's pinned commit): read from its `tokenizer.json` without
transformers first (`chat_tokenizer`), and by the image's transformers version before anything is refused;
the template is the one the worker picks (`training.chat_template`, else the model's own where it marks the assistant
turns, else TRL's training version of it, else the model's own masked by each turn's prefix). TRL's training templates
are TRL's to keep right and are not rendered here (the control plane has no TRL): the worker checks those chats as it
starts, before the model loads.
"""

from __future__ import annotations

import fnmatch
import itertools
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from huggingface_hub import HfApi, hf_hub_download
from huggingface_hub.errors import HfHubHTTPError
from loraflow_worker.contract import ModelSource, TrainingSettings, trl_training_template
from loraflow_worker.contract.dataset_formats import to_trl_row
from loraflow_worker.dataset.loss_mask import ChatTemplate, LossMaskError, check_first_chats, has_generation_markers, \
    refusal
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from tasks.preflight.chat_tokenizer import ChatTokenizer
from tasks.settings import Settings

CHECKED_EXAMPLES = 20
"""The worker checks as many (`sft_loss.CHECKED_EXAMPLES`)."""
TOKENIZER_FILES = ["tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab*", "merges.txt", "*.model",
                   "chat_template.json", "chat_template.jinja", "additional_chat_templates/*", "config.json"]
"""What `AutoTokenizer.from_pretrained` reads of a model repo (never its weights)."""
TOKENIZER_FILE_MAX_BYTES = 64 * 2**20
"""The largest tokenizer file the control plane downloads: a model repo is anyone's upload, and a file matching
`TOKENIZER_FILES` could be gigabytes on the control plane's disk. Real ones are far smaller (Qwen3's tokenizer.json
is 11 MB)."""
TOKENIZER_MAX_BYTES = 256 * 2**20
"""The most the control plane downloads of one model's tokenizer files together, for the same reason."""


@dataclass(frozen=True)
class ChatCheck:
    """What the check found: the share of the first chats' tokens that carry the loss, under which template."""

    examples: int
    token_share: float | None
    """None where the worker renders with a TRL training template, which is not rendered here."""
    template: str

    def describe(self) -> str:
        share = f"{self.token_share:.0%} of their tokens carry the loss" if self.token_share is not None else \
            "their loss is masked by TRL's template on the worker"
        return f"the first {self.examples} chats: {share} (chat template: {self.template})"


def first_chats(path: Path, data_format: str = "auto", columns: Mapping[str, str] | None = None,
                count: int = CHECKED_EXAMPLES) -> list[list[dict[str, Any]]]:
    """The `messages` of a local file's first `count` rows, converted from `data_format` with the file's `columns` as
    the worker converts them (the file was checked: `check_dataset_jsonl`); empty for a file of prompt/completion or
    prompt-only rows (Alpaca's among them), whose loss needs no template's marks."""
    with path.open(encoding="utf-8") as lines:
        rows = (to_trl_row(json.loads(line), data_format, columns or {}) for line in lines if line.strip())
        return [row["messages"] for row in itertools.islice(rows, count) if "messages" in row]


def tokenizer_folder(model: ModelSource, settings: Settings) -> Path:
    """A folder holding the model's tokenizer files: the model's own folder in local mode, else those files of the
    pinned commit, downloaded into the Hub cache (no weights). `TokenizerTooLarge`, before any download, when a file
    is above `TOKENIZER_FILE_MAX_BYTES` or all are above `TOKENIZER_MAX_BYTES` (callers leave the check to the
    worker, as for a tokenizer that cannot be read)."""
    if model.revision is None:
        return Path(model.id)
    token = settings.hf_token.get_secret_value() if settings.hf_token else None
    api = HfApi(endpoint=settings.hf_endpoint, token=token)
    # With the files' sizes, so that nothing is downloaded before its size is known.
    files = [s for s in api.model_info(model.id, revision=model.revision, files_metadata=True).siblings or []
             if any(fnmatch.fnmatch(s.rfilename, pattern) for pattern in TOKENIZER_FILES)]
    _within_caps(model.id, [(s.rfilename, s.size) for s in files])
    names = [s.rfilename for s in files]
    paths = [Path(hf_hub_download(model.id, name, revision=model.revision, endpoint=settings.hf_endpoint, token=token))
             for name in names]
    if not paths:
        raise ValueError(f"model.id {model.id!r} has no tokenizer files at {model.revision[:12]}, so its chats cannot "
                         "be rendered: a model repo needs its tokenizer beside its weights")
    # hf_hub_download puts a commit's files in one snapshot folder, in the repo's layout.
    return paths[0].parents[len(PurePosixPath(names[0]).parts) - 1]


class TokenizerTooLarge(ValueError):
    """A model's tokenizer files are larger than the control plane downloads; the worker checks its chats instead."""


def check_chats(chats: list[list[dict[str, Any]]], tokenizer: Any, training: TrainingSettings,
                template_file: Path | None = None) -> ChatCheck:
    """`chats` masked as the worker will: ValueError (the whole refusal) when one would carry no loss."""
    template = chat_template(tokenizer, training, template_file)
    trl_name = None if template is not None else trl_training_template(_own_template(tokenizer) or "")
    if template is None and trl_name is None:
        raise ValueError("the model has no chat template to render the `messages` chats with: give "
                         "training.chat_template (a TRL training template's name, e.g. `qwen3_training`, or a .jinja "
                         "file)")
    if trl_name is not None:
        return ChatCheck(len(chats), None, f"TRL's `{trl_name}`, the training version of the model's template")
    try:
        share = check_first_chats(tokenizer, chats, template, training.max_seq_length)
    except LossMaskError as e:
        raise ValueError(refusal(str(e), template)) from e
    return ChatCheck(len(chats), share, template.source)


class UnreadableTokenizer(OSError):
    """The model's tokenizer files are there but transformers cannot build a tokenizer from them."""


def check_chats_in(folder: Path, chats: list[list[dict[str, Any]]], training: TrainingSettings,
                   template_file: Path | None = None) -> ChatCheck:
    """`check_chats` with the tokenizer in `folder`. A pass of the fast path (`ChatTokenizer`, no transformers
    import) is taken; whatever else it finds, a refusal included, is judged again with transformers' own tokenizer,
    the one training uses. `UnreadableTokenizer` when transformers cannot read it."""
    try:
        light = ChatTokenizer.read(folder)
        if light is not None:
            return check_chats(chats, light, training, template_file)
    except Exception:  # noqa: BLE001, S110 - whatever stopped the fast path, transformers judges the run below
        pass
    # transformers takes a second or more to import. Without torch (the control plane's case) it would say so on
    # import, an advisory the tokenizers do not need.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as e:
        raise UnreadableTokenizer(f"{type(e).__name__}: {e}") from e
    return check_chats(chats, tokenizer, training, template_file)


def chat_template(tokenizer: Any, training: TrainingSettings, template_file: Path | None) -> ChatTemplate | None:
    """The template the worker renders with when it is one to render here; None when it is TRL's (a training template
    named by `training.chat_template`, or TRL's training version of the model's own) or the model has none."""
    if template_file is not None:
        return ChatTemplate(template_file.read_text(encoding="utf-8"),
                            f"training.chat_template ({template_file.name})")
    if training.chat_template is not None:
        return None
    own = _own_template(tokenizer)
    if own is None:
        return None
    if has_generation_markers(own) or trl_training_template(own) is None:
        marks = "" if has_generation_markers(own) else " (no generation markers, no TRL training version)"
        return ChatTemplate(own, f"the model's own chat template{marks}")
    return None


def _within_caps(model_id: str, files: list[tuple[str, int | None]]) -> None:
    """`TokenizerTooLarge` naming the file, its size and the cap unless every file (name, size in bytes) is within
    `TOKENIZER_FILE_MAX_BYTES` and all together within `TOKENIZER_MAX_BYTES`."""
    for name, size in files:
        if size is None:
            raise TokenizerTooLarge(f"the Hub gave no size for {model_id}'s {name}, so it was not downloaded (the "
                                    "control plane downloads tokenizer files of at most "
                                    f"{_mib(TOKENIZER_FILE_MAX_BYTES)})")
        if size > TOKENIZER_FILE_MAX_BYTES:
            raise TokenizerTooLarge(f"{model_id}'s {name} is {_mib(size)}, above the {_mib(TOKENIZER_FILE_MAX_BYTES)} "
                                    "the control plane downloads of a tokenizer file, so it was not downloaded")
    total = sum(size or 0 for _, size in files)
    if total > TOKENIZER_MAX_BYTES:
        raise TokenizerTooLarge(f"{model_id}'s {len(files)} tokenizer files are {_mib(total)} together, above the "
                                f"{_mib(TOKENIZER_MAX_BYTES)} the control plane downloads of a tokenizer, so none was "
                                "downloaded")


def _mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB ({size:,} bytes)"


def _own_template(tokenizer: Any) -> str | None:
    own = tokenizer.chat_template
    return own.get("default") if isinstance(own, dict) else own


@task(name="check-chats", cache_policy=NO_CACHE)
def check_chats_task(model: ModelSource, training: TrainingSettings, files: list[tuple[str, str, dict[str, str]]],
                     template_file: str | None, hub_token_secret: str | None = None) -> ChatCheck | None:
    """The run's local files of chats (`files`: path, format, columns; its dataset's and evaluation's) masked as
    training will, with the model's tokenizer; None when there is nothing to check before renting (loss on every
    token, no local chats: a Hub dataset's are checked by the worker as it starts)."""
    if training.loss_on == "all" or training.chat_template is not None and template_file is None:
        return None
    chats = [chat for path, data_format, columns in files for chat in first_chats(Path(path), data_format, columns)]
    if not chats:
        return None
    try:
        folder = tokenizer_folder(model, Settings().with_hub_token(hub_token_secret))
    except (OSError, ValueError, HfHubHTTPError) as e:
        _not_checked(model, e)
        return None
    try:
        found = check_chats_in(folder, chats, training, Path(template_file) if template_file else None)
    except UnreadableTokenizer as e:
        _not_checked(model, e.__cause__ or e)
        return None
    get_run_logger().info("Loss on the %s: %s", training.loss_on, found.describe())
    return found


def _not_checked(model: ModelSource, error: BaseException) -> None:
    # As the memory plan's read of config.json: a check that cannot run leaves it to the worker.
    get_run_logger().warning("The first chats were not checked before renting: %s's tokenizer could not be read "
                             "(%s: %s); the worker checks them as it starts", model.id, type(error).__name__,
                             str(error)[:300])
