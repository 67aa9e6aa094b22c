"""The crash/cancellation/failure hook: each step runs whatever the other did, and nothing is raised
into Prefect's hook machinery."""

import logging
import uuid
from types import SimpleNamespace

import prefect.deployments
import pytest
from prefect.exceptions import ObjectNotFound
from pydantic import BaseModel, ValidationError

from tasks.lifecycle import teardown
from tasks.runpod.errors import RunpodError

FLOW_RUN = SimpleNamespace(id=uuid.UUID("00000000-0000-0000-0000-0000000000aa"))
STATE = SimpleNamespace(name="Crashed")


class _NeedsAKey(BaseModel):
    api_key: str


def _validation_error() -> ValidationError:
    try:
        _NeedsAKey.model_validate({})
    except ValidationError as e:
        return e
    raise AssertionError("the model accepted an empty dict")


@pytest.fixture
def reconcile_starts(monkeypatch):
    calls = []

    def fake_run_deployment(name, **kwargs):
        calls.append((name, kwargs))

    monkeypatch.setattr(prefect.deployments, "run_deployment", fake_run_deployment)
    return calls


@pytest.mark.parametrize(
    "failure",
    [
        RunpodError("503 from RunPod"),
        ValueError("Secret block 'runpod-api-key' not found"),
        _validation_error(),
        KeyError("RUNPOD_API_KEY"),
    ],
    ids=["runpod", "secret-block", "validation", "bug"],
)
def test_a_failed_delete_is_logged_with_its_type_and_reconcile_still_starts(monkeypatch, caplog, reconcile_starts, failure):
    def failing_delete(run_id):
        assert run_id == str(FLOW_RUN.id)
        raise failure

    monkeypatch.setattr(teardown, "delete_run_endpoints", failing_delete)
    with caplog.at_level(logging.INFO, logger="loraflow.teardown"):
        teardown.delete_run_endpoints_hook(None, FLOW_RUN, STATE)

    assert [name for name, _ in reconcile_starts] == [teardown.RECONCILE_DEPLOYMENT]
    assert reconcile_starts[0][1] == {"timeout": 0, "as_subflow": False}
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1
    assert type(failure).__name__ in errors[0] and str(FLOW_RUN.id) in errors[0] and "Crashed" in errors[0]


def test_a_successful_delete_is_logged_and_reconcile_starts(monkeypatch, caplog, reconcile_starts):
    monkeypatch.setattr(teardown, "delete_run_endpoints", lambda run_id: ["ep-1", "ep-2"])
    with caplog.at_level(logging.INFO, logger="loraflow.teardown"):
        teardown.delete_run_endpoints_hook(None, FLOW_RUN, STATE)
    assert len(reconcile_starts) == 1
    assert any("ep-1" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.parametrize(
    "failure", [RuntimeError("Prefect API unreachable"), ValueError("bad deployment name")], ids=["runtime", "value"]
)
def test_a_failing_reconcile_start_is_logged_not_raised(monkeypatch, caplog, failure):
    def failing_run_deployment(name, **kwargs):
        raise failure

    monkeypatch.setattr(prefect.deployments, "run_deployment", failing_run_deployment)
    monkeypatch.setattr(teardown, "delete_run_endpoints", lambda run_id: [])
    with caplog.at_level(logging.INFO, logger="loraflow.teardown"):
        teardown.delete_run_endpoints_hook(None, FLOW_RUN, STATE)  # raises nothing
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1
    assert type(failure).__name__ in errors[0] and teardown.RECONCILE_DEPLOYMENT in errors[0]


def test_both_steps_failing_logs_both_and_raises_nothing(monkeypatch, caplog):
    def failing_delete(run_id):
        raise ValueError("no Secret block")

    def failing_run_deployment(name, **kwargs):
        raise ConnectionError("Prefect API unreachable")

    monkeypatch.setattr(teardown, "delete_run_endpoints", failing_delete)
    monkeypatch.setattr(prefect.deployments, "run_deployment", failing_run_deployment)
    with caplog.at_level(logging.INFO, logger="loraflow.teardown"):
        teardown.delete_run_endpoints_hook(None, FLOW_RUN, STATE)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 2
    assert "ValueError" in errors[0] and "ConnectionError" in errors[1]


def test_no_reconcile_deployment_is_only_noted(monkeypatch, caplog):
    def missing(name, **kwargs):
        raise ObjectNotFound(http_exc=None)

    monkeypatch.setattr(prefect.deployments, "run_deployment", missing)
    with caplog.at_level(logging.INFO, logger="loraflow.teardown"):
        teardown.start_reconcile()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("No " + teardown.RECONCILE_DEPLOYMENT in r.getMessage() for r in caplog.records)
