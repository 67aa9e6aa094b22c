"""The team demo on a machine that lacks what it starts: one line naming the command that installs it, never a
traceback, and nothing started. (The stack itself: tests/test_team_stack_e2e.py.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from deployments import team_stack

REPO = Path(__file__).resolve().parents[1]


def _programs(folder: Path, *names: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        (folder / name).write_text("#!/bin/sh\n")
        (folder / name).chmod(0o755)


def test_without_redis_server_the_demo_names_make_team_demo_in_one_line_and_starts_nothing(tmp_path):
    home = tmp_path / "team"
    empty_path = tmp_path / "bin"
    empty_path.mkdir()
    done = subprocess.run([sys.executable, "-m", "deployments.team_stack", "--runs", "1", "--home", str(home)],
                          cwd=REPO, env={"PATH": str(empty_path), "HOME": str(tmp_path)}, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("team_stack: Debian's ") and "redis-server" in lines[0] and "`make team-demo`" in lines[0]
    assert done.stdout == ""
    assert not home.exists()


def test_each_missing_package_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(team_stack, "POSTGRES_BINS", str(tmp_path / "postgresql" / "*" / "bin"))
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    assert team_stack.missing_system_packages() == ["postgresql", "redis-server"]
    assert team_stack.setup_problem().startswith("Debian's postgresql and redis-server are not installed: `make team-demo`")

    _programs(tmp_path / "bin", "redis-server")
    _programs(tmp_path / "postgresql" / "15" / "bin", "initdb", "postgres")  # half a server: still missing
    assert team_stack.missing_system_packages() == ["postgresql"]

    _programs(tmp_path / "postgresql" / "15" / "bin", *team_stack.POSTGRES_PROGRAMS)
    _programs(tmp_path / "postgresql" / "16" / "bin", *team_stack.POSTGRES_PROGRAMS)
    assert team_stack.missing_system_packages() == []
    assert team_stack.postgres_bin("initdb") == tmp_path / "postgresql" / "16" / "bin" / "initdb"  # the newest
    assert team_stack.redis_server() == str(tmp_path / "bin" / "redis-server")


def test_without_the_worker_environment_the_problem_names_the_command(tmp_path, monkeypatch):
    monkeypatch.setattr(team_stack, "POSTGRES_BINS", str(tmp_path / "postgresql" / "*" / "bin"))
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    _programs(tmp_path / "bin", "redis-server")
    _programs(tmp_path / "postgresql" / "15" / "bin", *team_stack.POSTGRES_PROGRAMS)
    problem = team_stack.setup_problem(worker_python=tmp_path / "nowhere" / "python")
    assert "no worker environment" in problem and "`make team-demo`" in problem and "LORAFLOW_WORKER_PYTHON" in problem
    assert team_stack.setup_problem(worker_python=Path(sys.executable)) is None


def test_make_team_demo_runs_the_demo_and_args_replace_its_options():
    def run_line(*make_args: str) -> str:
        done = subprocess.run(["make", "-n", "--no-print-directory", "team-demo", *make_args], cwd=REPO,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return next(line for line in done.stdout.splitlines() if "deployments.team_stack" in line)

    assert run_line().endswith("-m deployments.team_stack --runs 6 --quota 2")
    assert run_line("ARGS=--workers 5").endswith("-m deployments.team_stack --workers 5")
