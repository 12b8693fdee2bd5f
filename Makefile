# Two entry points (see README): `make demo` and `make test`. Each creates .venv and
# installs what it needs. torch is installed first, pinned to the CPU build that lies on
# these machines' disk (`pip install torch==2.13.0`), so nothing pulls a CUDA build.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.opfuse-installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: demo test install clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[models,test]"
	$(PY) -c "import opfuse.kernels.ops as ops; ops.warm_up()"   # compile + cache the numba kernels once
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/opfuse demo

test: $(STAMP)
	$(PY) -m pytest -q tests/cpu

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
