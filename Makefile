# harnessrl: `make demo` runs the main job locally; `make test` runs checks and the whole suite.
# Every target sets up what it needs (`make dev` is idempotent and takes seconds once built).
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
BENCHES := bus gateway reward controller trainer scale
PYTEST_ARGS ?=

.PHONY: dev check test demo bench $(addprefix bench-,$(BENCHES)) fmt

dev:
	@bash scripts/dev.sh

check: dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

fmt: dev
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

test: check
	$(PY) -m pytest $(PYTEST_ARGS)

demo: dev
	$(VENV)/bin/harnessrl demo

bench: $(addprefix bench-,$(BENCHES))

$(addprefix bench-,$(BENCHES)): bench-%: dev
	@[ "$*" != gateway ] || command -v wrk >/dev/null || apt-get install -y -qq wrk >/dev/null 2>&1 \
		|| echo "wrk not installable here: bench-gateway uses its aiohttp load generator"
	@[ "$*" != scale ] || command -v haproxy >/dev/null || [ -x /usr/sbin/haproxy ] \
		|| apt-get install -y -qq haproxy >/dev/null 2>&1 \
		|| echo "haproxy not installable here: bench-scale needs its load balancer (apt-get install haproxy)"
	$(PY) -m harnessrl.benchmarks $*
