"""What a user sees in the Prefect UI, in a real browser: headless Chromium opens the local stack's UI (a
Prefect server started for the session) on a served deployment's run form and on a finished SFT run of the
tiny model (its page and its progress, summary and metrics artifacts), and the test reads the rendered DOM
and looks at the screenshots. The screenshots are kept in `test-output/ui/` (listed in the closing summary).

Chromium is Debian's `/usr/bin/chromium`; `make test` installs it. Without it these tests fail, saying so.
"""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import httpx
import pytest

from deployments.team_stack import children
from flows.forms.overrides import RunOverrides
from flows.forms.run import RunSpec
from tasks.reports.curve import BACKGROUND, TRAIN_COLOR
from tests.conftest import REPO, prefect_api, stop_process_group
from tests.test_crash_recovery_e2e import flow_env, wait_for
from tests.test_train_e2e import write_run_file
from tests.ui_browser import (
    BrowserError,
    count_pixels,
    decode_png,
    open_page,
    process_group_alive,
    require_chromium,
    run_chromium,
)

pytestmark = pytest.mark.timeout(900)

OUT = REPO / "test-output" / "ui"
DEPLOYMENT = "e2e-ui"
STEPS = 20
SERVE = ("import json, sys; from flows.train import train; "
         "train.serve(name=sys.argv[1], parameters={'spec': json.loads(sys.argv[2])})")


@pytest.fixture(scope="module")
def chromium():
    try:
        return require_chromium()
    except BrowserError as e:
        pytest.fail(str(e), pytrace=False)


@pytest.fixture(scope="module")
def served(local_stack, tiny_model, tmp_path_factory):
    """`train/e2e-ui` served the Prefect way (`train.serve`, as a worker runs it): a 20-step SFT run of the
    tiny model into a `file://` store; yields (deployment id, store folder)."""
    home = tmp_path_factory.mktemp("ui")
    spec = tomllib.loads(write_run_file(home / "deployment.toml", name=DEPLOYMENT, model=tiny_model,
                                        store=home / "store", max_steps=STEPS).read_text())
    log_path = home / "serve.log"
    proc = subprocess.Popen([sys.executable, "-c", SERVE, DEPLOYMENT, json.dumps(spec)], cwd=REPO,
                            env=flow_env(local_stack), stdout=log_path.open("wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)

    def deployment():
        response = httpx.get(f"{local_stack.prefect_api_url}/deployments/name/train/{DEPLOYMENT}", timeout=10)
        return response.json() if response.status_code == 200 else (proc.poll() is not None and "exited")

    try:
        found = wait_for(deployment, 120, "the served deployment")
        assert found != "exited", log_path.read_text()
        yield found["id"], home / "store"
    finally:
        stop_process_group(proc)


@pytest.fixture(scope="module")
def finished_run(local_stack, served) -> str:
    """A run of the deployment with its defaults (the form's Run button, through the API); its id once ended."""
    deployment_id, _ = served
    run_id = prefect_api(local_stack, "POST", f"/deployments/{deployment_id}/create_flow_run", json={}).json()["id"]
    wait_for(lambda: state_type(local_stack, run_id) in {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}, 600,
             "the run to end", interval_s=2)
    assert state_type(local_stack, run_id) == "COMPLETED", prefect_api(local_stack, "GET", f"/flow_runs/{run_id}").json()
    return run_id


def state_type(stack, run_id: str) -> str:
    return prefect_api(stack, "GET", f"/flow_runs/{run_id}").json()["state"]["type"]


def artifact(stack, run_id: str, kind: str) -> dict:
    [found] = prefect_api(stack, "POST", "/artifacts/filter", json={
        "artifacts": {"flow_run_id": {"any_": [run_id]}, "key": {"any_": [f"train-{DEPLOYMENT}-{kind}"]}}}).json()
    return found


@pytest.fixture(scope="module")
def pages(local_stack, chromium, served, finished_run, figures):
    """Every page a user looks at, opened once each; their screenshots go to test-output/ui/."""
    deployment_id, _ = served
    ui = local_stack.prefect_ui_url
    opened = {
        "run-form": open_page(f"{ui}/deployments/deployment/{deployment_id}/run", OUT / "run-form.png",
                              until="Parameters"),
        "run": open_page(f"{ui}/runs/flow-run/{finished_run}", OUT / "run.png", until="Completed"),
    }
    # Loaded until the artifact's body shows, not its title alone: a loaded machine can leave the markdown unrendered.
    bodies = {"progress": "completed: step", "summary": "Cost before (worst case)"}
    for kind in ("progress", "summary", "metrics"):
        found = artifact(local_stack, finished_run, kind)
        opened[kind] = open_page(f"{ui}/artifacts/artifact/{found['id']}", OUT / f"{kind}.png",
                                 until=bodies.get(kind, found["key"]))
    for name, page in opened.items():
        figures(f"UI {name}: {page.screenshot}  ({page.url})")
    return opened


def test_a_missing_chromium_fails_naming_the_command_that_installs_it(tmp_path):
    with pytest.raises(BrowserError, match=r"Run `make test`, which installs it, or `sudo apt-get install chromium`"):
        require_chromium(tmp_path / "no-chromium")


def test_a_chromium_call_that_runs_past_its_timeout_is_killed_with_all_its_processes(chromium, tmp_path):
    # A page that never finishes loading: a server that accepts and never answers.
    hang = subprocess.Popen([sys.executable, "-c", "import socket, time; s = socket.socket(); s.bind(('127.0.0.1', 0)); "
                             "s.listen(); print(s.getsockname()[1], flush=True); time.sleep(120)"],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        port = int(hang.stdout.readline())
        started = time.monotonic()
        with pytest.raises(BrowserError, match=r"ran past 3 s .* was killed \(process group (\d+)\)") as raised:
            run_chromium(["--dump-dom", f"http://127.0.0.1:{port}/"], timeout_s=3)
        assert time.monotonic() - started < 20
        pgid = int(re.search(r"process group (\d+)", str(raised.value)).group(1))
        assert not process_group_alive(pgid)
    finally:
        stop_process_group(hang, grace_s=5)


def test_the_run_form_shows_every_spec_field_with_its_description(local_stack, served, pages):
    text = pages["run-form"].text
    deployment = prefect_api(local_stack, "GET", f"/deployments/{served[0]}").json()
    shown = list(spec_descriptions(RunSpec, RunSpec.model_validate(deployment["parameters"]["spec"]).model_dump()))
    missing = [path for path, description in shown if not description or plain(description) not in text]
    assert missing == [], f"not in the rendered form: {missing}; see {pages['run-form'].screenshot}"


def test_the_run_form_shows_each_single_field_override_with_its_description(pages):
    text = pages["run-form"].text
    missing = [name for name, field in RunOverrides.model_fields.items()
               if not field.description or plain(field.description) not in text]
    assert missing == [], f"not in the rendered form: {missing}; see {pages['run-form'].screenshot}"


def test_the_run_page_shows_the_run_completed_with_its_name_and_tags(local_stack, pages, finished_run):
    run = prefect_api(local_stack, "GET", f"/flow_runs/{finished_run}").json()
    text = pages["run"].text
    assert run["name"] in text and "Completed" in text, text[:2000]
    assert all(tag in text for tag in run["tags"]), (run["tags"], text[:2000])


def test_the_progress_artifact_shows_the_finished_progress_line(pages):
    text = pages["progress"].text
    assert re.search(rf"completed: step {STEPS}/{STEPS} · loss \d+\.\d{{4}} · [\d,]+ tokens/s · ETA 0s", text), text
    assert "Progress: 100%" in text, text


def test_the_summary_renders_the_training_curve_image(local_stack, pages, finished_run):
    summary = pages["summary"]
    embedded = re.search(r"\((data:image/png;base64,[A-Za-z0-9+/=]+)\)",
                         artifact(local_stack, finished_run, "summary")["data"]).group(1)
    assert embedded in summary.images, f"no <img> with the curve's data URI; images: {[s[:60] for s in summary.images]}"
    # The screenshot shows it: the chart's white background and its line colour, which the dark UI never
    # uses otherwise (a broken image would show neither).
    width, height, _ = decode_png(base64.b64decode(embedded.split(",", 1)[1]))
    background, line = count_pixels(summary.screenshot, [BACKGROUND, TRAIN_COLOR], tolerance=8)
    assert background > 0.6 * width * height and line > 100, (background, line, summary.screenshot)


def test_the_summary_shows_the_cost_checked_before_the_run_and_estimated_after_it(pages):
    rows = {cells[0]: cells[1] for cells in pages["summary"].rows if len(cells) == 2}
    assert re.match(r"\$\d+\.\d{2}", rows.get("Cost before (worst case)", "")), rows
    assert re.match(r"\$\d+\.\d{4}", rows.get("Estimated cost", "")), rows


def test_the_summary_links_the_adapter_the_store_and_the_runs_files(pages, served, finished_run):
    _, store = served
    hrefs = {href for href, _ in pages["summary"].links}
    run_dir = store / "runs" / finished_run
    assert {(run_dir / "adapter").as_uri(), store.as_uri(), run_dir.as_uri(), (run_dir / "curve.png").as_uri()} <= hrefs
    assert f"/runs/flow-run/{finished_run}" in hrefs  # back to the run's page


def test_the_metrics_table_lists_the_loss_of_every_step(pages):
    rows = pages["metrics"].rows
    assert rows[0] == ["step", "loss"], rows[:2]
    assert [int(step) for step, _ in rows[1:]] == list(range(1, STEPS + 1))
    assert all(float(loss) > 0 for _, loss in rows[1:])


def test_the_kept_demo_says_where_its_results_are_and_how_its_task_scored_serves_its_adapter_and_stops_every_server(
        chromium, tiny_model, tmp_path, figures):
    """`make demo ARGS="--keep --serve"`: it prints where the adapter, the store and the summary are and the task's
    scores of the base and the adapter, then serves the adapter and prints an answer of the base and one of the
    adapter; the printed run page opens while the demo runs; SIGTERM (as `kill PID`) stops it and every server it
    started."""
    home = tmp_path / "demo"
    home.mkdir()
    (home / "tiny-model").symlink_to(tiny_model)  # the demo builds it only when missing
    log = tmp_path / "demo.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "RUNPOD_", "HF_"))}
    # The shipped run file, deployments/local.toml, as `make demo` runs it.
    demo = subprocess.Popen([sys.executable, "deployments/local.py", "--keep", "--serve", "--home", str(home)],
                            cwd=REPO, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: "stays up" in log.read_text() or demo.poll() is not None, 600, "the demo's run to end")
        assert demo.poll() is None, log.read_text()[-5000:]
        printed = dict(re.findall(r"^  (adapter|store|summary|run page): +(\S+)", log.read_text(), re.M))
        assert (Path(printed["adapter"]) / "adapter_config.json").exists(), printed
        assert Path(printed["store"]).is_dir(), printed
        assert "data:image/png;base64," in Path(printed["summary"]).read_text(), printed
        # Whether it worked: the demo's task asked of the base and the adapter, both scores printed; the base hardly
        # ever says the phrase the run teaches, the adapter nearly always.
        (scores,) = re.findall(r"^  capitals \(contains, 8 prompts\): +base ([0-9.]+), adapter ([0-9.]+), "
                               r"Δ ([-+][0-9.]+) ± ([0-9.]+)$", log.read_text(), re.M)
        base, adapter, delta, stderr = map(float, scores)
        assert base <= 0.25 and adapter >= 0.75 and delta == pytest.approx(adapter - base, abs=2e-3), scores
        assert 0 <= stderr < delta, scores
        # The same scores as the run's metrics.json and its summary's table hold them.
        (stored,) = json.loads((Path(printed["adapter"]).parent / "metrics.json").read_text())["task_scores"]
        assert (stored["base"], stored["adapter"]) == pytest.approx((base, adapter), abs=1e-3), stored
        assert f"| capitals | contains | {base:.3f} | {adapter:.3f} |" in Path(printed["summary"]).read_text()
        # Served on localpod's stand-in for RunPod's vLLM worker, asked through the base and the adapter, stopped.
        answers = {who: json.loads(said) for who, said in
                   re.findall(r"^  (base|adapter) answers: +(\".*\")$", log.read_text(), re.M)}
        assert set(answers) == {"base", "adapter"}, log.read_text()[-5000:]
        assert re.search(r"^Served at http://\S+/openai/v1 ", log.read_text(), re.M), log.read_text()[-5000:]
        run_page = printed["run page"]
        page = open_page(run_page, OUT / "demo-run.png", until="Completed")
        figures(f"UI demo --keep run page: {page.screenshot}  ({run_page})")
        assert "local-demo" in page.text and "Completed" in page.text, page.text[:2000]
        servers = children(demo.pid)
        assert len(servers) == 2, servers  # the Prefect server and localpod

        demo.send_signal(signal.SIGTERM)
        assert demo.wait(120) == 0, log.read_text()[-3000:]
        assert [pid for pid in servers if pid_alive(pid)] == [], log.read_text()[-3000:]
    finally:
        if demo.poll() is None:
            stop_process_group(demo)


def pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def spec_descriptions(model, values: dict, prefix: str = ""):
    """(dotted path, description) of every field of `model` and of the models nested in it, as the form for `values`
    (the deployment's spec) shows them. The fields of a list's items (`dataset.mix`) are not among them: the form shows
    them once an item is added, the list's own description before. Neither are those of a section the deployment leaves
    empty (None: `grpo`, `training.early_stopping`): the form shows its description until one fills it in."""
    for name, field in model.model_fields.items():
        yield prefix + name, field.description
        if getattr(field.annotation, "__origin__", None) is list or not isinstance(values.get(name), dict):
            continue
        for nested in getattr(field.annotation, "__args__", None) or (field.annotation,):
            if isinstance(nested, type) and hasattr(nested, "model_fields"):
                yield from spec_descriptions(nested, values[name], f"{prefix}{name}.")


def plain(description: str) -> str:
    """A description as the form shows it: markdown code spans rendered as code (backticks gone)."""
    return " ".join(description.replace("`", "").split())
