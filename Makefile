# Two commands a newcomer needs: `make run` and `make test`. Everything else is a helper.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
HOST   ?= 127.0.0.1
PORT   ?= 8000
ARCH   ?= efficientnet_lite0
WEIGHTS ?= pretrained
MODEL_STORE ?= model_store
PIP    := $(PY) -m pip install --disable-pip-version-check --progress-bar off

.PHONY: run test lint bench bench-quick loadtest model install install-dev clean

run: install $(MODEL_STORE)/manifest.json  ## serve on $(HOST):$(PORT)
	HOST=$(HOST) PORT=$(PORT) MODEL_STORE=$(MODEL_STORE) $(PY) -m app

test: install-dev  ## whole test suite (CPU only) plus lint
	$(PY) -m ruff check app tests bench
	$(PY) -m mypy
	$(PY) -m pytest

bench: install-dev  ## this server vs raw model, service-streamer, plain FastAPI (9-10 min)
	$(PY) -m bench --plot docs/performance.png --json docs/bench.json

bench-quick: install-dev  ## the same, default model only, under 2 minutes
	$(PY) -m bench --quick

loadtest: install-dev $(MODEL_STORE)/manifest.json  ## locust, headless, 30 s, against a local server
	PY=$(PY) PORT=$(PORT) MODEL_STORE=$(MODEL_STORE) tests/load/run_loadtest.sh

lint: install-dev
	$(PY) -m ruff check app tests bench
	$(PY) -m ruff format --check app tests bench
	$(PY) -m mypy

model: $(MODEL_STORE)/manifest.json  ## export the default model if it is missing

$(MODEL_STORE)/manifest.json: | install
	$(PY) -m app.export --arch $(ARCH) --weights $(WEIGHTS) --out $(MODEL_STORE)

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip

$(VENV)/.installed: requirements.txt constraints.txt | $(VENV)/bin/python
	$(PIP) -r requirements.txt -c constraints.txt
	touch $@

$(VENV)/.installed-dev: requirements-dev.txt requirements.txt constraints.txt | $(VENV)/bin/python
	$(PIP) -r requirements-dev.txt -c constraints.txt
	touch $(VENV)/.installed $@

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
