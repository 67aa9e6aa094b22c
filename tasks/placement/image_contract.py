"""Which job contract a worker image speaks, read from its tag before anything is rented.

A worker refuses a job of another contract version (`loraflow_worker.handler`), but only once a GPU is
rented and the image pulled: a stale image found out then costs a cold start. `make image` tags every
image with the contract it speaks (`loraflow-worker:<version>-contract<N>-cu130-sm<archs>`, also its
`ai.loraflow.contract-version` label), so the control plane can compare before renting. The tag is what
is read: RunPod pulls from registries this process may not reach, with credentials it may not hold.
"""

from __future__ import annotations

import re

from loraflow_worker.contract import CONTRACT_VERSION

_CONTRACT_IN_TAG = re.compile(r"(?:^|[-_.])contract(\d+)(?=$|[-_.])")


class ImageContractError(ValueError):
    """The worker image speaks another job contract than this control plane, or its tag does not say which."""


def image_tag(image: str) -> str | None:
    """The tag of `registry/repository:tag[@digest]`; None when the reference has none (a bare digest, or
    no tag: Docker's `latest`)."""
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    return last.split(":", 1)[1] if ":" in last else None


def image_contract_version(image: str) -> int | None:
    """The contract version the image's tag names (`...-contract<N>-...`); None when it names none."""
    tag = image_tag(image)
    match = _CONTRACT_IN_TAG.search(tag) if tag else None
    return int(match.group(1)) if match else None


def check_image_contract(image: str) -> int:
    """The image's contract version, when it is this control plane's; else `ImageContractError` naming both
    versions and the fix."""
    version = image_contract_version(image)
    fix = ("rebuild and push the worker image from this checkout with `make image` (its tag names the contract: "
           f"`loraflow-worker:<version>-contract{CONTRACT_VERSION}-...`) and set LORAFLOW_WORKER_IMAGE to it")
    if version is None:
        raise ImageContractError(
            f"worker image {image!r}: its tag names no job contract version (`-contract<N>-`), so whether it "
            f"understands this control plane's contract version {CONTRACT_VERSION} is unknown: {fix}")
    if version != CONTRACT_VERSION:
        raise ImageContractError(
            f"worker image {image!r} speaks job contract version {version}; this control plane sends version "
            f"{CONTRACT_VERSION}, which the image would refuse after a GPU was rented: {fix}")
    return version
