"""The weight cache's volumes: one per datacenter and control plane, created when missing, grown to fit,
never shrunk — against localpod's `/v2/network-volumes`."""

from __future__ import annotations

import pytest

from tasks.runpod.models import CreateNetworkVolume
from tasks.runpod.volumes import ensure_volume, find_volume, volume_name, volume_size_gb
from tests.test_runpod_secrets import localpod, runpod  # noqa: F401

VOLUME_DC = "EU-RO-1"


def test_volume_names_carry_the_control_plane_tag_and_the_datacenter():
    assert volume_name("EU-RO-1", "ab12") == "loraflow-cache-ab12-eu-ro-1"


def test_a_volume_holds_the_models_and_one_more_download_of_the_largest():
    # 6 GB + 2 GB, plus 6 GB to update the largest, plus 10 % headroom: 15.4 GB, rounded up to 20.
    assert volume_size_gb([6_000_000_000, 2_000_000_000]) == 20
    assert volume_size_gb([]) == 10


def test_more_than_runpods_largest_volume_is_refused():
    with pytest.raises(ValueError, match="4096 GB"):
        volume_size_gb([3_000_000_000_000])


def test_a_missing_volume_is_created_once(runpod):  # noqa: F811
    first = ensure_volume(runpod, "loraflow-cache-ns-eu-ro-1", VOLUME_DC, 20)
    again = ensure_volume(runpod, "loraflow-cache-ns-eu-ro-1", VOLUME_DC, 20)
    assert again.id == first.id and first.size == 20 and first.data_center == VOLUME_DC
    assert len([v for v in runpod.list_network_volumes() if v.name == "loraflow-cache-ns-eu-ro-1"]) == 1


def test_a_volume_too_small_grows_and_one_big_enough_is_never_shrunk(runpod):  # noqa: F811
    created = ensure_volume(runpod, "cache", VOLUME_DC, 20)
    assert ensure_volume(runpod, "cache", VOLUME_DC, 50).size == 50
    assert ensure_volume(runpod, "cache", VOLUME_DC, 30).size == 50
    assert find_volume(runpod, "cache", VOLUME_DC).id == created.id


def test_of_two_volumes_of_one_name_every_reader_picks_the_larger(runpod):  # noqa: F811
    small = runpod.create_network_volume(CreateNetworkVolume(name="cache", size=10, data_center=VOLUME_DC))
    large = runpod.create_network_volume(CreateNetworkVolume(name="cache", size=40, data_center=VOLUME_DC))
    assert find_volume(runpod, "cache", VOLUME_DC).id == large.id != small.id
