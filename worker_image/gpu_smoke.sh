#!/usr/bin/env bash
# GPU smoke run: trains a random-init Qwen3.5 model with a real vocabulary (151,936 tokens, hidden 2048) for SFT
# and GRPO steps through the real worker code, with the fast paths the plan engages and then without each, and
# prints what engaged, the tokens/s of each variant over its timed steps, and the completions vLLM generated
# (python -m loraflow_worker.gpu_smoke; see README.md).
#
#   worker_image/gpu_smoke.sh --wheels /path/to/wheels   # a bare GPU box: install the locked stack from
#                                                         # that wheel folder into $SMOKE_VENV, then run
#   worker_image/gpu_smoke.sh                             # $PYTHON already has the stack (e.g. in the image)
#   worker_image/gpu_smoke.sh --variants all,no-liger,no-vllm --deadline 900   # some variants, 15 minutes at most
#   PYTHON=.venv-worker/bin/python worker_image/gpu_smoke.sh --cpu --steps 2 --warmup 1 --variants all   # the CPU check the tests run
#
# Other options go to gpu_smoke.py: --variants A,B,..., --steps N (timed), --warmup N, --deadline S, --out DIR,
# --variant-timeout S.
# Settings (environment): PYTHON (default python3), SMOKE_VENV (default /tmp/loraflow-smoke-venv).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python3}"
SMOKE_VENV="${SMOKE_VENV:-/tmp/loraflow-smoke-venv}"

if [[ "${1:-}" == "--wheels" ]]; then
    wheels="${2:?--wheels needs a folder of wheels for requirements-gpu.lock}"
    shift 2
    started=$SECONDS
    LORAFLOW_VENV="$SMOKE_VENV" PYTHON="$PYTHON" bash "$HERE/build.sh" deps --find-links "$wheels"
    LORAFLOW_VENV="$SMOKE_VENV" bash "$HERE/build.sh" worker
    echo "gpu_smoke.sh: installed the stack in $((SECONDS - started)) s"
    PYTHON="$SMOKE_VENV/bin/python"
fi

# One thread per process: the CPU variant shares the machine with the tests; on a GPU it does not matter.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# The worker package of this folder, installed or not; relative paths (PYTHON, --out) stay the caller's.
export PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" -m loraflow_worker.gpu_smoke "$@"
