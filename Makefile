# hvdtrain: `make demo` runs the main job, `make test` runs every test. Both set everything up
# first (scripts/setup.sh is idempotent: the second run takes seconds).
SHELL := /bin/bash
VENV := $(CURDIR)/.venv
PY := $(VENV)/bin/python
# Stamp: requirements/docs.txt installed into the venv (the docs target).
DOCS_DEPS := $(VENV)/.hvdtrain-docs-deps
NP ?= 2
export PATH := $(VENV)/bin:$(PATH)
# Ranks >= cores on small machines: idle MPI ranks yield instead of busy-polling (docs/stack.md, section 3).
export OMPI_MCA_mpi_yield_when_idle ?= 1
export TF_CPP_MIN_LOG_LEVEL ?= 2

.PHONY: setup demo test unit parallel bench doctor docs gpu-check clean

setup:
	bash scripts/setup.sh
	bash scripts/setup_engines.sh $(PY)  # Spark (+ a JRE) and Ray for hvdtrain.spark, hvdtrain.ray; HVDTRAIN_ENGINES

# The main job (docs/quickstart.md): MNIST with its recipe (hvdtrain/datasets/recipes.py), 2 processes,
# PyTorch and Keras on both backends, >= 98.9 %.
MNIST := --dataset mnist
demo: setup
	horovodrun -np $(NP) -H localhost:$(NP) hvdtrain train --framework torch $(MNIST) \
		--output-dir runs/mnist-torch
	horovodrun -np $(NP) -H localhost:$(NP) hvdtrain train --framework keras $(MNIST) \
		--output-dir runs/mnist-keras
	horovodrun -np $(NP) -H localhost:$(NP) hvdtrain train --framework keras --keras-backend torch \
		$(MNIST) --output-dir runs/mnist-keras-torch
	hvdtrain report runs/mnist-torch runs/mnist-keras runs/mnist-keras-torch

# tests/unit/test_docs.py builds the documentation (as `make docs` does), so test needs its tools.
# scripts/test.sh runs tests/unit, slurm, container, gpu, ray and a few files of tests/parallel
# (its BESIDE list) beside the rest of tests/parallel and tests/spark.
test: setup $(DOCS_DEPS)
	bash scripts/test.sh $(PY)

unit: setup $(DOCS_DEPS)
	$(PY) -m pytest tests/unit

parallel: setup
	$(PY) -m pytest tests/parallel

bench: setup
	cd benchmarks && $(PY) run_all.py

doctor: setup
	hvdtrain doctor

# The documentation site (docs/conf.py) into docs/_build/html: every page read afresh (-E), warnings
# are errors (-W), every cross-reference must resolve (-n). Its tools: requirements/docs.txt.
$(DOCS_DEPS): requirements/docs.txt requirements/constraints.txt
	$(PY) -m pip install -q --disable-pip-version-check -c requirements/constraints.txt \
		-r requirements/docs.txt
	touch $@
docs: setup $(DOCS_DEPS)
	$(PY) -m sphinx -n -W --keep-going -E -q -b html docs docs/_build/html
	@echo "docs: file://$(CURDIR)/docs/_build/html/index.html"

# On a GPU machine: NCCL set-up, tests/gpu and the GPU benchmark (ResNet-50; Keras on PyTorch), evidence in runs/gpu-check.
gpu-check:
	bash scripts/gpu_check.sh runs/gpu-check

clean:
	rm -rf runs .pytest_cache build *.egg-info
