"""localpod's worker settings: the worker environment's interpreter, and the `docker run` a docker-runtime
worker starts with. Nothing here needs a Docker engine or an image; `tests/image/` runs real containers.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from localpod import LocalpodConfig, create_app
from localpod.__main__ import _parser, config_from_args, main
from localpod.models import DEFAULT_WORKER_PYTHON
from localpod.state.account import LocalpodState
from localpod.workers.containers import docker_run_command
from localpod.workers.supervisor import WorkerSupervisor
from tests.test_localpod import API_KEY, REPO_ROOT, failed_job_error

HOST_ONLY = "LOCALPOD_TEST_HOST_ONLY"  # set on this machine only: a docker worker must not see it


def parse(*argv: str) -> LocalpodConfig:
    parser = _parser()
    return config_from_args(parser.parse_args(list(argv)), parser)


def executable(path: Path) -> Path:
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


# --- the worker environment's interpreter ----------------------------------------------------------


def test_default_worker_python_is_this_checkouts_worker_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCALPOD_WORKER_PYTHON", raising=False)
    assert DEFAULT_WORKER_PYTHON == REPO_ROOT / ".venv-worker" / "bin" / "python"
    assert LocalpodConfig.model_fields["worker_python"].default == DEFAULT_WORKER_PYTHON
    assert _parser().parse_args([]).worker_python is None  # the config's default applies


def test_default_worker_command_runs_the_handler_with_the_worker_python(tmp_path: Path) -> None:
    python = executable(tmp_path / "python")
    config = LocalpodConfig(worker_python=python, log_dir=tmp_path)
    assert config.worker_command == [str(python), "-m", "loraflow_worker.handler"]
    assert config.worker_command[0] != sys.executable


def test_worker_python_comes_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    python = executable(tmp_path / "worker-python")
    monkeypatch.setenv("LOCALPOD_WORKER_PYTHON", str(python))
    assert parse("--log-dir", str(tmp_path)).worker_command == [str(python), "-m", "loraflow_worker.handler"]
    # The flag wins over the environment.
    other = executable(tmp_path / "other-python")
    assert parse("--worker-python", str(other), "--log-dir", str(tmp_path)).worker_command[0] == str(other)


@pytest.mark.parametrize("through", ["flag", "env"])
def test_a_missing_worker_python_is_refused_at_start_naming_the_setting_and_the_fix(
    through: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "no-venv" / "bin" / "python"
    argv = ["--log-dir", str(tmp_path), "--port", "1"]
    if through == "flag":
        argv += ["--worker-python", str(missing)]
    else:
        monkeypatch.setenv("LOCALPOD_WORKER_PYTHON", str(missing))
    with pytest.raises(SystemExit) as exited:
        main(argv)  # refused before it serves anything (port 1 would not even bind)
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert f"no worker interpreter at {missing}" in error
    assert "--worker-python" in error and "LOCALPOD_WORKER_PYTHON" in error and "make install" in error


def test_worker_command_is_the_full_override(tmp_path: Path) -> None:
    config = parse("--worker-python", str(tmp_path / "missing"), "--worker-command", "python3 my_handler.py",
                   "--log-dir", str(tmp_path))
    assert config.worker_command == ["python3", "my_handler.py"]


# --- docker runtime settings -----------------------------------------------------------------------


def test_docker_runtime_needs_no_worker_python(tmp_path: Path) -> None:
    config = parse("--worker-runtime", "docker", "--worker-python", str(tmp_path / "missing"),
                   "--worker-mount", str(tmp_path), "--log-dir", str(tmp_path / "logs"))
    assert config.worker_runtime == "docker" and config.worker_command is None
    assert config.worker_mounts == [tmp_path] and config.docker_command == ["docker"]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"worker_runtime": "docker", "worker_command": ["python", "h.py"]}, "applies to the process runtime"),
        ({"worker_runtime": "docker", "worker_mounts": ["/no/such/folder"]}, "existing absolute paths"),
        ({"worker_runtime": "docker", "worker_mounts": ["relative/folder"]}, "existing absolute paths"),
        ({"worker_command": ["python", "h.py"], "worker_mounts": ["/"]}, "apply to the docker runtime"),
    ],
)
def test_settings_of_the_other_runtime_are_refused(fields: dict[str, Any], message: str, tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match=message):
        LocalpodConfig.model_validate({"log_dir": tmp_path, **fields})


def test_worker_mounts_are_made_absolute_on_the_command_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "store").mkdir()
    monkeypatch.chdir(tmp_path)
    config = parse("--worker-runtime", "docker", "--worker-mount", "store", "--log-dir", str(tmp_path / "logs"))
    assert config.worker_mounts == [tmp_path / "store"]


# --- the docker run command ------------------------------------------------------------------------


def docker_endpoint_spec(**overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "name": "loraflow-docker-test",
        "type": "QUEUE",
        "image": "loraflow-worker:0.1.0-cu130-sm90",
        "env": {"HF_TOKEN": "hf_secret_value", "LORAFLOW_RUN_DEADLINE_EPOCH_S": "1900000000"},
        "workers": {"min": 0, "max": 1, "idleTimeout": 5},
        "timeout": 600_000,
        "gpu": {"pools": ["ADA_24"]},
    }
    spec.update(overrides)
    return spec


@pytest.fixture
def docker_state(tmp_path: Path) -> LocalpodState:
    store, models = tmp_path / "store", tmp_path / "models"
    store.mkdir()
    models.mkdir()
    config = LocalpodConfig(api_key=API_KEY, port=18765, log_dir=tmp_path / "logs", worker_runtime="docker",
                            worker_mounts=[store, models])
    return create_app(config).state.localpod


def worker_command(state: LocalpodState, spec: dict[str, Any], worker_id: str = "w0rker0000id01"
                   ) -> tuple[list[str], dict[str, str], Path]:
    endpoint = state.add_endpoint(spec)
    supervisor = WorkerSupervisor(state)
    env = supervisor.runpod_env(endpoint, worker_id, "worker-token")
    disk = state.config.log_dir / "disks" / worker_id
    return docker_run_command(state.config, endpoint, worker_id, sorted(env), disk, supervisor.instance), env, disk


def option_values(command: list[str], option: str) -> list[str]:
    return [command[i + 1] for i, arg in enumerate(command[:-1]) if arg == option]


def test_docker_worker_is_a_named_attached_removed_container_of_the_endpoints_image(docker_state: LocalpodState
                                                                                   ) -> None:
    command, _, _ = worker_command(docker_state, docker_endpoint_spec())
    assert command[:2] == ["docker", "run"]
    assert "--rm" in command and "-d" not in command and "--detach" not in command
    assert option_values(command, "--pull") == ["never"]
    assert option_values(command, "--name") == ["localpod-w0rker0000id01"]
    assert option_values(command, "--network") == ["host"]
    assert command[-1] == "loraflow-worker:0.1.0-cu130-sm90"  # no args: the image's own command runs
    labels = option_values(command, "--label")
    assert "localpod.worker=w0rker0000id01" in labels
    assert any(label.startswith("localpod.instance=") for label in labels)


def test_docker_worker_gets_the_endpoints_env_and_runpods_variables_only(
    docker_state: LocalpodState, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(HOST_ONLY, "1")
    command, env, disk = worker_command(docker_state, docker_endpoint_spec())
    names = option_values(command, "--env")
    assert names == sorted(env)
    assert HOST_ONLY not in names and "PATH" not in names and "HOME" not in names
    assert {"HF_TOKEN", "LORAFLOW_RUN_DEADLINE_EPOCH_S", "RUNPOD_POD_ID", "RUNPOD_AI_API_KEY", "RUNPOD_ENDPOINT_ID",
            "RUNPOD_WEBHOOK_GET_JOB", "RUNPOD_WEBHOOK_POST_OUTPUT", "RUNPOD_WEBHOOK_PING"} <= set(names)
    assert env["RUNPOD_WEBHOOK_GET_JOB"].startswith("http://127.0.0.1:18765/v2/")
    # Names only: the values (a token among them) stay off the command line, where `ps` would show them.
    assert all("=" not in name for name in names)
    assert not any("hf_secret_value" in arg or "worker-token" in arg for arg in command)
    assert f"{disk}:{disk}" in option_values(command, "--volume")


def test_docker_worker_sees_each_mount_at_its_own_path(docker_state: LocalpodState) -> None:
    command, _, _ = worker_command(docker_state, docker_endpoint_spec())
    volumes = option_values(command, "--volume")
    for mount in docker_state.config.worker_mounts:
        assert f"{mount}:{mount}" in volumes


def test_endpoint_args_replace_the_images_command(docker_state: LocalpodState) -> None:
    command, _, _ = worker_command(docker_state, docker_endpoint_spec(args="python -u '/jobs/my handler.py' --fast"))
    image_at = command.index("loraflow-worker:0.1.0-cu130-sm90")
    assert command[image_at + 1:] == ["python", "-u", "/jobs/my handler.py", "--fast"]


def test_an_env_fault_reaches_a_docker_worker(docker_state: LocalpodState) -> None:
    from localpod.faults.rules import WorkerFaultRule

    docker_state.faults.add_worker_fault(WorkerFaultRule(action="env", env={"LORAFLOW_TEST_FAULT": "oom"}))
    command, env, _ = worker_command(docker_state, docker_endpoint_spec())
    assert env["LORAFLOW_TEST_FAULT"] == "oom" and "LORAFLOW_TEST_FAULT" in option_values(command, "--env")


def test_a_docker_client_that_cannot_start_fails_the_queued_jobs(tmp_path: Path) -> None:
    config = LocalpodConfig(api_key=API_KEY, log_dir=tmp_path, worker_runtime="docker",
                            docker_command=[str(tmp_path / "no-such-docker")])
    error = failed_job_error(config)
    assert "could not start worker" in error and "no-such-docker" in error

