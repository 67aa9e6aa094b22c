# Two commands do all the set-up on a fresh machine with Python 3.11+ and pip:
#   make demo   install, then run the main job on the embedded local stack
#   make test   install what the tests need, then run them
#
# Two environments, as in production, where the worker runs in its image and the flows elsewhere:
#   .venv         the control plane, localpod and the control-plane tests (Prefect; no training stack)
#   .venv-worker  the worker: the image's locked versions (worker_image/cpu-constraints.txt, generated
#                 from worker_image/requirements-gpu.lock) with the CPU torch; localpod's workers and the
#                 worker's tests run with its interpreter
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
WORKER_VENV := .venv-worker
WORKER_PY := $(WORKER_VENV)/bin/python
# Every pip call takes constraints: a loose torch requirement otherwise pulls a multi-GB CUDA build.
PIP := $(PY) -m pip install --quiet -c constraints-cpu.txt
WORKER_PIP := $(WORKER_PY) -m pip install --quiet -c worker_image/cpu-constraints.txt
DOCKER ?= docker

.PHONY: demo test install system-packages image image-test control-plane-image

demo: $(VENV)/.installed $(WORKER_VENV)/.installed
	$(PY) deployments/local.py $(ARGS)

test: system-packages $(VENV)/.installed $(WORKER_VENV)/.installed
	$(WORKER_PY) -m pytest worker_image/tests $(ARGS)
	$(PY) -m pytest tests $(ARGS)

install: $(VENV)/.installed $(WORKER_VENV)/.installed

# Debian's packages the tests start: headless Chromium (the UI tests), PostgreSQL and Redis (the team
# setup's tests). Installed when missing (as root, or through sudo).
SYSTEM_PACKAGES := chromium postgresql redis-server
system-packages:
	@missing=$$(for p in $(SYSTEM_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		sudo=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		echo "installing Debian packages: $$missing"; \
		$$sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -qq --no-install-recommends $$missing; \
	fi

$(VENV)/.installed: pyproject.toml worker_image/pyproject.toml constraints-cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) -e ./worker_image -e '.[local,test]'
	touch $@

$(WORKER_VENV)/.installed: worker_image/pyproject.toml worker_image/cpu-constraints.txt
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11) and "the worker environment needs Python 3.11, the image'"'"'s (the lock is compiled for it): make PYTHON=python3.11")'
	$(PYTHON) worker_image/cpu_constraints.py --check
	test -x $(WORKER_PY) || $(PYTHON) -m venv $(WORKER_VENV)
	$(WORKER_PIP) torch hatchling
	$(WORKER_PIP) -e './worker_image[train,test]' liger-kernel triton
	touch $@

# The worker image (the real lock, GPU packages included), built from Debian's packages when no
# registry serves the base image; then its own checks and a short SFT and GRPO job inside it, on the CPU.
image:
	bash worker_image/image.sh build

image-test: system-packages $(VENV)/.installed $(WORKER_VENV)/.installed
	bash worker_image/image.sh test

# The control-plane image of the Docker work pool, as `prefect deploy --prefect-file deployments/docker/prefect.yaml`
# builds it (offline: CONTROL_PLANE_BASE=loraflow-base:bookworm, made by worker_image/base_image.sh).
CONTROL_PLANE_BASE ?= python:3.11-slim-bookworm
control-plane-image:
	bash deployments/docker/build_ca.sh copy
	$(DOCKER) build --network host --build-arg BASE_IMAGE=$(CONTROL_PLANE_BASE) -f deployments/docker/Dockerfile \
		-t loraflow-control-plane . ; rc=$$?; bash deployments/docker/build_ca.sh remove; exit $$rc
