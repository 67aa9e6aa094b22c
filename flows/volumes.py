"""The `volumes` flow: every loraflow network volume on the account with its datacenter, size, type, models,
endpoints, last use and monthly cost; this control plane's volumes unused for `retain_days` deleted with their
weight-cache records; other control planes' volumes listed and left alone unless named.

RunPod bills a network volume by the GB-month whether anything uses it or not: a volume no run or sweep
uses is money spent for nothing, and a run whose warm volume was deleted simply starts cold.

    .venv/bin/python -m flows.volumes '{"dry_run": true}'
    .venv/bin/python -m flows.volumes '{"retain_days": 30}'
    .venv/bin/python -m flows.volumes '{"delete_namespaces": ["ab12"], "confirm": true}'
    prefect deployment run volumes/daily
"""

# No `from __future__ import annotations` here: Prefect builds the parameter model (the UI form) from
# the flow signature.
import json
import re
import sys
from datetime import UTC, datetime

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from tasks.reports.serving import read_serving_endpoints
from tasks.runpod.endpoints import NAMESPACE_PATTERN
from tasks.settings import Settings, startup_problem
from tasks.storage.volume_inventory import RetentionRequest, VolumeRow, apply_retention, decide, read_volumes, totals

DEFAULT_RETAIN_DAYS = 14.0
"""Two weeks: a model trained on weekly keeps its volume; one nobody trains stops costing within a fortnight."""


class VolumesPolicy(BaseModel):
    """Which volumes to keep: this control plane's by use, other control planes' only when named."""

    model_config = ConfigDict(extra="forbid")

    retain_days: float = Field(
        default=DEFAULT_RETAIN_DAYS, gt=0, le=3650,
        description="A volume of this control plane that no training run or preload sweep used for this many days "
        "is deleted, with its weight-cache record (an orphan with no record too). A volume an endpoint attaches is "
        "never deleted. Fractions allowed. The Prefect server must keep events longer than this "
        "(PREFECT_SERVER_EVENTS_RETENTION_PERIOD, default 7 days): else a volume without a use it can see is kept.")
    dry_run: bool = Field(default=False, description="List the volumes and what would be done; change nothing.")
    delete_namespaces: list[str] = Field(
        default_factory=list, description="Tags of other control planes (the part after `loraflow-cache-` in a volume "
        "name) whose volumes are deleted — not attached ones; needs confirm: true. Their cost is in the table first.")
    adopt_namespaces: list[str] = Field(
        default_factory=list, description="Tags of other control planes whose volumes become this control plane's: "
        "renamed to this control plane's name in their datacenter (RunPod allows renaming), so the next preload "
        "sweep uses them and records what is on them; refused where this control plane already has a volume. "
        "Needs confirm: true.")
    confirm: bool = Field(default=False, description="Carry out delete_namespaces and adopt_namespaces. Without it, "
                          "the table shows what they would do and what those volumes cost.")

    @field_validator("delete_namespaces", "adopt_namespaces")
    @classmethod
    def _tags(cls, tags: list[str]) -> list[str]:
        bad = [tag for tag in tags if not re.fullmatch(NAMESPACE_PATTERN, tag)]
        if bad:
            raise ValueError(f"{bad} are not control-plane tags (1-8 of a-z, 0-9, as in loraflow-cache-<tag>-<dc>)")
        return tags


@flow(name="volumes", log_prints=True)
def volumes(policy: VolumesPolicy = VolumesPolicy()) -> list[VolumeRow]:
    """List every loraflow network volume with its monthly cost, and apply retention.

    1. Read the volumes, the endpoints that attach them, their billing, this control plane's weight-cache
       records and the `loraflow.volume.used` events.
    2. Decide: keep what was used within `retain_days` or is attached; delete this control plane's unused
       volumes (with their records); other control planes' only as `delete_namespaces`/`adopt_namespaces` say.
    3. Act (not on a dry run; not on other control planes' volumes without `confirm`). RunPod documents no refusal
       to delete an attached volume, so the account's endpoints are listed again right before each delete: a
       volume one attached since step 1 is kept, and its row says so.
    4. Publish the table (`volumes`) and the total $/month (`volumes-cost`), and the serving endpoints with their
       age, cost and expiry (`volumes-serving`).
    """
    logger = get_run_logger()
    namespace = Settings().control_plane_namespace()
    request = RetentionRequest(**policy.model_dump())
    rows, records, horizon = read_volumes(namespace, policy.retain_days)
    decided = decide(rows, records, request, namespace, datetime.now(UTC), horizon)
    done = apply_retention(decided, request, namespace)
    summary = totals(done)
    create_table_artifact(table=[row.table_row() for row in done], key="volumes",
                          description=f"loraflow network volumes (this control plane: {namespace}). {summary}")
    create_markdown_artifact(markdown=f"**Storage**: {summary}", key="volumes-cost",
                             description="What loraflow's network volumes cost by the month")
    logger.info("%s", summary)
    # Serving endpoints read warm volumes and bill while idle: listed with age, cost and expiry beside them.
    serving = read_serving_endpoints(namespace, return_state=True)
    if serving.is_completed() and serving.result():
        create_table_artifact(table=serving.result(), key="volumes-serving",
                              description="Serving endpoints on the account (the volumes they attach are kept)")
    return done


if __name__ == "__main__":
    if len(sys.argv) > 2:
        sys.exit("usage: python -m flows.volumes ['{\"retain_days\": 14, \"dry_run\": true}']")
    try:
        volumes_policy = VolumesPolicy.model_validate(json.loads(sys.argv[1]) if len(sys.argv) == 2 else {})
    except (ValueError, ValidationError) as e:
        sys.exit(f"bad volumes policy: {e}")
    if problem := startup_problem():
        sys.exit(problem)
    final = volumes(volumes_policy, return_state=True)
    print(f"flow run {final.state_details.flow_run_id}: {final.name}", flush=True)
    sys.exit(0 if final.is_completed() else 1)
