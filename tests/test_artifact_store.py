"""The artifact store behaves the same on a local folder and on a Hub dataset repo (the local stand-in).

Behaviour tests run against both kinds (`store` is parametrized); Hub-only facts (one commit per write,
forced privacy, error mapping, retries, endpoint from the environment) follow. Retry tests arm the
stand-in's commit faults (`hub.arm_commit_faults`) and pass short retry budgets.
"""

from __future__ import annotations

import itertools
import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest
from huggingface_hub import HfApi
from loraflow_worker.artifacts import ArtifactNotFound, ArtifactStore, ArtifactStoreError, open_store
from loraflow_worker.artifacts.store import HUB_RETRY_BUDGET_S

from tests.hub_fixture import HubStandIn, running_hub

_names = itertools.count()


def _new_repo() -> str:
    return f"org/artifacts-{next(_names)}"


def _open_hub_store(hub: HubStandIn, repo_id: str, tmp_path: Path, *,
                    retry_budget_s: float = HUB_RETRY_BUDGET_S) -> ArtifactStore:
    return open_store(f"hf://datasets/{repo_id}", token=hub.token, endpoint=hub.url, cache_dir=tmp_path / "hf-cache",
                      retry_budget_s=retry_budget_s)


@pytest.fixture(params=["file", "hub"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ArtifactStore:
    if request.param == "file":
        return open_store((tmp_path / "store").as_uri())
    return _open_hub_store(request.getfixturevalue("hub"), _new_repo(), tmp_path)


def test_put_then_read_returns_the_bytes_and_the_json(store: ArtifactStore) -> None:
    store.put({"runs/r1/metrics.json": b'{"loss": 0.5}', "runs/r1/console.txt": b"ok"}, message="metrics")
    assert store.read_bytes("runs/r1/console.txt") == b"ok"
    assert store.read_json("runs/r1/metrics.json") == {"loss": 0.5}


def test_put_takes_local_files_as_paths(store: ArtifactStore, tmp_path: Path) -> None:
    local = tmp_path / "train.jsonl"
    local.write_bytes(b'{"text": "hi"}\n')
    store.put({"runs/r1/dataset/train.jsonl": local}, message="dataset")
    assert store.read_bytes("runs/r1/dataset/train.jsonl") == b'{"text": "hi"}\n'


def test_exists_is_true_only_for_stored_files(store: ArtifactStore) -> None:
    store.put({"runs/r1/DONE": b""}, message="done")
    assert store.exists("runs/r1/DONE") is True
    assert store.exists("runs/r1/result.json") is False
    assert store.exists("runs/r1") is False  # a folder is not a file


def test_list_files_is_recursive_sorted_and_scoped_to_the_folder(store: ArtifactStore) -> None:
    store.put({"runs/a/x": b"1", "runs/a/sub/y": b"2", "runs/ab/z": b"3", "top.txt": b"4"}, message="files")
    assert store.list_files("runs/a") == ["runs/a/sub/y", "runs/a/x"]
    assert store.list_files("runs/a/") == ["runs/a/sub/y", "runs/a/x"]
    assert store.list_files("") == ["runs/a/sub/y", "runs/a/x", "runs/ab/z", "top.txt"]
    assert store.list_files("runs/missing") == []


def test_download_copies_the_folder_relative_to_the_prefix(store: ArtifactStore, tmp_path: Path) -> None:
    store.put({"runs/r1/adapter/adapter_config.json": b"{}", "runs/r1/adapter/w/a.bin": b"\0\1",
               "runs/r1/metrics.json": b"{}"}, message="adapter")
    dest = store.download("runs/r1/adapter", tmp_path / "adapter")
    assert dest == tmp_path / "adapter"
    assert sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()) == [
        "adapter_config.json", "w/a.bin"]
    assert (dest / "w" / "a.bin").read_bytes() == b"\0\1"


def test_download_of_an_empty_prefix_raises_not_found_naming_it(store: ArtifactStore, tmp_path: Path) -> None:
    with pytest.raises(ArtifactNotFound, match="runs/nothing/"):
        store.download("runs/nothing", tmp_path / "dest")


def test_reading_a_missing_path_raises_not_found_naming_the_store_and_path(store: ArtifactStore) -> None:
    with pytest.raises(ArtifactNotFound) as excinfo:
        store.read_bytes("runs/r1/result.json")
    assert "runs/r1/result.json" in str(excinfo.value) and store.url in str(excinfo.value)


def test_delete_prefix_removes_only_that_folder_and_ignores_a_missing_one(store: ArtifactStore) -> None:
    store.put({"runs/r1/ckpt-1/a": b"1", "runs/r1/ckpt-10/a": b"2"}, message="ckpts")
    store.delete_prefix("runs/r1/ckpt-1", message="drop ckpt 1")
    store.delete_prefix("runs/r1/never-there", message="no-op")
    assert store.list_files("runs/r1") == ["runs/r1/ckpt-10/a"]


def test_put_with_delete_prefixes_replaces_a_folder_and_ignores_missing_ones(store: ArtifactStore) -> None:
    store.put({"runs/r1/ckpt/old": b"old", "runs/r1/keep": b"k"}, message="ckpt 1")
    store.put({"runs/r1/ckpt/new": b"new"}, message="ckpt 2", delete_prefixes=["runs/r1/ckpt", "runs/r1/absent"])
    assert store.list_files("runs/r1") == ["runs/r1/ckpt/new", "runs/r1/keep"]


def test_put_folder_replaces_what_was_under_the_prefix(store: ArtifactStore, tmp_path: Path) -> None:
    store.put({"runs/r1/adapter/stale.bin": b"s"}, message="old adapter")
    local = tmp_path / "adapter"
    (local / "sub").mkdir(parents=True)
    (local / "adapter_model.safetensors").write_bytes(b"w")
    (local / "sub" / "x.json").write_bytes(b"{}")
    store.put_folder(local, "runs/r1/adapter", message="adapter")
    assert store.list_files("runs/r1/adapter") == ["runs/r1/adapter/adapter_model.safetensors",
                                                   "runs/r1/adapter/sub/x.json"]


def test_put_folder_without_replace_keeps_what_was_there(store: ArtifactStore, tmp_path: Path) -> None:
    store.put({"runs/r1/adapter/kept.bin": b"k"}, message="old")
    local = tmp_path / "more"
    local.mkdir()
    (local / "new.bin").write_bytes(b"n")
    store.put_folder(local, "runs/r1/adapter", message="more", replace=False)
    assert store.list_files("runs/r1/adapter") == ["runs/r1/adapter/kept.bin", "runs/r1/adapter/new.bin"]


@pytest.mark.parametrize("path", ["../escape", "/abs", "runs//x", "runs/./x", "a\\b", ""])
def test_a_path_that_leaves_the_store_is_refused(store: ArtifactStore, path: str) -> None:
    with pytest.raises(ArtifactStoreError, match="bad artifact path"):
        store.put({path: b"x"}, message="bad")


def test_display_url_points_at_the_path(store: ArtifactStore) -> None:
    url = store.display_url("runs/r1")
    assert url.endswith("/runs/r1")
    assert url.startswith("file:///") if store.url.startswith("file:") else "/datasets/org/" in url


def test_a_folder_store_has_no_revisions_and_reads_the_latest_content_whatever_is_asked(tmp_path: Path) -> None:
    store = open_store((tmp_path / "store").as_uri())
    assert store.put({"runs/r1/rewards/r.py": b"v1"}, message="v1") is None
    store.put({"runs/r1/rewards/r.py": b"v2"}, message="v2")
    assert store.read_bytes("runs/r1/rewards/r.py", revision="a" * 40) == b"v2"
    assert store.exists("runs/r1/rewards/r.py", revision="a" * 40)


def test_a_failed_folder_put_leaves_what_was_there(tmp_path: Path) -> None:
    store = open_store((tmp_path / "store").as_uri())
    store.put({"runs/r1/adapter/adapter_config.json": b"old config", "runs/r1/adapter/w.bin": b"old"}, message="a1")
    with pytest.raises(FileNotFoundError):  # the second file's source is gone when it is copied
        store.put({"runs/r1/adapter/adapter_config.json": b"new config",
                   "runs/r1/adapter/w.bin": tmp_path / "missing.bin"},
                  message="a2", delete_prefixes=["runs/r1/adapter"])
    assert store.list_files("") == ["runs/r1/adapter/adapter_config.json", "runs/r1/adapter/w.bin"]
    assert store.read_bytes("runs/r1/adapter/adapter_config.json") == b"old config"
    assert [p.name for p in (tmp_path / "store").iterdir()] == ["runs"]  # no staging folder left behind


def test_a_folder_put_in_flight_is_never_listed(tmp_path: Path) -> None:
    store = open_store((tmp_path / "store").as_uri())
    staging = tmp_path / "store" / ".put-x.loraflow-partial"
    staging.mkdir()
    (staging / "0").write_bytes(b"half written")
    assert store.list_files("") == []


@pytest.mark.parametrize("url", ["s3://bucket/x", "hf://models/org/repo", "hf://datasets/org", "file://relative/x",
                                 "/plain/path", "hf://datasets/org/repo/extra"])
def test_an_unsupported_url_is_refused_naming_the_accepted_forms(url: str) -> None:
    with pytest.raises(ArtifactStoreError, match=r"file:///absolute/path.*hf://datasets/<org>/<repo>"):
        open_store(url)


# -- Hub only ------------------------------------------------------------------------------------


def test_each_write_is_exactly_one_commit_on_the_hub(hub: HubStandIn, tmp_path: Path) -> None:
    repo_id = _new_repo()
    store = _open_hub_store(hub, repo_id, tmp_path)
    local = tmp_path / "adapter"
    local.mkdir()
    for i in range(30):
        (local / f"shard-{i}.bin").write_bytes(bytes([i]) * 100)
    counts = [len(hub.commits("dataset", repo_id))]
    store.put({f"runs/r1/ckpt-1/f{i}": b"x" * i for i in range(40)}, message="ckpt 1")
    counts.append(len(hub.commits("dataset", repo_id)))
    store.put({"runs/r1/ckpt-2/f": b"y"}, message="ckpt 2", delete_prefixes=["runs/r1/ckpt-1"])
    counts.append(len(hub.commits("dataset", repo_id)))
    store.put_folder(local, "runs/r1/adapter", message="adapter")
    counts.append(len(hub.commits("dataset", repo_id)))
    store.delete_prefix("runs/r1/ckpt-2", message="drop")
    counts.append(len(hub.commits("dataset", repo_id)))
    assert [b - a for a, b in itertools.pairwise(counts)] == [1, 1, 1, 1]
    assert hub.commits("dataset", repo_id)[0]["title"] == "drop"


def test_a_hub_put_returns_the_commit_it_made(hub: HubStandIn, tmp_path: Path) -> None:
    repo_id = _new_repo()
    revision = _open_hub_store(hub, repo_id, tmp_path).put({"runs/r1/DONE": b""}, message="done")
    assert revision == hub.commits("dataset", repo_id)[0]["id"]


def test_a_hub_read_at_a_revision_sees_the_files_as_that_commit_stored_them(hub: HubStandIn, tmp_path: Path) -> None:
    store = _open_hub_store(hub, _new_repo(), tmp_path)
    first = store.put({"runs/r1/rewards/r.py": b"v1", "runs/r1/adapter/w.bin": b"w1"}, message="v1")
    store.put({"runs/r1/rewards/r.py": b"v2", "runs/r1/adapter/w.bin": b"w2", "runs/r1/adapter/extra.bin": b"x"},
              message="v2 by someone else")
    assert store.read_bytes("runs/r1/rewards/r.py", revision=first) == b"v1"
    assert store.read_bytes("runs/r1/rewards/r.py") == b"v2"
    assert store.exists("runs/r1/adapter/extra.bin") and not store.exists("runs/r1/adapter/extra.bin", revision=first)
    dest = store.download("runs/r1/adapter", tmp_path / "at-first", revision=first)
    assert [p.name for p in dest.iterdir()] == ["w.bin"] and (dest / "w.bin").read_bytes() == b"w1"


def test_a_hub_read_at_an_unknown_revision_is_a_store_error_naming_it(hub: HubStandIn, tmp_path: Path) -> None:
    store = _open_hub_store(hub, _new_repo(), tmp_path)
    store.put({"runs/r1/DONE": b""}, message="done")
    with pytest.raises(ArtifactStoreError, match=f"revision '{'f' * 40}' not found"):
        store.read_bytes("runs/r1/DONE", revision="f" * 40)


def test_opening_an_existing_public_repo_makes_it_private(hub: HubStandIn, tmp_path: Path) -> None:
    repo_id = _new_repo()
    api = HfApi(endpoint=hub.url, token=hub.token)
    api.create_repo(repo_id, repo_type="dataset", private=False)
    _open_hub_store(hub, repo_id, tmp_path)
    assert api.repo_info(repo_id, repo_type="dataset").private is True


def test_the_hub_store_hides_the_hubs_own_gitattributes(hub: HubStandIn, tmp_path: Path) -> None:
    store = _open_hub_store(hub, _new_repo(), tmp_path)
    store.put({"a.txt": b"a"}, message="a")
    assert store.list_files("") == ["a.txt"]
    assert [p.name for p in store.download("", tmp_path / "all").iterdir()] == ["a.txt"]


def test_a_refused_token_is_a_store_error_that_does_not_show_the_token(tmp_path: Path) -> None:
    with running_hub(tmp_path / "hub", require_token="the-right-token") as strict:
        with pytest.raises(ArtifactStoreError, match="HF_TOKEN") as excinfo:
            open_store("hf://datasets/org/guarded", token="hf_wrong_secret", endpoint=strict.url)
    assert "hf_wrong_secret" not in str(excinfo.value)


def test_an_unreachable_hub_is_a_transient_store_error_once_the_budget_is_spent(tmp_path: Path) -> None:
    with running_hub(tmp_path / "hub") as gone:
        endpoint = gone.url
    with pytest.raises(ArtifactStoreError, match="could not be reached.*Gave up after") as excinfo:
        open_store("hf://datasets/org/anything", token="t", endpoint=endpoint, retry_budget_s=1)
    assert excinfo.value.transient is True


def test_put_gives_up_after_its_retry_budget_with_a_transient_error_naming_the_429_and_the_repo(
        tmp_path: Path) -> None:
    with running_hub(tmp_path / "hub", commits_per_hour=2) as limited:
        store = _open_hub_store(limited, "org/busy", tmp_path, retry_budget_s=2)
        store.put({"a": b"1"}, message="1")
        store.put({"a": b"2"}, message="2")
        started = time.monotonic()
        with pytest.raises(ArtifactStoreError) as excinfo:
            store.put({"a": b"3"}, message="3")
        elapsed = time.monotonic() - started
    message = str(excinfo.value)
    assert excinfo.value.transient is True
    assert "429" in message and "rate limit" in message and "hf://datasets/org/busy" in message
    assert "retry budget 2 s" in message
    assert 2 <= elapsed < 10  # the Hub asked for about an hour; the budget decides


def test_put_survives_429s_and_503s_and_the_files_land_in_one_commit(hub: HubStandIn, tmp_path: Path) -> None:
    repo_id = _new_repo()
    store = _open_hub_store(hub, repo_id, tmp_path, retry_budget_s=30)
    hub.arm_commit_faults("dataset", repo_id, status=429, count=2, retry_after_s=0)
    hub.arm_commit_faults("dataset", repo_id, status=503, count=2)
    before = len(hub.commits("dataset", repo_id))
    store.put({"runs/r1/adapter/w.bin": b"w", "runs/r1/DONE": b""}, message="final save")
    commits = hub.commits("dataset", repo_id)
    assert len(commits) == before + 1 and commits[0]["title"] == "final save"
    assert store.list_files("runs/r1") == ["runs/r1/DONE", "runs/r1/adapter/w.bin"]
    assert hub.armed_commit_faults("dataset", repo_id) == 0


def test_put_waits_as_long_as_retry_after_asks(hub: HubStandIn, tmp_path: Path) -> None:
    repo_id = _new_repo()
    store = _open_hub_store(hub, repo_id, tmp_path, retry_budget_s=30)
    hub.arm_commit_faults("dataset", repo_id, status=429, retry_after_s=1)
    started = time.monotonic()
    store.put({"a": b"1"}, message="after a wait")
    assert time.monotonic() - started >= 1.0
    assert hub.commits("dataset", repo_id)[0]["title"] == "after a wait"


def test_each_retry_is_a_warning_naming_the_status_and_the_wait(hub: HubStandIn, tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    repo_id = _new_repo()
    store = _open_hub_store(hub, repo_id, tmp_path, retry_budget_s=30)
    hub.arm_commit_faults("dataset", repo_id, status=429, retry_after_s=0)
    hub.arm_commit_faults("dataset", repo_id, status=500)
    with caplog.at_level(logging.WARNING, logger="loraflow_worker"):
        store.put({"a": b"1"}, message="1")
    retries = [r.getMessage() for r in caplog.records if r.name == "loraflow_worker" and "trying again" in r.message]
    assert len(retries) == 2
    assert "(HTTP 429): trying again in 0.0 s" in retries[0] and f"hf://datasets/{repo_id}" in retries[0]
    assert "(HTTP 500): trying again in" in retries[1]


def test_a_403_is_not_retried(hub: HubStandIn, tmp_path: Path) -> None:
    repo_id = _new_repo()
    store = _open_hub_store(hub, repo_id, tmp_path, retry_budget_s=30)
    hub.arm_commit_faults("dataset", repo_id, status=403, count=2)
    with pytest.raises(ArtifactStoreError, match="token was refused") as excinfo:
        store.put({"a": b"1"}, message="1")
    assert excinfo.value.transient is False
    assert hub.armed_commit_faults("dataset", repo_id) == 1  # one commit request was made, not two


def test_a_put_with_no_retry_budget_fails_at_the_first_429(hub: HubStandIn, tmp_path: Path) -> None:
    repo_id = _new_repo()
    store = _open_hub_store(hub, repo_id, tmp_path, retry_budget_s=30)
    hub.arm_commit_faults("dataset", repo_id, status=429, count=2)
    with pytest.raises(ArtifactStoreError, match="rate limit") as excinfo:
        store.put({"heartbeat.json": b"{}"}, message="heartbeat", retry_budget_s=0)
    assert excinfo.value.transient is True
    assert hub.armed_commit_faults("dataset", repo_id) == 1


def test_the_hub_store_takes_endpoint_and_token_from_the_environment(hub: HubStandIn) -> None:
    # huggingface_hub reads HF_ENDPOINT at import, so the default path needs a fresh process.
    script = (
        "import json, sys\n"
        "from loraflow_worker.artifacts import open_store\n"
        "store = open_store(sys.argv[1])\n"
        "store.put({'runs/r1/DONE': b'done'}, message='done')\n"
        "print(json.dumps({'done': store.read_bytes('runs/r1/DONE').decode(), 'url': store.display_url('runs/r1')}))\n"
    )
    repo_id = _new_repo()
    out = subprocess.run([sys.executable, "-c", script, f"hf://datasets/{repo_id}"], env=hub.client_env(),
                         capture_output=True, text=True, timeout=60, check=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert result == {"done": "done", "url": f"{hub.url}/datasets/{repo_id}/tree/main/runs/r1"}
    assert hub.commits("dataset", repo_id)[0]["title"] == "done"
