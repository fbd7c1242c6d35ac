# Two entry points (see README): `make run` and `make test`. Both build what they need from
# nothing but a Python 3.10+ interpreter: a virtual environment in .venv, the package and its
# dependencies, and the native CUDA library when a CUDA toolkit is present.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PROMPT ?= def parse_args(
EXTRAS ?= test
STAMP  := $(VENV)/.installed

.PHONY: setup native run test test-gpu clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	touch $(STAMP)

setup: $(STAMP) native

# Builds openjet_plugin/native/libopenjet.so when nvcc is found; says why not otherwise.
native: $(STAMP)
	$(PY) -m openjet_plugin.build_native

run: setup
	$(VENV)/bin/openjet generate "$(PROMPT)" --max-tokens 64

test: setup
	$(PY) -m pytest -q -ra

test-gpu: setup
	$(PY) -m pytest -q -ra -m gpu

clean:
	rm -rf $(VENV) build openjet_plugin/native/*.so
