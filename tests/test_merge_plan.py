"""The merge's plan, before anything is rented: which serverless CPU worker holds a model of N parameters (sizing
from the bf16 bytes against the catalog's flavors, within a serverless worker's 8 vCPUs and its flavor's disk per
vCPU), a model too large for any refused, the endpoint named so that the hooks and the reconciler find it, the base
read from the run's manifest, and what the summary says."""

from __future__ import annotations

import json

import pytest
from loraflow_worker.artifacts import FileStore
from loraflow_worker.contract import LogitsCheck, MergeResult, TrainMetrics

from tasks.reports.summary import RunReport, summary_markdown
from tasks.runpod.endpoints import endpoint_name, parse_endpoint_name, run_hash
from tasks.runpod.jobs import JobOutcome
from tasks.runpod.live_catalog import CatalogCpuType, read_cpu_types
import tasks.jobs.merge as merge_module
from tasks.jobs.merge import (
    MERGE_LABEL,
    MergeCompute,
    MergeRefused,
    check_merge_fits,
    choose_merge_compute,
    merge_disk_gb,
    merge_ram_gb,
    merge_request,
    merged_of,
    read_merge_source,
)
from tests.test_live_catalog import client_for, localpod  # noqa: F401  (a fixture)


def flavor(flavor_id: str, ram_gb_per_vcpu: float, usd_per_vcpu: float, vcpu_max: int = 32) -> CatalogCpuType:
    return CatalogCpuType.model_validate({"id": flavor_id, "name": flavor_id, "vcpu": {"min": 2, "max": vcpu_max},
                                          "ramGbPerVcpu": ram_gb_per_vcpu, "price": {"serverlessPerVcpu": usd_per_vcpu}})


FLAVORS = [flavor("cpu3c", 2.0, 0.03), flavor("cpu3g", 4.0, 0.04), flavor("cpu5c", 2.0, 0.05)]


def test_the_ram_a_merge_needs_is_the_bf16_weights_with_a_fifth_more_and_the_process():
    assert merge_ram_gb(8_000_000_000) == pytest.approx(16.0 * 1.2 + 4.0)
    assert merge_disk_gb(8_000_000_000) == 48 + 10


def test_an_8b_model_merges_on_the_cheapest_worker_whose_ram_holds_it():
    # 23.2 GB needed: cpu3c and cpu5c need 16 vCPUs (32 GB) for it, cpu3g 8 (32 GB): $0.32/hr against $0.48 and $0.80.
    compute = choose_merge_compute(8_000_000_000, FLAVORS)
    assert compute == MergeCompute(flavor="cpu3g", vcpu_count=8, ram_gb=32.0, usd_per_hour=0.32, needed_ram_gb=23.2)
    assert compute.describe() == "CPU cpu3g × 8 vCPU (32 GB RAM, $0.320/hr)"


def test_a_small_model_takes_the_fewest_vcpus_of_the_cheapest_flavor_that_holds_it():
    # 0.6 B parameters: 5.44 GB. cpu3g × 2 (8 GB, $0.08/hr) against cpu3c × 4 (8 GB, $0.12/hr) and cpu5c × 4 ($0.20).
    assert choose_merge_compute(600_000_000, FLAVORS).model_dump(include={"flavor", "vcpu_count"}) == {
        "flavor": "cpu3g", "vcpu_count": 2}
    # With only the compute-optimized flavors in stock, cpu3c at 4 vCPUs: 2 would hold 4 GB, less than 5.44.
    assert choose_merge_compute(600_000_000, FLAVORS, in_stock={"cpu3c", "cpu5c"}).model_dump(
        include={"flavor", "vcpu_count", "ram_gb"}) == {"flavor": "cpu3c", "vcpu_count": 4, "ram_gb": 8.0}


def test_a_model_too_large_for_every_flavor_is_refused_naming_its_needs_and_each_flavors_largest_worker():
    with pytest.raises(MergeRefused) as refused:
        choose_merge_compute(70_000_000_000, FLAVORS, model="meta-llama/Llama-3.1-70B")
    assert str(refused.value) == (
        "the merge of meta-llama/Llama-3.1-70B (70.0 B parameters, 140.0 GB in bf16) needs 172 GB of RAM and 430 GB "
        "of container disk; a serverless CPU worker has at most 8 vCPUs, and the largest of each flavor on offer "
        "holds less (cpu3c × 8 vCPU: 16 GB RAM, 80 GB disk; cpu3g × 8 vCPU: 32 GB RAM, 80 GB disk; cpu5c × 8 vCPU: "
        "16 GB RAM, 120 GB disk): merge it elsewhere, or remove publish.merged_model_id")


def test_a_14b_model_is_refused_though_the_catalog_offers_32_vcpus_for_the_flavor():
    # 14 B: 37.6 GB of RAM. cpu3g × 16 vCPU (64 GB) would hold it, but a serverless CPU worker stops at 8 (32 GB).
    with pytest.raises(MergeRefused, match=r"needs 38 GB of RAM .* a serverless CPU worker has at most 8 vCPUs.*"
                                           r"cpu3g × 8 vCPU: 32 GB RAM"):
        choose_merge_compute(14_000_000_000, FLAVORS, model="Qwen/Qwen3-14B")


def test_the_largest_model_that_merges_takes_a_serverless_worker_of_at_most_8_vcpus():
    compute = choose_merge_compute(11_000_000_000, FLAVORS)
    assert (compute.flavor, compute.vcpu_count, compute.ram_gb) == ("cpu3g", 8, 32.0)


def test_the_container_disk_sizes_the_worker_up_when_its_ram_alone_would_not():
    # 16 GB of RAM per vCPU holds an 8 B model's 23.2 GB at 2 vCPUs; its 58 GB of disk needs 8 (10 GB per vCPU).
    compute = choose_merge_compute(8_000_000_000, [flavor("cpu9m", 16.0, 0.02)])
    assert (compute.flavor, compute.vcpu_count) == ("cpu9m", 8)


def test_cpu5c_allows_15_gb_of_disk_per_vcpu_and_cpu3c_10():
    # 2 B parameters: 8.8 GB of RAM and 22 GB of disk. With RAM to spare, cpu5c's 2 vCPUs hold 30 GB of disk, cpu3c's
    # 20 GB do not: 4 vCPUs.
    roomy = [flavor("cpu3c", 8.0, 0.01), flavor("cpu5c", 8.0, 0.01)]
    sizes = {f.id: choose_merge_compute(2_000_000_000, [f]).vcpu_count for f in roomy}
    assert sizes == {"cpu3c": 4, "cpu5c": 2}


def test_a_catalog_id_in_its_long_form_is_rented_by_the_flavor_id_the_create_takes():
    compute = choose_merge_compute(600_000_000, [flavor("cpu3c-2-4", 2.0, 0.03)], in_stock={"cpu3c"})
    assert (compute.flavor, compute.vcpu_count) == ("cpu3c", 4)
    wire = merge_request(name="loraflow-merge-x", compute=compute, image="i", env={}, disk_gb=14,
                         execution_timeout_s=600).to_wire()
    assert wire["cpu"] == [{"id": "cpu3c", "vcpuCount": 4}]


def test_with_no_cpu_flavor_in_stock_the_merge_is_refused_saying_so():
    with pytest.raises(MergeRefused, match="no CPU flavor of RunPod's catalog is in stock in any datacenter"):
        choose_merge_compute(600_000_000, FLAVORS, in_stock=set())


def test_localpods_catalog_sizes_the_merge_as_runpods_would(localpod):  # noqa: F811
    cpu_types = read_cpu_types(client_for(localpod))
    compute = choose_merge_compute(8_000_000_000, cpu_types)
    cheapest = min(((f, v) for f in cpu_types for v in (2, 4, 8, 16, 32) if v * f.ram_gb_per_vcpu >= 23.2
                    and v * f.disk_gb_per_vcpu >= 58 and f.vcpu.min <= v <= f.vcpu.max),
                   key=lambda fv: fv[0].price.serverless_per_vcpu * fv[1])
    assert (compute.flavor, compute.vcpu_count) == (cheapest[0].id, cheapest[1])


def test_the_cpu_catalog_is_read_as_runpod_offers_it_to_serverless(localpod):  # noqa: F811
    cpu_types = read_cpu_types(client_for(localpod))
    assert {(f.id, f.vcpu.max, f.ram_gb_per_vcpu) for f in cpu_types} == {
        ("cpu3c", 8, 2.0), ("cpu3g", 8, 4.0), ("cpu5c", 8, 2.0)}


def test_a_14b_models_merge_is_refused_before_the_training_is_rented_naming_the_limit(
        localpod, monkeypatch):  # noqa: F811
    monkeypatch.setattr(merge_module, "make_client", lambda: client_for(localpod))
    with pytest.raises(MergeRefused, match=r"^publish.merged_model_id: the merge of Qwen/Qwen3-14B .* a serverless "
                                           r"CPU worker has at most 8 vCPUs"):
        check_merge_fits(14_000_000_000, "Qwen/Qwen3-14B")
    check_merge_fits(8_000_000_000, "Qwen/Qwen3-8B")  # fits cpu3g × 8: nothing raised


def test_the_merge_endpoint_is_a_cpu_endpoint_named_after_the_flow_run_doing_the_merge():
    name = endpoint_name("flow-run-1", 1, MERGE_LABEL.format(run_name="capybara"), "t1")
    parsed = parse_endpoint_name(name)
    assert parsed is not None and parsed.run_hash == run_hash("flow-run-1") and parsed.label == "merge-capybara"
    compute = MergeCompute(flavor="cpu3g", vcpu_count=8, ram_gb=32, usd_per_hour=0.32, needed_ram_gb=23.2)
    wire = merge_request(name=name, compute=compute, image="loraflow-worker:x-contract9", env={"HF_ENDPOINT": "h"},
                         disk_gb=58, execution_timeout_s=600).to_wire()
    assert wire["cpu"] == [{"id": "cpu3g", "vcpuCount": 8}] and "gpu" not in wire, wire
    assert wire["workers"]["max"] == 1 and wire["disk"] == 58


def test_the_base_comes_from_the_runs_manifest_and_a_run_without_one_is_refused(tmp_path):
    store = FileStore(tmp_path)
    with pytest.raises(MergeRefused, match="run r1 has no manifest .*: only a completed run can be merged"):
        read_merge_source(store, "r1")
    store.put({"runs/r1/manifest.json": json.dumps({"base_model_id": "acme/base", "base_model_revision": "abc",
                                                    "job": {"lora": {"quantization": "4bit"}}}).encode()}, message="m")
    with pytest.raises(MergeRefused, match="run r1 has no adapter"):
        read_merge_source(store, "r1")
    store.put({"runs/r1/adapter/adapter_config.json": b"{}"}, message="a")
    base, quantization = read_merge_source(store, "r1")
    assert (base.id, base.revision, quantization) == ("acme/base", "abc", "4bit")


COMPUTE = MergeCompute(flavor="cpu3c", vcpu_count=4, ram_gb=8, usd_per_hour=0.12, needed_ram_gb=5.4)


def test_a_completed_merge_job_gives_the_repo_and_the_logits_check():
    check = LogitsCheck(inputs=3, tokens=30, max_abs_difference=0.0042, reference_max_abs=5.0, tolerance=0.1,
                        passed=True)
    output = MergeResult(run_id="r1", merged_model_id="acme/m", url="https://hub/acme/m", commit_url="https://c",
                         base_model="acme/base", base_model_revision="abc", adapter="acme/lora", logits_check=check,
                         merged_bytes=10, seconds=12.5).model_dump(mode="json")
    merged = merged_of("acme/m", JobOutcome(kind="completed", job_id="j", status="COMPLETED", output=output), COMPUTE,
                       "loraflow-merge-x")
    assert (merged.url, merged.error, merged.ran_on) == ("https://hub/acme/m", None, COMPUTE.describe())
    assert merged.check_line() == "max |Δlogit| 0.0042 ≤ 0.1 over 3 inputs"


def test_a_failed_merge_job_says_why():
    outcome = JobOutcome(kind="failed", job_id="j", status="FAILED",
                         error="MergeMismatch: the merged model's logits differ from base + adapter's by up to 3")
    merged = merged_of("acme/m", outcome, COMPUTE, "loraflow-merge-x")
    assert merged.url is None and merged.error == f"the merge job ended failed: {outcome.error}"


def test_the_summary_has_a_merged_model_row_with_the_check_where_it_ran_or_why_it_failed():
    metrics = TrainMetrics(steps=1, losses=[(1, 1.0)], first_loss=1.0, final_loss=1.0, tokens=1, wall_seconds=1.0,
                           device="cpu")
    common = dict(run_name="demo", run_id="r", model="acme/base", model_revision=None, gpu="RTX 4090", gpu_count=1,
                  endpoint_name="e", metrics=metrics, cost_ceiling_usd=1.0, estimated_cost_usd=0.1,
                  adapter_url="file:///s/runs/r/adapter", store_url="file:///s", merged_model="acme/m",
                  merge_ran_on=COMPUTE.describe())
    merged = summary_markdown(RunReport(**common, merged_model_url="https://hub/acme/m",
                                        merge_check="max |Δlogit| 0.0042 ≤ 0.1 over 3 inputs"))
    assert ("| Merged model | [acme/m](https://hub/acme/m): logits max \\|Δlogit\\| 0.0042 ≤ 0.1 over 3 inputs; "
            f"merged on {COMPUTE.describe()} |") in merged
    failed = summary_markdown(RunReport(**common, merge_error="the merge job ended failed: MergeMismatch: x"))
    assert ("| Merged model | `acme/m`: **not merged** (the merge job ended failed: MergeMismatch: x) on "
            f"{COMPUTE.describe()}; the run completed anyway |") in failed
