# radixcache: `make run` starts a worker and streams a reply; `make test` runs the suite.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# The CPU build of torch; installing it first means the `torch>=` range in pyproject adds nothing heavier.
TORCH  ?= torch==2.13.0
# FlashInfer's Python sources only (--no-deps: its CUDA dependencies, and a CUDA torch, stay out): tests/
# test_flashinfer_api.py reads its wrappers' signatures with ast, never imports it. The latest 0.6.x; pyproject's
# `cuda` extra admits it.
FLASHINFER ?= flashinfer-python==0.6.18.post1
STAMP  := $(VENV)/.installed

.PHONY: setup test lint proto proto-check run bench bench-llamacpp soak gpu-check mutation clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@# Mooncake's binaries (the store extra, in test) link libibverbs even for TCP: Debian's libibverbs1, as root.
	@if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1'; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			apt-get install -y -q libibverbs1 >/dev/null || { apt-get update -q && apt-get install -y -q libibverbs1; } \
				|| echo "note: apt-get could not install libibverbs1: the store tests will skip"; \
		else echo "note: libibverbs1 is missing (apt-get install libibverbs1): the store tests will skip"; fi; \
	fi
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip "setuptools>=70" wheel
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test,bench]"
	$(PY) -m pip install -q --no-deps "$(FLASHINFER)"
	touch $(STAMP)

test: setup
	$(PY) -m pytest -q -p no:cacheprovider

# The type check (mypy, [tool.mypy] in pyproject.toml) covers the cache core and the engine, speculation and front
# rooms; scripts/typecheck.py lays out the installed package names for it first.
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) scripts/typecheck.py

# Regenerates the gRPC stubs from proto/; proto-check fails if the committed stubs drifted from the .proto files.
proto: setup
	$(PY) -m grpc_tools.protoc -I proto --python_out=. --pyi_out=. --grpc_python_out=. proto/radixcache/v1/*.proto

proto-check: setup
	@set -e; tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; \
	$(PY) -m grpc_tools.protoc -I proto --python_out=$$tmp --pyi_out=$$tmp --grpc_python_out=$$tmp proto/radixcache/v1/*.proto; \
	for f in $$tmp/radixcache/v1/*; do diff -q $$f radixcache/v1/$$(basename $$f) || { echo "stubs drifted: run make proto"; exit 1; }; done

run: setup
	$(PY) scripts/demo.py

# Benchmarks (never part of `make test`): the cache's data structure, then the serving benchmarks side by side
# (cache on/off workers, transformers, decode floor); the last line printed is one JSON object. ~5-8 min on 2 cores.
bench: setup
	$(PY) bench/tree_bench.py --quick
	$(PY) bench/run_all.py

# Optional, never part of `make test` or `make bench`: radixcache against llama.cpp's llama-server on the CPU (same
# checkpoint, one thread each, parity checked first). Builds llama-server once (~10 min on 2 quiet cores, cached in
# bench/results/llamacpp/); the last line printed is one JSON object of ratios.
bench-llamacpp: setup
	$(PY) bench/llamacpp_compare.py

# The long chaos + wire-fuzz run against one real worker (never part of `make test`; a few minutes): >= 2,000 chaos
# requests, >= 5,000 fuzzed calls, worker RSS before/after, the longest loop stall while 15 MiB requests arrive. The
# last line is one JSON object; exit status 1 if a promise was broken. See RELIABILITY.md.
soak: setup
	$(PY) scripts/soak.py

# For a machine with CUDA: flashinfer against the torch backend on the configurations users hit, the default model
# served both ways, then timings (~8 min at most); table + logs under $OUT (default ./gpu-check-out). Without CUDA it
# runs the CPU parts and exits 0. No venv needed there: it installs the package (no dependencies) into the machine's
# python3 and runs there (BENCHMARKS.md, GPU).
gpu-check:
	$(PYTHON) -m pip install -q --no-deps --no-build-isolation -e .
	$(PYTHON) scripts/gpu_check.py

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache .hypothesis

# Mutation testing (never part of `make test`): per-module scores, survivors under build/mutation/<target>/.
# One mutant at a time (hours on one core: radixcache/ under an hour, a worker target longer); `make mutation
# TARGETS="radixcache validation"` runs some; reruns resume and retest what no test killed before.
mutation: setup
	$(PY) -m pip install -q -e ".[mutation]"
	$(PY) scripts/mutation.py $(TARGETS)
