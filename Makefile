# hvdtrain: `make demo` runs the main job, `make test` runs every test. Both set everything up
# first (scripts/setup.sh is idempotent: the second run takes seconds).
SHELL := /bin/bash
VENV := $(CURDIR)/.venv
PY := $(VENV)/bin/python
NP ?= 2
export PATH := $(VENV)/bin:$(PATH)
# Ranks >= cores on small machines: idle MPI ranks yield instead of busy-polling (DESIGN.md).
export OMPI_MCA_mpi_yield_when_idle ?= 1
export TF_CPP_MIN_LOG_LEVEL ?= 2

.PHONY: setup demo test unit parallel bench doctor clean

setup:
	bash scripts/setup.sh

demo: setup
	horovodrun -np $(NP) -H localhost:$(NP) hvdtrain train --framework torch --dataset digits \
		--output-dir runs/demo-torch
	horovodrun -np $(NP) -H localhost:$(NP) hvdtrain train --framework keras --dataset digits \
		--output-dir runs/demo-keras
	horovodrun -np $(NP) -H localhost:$(NP) hvdtrain train --framework keras --keras-backend torch \
		--dataset digits --output-dir runs/demo-keras-torch
	hvdtrain report runs/demo-torch runs/demo-keras runs/demo-keras-torch

test: setup
	$(PY) -m pytest tests

unit: setup
	$(PY) -m pytest tests/unit

parallel: setup
	$(PY) -m pytest tests/parallel

bench: setup
	cd benchmarks && $(PY) run_all.py

doctor: setup
	hvdtrain doctor

clean:
	rm -rf runs .pytest_cache build *.egg-info
