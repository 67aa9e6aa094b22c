"""A job's extra pip packages: installed before training, real errors fail fast, index outages retried.

Nothing is downloaded: pip gets `--no-index` (with a wheel built here) or a local index that answers 503.
"""

from __future__ import annotations

import base64
import hashlib
import http.server
import threading
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from loraflow_worker.handler import WORK_DIR_ENV, JobRefused, handler
from loraflow_worker.runtime.packages import ATTEMPTS, PIP_ARGS_ENV, PackageInstallError, install_extra_packages


def test_unresolvable_package_fails_at_once_with_pips_message(tiny_model_dir, make_job, tmp_path, monkeypatch):
    monkeypatch.setenv(WORK_DIR_ENV, str(tmp_path / "work"))
    monkeypatch.setenv(PIP_ARGS_ENV, "--no-index")
    job = make_job("run-p", tiny_model_dir, tmp_path / "store", extra_packages=["loraflow-probe-missing-pkg==1.0"])
    with pytest.raises(PackageInstallError) as failed:
        handler(job)
    message = str(failed.value)
    assert message.startswith("extra_packages ['loraflow-probe-missing-pkg==1.0']: pip could not install them "
                              f"(attempt 1 of {ATTEMPTS}):\n")
    assert "ERROR: No matching distribution found for loraflow-probe-missing-pkg==1.0" in message
    assert not (tmp_path / "work" / "loraflow-job" / "job.json").exists()  # no training process was started


def test_package_is_installed_from_the_given_wheel(tmp_path, monkeypatch):
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    _build_wheel(wheels, "loraflow_probe_pkg", "0.1")
    # --target keeps this test's package out of the test environment; the worker installs into its own.
    monkeypatch.setenv(PIP_ARGS_ENV, f"--no-index --find-links {wheels} --target {site}")
    install_extra_packages(["loraflow-probe-pkg==0.1"], tmp_path)
    assert (site / "loraflow_probe_pkg" / "__init__.py").read_text() == "VALUE = 42\n"


def test_index_outage_is_retried_then_reported(tmp_path, monkeypatch, failing_index):
    url, hits = failing_index
    monkeypatch.setenv(PIP_ARGS_ENV, f"--index-url {url} --retries 0 --timeout 5")
    with pytest.raises(PackageInstallError, match=rf"the package index kept failing \(attempt {ATTEMPTS} of {ATTEMPTS}\)"):
        install_extra_packages(["loraflow-probe-missing-pkg"], tmp_path, backoff_s=(0.1,))
    assert len(hits) == ATTEMPTS  # one index request per pip run (pip's own retries are off)


def test_requirement_with_pip_options_is_refused(tiny_model_dir, make_job, tmp_path):
    job = make_job("run-q", tiny_model_dir, tmp_path / "store",
                   extra_packages=["--index-url=https://evil.example/simple"])
    with pytest.raises(JobRefused, match=r"`extra_packages`: Value error, '--index-url=https://evil.example/simple' "
                                         r"is not a plain pip requirement"):
        handler(job)


@pytest.fixture
def failing_index() -> Iterator[tuple[str, list[float]]]:
    """A package index that answers every request with 503 Service Unavailable."""
    hits: list[float] = []

    class Unavailable(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            hits.append(time.monotonic())
            self.send_response(503)
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Unavailable)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/simple", hits
    finally:
        server.shutdown()
        server.server_close()


def _build_wheel(folder: Path, package: str, version: str) -> Path:
    """A pure-Python wheel holding `package/__init__.py` (VALUE = 42)."""
    dist_info = f"{package}-{version}.dist-info"
    files = {
        f"{package}/__init__.py": b"VALUE = 42\n",
        f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {package.replace('_', '-')}\nVersion: {version}\n".encode(),
        f"{dist_info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: loraflow-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(
        f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},{len(data)}\n"
        for name, data in files.items()
    ) + f"{dist_info}/RECORD,,\n"
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / f"{package}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, data in {**files, f"{dist_info}/RECORD": record.encode()}.items():
            archive.writestr(name, data)
    return wheel
