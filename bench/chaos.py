"""The chaos benchmark, long form: many train runs with faults injected, then the leak and loss figures.

    .venv/bin/python bench/chaos.py --runs 20
    .venv/bin/python bench/chaos.py --runs 40 --concurrency 8 --mix worker-crash=2,preempt=2,api-faults --noise 0.05

    .venv/bin/python bench/chaos.py --team --workers 3 --runs 32 --concurrency 8 --mix all,api-storm=8 --noise 0.08

Starts its own local stack (Prefect server + localpod running the real worker on the CPU) in a
temporary folder, runs `--runs` flows drawn from `--mix` (scenarios of `bench/chaos_scenarios.py`),
`--concurrency` at a time, and prints one line per run and the figures block. Exits 1 when anything
leaked or was lost, or a run did not end as its fault predicts.

With `--team`, the team setup instead (`deployments/team_stack.py`: PostgreSQL, leases in Redis, `--workers`
Prefect workers, the reconcile deployment on an interval; `bench/chaos_team.py`): every run is a deployment run,
and once the `--kill-at`-th run has started, the worker host holding the most running runs is SIGKILLed with
them and started again. Its runs must end Crashed with their endpoints deleted and their slots freed; the
others as their scenarios predict.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from bench.chaos_batch import plan, run_batch  # noqa: E402
from bench.chaos_scenarios import SCENARIOS  # noqa: E402
from bench.chaos_team import TeamChaos, default_kill_at  # noqa: E402
from deployments.local_stack import build_tiny_model  # noqa: E402
from deployments.team_stack import setup_problem  # noqa: E402

DEFAULT_MIX = {kind: 1 for kind in SCENARIOS} | {"api-faults": 2, "worker-crash": 2, "preempt": 2}
MAX_CONCURRENCY = 28  # the local stack's quota is 2 above: more runs at once would only queue for slots


def parse_mix(text: str | None) -> dict[str, int]:
    """`kind=weight,kind,...` (weight 1 when omitted; `all`: every scenario once); None: every scenario, the
    common faults twice."""
    if not text:
        return DEFAULT_MIX
    mix: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        if part == "all":  # every scenario once; later parts change weights
            mix |= dict.fromkeys(SCENARIOS, 1)
            continue
        kind, _, weight = part.partition("=")
        if kind not in SCENARIOS:
            raise SystemExit(f"unknown scenario {kind!r}; known: {', '.join(SCENARIOS)}")
        mix[kind] = int(weight or 1)
    return mix


def draw(mix: dict[str, int], runs: int, seed: int) -> list[str]:
    """`runs` scenario kinds in proportion to the weights (every kind at least once when runs allow), shuffled."""
    cycle = [kind for kind, weight in mix.items() for _ in range(weight)]
    kinds = [cycle[i % len(cycle)] for i in range(runs)]
    random.Random(seed).shuffle(kinds)
    return kinds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20, help="train runs in all (default 20)")
    parser.add_argument("--concurrency", type=int, default=6, help=f"runs at once, at most {MAX_CONCURRENCY} (default 6)")
    parser.add_argument("--mix", help="scenarios and weights, e.g. `oom=2,preempt,api-faults=3` or `all,api-storm=30` (default: all, "
                        f"api-faults/worker-crash/preempt twice); known: {', '.join(SCENARIOS)}")
    parser.add_argument("--max-steps", type=int, default=6, help="training steps per run (default 6)")
    parser.add_argument("--noise", type=float, default=0.0,
                        help="probability of a background 429/500/drop on every control-plane call and status poll "
                        "of every run (default 0: only the scenarios' own faults)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the draw and of the noise (default 1)")
    parser.add_argument("--load-adapters", type=int, default=2, help="completed adapters to load with PEFT (default 2)")
    parser.add_argument("--json", type=Path, help="also write the figures and per-run results to this file")
    parser.add_argument("--keep", action="store_true", help="keep the stack's folder (logs, stores) and print its path")
    parser.add_argument("--team", action="store_true", help="run on the team setup: deployment runs through several "
                        "Prefect workers, PostgreSQL, Redis, one worker host killed mid-batch")
    parser.add_argument("--workers", type=int, default=3, help="with --team: Prefect workers (default 3)")
    parser.add_argument("--kill-at", type=int, help="with --team: kill a worker host once this many runs have "
                        "started (default: half the runs; 0: kill none)")
    args = parser.parse_args(argv)
    if not 1 <= args.concurrency <= MAX_CONCURRENCY:
        parser.error(f"--concurrency must be 1..{MAX_CONCURRENCY}")
    if not 0 <= args.noise < 0.5:
        parser.error("--noise must be in [0, 0.5): more would exhaust the tasks' 5 retries")
    if not args.team and (args.kill_at is not None or args.workers != 3):
        parser.error("--workers and --kill-at need --team")
    if args.team and args.workers < 2 and args.kill_at != 0:
        parser.error("--workers must be at least 2 when a worker host is killed (--kill-at 0 kills none)")
    if args.team and not 0 <= (args.kill_at or 0) <= args.runs:
        parser.error(f"--kill-at must be 0..{args.runs} (the runs)")
    if args.team and (problem := setup_problem()):
        parser.error(problem)

    from deployments.local_stack import LocalStack

    kinds = draw(parse_mix(args.mix), args.runs, args.seed)
    home = Path(tempfile.mkdtemp(prefix="loraflow-chaos-"))
    print(f"chaos: {args.runs} runs, {args.concurrency} at a time, max_steps {args.max_steps}, noise {args.noise}; "
          f"folder {home}", flush=True)
    try:
        model = build_tiny_model(home / "tiny-model")
        options = dict(concurrency=args.concurrency, max_steps=args.max_steps, load_adapters=args.load_adapters,
                       noise=args.noise, seed=args.seed)
        if args.team:
            kill_at = default_kill_at(args.runs) if args.kill_at is None else args.kill_at
            with TeamChaos(home / "stack", workers=args.workers, concurrency=args.concurrency, slots=MAX_CONCURRENCY,
                           model=model, store=home / "defaults", kill_at_run=kill_at) as chaos:
                print(f"chaos: team setup, {args.workers} workers, a worker host killed "
                      f"{f'once run {kill_at} has started' if kill_at else 'never'}", flush=True)
                batch = run_batch(chaos.team.local, plan(kinds, prefix="b"), home / "runs", model, **options,
                                  flows=chaos.flows, host_kill=chaos.killer)
        else:
            with LocalStack(home / "stack", worker_quota=MAX_CONCURRENCY + 2, with_hub=True) as stack:
                batch = run_batch(stack, plan(kinds, prefix="b"), home / "runs", model, **options)
    finally:
        if not args.keep:
            shutil.rmtree(home, ignore_errors=True)
    print(batch.report())
    for record in (r for r in batch.records if r.problems):
        print(f"\n--- {record.name}: {record.scenario.summary}\n" + "\n".join(record.problems))
    print(batch.figures.block())
    if args.json:
        args.json.write_text(json.dumps({
            "figures": asdict(batch.figures),
            "runs": [{"name": r.name, "scenario": r.scenario.kind, "state": r.state_type, "given_up": r.retried,
                      "host_killed": r.host_killed,
                      "gpus": r.gpus_used, "wall_s": round(r.wall_s, 1), "problems": r.problems} for r in batch.records],
        }, indent=2))
    bad = any(batch.figures.leaks_and_losses().values()) or batch.figures.not_as_expected
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
