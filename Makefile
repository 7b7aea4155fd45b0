# harnessrl: `make demo` runs the main job locally; `make test` runs checks and the whole suite.
# Every target sets up what it needs (`make dev` is idempotent and takes seconds once built).
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
BENCHES := bus gateway reward controller trainer scale merge
PYTEST_ARGS ?=

.PHONY: dev check test demo bench $(addprefix bench-,$(BENCHES)) fmt images cluster-check

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

# The suite runs on XDIST_WORKERS processes (default: one per core); each test file stays whole on
# one worker, costliest first (harnessrl.testkit.parallel), so module fixtures start once. It ends with the table of where the time went, whose whole
# JSON lands in .harnessrl/test-times/last.json; `make test-times` keeps one per commit
# (BASE=old.json also prints the two side by side).
XDIST_WORKERS ?= auto
SUITE = $(PY) -m pytest -m "not images" -n $(XDIST_WORKERS) --dist loadfile --no-loadscope-reorder
TIMES ?= .harnessrl/test-times/$(shell git rev-parse --short HEAD 2>/dev/null || echo worktree).json

# The static checks run beside the suite, not before it: mypy alone takes 1.5 minutes of one core on a
# fresh clone, while the other core would sit idle. Their output comes after the suite's; either
# failing fails the target.
test: dev
	@mkdir -p .harnessrl; $(MAKE) --no-print-directory check > .harnessrl/check.log 2>&1 & lint=$$!; \
	$(SUITE) --times-json .harnessrl/test-times/last.json $(PYTEST_ARGS); suite=$$?; \
	wait $$lint; checked=$$?; cat .harnessrl/check.log; \
	[ $$checked -eq 0 ] || echo "make test: the static checks (make check) failed: see above"; \
	[ $$suite -eq 0 ] && [ $$checked -eq 0 ]

.PHONY: test-times
test-times: dev
	$(SUITE) --times-json $(TIMES) $(PYTEST_ARGS)
	@[ -z "$(BASE)" ] || $(PY) -m harnessrl.testkit.timing compare $(BASE) $(TIMES)

demo: dev
	$(VENV)/bin/harnessrl demo

# The coding demo: the unmodified mini-swe-agent learning to fix bugs it never saw (needs scripts/tools.sh).
.PHONY: demo-swe
demo-swe: dev
	$(VENV)/bin/harnessrl demo swe

bench: $(addprefix bench-,$(BENCHES))

$(addprefix bench-,$(BENCHES)): bench-%: dev
	@[ "$*" != gateway ] || command -v wrk >/dev/null || apt-get install -y -qq wrk >/dev/null 2>&1 \
		|| echo "wrk not installable here: bench-gateway uses its aiohttp load generator"
	@[ "$*" != scale ] || command -v haproxy >/dev/null || [ -x /usr/sbin/haproxy ] \
		|| apt-get install -y -qq haproxy >/dev/null 2>&1 \
		|| echo "haproxy not installable here: bench-scale needs its load balancer (apt-get install haproxy)"
	$(PY) -m harnessrl.benchmarks $*

# Faults and endurance, outside `make test`: flags through CHAOS_ARGS / SOAK_ARGS, e.g.
# `make chaos CHAOS_ARGS="--calls 300 --kills 5 --seed 3"`, `make soak SOAK_ARGS="--minutes 3"`.
.PHONY: chaos soak
chaos: dev
	@command -v haproxy >/dev/null || [ -x /usr/sbin/haproxy ] || apt-get install -y -qq haproxy >/dev/null 2>&1 \
		|| echo "haproxy not installable here: chaos needs its load balancer (apt-get install haproxy)"
	$(PY) -m harnessrl.benchmarks.chaos $(CHAOS_ARGS)

soak: dev
	$(PY) -m harnessrl.benchmarks.soak $(SOAK_ARGS)

# Every tap on the event stream of one short real run (export, replay, OTLP, dashboard, metrics).
.PHONY: analytics-check
analytics-check: dev
	$(PY) -m harnessrl.benchmarks.analytics_check $(ANALYTICS_ARGS)

# Container images (podman, offline wheelhouse, cached by input hash) and the chart's local-cpu
# scenario run in them end to end (its last line is one JSON object).
images: dev
	@bash scripts/images.sh

cluster-check: images
	$(PY) -m pytest -m images tests/test_images.py tests/test_container_grading.py
	$(PY) -m harnessrl.benchmarks cluster_check
