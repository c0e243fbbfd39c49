# make test / make bench: create or reuse .venv, install what is missing, run.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.graphrt-installed
# A CPU build of torch where no NVIDIA GPU is present (plain `pip install torch` pulls GBs of CUDA).
TORCH_CPU := torch==2.13.0

.PHONY: test bench test-cuda clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		$(PY) -m pip install -q torch; \
	else \
		$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_CPU); \
	fi
	$(PY) -m pip install -q --no-build-isolation -e ".[dev,bench]"
	touch $(STAMP)

test: $(STAMP)
	PYTHONPATH=. $(PY) -m pytest -q

test-cuda: $(STAMP)
	PYTHONPATH=. $(PY) -m pytest -q -m cuda

bench: $(STAMP)
	PYTHONPATH=. $(PY) scripts/bench.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) bench_out
