"""The fault book: the rules in force, which request, job or worker each one hits, and where a worker may start
(the GPU and CPU stock, the hosts' CUDA, an endpoint's network volume, over `localpod.catalog`)."""


from __future__ import annotations

import random
import secrets
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from localpod.catalog import placement, tables
from localpod.catalog.cuda import CudaNeed
from localpod.catalog.placement import WorkerPlacement
from localpod.faults.rules import (
    ROUTE_ACTIONS,
    WORKER_ACTIONS,
    CpuStock,
    CpuStockChange,
    CudaChange,
    HostsCuda,
    RouteFault,
    RouteFaultRule,
    Stock,
    StockChange,
    VolumeTypes,
    VolumeTypesChange,
    WorkerFault,
    WorkerFaultRule,
)


@dataclass
class _RouteEntry:
    id: str
    rule: RouteFaultRule
    rng: random.Random
    hits: int = 0

    def view(self) -> RouteFault:
        remaining = None if self.rule.times is None else self.rule.times - self.hits
        return RouteFault(**self.rule.model_dump(), id=self.id, hits=self.hits, remaining=remaining)


@dataclass
class ArmedFault:
    """A worker fault reserved for one job; `WorkerSupervisor` fires it."""

    id: str
    rule: WorkerFaultRule
    remaining: int
    hits: int = 0
    removed: bool = False
    """Set when the rule is deleted: a job that had it armed runs on undisturbed."""

    def view(self) -> WorkerFault:
        return WorkerFault(**self.rule.model_dump(), id=self.id, hits=self.hits, remaining=self.remaining)


@dataclass
class FaultBook:
    """Every fault rule of one server, the stock of GPU pools per datacenter, where each worker was placed,
    and counts of what was injected."""

    route_rules: dict[str, _RouteEntry] = field(default_factory=dict)
    worker_rules: dict[str, ArmedFault] = field(default_factory=dict)
    out_of_stock: set[tuple[str, str]] = field(default_factory=set)
    """(pool, datacenter id) pairs taken out of stock."""
    placements: dict[str, WorkerPlacement] = field(default_factory=dict)
    """Worker id → where it was started (`place`); the account and the billing read it."""
    volume_data_centers: dict[str, str] = field(default_factory=dict)
    """Network volume id → its datacenter, kept by `volumes.VolumeBook`; `place` pins endpoints' workers there."""
    hosts: dict[str, dict[str, tuple[str, ...]]] = field(default_factory=tables.default_host_table)
    """GPU type id → datacenter offering it → the CUDA versions its hosts run there (`/_localpod/cuda`)."""
    cpu_out_of_stock: set[tuple[str, str]] = field(default_factory=set)
    """(CPU flavor id, datacenter id) pairs taken out of stock (`/_localpod/cpu-stock`)."""
    volume_types: dict[str, tuple[str, ...]] = field(default_factory=tables.default_volume_types)
    """Datacenter id → the network volume tiers it offers, primary first (`/_localpod/volume-types`)."""
    injected: Counter[str] = field(default_factory=Counter)

    # --- route faults ----------------------------------------------------------------------------

    def add_route_fault(self, rule: RouteFaultRule) -> RouteFault:
        entry = _RouteEntry(id=_new_rule_id(), rule=rule, rng=random.Random(rule.seed))
        self.route_rules[entry.id] = entry
        return entry.view()

    def route_faults(self) -> list[RouteFault]:
        return [e.view() for e in self.route_rules.values()]

    def remove_route_fault(self, fault_id: str) -> bool:
        return self.route_rules.pop(fault_id, None) is not None

    def clear_route_faults(self) -> None:
        self.route_rules.clear()

    def match_route(self, route: str, endpoint_name: str | None, data_center: str | None = None, *,
                    hangs: bool = True) -> RouteFaultRule | None:
        """The rule that applies to this request, counted as a hit; None: answer normally. `hangs=False`: a rule that
        holds the request does not apply (it already held it)."""
        for entry in self.route_rules.values():
            rule = entry.rule
            if not hangs and rule.action == "hang":
                continue
            if rule.route != route or not _prefix_matches(rule.endpoint_name_prefix, endpoint_name):
                continue
            if rule.data_center_id is not None and rule.data_center_id != data_center:
                continue
            if rule.times is not None and entry.hits >= rule.times:
                continue
            # One draw per matching request: with a seed, the same requests get the same faults.
            if rule.probability is not None and entry.rng.random() >= rule.probability:
                continue
            entry.hits += 1
            self.injected[rule.action] += 1
            return rule
        return None

    # --- worker faults ---------------------------------------------------------------------------

    def add_worker_fault(self, rule: WorkerFaultRule) -> WorkerFault:
        entry = ArmedFault(id=_new_rule_id(), rule=rule, remaining=rule.times)
        self.worker_rules[entry.id] = entry
        return entry.view()

    def worker_faults(self) -> list[WorkerFault]:
        return [e.view() for e in self.worker_rules.values()]

    def remove_worker_fault(self, fault_id: str) -> bool:
        entry = self.worker_rules.pop(fault_id, None)
        if entry is not None:
            entry.removed = True
        return entry is not None

    def clear_worker_faults(self) -> None:
        for fault_id in list(self.worker_rules):
            self.remove_worker_fault(fault_id)

    def arm_job_fault(self, endpoint_name: str) -> ArmedFault | None:
        """Reserve the first crash/hang/preempt fault that matches for a job a worker just took."""
        for entry in self.worker_rules.values():
            if entry.rule.action != "env" and entry.remaining > 0 and _prefix_matches(
                entry.rule.endpoint_name_prefix, endpoint_name
            ):
                entry.remaining -= 1
                return entry
        return None

    def disarm(self, armed: ArmedFault) -> None:
        """The job ended before its fault fired: the next matching job gets it instead."""
        armed.remaining += 1

    def fired(self, armed: ArmedFault) -> None:
        armed.hits += 1
        self.injected[f"worker_{armed.rule.action}"] += 1

    def spawn_env(self, endpoint_name: str) -> dict[str, str]:
        """Variables for a worker about to start: every matching env fault with workers left gives its own."""
        env: dict[str, str] = {}
        for entry in self.worker_rules.values():
            if entry.rule.action == "env" and entry.remaining > 0 and _prefix_matches(
                entry.rule.endpoint_name_prefix, endpoint_name
            ):
                entry.remaining -= 1
                self.fired(entry)
                env.update(entry.rule.env or {})
        return env

    # --- stock -----------------------------------------------------------------------------------

    def set_stock(self, change: StockChange) -> Stock:
        where = [change.data_center_id] if change.data_center_id else tables.DATA_CENTER_IDS
        pairs = {(change.pool, dc) for dc in where}
        if change.available:
            self.out_of_stock -= pairs
        else:
            self.out_of_stock |= pairs
        return self.stock()

    def stock(self) -> Stock:
        everywhere, by_dc = _stock_view(self.out_of_stock)
        return Stock(out_of_stock=everywhere, out_of_stock_by_data_center=by_dc)

    def in_stock(self, pool: str, data_center_id: str) -> bool:
        return (pool, data_center_id) not in self.out_of_stock

    # --- CPU stock -------------------------------------------------------------------------------

    def set_cpu_stock(self, change: CpuStockChange) -> CpuStock:
        flavors = [change.cpu_flavor] if change.cpu_flavor else tables.CPU_FLAVOR_IDS
        where = [change.data_center_id] if change.data_center_id else tables.DATA_CENTER_IDS
        pairs = {(flavor, dc) for flavor in flavors for dc in where}
        if change.available:
            self.cpu_out_of_stock -= pairs
        else:
            self.cpu_out_of_stock |= pairs
        return self.cpu_stock()

    def cpu_stock(self) -> CpuStock:
        everywhere, by_dc = _stock_view(self.cpu_out_of_stock)
        return CpuStock(out_of_stock=everywhere, out_of_stock_by_data_center=by_dc)

    def cpu_in_stock(self, flavor_id: str, data_center_id: str) -> bool:
        return (flavor_id, data_center_id) not in self.cpu_out_of_stock

    # --- network volume tiers --------------------------------------------------------------------

    def set_volume_types(self, change: VolumeTypesChange) -> VolumeTypes:
        self.volume_types[change.data_center_id] = tuple(change.types)
        return self.volume_types_view()

    def reset_volume_types(self) -> None:
        self.volume_types = tables.default_volume_types()

    def volume_types_view(self) -> VolumeTypes:
        return VolumeTypes(network_volume_types={dc: list(types) for dc, types in self.volume_types.items()})

    # --- hosts' CUDA versions -------------------------------------------------------------------

    def set_host_cuda(self, change: CudaChange) -> HostsCuda:
        for row in change.gpu_types():
            for dc_id in self.hosts[row.id]:
                if change.data_center_id in (None, dc_id):
                    self.hosts[row.id][dc_id] = tuple(change.versions)
        return self.hosts_cuda()

    def reset_host_cuda(self) -> None:
        self.hosts = tables.default_host_table()

    def hosts_cuda(self) -> HostsCuda:
        return HostsCuda(hosts={type_id: {dc: list(versions) for dc, versions in by_dc.items()}
                                for type_id, by_dc in self.hosts.items()})

    def host_cuda(self, gpu_type_id: str, data_center_id: str) -> tuple[str, ...]:
        """A `tables.HostCuda`: the versions in force now."""
        return self.hosts.get(gpu_type_id, {}).get(data_center_id, ())

    # --- placement -------------------------------------------------------------------------------

    def place(self, spec: dict[str, Any], *, ignore_cuda: bool = False) -> WorkerPlacement | None:
        """Where a worker of this endpoint would start now (`placement.place`); None: nowhere it allows has stock on
        hosts that meet its CUDA need. An endpoint attaches one network volume at most
        (`VolumeBook.check_endpoint`): its workers start in its datacenter; none start once that volume is
        deleted (`gone_volumes`)."""
        if self.gone_volumes(spec):
            return None
        return placement.place(spec, self.in_stock, self._pinned(spec), self.host_cuda, ignore_cuda=ignore_cuda,
                               cpu_in_stock=self.cpu_in_stock)

    def placeable(self, spec: dict[str, Any]) -> bool:
        """Can a worker of this endpoint start? Not when no datacenter it allows has stock of one of its pools
        on hosts that meet its CUDA need (a CPU endpoint: of one of its CPU flavors)."""
        return self.place(spec) is not None

    def unplaceable_reason(self, spec: dict[str, Any]) -> str | None:
        """Why no worker of this endpoint can start now, as the log says it; None when one can."""
        if self.placeable(spec):
            return None
        if gone := self.gone_volumes(spec):
            return (f"its network volume {', '.join(gone)} was deleted while the endpoint attached it: no worker can "
                    "mount it")
        pinned = self._pinned(spec)
        allowed = placement.allowed_data_centers(spec, pinned)
        where = ", ".join(allowed) or "no datacenter of localpod's catalog"
        if pinned is not None:
            where += f" (its network volume's datacenter is {pinned})"
        if not spec.get("gpu"):
            flavors = ", ".join(dict.fromkeys(c["id"] for c in spec.get("cpu") or ()))
            return f"no stock of CPU flavor {flavors} in {where}"
        gpu = spec.get("gpu") or {}
        pools = list(gpu.get("pools") or ())
        if self.place(spec, ignore_cuda=True) is None:
            return f"no stock of {', '.join(pools) or 'its GPUs'} in {where}"
        # Stock is not what stops it: name the types it could have and the datacenters that have them in stock.
        stocked = {dc: [g.id for p in pools if self.in_stock(p, dc) for g in placement.endpoint_gpu_types(gpu, p, dc)]
                   for dc in allowed}
        types = dict.fromkeys(type_id for type_ids in stocked.values() for type_id in type_ids)
        return (f"no host of {', '.join(types)} in {', '.join(dc for dc, ids in stocked.items() if ids)} runs "
                f"{CudaNeed.of(gpu).describe()}")

    def gone_volumes(self, spec: dict[str, Any]) -> list[str]:
        """The network volumes this endpoint attaches that no longer exist. RunPod lets a volume be deleted while an
        endpoint attaches it (its API documents no refusal); the endpoint still names it, and a worker that would
        mount it cannot start."""
        return [v for v in spec.get("networkVolumes") or () if v not in self.volume_data_centers]

    def _pinned(self, spec: dict[str, Any]) -> str | None:
        pins = self.volume_data_centers
        pinned = [pins[v] for v in spec.get("networkVolumes") or () if v in pins]
        return pinned[0] if pinned else None

    def counts(self) -> dict[str, int]:
        """Faults injected so far by kind, every kind listed (0 when none)."""
        kinds = [*ROUTE_ACTIONS, *(f"worker_{a}" for a in WORKER_ACTIONS)]
        return {kind: self.injected[kind] for kind in kinds}


def _stock_view(out_of_stock: set[tuple[str, str]]) -> tuple[list[str], dict[str, list[str]]]:
    """(what is out of stock in every datacenter, datacenter → what else is out there) of (pool or flavor,
    datacenter) pairs."""
    everywhere = sorted({item for item, _ in out_of_stock
                         if all((item, dc) in out_of_stock for dc in tables.DATA_CENTER_IDS)})
    by_dc: dict[str, list[str]] = {}
    for item, dc in sorted(out_of_stock):
        if item not in everywhere:
            by_dc.setdefault(dc, []).append(item)
    return everywhere, dict(sorted(by_dc.items()))


def _prefix_matches(prefix: str | None, name: str | None) -> bool:
    return prefix is None or (isinstance(name, str) and name.startswith(prefix))


def _new_rule_id() -> str:
    return f"fault-{secrets.token_hex(6)}"
