"""Run the main job on the embedded local stack: no cloud account, no download, CPU only.

    make demo                                      # install, then run this
    .venv/bin/python deployments/local.py          # run it again
    .venv/bin/python deployments/local.py --keep   # leave the Prefect UI up afterwards (Ctrl-C stops it)
    .venv/bin/python deployments/local.py --run-file deployments/local-study.toml   # a study instead (`[study]`)
    .venv/bin/python deployments/local.py --serve  # then serve the adapter and ask it and the base a question

It starts a Prefect server (SQLite) and localpod, builds a tiny Qwen3-architecture model offline,
runs the `train` flow for a short LoRA SFT run through localpod, checks that the adapter loads with
PEFT, prints where everything is (adapter, artifact store, the run's summary) and the run's task scores (local.toml's: the base
model's and the adapter's on eight of the trained questions, their difference and its standard error), and stops what
it started; with `--keep` it leaves the Prefect server up, prints the run's page, and stops everything on
Ctrl-C or SIGTERM. Exit code 0 only if the run completed and its adapter loads. A run file with a `[study]`
section runs the `study` flow instead: its children, their comparison, and the best child's adapter checked the
same way. A run file with `[publish]` also starts the local Hub stand-in, which it publishes to. With `--serve`, the
adapter is then served by the `serve` flow on localpod's stand-in for RunPod's vLLM worker, asked one question of
the dataset through the base and through the adapter at the OpenAI base URL the serve printed, and stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tomllib
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from deployments.local_stack import LocalStack, build_tiny_model, check_adapter  # noqa: E402

SILENCE_S = 8  # a long phase prints a line when the terminal has been quiet this long


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-file", default=str(REPO / "deployments" / "local.toml"), help="TOML run file to train.")
    parser.add_argument("--home", default=str(REPO / ".local"), help="Folder for the stack's state, the model and artifacts.")
    parser.add_argument("--keep", action="store_true", help="Keep the Prefect server running after the run, for the UI.")
    parser.add_argument("--port", type=int, default=0, help="Port of the Prefect server and its UI (default: a free one).")
    parser.add_argument("--serve", action="store_true", help="Then serve the adapter and print an answer of the base "
                        "and one of the adapter.")
    args = parser.parse_args()
    home = Path(args.home).resolve()
    os.chdir(REPO)
    watch_output()
    stop_on_signals()

    model_dir = home / "tiny-model"
    if not (model_dir / "config.json").exists():
        with phase(f"Building the tiny model in {model_dir}", "building the tiny model"):
            build_tiny_model(model_dir)

    plan = tomllib.loads(Path(args.run_file).read_text())
    stack = LocalStack(home / "stack", prefect_port=args.port, with_hub="publish" in plan)
    try:
        with phase("Starting the local Prefect server and localpod", "starting the Prefect server and localpod"):
            stack.__enter__()  # stops what it started if it fails
        os.environ.update(stack.client_env)
        if "study" in plan:
            code = study_and_report(stack, args.run_file, home, model_dir, links=args.keep)
        else:
            code = train_and_report(stack, args.run_file, home, model_dir, links=args.keep, serve=args.serve)
        if args.keep:
            print(f"\nThe Prefect UI stays up at {stack.prefect_ui_url} (the links above work) until you press "
                  f"Ctrl-C or run `kill {os.getpid()}`.", flush=True)
            wait_for_stop()
        else:
            print("\n`make demo ARGS=--keep` keeps the Prefect UI up after the run, to look at it there.")
        return code
    except KeyboardInterrupt:
        print("\nInterrupted.", file=sys.stderr, flush=True)
        return 130
    finally:
        # Whatever ended the demo (the run, Ctrl-C, SIGTERM, an error): no server outlives it, and a second
        # Ctrl-C does not cut the stopping short.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        with phase("Stopping the local Prefect server and localpod", "stopping"):
            stack.stop()
        print("Stopped.", flush=True)


def train_and_report(stack: LocalStack, run_file: str, home: Path, model_dir: Path, links: bool,
                     serve: bool = False) -> int:
    """Run the flow, check its adapter, print where its artifacts are (`links`: and its pages in the Prefect
    UI, which work while the server runs), and with `serve` serve it and ask it; the exit code."""
    # Prefect reads its settings when first imported: import it only now that the env points at the stack.
    from flows.forms.run import load_run_file
    from flows.train import train

    spec = load_run_file(run_file)
    spec = spec.model_copy(update={"artifact_store": f"file://{home / 'artifacts'}",
                                   "model": spec.model.model_copy(update={"id": str(model_dir)})})
    started = time.time()
    with phase(f"Training `{spec.name}` ({spec.training.max_steps} steps) through localpod; Prefect's log follows",
               "training"):
        state = train(spec, return_state=True)
    run_id = str(state.state_details.flow_run_id)
    ui = stack.prefect_ui_url
    summary = summary_artifact(run_id)
    pages = [f"  run page:      {ui}/runs/flow-run/{run_id}"] if links else []  # tests/test_ui_browser.py reads this line
    if links and summary is not None:
        pages.append(f"  summary page:  {ui}/artifacts/artifact/{summary.id}")
    if not state.is_completed():
        print(f"\nThe run did not complete: {state.message}", *pages, sep="\n", file=sys.stderr, flush=True)
        return 1
    results = state.result()
    adapter_dir = Path(results.adapter_url.removeprefix("file://"))
    with phase("Checking that the adapter loads with PEFT", "checking the adapter"):
        # The promise of a run: an adapter that loads with PEFT on its base model.
        report = check_adapter(model_dir, adapter_dir)
    if not report["loads"]:
        print(f"\nThe run completed but its adapter does not load: {report['error']}", *pages, sep="\n",
              file=sys.stderr, flush=True)
        return 1
    run_dir = adapter_dir.parent
    summary_file = home / "summaries" / f"{run_id}.md"
    if summary is not None:
        summary_file.parent.mkdir(parents=True, exist_ok=True)
        summary_file.write_text(summary.data)
    metrics = results.result.metrics
    lines = [
        f"\nRun completed in {time.time() - started:.0f} s: {metrics.steps} steps, loss "
        f"{metrics.first_loss:.3f} -> {metrics.final_loss:.3f} on {metrics.device}",
        f"  adapter:       {adapter_dir}  (loads with PEFT onto {model_dir})",
        f"  store:         {home / 'artifacts'}  (this run's files: {run_dir}: "
        f"{', '.join(sorted(p.name for p in run_dir.iterdir()))})",
        *([f"  summary:       {summary_file}  (the run's summary in markdown, curve included)"] if summary else []),
        *pages,
        *score_lines(metrics),
    ]
    print(*lines, sep="\n", flush=True)
    return serve_and_ask(spec, run_id, home, model_dir) if serve else 0


def score_lines(metrics) -> list[str]:
    """The run's task scores (`[[evaluation.tasks]]`) and benchmark scores, base against adapter, a line each."""
    tasks = [f"  {s.task} ({s.grader}, {s.n} prompts):".ljust(40) + f" base {s.base:.3f}, adapter {s.adapter:.3f}, "
             f"Δ {s.delta:+.3f} ± {s.delta_stderr:.3f}" for s in metrics.task_scores]
    benchmarks = [f"  {s.task} (benchmark {s.metric}{'' if s.higher_is_better else ', lower is better'}):".ljust(40)
                  + f" base {s.base:.3f}, adapter {s.adapter:.3f}, Δ {s.delta:+.3f}" for s in metrics.benchmark_scores]
    if not tasks and not benchmarks:
        return [f"\nNo task was scored: {metrics.evaluation_stopped}"] if metrics.evaluation_stopped else []
    return ["\nAsked of the base model and of the adapter after training (a task's score: its grader's mean "
            "over its prompts, 0 to 1):", *tasks, *benchmarks]


def serve_and_ask(spec, run_id: str, home: Path, model_dir: Path) -> int:
    """Serve the run's adapter on the tiny model (`python -m flows.serve`, as a user starts it), ask the dataset's first
    question of the base and of the adapter at the printed OpenAI base URL, print both answers, stop the serve; the
    exit code."""
    import httpx

    question = "Say hello in one sentence."  # a run file whose data is not a local chat file
    if spec.dataset.local_file is not None:
        first = json.loads(Path(spec.dataset.local_file).read_text().splitlines()[0])
        question = next((m["content"] for m in first.get("messages", []) if m["role"] == "user"), question)
    serve_file, log = home / "serve.toml", home / "serve.log"
    serve_file.write_text("\n".join([
        f"name = {json.dumps(spec.name)}", f"artifact_store = {json.dumps(spec.artifact_store)}", "[serve]",
        f"base_model = {json.dumps(str(model_dir))}", f'adapters = [{{ name = "adapter", source = "runs/{run_id}" }}]',
        'gpu = ["RTX 4090"]', "hours = 1", "budget_usd = 1", f"max_model_len = {spec.training.max_seq_length}",
        f"prompts = [{json.dumps(question)}]", "max_tokens = 24", "cold_start_minutes = 10"]) + "\n")
    proc = subprocess.Popen([sys.executable, "-m", "flows.serve", str(serve_file)], cwd=REPO, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        with phase("Serving the adapter on the tiny model (localpod's stand-in for RunPod's vLLM worker); the serve's "
                   f"log: {log}", "starting the endpoint"):
            base_url = models = None
            while models is None and proc.poll() is None:
                time.sleep(1)
                said = log.read_text(errors="replace")
                # The flow prints them, and Prefect logs its prints: each is the end of a log line.
                url, names = re.search(r"OpenAI base URL: (\S+)$", said, re.M), re.search(r"models: (.+), adapter$",
                                                                                         said, re.M)
                base_url, models = (url[1], names[1]) if url and names else (None, None)
        if base_url is None:
            print(f"\nThe serve ended before it answered:\n{log.read_text(errors='replace')[-3000:]}",
                  file=sys.stderr, flush=True)
            return 1
        headers = {"Authorization": f"Bearer {os.environ['RUNPOD_API_KEY']}"}
        answers = {}
        with httpx.Client(base_url=base_url, headers=headers, timeout=300) as client:
            for label, model in (("base", models), ("adapter", "adapter")):  # the base by the name the serve gave it
                response = client.post("/chat/completions", json={
                    "model": model, "max_tokens": 24, "temperature": 0,
                    "messages": [{"role": "user", "content": question}]}).raise_for_status()
                answers[label] = response.json()["choices"][0]["message"]["content"]
        print(f"\nServed at {base_url} (an OpenAI client's base URL; the RunPod key is its API key)",
              f"  question:        {question}", f"  base answers:    {json.dumps(answers['base'], ensure_ascii=False)}",
              f"  adapter answers: {json.dumps(answers['adapter'], ensure_ascii=False)}", sep="\n", flush=True)
        return 0
    finally:
        with phase("Stopping the serve (its endpoint deleted)", "stopping the serve"):
            subprocess.run([sys.executable, "-m", "flows.serve", "--stop", spec.name], cwd=REPO, capture_output=True,
                           timeout=300)
            try:
                proc.wait(300)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def study_and_report(stack: LocalStack, run_file: str, home: Path, model_dir: Path, links: bool) -> int:
    """Run the study, print its comparison, check the best child's adapter; the exit code."""
    from flows.study import study
    from flows.forms.study import load_study_file

    spec = load_study_file(run_file)
    spec = spec.model_copy(update={"artifact_store": f"file://{home / 'artifacts'}",
                                   "model": spec.model.model_copy(update={"id": str(model_dir)})})
    started = time.time()
    with phase(f"Studying `{spec.name}`: {spec.study.children()} runs, {spec.study.parallel} at a time, through "
               "localpod; Prefect's log follows", "studying"):
        state = study(spec, return_state=True)
    study_id = str(state.state_details.flow_run_id)
    pages = [f"  study page:    {stack.prefect_ui_url}/runs/flow-run/{study_id}"] if links else []
    if not state.is_completed():
        print(f"\nThe study did not complete: {state.message}", *pages, sep="\n", file=sys.stderr, flush=True)
        return 1
    report = state.result()

    def line(row) -> str:
        mark = "best" if report.best is not None and row.index == report.best.index else ""
        outcome = f"{report.metric} {row.metric:.4f}" if row.metric is not None else row.reason[:80]
        return f"  {mark:<4} {row.name:<40} {row.state:<11} {outcome}"

    rows = [line(row) for row in report.rows]
    print(f"\nStudy completed in {time.time() - started:.0f} s ({report.metric}, "
          f"{'highest' if report.maximize else 'lowest'} wins); cost ${report.cost_usd:.4f} of ceilings "
          f"${report.cost_ceiling_usd:.2f}:", *rows, *pages, sep="\n", flush=True)
    if report.best is None:
        return 1
    adapter_dir = Path(report.best.adapter_url.removeprefix("file://"))
    with phase("Checking that the best child's adapter loads with PEFT", "checking the adapter"):
        loaded = check_adapter(model_dir, adapter_dir)
    if not loaded["loads"]:
        print(f"\nThe best child's adapter does not load: {loaded['error']}", file=sys.stderr, flush=True)
        return 1
    print(f"  best adapter:  {adapter_dir}  (loads with PEFT onto {model_dir})", flush=True)
    return 0


def summary_artifact(run_id: str):
    """The run's markdown summary artifact (id, data), or None when the run wrote none (it failed early)."""
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterType

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[run_id]), type=ArtifactFilterType(any_=["markdown"])))
    return next((a for a in found if a.key and a.key.endswith("-summary")), None)


def stop_on_signals() -> None:
    """Ctrl-C and SIGTERM both unwind the `with` blocks, so the servers are stopped. A shell starts a
    background job with SIGINT ignored, and Python keeps it ignored: install the handler anyway."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def wait_for_stop() -> None:
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print(flush=True)  # past the ^C the terminal echoed


@contextmanager
def phase(what: str, doing: str):
    """Say `what` is starting; while it lasts, print "still <doing>" whenever the terminal has been silent
    for SILENCE_S, so a long step never looks like a hang."""
    print(f"{what} ...", flush=True)
    started = time.monotonic()
    done = threading.Event()

    def tick() -> None:
        while not done.wait(1):
            if time.monotonic() - _OUTPUT.last >= SILENCE_S:
                print(f"  ... still {doing} ({time.monotonic() - started:.0f} s)", flush=True)

    ticker = threading.Thread(target=tick, name="demo-progress", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()


class _LastOutput:
    """When this process last wrote to its terminal (Prefect's log lines included)."""

    def __init__(self) -> None:
        self.last = time.monotonic()


class _Watched:
    """A stream that records when it was written to, and otherwise behaves as the one it wraps."""

    def __init__(self, stream, record: _LastOutput) -> None:
        self._stream, self._record = stream, record

    def write(self, text: str) -> int:
        self._record.last = time.monotonic()
        return self._stream.write(text)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


_OUTPUT = _LastOutput()


def watch_output() -> None:
    # Before Prefect is imported: its console log handler keeps the stream it finds then.
    sys.stdout, sys.stderr = _Watched(sys.stdout, _OUTPUT), _Watched(sys.stderr, _OUTPUT)


if __name__ == "__main__":
    sys.exit(main())
