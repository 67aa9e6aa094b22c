"""CUDA versions as the catalog compares them, and what an endpoint (`gpu.minCudaVersion`,
`gpu.allowedCudaVersions`) or a catalog query (`minCudaVersion`, `cudaVersions`) asks of its hosts' versions."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class CudaNeed:
    """What an endpoint asks of its hosts' CUDA (`gpu.minCudaVersion` or a non-empty `gpu.allowedCudaVersions`),
    or a catalog query of them (`minCudaVersion`, `cudaVersions`); both None: anything goes."""

    floor: str | None = None
    allowed: frozenset[str] | None = None

    @classmethod
    def of(cls, gpu: dict[str, Any]) -> CudaNeed:
        # RunPod refuses both at once (`routes.endpoints` checks it); an empty allowed list states no constraint.
        allowed = gpu.get("allowedCudaVersions") or None
        return cls(floor=gpu.get("minCudaVersion") or None, allowed=frozenset(allowed) if allowed else None)

    @property
    def any(self) -> bool:
        return self.floor is None and self.allowed is None

    def admits(self, version: str) -> bool:
        if self.allowed is not None and version not in self.allowed:
            return False
        if self.floor is not None:
            floor = cuda_version(self.floor)
            return cuda_version(version)[: len(floor)] >= floor
        return True

    def met_by(self, versions: Iterable[str]) -> bool:
        return self.any or any(self.admits(v) for v in versions)

    def describe(self) -> str:
        """As a log line says it: "CUDA >= 13.0", "CUDA 12.9 or 13.0"."""
        if self.floor is not None:
            return f"CUDA >= {self.floor}"
        return "CUDA " + " or ".join(sorted(self.allowed or (), key=cuda_version))


def cuda_version(text: str) -> tuple[int, ...]:
    """A CUDA version as a comparable tuple. As a `minCudaVersion` floor, "12" admits any 12.x (versions are
    compared on as many parts as the floor has)."""
    return tuple(int(part) for part in text.split("."))
