# The two commands: `make demo` and `make test`. Each does all of its own set-up.
# The first supported Python on the machine (pyproject: >=3.11,<3.13); `make PYTHON=/path/to/python3.12` to choose.
PYTHON ?= $(or $(shell command -v python3.11 2>/dev/null),$(shell command -v python3.12 2>/dev/null),$(shell \
	for p in python3 python; do command -v $$p >/dev/null 2>&1 && $$p -c 'import sys; sys.exit(not (3, 11) <= sys.version_info[:2] < (3, 13))' 2>/dev/null && command -v $$p && break; done),python3.11)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: demo test test-ci dev install validate bench clean browser lint

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -c 'import sys; sys.exit(0 if (3, 11) <= sys.version_info[:2] < (3, 13) else \
		"make: redrive needs Python 3.11 or 3.12; $(PYTHON) is " + sys.version.split()[0] + " (make PYTHON=…)")' \
		|| { echo "make: no Python 3.11 or 3.12 found (tried $(PYTHON)); install one or give make PYTHON=…" >&2; exit 1; }
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install --quiet --upgrade pip
	@$(PY) -m pip install --quiet -e ".[dev]"
	@rm -f $(VENV)/.installed-*; touch $(STAMP)

install: $(STAMP)

## make demo: start embedded Postgres, moto and the sandbox, migrate, start the deployed topology (code server,
## daemon, webserver, conversion API and worker, as `make serve`), run every pipeline's demo at once through it
## (the daemon ticks the sensors, the run queue starts the runs), print a summary, stop.
demo: install
	@$(PY) -m orchestration.demo

## make demo-daemon: the same as `make demo` (which now goes through the daemon); kept for old habits.
.PHONY: demo-daemon
demo-daemon: demo

## make test: the whole suite; the local stack is started by the tests' fixtures.
test: install browser lint docs-check
	@$(PY) -m pytest -q $(PYTEST_ARGS)

## the docs site, strict: a broken link or anchor, or a page outside the nav, fails (built into a temporary folder)
.PHONY: docs-check docs
docs-check: install
	@d=$$(mktemp -d) && $(VENV)/bin/mkdocs build --strict --quiet -d "$$d"; rc=$$?; rm -rf "$$d"; exit $$rc

## make docs: serve the docs site on localhost:8000
docs: install
	@$(VENV)/bin/mkdocs serve

## ruff: undefined names, unused imports, naive datetimes
lint: install
	@$(VENV)/bin/ruff check --quiet .

## Debian's chromium for the browser tests (003's Retry button, the dead-letter console); a no-op when it is installed.
browser:
	@bash scripts/install-browser.sh || echo "make: could not install chromium; the browser tests will fail on CI and skip elsewhere"

## make test-ci: the suite once more against the machine's PostgreSQL service (DATABASE_URL). The chaos harness
## test and the newcomer's check start a PostgreSQL of their own whatever DATABASE_URL says, and `first_pass` tests
## (the demos, devstack, dagster dev, the log format) prove nothing that depends on the server, so the first pass
## has already run them; the deployed topology and every process test run again here.
test-ci: install
	@DATABASE_URL=$${CI_DATABASE_URL:-postgresql://postgres@127.0.0.1:5432/postgres} $(PY) -m pytest -q -m "not browser and not chaos and not newcomer and not first_pass" $(PYTEST_ARGS)

## make dev: the local stack plus `dagster dev`; the UI opens on localhost:3000. Ctrl-C stops all of it (what has
## not stopped 60 s later is killed, with what it started).
dev: install
	@$(PY) -m devstack run -- $(VENV)/bin/dagster dev -w workspace.yaml -p 3000

validate: install
	@$(PY) -m devstack run --purpose validate -- $(VENV)/bin/dagster definitions validate -w workspace.yaml

bench: install
	@$(PY) -m pip install --quiet -e ".[bench]"
	@$(PY) -m bench

## make chaos: 10,000 items through the production topology under faults, kills and a PostgreSQL restart;
## writes docs/chaos-report.md and exits non-zero on anything lost, duplicated, leaked or unreplayable.
CHAOS_ITEMS ?= 10000
.PHONY: chaos
chaos: install
	@$(PY) -m bench chaos --items $(CHAOS_ITEMS) $(CHAOS_ARGS)

clean:
	rm -rf .data .dagster_home

## make serve: the deployed topology on the embedded defaults, each process on its own (dagster api grpc,
## dagster-webserver, dagster-daemon, the conversion API and worker) on dagster.yaml.example; Ctrl-C stops all.
## It prints every endpoint and writes them to .data/serve.env (source it: set -a; . .data/serve.env; set +a).
.PHONY: serve
serve: install
	@$(PY) -m devstack serve $(if $(WORKERS),--workers $(WORKERS))

## make rehearse RECIPES="llm-401 bad-profile": arm failures to practise the runbooks on, on a running `make serve`
## (run it in a second shell; without RECIPES it lists them). docs/operating.md → "Rehearse locally".
.PHONY: rehearse
rehearse: install
	@$(VENV)/bin/redrive rehearse $(or $(RECIPES),list)

## make screenshots: the browser tests, saving their screenshots into docs/images (the suite alone writes none there)
.PHONY: screenshots
screenshots: install browser
	@REDRIVE_SCREENSHOTS=docs/images $(PY) -m pytest -q -m browser $(PYTEST_ARGS)

## make constraints: re-pin constraints.txt (the image's dependency pins) from this virtualenv after a pyproject change.
.PHONY: constraints
constraints: install
	@{ sed -n '1,4p' constraints.txt; $(PY) -m pip freeze --exclude-editable | grep -v '^#'; } > constraints.txt.new
	@mv constraints.txt.new constraints.txt
