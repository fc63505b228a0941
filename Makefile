# CEM Lab: `make demo` runs the whole path on the embedded corpus; `make test` runs the tests.
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
.DEFAULT_GOAL := help

VENV    ?= .venv
PYTHON  ?= python3
TORCH   ?= torch==2.13.0
export CEMLAB_HOME ?= $(CURDIR)/.cemlab
STAMP   := $(VENV)/.installed
BIN     := $(CURDIR)/$(VENV)/bin
SERVICES := $(CEMLAB_HOME)/services.env
DASHBOARD_PORT ?= 8501
# Test processes (pytest-xdist): the end-to-end tests wait on servers and processes much of
# their time, so two share two cores well; the tests that start a Ray cluster run in one group,
# one at a time in one process, and the other process yields the CPU to them (nice 19; the S3
# stack's grid runs there too: tests/conftest.py). TEST_WORKERS=0 runs them all in this process.
# Their OpenMP threads wait passively: spinning, each process's threads take the other's cores.
TEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup)
TEST_ENV = $(if $(filter 0,$(TEST_WORKERS)),,OMP_WAIT_POLICY=PASSIVE)
# pip warns once per package about this machine's empty local index mirrors: not our news.
QUIET_PIP := { grep -v "^WARNING: Location '.*' is ignored" || true; }

.PHONY: help setup up demo test test-fast cluster-test reproduce-cpu recursion-cpu dashboard docs down lint clean

help:
	@echo "make setup      create $(VENV) (CPU torch first where no CUDA GPU) and install cemlab[dev]"
	@echo "make demo       start local Ray + MLflow, submit experiments/demo.yaml with ray job submit"
	@echo "make test       run the whole test suite (what CI runs)"
	@echo "make test-fast  run the unit tests only (no end-to-end runs), 1.5-4 minutes on 2 cores"
	@echo "make cluster-test  rehearse a 2-host cluster on this machine (root: network namespaces)"
	@echo "make reproduce-cpu  run the paper's claims at CPU scale, write docs/results/REPORT.md"
	@echo "make recursion-cpu  the recursion study (T=2 vs T=1 per reading): docs/results/recursion*/"
	@echo "make dashboard  serve the Streamlit dashboard on http://127.0.0.1:$(DASHBOARD_PORT)"
	@echo "make docs       serve the documentation site (docs/) on http://127.0.0.1:8000"
	@echo "make down       stop the local services started by make up/demo/dashboard"

setup: $(STAMP)

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
	  || { echo "error: Python >= 3.11 is required ($(PYTHON) is older)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	@if nvidia-smi -L >/dev/null 2>&1; then \
	  echo "CUDA GPU found: torch comes with its CUDA build"; \
	else \
	  echo "no CUDA GPU: installing the CPU build $(TORCH) first"; \
	  $(BIN)/pip install --quiet "$(TORCH)" 2>&1 | $(QUIET_PIP); \
	fi
	$(BIN)/pip install --quiet -e ".[dev]" 2>&1 | $(QUIET_PIP)
	@if ! nvidia-smi -L >/dev/null 2>&1; then \
	  echo "building DeepSpeed's CPU comm op once (about 30 s), not in the first trial"; \
	  $(BIN)/python -c 'from workloads.runtime.engine import build_cpu_comm_op; build_cpu_comm_op()'; \
	fi
	@touch $(STAMP)

up: setup
	@infra/local/up.sh

demo: up
	@source $(SERVICES) && \
	  ray job submit --working-dir . -- cemlab run experiments/demo.yaml
	@echo "Look at the runs: MLflow UI at $$(source $(SERVICES) && echo $$MLFLOW_TRACKING_URI)," \
	  "charts with 'make dashboard'; 'make down' stops the services."

test: setup
	$(TEST_ENV) $(BIN)/python -m pytest $(XDIST)

test-fast: setup
	$(TEST_ENV) $(BIN)/python -m pytest $(XDIST) -m "not slow"

# Part of `make test` too (where it runs as root); here it fails, rather than skips, without root.
cluster-test: setup
	@reason=$$($(BIN)/python -c 'from infra.rehearsal.two_hosts import missing_requirement as m; print(m() or "")'); \
	  if [ -n "$$reason" ]; then echo "error: $$reason" >&2; exit 1; fi
	$(BIN)/python -m pytest -s -p no:cacheprovider tests/infra/test_two_hosts.py

# Imports the committed result bundles, trains what they and the ledger lack of the claims'
# -cpu specs (in this process, a local Ray), then writes docs/results/REPORT.md and one figure
# per claim. Bundles of other model code are refused (the reason printed) and trained again.
reproduce-cpu: up
	@source $(SERVICES) && { cemlab import docs/results/data || \
	  echo "reproduce-cpu: training what the bundles above cannot give"; } && \
	  cemlab report experiments/paper/

# The recursion study (docs/recursion.md): the same, on experiments/studies/.
recursion-cpu: up
	@source $(SERVICES) && cemlab report experiments/studies/ --claims recursion \
	  --out docs/results/recursion && \
	  cemlab report experiments/studies/ --claims recursion-options \
	  --out docs/results/recursion-options

dashboard: up
	@source $(SERVICES) && echo "dashboard: http://127.0.0.1:$(DASHBOARD_PORT)" && \
	  streamlit run dashboards/app.py --server.port $(DASHBOARD_PORT)  # rest: .streamlit/config.toml

down:
	@infra/local/down.sh

docs: setup
	$(BIN)/mkdocs serve

lint: setup
	$(BIN)/ruff check .

clean: down
	rm -rf $(VENV) $(CEMLAB_HOME)
