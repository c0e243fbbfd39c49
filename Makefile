# make test / make bench: create or reuse .venv, install what is missing, run.
# make test also runs the Hugging Face tests on the oldest supported transformers, in a second venv.
# make test-cuda: the cuda-marked tests on the python found ($(PYTHON)) when its torch sees a GPU, installing
# nothing (the GPU machines have torch, transformers and pytest, and no network); else through .venv.
# On a GPU machine with 15 minutes, run scripts/gpu_first_session.sh instead (docs/BENCHMARKS.md).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.graphrt-installed
# A CPU build of torch where no NVIDIA GPU is present (plain `pip install torch` pulls GBs of CUDA).
TORCH_CPU := torch==2.13.0
# The transformers releases the tests run on: the newest (the whole suite) and the oldest of
# pyproject's `hf` range (the Hugging Face tests below).
TRANSFORMERS_NEWEST ?= 5.24.0
TRANSFORMERS_OLDEST ?= 5.17.0
OLDEST_VENV ?= .venv-transformers-oldest
OLDEST_PY := $(OLDEST_VENV)/bin/python
OLDEST_STAMP := $(OLDEST_VENV)/.graphrt-installed-$(TRANSFORMERS_OLDEST)
# The Hugging Face tests that run again on the oldest release (about a minute of CPU): the cache keyword, the
# layer kinds and windows, hybrids, T5Gemma and "hybrid" configs, MultiStepGenerate, one family of each kind
# (decoder, state-space hybrid, encoder-decoder that stays eager before 5.24, VLM with an image), and the engine
# path alone and sharded over two ranks, and its rotary embeddings that depend on the length (longrope changed
# between the releases; the GPU image's transformers is this release).
FAMILY_TEST := tests/test_hf_families.py::test_a_repeated_generate_call_replays_every_forward_call
MULTISTEP := tests/test_hf_multistep.py
OLDEST_TESTS ?= tests/test_hf_cache_keyword.py tests/test_hf_window_layers.py tests/test_hf_hybrids.py \
	$(MULTISTEP)::test_sliding_window_and_chunked_launches_replay \
	$(MULTISTEP)::test_a_model_whose_forward_takes_no_cache_keyword_is_refused_naming_the_keywords \
	$(FAMILY_TEST)[llama] $(FAMILY_TEST)[gemma3] $(FAMILY_TEST)[bamba] $(FAMILY_TEST)[bart] $(FAMILY_TEST)[llava-image] \
	tests/test_hf_engine.py tests/test_hf_engine_tensor_parallel.py tests/test_hf_engine_rope.py

.PHONY: test test-newest test-oldest-transformers bench test-cuda clean

# .venv: torch (the CUDA build with a GPU, else the CPU one), graphrt's dev and bench extras, the newest transformers.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch; \
	else \
		$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_CPU); \
	fi
	$(PY) -m pip install -q --no-build-isolation -e ".[dev,bench]" "transformers==$(TRANSFORMERS_NEWEST)"
	touch $@

# The oldest release's venv holds only what differs from .venv (transformers and what it pins): a .pth file puts
# .venv's site-packages (torch, pytest, ...) after its own, so torch is installed once (about 40 s less). Its own
# setuptools goes: Python 3.11's venv brings one too old to build graphrt in place, and .venv's builds it.
PURELIB := import sysconfig; print(sysconfig.get_paths()["purelib"])
$(OLDEST_STAMP): $(STAMP) pyproject.toml Makefile
	test -x $(OLDEST_PY) || $(PYTHON) -m venv $(OLDEST_VENV)
	$(PY) -c '$(PURELIB)' > "$$($(OLDEST_PY) -c '$(PURELIB)')/graphrt-newest-venv.pth"
	$(OLDEST_PY) -m pip uninstall -y -q setuptools
	$(OLDEST_PY) -m pip install -q --no-build-isolation -e ".[dev]" "transformers==$(TRANSFORMERS_OLDEST)"
	touch $@

# pytest-xdist workers for make test: every core (CI's 2 halve the run); TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= auto

test: test-newest test-oldest-transformers

test-newest: $(STAMP)
	PYTHONPATH=. $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

test-oldest-transformers: $(OLDEST_STAMP)
	PYTHONPATH=. $(OLDEST_PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(OLDEST_TESTS)

SEES_CUDA = import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)

test-cuda:
	@if $(PYTHON) -c "$(SEES_CUDA)" 2>/dev/null; then \
		echo "test-cuda: $(PYTHON)'s torch sees a GPU: running on it, installing nothing"; \
		PYTHONPATH=. $(PYTHON) -m pytest -q -m cuda; \
	else \
		$(MAKE) --no-print-directory $(STAMP) && PYTHONPATH=. $(PY) -m pytest -q -m cuda; \
	fi

bench: $(STAMP)
	PYTHONPATH=. $(PY) scripts/bench.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) $(OLDEST_VENV) bench_out
