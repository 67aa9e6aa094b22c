"""Run the main job on the embedded local stack: no cloud account, no download, CPU only.

    make demo                                   # install, then run this
    .venv/bin/python deployments/local.py       # run it again
    .venv/bin/python deployments/local.py --keep   # leave the Prefect UI up afterwards (Ctrl-C stops it)

It starts a Prefect server (SQLite) and localpod, builds a tiny Qwen3-architecture model offline,
runs the `train` flow for a short LoRA SFT run through localpod, checks that the adapter loads with
PEFT, prints where everything is, and stops what it started. Exit code 0 only if the run completed
and its adapter exists.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from deployments.local_stack import LocalStack, build_tiny_model, check_adapter  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-file", default=str(REPO / "deployments" / "local.toml"), help="TOML run file to train.")
    parser.add_argument("--home", default=str(REPO / ".local"), help="Folder for the stack's state, the model and artifacts.")
    parser.add_argument("--keep", action="store_true", help="Keep the Prefect server running after the run, for the UI.")
    args = parser.parse_args()
    home = Path(args.home).resolve()
    os.chdir(REPO)

    model_dir = home / "tiny-model"
    if not (model_dir / "config.json").exists():
        print(f"Building the tiny model in {model_dir} ...", flush=True)
        build_tiny_model(model_dir)

    print("Starting the local Prefect server and localpod ...", flush=True)
    with LocalStack(home / "stack") as stack:
        os.environ.update(stack.client_env)
        # Prefect reads its settings when first imported: import it only now that the env points at the stack.
        from flows.spec import load_run_file
        from flows.train import train

        spec = load_run_file(args.run_file)
        spec = spec.model_copy(update={"artifact_store": f"file://{home / 'artifacts'}",
                                       "model": spec.model.model_copy(update={"id": str(model_dir)})})
        started = time.time()
        state = train(spec, return_state=True)
        run_id = state.state_details.flow_run_id
        run_page = f"{stack.prefect_ui_url}/runs/flow-run/{run_id}"
        if not state.is_completed():
            print(f"\nThe run did not complete: {state.message}\nRun page: {run_page}", file=sys.stderr)
            return 1
        results = state.result()
        adapter_dir = Path(results.adapter_url.removeprefix("file://"))
        # The promise of a run: an adapter that loads with PEFT on its base model.
        report = check_adapter(model_dir, adapter_dir)
        if not report["loads"]:
            print(f"\nThe run completed but its adapter does not load: {report['error']}", file=sys.stderr)
            return 1
        metrics = results.result.metrics
        print(
            f"\nRun completed in {time.time() - started:.0f} s: {metrics.steps} steps, loss "
            f"{metrics.first_loss:.3f} -> {metrics.final_loss:.3f} on {metrics.device}\n"
            f"  adapter:  {adapter_dir}\n"
            f"  metrics:  {adapter_dir.parent / 'metrics.json'}"
        )
        if not args.keep:
            print("  (the local Prefect server has stopped; `make demo ARGS=--keep` keeps it and its UI up)")
        else:
            print(f"\nThe run's page: {run_page}\nPrefect UI at {stack.prefect_ui_url}; press Ctrl-C to stop the local stack.")
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
