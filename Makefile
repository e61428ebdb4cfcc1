# The two commands: `make run` and `make test`. Everything they need is installed here.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
MODEL  := models/smollm2-135m-instruct/inferline-model.json
HANDBOOK_INDEX := indexes/handbook/CURRENT
RELEASES_INDEX := indexes/releases/CURRENT
CHROMIUM := /usr/bin/chromium
GUIDELLM_VENV := .venv-guidellm
GUIDELLM := $(GUIDELLM_VENV)/bin/guidellm
PIP    := $(PY) -m pip --disable-pip-version-check

.PHONY: install run test test-fast bench bench-deps lint clean reliability schemas

KERNELS := $(VENV)/.kernels

install: $(STAMP) $(MODEL) $(HANDBOOK_INDEX) $(RELEASES_INDEX) $(KERNELS)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -e '.[test,convert,ray]'
	touch $(STAMP)

# Idempotent: the script returns at once when the model is already in place.
$(MODEL): $(STAMP) scripts/fetch_model.py
	$(PY) scripts/fetch_model.py

# The engine's C++ CPU kernels, compiled once for this machine (about 20 s); without a compiler the
# engine falls back to its torch path and says so.
$(KERNELS): $(STAMP) $(wildcard serving/engine/kernels/*.cpp serving/engine/kernels/*.h)
	$(PY) -m serving.engine.kernels
	touch $(KERNELS)

# The RAG example's index (pipelines/rag.yaml), rebuilt when a handbook page changes (Markdown, the PDF that
# scripts/make_handbook_pdf.py writes, HTML) or the index format does (store/index_version.py: an index from
# before the keyword side cannot search hybrid, as both examples do).
$(HANDBOOK_INDEX): $(STAMP) store/index_version.py $(wildcard pipelines/data/handbook/*.md pipelines/data/handbook/*.pdf pipelines/data/handbook/*.html)
	$(PY) -m serving.cli.main index build pipelines/data/handbook --name handbook

# The release notes, the second index of the research example (pipelines/research.yaml).
$(RELEASES_INDEX): $(STAMP) store/index_version.py $(wildcard pipelines/data/releases/*.md)
	$(PY) -m serving.cli.main index build pipelines/data/releases --name releases

# The web console's browser tests (tests/serving/console/test_browser.py) drive Debian's chromium with
# Playwright, never a browser Playwright downloads itself. sudo only when not root. Without apt-get this
# only warns, and those tests fail, loudly, until Chromium is at $(CHROMIUM). `make run` does not need it.
$(CHROMIUM):
	@if command -v apt-get >/dev/null 2>&1; then \
	  SUDO=$$([ "$$(id -u)" -eq 0 ] || echo sudo); \
	  $$SUDO apt-get update -qq && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium; \
	else \
	  echo "warning: no apt-get here: install Chromium at $(CHROMIUM) for the console's browser tests" >&2; \
	fi

# guidellm, the benchmark tool of vLLM's users, for the test that runs it against a real server
# (tests/serving/cli/test_clients.py). Its own venv: its pins (click, multidict) clash with ours.
$(GUIDELLM):
	test -x $(GUIDELLM_VENV)/bin/python || $(PYTHON) -m venv $(GUIDELLM_VENV)
	$(GUIDELLM_VENV)/bin/python -m pip --disable-pip-version-check install --quiet 'guidellm==0.8.1' 'torch==2.13.0'

# Serves every pipeline of inferline.yaml on 127.0.0.1:8000 (auth off, loopback only).
run: install
	$(VENV)/bin/inferline serve

# Two workers, each taking whole files (a file's module-scoped server starts once): about 12 minutes here
# where one worker took 21-22, since most of a serial run waits on servers, Ray and subprocesses with a
# core idle. Files go out in collection order (tests/faults' long single tests first), not xdist's
# most-tests-first, which left the one-test files that take 30-45 s each for the end, one worker idle.
# TEST_WORKERS=0 runs in this process, one test after another.
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test: install $(CHROMIUM) $(GUIDELLM)
	$(VENV)/bin/lint-imports
	$(PYTEST)

test-fast: install
	$(PYTEST) -m "not slow"

bench: install
	$(PY) bench/runner.py
	$(PY) bench/engine.py --quick
	$(PY) bench/http.py --quick
	$(PY) bench/audit.py --quick
	$(PY) bench/workflow.py --quick
	$(PY) bench/tools.py --quick

# The full reliability run (about 25 minutes): 128 streaming clients for 10 minutes, the fault tests with a
# 30 s database outage, schemathesis and hypothesis at full size; rewrites docs/reliability.md.
reliability: install
	$(PY) bench/reliability.py

# Optional: llama-cpp-python for `bench/engine_speed.py --llamacpp`. It compiles llama.cpp from source,
# about 12 minutes on 2 cores; one build job (CMAKE_BUILD_PARALLEL_LEVEL=1) leaves the other core free.
bench-deps: install
	CMAKE_BUILD_PARALLEL_LEVEL=$${CMAKE_BUILD_PARALLEL_LEVEL:-1} $(PIP) install -e '.[bench]'

# The JSON Schemas of the two YAML files (schemas/), regenerated after a spec model or a stage's Config changes;
# tests/pipeline/test_schema.py fails while they are stale.
schemas: $(STAMP)
	$(PY) -m serving.cli.main schema pipeline --builtin --output schemas/pipeline.schema.json
	$(PY) -m serving.cli.main schema server --output schemas/server.schema.json

# ruff, and the layers of docs/design.md as import-linter contracts (pyproject.toml).
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

clean:
	rm -rf $(VENV) $(GUIDELLM_VENV) models indexes build *.egg-info
