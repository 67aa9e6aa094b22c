#!/usr/bin/env bash
# GPU smoke run: trains a random-init Qwen3.5 model with a real vocabulary (151,936 tokens, hidden 2048) through the
# real worker code and prints, per run, tokens/s, torch's reserved peak and the device's own peak, what engaged, and
# the machine's library versions (python -m loraflow_worker.gpu_smoke; see README.md). By default it fits a lent GPU
# machine's slot: 420 s for SFT (all fast paths, then without Liger, without fla), QLoRA SFT and GRPO without vLLM.
# --memory calibrates the memory plan instead: its estimate beside the measured peaks, 330 s of runs.
# --bf16 shows what bf16 does to training instead (probes, head copies at 1e-5, memory of qlora/modules-to-save/dpo), 400 s.
#
#   worker_image/gpu_smoke.sh                             # $PYTHON already has the stack (e.g. in the image)
#   worker_image/gpu_smoke.sh --carried .whl              # a lent machine: its own torch, plus the carried wheels
#   worker_image/gpu_smoke.sh --carried .whl --memory     # a lent machine: the memory plan against the peaks, <= 8 min
#   worker_image/gpu_smoke.sh --carried .whl --bf16       # a lent machine: what bf16 does to training, <= 8 min
#   worker_image/gpu_smoke.sh --pack .whl                 # here, with registry access: fill .whl for --carried
#   worker_image/gpu_smoke.sh --wheels /path/to/wheels    # a bare GPU box: the whole lock from that wheel folder
#   worker_image/gpu_smoke.sh --variants all,no-liger,no-vllm --deadline 900   # other runs, 15 minutes at most
#   PYTHON=.venv-worker/bin/python worker_image/gpu_smoke.sh --cpu --steps 2 --warmup 1 --variants all   # the CPU check the tests run
#   worker_image/gpu_smoke.sh --list                      # every variant, what it changes or checks; runs nothing
#
# Other options go to python -m loraflow_worker.gpu_smoke: --variants A,B,..., --steps N (timed), --warmup N,
# --deadline S, --out DIR, --variant-timeout S, --allow-busy-gpu.
# Settings (environment): PYTHON (default python3), SMOKE_VENV (default /tmp/loraflow-smoke-venv, for --wheels),
# SMOKE_SITE (default /tmp/loraflow-smoke-site, for --carried), PACK_PYTHON_VERSION (default 3.12, for --pack: a
# lent machine's Python).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python3}"
SMOKE_VENV="${SMOKE_VENV:-/tmp/loraflow-smoke-venv}"
SMOKE_SITE="${SMOKE_SITE:-/tmp/loraflow-smoke-site}"
PACK_PYTHON_VERSION="${PACK_PYTHON_VERSION:-3.12}"
# What a lent GPU machine lacks of the worker's stack, or has at other versions (its own list: KINDS.md of the
# device tool; torch, triton, numpy, pandas, pyarrow, tokenizers, safetensors, accelerate, psutil and nvidia-ml-py
# are there). flash-linear-attention is left out on purpose: with the torch 2.11 / triton 3.6 of those machines fla
# refuses its Hopper backward (fla issue 640, README.md), and tilelang, its way around, is too large to carry.
PACK_PACKAGES=(transformers trl peft datasets dill multiprocess huggingface-hub hf-xet httpx2 httpcore2 truststore idna
               anyio h11 pydantic pydantic-core annotated-types typing-inspection typing-extensions click fsspec regex
               liger-kernel bitsandbytes backoff)
PACK_LIMIT_BYTES=$((56 * 1024 * 1024))  # a lent machine takes 64 MiB of carried files with the working tree (~3 MiB)

locked_version() {
    sed -n "s/^$1==\([^ ]*\) .*/\1/p" "$HERE/requirements-gpu.lock"
}

if [[ "${1:-}" == "--pack" ]]; then
    dest="${2:?--pack needs the folder to fill (e.g. .whl, ignored by git)}"
    mkdir -p "$dest"
    specs=()
    for name in "${PACK_PACKAGES[@]}"; do
        version="$(locked_version "$name")"
        [[ -n "$version" ]] || { echo "gpu_smoke.sh: $name is not in requirements-gpu.lock" >&2; exit 1; }
        specs+=("$name==$version")
    done
    # The platform tags a manylinux x86_64 machine takes; pip matches each tag exactly.
    platforms=()
    for tag in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
        platforms+=(--platform "${tag}_x86_64")
    done
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "$PACK_PYTHON_VERSION" \
        --implementation cp "${platforms[@]}" -d "$dest" "${specs[@]}"
    # bitsandbytes ships one library per CUDA and ROCm version (~43 MB); a lent machine's torch is a CUDA 13 build, so
    # only the CUDA 13 and CPU libraries travel (pip installs a wheel's files without checking them against RECORD).
    "$PYTHON" - "$dest" <<'EOF'
import re, sys, zipfile
from pathlib import Path

for wheel in Path(sys.argv[1]).glob("bitsandbytes-*.whl"):
    keep = re.compile(r"libbitsandbytes_(cpu|cuda13\d)\.so$")
    slim = wheel.with_suffix(".slim")
    with zipfile.ZipFile(wheel) as whole, zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as kept:
        for item in whole.infolist():
            if not item.filename.endswith(".so") or keep.search(item.filename):
                kept.writestr(item, whole.read(item.filename))
    slim.replace(wheel)
EOF
    total=$(du -cb "$dest"/*.whl | tail -1 | cut -f1)
    echo "gpu_smoke.sh: $dest holds $(ls "$dest"/*.whl | wc -l) wheels, $((total / 1024 / 1024)) MiB"
    if (( total > PACK_LIMIT_BYTES )); then
        echo "gpu_smoke.sh: over the $((PACK_LIMIT_BYTES / 1024 / 1024)) MiB that fit beside the working tree" >&2
        exit 1
    fi
    exit 0
fi

if [[ "${1:-}" == "--carried" ]]; then
    wheels="${2:?--carried needs the folder --pack filled}"
    shift 2
    started=$SECONDS
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SMOKE_SITE" "$wheels"/*.whl
    export PYTHONPATH="$SMOKE_SITE${PYTHONPATH:+:$PYTHONPATH}"
    echo "gpu_smoke.sh: installed $(ls "$wheels"/*.whl | wc -l) carried wheels into $SMOKE_SITE in $((SECONDS - started)) s"
    # What the carried wheels need from the machine's own packages (datasets 5.2 needs pyarrow >= 24, for one).
    { "$PYTHON" -m pip show numpy pandas pyarrow tokenizers safetensors accelerate psutil 2>/dev/null || true; } \
        | sed -n 's/^\(Name\|Version\): //p' | paste -sd' ' | sed 's/^/gpu_smoke.sh: the machine has /'
elif [[ "${1:-}" == "--wheels" ]]; then
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
