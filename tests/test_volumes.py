"""The weight cache's volumes: one per datacenter and control plane, created when missing, grown to fit,
never shrunk; listed with their monthly cost, and deleted when unused past the retention (never when attached,
never another control plane's unless named) — against localpod's `/v2/network-volumes`."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from tasks.runpod.errors import BadRequestError, QuotaExceededError
from tasks.runpod.models import CreateEndpoint, CreateNetworkVolume, Endpoint
from tasks.runpod.volumes import (
    attaching_endpoints,
    delete_unattached_volume,
    ensure_volume,
    find_volume,
    parse_volume_name,
    volume_exists,
    volume_name,
    volume_size_gb,
)
from tasks.placement.prices import documented_usd_per_month
from tasks.storage.volume_inventory import RetentionRequest, VolumeRow, apply, decide, inventory, totals
from tasks.placement.weight_cache import DataCenterCache, WarmModel, WarmVolumeGone, gone_volume
from tests.test_localpod import create_endpoint, endpoint_body
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


# --- inventory, cost and retention (tasks/storage/volume_inventory.py), against localpod in-process ---------------

NOW = datetime(2026, 11, 20, 12, 0, tzinfo=UTC)
OURS, THEIRS = "ours1", "them2"
LONG_AGO = NOW - timedelta(days=60)  # the Prefect server's oldest event: uses since then are all seen


def ours(runpod, data_center: str = VOLUME_DC, size: int = 20):  # noqa: F811
    return runpod.create_network_volume(CreateNetworkVolume(name=volume_name(data_center, OURS), size=size,
                                                            data_center=data_center))


def theirs(runpod, size: int = 40):  # noqa: F811
    return runpod.create_network_volume(CreateNetworkVolume(name=volume_name("US-CA-2", THEIRS), size=size,
                                                            data_center="US-CA-2"))


def record(volume, models=("acme/tiny",), warmed_at=LONG_AGO) -> DataCenterCache:
    return DataCenterCache(data_center=volume.data_center, volume_id=volume.id, volume_gb=volume.size,
                           models={m: WarmModel(revision="abc", size_bytes=1, warmed_at=warmed_at) for m in models})


def retention(runpod, *, records=(), uses=None, request=None, horizon=LONG_AGO):  # noqa: F811
    """The rows the volumes flow would act on, decided for `request` (default: 14 days, ours only)."""
    records = {r.data_center: r for r in records}
    rows = inventory(runpod.list_network_volumes(), runpod.list_endpoints(), records, uses or {}, None, OURS)
    return {row.volume_id: row for row in decide(rows, records, request or RetentionRequest(retain_days=14), OURS,
                                                  NOW, horizon)}


def test_volume_names_are_parsed_back_into_tag_and_datacenter():
    assert parse_volume_name(volume_name("EU-RO-1", "ab12")) == ("ab12", "eu-ro-1")
    assert parse_volume_name("loraflow-cache-toolongtag-eu-ro-1") is None and parse_volume_name("data") is None


def test_the_documented_price_is_7_cents_a_gb_month_and_5_above_a_terabyte():
    assert documented_usd_per_month(100) == 7.0
    assert documented_usd_per_month(2000) == 70.0 + 50.0
    assert documented_usd_per_month(100, "HIGH_PERFORMANCE") > documented_usd_per_month(100)


def test_every_loraflow_volume_is_listed_with_its_cost_models_and_endpoints(runpod, localpod):  # noqa: F811
    mine, foreign = ours(runpod), theirs(runpod)
    runpod.create_network_volume(CreateNetworkVolume(name="someone-elses-data", size=10, data_center=VOLUME_DC))
    attached = create_endpoint(localpod, name="loraflow-x", networkVolumes=[foreign.id])
    rows = retention(runpod, records=[record(mine)])
    assert set(rows) == {mine.id, foreign.id}  # a volume without loraflow's prefix is not ours to list
    assert rows[mine.id].models == ["acme/tiny"] and rows[mine.id].usd_per_month == 1.4
    assert rows[mine.id].cost_source == "documented price" and rows[mine.id].type == "STANDARD"
    assert rows[foreign.id].namespace == THEIRS and rows[foreign.id].models is None
    assert rows[foreign.id].attached_to == [attached["name"]]


def test_billed_figures_replace_the_documented_price_where_billing_has_them(runpod):  # noqa: F811
    volume = ours(runpod)
    day = NOW.replace(hour=0) - timedelta(days=1)
    billed = ({volume.id: 1.2 * 30}, {volume.id: day})
    [row] = inventory(runpod.list_network_volumes(), [], {}, {}, billed, OURS)
    assert (row.usd_per_month, row.cost_source) == (36.0, "billed")


def test_retention_deletes_an_unused_volume_and_its_record(runpod):  # noqa: F811
    volume = ours(runpod)
    row = retention(runpod, records=[record(volume)], uses={volume.id: NOW - timedelta(days=20)})[volume.id]
    assert row.action == "delete" and "not used within 14 days" in row.reason
    [done] = apply(runpod, [row.model_copy(update={"models": None})], RetentionRequest(retain_days=14), OURS)
    assert done.result == "deleted" and runpod.list_network_volumes() == []


def test_retention_keeps_a_volume_a_run_used_within_the_window(runpod):  # noqa: F811
    volume = ours(runpod)
    row = retention(runpod, records=[record(volume)], uses={volume.id: NOW - timedelta(days=2)})[volume.id]
    assert row.action == "keep" and "used within 14 days" in row.reason


def test_retention_keeps_a_volume_an_endpoint_attaches_however_old(runpod, localpod):  # noqa: F811
    volume = ours(runpod)
    create_endpoint(localpod, name="loraflow-live", networkVolumes=[volume.id])
    row = retention(runpod, uses={volume.id: NOW - timedelta(days=200)})[volume.id]
    assert row.action == "keep" and "attached to loraflow-live" in row.reason


def test_a_volume_attached_between_the_decision_and_the_delete_is_kept_and_reported_so(runpod, localpod):  # noqa: F811
    volume = ours(runpod)
    row = retention(runpod)[volume.id]
    assert row.action == "delete"
    # Another control plane's run attaches it after the inventory was read: the endpoints are listed again.
    create_endpoint(localpod, name="loraflow-them2-run-a1", networkVolumes=[volume.id])
    [done] = apply(runpod, [row], RetentionRequest(retain_days=14), OURS)
    assert (done.action, done.result, done.attached_to) == ("keep", "kept: attached", ["loraflow-them2-run-a1"])
    assert "attached to loraflow-them2-run-a1 when it was about to be deleted" in done.reason
    assert [v.id for v in runpod.list_network_volumes()] == [volume.id]
    assert "deleted 0" in totals([done])


def test_the_endpoints_attaching_a_volume_are_every_control_planes(runpod, localpod):  # noqa: F811
    volume = ours(runpod)
    for name in ("loraflow-ours1-run-a1", "loraflow-them2-run-a1", "someone-elses-endpoint"):
        create_endpoint(localpod, name=name, networkVolumes=[volume.id])
    create_endpoint(localpod, name="loraflow-ours1-other-a1")
    assert sorted(attaching_endpoints(runpod, volume.id)) == [
        "loraflow-ours1-run-a1", "loraflow-them2-run-a1", "someone-elses-endpoint"]


def test_a_volume_is_deleted_only_when_no_endpoint_references_it_right_before_the_delete(runpod, localpod):  # noqa: F811
    attached, free = ours(runpod), ours(runpod, data_center="EU-CZ-1")
    create_endpoint(localpod, name="loraflow-them2-run-a1", networkVolumes=[attached.id])
    assert delete_unattached_volume(runpod, attached.id) == ["loraflow-them2-run-a1"]
    assert delete_unattached_volume(runpod, free.id) == []
    assert delete_unattached_volume(runpod, free.id) == []  # already gone counts as deleted
    assert [v.id for v in runpod.list_network_volumes()] == [attached.id]


@pytest.mark.parametrize("reference", [{"networkVolumeId": "vol1"}, {"networkVolumeIds": ["vol1"]},
                                       {"networkVolumes": ["vol1"]}])
def test_an_endpoint_document_references_its_volume_under_any_of_runpods_names(reference):
    endpoint = Endpoint.model_validate({"id": "ep1", "name": "someone", "workers": {"min": 0, "max": 1},
                                        "createdAt": "2026-11-20T12:00:00Z", **reference})
    assert endpoint.network_volumes == ["vol1"]


def test_an_orphan_of_ours_never_seen_used_is_deleted(runpod):  # noqa: F811
    volume = ours(runpod)
    row = retention(runpod)[volume.id]
    assert row.action == "delete" and "orphan" in row.reason


def test_without_events_reaching_back_past_the_window_an_unseen_volume_is_kept(runpod):  # noqa: F811
    volume = ours(runpod)
    row = retention(runpod, horizon=NOW - timedelta(days=7))[volume.id]
    assert row.action == "keep" and "PREFECT_SERVER_EVENTS_RETENTION_PERIOD" in row.reason


def test_another_control_planes_volume_is_untouched_unless_its_tag_is_named(runpod):  # noqa: F811
    volume = theirs(runpod)
    assert retention(runpod)[volume.id].action == "keep"
    named = RetentionRequest(retain_days=14, delete_namespaces=[THEIRS])
    row = retention(runpod, request=named)[volume.id]
    assert row.action == "delete"
    [unconfirmed] = apply(runpod, [row], named, OURS)
    assert "needs confirm: true" in unconfirmed.result and "$2.80/month" in unconfirmed.result
    assert [v.id for v in runpod.list_network_volumes()] == [volume.id]
    [done] = apply(runpod, [row], named.model_copy(update={"confirm": True}), OURS)
    assert done.result == "deleted" and runpod.list_network_volumes() == []


def test_an_adopted_volume_is_renamed_to_ours(runpod):  # noqa: F811
    volume = theirs(runpod)
    request = RetentionRequest(retain_days=14, adopt_namespaces=[THEIRS], confirm=True)
    [done] = apply(runpod, [retention(runpod, request=request)[volume.id]], request, OURS)
    assert done.result == f"renamed {volume_name('US-CA-2', OURS)}"
    assert [v.name for v in runpod.list_network_volumes()] == [volume_name("US-CA-2", OURS)]


def test_a_dry_run_changes_nothing(runpod):  # noqa: F811
    volume = ours(runpod)
    request = RetentionRequest(retain_days=14, dry_run=True)
    [done] = apply(runpod, [retention(runpod, request=request)[volume.id]], request, OURS)
    assert done.result == "dry run: would delete" and len(runpod.list_network_volumes()) == 1


def test_naming_our_own_tag_for_deletion_is_refused(runpod):  # noqa: F811
    with pytest.raises(ValueError, match="this control plane's own tag"):
        retention(runpod, request=RetentionRequest(retain_days=14, delete_namespaces=[OURS]))


def test_the_total_line_says_what_the_deletions_save():
    row = VolumeRow(volume_id="v", name="n", data_center="EU-RO-1", namespace=OURS, ours=True, size_gb=20,
                    usd_per_month=1.4, cost_source="documented price", action="delete", result="deleted")
    assert "deleted 1, saving $1.40/month; left $0.00/month" in totals([row])


# --- a stale warm record never fails a run (tasks/placement/weight_cache.py) --------------------------------------------


def test_an_endpoint_refused_for_a_deleted_warm_volume_reads_as_the_volume_gone(runpod, localpod):  # noqa: F811
    volume = ours(runpod)
    runpod.delete_network_volume(volume.id)
    with pytest.raises(BadRequestError) as refused:
        runpod.create_endpoint(CreateEndpoint.model_validate(endpoint_body(networkVolumes=[volume.id], timeout=60_000)))
    gone = gone_volume(refused.value, [volume.id], lambda v: volume_exists(runpod, v))
    assert isinstance(gone, WarmVolumeGone) and gone.volume_id == volume.id


def test_a_refusal_while_the_volume_exists_stands_as_the_error(runpod):  # noqa: F811
    volume = ours(runpod)
    refusal = BadRequestError("RunPod answered 400: bad image", status=400)
    assert gone_volume(refusal, [volume.id], lambda v: volume_exists(runpod, v)) is None
    assert gone_volume(QuotaExceededError("quota", status=400), [volume.id], lambda v: False) is None


def test_a_runs_summary_shows_what_its_warm_volume_costs_by_the_month():
    from tasks.reports.summary import summary_markdown
    from tests.test_reports_and_cost import report

    warm = summary_markdown(report(warm_volume="v1 in EU-RO-1", storage_usd_per_month=1.4,
                                   storage_cost_source="documented price"))
    assert "| Weights | warm, from network volume v1 in EU-RO-1; its storage costs $1.40/month whether used or not " \
           "(documented price) |" in warm
    assert "| Weights | downloaded (cold start) |" in summary_markdown(report())


def test_one_volumes_monthly_cost_is_the_documented_price_without_billing_figures(runpod):  # noqa: F811
    from tasks.storage.volume_inventory import volume_monthly_cost

    volume = ours(runpod, size=30)
    assert volume_monthly_cost(runpod, volume.id, NOW) == (2.1, "documented price")
    assert volume_monthly_cost(runpod, "nosuchvol1", NOW) is None


def test_billed_figures_come_from_localpods_volume_billing_once_days_have_passed(runpod, localpod):  # noqa: F811
    from tasks.storage.volume_inventory import billed_figures
    from tests.test_localpod import AUTH

    volume = ours(runpod, size=100)
    clock = localpod.post("/_localpod/clock", json={"advance_days": 3}, headers=AUTH).json()
    now = datetime.fromisoformat(clock["now"].replace("Z", "+00:00"))
    monthly, since = billed_figures(runpod, now, days=5)
    assert monthly[volume.id] == pytest.approx(7.0, rel=0.01)  # a full billed day × 30: 100 GB at $0.07
    assert since[volume.id] <= now - timedelta(days=2)


def test_a_placement_given_the_records_read_during_the_check_reads_none_again(monkeypatch):
    from tasks.placement import weight_cache

    def read_again(*args, **kwargs):
        raise AssertionError("the records were read again")

    monkeypatch.setattr(weight_cache, "read_all_caches", read_again)
    warm = DataCenterCache(data_center="EU-RO-1", volume_id="vol1", volume_gb=50,
                           models={"acme/tiny": WarmModel(revision="abc", size_bytes=1, warmed_at=LONG_AGO)})
    cold = warm.model_copy(update={"data_center": "US-CA-2", "volume_id": "vol2", "models": {}})
    records = {"US-CA-2": cold, "EU-RO-1": warm}
    assert weight_cache.warm_cache_for("acme/tiny", "abc", ["US-CA-2", "EU-RO-1"], records=records) == warm
    assert weight_cache.warm_cache_for("acme/tiny", "def", ["US-CA-2", "EU-RO-1"], records=records) is None
