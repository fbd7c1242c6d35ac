# Two entry points (see README): `make run` and `make test`. Both build what they need from
# nothing but a Python 3.10+ interpreter: a virtual environment in .venv, llama-cpp-python built
# for this host (openjet_plugin/setup_llama.py: the instruction sets this machine runs, CUDA where
# a GPU and a toolkit are present), the package and its dependencies, and the native CUDA library
# when a GPU is visible (or OPENJET_CUDA_ARCHS asks for it). Nothing is rebuilt that is current.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PROMPT ?= def parse_args(
EXTRAS ?= test
comma  := ,
STAMP  := $(VENV)/.installed-$(subst $(comma),-,$(EXTRAS))

.PHONY: setup native run test test-gpu clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# llama-cpp-python first (its own, host-specific build), then the package: pip then finds it
# installed and does not build it again its own way.
$(STAMP): pyproject.toml openjet_plugin/setup_llama.py openjet_plugin/cpu_features.py | $(VENV)/bin/python
	@echo "openjet setup: virtual environment $(VENV), extras [$(EXTRAS)]"
	@$(PY) -m openjet_plugin.setup_llama --package ".[$(EXTRAS)]"
	@touch $(STAMP)

setup: $(STAMP) native

# Builds openjet_plugin/native/libopenjet.so for the local GPU when the sources changed; without a
# GPU it says so and builds nothing (OPENJET_CUDA_ARCHS=90 make native forces it).
native: $(STAMP)
	@$(PY) -m openjet_plugin.build_native --if-stale

run: setup
	$(VENV)/bin/openjet generate "$(PROMPT)" --max-tokens 64

test: setup
	$(PY) -m pytest -q -ra

test-gpu: setup
	$(PY) -m pytest -q -ra -m gpu

clean:
	rm -rf $(VENV) build openjet_plugin/native/*.so
