# Every target sets itself up from nothing: a .venv with torch pinned, then the package with extras.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
TORCH   := torch==2.13.0

.PHONY: setup browser demo test bench lint clean

setup: $(STAMP)

# Debian's Chromium renders the HTML report in the browser tests; installed once, skipped if present.
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  echo "installing Debian's chromium for the report's browser test"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
	  || echo "chromium could not be installed: the browser test will be skipped"; }

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet $(TORCH)
	$(BIN)/pip install --quiet -e '.[all]'
	touch $(STAMP)

demo: setup
	$(BIN)/python -m hyperacc.demo

test: setup browser
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/python bench/run_all.py

lint: setup
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache runs
