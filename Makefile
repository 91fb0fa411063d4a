# The two commands a user needs: `make demo` and `make test`. Both bootstrap .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint proto bench anchors flake clean

$(STAMP): setup.py constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e '.[tf,torch,ray,k8s,dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/dlrover submit examples/tf/job.yaml --kill worker:1@50% --summary-json demo-summary.json

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python tools/import_graph.py
	$(BIN)/python -m pytest -q --durations=25 -n 2 --dist loadgroup tests

# Skips the slow end-to-end tests (CI still runs them through `make test`).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup -m "not slow" tests

lint: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

proto: $(STAMP)
	$(BIN)/python tools/gen_proto.py

bench: $(STAMP)
	$(BIN)/python benchmarks/sharding.py
	$(BIN)/python benchmarks/tf_hooks.py
	$(BIN)/python benchmarks/scale.py

# DLRover 0.6.1, the reference system, in its own venv: the benchmarks run it beside ours when
# .anchors/ exists (CI does not need it). torch==2.13.0 exactly: the CPU wheel from local disk.
ANCHORS := .anchors
anchors: $(ANCHORS)/.installed
$(ANCHORS)/.installed:
	$(PY) -m venv $(ANCHORS)
	$(ANCHORS)/bin/pip install -q 'dlrover[k8s]==0.6.1' torch==2.13.0 protobuf numpy
	touch $@

# Repeat tests to find flakes: make flake TESTS="tests/integration" N=5 LOAD=1
N ?= 5
TESTS ?= tests
flake: $(STAMP)
	PYTHON=$(BIN)/python tools/flake.sh -n $(N) $(if $(filter 1,$(LOAD)),-l) $(TESTS)

clean:
	rm -rf $(VENV) build *.egg-info
