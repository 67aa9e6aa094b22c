"""The volume race of the chaos suite (`volume-race` in `bench/chaos_scenarios.py`): an endpoint attaches a
network volume after the volumes flow listed the account's endpoints and before it deletes the volume.

RunPod's API documents no refusal to delete a volume an endpoint attaches (localpod deletes it, and that endpoint's
workers can no longer start), so only the flow's own second look at the endpoints, right before the delete, can
keep it. The scenario makes this control plane's volume in its datacenter with a weight-cache record that last
warmed it a month ago, holds the flow's billing read (a `hang` fault on `network_volume_billing`, which the flow
reads after the endpoints), attaches the volume to a new endpoint while the read is held, and checks that the
volume is kept, reported as attached, with its record and its endpoint intact. Then it cleans up what it made.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import string
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx

from bench.chaos_lib import _RECORD_LOCK, REPO, BackgroundWatch, Localpod, PrefectApi, RunRecord, runpod_api, wait_for
from bench.chaos_scenarios import Scenario, scoped
from tasks.runpod.endpoints import NAMESPACE_PATTERN
from tasks.runpod.volumes import volume_name
from tasks.settings import NAMESPACE_VARIABLE
from tasks.placement.weight_cache import DataCenterCache, WarmModel, variable_name

RETAIN_DAYS = 0.0005
"""The flow's retention, about 43 s: a month-old use is past it, and the stack's own events reach back past it
within a minute of the stack's start (the flow keeps any volume whose unused time its events cannot prove)."""
EVENTS_WAIT_S = 300
"""How long the scenario waits for the Prefect server to hold an event older than the retention."""
RACE_MODEL = "chaos/race-model"


@dataclass
class VolumeRace:
    """What the volume race made and found."""

    volume_id: str
    attached_by: str | None = None
    """The endpoint made while the flow's billing read was held; None: the read was never held."""
    row: dict[str, Any] | None = None
    """The flow's `volumes` table row of the volume; None: the table has none."""
    volume_kept: bool = False
    record_kept: bool = False
    endpoint_still_attaches: bool = False
    left_behind: str | None = None
    """What the scenario could not remove afterwards; None: nothing."""


def run_volume_race(stack, pod: Localpod, scenario: Scenario, *, name: str, here, timeout_s: float) -> RunRecord:
    """Make the volume and its record, run the volumes flow with the race in its billing read, read what it did,
    then remove the endpoint, the volume and the record. Runs that write weight-cache records take turns: the
    flow would clear another run's stale record, or delete its volume."""
    record = RunRecord(scenario, name, here / "store")
    prefect = PrefectApi(stack.prefect_api_url)
    data_center = scenario.race_data_center
    assert data_center is not None, "a volumes scenario names its race_data_center"
    with _RECORD_LOCK, runpod_api(stack) as runpod:
        namespace = control_plane_namespace(prefect)
        volume = runpod.post("/network-volumes", json={"name": volume_name(data_center, namespace), "size": 10,
                                                        "dataCenter": data_center}).raise_for_status().json()
        race = record.volume_race = VolumeRace(volume_id=volume["id"])
        month_ago = datetime.now(UTC) - timedelta(days=30)
        cache = DataCenterCache(data_center=data_center, volume_id=volume["id"], volume_gb=10, models={
            RACE_MODEL: WarmModel(revision="local", size_bytes=1, warmed_at=month_ago)})
        prefect.set_variable(variable_name(data_center), cache.model_dump(mode="json"))
        attacher: AttachWhileHeld | None = None
        try:
            wait_for(lambda: events_reach_back(prefect, timedelta(days=RETAIN_DAYS) + timedelta(seconds=15)),
                     EVENTS_WAIT_S, interval_s=2)
            for rule in scenario.route_faults:
                record.fault_ids.append(pod.add_route_fault(scoped(rule, record.endpoint_prefix)))
            attacher = AttachWhileHeld(pod, runpod, record.fault_ids[0], attaching_endpoint(record, volume["id"]),
                                       timeout_s)
            started = time.monotonic()
            with attacher:
                _run_volumes_flow(stack, record, timeout_s)
            record.wall_s = time.monotonic() - started
            race.attached_by = attacher.made
            if record.flow_run_id is not None:
                race.row = volumes_row(prefect, record.flow_run_id, volume["id"])
            race.volume_kept = runpod.get(f"/network-volumes/{volume['id']}").status_code == 200
            kept = prefect.get_variable(variable_name(data_center))
            race.record_kept = isinstance(kept, dict) and kept.get("volume_id") == volume["id"]
            if attacher.endpoint_id is not None:
                answer = runpod.get(f"/serverless/{attacher.endpoint_id}").raise_for_status().json()
                race.endpoint_still_attaches = volume["id"] in (answer.get("networkVolumes") or [])
        finally:
            race.left_behind = _clean_up(runpod, prefect, data_center, volume["id"],
                                         attacher.endpoint_id if attacher is not None else None)
    return record


def volume_race_problems(record: RunRecord) -> list[str]:
    """Everything not as the race must end: the flow completed, the endpoint was made inside the window, and the
    volume, its record and its endpoint are all still there, the flow's row saying why it kept it (or, under noise,
    that the listing before the delete was refused)."""
    race: VolumeRace | None = record.volume_race
    if race is None:
        return ["the volume race made no volume"]
    problems = []
    if record.state_type != "COMPLETED":
        problems.append(f"the volumes flow ended {record.state_type}: {record.state_message[:1500]}\n"
                        f"{record.output[-2000:]}")
    if race.attached_by is None:
        problems.append("no endpoint attached the volume while the flow's billing read was held: the race never ran")
    row = race.row or {}
    kept_attached = (row.get("action"), row.get("result")) == ("keep", "kept: attached") and \
        "when it was about to be deleted" in row.get("reason", "")
    # Under background noise the listing right before the delete can itself be refused: the delete is then not
    # sent, and the row says it failed for a transient reason, which the next run of the flow retries.
    relist_refused = str(row.get("result", "")).startswith("failed:") and "transient" in str(row.get("result"))
    if not (kept_attached or relist_refused):
        problems.append(f"the flow's row of volume {race.volume_id} does not say it was kept because an endpoint "
                        f"attached it right before the delete: {row or 'no row'}")
    lost = [what for what, there in (("the volume", race.volume_kept), ("its weight-cache record", race.record_kept),
                                     ("the endpoint's volume", race.endpoint_still_attaches)) if not there]
    if lost:
        problems.append(f"lost: {', '.join(lost)}")
    if race.left_behind:
        problems.append(f"the scenario could not remove {race.left_behind}")
    return problems


class AttachWhileHeld(BackgroundWatch):
    """From a thread of its own, once the held route's fault has hit (the flow's billing read is held), makes an
    endpoint attaching the volume, as a teammate's run going warm on it would."""

    join_timeout_s = 60.0

    def __init__(self, pod: Localpod, runpod: httpx.Client, fault_id: str, body: dict[str, Any], timeout_s: float):
        self.pod, self.runpod, self.fault_id, self.body, self.timeout_s = pod, runpod, fault_id, body, timeout_s
        self.made: str | None = None
        self.endpoint_id: str | None = None
        super().__init__()

    def _run(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not self._stop.is_set() and time.monotonic() < deadline:
            try:
                if self.pod.faults_by_id().get(self.fault_id, {}).get("hits"):
                    self.endpoint_id = self.runpod.post("/serverless", json=self.body).raise_for_status().json()["id"]
                    self.made = self.body["name"]
                    return
            except httpx.HTTPError:
                pass  # the next look tries again
            self._stop.wait(0.1)


def attaching_endpoint(record: RunRecord, volume_id: str) -> dict[str, Any]:
    """An endpoint (named for the run, so the batch counts and clears it) that attaches the volume and starts no
    worker."""
    return {"name": f"{record.endpoint_prefix}attach", "type": "QUEUE", "image": "loraflow/chaos-attach:latest",
            "scaling": {"type": "QUEUE_DELAY", "queueDelay": 4}, "gpu": {"pools": ["ADA_24"]}, "workers": {"max": 0},
            "networkVolumes": [volume_id]}


def control_plane_namespace(prefect: PrefectApi) -> str:
    """The stack's control-plane tag, as `tasks.settings.Settings.control_plane_namespace` reads it: the Prefect
    Variable, created with a random tag when missing (a flow creating it at the same moment wins)."""
    tag = prefect.get_variable(NAMESPACE_VARIABLE)
    if tag is None:
        new = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(6))
        response = prefect.http.post("/variables/", json={"name": NAMESPACE_VARIABLE, "value": new})
        if response.status_code != 409:
            response.raise_for_status()
        tag = prefect.get_variable(NAMESPACE_VARIABLE)
    if not isinstance(tag, str) or not re.fullmatch(NAMESPACE_PATTERN, tag):
        raise RuntimeError(f"the Prefect Variable {NAMESPACE_VARIABLE!r} holds {tag!r}, not a control-plane tag")
    return tag


def events_reach_back(prefect: PrefectApi, age: timedelta) -> bool:
    """Whether the Prefect server holds an event at least `age` old."""
    now = datetime.now(UTC)
    page = prefect.http.post("/events/filter", json={"filter": {
        "occurred": {"since": (now - timedelta(days=365)).isoformat(), "until": now.isoformat()}, "order": "ASC"},
        "limit": 1}).raise_for_status().json()
    events = page.get("events") or []
    return bool(events) and datetime.fromisoformat(events[0]["occurred"].replace("Z", "+00:00")) <= now - age


def _run_volumes_flow(stack, record: RunRecord, timeout_s: float) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "RUNPOD_"))} | stack.client_env
    try:
        proc = subprocess.run([sys.executable, "-m", "flows.volumes", json.dumps({"retain_days": RETAIN_DAYS})],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
        record.returncode, record.output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        record.output = f"{e.stdout or ''}{e.stderr or ''}\n(the flow ran past {timeout_s:.0f} s and was killed)"
    match = re.search(r"flow run ([0-9a-f-]{36}):", record.output)
    record.flow_run_id = match.group(1) if match else None


def volumes_row(prefect: PrefectApi, flow_run_id: str, volume_id: str) -> dict[str, Any] | None:
    """The volumes flow run's table row (artifact `volumes`) of one volume."""
    found = prefect.http.post("/artifacts/filter", json={"artifacts": {
        "flow_run_id": {"any_": [flow_run_id]}, "key": {"any_": ["volumes"]}}}).raise_for_status().json()
    rows = [row for a in found for row in (a["data"] if isinstance(a["data"], list) else json.loads(a["data"]))]
    return next((row for row in rows if row.get("volume id") == volume_id), None)


def _clean_up(runpod: httpx.Client, prefect: PrefectApi, data_center: str, volume_id: str,
              endpoint_id: str | None) -> str | None:
    """Delete the endpoint the race made, then the volume, then its record: what the batch counts as leaked must be
    what the flow left, not what the scenario made. Returns what could not be removed, or None."""
    left = []
    if endpoint_id is not None:
        left.append(_not_removed(f"endpoint {endpoint_id}", runpod.delete(f"/serverless/{endpoint_id}")))
    left.append(_not_removed(f"volume {volume_id}", runpod.delete(f"/network-volumes/{volume_id}")))
    if (prefect.get_variable(variable_name(data_center)) or {}).get("volume_id") == volume_id:
        left.append(_not_removed(f"the weight-cache record of {data_center}",
                                 prefect.http.delete(f"/variables/name/{variable_name(data_center)}")))
    return ", ".join(what for what in left if what) or None


def _not_removed(what: str, answer: httpx.Response) -> str | None:
    """`what` with the answer that refused its delete; None: deleted, or already gone."""
    return None if answer.status_code in (204, 404) else f"{what} (HTTP {answer.status_code}: {answer.text[:200]})"
