"""localpod's catalog made from a recording of RunPod's answers (`python -m flows.preflight RUN_FILE --record DIR`),
for `python -m localpod --catalog-from DIR`: one real account's GPU types, pools, prices, hosts' CUDA versions,
stock and datacenters become the local stack's.

The recording's layout is the contract between the two (localpod imports nothing of the control plane; see
docs/local-stand-ins.md, "A recorded catalog"): `manifest.json` lists the answers, each with its file, its route
(`/v2/...`), its query and its status; each file holds one answer's JSON body. Of these, the answers of status 200 to
`/v2/catalog/gpus`, `/v2/catalog/datacenters` and `/v2/catalog/cpus` make the catalog; the lists of endpoints,
volumes and secrets are the account's, not the catalog's, and are not served.

How the tables are derived (RunPod publishes no host table, so part of it is inferred):
- GPU types: every type any GPU read lists (its last listing wins), with its pool, memory, prices and max counts; a
  pool's serverless price is its types' (RunPod quotes one per pool; where they differ, the highest, and a note says
  so). Types not made by NVIDIA are left out (localpod answers NVIDIA for every type).
- Stock: each type's level per datacenter from the serverless availability read (`include=AVAILABILITY`,
  `product=SERVERLESS`, no CUDA filter); a datacenter that lists the type (`gpuAvailability`) where that read does
  not offers it at NONE. Without such a read, the datacenters' `gpuAvailability` levels stand in.
- Hosts' CUDA: each type's hosts run the versions its `cudaVersions` lists (none listed: none, so a CUDA floor is
  never met there, as RunPod treats a type without versions). A read scoped to hosts that meet a CUDA need
  (`minCudaVersion`, `cudaVersions`) tells more: a datacenter with stock of the type unscoped and none scoped has
  no host that meets it, so its hosts run only the type's versions the need does not admit.
- Datacenters: the datacenters read's (region, volume tiers, compliance, global network); one named only by a
  GPU's availability gets region UNKNOWN and no volume tier. The country (`countryCodes`) comes from the id as
  RunPod names them: US-KS-2 is in US, EU-RO-1 in RO, CA-MTL-1 in CA.
- CPU flavors: the CPU read's, offered where the datacenters' `cpuAvailability` (else the CPU read's availability)
  says; none when the recording read no CPU catalog (every endpoint then runs on a GPU).
Stock that a recording shows as NONE stays NONE: `/_localpod/stock` takes pools out and puts them back, but cannot
give a datacenter stock it did not have when recorded.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from localpod.catalog.cuda import CudaNeed, cuda_version
from localpod.catalog.tables import (
    SERVERLESS_CPU_DISK_GB_PER_VCPU,
    AvailabilityLevel,
    CatalogTables,
    CpuTypeRow,
    DataCenterRow,
    GpuTypeRow,
)

MANIFEST = "manifest.json"
FORMAT = 1
RECORD_FIX = "record one with `python -m flows.preflight RUN_FILE --record DIR`"

# RunPod names datacenters REGION-COUNTRY-N where the first part is a continent (EU-RO-1, EUR-NO-1, AP-JP-1, OC-AU-1),
# and COUNTRY-SITE-N otherwise (US-KS-2, CA-MTL-1).
_CONTINENT_PREFIXES = {"EU", "EUR", "AP", "OC", "SEA", "ME", "AF", "SA", "AS"}
_COUNTRY = re.compile(r"^[A-Z]{2}$")


class RecordingError(ValueError):
    """A folder that is not a recording localpod can serve; the message names what is wrong and the fix."""


class _Answer(BaseModel):
    model_config = ConfigDict(extra="ignore")

    file: str = Field(description="The answer's file, in the recording's folder.")
    api: str = Field(default="control", description="control (API v2) or job (the per-endpoint job API).")
    route: str = Field(description="The route asked, from `/v2` on.")
    query: dict[str, str] = Field(default_factory=dict, description="The query parameters asked.")
    status: int = Field(description="RunPod's HTTP status.")


class _Manifest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    format: int = Field(description="The layout's version.")
    recorded_at: datetime = Field(description="When it was recorded.")
    api_host: str = Field(description="The API's host.")
    answers: list[_Answer] = Field(description="The answers, in the order they came.")


@dataclass(frozen=True)
class RecordedCatalog:
    """The tables made from a recording, and what a person starting localpod on it should know."""

    tables: CatalogTables
    description: str
    """One line: where from, when, and how much."""
    notes: tuple[str, ...]
    """What was left out or assumed, one line each."""


def load(folder: Path) -> RecordedCatalog:
    """The catalog of the recording in `folder`. Raises `RecordingError` naming the file and the fix."""
    manifest = _manifest(folder)
    answers = [(a, _body(folder, a)) for a in manifest.answers if a.api == "control" and a.status == 200]
    gpu_reads = [(a.query, body.get("gpus")) for a, body in answers if a.route == "/v2/catalog/gpus"]
    gpu_reads = [(query, gpus) for query, gpus in gpu_reads if isinstance(gpus, list)]
    if not gpu_reads:
        raise RecordingError(f"{folder}: the recording holds no answer of GET /v2/catalog/gpus (status 200) to make a "
                             f"catalog from; {RECORD_FIX} where RunPod's key can read the catalog")
    dc_docs = _last(body.get("dataCenters") for a, body in answers if a.route == "/v2/catalog/datacenters")
    cpu_reads = [(a.query, body.get("cpus")) for a, body in answers if a.route == "/v2/catalog/cpus"]
    cpu_reads = [(query, cpus) for query, cpus in cpu_reads if isinstance(cpus, list)]
    notes: list[str] = []
    tables = _tables(gpu_reads, dc_docs or [], cpu_reads, notes)
    pools = {g.pool for g in tables.gpu_types if g.pool is not None}
    description = (f"catalog recorded from {manifest.api_host} at {manifest.recorded_at.isoformat()} ({folder}): "
                   f"{len(tables.gpu_types)} GPU types in {len(pools)} pools, {len(tables.data_centers)} datacenters, "
                   f"{len(tables.cpu_types)} CPU flavors")
    return RecordedCatalog(tables=tables, description=description, notes=tuple(notes))


def _manifest(folder: Path) -> _Manifest:
    path = folder / MANIFEST
    if not path.is_file():
        raise RecordingError(f"{path}: no such file; --catalog-from names a recording's folder ({RECORD_FIX})")
    try:
        manifest = _Manifest.model_validate_json(path.read_text())
    except ValidationError as e:
        raise RecordingError(f"{path} is not a recording's manifest: {e.errors()[0]['loc']}: {e.errors()[0]['msg']}; "
                             f"{RECORD_FIX}") from e
    if manifest.format != FORMAT:
        raise RecordingError(f"{path}: format {manifest.format}; this localpod reads format {FORMAT}: record it again "
                             "with this checkout's `python -m flows.preflight RUN_FILE --record DIR`")
    return manifest


def _body(folder: Path, answer: _Answer) -> dict[str, Any]:
    path = folder / answer.file
    try:
        body = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise RecordingError(f"{path} (listed in {MANIFEST} for {answer.route}) cannot be read as JSON: {e}; "
                             f"{RECORD_FIX}") from e
    return body if isinstance(body, dict) else {}


def _last(items: Any) -> list[dict[str, Any]] | None:
    found = None
    for item in items:
        if isinstance(item, list):
            found = item
    return found


def _serverless_need(query: dict[str, str]) -> CudaNeed | None:
    """The CUDA need a serverless availability read was scoped to (`CudaNeed()`: none); None for a read of another
    kind (no availability, another product, a count, cloud or countries that narrow it otherwise)."""
    if query.get("include") != "AVAILABILITY" or "SERVERLESS" not in query.get("product", "").split(","):
        return None
    if query.get("count", "1") != "1" or "cloud" in query or "countryCodes" in query:
        return None
    versions = query.get("cudaVersions")
    return CudaNeed(floor=query.get("minCudaVersion"),
                    allowed=frozenset(versions.split(",")) if versions else None)


def _levels(doc: dict[str, Any]) -> dict[str, AvailabilityLevel]:
    return {dc["id"]: dc["availability"] for dc in doc.get("dataCenters") or ()}


def _tables(gpu_reads: list[tuple[dict[str, str], list[dict[str, Any]]]], dc_docs: list[dict[str, Any]],
            cpu_reads: list[tuple[dict[str, str], list[dict[str, Any]]]], notes: list[str]) -> CatalogTables:
    types: dict[str, dict[str, Any]] = {}
    for _, gpus in gpu_reads:
        for doc in gpus:
            types[doc["id"]] = doc
    foreign = sorted(type_id for type_id, doc in types.items() if doc.get("manufacturer", "NVIDIA") != "NVIDIA")
    if foreign:
        notes.append(f"left out (localpod serves NVIDIA types only): {', '.join(foreign)}")
    types = {type_id: doc for type_id, doc in types.items() if type_id not in foreign}

    unscoped = [gpus for query, gpus in gpu_reads if _serverless_need(query) == CudaNeed()]
    scoped = [(need, {doc["id"]: doc for doc in gpus}) for query, gpus in gpu_reads
              if (need := _serverless_need(query)) is not None and not need.any]
    baseline = {doc["id"]: doc for doc in unscoped[-1]} if unscoped else None
    dc_offers = {dc["id"]: {o["id"]: o["availability"] for o in dc.get("gpuAvailability") or ()} for dc in dc_docs}
    if baseline is None:
        notes.append("no serverless availability read (include=AVAILABILITY, product=SERVERLESS) without a CUDA "
                     "filter: stock comes from the datacenters' gpuAvailability")

    offers: dict[str, dict[str, AvailabilityLevel]] = {}  # datacenter → type → level
    host_cuda: dict[str, dict[str, tuple[str, ...]]] = {}  # datacenter → type → versions, where not the type's own
    type_versions: dict[str, tuple[str, ...]] = {}
    dc_names: dict[str, str] = {}
    for type_id, doc in types.items():
        source = baseline.get(type_id) if baseline is not None else None
        listed = [source] if source is not None else [d.get(type_id) for _, d in scoped]
        versions = {v["version"] for d in listed if d for v in d.get("cudaVersions") or ()}
        type_versions[type_id] = tuple(sorted(versions, key=cuda_version))
        levels = _levels(source) if source is not None else {}
        for d in (source, *(s.get(type_id) for _, s in scoped)):
            dc_names.update({dc["id"]: dc["name"] for dc in (d or {}).get("dataCenters") or ()})
        for dc_id, by_type in dc_offers.items():
            if type_id in by_type:
                levels.setdefault(dc_id, "NONE" if baseline is not None else by_type[type_id])
        for dc_id, level in levels.items():
            offers.setdefault(dc_id, {})[type_id] = level
        for need, scoped_types in scoped:
            scoped_doc = scoped_types.get(type_id)
            if scoped_doc is None or source is None:
                continue
            met = _levels(scoped_doc)
            for dc_id, level in levels.items():
                if level != "NONE" and met.get(dc_id, "NONE") == "NONE":
                    below = host_cuda.get(dc_id, {}).get(type_id, type_versions[type_id])
                    host_cuda.setdefault(dc_id, {})[type_id] = tuple(v for v in below if not need.admits(v))

    cpu_types, cpu_offers = _cpus(cpu_reads, dc_docs)
    known = {dc["id"] for dc in dc_docs}
    named_only = sorted(set(offers) - known)
    if named_only:
        notes.append(f"datacenters named only by a GPU's availability (region UNKNOWN, no network volumes): "
                     f"{', '.join(named_only)}")
    rows = [_data_center(dc, offers.get(dc["id"], {}), host_cuda.get(dc["id"], {}), cpu_offers.get(dc["id"], {}))
            for dc in dc_docs]
    rows += [DataCenterRow(dc_id, dc_names.get(dc_id, dc_id), _country(dc_id), "UNKNOWN", False, (), (),
                           offers[dc_id], host_cuda.get(dc_id, {})) for dc_id in named_only]
    if not cpu_reads:
        notes.append("no CPU catalog read (GET /v2/catalog/cpus): no CPU flavors, every endpoint runs on a GPU")
    gpu_rows = tuple(_gpu_type(doc, type_versions[type_id]) for type_id, doc in types.items())
    return CatalogTables(gpu_types=gpu_rows, data_centers=tuple(rows), cpu_types=cpu_types,
                         pool_serverless_usd_per_hour=_pool_prices(types.values(), notes))


def _gpu_type(doc: dict[str, Any], versions: tuple[str, ...]) -> GpuTypeRow:
    price, most = doc.get("price") or {}, doc.get("maxCount") or {}
    return GpuTypeRow(doc["id"], doc["name"], doc.get("pool"), doc["memory"], float(price.get("secure", 0.0)),
                      float(price.get("community", 0.0)), int(most.get("secure", 1)), int(most.get("community", 0)),
                      versions)


def _pool_prices(docs: Any, notes: list[str]) -> dict[str, float]:
    by_pool: dict[str, set[float]] = {}
    for doc in docs:
        serverless = (doc.get("price") or {}).get("serverless")
        if doc.get("pool") is not None and serverless is not None:
            by_pool.setdefault(doc["pool"], set()).add(float(serverless))
    for pool, prices in sorted(by_pool.items()):
        if len(prices) > 1:
            notes.append(f"pool {pool}: its types list serverless prices {sorted(prices)}; localpod serves and bills "
                         f"the pool at {max(prices)} (RunPod quotes one price per pool)")
    return {pool: max(prices) for pool, prices in by_pool.items()}


def _data_center(doc: dict[str, Any], offers: dict[str, AvailabilityLevel], host_cuda: dict[str, tuple[str, ...]],
                 cpu_offers: dict[str, AvailabilityLevel]) -> DataCenterRow:
    return DataCenterRow(doc["id"], doc.get("name", doc["id"]), _country(doc["id"]), doc.get("region", "UNKNOWN"),
                         bool(doc.get("globalNetwork", False)), tuple(doc.get("networkVolumeTypes") or ()),
                         tuple(doc.get("compliance") or ()), offers, host_cuda, cpu_offers)


def _cpus(cpu_reads: list[tuple[dict[str, str], list[dict[str, Any]]]], dc_docs: list[dict[str, Any]],
          ) -> tuple[tuple[CpuTypeRow, ...], dict[str, dict[str, AvailabilityLevel]]]:
    flavors: dict[str, dict[str, Any]] = {}
    for _, cpus in cpu_reads:
        for doc in cpus:
            flavors[doc["id"]] = doc
    # Served as recorded; RunPod's catalog states no serverless disk limit: the flavor's known one (`cpu3c` for
    # `cpu3c-2-4`), else the least.
    rows = tuple(CpuTypeRow(doc["id"], doc["name"], doc.get("group", ""), doc["vcpu"]["min"], doc["vcpu"]["max"],
                            float(doc["ramGbPerVcpu"]), float(doc["price"]["securePerVcpu"]),
                            float(doc["price"]["serverlessPerVcpu"]), serverless_vcpu_max=doc["vcpu"]["max"],
                            serverless_disk_gb_per_vcpu=SERVERLESS_CPU_DISK_GB_PER_VCPU.get(
                                re.sub(r"-\d+-\d+$", "", doc["id"]), CpuTypeRow.serverless_disk_gb_per_vcpu))
                 for doc in flavors.values())
    offers: dict[str, dict[str, AvailabilityLevel]] = {}
    if any("cpuAvailability" in dc for dc in dc_docs):
        for dc in dc_docs:
            offers[dc["id"]] = {o["id"]: o["availability"] for o in dc.get("cpuAvailability") or ()
                                if o["id"] in flavors}
    else:
        for query, cpus in cpu_reads:
            if query.get("include") == "AVAILABILITY" and "vcpuCount" not in query:
                for doc in cpus:
                    for dc_id, level in _levels(doc).items():
                        offers.setdefault(dc_id, {})[doc["id"]] = level
    return rows, offers


def _country(data_center_id: str) -> str:
    """The country of a datacenter, from its id as RunPod names them; "" when the id does not say."""
    parts = data_center_id.split("-")
    country = parts[1] if parts[0] in _CONTINENT_PREFIXES and len(parts) > 1 else parts[0]
    return country if _COUNTRY.match(country) else ""

