"""The `preflight` flow: before the first real run, check what a run of this spec needs, renting and changing
nothing (no create, update or delete, at RunPod, on the Hub or in Prefect).

Run it where the runs will run (the same RUNPOD_API_KEY, HF_TOKEN, LORAFLOW_WORKER_IMAGE and Prefect server),
on the run file you mean to train, with the worker quota RunPod's console shows for the account:

    RUNPOD_API_KEY=... HF_TOKEN=... LORAFLOW_WORKER_IMAGE=... .venv/bin/python -m flows.preflight deployments/qwen.toml --worker-quota 5
    prefect deployment run preflight/check --param worker_quota=30
    .venv/bin/python -m flows.preflight deployments/qwen.toml --record recordings/my-account   # keep RunPod's answers

It prints one line per check, `ok`, `warn` or `FAIL`, what it found and, for a warn or a FAIL, the fix; the
same table is the run's artifact `preflight`. It exits 1 (the flow run ends Failed) when any check FAILs.
"""

# No `from __future__ import annotations` here: Prefect builds the parameter model (the UI form) from
# the flow signature when it loads the entrypoint, and cannot resolve postponed annotations.
import argparse
import sys
from contextlib import ExitStack, nullcontext
from pathlib import Path
from typing import Annotated

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact
from prefect.runtime import flow_run
from prefect.states import Failed, State
from pydantic import Field

from flows.forms.run import RunSpec, SpecError, load_run_file, read_run_file
from flows.study_search import space_corners
from flows.forms.study import describe_values, expand, load_study_file
from tasks.preflight.account import (
    PERMISSIONS,
    catalog_alternatives,
    check_data_centers,
    check_key_can_list,
    check_merge_worker,
    check_worker_image,
    check_worker_quota,
    judge_cost,
    judge_gpus,
    open_runpod,
    read_offers,
)
from tasks.preflight.hub import check_dataset, check_dataset_file, check_model, check_store
from tasks.preflight.recording import RecordingError, recording, recording_transport
from tasks.preflight.report import Check, failed, guarded, summary, table_rows
from tasks.preflight.server_rules import operator_rule_problems
from tasks.runpod.catalog import cuda_floor, resolve_gpu
from tasks.settings import HubTokenError, Settings


def _flow_run_name() -> str:
    return f"preflight-{flow_run.parameters['spec'].name}"


@flow(name="preflight", flow_run_name=_flow_run_name)
def preflight(
    spec: RunSpec,
    worker_quota: Annotated[int | None, Field(ge=1)] = None,
) -> list[Check] | State:
    """Check, read-only, what a run of `spec` needs before the first real one; one line per check.

    1. The RunPod key: may it list endpoints, secrets and network volumes (read access; write is not checked,
       since that would change the account)?
    2. The worker quota against the `runpod-endpoints` limit plus the workers of endpoints outside it.
    3. The worker image's tag names this control plane's job contract.
    4. Each GPU of `compute.gpu`: its hosts' CUDA against its floor, its stock there, its price's source; then
       the run's cost ceiling against `budget_usd`; with `publish.merged_model_id`, the serverless CPU worker the
       merge would rent, or why none can hold the model.
    5. The datacenters with network volumes, and the account's weight-cache volumes.
    6. The Hub token: it reads the model and the dataset, and may write to (or create) the artifact store.

    Args:
        spec: The run to check, as a deployment's parameters or a run file give it.
        worker_quota: The account's worker quota as RunPod's console shows it (5 on a new account; 10 to 60 with
            the balance). RunPod's API does not expose it: without it, `LORAFLOW_WORKER_QUOTA` or the quota RunPod
            last named in a refusal stands in, and without any of them the quota line is a warn.
    """
    logger = get_run_logger()
    checks: list[Check] = guarded("server rules", lambda: judge_server_rules(spec))
    try:
        settings = Settings().with_hub_token(spec.hub_token_secret)
    except HubTokenError as e:
        # The run would be refused before renting; the other checks go on with the flow's own token.
        checks.append(Check(name="hub token: hub_token_secret", status="FAIL", found=str(e),
                            fix="create the Secret block under a name of your own, holding your own "
                            "token, or unset hub_token_secret to use HF_TOKEN"))
        settings = Settings().with_hub_token()
    with ExitStack() as stack:
        client, no_key = open_runpod(settings, transport=recording_transport(settings))
        if client is not None:
            stack.enter_context(client)
        list_calls = {"endpoints": client.list_endpoints, "secrets": client.list_secrets,
                      "network volumes": client.list_network_volumes} if client is not None else {}
        for kind, permission in PERMISSIONS.items():
            checks += guarded(permission.name, lambda: check_key_can_list(
                permission, list_calls.get(kind), no_key, settings.runpod_api_key_block))
        checks += guarded("worker quota", lambda: check_worker_quota(client, settings, worker_quota))
        checks += guarded("worker image", lambda: check_worker_image(settings))
        gpus = [resolve_gpu(name) for name in spec.compute.gpu]
        floors = [cuda_floor(gpu, settings.loraflow_image_min_cuda) for gpu in gpus]
        offers = read_offers(client, gpus, floors)
        checks += guarded("gpus", lambda: judge_gpus(
            gpus, offers, floors, alternatives=lambda: catalog_alternatives(client, settings.loraflow_image_min_cuda)))
        checks += guarded("cost ceiling", lambda: judge_cost(
            gpus, offers, floors, spec.compute.gpu_count, spec.deadline_minutes, spec.budget_usd,
            settings.loraflow_max_run_usd))
        merged_model_id = spec.publish.merged_model_id if spec.publish is not None else None
        if merged_model_id is not None:
            checks += guarded("merge worker", lambda: check_merge_worker(client, spec.model, merged_model_id,
                                                                         settings))
        checks += guarded("datacenters with volumes", lambda: check_data_centers(client, settings))
    checks += guarded("hub: model", lambda: check_model(spec.model, settings, spec.compute.disk_gb))
    for field, source in spec.dataset.sources():  # each check runs within its own iteration
        if source.local_file is not None:
            checks += guarded(f"{field} file", lambda: check_dataset_file(field, source.local_file, source.row_format(),
                                                                          spec.algorithm))
        else:
            checks += guarded(f"hub: {field}", lambda: check_dataset(field, source.hub_source(), spec.algorithm,
                                                                     settings))
    checks += guarded("artifact store", lambda: check_store(spec.artifact_store, settings))

    for check in checks:
        print(check.line(), flush=True)  # the table itself, unprefixed: log lines would wrap each row in a header
    create_table_artifact(key="preflight", table=table_rows(checks), description=f"Preflight of {spec.name}: "
                          f"{summary(checks)}")
    if failed(checks):
        logger.error("Preflight: %s", summary(checks))
        return Failed(message=f"preflight: {summary(checks)}")
    logger.info("Preflight: %s", summary(checks))
    return checks


def judge_server_rules(spec: RunSpec) -> Check:
    """The operator's rules for every run (`tasks/preflight/server_rules.py`): the inputs folder, a run's own token,
    the cost cap (judged with the cost ceiling). A folder store or a local model with RunPod's workers is the
    artifact store's and the model's check."""
    settings = Settings()
    problems = operator_rule_problems(spec.local_paths(), hub_token_secret=spec.hub_token_secret, settings=settings,
                                      worker_secrets=spec.worker.secrets)
    if problems:
        return Check(name="server rules", status="FAIL", found="; ".join(problems),
                     fix="fix each field named; a run is refused for them before anything is rented")
    rules = [f"inputs inside {settings.loraflow_inputs_dir}" if settings.loraflow_inputs_dir else "",
             "a run's own token required" if settings.loraflow_require_run_token else "",
             f"at most ${settings.loraflow_max_run_usd:.2f} a run" if settings.loraflow_max_run_usd else "",
             f"at most ${settings.loraflow_max_study_usd:.2f} a study" if settings.loraflow_max_study_usd else ""]
    return Check(name="server rules", status="ok", found="; ".join(filter(None, rules)) or "no operator rules set")


def _quota(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: a worker quota is at least 1")
    return value


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m flows.preflight",
                                     description="Check, read-only, what a run of RUN_FILE needs before the first one.")
    parser.add_argument("run_file", metavar="RUN_FILE.toml")
    parser.add_argument("--worker-quota", type=_quota, metavar="N",
                        help="the account's worker quota, as RunPod's console shows it (the API does not expose it)")
    parser.add_argument("--record", type=Path, metavar="DIR",
                        help="also write RunPod's answers to the preflight's reads into DIR (a new folder), secrets "
                        "removed, with a manifest: `python -m localpod --catalog-from DIR` serves that catalog")
    args = parser.parse_args()
    try:
        if "study" in read_run_file(Path(args.run_file)):
            # A study's checks are its children's: every child is valid (a search's, those at its space's corners),
            # and the first stands for them here.
            study_spec = load_study_file(args.run_file)
            search = study_spec.study.search == "tpe"
            children = space_corners(study_spec) if search else expand(study_spec)
            run_spec = children[0].spec
            print(f"A study of {study_spec.study.children()} runs"
                  f"{f', picked by Optuna: the {len(children)} at its space corners' if search else ''}, each valid; "
                  f"checking its first, {run_spec.name} ({describe_values(children[0].values) or 'the run spec'}). "
                  "study.budget_usd is kept as the study starts its children, each within it alone.", flush=True)
        else:
            run_spec = load_run_file(args.run_file)
    except SpecError as e:
        sys.exit(str(e))
    try:
        with recording(args.record) if args.record is not None else nullcontext() as recorder:
            final = preflight(run_spec, worker_quota=args.worker_quota, return_state=True)
    except RecordingError as e:
        sys.exit(str(e))
    if recorder is not None:
        # Without a key the preflight reads nothing from RunPod: say so rather than leave an empty recording unnoticed.
        print(f"{len(recorder.answers)} answers of RunPod recorded in {args.record} (manifest.json lists them)"
              + ("" if recorder.answers else ": none, see the runpod key lines above"), flush=True)
    print(f"flow run {final.state_details.flow_run_id}: {final.name}", flush=True)
    sys.exit(0 if final.is_completed() else 1)
