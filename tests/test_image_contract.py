"""The worker image's job contract is read from its tag and checked before anything is rented."""

import pytest
from loraflow_worker.contract import CONTRACT_VERSION

from tasks.placement.image_contract import ImageContractError, check_image_contract, image_contract_version, image_tag


@pytest.mark.parametrize(
    ("image", "tag"),
    [
        ("registry.example:5000/team/loraflow-worker:0.1.0-contract2-cu130-sm90", "0.1.0-contract2-cu130-sm90"),
        ("loraflow-worker:local-contract2", "local-contract2"),
        ("registry.example:5000/loraflow-worker", None),  # a port is not a tag
        ("loraflow-worker@sha256:" + "a" * 64, None),
        ("loraflow-worker:0.1.0-contract2-cu130@sha256:" + "a" * 64, "0.1.0-contract2-cu130"),
    ],
)
def test_the_tag_is_read_from_any_image_reference(image, tag):
    assert image_tag(image) == tag


def test_make_images_tag_names_the_contract_version():
    assert image_contract_version("ghcr.io/acme/loraflow-worker:0.1.0-contract7-cu130-sm80-90") == 7
    assert image_contract_version("acme/worker:v1-nocontract2") is None  # a word that merely ends in it


def test_an_image_of_this_contract_passes():
    assert check_image_contract(f"r.example/loraflow-worker:0.1.0-contract{CONTRACT_VERSION}-cu130-sm90") == CONTRACT_VERSION


def test_an_image_of_another_contract_is_refused_naming_both_versions_and_make_image():
    old = CONTRACT_VERSION - 1
    with pytest.raises(ImageContractError) as refused:
        check_image_contract(f"r.example/loraflow-worker:0.0.9-contract{old}-cu130-sm90")
    message = str(refused.value)
    assert f"version {old}" in message and f"version {CONTRACT_VERSION}" in message
    assert "make image" in message and "LORAFLOW_WORKER_IMAGE" in message


def test_an_image_whose_tag_names_no_contract_is_refused_with_the_fix():
    with pytest.raises(ImageContractError, match="names no job contract version.*make image"):
        check_image_contract("r.example/loraflow-worker:latest")
