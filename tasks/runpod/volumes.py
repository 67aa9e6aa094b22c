"""The weight cache: one RunPod network volume per datacenter and control plane, holding the Hugging Face
cache of the models preloaded there.

A network volume lives in one datacenter and pins the workers that mount it there (RunPod's placement
rule), so a run that wants warm weights runs where its volume is. Names carry the control plane's tag,
like endpoint names, so two Prefect servers sharing an account never fill or grow each other's volumes.
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple

from tasks.runpod.client import RunpodClient
from tasks.runpod.endpoints import NAMESPACE_PATTERN
from tasks.runpod.errors import NotFoundError
from tasks.runpod.models import CreateNetworkVolume, NetworkVolume

VOLUME_PREFIX = "loraflow-cache-"
MIN_VOLUME_GB = 10
MAX_VOLUME_GB = 4096
"""RunPod's bounds on a network volume's size (`CreateNetworkVolumeRequest.size`)."""
SIZE_STEP_GB = 10
HEADROOM = 1.1
"""Room over the cache's exact size: the Hub cache's own files, and models that grow a little between revisions."""


def volume_name(data_center: str, namespace: str) -> str:
    """`loraflow-cache-<tag>-<datacenter>`: one per datacenter and control plane."""
    return f"{VOLUME_PREFIX}{namespace}-{data_center.lower()}"


class VolumeName(NamedTuple):
    namespace: str
    data_center: str
    """As the name carries it: lowercase."""


_NAME = re.compile(rf"^{VOLUME_PREFIX}(?P<namespace>{NAMESPACE_PATTERN})-(?P<data_center>[a-z0-9-]+)$")


def parse_volume_name(name: str) -> VolumeName | None:
    """The control plane's tag and the datacenter in a name `volume_name` made; None for any other name
    (a tag has no dash, so the first dash after it starts the datacenter)."""
    match = _NAME.match(name)
    return VolumeName(match["namespace"], match["data_center"]) if match else None


def volume_size_gb(model_bytes: list[int]) -> int:
    """The size a volume needs to hold these models and to download the largest of them once more: the Hub
    client writes a file in full next to its final place before moving it, so an update of a cached model
    briefly needs its size twice. Rounded up to 10 GB, within RunPod's bounds."""
    if not model_bytes:
        return MIN_VOLUME_GB
    needed_gb = (sum(model_bytes) + max(model_bytes)) * HEADROOM / 1e9
    size = math.ceil(needed_gb / SIZE_STEP_GB) * SIZE_STEP_GB
    if size > MAX_VOLUME_GB:
        raise ValueError(f"the models need a {size} GB volume, more than RunPod's largest ({MAX_VOLUME_GB} GB): "
                         "preload fewer models per sweep")
    return max(size, MIN_VOLUME_GB)


def find_volume(client: RunpodClient, name: str, data_center: str) -> NetworkVolume | None:
    """The volume of this name in this datacenter; with several (two sweeps raced to create it), the largest,
    then the lowest id, so every reader picks the same one."""
    matches = [v for v in client.list_network_volumes() if v.name == name and v.data_center == data_center]
    return min(matches, key=lambda v: (-v.size, v.id)) if matches else None


def ensure_volume(client: RunpodClient, name: str, data_center: str, size_gb: int) -> NetworkVolume:
    """The volume `name` in `data_center`, at least `size_gb` large: created when missing, grown when
    smaller, never shrunk (RunPod cannot shrink a volume, and a bigger one holds what it held)."""
    volume = find_volume(client, name, data_center)
    if volume is None:
        return client.create_network_volume(CreateNetworkVolume(name=name, size=size_gb, data_center=data_center))
    if volume.size < size_gb:
        return client.grow_network_volume(volume.id, size_gb)
    return volume


def volume_exists(client: RunpodClient, volume_id: str) -> bool:
    return any(v.id == volume_id for v in client.list_network_volumes())


def delete_volume(client: RunpodClient, volume_id: str) -> None:
    """Delete the volume and its files; one already gone counts as deleted. Attached or not: RunPod's API documents
    no refusal for a volume an endpoint attaches, so callers delete through `delete_unattached_volume`."""
    try:
        client.delete_network_volume(volume_id)
    except NotFoundError:
        pass


def attaching_endpoints(client: RunpodClient, volume_id: str) -> list[str]:
    """The names of the endpoints that reference the volume, listed now: every endpoint of the account, this
    control plane's, other control planes' and anyone's."""
    return [endpoint.name for endpoint in client.list_endpoints() if volume_id in endpoint.network_volumes]


def delete_unattached_volume(client: RunpodClient, volume_id: str) -> list[str]:
    """Delete the volume unless an endpoint references it, as the account's endpoints are listed right before the
    delete; returns the names of those endpoints ([]: deleted, or already gone). RunPod would delete it anyway, and
    the endpoint would keep naming a volume that is gone, which its workers cannot mount."""
    users = attaching_endpoints(client, volume_id)
    if not users:
        delete_volume(client, volume_id)
    return users
