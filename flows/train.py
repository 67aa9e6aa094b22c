"""The `train` flow: one LoRA fine-tuning run on a RunPod serverless GPU.

Run it on the embedded local stack (Prefect server + localpod + tiny model, no cloud account):

    make demo

or against RunPod, from a run file or a deployment:

    RUNPOD_API_KEY=... HF_TOKEN=... .venv/bin/python -m flows.train deployments/qwen.toml
    prefect deployment run train/qwen
    prefect deployment run train/qwen --param max_steps=5 --param 'gpu=["h100"]'   # single fields changed
"""

# No `from __future__ import annotations` here: Prefect builds the parameter model (the UI form) from
# the flow signature when it loads the entrypoint, and cannot resolve postponed annotations.
import sys
import uuid

from prefect import flow
from prefect.runtime import flow_run
from prefect.states import Cancelled, State
from prefect.utilities.annotations import quote
from pydantic import ValidationError

from flows.forms.overrides import RunOverrides, apply_overrides
from flows.serve import serve_trained
from flows.forms.run import RunSpec, SpecError, load_run_file
from flows.train_check import check
from flows.train_phases import (
    Attempts,
    adopt,
    cancelled_during,
    place,
    rent_train_and_tear_down,
    report,
    retry_or_fail,
)
from tasks.lifecycle.quota import wait_for_slot_releases
from tasks.lifecycle.steps import run_cancel_requested
from tasks.lifecycle.teardown import delete_run_endpoints_hook
from tasks.reports import events
from tasks.reports.summary import run_tags, run_title, tag_run
from tasks.settings import startup_problem
from tasks.storage.artifacts import RunResults, collect


def _flow_run_name() -> str:
    # Prefect calls this once the parameters are validated, before the body runs: the name describes the
    # run the overrides make. When they are invalid the body fails on them, naming them; the name is only
    # a label, so it falls back to the spec as given.
    parameters = flow_run.parameters
    spec: RunSpec = parameters["spec"]
    try:
        overrides = RunOverrides.model_validate({k: parameters.get(k) for k in RunOverrides.model_fields})
        spec = apply_overrides(spec, overrides)
    except (SpecError, ValidationError):
        pass
    return run_title(spec.name, spec.model.id, spec.algorithm, spec.compute.gpu[0])


# Each hook deletes the run's endpoints by name: the second layer of teardown, after `finally`.
@flow(name="train", log_prints=True, flow_run_name=_flow_run_name, on_crashed=[delete_run_endpoints_hook],
      on_cancellation=[delete_run_endpoints_hook], on_failure=[delete_run_endpoints_hook])
def train(
    spec: RunSpec,
    run_file: str | None = None,
    name: str | None = None,
    model: str | None = None,
    dataset: str | None = None,
    gpu: list[str] | None = None,
    max_steps: int | None = None,
    learning_rate: float | None = None,
    hub_token_secret: str | None = None,
) -> RunResults | State:
    """Fine-tune a LoRA adapter on a RunPod serverless GPU, in phases (`flows/train_check.py`,
    `flows/train_phases.py`): check (nothing is rented until it passes), then for each attempt: place → rent its
    endpoint under the `runpod-endpoints` quota → train and watch → tear down (always, confirmed) → collect (results
    stored completely end the run; otherwise retry from the last checkpoint, or fail); then report, publish and merge
    (`[publish]`). A cancel from the UI, the
    CLI or the API ends the run Cancelled once its endpoint is deleted. Every end sends `loraflow.run.finished`.

    Args:
        spec: The run, as a deployment's parameters or a run file give it. The parameters below change
            single fields of it, so that `--param max_steps=5` works where `--param spec=...` would have
            to repeat the whole spec.
        run_file: A TOML run file (e.g. `deployments/qwen.toml`) whose spec replaces `spec` before the other
            overrides apply. Relative paths are resolved from the flow's working directory.
        name: Replaces the spec's `name` (the run's label).
        model: Replaces the base model: a Hub model id (`Qwen/Qwen3-0.6B`, default branch) or a local model
            directory (local mode).
        dataset: Replaces the training data: a local JSONL file (a path ending in `.jsonl` or `.json`, or
            starting with `/`, `./`, `../` or `~`) or else a Hub dataset id (its `train` split).
        gpu: Replaces `compute.gpu`: GPU classes in the order to try them, e.g. `["h100", "a100 sxm"]`.
        max_steps: Replaces `training.max_steps` (optimizer steps).
        learning_rate: Replaces `training.learning_rate`.
        hub_token_secret: Replaces `hub_token_secret`: the Prefect Secret block holding your Hugging Face token,
            for this run.
    """
    run_id = flow_run.id or str(uuid.uuid4())
    spent = events.RunSpend()  # what `loraflow.run.finished` reports, however the run ends
    try:
        spec = apply_overrides(spec, RunOverrides(run_file=run_file, name=name, model=model, dataset=dataset,
                                                  gpu=gpu, max_steps=max_steps, learning_rate=learning_rate,
                                                  hub_token_secret=hub_token_secret))
        tagged = tag_run.submit(run_id, run_tags(spec.model.id, spec.algorithm, spec.compute.gpu))
        run = check(spec, run_id, quote(spent))  # nothing is rented until this has passed
        tagged.result()  # the run's labels, written while it was checked
        attempts = Attempts(forced=run.job_input.memory)
        for attempt in range(1, spec.attempts.max_attempts + 1):
            # The first attempt asks right before it creates its endpoint (`run_attempt`), a moment after the checks.
            if attempt > 1 and run_cancel_requested():
                return spent.finish(run_id, spec.name, "cancelled",
                                    Cancelled(message=f"Cancelled before attempt {attempt}"))
            plan, cache = place(run, attempt, attempts)
            spent.attempts, endpoints_before = attempt, len(attempts.endpoint_ids)
            spent.attempt_began(run.offers[plan.gpu.name].usd_per_hour * spec.compute.gpu_count)
            outcome, undeleted, plan, cache = rent_train_and_tear_down(run, attempt, attempts, plan, cache)
            spent.attempt_ended(run.offers[plan.gpu.name].usd_per_hour * spec.compute.gpu_count
                                * outcome.running_seconds / 3600)
            if outcome.kind == "run_cancelled":
                return spent.finish(run_id, spec.name, "cancelled", cancelled_during(attempt, outcome, undeleted))
            # The job's own output pins the adapter; the stored result.json must agree with it.
            results = collect(spec.artifact_store, run_id, spec.hub_token_secret,
                              job_output=outcome.output if outcome.kind == "completed" else None)
            if results.done:
                adopt(outcome, undeleted, plan)
                break
            retry_or_fail(run, attempt, attempts, plan, cache, outcome, results, endpoints_before)
        published, merged = report(run, plan, cache, results, attempt, attempts.endpoint_ids, spent.usd,
                                   attempts.refused)
        finished = spent.finish(run_id, spec.name, "completed", results, adapter_url=results.adapter_url,
                                metrics=results.result.metrics,
                                published_model=published.hub_model_id if published else None,
                                publish_error=published.error if published else None,
                                merged_model=merged.merged_model_id if merged else None,
                                merge_error=merged.error if merged else None)
    except BaseException as e:
        # Every failure ends here: refused before renting (0 attempts), out of attempts, or an error.
        spent.finish(run_id, spec.name, "cancelled" if run_cancel_requested() else "failed", None,
                     message=f"{type(e).__name__}: {e}")
        raise
    finally:
        wait_for_slot_releases()  # the last attempt's slot, given back while the run collected and reported
    serve_trained(spec, run_id, spec.name, published)  # `[publish.serve]`: the completed run's adapter, served
    return finished


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m flows.train RUN_FILE.toml")
    try:
        run_spec = load_run_file(sys.argv[1])
    except SpecError as e:
        sys.exit(str(e))
    if problem := startup_problem(worker_image=True):
        sys.exit(problem)
    final = train(run_spec, return_state=True)
    print(f"flow run {final.state_details.flow_run_id}: {final.name}", flush=True)
    sys.exit(0 if final.is_completed() else 1)
