"""The `train` flow: one LoRA fine-tuning run on a RunPod serverless GPU.

Run it on the embedded local stack (Prefect server + localpod + tiny model, no cloud account):

    make demo

or against RunPod, from a run file or a deployment:

    RUNPOD_API_KEY=... HF_TOKEN=... .venv/bin/python -m flows.train deployments/qwen.toml
    prefect deployment run train/qwen
"""

from __future__ import annotations

import sys
import time
import uuid
from pathlib import Path

from loraflow_worker.contract import DatasetSource, JobInput
from prefect import flow, get_run_logger
from prefect.concurrency.sync import concurrency
from prefect.runtime import flow_run

from flows.spec import RunSpec, SpecError, load_run_file
from tasks.artifacts import RunResults, check_chat_jsonl, collect, publish_dataset_task
from tasks.cost import check_budget, worst_case_cost_usd
from tasks.plan import plan_attempt, resolve_model_task
from tasks.quota import ENDPOINT_LIMIT, SLOT_LEASE_SECONDS, ensure_endpoint_limit
from tasks.reports import RunReport, publish_report
from tasks.runpod.catalog import resolve_gpu
from tasks.runpod.errors import JobFailedError
from tasks.runpod.steps import create_endpoint, delete_endpoint, submit_job, wait_for_job


@flow(name="train", log_prints=True)
def train(spec: RunSpec) -> RunResults:
    """Fine-tune a LoRA adapter on a RunPod serverless GPU.

    1. Prepare: check the budget, pin the model, publish a local dataset, plan the attempt.
    2. Take one slot of the `runpod-endpoints` limit (the account's endpoint quota).
    3. Create the run's endpoint (looked up by name first).
    4. Submit the job once.
    5. Wait for it, mirroring progress into the UI.
    6. Delete the endpoint, confirmed, whatever happened.
    7. Collect the results from the artifact store and publish the report.
    """
    logger = get_run_logger()
    run_id = flow_run.id or str(uuid.uuid4())
    started = time.time()
    deadline = started + spec.deadline_minutes * 60

    # 1. Prepare: nothing is rented until this has passed.
    gpus = [resolve_gpu(name) for name in spec.compute.gpu]
    cost_ceiling = worst_case_cost_usd(gpus, spec.compute.gpu_count, spec.deadline_minutes)
    check_budget(cost_ceiling, spec.budget_usd)
    if spec.dataset.local_file is not None:
        examples = check_chat_jsonl(Path(spec.dataset.local_file))
        logger.info("Dataset %s: %d examples", spec.dataset.local_file, examples)
    model = resolve_model_task(spec.model)
    if spec.dataset.local_file is not None:
        dataset = DatasetSource(store_path=publish_dataset_task(spec.artifact_store, run_id, spec.dataset.local_file))
    else:
        dataset = DatasetSource(hub_id=spec.dataset.hub_id, split=spec.dataset.split)
    job_input = JobInput(run_id=run_id, attempt=1, algorithm=spec.algorithm, model=model, dataset=dataset,
                         lora=spec.lora, training=spec.training, artifact_store=spec.artifact_store,
                         deadline_epoch_s=deadline)
    plan = plan_attempt(job_input=job_input, run_label=spec.name, gpu=gpus[0], gpu_count=spec.compute.gpu_count,
                        disk_gb=spec.compute.disk_gb, deadline_epoch_s=deadline, now=time.time())
    logger.info("Run %s: %s on %d × %s, cost ceiling $%.2f, endpoint %s", spec.name, model.id,
                spec.compute.gpu_count, plan.gpu.name, cost_ceiling, plan.endpoint_name)

    # 2-6. Hold one endpoint slot for exactly as long as the endpoint may exist.
    ensure_endpoint_limit()
    with concurrency(ENDPOINT_LIMIT, occupy=1, strict=True, lease_duration=SLOT_LEASE_SECONDS,
                     raise_on_lease_renewal_failure=False):
        try:
            endpoint = create_endpoint(plan.create_request)
            job_id = submit_job(endpoint, plan.job_input.model_dump(mode="json"), plan.policy)
            outcome = wait_for_job(endpoint, job_id, deadline=plan.deadline_epoch_s,
                                   queue_allowance_s=plan.queue_allowance_s, progress_key=f"train-{spec.name}-progress")
        finally:
            delete_endpoint(plan.endpoint_name)

    # 7. The artifacts decide success: `DONE` is written last, after everything else is stored.
    results = collect(spec.artifact_store, run_id)
    if not results.done:
        reason = outcome.error or f"the job ended {outcome.status} without storing its results"
        tail = f"\n--- worker console (last lines) ---\n{results.console_tail}" if results.console_tail else ""
        trace = f"\n--- worker traceback ---\n{outcome.traceback}" if outcome.traceback else ""
        raise JobFailedError(f"run {spec.name} {outcome.kind}: {reason}{trace}{tail}", job_id=outcome.job_id,
                             status=outcome.status, error=outcome.error, console_tail=results.console_tail)
    if outcome.kind != "completed":
        logger.warning("Job ended %s but its results were stored completely; adopting them", outcome.kind)
    assert results.result is not None
    billed_hours = (outcome.running_seconds or results.result.metrics.wall_seconds) / 3600
    report = RunReport(
        run_name=spec.name, run_id=run_id, model=model.id, model_revision=model.revision, gpu=plan.gpu.name,
        gpu_count=spec.compute.gpu_count, endpoint_name=plan.endpoint_name, metrics=results.result.metrics,
        cost_ceiling_usd=cost_ceiling,
        estimated_cost_usd=round(plan.gpu.usd_per_hour * spec.compute.gpu_count * billed_hours, 4),
        adapter_url=results.adapter_url or "", store_url=spec.artifact_store,
        fast_paths=(results.manifest or {}).get("fast_paths"),
    )
    publish_report(report, key_prefix=f"train-{spec.name}")
    logger.info("Adapter: %s", results.adapter_url)
    return results


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m flows.train RUN_FILE.toml")
    try:
        run_spec = load_run_file(sys.argv[1])
    except SpecError as e:
        sys.exit(str(e))
    train(run_spec)
