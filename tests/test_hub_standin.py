"""The local Hub stand-in speaks enough of the Hub API for the real huggingface_hub 2.4.0 client.

Every test drives a real server process (tests/hub_fixture.py) with the real client. The client reads
HF_ENDPOINT at import, so each call here passes the endpoint explicitly (through `HfApi(endpoint=...)`).
"""

from __future__ import annotations

import hashlib
import itertools
import time
from pathlib import Path

import httpx
import pytest
from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi
from huggingface_hub.errors import (
    HfHubHTTPError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from tests.hub_fixture import HubStandIn, running_hub

_names = itertools.count()


def _repo_name(stem: str) -> str:
    return f"org/{stem}-{next(_names)}"


@pytest.fixture
def api(hub: HubStandIn) -> HfApi:
    return HfApi(endpoint=hub.url, token=hub.token)


@pytest.fixture
def dataset(api: HfApi) -> str:
    repo_id = _repo_name("ckpts")
    api.create_repo(repo_id, repo_type="dataset", private=True)
    return repo_id


def test_create_repo_with_exist_ok_twice_returns_the_same_private_repo(api: HfApi, hub: HubStandIn) -> None:
    repo_id = _repo_name("twice")
    first = api.create_repo(repo_id, repo_type="dataset", private=True, exist_ok=True)
    second = api.create_repo(repo_id, repo_type="dataset", private=True, exist_ok=True)
    assert first == second == f"{hub.url}/datasets/{repo_id}"
    assert api.repo_info(repo_id, repo_type="dataset").private is True


def test_create_repo_without_exist_ok_refuses_an_existing_repo(api: HfApi, dataset: str) -> None:
    with pytest.raises(HfHubHTTPError) as excinfo:
        api.create_repo(dataset, repo_type="dataset")
    assert excinfo.value.response.status_code == 409


def test_update_repo_settings_changes_the_visibility_shown_in_repo_info(api: HfApi, dataset: str) -> None:
    api.update_repo_settings(dataset, repo_type="dataset", private=False)
    assert api.repo_info(dataset, repo_type="dataset").private is False
    api.update_repo_settings(dataset, repo_type="dataset", private=True)
    assert api.repo_info(dataset, repo_type="dataset").private is True


def test_upload_file_is_one_commit_and_reads_back(api: HfApi, hub: HubStandIn, dataset: str, tmp_path: Path) -> None:
    before = len(hub.commits("dataset", dataset))
    info = api.upload_file(path_or_fileobj=b"hello", path_in_repo="ckpt-1/a.txt", repo_id=dataset,
                           repo_type="dataset", commit_message="ckpt 1")
    commits = hub.commits("dataset", dataset)
    assert len(commits) == before + 1
    assert commits[0]["id"] == info.oid and commits[0]["title"] == "ckpt 1"
    local = api.hf_hub_download(dataset, "ckpt-1/a.txt", repo_type="dataset", cache_dir=tmp_path)
    assert Path(local).read_bytes() == b"hello"


def test_create_commit_with_several_operations_is_one_commit(api: HfApi, hub: HubStandIn, dataset: str) -> None:
    api.create_commit(dataset, [CommitOperationAdd("ckpt-1/a.txt", b"a"), CommitOperationAdd("ckpt-1/b.txt", b"b"),
                                CommitOperationAdd("keep.txt", b"k")], commit_message="ckpt 1", repo_type="dataset")
    before = len(hub.commits("dataset", dataset))
    api.create_commit(
        dataset,
        [CommitOperationDelete("ckpt-1/", is_folder=True), CommitOperationDelete("keep.txt"),
         CommitOperationAdd("ckpt-2/a.txt", b"a2"), CommitOperationAdd("ckpt-2/sub/c.bin", bytes(range(256)) * 4000)],
        commit_message="ckpt 2", repo_type="dataset",
    )
    assert len(hub.commits("dataset", dataset)) == before + 1
    assert api.list_repo_files(dataset, repo_type="dataset") == [".gitattributes", "ckpt-2/a.txt", "ckpt-2/sub/c.bin"]


def test_re_uploading_unchanged_content_makes_no_commit(api: HfApi, hub: HubStandIn, dataset: str) -> None:
    first = api.upload_file(path_or_fileobj=b"same", path_in_repo="a.txt", repo_id=dataset, repo_type="dataset")
    again = api.upload_file(path_or_fileobj=b"same", path_in_repo="a.txt", repo_id=dataset, repo_type="dataset")
    assert again.oid == first.oid
    assert hub.commits("dataset", dataset)[0]["id"] == first.oid


def test_deleting_a_missing_file_fails_the_commit_with_entry_not_found(api: HfApi, dataset: str) -> None:
    with pytest.raises(RemoteEntryNotFoundError, match="A file with this name doesn't exist"):
        api.create_commit(dataset, [CommitOperationDelete("nope.txt")], commit_message="rm", repo_type="dataset")


def test_list_repo_tree_lists_one_level_or_recursively(api: HfApi, dataset: str) -> None:
    api.create_commit(dataset, [CommitOperationAdd("runs/a/x.txt", b"x"), CommitOperationAdd("runs/a/deep/y.txt", b"y"),
                                CommitOperationAdd("runs/b.txt", b"b")], commit_message="files", repo_type="dataset")
    flat = {e.path: type(e).__name__ for e in api.list_repo_tree(dataset, "runs", repo_type="dataset")}
    assert flat == {"runs/a": "RepoFolder", "runs/b.txt": "RepoFile"}
    deep = [e.path for e in api.list_repo_tree(dataset, "runs/a", recursive=True, repo_type="dataset")]
    assert deep == ["runs/a/deep", "runs/a/deep/y.txt", "runs/a/x.txt"]


def test_a_long_tree_listing_is_paged_and_the_client_follows_the_pages(api: HfApi, dataset: str) -> None:
    paths = [f"many/{i:04d}.txt" for i in range(1005)]
    api.create_commit(dataset, [CommitOperationAdd(p, b"") for p in paths], commit_message="many", repo_type="dataset")
    assert api.list_repo_files(dataset, repo_type="dataset") == [".gitattributes", *paths]


def test_get_paths_info_leaves_missing_paths_out(api: HfApi, dataset: str) -> None:
    api.upload_file(path_or_fileobj=b"a", path_in_repo="d/a.txt", repo_id=dataset, repo_type="dataset")
    infos = api.get_paths_info(dataset, ["d", "d/a.txt", "nope"], repo_type="dataset")
    assert [(type(i).__name__, i.path) for i in infos] == [("RepoFolder", "d"), ("RepoFile", "d/a.txt")]


def test_resolve_sends_commit_sha_and_git_blob_etag_and_no_xet_headers(api: HfApi, hub: HubStandIn,
                                                                        dataset: str) -> None:
    info = api.upload_file(path_or_fileobj=b"hello", path_in_repo="a.txt", repo_id=dataset, repo_type="dataset")
    auth = {"authorization": f"Bearer {hub.token}"}
    head = httpx.head(f"{hub.url}/datasets/{dataset}/resolve/main/a.txt", headers=auth)
    assert head.status_code == 200
    assert head.headers["x-repo-commit"] == info.oid == api.repo_info(dataset, repo_type="dataset").sha
    assert head.headers["etag"] == '"%s"' % hashlib.sha1(b"blob 5\0hello").hexdigest()
    assert head.headers["content-length"] == "5"
    assert not [h for h in head.headers if h.lower().startswith("x-xet")]
    pinned = httpx.get(f"{hub.url}/datasets/{dataset}/resolve/{info.oid}/a.txt", headers=auth)
    assert pinned.headers["x-repo-commit"] == info.oid and pinned.content == b"hello"


def test_snapshot_download_of_a_model_is_served_from_cache_the_second_time(hub: HubStandIn, tmp_path: Path) -> None:
    api = HfApi(endpoint=hub.url, token=hub.token)
    repo_id = _repo_name("tiny-model")
    api.create_repo(repo_id)  # a public model repo, as the worker downloads them
    api.create_commit(repo_id, [CommitOperationAdd("config.json", b'{"a": 1}'),
                                CommitOperationAdd("model.safetensors", b"\0" * 5000)], commit_message="weights")
    first = Path(api.snapshot_download(repo_id, cache_dir=tmp_path))
    served = hub.downloads("model", repo_id)
    second = Path(api.snapshot_download(repo_id, cache_dir=tmp_path))
    assert first == second
    assert sorted(p.name for p in first.iterdir()) == [".gitattributes", "config.json", "model.safetensors"]
    assert (first / "model.safetensors").read_bytes() == b"\0" * 5000
    assert served == 3 and hub.downloads("model", repo_id) == served


def test_file_exists_is_false_for_a_missing_file_and_true_for_a_stored_one(api: HfApi, dataset: str) -> None:
    api.upload_file(path_or_fileobj=b"x", path_in_repo="DONE", repo_id=dataset, repo_type="dataset")
    assert api.file_exists(dataset, "DONE", repo_type="dataset") is True
    assert api.file_exists(dataset, "missing.txt", repo_type="dataset") is False


def test_a_missing_repo_raises_repository_not_found(api: HfApi) -> None:
    with pytest.raises(RepositoryNotFoundError):
        api.repo_info("org/does-not-exist", repo_type="dataset")


def test_a_missing_file_raises_entry_not_found(api: HfApi, dataset: str, tmp_path: Path) -> None:
    with pytest.raises(RemoteEntryNotFoundError):
        api.hf_hub_download(dataset, "missing.txt", repo_type="dataset", cache_dir=tmp_path)


def test_a_missing_revision_raises_revision_not_found(api: HfApi, dataset: str, tmp_path: Path) -> None:
    with pytest.raises(RevisionNotFoundError):
        api.hf_hub_download(dataset, ".gitattributes", repo_type="dataset", revision="no-such-branch",
                            cache_dir=tmp_path)


def test_a_private_repo_is_hidden_from_anonymous_callers(hub: HubStandIn, dataset: str) -> None:
    with pytest.raises(RepositoryNotFoundError):
        HfApi(endpoint=hub.url, token=False).repo_info(dataset, repo_type="dataset")


def test_a_commit_past_the_hourly_limit_is_rejected_with_429_and_retry_after(tmp_path: Path) -> None:
    with running_hub(tmp_path / "hub", commits_per_hour=3) as limited:
        api = HfApi(endpoint=limited.url, token=limited.token)
        api.create_repo("org/busy", repo_type="dataset")
        for i in range(3):
            api.upload_file(path_or_fileobj=f"{i}".encode(), path_in_repo=f"c{i}.txt", repo_id="org/busy",
                            repo_type="dataset")
        with pytest.raises(HfHubHTTPError, match=r"rate limit for repository commits \(3 per hour\)") as excinfo:
            api.upload_file(path_or_fileobj=b"4", path_in_repo="c4.txt", repo_id="org/busy", repo_type="dataset")
        assert excinfo.value.response.status_code == 429
        assert 3590 <= int(excinfo.value.response.headers["Retry-After"]) <= 3600  # when the oldest commit ages out
        assert len(limited.commits("dataset", "org/busy")) == 1 + 3  # the rejected commit left no trace


def test_a_commit_passes_again_once_retry_after_has_passed(tmp_path: Path) -> None:
    with running_hub(tmp_path / "hub", commits_per_hour=1, commit_window_s=1) as limited:
        api = HfApi(endpoint=limited.url, token=limited.token)
        api.create_repo("org/window", repo_type="dataset")
        api.upload_file(path_or_fileobj=b"1", path_in_repo="a.txt", repo_id="org/window", repo_type="dataset")
        with pytest.raises(HfHubHTTPError) as excinfo:
            api.upload_file(path_or_fileobj=b"2", path_in_repo="a.txt", repo_id="org/window", repo_type="dataset")
        retry_after = int(excinfo.value.response.headers["Retry-After"])
        assert retry_after == 1
        time.sleep(retry_after)
        api.upload_file(path_or_fileobj=b"2", path_in_repo="a.txt", repo_id="org/window", repo_type="dataset")
        assert len(limited.commits("dataset", "org/window")) == 1 + 2


def test_armed_commit_faults_refuse_the_next_commits_in_order_then_commits_pass(api: HfApi, hub: HubStandIn,
                                                                                 dataset: str) -> None:
    hub.arm_commit_faults("dataset", dataset, status=429, count=2, retry_after_s=1)
    hub.arm_commit_faults("dataset", dataset, status=503)
    before = len(hub.commits("dataset", dataset))
    answers = []
    for _ in range(3):
        with pytest.raises(HfHubHTTPError) as excinfo:
            api.upload_file(path_or_fileobj=b"x", path_in_repo="x.txt", repo_id=dataset, repo_type="dataset")
        answers.append((excinfo.value.response.status_code, excinfo.value.response.headers.get("Retry-After")))
    assert answers == [(429, "1"), (429, "1"), (503, None)]
    assert len(hub.commits("dataset", dataset)) == before  # refused commits left no trace
    api.upload_file(path_or_fileobj=b"x", path_in_repo="x.txt", repo_id=dataset, repo_type="dataset")
    assert len(hub.commits("dataset", dataset)) == before + 1
    assert hub.armed_commit_faults("dataset", dataset) == 0


def test_an_armed_429_carries_the_hubs_rate_limit_text(api: HfApi, hub: HubStandIn, dataset: str) -> None:
    hub.arm_commit_faults("dataset", dataset, status=429)
    with pytest.raises(HfHubHTTPError, match=r"rate limit for repository commits \(128 per hour\)"):
        api.upload_file(path_or_fileobj=b"x", path_in_repo="x.txt", repo_id=dataset, repo_type="dataset")


def test_disarming_commit_faults_lets_the_next_commit_pass(api: HfApi, hub: HubStandIn, dataset: str) -> None:
    hub.arm_commit_faults("dataset", dataset, status=500, count=5)
    assert httpx.delete(f"{hub.url}/_hub/commit-faults/dataset/{dataset}").status_code == 204
    api.upload_file(path_or_fileobj=b"x", path_in_repo="x.txt", repo_id=dataset, repo_type="dataset")
    assert hub.armed_commit_faults("dataset", dataset) == 0


def test_arming_commit_faults_for_a_missing_repo_is_refused(hub: HubStandIn) -> None:
    response = httpx.post(f"{hub.url}/_hub/commit-faults/dataset/org/no-such-repo", json={"status": 429})
    assert response.status_code == 404


def test_with_require_token_other_tokens_get_repository_not_found(tmp_path: Path) -> None:
    with running_hub(tmp_path / "hub", require_token="the-right-one") as strict:
        HfApi(endpoint=strict.url, token="the-right-one").create_repo("org/guarded", repo_type="dataset")
        for token in ("a-wrong-one", False):
            with pytest.raises(RepositoryNotFoundError):
                HfApi(endpoint=strict.url, token=token).repo_info("org/guarded", repo_type="dataset")


def test_repos_and_files_survive_a_restart_on_the_same_data_dir(tmp_path: Path) -> None:
    with running_hub(tmp_path / "hub") as first:
        api = HfApi(endpoint=first.url, token=first.token)
        api.create_repo("org/durable", repo_type="dataset", private=True)
        sha = api.upload_file(path_or_fileobj=b"kept", path_in_repo="k.txt", repo_id="org/durable",
                              repo_type="dataset").oid
    with running_hub(tmp_path / "hub") as second:
        api = HfApi(endpoint=second.url, token=second.token)
        info = api.repo_info("org/durable", repo_type="dataset")
        assert (info.sha, info.private) == (sha, True)
        local = api.hf_hub_download("org/durable", "k.txt", repo_type="dataset", cache_dir=tmp_path / "cache")
        assert Path(local).read_bytes() == b"kept"


def test_a_read_only_token_reads_a_private_repo_but_its_commit_is_refused_with_403(api: HfApi, hub: HubStandIn,
                                                                                    dataset: str) -> None:
    api.upload_file(path_or_fileobj=b"x", path_in_repo="x.txt", repo_id=dataset, repo_type="dataset")
    reader = HfApi(endpoint=hub.url, token=hub.read_only_token)
    assert reader.repo_info(dataset, repo_type="dataset").private is True
    before = len(hub.commits("dataset", dataset))
    with pytest.raises(HfHubHTTPError, match="you must use a write token") as excinfo:
        reader.upload_file(path_or_fileobj=b"y", path_in_repo="y.txt", repo_id=dataset, repo_type="dataset")
    assert excinfo.value.response.status_code == 403
    assert len(hub.commits("dataset", dataset)) == before


def test_a_read_only_token_cannot_create_a_repo(hub: HubStandIn) -> None:
    reader = HfApi(endpoint=hub.url, token=hub.read_only_token)
    with pytest.raises(HfHubHTTPError, match="rights to create a model under the namespace") as excinfo:
        reader.create_repo(_repo_name("not-mine"), exist_ok=True)
    assert excinfo.value.response.status_code == 403


def test_list_repo_commits_lists_a_model_repos_commits_newest_first(api: HfApi) -> None:
    repo_id = _repo_name("adapter")
    api.create_repo(repo_id, private=True)
    api.upload_file(path_or_fileobj=b"1", path_in_repo="a.txt", repo_id=repo_id, commit_message="first",
                    commit_description="run 1")
    api.upload_file(path_or_fileobj=b"2", path_in_repo="a.txt", repo_id=repo_id, commit_message="second")
    commits = api.list_repo_commits(repo_id)
    assert [(c.title, c.message) for c in commits] == [("second", ""), ("first", "run 1"), ("initial commit", "")]


def test_a_commit_adding_a_readme_is_refused_when_its_card_metadata_is_invalid(api: HfApi, hub: HubStandIn) -> None:
    repo_id = _repo_name("carded")
    api.create_repo(repo_id)
    good = "---\nbase_model: org/base\nlibrary_name: peft\ntags:\n- lora\n---\n# card\n"
    api.upload_file(path_or_fileobj=good.encode(), path_in_repo="README.md", repo_id=repo_id)
    bad = "---\nbase_model: /a/local/path\n---\n# card\n"
    with pytest.raises(ValueError, match='Invalid metadata in README.md.\n- "base_model" must be a Hub repo id'):
        api.upload_file(path_or_fileobj=bad.encode(), path_in_repo="README.md", repo_id=repo_id)
    assert len(hub.commits("model", repo_id)) == 2
