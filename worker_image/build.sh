#!/usr/bin/env bash
# The worker image's build steps. The Dockerfile's RUN lines call this script, so the same steps run
# without a Docker engine too (a GPU box, CI, a dev machine):
#
#   worker_image/build.sh system                  # apt: Python 3.11 + headers and gcc (Triton compiles its
#                                                 #   launcher at run time), CA certificates
#   worker_image/build.sh deps [--find-links DIR] # the locked GPU stack into $LORAFLOW_VENV (offline from
#                                                 #   a wheel folder with --find-links)
#   worker_image/build.sh worker                  # the worker package, no dependencies, into $LORAFLOW_VENV
#   worker_image/build.sh verify                  # the installed stack is consistent and imports
#   worker_image/build.sh check [--target DIR]    # no GPU, offline: the lock parses and pins everything the
#                                                 #   .in asks for; the worker installs --no-deps into DIR
#   worker_image/build.sh tag                     # the image tag these settings build (see README.md)
#   worker_image/build.sh contract-version [--expect N]  # the job contract the worker speaks (contract/version.py's
#                                                 #   CONTRACT_VERSION); with --expect, fail unless it is N
#
# Settings (environment): LORAFLOW_VENV (default /opt/venv), PYTHON (the interpreter that creates the venv
# and runs `check`; default python3), TORCH_CUDA_ARCH_LIST (SM architectures, default
# "8.0;8.6;8.9;9.0;10.0;12.0"), IMAGE_REPO (default loraflow-worker), BUILD_CA (an extra CA bundle pip
# trusts in `deps`, for a build behind a TLS-intercepting proxy; default build-ca/ca.crt beside this
# script, when it exists).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
LOCK="$HERE/requirements-gpu.lock"
REQUIREMENTS_IN="$HERE/requirements-gpu.in"
LORAFLOW_VENV="${LORAFLOW_VENV:-/opt/venv}"
PYTHON="${PYTHON:-python3}"
TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-8.0;8.6;8.9;9.0;10.0;12.0}"
IMAGE_REPO="${IMAGE_REPO:-loraflow-worker}"
# torch 2.14.0 from PyPI (what the lock resolves) is built against CUDA 13.0: hosts need driver >= 580.
CUDA_TAG="cu130"

die() { echo "build.sh: $*" >&2; exit 1; }

worker_version() {
    sed -n 's/^version = "\(.*\)"$/\1/p' "$HERE/pyproject.toml" | head -n 1
}

contract_version() {
    # Read, not imported: the tag is computed where the worker's dependencies may not be installed.
    local version
    version="$(sed -n 's/^CONTRACT_VERSION = \([0-9][0-9]*\)\([^0-9].*\)\{0,1\}$/\1/p' "$HERE/loraflow_worker/contract/version.py")"
    [[ "$version" =~ ^[0-9]+$ ]] || die "no 'CONTRACT_VERSION = <N>' line in $HERE/loraflow_worker/contract/version.py"
    echo "$version"
}

step_tag() {
    # loraflow-worker:<worker version>-contract<N>-cu130-sm<arch>[-<arch>...], e.g.
    # loraflow-worker:0.1.0-contract5-cu130-sm90. The control plane reads `contract<N>` from the tag and refuses a
    # run whose image speaks another job contract before renting a GPU for it.
    local archs
    archs="$(echo "$TORCH_CUDA_ARCH_LIST" | tr ';, ' '\n' | sed -e 's/+PTX//' -e 's/\.//' | grep -v '^$' | paste -sd- -)"
    [[ -n "$archs" ]] || die "TORCH_CUDA_ARCH_LIST is empty: give SM architectures like '9.0' or '8.0;8.9;9.0'"
    echo "${IMAGE_REPO}:$(worker_version)-contract$(contract_version)-${CUDA_TAG}-sm${archs}"
}

step_contract_version() {
    local version
    version="$(contract_version)"
    if [[ "${1:-}" == "--expect" ]]; then
        # The Dockerfile's label comes from a build arg: an image must not carry a label its code contradicts.
        [[ "${2:-}" == "$version" ]] || die "the build says contract version '${2:-}' and contract/version.py says $version: \
build with --build-arg CONTRACT_VERSION=\$(worker_image/build.sh contract-version) (image.sh build does)"
    fi
    echo "$version"
}

step_system() {
    export DEBIAN_FRONTEND=noninteractive
    apt-get update
    apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev ca-certificates
    rm -rf /var/lib/apt/lists/*
}

step_deps() {
    local pip_args=(--no-deps --require-hashes -r "$LOCK")
    if [[ "${1:-}" == "--find-links" ]]; then
        [[ -d "${2:-}" ]] || die "--find-links needs a folder of wheels, got '${2:-}'"
        pip_args=(--no-index --find-links "$2" "${pip_args[@]}")
    fi
    local ca="${BUILD_CA:-$HERE/build-ca/ca.crt}"
    if [[ -f "$ca" ]]; then
        pip_args=(--cert "$ca" "${pip_args[@]}")
    fi
    [[ -x "$LORAFLOW_VENV/bin/python" ]] || "$PYTHON" -m venv "$LORAFLOW_VENV"
    # The lock is complete (every transitive package pinned with hashes), so nothing is resolved here. Three small
    # pure-Python packages of lm-eval exist only as source (see requirements-gpu.in): pip builds them with setuptools,
    # which an offline build's wheel folder must hold.
    "$LORAFLOW_VENV/bin/python" -m pip install --no-cache-dir "${pip_args[@]}"
}

step_worker() {
    # hatchling comes from the lock, so the build needs no index (--no-build-isolation).
    "$LORAFLOW_VENV/bin/python" -m pip install --no-cache-dir --no-deps --no-index --no-build-isolation "$HERE"
}

step_verify() {
    "$LORAFLOW_VENV/bin/python" -m pip check
    "$LORAFLOW_VENV/bin/python" - <<'PY'
import importlib.metadata as md
import torch, transformers, trl, peft, wandb, mlflow, lm_eval  # noqa: F401  the training stack, trackers and harness
import loraflow_worker.handler, loraflow_worker.training.grpo, loraflow_worker.gpu_smoke.runner  # noqa: F401
import loraflow_worker.evaluation.benchmarks  # noqa: F401
print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__,
      "trl", trl.__version__, "peft", peft.__version__, "runpod", md.version("runpod"),
      "wandb", wandb.__version__, "mlflow", mlflow.__version__, "lm-eval", md.version("lm-eval"),
      "loraflow-worker", md.version("loraflow-worker"))
PY
}

step_check() {
    local target=""
    if [[ "${1:-}" == "--target" ]]; then
        target="${2:?--target needs a folder}"
    fi
    "$PYTHON" - "$LOCK" "$REQUIREMENTS_IN" <<'PY'
import sys
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

lock_path, in_path = sys.argv[1:]
text = open(lock_path).read().replace("\\\n", " ")
locked = {}
for number, line in enumerate(text.splitlines(), 1):
    line = line.split("#", 1)[0].strip()
    if not line:
        continue
    spec, *options = line.split(" --")
    requirement = Requirement(spec.strip())
    specifiers = list(requirement.specifier)
    if len(specifiers) != 1 or specifiers[0].operator != "==":
        sys.exit(f"{lock_path}: `{spec.strip()}` is not pinned with ==")
    if not any(option.startswith("hash=sha256:") for option in options):
        sys.exit(f"{lock_path}: `{requirement.name}` has no sha256 hash (regenerate with --generate-hashes)")
    name = canonicalize_name(requirement.name)
    if name in locked:
        sys.exit(f"{lock_path}: `{requirement.name}` is pinned twice")
    locked[name] = specifiers[0].version
for line in open(in_path):
    line = line.split("#", 1)[0].strip()
    if not line:
        continue
    wanted = Requirement(line)
    version = locked.get(canonicalize_name(wanted.name))
    if version is None or not wanted.specifier.contains(version, prereleases=True):
        sys.exit(f"{lock_path} is out of date: {in_path} asks for `{line}`, the lock has {version}; re-run uv pip compile")
print(f"lock ok: {len(locked)} packages pinned with hashes; torch {locked['torch']}, vllm {locked['vllm']}, "
      f"transformers {locked['transformers']}")
PY
    if [[ -n "$target" ]]; then
        "$PYTHON" -c "import hatchling" 2>/dev/null \
            || die "$PYTHON cannot import hatchling (the worker's build backend; the image takes it from the lock): pip install hatchling"
        "$PYTHON" -m pip install --quiet --no-deps --no-index --no-build-isolation --target "$target" "$HERE"
        PYTHONPATH="$target" "$PYTHON" - "$target" <<'PY'
import sys
from pathlib import Path

import loraflow_worker
import loraflow_worker.contract  # noqa: F401  light: pydantic only

installed = Path(loraflow_worker.__file__).resolve().parent
if Path(sys.argv[1]).resolve() not in installed.parents:
    sys.exit(f"loraflow_worker imported from {installed}, not from the install target {sys.argv[1]}")
modules = sorted(".".join(p.relative_to(installed).with_suffix("").parts) for p in installed.rglob("*.py"))
for needed in ("handler", "training.sft", "training.grpo", "training.rewards", "training.fast_paths", "gpu_smoke.runner"):
    if needed not in modules:
        sys.exit(f"the installed worker lacks {needed.replace('.', '/')}.py")
print(f"worker ok: {len(modules)} modules installed --no-deps into {sys.argv[1]}")
PY
    fi
}

case "${1:-}" in
    system) step_system ;;
    deps) shift; step_deps "$@" ;;
    worker) step_worker ;;
    verify) step_verify ;;
    check) shift; step_check "$@" ;;
    tag) step_tag ;;
    contract-version) shift; step_contract_version "$@" ;;
    all) step_system; step_deps; step_worker; step_verify ;;
    *) die "usage: build.sh system|deps [--find-links DIR]|worker|verify|check [--target DIR]|tag|contract-version [--expect N]|all" ;;
esac
