# Two commands do all the set-up on a fresh machine with Python 3.11+ and pip:
#   make demo   install, then run the main job on the embedded local stack
#   make test   install what the tests need, then run them
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Every pip call takes the constraints: a loose torch requirement otherwise pulls a multi-GB CUDA build.
PIP := $(PY) -m pip install --quiet -c constraints-cpu.txt

.PHONY: demo test install

demo: $(VENV)/.installed
	$(PY) deployments/local.py $(ARGS)

test: $(VENV)/.installed
	$(PY) -m pytest $(ARGS)

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml worker_image/pyproject.toml constraints-cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0 hatchling
	$(PIP) -e './worker_image[train]' -e '.[local,test]'
	touch $@
