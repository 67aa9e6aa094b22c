"""Network volumes: each one a folder on this machine that lives in one datacenter of localpod's catalog; the
rules RunPod applies to volumes and to the endpoints that attach them; and how a worker sees its volume.

A volume's folder is `<volume_dir>/<volume id>`, made with the volume and removed with it. RunPod mounts an
endpoint's volume at `/runpod-volume` in each of its workers: a docker worker gets that very mount; a process
worker shares this machine's files and is told the folder in `LORAFLOW_VOLUME_PATH` instead. RunPod starts
the workers of an endpoint with a volume in the volume's datacenter only: `FaultBook.place` reads the pins
this book keeps. A volume is deleted when asked, attached or not (RunPod's API documents no refusal): an endpoint
that attached it keeps naming it, and no worker of that endpoint starts any more.

A volume bills by size and time from its creation to its deletion, as on RunPod (`billing.py` has the prices):
the book keeps each volume's bill (its tier, each size it had and from when, when it was deleted) after the
volume is gone, on the storage clock (`billing.StorageClock`), which tests move forward through
`/_localpod/clock`. Growing a volume changes its rate from that moment. The tiers a datacenter offers are
`FaultBook.volume_types` (the catalog's, unless `/_localpod/volume-types` changed them); the first is its
primary tier, the one a volume created without `type` gets.

Nothing here touches HTTP; `localpod/routes/volumes.py` answers `/v2/network-volumes`, `localpod/routes/billing.py`
`/v2/billing/network-volumes`.
"""

from __future__ import annotations

import logging
import secrets
import shutil
import string
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localpod.billing import StorageClock
from localpod.faults.book import FaultBook
from localpod.models import AccountVolume, LocalpodConfig
from localpod.problems import ProblemError

log = logging.getLogger("localpod.volumes")

RUNPOD_VOLUME_MOUNT = "/runpod-volume"  # RunPod mounts an endpoint's network volume here in every worker
VOLUME_PATH_ENV = "LORAFLOW_VOLUME_PATH"
"""Where a process worker finds its volume (it has no /runpod-volume); loraflow's worker keeps its Hub cache there."""
_ID_ALPHABET = string.ascii_lowercase + string.digits
_ID_LENGTH = 10  # RunPod network volume ids are 10 lowercase alphanumerics, e.g. "agv6w2qcg7" (the API's example)


@dataclass
class VolumeRecord:
    id: str
    name: str
    size: int
    """Allocated GB; localpod puts no quota on the folder."""
    data_center: str
    type: str
    path: Path

    def document(self) -> dict[str, Any]:
        """The `NetworkVolume` schema's document."""
        return {"id": self.id, "name": self.name, "size": self.size, "dataCenter": self.data_center, "type": self.type}


@dataclass
class VolumeBill:
    """What one volume was billed for, kept after it is deleted: its tier, and each size it had from when (storage
    clock seconds), until its deletion."""

    volume_id: str
    type: str
    sizes: list[tuple[float, int]] = field(default_factory=list)
    """(from when, GB), in time order: the creation's size first, then each growth."""
    deleted_at: float | None = None

    def spans(self, now: float) -> Iterator[tuple[float, float, int]]:
        """(began, ended, GB) for each stretch at one size; the last ends at the deletion, or `now`."""
        ends = [since for since, _ in self.sizes[1:]] + [self.deleted_at if self.deleted_at is not None else now]
        for (since, size), until in zip(self.sizes, ends, strict=True):
            yield since, until, size


class VolumeBook:
    """Every network volume of one server. Methods raise `ProblemError` with RunPod's answer to a refused call."""

    def __init__(self, config: LocalpodConfig, faults: FaultBook, clock: StorageClock) -> None:
        self.config = config
        self.faults = faults
        self.clock = clock
        self.volumes: dict[str, VolumeRecord] = {}
        self.bills: dict[str, VolumeBill] = {}
        """Every volume ever created, deleted ones included: what `/v2/billing/network-volumes` reads."""

    def create(self, name: str, size: int, data_center: str, volume_type: str | None) -> VolumeRecord:
        """A new volume and its empty folder, billed from now. Names need not be unique (RunPod's
        `NetworkVolume.name`)."""
        offered = self.faults.volume_types.get(data_center, ())
        if not offered:
            capable = ", ".join(dc for dc, tiers in self.faults.volume_types.items() if tiers)
            raise ProblemError(400, f"data center {data_center} does not support network volumes; these do: {capable}")
        # RunPod: an omitted type is the datacenter's default (primary) storage tier.
        tier = volume_type or offered[0]
        if tier not in offered:
            raise ProblemError(400, f"data center {data_center} offers no {tier} network volumes, only "
                                    f"{', '.join(offered)}: pick one of those as `type`, or another datacenter")
        if data_center in self.config.volume_create_fails_in:
            self.faults.injected["status_500"] += 1
            raise ProblemError(500, f"creating a network volume in {data_center} failed "
                                    "(localpod fault injection: volume_create_fails_in)")
        volume_id = self._new_id()
        volume = VolumeRecord(id=volume_id, name=name, size=size, data_center=data_center, type=tier,
                              path=volume_path(self.config, volume_id))
        volume.path.mkdir(parents=True, exist_ok=True)
        self.volumes[volume.id] = volume
        self.bills[volume.id] = VolumeBill(volume_id=volume.id, type=tier, sizes=[(self.clock.now(), size)])
        self.faults.volume_data_centers[volume.id] = data_center
        return volume

    def get(self, volume_id: str) -> VolumeRecord:
        volume = self.volumes.get(volume_id)
        if volume is None:
            raise ProblemError(404, f"network volume {volume_id} not found")
        return volume

    def update(self, volume: VolumeRecord, name: str | None, size: int | None) -> None:
        """Rename and grow (billed at the new size from now); RunPod cannot shrink a volume's storage."""
        if size is not None and size < volume.size:
            raise ProblemError(400, f"network volume {volume.id} is {volume.size} GB and cannot shrink to {size} GB: "
                                    "network volume storage cannot be reduced")
        volume.name = name if name is not None else volume.name
        if size is not None and size != volume.size:
            volume.size = size
            self.bills[volume.id].sizes.append((self.clock.now(), size))

    def delete(self, volume: VolumeRecord, users: list[tuple[str, str]]) -> None:
        """Remove the volume and its folder, even while endpoints (id, name) attach it: RunPod's API documents no
        refusal. Those endpoints keep naming the volume, and no worker of theirs starts any more
        (`FaultBook.gone_volumes`); the log says which."""
        if users:
            named = ", ".join(f"{endpoint_id} ({name})" for endpoint_id, name in users)
            log.warning("network volume %s deleted while endpoint %s attaches it: no worker of theirs can start now",
                        volume.id, named)
        del self.volumes[volume.id]
        del self.faults.volume_data_centers[volume.id]
        self.bills[volume.id].deleted_at = self.clock.now()  # its bill stays: billing still reports what it cost
        # A docker worker may have left files only root can remove: the volume is gone for the API regardless.
        shutil.rmtree(volume.path, ignore_errors=True)

    def check_endpoint(self, spec: dict[str, Any]) -> None:
        """An endpoint's `networkVolumes` must name volumes that exist, and one at most: a worker mounts one volume,
        at /runpod-volume, and RunPod starts the workers in that volume's datacenter."""
        ids = list(dict.fromkeys(spec.get("networkVolumes") or ()))
        unknown = [volume_id for volume_id in ids if volume_id not in self.volumes]
        if unknown:
            raise ProblemError(400, f"network volume {', '.join(unknown)} not found")
        if len(ids) > 1:
            attached = ", ".join(f"{v} in {self.volumes[v].data_center}" for v in ids)
            raise ProblemError(400, f"attach one network volume, not several ({attached}): a worker mounts one, at "
                                    f"{RUNPOD_VOLUME_MOUNT}, and starts in its datacenter")

    def account_rows(self) -> list[AccountVolume]:
        return [AccountVolume(id=v.id, name=v.name, data_center=v.data_center, size=v.size, type=v.type,
                              path=str(v.path))
                for v in self.volumes.values()]

    def _new_id(self) -> str:
        volume_id = _random_id()
        while volume_id in self.bills:  # a deleted volume's id stays taken: its bill is still listed under it
            volume_id = _random_id()
        return volume_id


def volume_path(config: LocalpodConfig, volume_id: str) -> Path:
    """A volume's folder; absolute, since Docker reads a relative `--volume` source as a named volume."""
    return config.volume_dir.absolute() / volume_id


def volume_env(config: LocalpodConfig, spec: dict[str, Any]) -> dict[str, str]:
    """What a process worker of this endpoint is told about its volume: its folder; nothing without a volume, and
    nothing for a docker worker, which has the volume mounted where RunPod mounts it."""
    volume_ids = spec.get("networkVolumes") or []
    if not volume_ids or config.worker_runtime != "process":
        return {}
    return {VOLUME_PATH_ENV: str(volume_path(config, volume_ids[0]))}


def docker_volume_args(config: LocalpodConfig, spec: dict[str, Any]) -> list[str]:
    """`docker run` options that mount this endpoint's volume at /runpod-volume; none without a volume."""
    volume_ids = spec.get("networkVolumes") or []
    return ["--volume", f"{volume_path(config, volume_ids[0])}:{RUNPOD_VOLUME_MOUNT}"] if volume_ids else []


def _random_id() -> str:
    return "".join(secrets.choice(_ID_ALPHABET) for _ in range(_ID_LENGTH))
