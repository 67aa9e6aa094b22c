"""When each account secret was last used, as Prefect events, and the pruning of the unused ones.

A run sends `loraflow.secret.used` for each secret its workers will read, before any endpoint refers to
it (`secret_used`). Pruning reads the newest per secret in one request (`newest_secret_uses`, the way
`tasks/lifecycle/liveness.py` reads heartbeats): events, not a shared Variable, so that concurrent runs never
read-modify-write one record. Where no use is recorded (Prefect keeps events for
`PREFECT_EVENTS_RETENTION_PERIOD`, 7 days by default) a secret's creation time counts; a secret deleted
while a later run still wanted it is created again by that run.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from prefect import get_client, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.events import Event, emit_event
from prefect.events.filters import EventFilter, EventNameFilter, EventOccurredFilter, EventResourceFilter

from tasks.runpod.secrets import LONGEST_RUN, SecretVerdict, prune_unused_secrets
from tasks.settings import Settings, make_client

SECRET_USED = "loraflow.secret.used"
SECRET_RESOURCE = "loraflow.secret."


def secret_used(name: str, *, env_name: str) -> Event | None:
    """Send `loraflow.secret.used`: a run's workers will read the account secret `name` as `env_name`. Never
    raises; inside a run, Prefect names the run as a related resource."""
    return emit_event(event=SECRET_USED,
                      resource={"prefect.resource.id": f"{SECRET_RESOURCE}{name}", "prefect.resource.name": name},
                      payload={"env_name": env_name})


def newest_secret_uses(client: Any, since: datetime, until: datetime) -> dict[str, datetime]:
    """Secret name → its newest `loraflow.secret.used` between `since` and `until`, in one request
    (`POST /events/count-by/resource`: each group's `end_time` is its newest event). `client` is a sync
    Prefect client (`get_client(sync_client=True)`)."""
    event_filter = EventFilter(
        occurred=EventOccurredFilter(since=since, until=until),
        event=EventNameFilter(name=[SECRET_USED]),
        resource=EventResourceFilter(id_prefix=[SECRET_RESOURCE]),
    )
    # One day per time bucket: a window of up to 1000 days stays under the server's bucket cap.
    response = client.request("POST", "/events/count-by/{countable}", path_params={"countable": "resource"},
                              json={"filter": event_filter.model_dump(mode="json"), "time_unit": "day",
                                    "time_interval": 1.0})
    return {count["value"].removeprefix(SECRET_RESOURCE): datetime.fromisoformat(count["end_time"])
            for count in response.json() if count["value"].startswith(SECRET_RESOURCE)}


@task(name="prune-secrets", cache_policy=NO_CACHE)
def prune_secrets(retain_days: float, dry_run: bool = False) -> list[SecretVerdict]:
    """Delete this control plane's account secrets that no endpoint refers to and no run used (nor were
    created) within `retain_days` (at least a run's longest life); log one line per secret deleted or
    failed. Another namespace's secrets are never touched."""
    settings = Settings()
    now = datetime.now(UTC)
    window = max(timedelta(days=retain_days), LONGEST_RUN)
    with get_client(sync_client=True) as prefect:
        # `occurred` is the sender's clock: some room past now for clocks running ahead.
        uses = newest_secret_uses(prefect, since=now - window, until=now + timedelta(minutes=10))
    with make_client(settings) as client:
        verdicts = prune_unused_secrets(client, settings.control_plane_namespace(), retain_days=retain_days,
                                        now=now, last_used=uses, dry_run=dry_run)
    logger = get_run_logger()
    for verdict in verdicts:
        if verdict.action != "kept":
            logger.info("Secret %s: %s (%s)", verdict.name, verdict.action, verdict.reason)
    return verdicts
