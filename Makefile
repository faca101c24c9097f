# Every target sets itself up from nothing: a .venv with torch pinned, then the package with extras.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
TORCH   := torch==2.13.0

.PHONY: setup system demo test check soak bench lint clean gpu-check

# Bytecode is written where Python first imports a module, for every process these targets start, even
# where PYTHONDONTWRITEBYTECODE is set (this VM): otherwise every rank, launcher and agent compiled all it
# imported again (0.25 s of CPU of each 2-rank `hyperacc run` job for the package's own modules alone,
# and pytest's rewritten test modules in each worker). The set-up compiles only the package's own modules
# (0.03 s when nothing changed); the 15,600 modules of the dependencies, of which the suite imports about
# 3,700, are compiled when first imported rather than all at set-up (18 s on both cores here).
unexport PYTHONDONTWRITEBYTECODE
setup: $(STAMP)
	@$(BIN)/python -m compileall -q src >/dev/null

# Debian packages the tests use where present: Chromium renders the HTML report, numactl and
# gperftools' tcmalloc exercise the binding and memory-release stabilizers, tmux drives the live view
# of `hyperacc run` in a terminal. Installed once; a test whose package could not be installed skips
# with its reason.
SYSTEM_PKGS := chromium numactl libtcmalloc-minimal4 tmux
system:
	@missing=""; for p in $(SYSTEM_PKGS); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q 'ok installed' || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null) \
	  || echo "could not install$$missing: the tests that need them will be skipped"; fi

# Installed by uv (from the package registry, through pip): 23 s here against pip's 53 s for the same
# versions. uv does not read pip's configuration, so the wheel
# folders pip is told of (PIP_FIND_LINKS, pip.conf's find-links: where this machine keeps the CPU build
# of torch) are passed on. Where uv cannot be installed or fails, pip does it all, as before.
FIND_LINKS = $(foreach d,$(sort $(PIP_FIND_LINKS) $(shell $(PY) -m pip config get global.find-links 2>/dev/null)),--find-links $(d))
UV_INSTALL = $(BIN)/uv pip install --quiet --python $(BIN)/python $(FIND_LINKS)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	($(BIN)/pip install --quiet uv && $(UV_INSTALL) $(TORCH) && $(UV_INSTALL) -e '.[all]') \
	  || ($(BIN)/pip install --quiet $(TORCH) && $(BIN)/pip install --quiet -e '.[all]')
	touch $(STAMP)

demo: setup
	$(BIN)/python -m hyperacc.demo

# `make test` runs files on TEST_WORKERS processes (pytest-xdist, whole files per worker so that a
# file's recorded jobs are shared by its tests). Most of the suite's wall time is real ranks waiting
# (rendezvous, torchrun's monitor, timeouts): 2 workers fill those gaps on this 2-core machine (3 were no
# faster: the suite is then bound by CPU, mostly rank start-up, see README "Tests").
TEST_WORKERS ?= 2

# The test tiers (pyproject.toml's markers; README, "Tests"). `test` is the whole suite, what CI runs;
# `check` is the inner loop: no torchrun jobs, no browser, nothing slow; `soak` is the long repetitions.
test: setup system
	$(BIN)/python -m pytest -q -m 'not soak' -n $(TEST_WORKERS) --dist loadfile --durations=15

check: setup system
	$(BIN)/python -m pytest -q -m 'not multirank and not browser and not slow and not soak'

soak: setup system
	$(BIN)/python -m pytest -q -m soak

bench: setup
	$(BIN)/python bench/run_all.py

# The CUDA paths on one GPU (bench/gpu_check.py), with whichever Python holds a CUDA build of torch:
# the project's .venv where it exists, else the machine's python3. Never part of CI.
gpu-check:
	PYTHONPATH=src$${PYTHONPATH:+:$$PYTHONPATH} $(if $(wildcard $(BIN)/python),$(BIN)/python,python3) bench/gpu_check.py

lint: setup
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache runs
