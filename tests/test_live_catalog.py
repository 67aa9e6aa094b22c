"""The control plane prices and places GPUs from RunPod's live catalog, read from localpod through the real
client, and falls back to the static table, saying so, when the catalog cannot be read; the cost ceiling,
the budget check and the report name the price source they used."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from loraflow_worker.contract import TrainMetrics

from localpod import LocalpodConfig, create_app
from localpod.catalog.tables import POOL_SERVERLESS_USD_PER_HOUR
from localpod.models import Account
from tasks.placement.cost import check_budget, cost_ceiling
from tasks.reports.summary import RunReport, summary_markdown
from tasks.runpod.catalog import resolve_gpu
from tasks.runpod.client import RunpodClient
from tasks.runpod import live_catalog as catalog_module
from tasks.runpod.live_catalog import (
    READ_TRIES,
    LiveCatalog,
    billed_usd,
    clear_catalog_cache,
    gpu_offers,
    live_catalog,
    read_data_centers,
)
from tests.test_localpod import API_KEY, AUTH, endpoint_body, wait_for

RTX_4090, H100, B200 = resolve_gpu("4090"), resolve_gpu("h100"), resolve_gpu("b200")
A100_SXM = resolve_gpu("a100 sxm")
LIVE_4090 = POOL_SERVERLESS_USD_PER_HOUR["ADA_24"]
LIVE_H100 = POOL_SERVERLESS_USD_PER_HOUR["ADA_80_PRO"]


@pytest.fixture
def localpod(tmp_path: Path) -> Iterator[TestClient]:
    config = LocalpodConfig(api_key=API_KEY, worker_quota=10, log_dir=tmp_path / "logs", long_poll_s=0.2,
                            kill_grace_s=1, worker_command=[sys.executable, "-c", "import time; time.sleep(300)"])
    with TestClient(create_app(config)) as c:
        yield c


def client_for(localpod: TestClient, api_url: str = "http://localpod/v2") -> RunpodClient:
    """loraflow's client, talking to the in-process localpod (query strings included)."""

    def forward(request: httpx.Request) -> httpx.Response:
        answer = localpod.request(request.method, request.url.raw_path.decode(), content=request.content,
                                  headers=request.headers)
        return httpx.Response(answer.status_code, headers=answer.headers, content=answer.content)

    return RunpodClient(API_KEY, api_url=api_url, transport=httpx.MockTransport(forward))


@pytest.fixture
def runpod(localpod: TestClient) -> RunpodClient:
    return client_for(localpod)


@pytest.fixture(autouse=True)
def fresh_cache() -> Iterator[None]:
    clear_catalog_cache()
    yield
    clear_catalog_cache()


@pytest.fixture(autouse=True)
def quick_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """Retries after a 5xx wait a hundredth of a second here (a 429's Retry-After is still honoured as sent)."""
    monkeypatch.setattr(catalog_module, "READ_FIRST_BACKOFF_S", 0.01)


def fault(localpod: TestClient, route: str, **rule: object) -> None:
    localpod.post("/_localpod/faults", json={"route": route, "action": "status_500", **rule}).raise_for_status()


def unreadable(localpod: TestClient, route: str) -> None:
    """`route` fails every try of one read."""
    fault(localpod, route, times=READ_TRIES)


# --- prices, CUDA versions and stock from the catalog ------------------------------------------------


def test_the_price_is_the_catalogs_serverless_price_when_it_answers(runpod: RunpodClient) -> None:
    [offer] = gpu_offers(runpod, [RTX_4090])
    assert (offer.usd_per_hour, offer.source, offer.fallback_reason) == (LIVE_4090, "catalog", None)
    assert offer.usd_per_hour != RTX_4090.usd_per_hour  # localpod's prices differ from the static table's


def test_an_offer_carries_the_cuda_versions_and_stock_of_the_classes_own_gpu_types(runpod: RunpodClient) -> None:
    [rtx, h100] = gpu_offers(runpod, [RTX_4090, H100])
    assert "12.8" in rtx.cuda_versions and rtx.cuda_versions == sorted(rtx.cuda_versions)
    assert "US-KS-2" not in rtx.data_centers  # no RTX 4090 there
    # H100 is the SXM card: datacenters with only the PCIe and NVL cards of its pool do not count.
    assert set(h100.in_stock_data_centers()) == {"US-KS-2", "EU-RO-1", "US-TX-3"}


def test_stock_taken_out_in_one_datacenter_shows_in_the_offer(localpod: TestClient, runpod: RunpodClient) -> None:
    localpod.post("/_localpod/stock", json={"pool": "ADA_24", "available": False, "data_center_id": "EU-RO-1"})
    [offer] = gpu_offers(runpod, [RTX_4090])
    assert offer.data_centers["EU-RO-1"] == "NONE" and "EU-RO-1" not in offer.in_stock_data_centers()
    assert offer.in_stock_data_centers()[0] in ("US-CA-2", "US-TX-3")  # HIGH before EU-CZ-1's MEDIUM


def test_the_datacenters_say_which_take_network_volumes(runpod: RunpodClient) -> None:
    volumes = {dc.id: dc.supports_network_volumes for dc in read_data_centers(runpod)}
    assert volumes == {"US-KS-2": True, "US-CA-2": True, "EU-RO-1": True, "EU-CZ-1": True, "US-TX-3": False}


# --- the cards of each pool, from the catalog ----------------------------------------------------------


def test_a_class_excludes_the_other_cards_the_catalog_lists_in_its_pool(runpod: RunpodClient) -> None:
    [a100, h100] = gpu_offers(runpod, [A100_SXM, H100])
    assert (a100.exclude, a100.cards_from, a100.not_in_pool) == (["NVIDIA A100 80GB PCIe"], "catalog", None)
    assert h100.exclude == []  # localpod's ADA_80_PRO holds the SXM card alone, as RunPod's SDK maps it
    assert h100.pinned(H100).exclude == () and a100.pinned(A100_SXM).exclude == ("NVIDIA A100 80GB PCIe",)


def test_a_card_the_catalog_lists_in_the_pool_is_excluded_though_the_static_table_does_not_know_it(runpod) -> None:
    read = live_catalog(runpod)
    nvl = next(t for t in read.gpu_types if t.id == "NVIDIA H100 NVL")
    grown = LiveCatalog(gpu_types=[*read.gpu_types, nvl.model_copy(update={"pool": "ADA_80_PRO"})], read_at=0)
    offer = grown.offer(H100)
    assert offer.exclude == ["NVIDIA H100 NVL"] and offer.source == "catalog"


def test_a_class_whose_card_is_not_in_its_pool_is_marked_naming_the_class_and_the_pool(runpod) -> None:
    read = live_catalog(runpod)
    moved = LiveCatalog(read_at=0, gpu_types=[t.model_copy(update={"pool": "HOPPER_80"}) if t.id == H100.card else t
                                              for t in read.gpu_types])
    offer = moved.offer(H100)
    assert offer.not_in_pool is not None
    assert "GPU class H100" in offer.not_in_pool and "pool ADA_80_PRO" in offer.not_in_pool
    assert "pool HOPPER_80" in offer.not_in_pool  # where the catalog lists the card instead
    assert moved.offer(RTX_4090).not_in_pool is None


def test_without_the_catalog_the_static_table_pins_the_class(localpod, runpod) -> None:
    unreadable(localpod, "list_gpu_types")
    [offer] = gpu_offers(runpod, [A100_SXM])
    assert (offer.exclude, offer.cards_from) == (["NVIDIA A100 80GB PCIe"], "static table")


# --- reads retried on 429 and 5xx -----------------------------------------------------------------------


def test_a_catalog_rate_limited_once_is_read_again_after_its_retry_after(localpod, runpod) -> None:
    fault(localpod, "list_gpu_types", action="status_429", retry_after_s=1)
    started = time.monotonic()
    [offer] = gpu_offers(runpod, [RTX_4090])
    assert (offer.source, offer.usd_per_hour) == ("catalog", LIVE_4090)
    assert time.monotonic() - started >= 1.0


def test_a_catalog_failing_with_500_on_all_but_its_last_try_gives_the_catalogs_prices(localpod, runpod) -> None:
    fault(localpod, "list_gpu_types", times=READ_TRIES - 1)
    [offer] = gpu_offers(runpod, [RTX_4090])
    assert offer.source == "catalog"


def test_a_retry_after_past_the_wait_budget_is_not_waited_for(localpod, runpod) -> None:
    fault(localpod, "list_gpu_types", action="status_429", retry_after_s=3600)
    started = time.monotonic()
    [offer] = gpu_offers(runpod, [RTX_4090])
    assert offer.source == "static list price" and "RateLimitError" in offer.fallback_reason
    assert time.monotonic() - started < 5


def test_the_datacenters_and_billing_are_read_again_after_a_429(localpod, runpod) -> None:
    fault(localpod, "list_data_centers", action="status_429", retry_after_s=0)
    assert read_data_centers(runpod)
    fault(localpod, "serverless_billing", action="status_429", retry_after_s=0)
    assert billed_usd(runpod, ["someendpoint01"], datetime.now(UTC)) is not None


# --- falling back to the static table ----------------------------------------------------------------


def test_a_catalog_answering_500_falls_back_to_the_static_price_and_says_why(localpod, runpod) -> None:
    unreadable(localpod, "list_gpu_types")
    [offer] = gpu_offers(runpod, [RTX_4090])
    assert (offer.usd_per_hour, offer.source) == (RTX_4090.usd_per_hour, "static list price")
    assert "ServerError" in offer.fallback_reason and "500" in offer.fallback_reason
    assert offer.data_centers == {} and offer.cuda_versions == []


def test_an_api_without_the_catalog_404s_and_the_static_price_stands_in(localpod: TestClient) -> None:
    retired = client_for(localpod, api_url="http://localpod/v1")  # localpod serves no /v1/catalog/gpus
    [offer] = gpu_offers(retired, [RTX_4090])
    assert (offer.usd_per_hour, offer.source) == (RTX_4090.usd_per_hour, "static list price")
    assert "NotFoundError" in offer.fallback_reason


def test_a_catalog_of_another_shape_falls_back(localpod: TestClient) -> None:
    odd = RunpodClient(API_KEY, api_url="http://odd/v2", transport=httpx.MockTransport(
        lambda request: httpx.Response(200, json={"gpus": [{"id": "NVIDIA GeForce RTX 4090"}]})))
    [offer] = gpu_offers(odd, [RTX_4090])
    assert offer.source == "static list price" and "ValidationError" in offer.fallback_reason


def test_a_class_whose_pool_has_no_serverless_price_falls_back_alone(runpod: RunpodClient) -> None:
    read = live_catalog(runpod)
    assert read.gpu_types is not None
    without_b200 = LiveCatalog(gpu_types=[t for t in read.gpu_types if t.pool != "BLACKWELL_180"], read_at=0)
    assert without_b200.offer(RTX_4090).source == "catalog"
    b200 = without_b200.offer(B200)
    assert (b200.source, b200.usd_per_hour) == ("static list price", B200.usd_per_hour)
    assert "BLACKWELL_180" in b200.fallback_reason


# --- the per-process cache ---------------------------------------------------------------------------


def test_a_read_serves_until_it_is_older_than_the_max_age(localpod: TestClient, runpod: RunpodClient) -> None:
    first = live_catalog(runpod)
    localpod.post("/_localpod/stock", json={"pool": "ADA_24", "available": False})
    assert live_catalog(runpod) is first
    assert live_catalog(runpod, max_age_s=0) is not first
    assert live_catalog(runpod).offer(RTX_4090).in_stock_data_centers() == []


def test_a_failed_read_is_not_kept(localpod: TestClient, runpod: RunpodClient) -> None:
    unreadable(localpod, "list_gpu_types")
    assert live_catalog(runpod).gpu_types is None
    assert live_catalog(runpod).gpu_types is not None


# --- cost ceiling, budget and report -----------------------------------------------------------------


def test_the_ceiling_takes_the_dearest_live_price_and_names_its_source(runpod: RunpodClient) -> None:
    ceiling = cost_ceiling(gpu_offers(runpod, [RTX_4090, H100]), gpu_count=1, deadline_minutes=60)
    assert (ceiling.usd, ceiling.gpu, ceiling.price_source) == (round(LIVE_H100, 2), "H100", "catalog")
    assert "price source: catalog" in ceiling.describe()


def test_the_budget_check_names_the_catalog_as_the_price_source(runpod: RunpodClient) -> None:
    ceiling = cost_ceiling(gpu_offers(runpod, [H100]), gpu_count=1, deadline_minutes=60)
    with pytest.raises(ValueError, match="price source: catalog"):
        check_budget(ceiling.usd, 3.5, ceiling.price_source)
    check_budget(ceiling.usd, 5.0, ceiling.price_source)


def test_the_budget_check_says_plainly_when_the_fallback_list_price_stood_in(localpod, runpod) -> None:
    unreadable(localpod, "list_gpu_types")
    ceiling = cost_ceiling(gpu_offers(runpod, [H100]), gpu_count=1, deadline_minutes=60)
    assert ceiling.usd == H100.usd_per_hour  # 4.18: over a budget of $4.00 that the live price (3.97) is within
    assert "price source: fallback list price, not the live catalog" in ceiling.describe()
    with pytest.raises(ValueError, match="price source: fallback list price, not the live catalog"):
        check_budget(ceiling.usd, 4.0, ceiling.price_source)


def report(**cost: object) -> RunReport:
    metrics = TrainMetrics(steps=1, losses=[(1, 2.0)], first_loss=2.0, final_loss=2.0, tokens=10, wall_seconds=1.0,
                           device="cpu")
    return RunReport(run_name="demo", run_id="r1", model="tiny", model_revision=None, gpu="RTX 4090", gpu_count=1,
                     endpoint_name="loraflow-demo-a1", metrics=metrics, cost_ceiling_usd=1.12,
                     estimated_cost_usd=0.0031, adapter_url="file:///a/adapter", store_url="file:///a", **cost)


def test_the_report_names_the_price_and_its_source() -> None:
    text = summary_markdown(report(usd_per_hour=1.12, price_source="catalog"))
    assert "| Estimated cost | $0.0031 (ceiling $1.12) at $1.12/GPU-hour, price source: catalog |" in text
    assert "Billed by RunPod" not in text  # not read: left out, not failed


def test_the_report_adds_what_runpod_billed_when_billing_answered() -> None:
    assert "| Billed by RunPod | $0.0029 |" in summary_markdown(report(billed_usd=0.0029))


# --- billing -----------------------------------------------------------------------------------------


def test_billed_usd_sums_what_localpod_billed_the_endpoints(localpod: TestClient, runpod: RunpodClient) -> None:
    since = datetime.now(UTC) - timedelta(minutes=1)
    body = endpoint_body(name="loraflow-billed", workers={"min": 1, "max": 1})
    endpoint_id = localpod.post("/v2/serverless", json=body, headers=AUTH).json()["id"]

    def workers() -> list:
        return [w for w in Account.model_validate(localpod.get("/_localpod/account").json()).workers
                if w.endpoint_id == endpoint_id]

    wait_for(workers, "the endpoint's worker")
    localpod.delete(f"/v2/serverless/{endpoint_id}", headers=AUTH)
    [worker] = wait_for(lambda: [w for w in workers() if w.ended_at], "the worker to end", timeout=30)
    billed = billed_usd(runpod, [endpoint_id], since)
    assert billed is not None and billed.endpoint_ids == [endpoint_id]
    seconds = (worker.ended_at - worker.started_at).total_seconds()
    assert billed.usd == pytest.approx(seconds * LIVE_4090 / 3600, abs=2e-6)


def test_billed_usd_is_none_when_billing_cannot_be_read(localpod: TestClient, runpod: RunpodClient) -> None:
    unreadable(localpod, "serverless_billing")
    assert billed_usd(runpod, ["someendpoint01"], datetime.now(UTC)) is None
