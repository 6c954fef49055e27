# Two commands do everything on a fresh machine with python3, pip and apt: `make demo`, `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
PKGS := schema sim router diagnostics instrumentation exporters dashboards alerts monitoring check cli demo
APT_PACKAGES := prometheus redis-server chromium

.PHONY: demo test test-fast lint typecheck pytest venv test-deps sysdeps vllm-env generate check-generated clean bench

$(BIN)/kvdiag: pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e '.[otel,analysis,dashboards]'
	@# bytecode as a wheel's install writes it: an editable install has none, and where PYTHONDONTWRITEBYTECODE
	@# is set every CLI run would compile a hundred modules again (a tenth of one conversation's explain)
	$(BIN)/python -m compileall -q $(PKGS) __init__.py
	touch $@

venv: $(BIN)/kvdiag

demo: venv
	$(BIN)/kvdiag demo

$(VENV)/.test-deps: $(BIN)/kvdiag requirements-test.txt constraints.txt
	$(BIN)/pip install -q -c constraints.txt -r requirements-test.txt
	touch $@

test-deps: $(VENV)/.test-deps

# The real vLLM + NIXL (CPU) environment the connector tests run against: pinned, no GPU deps.
$(VENV)/.vllm-env: $(VENV)/.test-deps requirements-vllm.txt constraints.txt
	$(BIN)/pip install -q --no-deps -c constraints.txt -r requirements-vllm.txt
	touch $@

vllm-env: $(VENV)/.vllm-env

# System packages the tests start themselves (Redis, Prometheus/promtool, headless Chromium).
sysdeps:
	@missing=""; \
	command -v redis-server >/dev/null || missing="$$missing redis-server"; \
	command -v promtool >/dev/null || missing="$$missing prometheus"; \
	command -v chromium >/dev/null || missing="$$missing chromium"; \
	if [ -n "$$missing" ]; then \
	  echo "installing system packages:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi

# Symlinked view of the repository as the `kvdiag` package, for mypy (the editable install uses
# an import hook that type checkers cannot follow).
build/pkg/kvdiag: Makefile
	rm -rf build/pkg && mkdir -p build/pkg/kvdiag
	ln -s ../../../__init__.py ../../../py.typed build/pkg/kvdiag/
	for p in $(PKGS); do ln -s ../../../$$p build/pkg/kvdiag/$$p; done

lint: test-deps
	$(BIN)/ruff check .

typecheck: test-deps build/pkg/kvdiag
	$(BIN)/mypy -p kvdiag

pytest: test-deps sysdeps vllm-env
	$(BIN)/python -m pytest -q -p no:cacheprovider

test: lint typecheck pytest

# The edit loop: lint, types and the tests that need neither real vLLM nor minutes (CI runs everything).
test-fast: lint typecheck sysdeps
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "not slow and not vllm"

generate: venv
	$(BIN)/python -m kvdiag.dashboards.build --out dashboards
	$(BIN)/python -m kvdiag.alerts.build --out alerts/kvdiag-alerts.yaml
	$(BIN)/python -m kvdiag.schema.docs --out docs/metrics.md
	$(BIN)/python -m kvdiag.cli.reference --out docs/cli.md
	$(BIN)/python -m kvdiag.diagnostics.engine_no_events --out diagnostics/event_table_columns.py

# CI gate (kubernetes-mixin style): regenerating must not change the committed files; then lint the rules.
check-generated: generate sysdeps
	git diff --exit-code -- dashboards alerts docs/metrics.md diagnostics/event_table_columns.py
	promtool check rules alerts/kvdiag-alerts.yaml
	promtool test rules tests/promtool/*.yaml

clean:
	rm -rf $(VENV) build .mypy_cache .ruff_cache
