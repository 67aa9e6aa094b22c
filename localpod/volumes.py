"""Network volumes: each one a folder on this machine that lives in one datacenter of localpod's catalog; the
rules RunPod applies to volumes and to the endpoints that attach them; and how a worker sees its volume.

A volume's folder is `<volume_dir>/<volume id>`, made with the volume and removed with it. RunPod mounts an
endpoint's volume at `/runpod-volume` in each of its workers: a docker worker gets that very mount; a process
worker shares this machine's files and is told the folder in `LORAFLOW_VOLUME_PATH` instead. RunPod starts
the workers of an endpoint with a volume in the volume's datacenter only: `FaultBook.place` reads the pins
this book keeps.

Nothing here touches HTTP; `routes_volumes.py` answers `/v2/network-volumes`.
"""

from __future__ import annotations

import secrets
import shutil
import string
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from localpod import catalog
from localpod.faults import FaultBook
from localpod.models import AccountVolume, LocalpodConfig
from localpod.problems import ProblemError

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
    created_at: float

    def document(self) -> dict[str, Any]:
        """The `NetworkVolume` schema's document."""
        return {"id": self.id, "name": self.name, "size": self.size, "dataCenter": self.data_center, "type": self.type}


class VolumeBook:
    """Every network volume of one server. Methods raise `ProblemError` with RunPod's answer to a refused call."""

    def __init__(self, config: LocalpodConfig, faults: FaultBook) -> None:
        self.config = config
        self.faults = faults
        self.volumes: dict[str, VolumeRecord] = {}

    def create(self, name: str, size: int, data_center: str, volume_type: str | None) -> VolumeRecord:
        """A new volume and its empty folder. Names need not be unique (RunPod's `NetworkVolume.name`)."""
        dc = catalog.data_center(data_center)
        if dc is None or not dc.network_volume_types:
            capable = ", ".join(row.id for row in catalog.DATA_CENTERS if row.network_volume_types)
            raise ProblemError(400, f"data center {data_center} does not support network volumes; these do: {capable}")
        # RunPod: an omitted type is the datacenter's default (primary) storage tier.
        tier = volume_type or dc.network_volume_types[0]
        if tier not in dc.network_volume_types:
            offered = ", ".join(dc.network_volume_types)
            raise ProblemError(400, f"data center {data_center} offers no {tier} network volumes, only {offered}")
        if data_center in self.config.volume_create_fails_in:
            self.faults.injected["status_500"] += 1
            raise ProblemError(500, f"creating a network volume in {data_center} failed "
                                    "(localpod fault injection: volume_create_fails_in)")
        volume_id = self._new_id()
        volume = VolumeRecord(id=volume_id, name=name, size=size, data_center=data_center, type=tier,
                              path=volume_path(self.config, volume_id), created_at=time.time())
        volume.path.mkdir(parents=True, exist_ok=True)
        self.volumes[volume.id] = volume
        self.faults.volume_data_centers[volume.id] = data_center
        return volume

    def get(self, volume_id: str) -> VolumeRecord:
        volume = self.volumes.get(volume_id)
        if volume is None:
            raise ProblemError(404, f"network volume {volume_id} not found")
        return volume

    def update(self, volume: VolumeRecord, name: str | None, size: int | None) -> None:
        """Rename and grow; RunPod cannot shrink a volume's storage."""
        if size is not None and size < volume.size:
            raise ProblemError(400, f"network volume {volume.id} is {volume.size} GB and cannot shrink to {size} GB: "
                                    "network volume storage cannot be reduced")
        volume.name = name if name is not None else volume.name
        volume.size = size if size is not None else volume.size

    def delete(self, volume: VolumeRecord, users: list[tuple[str, str]]) -> None:
        """Remove the volume and its folder; refused while endpoints (id, name) still attach it, as RunPod does."""
        if users:
            named = ", ".join(f"{endpoint_id} ({name})" for endpoint_id, name in users)
            raise ProblemError(400, f"network volume {volume.id} is attached to endpoint {named}: detach it or "
                                    "delete the endpoint first")
        del self.volumes[volume.id]
        del self.faults.volume_data_centers[volume.id]
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
        return [AccountVolume(id=v.id, name=v.name, data_center=v.data_center, size=v.size, path=str(v.path))
                for v in self.volumes.values()]

    def _new_id(self) -> str:
        volume_id = _random_id()
        while volume_id in self.volumes:
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
