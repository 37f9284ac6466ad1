# qworker: `make install` sets up .venv (and a redis-server and g++ when none is on PATH), and builds
# the native CPU kernels for every instruction-set level; `make test` runs the whole suite. Works on a fresh Debian/Ubuntu machine with Python 3.11.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install redis compiler browser kernels test typecheck lint clean demo

install: $(STAMP) redis compiler kernels

KERNELS := qworker/model/kernels/native_lib/manifest.json

kernels: $(KERNELS)

# one shared library per level (AVX2, AVX-512, AVX512-BF16); the worker loads the best its CPU runs
$(KERNELS): $(wildcard qworker/model/kernels/csrc/*) qworker/model/kernels/native_build.py | $(STAMP) compiler
	$(BIN)/python -m qworker.model.kernels.native_build

$(STAMP): pyproject.toml producer/pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first and pinned: 2.13.0 is the CPU build this project is tested with
	$(BIN)/python -m pip install --quiet torch==2.13.0
	# the client (producer/, qworker-client) first, so the worker's pin on it resolves here
	$(BIN)/python -m pip install --quiet -e ./producer
	$(BIN)/python -m pip install --quiet -e '.[worker,test]'
	touch $(STAMP)

redis:  # redis-cli too: the cluster tests join their nodes with `redis-cli --cluster create`
	@{ command -v redis-server && command -v redis-cli; } >/dev/null 2>&1 || { \
	  echo "installing redis-server and redis-tools from the system's packages"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq redis-server redis-tools \
	    >/dev/null; }

compiler:
	@command -v g++ >/dev/null 2>&1 || { \
	  echo "installing g++ from the system's packages"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq g++ >/dev/null; }

# the dashboard's browser test (tests/test_dashboard_browser.py): headless chromium and its driver
browser:
	@{ command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; } || { \
	  echo "installing chromium and chromium-driver from the system's packages"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq chromium chromium-driver >/dev/null; }

# the kernel build and the type check side by side (about a minute each on 2 cores), then the suite,
# two test files at a time (loadfile keeps each file's module fixtures in one process)
test: $(STAMP) redis compiler browser
	$(MAKE) --no-print-directory -j2 kernels typecheck
	$(BIN)/python -m pytest -q -rs -n 2 --dist loadfile --durations=25

typecheck: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

# a local Redis, a worker on the default model, a few chat jobs streamed live; then all stopped
demo: install
	$(BIN)/qworker demo

lint: install
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache .hypothesis qworker/model/kernels/native_lib
