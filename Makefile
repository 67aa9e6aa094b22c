# Two commands do all the set-up on a fresh machine with Python 3.11+ and pip:
#   make demo   install, then run the main job on the embedded local stack
#   make test   install what the tests need, then run them
#
# Two environments, as in production, where the worker runs in its image and the flows elsewhere:
#   .venv         the control plane, localpod and the control-plane tests (Prefect; no training stack):
#                 exactly the versions of requirements.lock (`make lock` writes it from the two pyproject.toml)
#   .venv-worker  the worker: the image's locked versions (worker_image/cpu-constraints.txt, generated
#                 from worker_image/requirements-gpu.lock) with the CPU torch; localpod's workers and the
#                 worker's tests run with its interpreter
# Both are installed by uv, at once: pip took ~4 minutes for the two on 2 cores, one package at a time.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
WORKER_VENV := .venv-worker
WORKER_PY := $(WORKER_VENV)/bin/python
DOCKER ?= docker

# uv, pinned, in a folder of its own (pip puts it there once); UV=uv uses one already on PATH.
UV_VERSION := 0.13.9
TOOLS := .tools
UV_DEFAULT := $(TOOLS)/uv-$(UV_VERSION)/bin/uv
UV ?= $(UV_DEFAULT)
UV_BOOTSTRAP := $(filter $(UV_DEFAULT),$(UV))
# uv reads no pip configuration: where pip finds wheels beside the index (here the CPU torch) must reach it.
UV_FIND_LINKS ?= $(PIP_FIND_LINKS)
ifneq ($(strip $(UV_FIND_LINKS)),)
export UV_FIND_LINKS
endif
# Behind a TLS-intercepting proxy its CA is in the system store (or SSL_CERT_FILE, which uv reads too), not in
# the roots uv carries.
export UV_SYSTEM_CERTS ?= 1
# The environments are made with $(PYTHON), never with an interpreter uv would download.
export UV_PYTHON_DOWNLOADS := never
UV_PIP := $(UV) pip install --quiet
# uv writes no bytecode, and where PYTHONDONTWRITEBYTECODE is set (the machines that run the tests set it) Python
# writes none either: every process would compile the modules it imports again (torch, transformers and TRL: 8 s
# of CPU in each training process). pip compiled all 24k modules (a minute of CPU); importing what the processes
# import, with bytecode written, compiles only those, once. A module left off these lists is only slower to import.
WORKER_WARM := import torch, transformers, trl, peft, accelerate, datasets, runpod, lm_eval; \
	from transformers import AutoModelForCausalLM, AutoTokenizer; from transformers.models.qwen3 import modeling_qwen3; \
	from trl import SFTConfig, SFTTrainer, GRPOConfig, GRPOTrainer
CONTROL_PLANE_WARM := import prefect, prefect.cli, prefect.server.api.server, prefect_redis, prefect_docker, \
	httpx, fastapi, uvicorn, jsonschema, huggingface_hub, matplotlib.pyplot, pytest, tokenizers, jinja2.sandbox; \
	from transformers import AutoTokenizer
WITH_BYTECODE := env -u PYTHONDONTWRITEBYTECODE
# The interpreter $(PYTHON) names, resolved (a pyenv shim or a bare `python3` becomes the real one).
PYTHON_EXE = $$($(PYTHON) -c 'import sys; print(sys.executable)')

.PHONY: demo test install lock system-packages team-demo image image-test control-plane-image

# When make started: the demo's installing is the time from here to its run.
STARTED := $(shell date +%s.%N)
demo: install
	@installed=$$(date +%s.%N); \
	awk "BEGIN { printf \"make demo: installing took %.0f s\n\", $$installed - $(STARTED) }"; \
	$(PY) deployments/local.py $(ARGS); rc=$$?; \
	ended=$$(date +%s.%N); \
	awk "BEGIN { printf \"make demo: installing took %.0f s, the run %.0f s (%.0f s in all)\n\", \
		$$installed - $(STARTED), $$ended - $$installed, $$ended - $(STARTED) }"; \
	exit $$rc

# The worker's tests two modules at a time (pytest-xdist, a module per unit: they train on the CPU, ~4.5 min on 2 cores
# against ~6.5 one after the other); the control plane's as its pyproject.toml says.
test: system-packages install
	$(WORKER_PY) -m pytest worker_image/tests -n 2 --dist loadfile $(ARGS)
	$(PY) -m pytest tests $(ARGS)

# The two environments share nothing but uv's cache: they install side by side.
install:
	@$(MAKE) --no-print-directory -j2 $(VENV)/.installed $(WORKER_VENV)/.installed

# Debian's packages the tests start: headless Chromium (the UI tests), PostgreSQL and Redis (the team
# setup's tests). Installed when missing (as root, or through sudo). A target may need fewer (team-demo).
SYSTEM_PACKAGES := chromium postgresql redis-server
system-packages:
	@missing=$$(for p in $(SYSTEM_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	missing=$$(echo $$missing); \
	if [ -n "$$missing" ]; then \
		command -v apt-get >/dev/null || { echo "make: needs Debian's $$missing (no apt-get here: install them with this system's package manager)" >&2; exit 1; }; \
		if [ "$$(id -u)" = 0 ]; then sudo=; elif command -v sudo >/dev/null; then sudo=sudo; \
		else echo "make: installing Debian's $$missing needs root: run 'apt-get install $$missing' as root" >&2; exit 1; fi; \
		echo "installing Debian packages: $$missing"; \
		$$sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -qq --no-install-recommends $$missing; \
	fi

$(UV_DEFAULT):
	$(PYTHON) -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-deps \
		--target $(TOOLS)/uv-$(UV_VERSION) uv==$(UV_VERSION)

# The control plane's lock, for .venv and the control-plane image (deployments/docker/Dockerfile): every package
# of pyproject.toml's closure (extras local and test) with worker_image's core, for any platform with Python
# 3.11+. Run after changing a dependency in either pyproject.toml; versions already locked stay where they can
# (tests/test_control_plane_lock.py fails while the lock and the requirements disagree).
lock: | $(UV_BOOTSTRAP)
	printf -- '-e .[local,test]\n-e ./worker_image\n' | $(UV) pip compile --quiet --universal --python-version 3.11 \
		--no-emit-package loraflow --no-emit-package loraflow-worker --custom-compile-command 'make lock' \
		-o requirements.lock -

$(VENV)/.installed: pyproject.toml worker_image/pyproject.toml requirements.lock | $(UV_BOOTSTRAP)
	@echo "installing $(VENV): the control plane, as requirements.lock pins it"
	@test -x $(PY) || $(UV) venv --quiet --python "$(PYTHON_EXE)" $(VENV)
	@$(UV_PIP) --python $(PY) -c requirements.lock -e ./worker_image -e '.[local,test]' \
		|| { echo "make: $(VENV) did not install; after a change of pyproject.toml's dependencies, run 'make lock'" >&2; exit 1; }
	@$(WITH_BYTECODE) $(PY) -c '$(CONTROL_PLANE_WARM)'
	@touch $@

# torch is the CPU wheel (cpu-constraints.txt pins its +cpu build: PyPI's torch of the same version is a CUDA
# build of several GB). pip: the worker installs a run's extra packages with it; hatchling: the wheel test
# builds the worker without an index.
$(WORKER_VENV)/.installed: worker_image/pyproject.toml worker_image/cpu-constraints.txt | $(UV_BOOTSTRAP)
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11) and "the worker environment needs Python 3.11, the image'"'"'s (the lock is compiled for it): make PYTHON=python3.11")'
	@$(PYTHON) worker_image/cpu_constraints.py --check
	@echo "installing $(WORKER_VENV): the worker image's locked stack with the CPU torch"
	@test -x $(WORKER_PY) || $(UV) venv --quiet --python "$(PYTHON_EXE)" $(WORKER_VENV)
	@$(UV_PIP) --python $(WORKER_PY) -c worker_image/cpu-constraints.txt \
		pip hatchling torch -e './worker_image[train,test]' liger-kernel triton \
		|| { echo "make: $(WORKER_VENV) did not install; if uv found no $$(grep '^torch==' worker_image/cpu-constraints.txt): name a folder or page holding that wheel in PIP_FIND_LINKS or UV_FIND_LINKS" >&2; exit 1; }
	@$(WITH_BYTECODE) $(WORKER_PY) -c '$(WORKER_WARM); import sys; \
		sys.exit(torch.version.cuda and f"$(WORKER_VENV) got a CUDA build of torch ({torch.__version__})")'
	@touch $@

# The team setup on this machine (docs/team.md): PostgreSQL, Redis, a Prefect server, localpod and 3
# Prefect workers, then 6 tiny-model runs on 2 slots. ARGS replaces the demo's options (ARGS="--workers 3"
# keeps the stack up until Ctrl-C).
TEAM_DEMO_ARGS := --runs 6 --quota 2
team-demo: SYSTEM_PACKAGES := postgresql redis-server
team-demo: system-packages install
	$(PY) -m deployments.team_stack $(if $(ARGS),$(ARGS),$(TEAM_DEMO_ARGS))

# The worker image (the real lock, GPU packages included), built from Debian's packages when no
# registry serves the base image; then its own checks and a short SFT and GRPO job inside it, on the CPU.
image:
	bash worker_image/image.sh build

image-test: system-packages install
	bash worker_image/image.sh test

# The control-plane image of the Docker work pool, as `prefect deploy --prefect-file deployments/docker/prefect.yaml`
# builds it (offline: CONTROL_PLANE_BASE=loraflow-base:bookworm, made by worker_image/base_image.sh).
CONTROL_PLANE_BASE ?= python:3.11-slim-bookworm
control-plane-image:
	@$(DOCKER) info >/dev/null 2>&1 || { echo "make: no Docker engine answers '$(DOCKER) info': start dockerd (apt-get install docker.io), or set DOCKER" >&2; exit 1; }
	bash deployments/docker/build_ca.sh copy
	$(DOCKER) build --network host --build-arg BASE_IMAGE=$(CONTROL_PLANE_BASE) -f deployments/docker/Dockerfile \
		-t loraflow-control-plane . ; rc=$$?; bash deployments/docker/build_ca.sh remove; exit $$rc
