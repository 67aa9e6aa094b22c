"""A Hub model that the worker could not download onto its disk is refused before anything is rented.

The model is served by the local Hub stand-in (tests/hub_fixture.py) and read by the real client."""

from __future__ import annotations

import itertools

import httpx2  # the HTTP library huggingface_hub 2.4 builds its errors from
import pytest
from huggingface_hub import CommitOperationAdd, HfApi
from huggingface_hub.errors import HfHubHTTPError
from huggingface_hub.utils import hf_raise_for_status
from loraflow_worker.contract import ModelSource
from pydantic import SecretStr

from tasks.placement.plan import DISK_MARGIN_GB, resolve_model
from tasks.settings import Settings
from tests.hub_fixture import HubStandIn, hub  # noqa: F401

_names = itertools.count()
WEIGHTS = b"\0" * 300_000


@pytest.fixture
def settings(hub: HubStandIn) -> Settings:  # noqa: F811
    return Settings(hf_endpoint=hub.url, hf_token=SecretStr(hub.token))


@pytest.fixture
def model_id(hub: HubStandIn) -> str:  # noqa: F811
    repo_id = f"org/tiny-{next(_names)}"
    api = HfApi(endpoint=hub.url, token=hub.token)
    api.create_repo(repo_id)
    api.create_commit(repo_id, [CommitOperationAdd("config.json", b'{"model_type": "qwen3"}'),
                                CommitOperationAdd("model.safetensors", WEIGHTS)], commit_message="weights")
    return repo_id


def test_a_model_that_fits_is_pinned_and_its_files_probed(monkeypatch, settings, model_id):
    probed = []
    real_probe = HfApi.get_hf_file_metadata

    def recording_probe(self, *, url, **kwargs):
        probed.append(url)
        return real_probe(self, url=url, **kwargs)

    monkeypatch.setattr(HfApi, "get_hf_file_metadata", recording_probe)
    resolved = resolve_model(ModelSource(id=model_id), settings, disk_gb=DISK_MARGIN_GB + 1)
    sha = HfApi(endpoint=settings.hf_endpoint, token=settings.hf_token.get_secret_value()).model_info(model_id).sha
    assert resolved == ModelSource(id=model_id, revision=sha)
    assert probed == [f"{settings.hf_endpoint}/{model_id}/resolve/{sha}/config.json"]


def test_a_model_bigger_than_the_disk_leaves_is_refused_naming_both_sizes_and_the_field(settings, model_id):
    with pytest.raises(ValueError) as e:
        resolve_model(ModelSource(id=model_id), settings, disk_gb=DISK_MARGIN_GB)
    message = str(e.value)
    assert "compute.disk_gb" in message and f"{DISK_MARGIN_GB} GB" in message
    assert "0.3 MB" in message  # config.json and the 300 kB of weights
    assert f"at least {DISK_MARGIN_GB + 1}" in message


def test_without_disk_gb_only_access_is_checked(settings, model_id):
    assert resolve_model(ModelSource(id=model_id), settings).id == model_id


def _hub_answer(status: int, error_code: str, url: str) -> HfHubHTTPError:
    response = httpx2.Response(status, headers={"X-Error-Code": error_code, "X-Error-Message": "Access restricted"},
                              request=httpx2.Request("HEAD", url))
    try:
        hf_raise_for_status(response)
    except HfHubHTTPError as e:  # the client's own mapping of the Hub's answer
        return e
    raise AssertionError("hf_raise_for_status accepted an error answer")


@pytest.mark.parametrize(
    ("status", "error_code", "expected"),
    [(403, "GatedRepo", "is gated and HF_TOKEN has not been granted access"),
     (401, "RepoNotFound", "HF_TOKEN cannot download its files")],
    ids=["gated", "unauthorised"],
)
def test_a_model_whose_files_the_token_cannot_download_is_refused(monkeypatch, settings, model_id, status, error_code,
                                                                  expected):
    # The stand-in serves no gated repos (its model_info always says gated: false and its files answer the
    # same as its model_info), so the file request answers as the Hub does for a gated repo.
    def refused(self, *, url, **kwargs):
        raise _hub_answer(status, error_code, url)

    monkeypatch.setattr(HfApi, "get_hf_file_metadata", refused)
    with pytest.raises(ValueError) as e:
        resolve_model(ModelSource(id=model_id), settings, disk_gb=100)
    assert expected in str(e.value) and model_id in str(e.value)


def test_a_private_model_without_a_token_is_refused(hub, model_id):  # noqa: F811
    HfApi(endpoint=hub.url, token=hub.token).update_repo_settings(model_id, private=True)
    with pytest.raises(ValueError) as e:
        resolve_model(ModelSource(id=model_id), Settings(hf_endpoint=hub.url, hf_token=None), disk_gb=100)
    assert "HF_TOKEN" in str(e.value)
