"""The preload sweep's plan: which datacenters (named, or where training ran, capped), on what (the cheapest
CPU flavor in stock, a GPU where none is), into which volume (used, grown, or replaced when a smaller one
will do), within the storage budget, skipping datacenters that offer only high-performance storage.

`plan_sweep` is pure; the catalog it plans from is read from an in-process localpod through the real client,
so the documents are the ones RunPod's schema describes. A sweep is held to a team server's rules as a run is: the
operator's cap on its workers' cost, and a Hub token of its own."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from flows.preload import (
    PreloadSpec,
    SweepPlan,
    SweepTarget,
    check_preload_rules,
    check_sweep_cap,
    plan_sweep,
    sweep_cost_ceiling,
    sweep_table,
)
from tasks.placement.history import placed_worker
from tasks.runpod.catalog import GPU_CLASSES, resolve_gpu
from tasks.runpod.client import RunpodClient
from tasks.runpod.endpoints import build_create_request
from tasks.runpod.live_catalog import (
    CatalogCpuType,
    CatalogDataCenter,
    GpuOffer,
    clear_catalog_cache,
    gpu_offers,
    read_cpu_types,
    read_data_centers,
)
from tasks.runpod.models import CreateNetworkVolume, NetworkVolume
from tasks.jobs.preload import Compute, VolumePlan, choose_compute, cpu_worker_vcpus, plan_volume, preload_request
from tasks.preflight.server_rules import ServerRuleError
from tasks.settings import Settings
from tests.test_live_catalog import client_for, localpod  # noqa: F401  (a fixture)
from tests.test_localpod import AUTH, wait_for

MODEL = [{"id": "acme/tiny"}]
GB = 20  # the volume the models need: $1.40 a month at RunPod's standard $0.07/GB-month


@pytest.fixture
def runpod(localpod: TestClient) -> RunpodClient:
    clear_catalog_cache()
    yield client_for(localpod)
    clear_catalog_cache()


Catalog = tuple[list[CatalogDataCenter], list[GpuOffer], list[CatalogCpuType]]


def read_catalog(runpod: RunpodClient) -> Catalog:
    clear_catalog_cache()
    return (read_data_centers(runpod, cpus=True), gpu_offers(runpod, list(GPU_CLASSES.values())),
            read_cpu_types(runpod))


@pytest.fixture
def catalog(runpod: RunpodClient) -> Catalog:
    return read_catalog(runpod)


def plan(catalog: Catalog, *, recent: list[str] = (), volumes: list[NetworkVolume] = (), recorded=None,
         volume_gb: int = GB, **spec) -> SweepPlan:
    data_centers, offers, cpu_types = catalog
    return plan_sweep(PreloadSpec(models=MODEL, **spec), data_centers, offers, cpu_types, recent=list(recent),
                      volumes=list(volumes), volume_gb=volume_gb, recorded=recorded or {})


def volume(data_center: str, size: int, volume_id: str | None = None, type: str = "STANDARD") -> NetworkVolume:
    return NetworkVolume(id=volume_id or f"vol-{data_center.lower()}-{size}", name=f"loraflow-cache-t1-{data_center.lower()}",
                         size=size, data_center=data_center, type=type)


def skipped(result: SweepPlan) -> dict[str, tuple[str, str]]:
    return {o.data_center: (o.status, o.error or "") for o in result.skipped}


# --- where ---------------------------------------------------------------------------------------


def test_with_no_datacenters_named_the_sweep_warms_where_training_ran_most_recent_first_capped(catalog):
    result = plan(catalog, recent=["US-CA-2", "EU-RO-1", "US-KS-2", "EU-CZ-1"])
    assert [t.data_center for t in result.targets] == ["US-CA-2", "EU-RO-1", "US-KS-2"]
    assert "training ran in the last 14 days (at most 3)" in result.chosen_by


def test_a_datacenter_where_training_ran_without_network_volumes_does_not_take_a_default_place(catalog):
    result = plan(catalog, recent=["US-TX-3", "EU-RO-1"], max_default_data_centers=1)
    assert [t.data_center for t in result.targets] == ["EU-RO-1"] and not result.skipped


def test_with_no_training_history_and_none_named_the_sweep_does_nothing_and_says_how_to_name_datacenters(catalog):
    result = plan(catalog, recent=[])
    assert result.targets == [] and result.skipped == []
    assert "no training run of this control plane was placed" in result.nothing_to_do
    assert "spec's data_centers (for the nightly deployment, in prefect.yaml)" in result.nothing_to_do


def test_with_nothing_to_do_the_table_says_how_to_name_datacenters_and_what_storage_costs_now(catalog):
    kept = volume("US-KS-2", 100)
    result = plan(catalog, recent=[], volumes=[kept])
    [total] = sweep_table([], {}, result, [kept], budget=20.0)
    assert (total["datacenter"], total["storage $/month"]) == ("total", "7.00")
    assert "1 other volume(s) of this control plane $7.00" in total["note"]
    assert total["note"].endswith(result.nothing_to_do)


def test_named_datacenters_are_warmed_whatever_the_training_history(catalog):
    result = plan(catalog, recent=["US-CA-2"], data_centers=["EU-RO-1", "US-KS-2", "EU-CZ-1", "US-TX-3"])
    assert [t.data_center for t in result.targets] == ["EU-RO-1", "US-KS-2", "EU-CZ-1"]
    assert skipped(result)["US-TX-3"][0] == "error" and "has no network volumes" in skipped(result)["US-TX-3"][1]


# --- budget --------------------------------------------------------------------------------------


def test_a_datacenter_whose_volume_would_pass_the_budget_is_skipped_with_the_figures(catalog):
    result = plan(catalog, data_centers=["EU-RO-1", "US-CA-2"], max_storage_usd_per_month=2.0)
    assert [t.data_center for t in result.targets] == ["EU-RO-1"] and result.targets[0].usd_per_month == 1.40
    status, error = skipped(result)["US-CA-2"]
    assert status == "skipped"
    assert error == ("over the storage budget: a 20 GB volume here ($1.40/month) would bring this control plane's "
                     "volumes to $2.80/month, over max_storage_usd_per_month $2.00")
    assert result.storage_usd_per_month == 1.40


def test_volumes_of_this_control_plane_outside_the_sweep_count_against_the_budget(catalog):
    kept = volume("US-KS-2", 100)  # $7.00 a month, kept until the volumes flow's retention
    result = plan(catalog, data_centers=["EU-RO-1"], volumes=[kept], max_storage_usd_per_month=8.0)
    assert result.targets == [] and "would bring this control plane's volumes to $8.40/month" in skipped(result)["EU-RO-1"][1]


def test_replacing_an_oversized_volume_counts_at_the_new_size(catalog):
    old = volume("EU-RO-1", 100)
    result = plan(catalog, data_centers=["EU-RO-1"], volumes=[old], max_storage_usd_per_month=2.0)
    [target] = result.targets
    assert (target.volume.action, target.volume.size_gb, target.volume.retire) == ("create", GB, [old])
    assert result.storage_usd_per_month == 1.40


# --- storage tier --------------------------------------------------------------------------------


def test_a_datacenter_that_offers_only_high_performance_storage_is_skipped(localpod, runpod):
    localpod.post("/_localpod/volume-types", json={"data_center_id": "EU-RO-1", "types": ["HIGH_PERFORMANCE"]},
                  headers=AUTH).raise_for_status()
    result = plan(read_catalog(runpod), data_centers=["EU-RO-1", "US-CA-2"])
    assert [t.data_center for t in result.targets] == ["US-CA-2"]
    assert skipped(result)["EU-RO-1"] == ("skipped", "offers only HIGH_PERFORMANCE storage (a 20 GB volume: "
                                                      "$2.80/month); loraflow's volumes are STANDARD")


def test_a_volume_is_created_on_standard_storage_where_high_performance_is_the_default(localpod, runpod):
    localpod.post("/_localpod/volume-types", json={"data_center_id": "EU-RO-1",
                                                   "types": ["HIGH_PERFORMANCE", "STANDARD"]},
                  headers=AUTH).raise_for_status()
    created = runpod.create_network_volume(CreateNetworkVolume(name="loraflow-cache-t1-eu-ro-1", size=GB,
                                                               data_center="EU-RO-1", type="STANDARD"))
    assert created.type == "STANDARD"
    assert [v.type for v in runpod.list_network_volumes() if v.id == created.id] == ["STANDARD"]


# --- compute -------------------------------------------------------------------------------------


def test_the_preload_runs_on_the_cheapest_cpu_flavor_in_stock_in_the_datacenter(catalog):
    data_centers, offers, cpu_types = catalog
    ro = next(dc for dc in data_centers if dc.id == "EU-RO-1")
    compute = choose_compute(ro, cpu_types, offers)
    cheapest = min((c for c in cpu_types if c.id in {a.id for a in ro.cpu_availability}),
                   key=lambda c: c.price.serverless_per_vcpu * cpu_worker_vcpus(c))
    assert (compute.kind, compute.name, compute.vcpu_count) == ("cpu", cheapest.id, cpu_worker_vcpus(cheapest))
    assert compute.describe() == f"CPU {cheapest.id} × {compute.vcpu_count} vCPU"


def test_a_datacenter_that_offers_no_cpu_flavor_preloads_on_its_cheapest_gpu(catalog):
    data_centers, offers, cpu_types = catalog
    cz = next(dc for dc in data_centers if dc.id == "EU-CZ-1")
    assert cz.cpu_availability == []
    compute = choose_compute(cz, cpu_types, offers)
    in_stock = [o for o in offers if "EU-CZ-1" in o.in_stock_data_centers()]
    assert (compute.kind, compute.name) == ("gpu", min(in_stock, key=lambda o: (o.usd_per_hour, o.gpu)).gpu)
    assert compute.exclude == next(o for o in offers if o.gpu == compute.name).exclude  # pinned as the catalog says


def test_a_gpu_preload_endpoint_pins_its_card_as_runpods_catalog_lists_its_pool(catalog, runpod):
    _, offers, _ = catalog
    a100 = next(o for o in offers if o.gpu == "A100 SXM")
    compute = Compute(kind="gpu", name="A100 SXM", usd_per_hour=a100.usd_per_hour, exclude=a100.exclude)
    vol = runpod.create_network_volume(CreateNetworkVolume(name="loraflow-cache-t1-us-ks-2", size=GB,
                                                           data_center="US-KS-2", type="STANDARD"))
    request = preload_request(name="loraflow-preload-us-ks-2-0123456789ab-t1-a1", compute=compute,
                              image="loraflow-worker:local-contract4", env={}, execution_timeout_s=600,
                              data_center="US-KS-2", volume_id=vol.id)
    assert request.to_wire()["gpu"]["excludedTypes"] == ["NVIDIA A100 80GB PCIe"]
    assert runpod.create_endpoint(request).network_volumes == [vol.id]  # localpod takes the selection


def test_with_the_cpu_flavors_out_of_stock_the_preload_falls_back_to_a_gpu(localpod, runpod):
    localpod.post("/_localpod/cpu-stock", json={"available": False, "data_center_id": "EU-RO-1"},
                  headers=AUTH).raise_for_status()
    result = plan(read_catalog(runpod), data_centers=["EU-RO-1", "US-CA-2"])
    assert {t.data_center: t.compute.kind for t in result.targets} == {"EU-RO-1": "gpu", "US-CA-2": "cpu"}


def test_cpu_false_preloads_on_a_gpu_everywhere(catalog):
    result = plan(catalog, data_centers=["EU-RO-1", "US-CA-2"], cpu=False)
    assert {t.compute.kind for t in result.targets} == {"gpu"}


def test_a_cpu_worker_gets_the_fewest_vcpus_that_give_it_enough_memory(catalog):
    _, _, cpu_types = catalog
    flavor = cpu_types[0]
    assert cpu_worker_vcpus(flavor.model_copy(update={"ram_gb_per_vcpu": 2.0})) == 2
    assert cpu_worker_vcpus(flavor.model_copy(update={"ram_gb_per_vcpu": 1.0})) == 4
    assert cpu_worker_vcpus(flavor.model_copy(update={"vcpu": flavor.vcpu.model_copy(update={"min": 3})})) == 4
    assert cpu_worker_vcpus(flavor.model_copy(update={"vcpu": flavor.vcpu.model_copy(update={"max": 1})})) is None


def test_a_cpu_preload_endpoint_with_the_volume_is_accepted_as_runpods_schema_describes_it(runpod):
    vol = runpod.create_network_volume(CreateNetworkVolume(name="loraflow-cache-t1-eu-ro-1", size=GB,
                                                           data_center="EU-RO-1", type="STANDARD"))
    request = preload_request(name="loraflow-preload-eu-ro-1-0123456789ab-t1-a1",
                              compute=Compute(kind="cpu", name="cpu3c", vcpu_count=2, usd_per_hour=0.06),
                              image="loraflow-worker:local-contract4", env={}, execution_timeout_s=600,
                              data_center="EU-RO-1", volume_id=vol.id)
    assert request.gpu is None and request.to_wire()["cpu"] == [{"id": "cpu3c", "vcpuCount": 2}]
    endpoint = runpod.create_endpoint(request)
    assert endpoint.network_volumes == [vol.id]


# --- volumes -------------------------------------------------------------------------------------


def test_a_volume_that_fits_is_used_the_recorded_one_first():
    a, b = volume("EU-RO-1", 20, "vol-a"), volume("EU-RO-1", 30, "vol-b")
    result = plan_volume([a, b], GB, recorded_id="vol-b")
    assert (result.action, result.volume, result.retire) == ("use", b, [a])


def test_a_volume_too_small_is_grown():
    small = volume("EU-RO-1", 10)
    result = plan_volume([small], GB, recorded_id=small.id)
    assert (result.action, result.volume, result.size_gb, result.retire) == ("grow", small, GB, [])


def test_a_volume_larger_than_needed_by_more_than_a_step_is_replaced_by_a_right_sized_one():
    large = volume("EU-RO-1", 100)
    result = plan_volume([large], GB, recorded_id=large.id)
    assert (result.action, result.volume, result.size_gb, result.retire) == ("create", None, GB, [large])


def test_a_high_performance_volume_is_replaced_by_a_standard_one():
    fast = volume("EU-RO-1", GB, type="HIGH_PERFORMANCE")
    result = plan_volume([fast], GB, recorded_id=fast.id)
    assert (result.action, result.volume_type, result.retire) == ("create", "STANDARD", [fast])


# --- placement history ---------------------------------------------------------------------------


def test_a_placement_names_the_datacenter_runpod_placed_the_worker_in(localpod, runpod):
    endpoint = runpod.create_endpoint(build_create_request(
        name="loraflow-run-0123456789ab-t1-a1", gpu=resolve_gpu("4090"), gpu_count=1, image="x", env={}, disk_gb=20,
        execution_timeout_s=600, cuda_floor=None, data_center_ids=["EU-RO-1"]))
    localpod.post(f"/v2/{endpoint.id}/run", json={"input": {}}, headers=AUTH).raise_for_status()
    worker = wait_for(lambda: placed_worker(runpod.list_endpoint_workers(endpoint.id), None), "the worker's placement")
    assert worker.data_center_id == "EU-RO-1"


# --- a team server's rules -----------------------------------------------------------------------------------------


def h200_sweep(data_centers: list[str]) -> SweepPlan:
    h200 = resolve_gpu("H200")
    return SweepPlan(targets=[SweepTarget(data_center=dc, compute=Compute(kind="gpu", name=h200.name,
                                                                          usd_per_hour=h200.usd_per_hour),
                                          volume=VolumePlan(action="create", size_gb=GB), usd_per_month=1.40)
                              for dc in data_centers], skipped=[], chosen_by="named in the spec",
                     storage_usd_per_month=7.0)


def test_a_day_on_h200s_in_five_datacenters_is_refused_by_the_operators_cap_naming_the_figures():
    data_centers = ["EU-RO-1", "US-CA-2", "US-KS-2", "EU-CZ-1", "EU-SE-1"]
    spec = PreloadSpec(models=MODEL, data_centers=data_centers, cpu=False, gpu="H200", minutes_per_data_center=1440)
    sweep = h200_sweep(data_centers)
    price = resolve_gpu("H200").usd_per_hour
    assert sweep_cost_ceiling(sweep, 1440) == round(5 * price * 24, 2)
    with pytest.raises(ValueError) as refused:
        check_sweep_cap(sweep, spec, cap_usd=50)
    message = str(refused.value)
    assert message.startswith(f"the preload sweep (EU-RO-1 on GPU {resolve_gpu('H200').name} at ${price:.2f}/hr, ")
    assert f"minutes_per_data_center 1440 each) may cost up to ${5 * price * 24:.2f}, above this server's cap of " \
           "$50.00 per run (LORAFLOW_MAX_RUN_USD, set by its operator): lower minutes_per_data_center" in message
    check_sweep_cap(sweep, spec, cap_usd=None)  # no cap set


def test_a_sweep_on_cpu_workers_within_the_cap_passes(catalog):
    result = plan(catalog, data_centers=["EU-RO-1", "US-CA-2"])
    assert {t.compute.kind for t in result.targets} == {"cpu"}
    check_sweep_cap(result, PreloadSpec(models=MODEL), cap_usd=5)


def test_a_sweep_on_the_control_planes_token_is_refused_where_a_token_of_ones_own_is_required():
    with pytest.raises(ServerRuleError) as refused:
        check_preload_rules(PreloadSpec(models=MODEL), Settings(loraflow_require_run_token=True))
    assert "the preload sweep is refused by this server's rules, before anything was rented: hub_token_secret is " \
           "empty" in str(refused.value) and "LORAFLOW_REQUIRE_RUN_TOKEN=1" in str(refused.value)
    check_preload_rules(PreloadSpec(models=MODEL, hub_token_secret="ops-preload-token"),
                        Settings(loraflow_require_run_token=True))


@pytest.mark.parametrize("block", ["hf-token", "runpod-api-key", "loraflow-secret-key-t1"])
def test_a_sweep_naming_one_of_the_servers_own_blocks_as_its_token_is_refused_naming_the_field(block):
    with pytest.raises(ServerRuleError, match=f"hub_token_secret: the Prefect Secret block '{block}' is this server's "
                                              "own"):
        check_preload_rules(PreloadSpec(models=MODEL, hub_token_secret=block), Settings())
