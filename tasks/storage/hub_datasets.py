"""A run's Hub datasets, checked before anything is rented, without `datasets` (the worker's, not the control
plane's): the dataset, its revision (pinned to the commit it names now), its config and split (as the README's
`configs:` declares them, or as `datasets` finds splits by file name), and its first rows, converted by the worker's
own code (`contract.dataset_formats`) when the split's first file is JSON Lines. Parquet and other files are read by
the worker only: their rows are checked when it loads them."""

from __future__ import annotations

import json
import re
from pathlib import PurePosixPath

import yaml
from huggingface_hub import HfApi, hf_hub_url
from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError
from huggingface_hub.repocard import REGEX_YAML_BLOCK
from huggingface_hub.utils import build_hf_headers, get_session
from loraflow_worker.contract import SourceFields
from loraflow_worker.contract.dataset_formats import to_trl_row, trl_format
from prefect import task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel, Field

from tasks.settings import Settings
from tasks.storage.artifacts import check_rows

FIRST_ROWS = 20
"""Rows of a Hub dataset's JSONL file read before renting: enough to catch a wrong format or column name, a few KB."""
READ_TIMEOUT_S = 30.0

# What `datasets` (data_files.py) infers splits from when the README declares no `configs:`: a sharded file name
# (`data/train-00000-of-00001.parquet`), else a split's keyword as a folder or file name part, else all files → train.
SPLIT_KEYWORDS = {"train": ("train", "training"), "validation": ("validation", "valid", "dev", "val"),
                  "test": ("test", "testing", "eval", "evaluation")}
_SEP = r"[-._ 0-9]"
_SHARDED = re.compile(r"^data/(?P<split>[^/]+?)-\d{5}-of-\d{5}[^/]*$")
_NOT_DATA = {"README.md", "config.json", "dataset_info.json", "dataset_infos.json", "dummy_data.zip",
             "dataset_dict.json", ".gitattributes"}


class HubDataset(BaseModel):
    """A Hub source as the run will load it."""

    field: str = Field(description="The spec field that names it, e.g. `dataset.mix[1]`.")
    sha: str = Field(description="The commit its revision names now: the run trains on it.")
    config: str | None = Field(description="The config `load_dataset` will load (None: the dataset's only one).")
    rows_checked: int = Field(description="First rows converted and checked (0: none could be read before renting).")
    checked_file: str | None = Field(default=None, description="The file whose first rows were checked.")
    trl_format: str | None = Field(default=None, description="The TRL format its rows convert to (None: not read).")

    def describe(self, hub_id: str) -> str:
        rows = (f"its first {self.rows_checked} rows of {self.checked_file} convert and check" if self.rows_checked
                else "its rows are checked by the worker (the split's files are not JSON Lines)")
        config = f", config {self.config}" if self.config else ""
        return f"{self.field}: {hub_id} at commit {self.sha[:12]}{config}; {rows}"


def check_hub_dataset(source: SourceFields, field: str, algorithm: str, settings: Settings,
                      first_rows: int = FIRST_ROWS) -> HubDataset:
    """Check the Hub dataset of `source` (named by the spec's `field`) for `algorithm`; ValueError naming the field,
    the file, the row and the fix."""
    token = settings.hf_token.get_secret_value() if settings.hf_token else None
    api = HfApi(endpoint=settings.hf_endpoint, token=token)
    hub_id = source.hub_id
    try:
        info = api.dataset_info(hub_id, revision=source.revision)
        files = sorted(sibling.rfilename for sibling in info.siblings or [])
        if info.gated and files:
            # dataset_info answers for gated repos too: ask for a file the way the worker's download does.
            api.get_hf_file_metadata(url=hf_hub_url(hub_id, files[0], repo_type="dataset", revision=info.sha,
                                                    endpoint=api.endpoint))
    except GatedRepoError as e:
        raise ValueError(f"{field}.hub_id {hub_id!r} is gated and the token has not been granted access: accept its "
                         "terms on the Hub with the token's account") from e
    except RevisionNotFoundError as e:
        raise ValueError(f"{field}.revision {source.revision!r} is not a branch, tag or commit of {hub_id}") from e
    except RepositoryNotFoundError as e:
        reader = "the token cannot read it" if token else "there is no token to read it with"
        raise ValueError(f"{field}.hub_id {hub_id!r}: no such dataset on the Hub, or it is private and {reader}") from e
    if any("/" not in f and f.endswith(".py") for f in files):
        # A loading-script dataset: `datasets` takes its configs and splits from the Hub's Parquet export.
        return HubDataset(field=field, sha=info.sha, config=source.config, rows_checked=0)
    declared = _declared_configs(api, hub_id, info.sha, files)
    config, split_files = _config_and_split(declared, files, source, field)
    jsonl = [f for f in split_files if f.endswith(".jsonl")]
    if not jsonl:
        return HubDataset(field=field, sha=info.sha, config=config, rows_checked=0)
    lines = _first_lines(hf_hub_url(hub_id, jsonl[0], repo_type="dataset", revision=info.sha, endpoint=api.endpoint),
                         token, first_rows)
    where = f"{field} (hub {hub_id}, split {source.split}), file {jsonl[0]}"
    count = check_rows(lines, algorithm, where, source.format, source.columns)
    if count == 0:
        raise ValueError(f"{where} has no rows")
    return HubDataset(field=field, sha=info.sha, config=config, rows_checked=count, checked_file=jsonl[0],
                      trl_format=trl_format(to_trl_row(json.loads(lines[0]), source.format, source.columns)))


@task(name="check-hub-datasets", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=[5, 20],
      retry_condition_fn=lambda task, run, state: not isinstance(state.data, ValueError))
def check_hub_datasets_task(sources: list[tuple[str, SourceFields]], algorithm: str,
                            hub_token_secret: str | None = None) -> dict[str, HubDataset]:
    """`check_hub_dataset` of each (spec field, Hub source), with the run's Hub token; by field."""
    settings = Settings().with_hub_token(hub_token_secret)
    return {field: check_hub_dataset(source, field, algorithm, settings) for field, source in sources}


def _declared_configs(api: HfApi, hub_id: str, sha: str, files: list[str]) -> list[dict]:
    """The `configs:` of the dataset card's YAML (how `datasets` names configs and their data files); [] for none."""
    if "README.md" not in files:
        return []
    url = hf_hub_url(hub_id, "README.md", repo_type="dataset", revision=sha, endpoint=api.endpoint)
    response = get_session().get(url, headers=build_hf_headers(token=api.token), follow_redirects=True,
                                 timeout=READ_TIMEOUT_S)
    response.raise_for_status()
    front = REGEX_YAML_BLOCK.search(response.text)  # huggingface_hub's own reading of a card's YAML block
    metadata = yaml.safe_load(front.group(2)) if front else None
    configs = metadata.get("configs") if isinstance(metadata, dict) else None
    return [c for c in configs or [] if isinstance(c, dict) and isinstance(c.get("config_name"), str)]


def _config_and_split(declared: list[dict], files: list[str], source: SourceFields,
                      field: str) -> tuple[str | None, list[str]]:
    """(the config `load_dataset` will load, the files of the source's split); ValueError naming the field."""
    split = source.split.split("[", 1)[0]  # `train[:10%]` slices the split `train`
    if not declared:
        if source.config not in (None, "default"):
            raise ValueError(f"{field}.config {source.config!r}: {source.hub_id} declares no configs (its README has "
                             f"no `configs:`), so it has only its default one; remove {field}.config")
        splits = _inferred_splits([f for f in files if _is_data(f)])
        how = "by its file names, as `datasets` finds them"
    else:
        names = [c["config_name"] for c in declared]
        if source.config is None:
            defaults = [c for c in declared if c.get("default")]
            if len(declared) > 1 and not defaults:
                raise ValueError(f"{field}.config is empty, and {source.hub_id} has several configs and no default: "
                                 f"set {field}.config to one of {', '.join(names)}")
            chosen = (defaults or declared)[0]
        elif source.config in names:
            chosen = declared[names.index(source.config)]
        else:
            raise ValueError(f"{field}.config {source.config!r} is not a config of {source.hub_id}; its configs "
                             f"(the README's `configs:`): {', '.join(names)}")
        splits = _declared_splits(chosen.get("data_files"), files)
        how = f"as the README's config {chosen['config_name']} declares them"
        if source.config is None:
            return _split_files(splits, split, source, field, how, config=None)
    return _split_files(splits, split, source, field, how, config=source.config)


def _split_files(splits: dict[str, list[str]], split: str, source: SourceFields, field: str, how: str,
                 config: str | None) -> tuple[str | None, list[str]]:
    if split not in splits:
        raise ValueError(f"{field}.split {source.split!r}: {source.hub_id} has no split {split!r}; its splits "
                         f"({how}): {', '.join(sorted(splits)) or 'none'}")
    return config, splits[split]


def _declared_splits(data_files: object, files: list[str]) -> dict[str, list[str]]:
    """A declared config's `data_files` (a pattern or list of them: the `train` split; or `{split, path}` entries)
    as the repo's files of each split."""
    if data_files is None:
        return _inferred_splits([f for f in files if _is_data(f)])
    entries = data_files if isinstance(data_files, list) else [data_files]
    if all(isinstance(e, str) for e in entries):
        entries = [{"split": "train", "path": entries}]
    splits: dict[str, list[str]] = {}
    for entry in entries:
        if not isinstance(entry, dict) or "split" not in entry:
            continue
        patterns = entry.get("path") or []
        patterns = patterns if isinstance(patterns, list) else [patterns]
        splits[str(entry["split"])] = [f for f in files if any(_matches(f, p) for p in patterns)]
    return splits


def _inferred_splits(files: list[str]) -> dict[str, list[str]]:
    sharded: dict[str, list[str]] = {}
    for f in files:
        if match := _SHARDED.match(f):
            sharded.setdefault(match["split"], []).append(f)
    if sharded:
        return sharded
    for in_dirs in (True, False):
        found = {split: [f for f in files if any(_keyword_in(f, k, in_dirs) for k in keywords)]
                 for split, keywords in SPLIT_KEYWORDS.items()}
        found = {split: matched for split, matched in found.items() if matched}
        if found:
            return found
    return {"train": files} if files else {}


def _keyword_in(path: str, keyword: str, in_dirs: bool) -> bool:
    parts = PurePosixPath(path).parts
    if in_dirs:
        return any(re.fullmatch(rf"(.*{_SEP})?{keyword}({_SEP}.*)?", d) for d in parts[:-1])
    return re.fullmatch(rf"(.*{_SEP})?{keyword}{_SEP}.*", parts[-1]) is not None


def _matches(path: str, pattern: str) -> bool:
    """fsspec's glob as the Hub's data files use it: `*` within a folder, `**` across folders."""
    regex = re.escape(pattern).replace(r"\*\*/", "(.*/)?").replace(r"\*\*", ".*").replace(r"\*", "[^/]*")
    return re.fullmatch(regex.replace(r"\?", "[^/]"), path) is not None


def _is_data(path: str) -> bool:
    name = PurePosixPath(path).name
    return name not in _NOT_DATA and not name.startswith(".") and not any(p.startswith(".") for p in path.split("/"))


def _first_lines(url: str, token: str | None, count: int) -> list[str]:
    """The first `count` non-blank lines of the file at `url`, read as a stream: a dataset's file may be gigabytes."""
    lines: list[str] = []
    with get_session().stream("GET", url, headers=build_hf_headers(token=token), follow_redirects=True,
                              timeout=READ_TIMEOUT_S) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.strip():
                lines.append(line)
            if len(lines) >= count:
                break
    return lines
