#!/usr/bin/env bash
# GPU smoke run: trains a small random-init Qwen3.5 model for a few SFT and GRPO steps through the real
# worker code with every fast path that is installed, then with each switched off, and prints what
# engaged and the tokens/s of each variant (python -m loraflow_worker.gpu_smoke; see README.md).
#
#   worker_image/gpu_smoke.sh --wheels /path/to/wheels   # a bare GPU box: install the locked stack from
#                                                         # that wheel folder into $SMOKE_VENV, then run
#   worker_image/gpu_smoke.sh                             # $PYTHON already has the stack (e.g. in the image)
#   PYTHON=.venv/bin/python worker_image/gpu_smoke.sh --cpu --steps 2   # the CPU check the tests run
#
# Other options go to gpu_smoke.py: --steps N, --out DIR, --variant-timeout S.
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
cd "$HERE"
exec "$PYTHON" -m loraflow_worker.gpu_smoke "$@"
