# Makefile: the two set-up commands of the README (make demo, make test) and make bench.
# Each target creates .venv/ when it is missing, installs torch 2.13.0 (the CPU build; pinned so pip
# never resolves a multi-GB CUDA build), the test/baseline packages (HF Accelerate 1.15 and transformers' companions
# PEFT, TRL and datasets at versions that work with transformers 5.24 and torch 2.13: pip keeps torch as it is) and
# accelerate_c itself.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.deps-stamp
# pytest workers (pytest-xdist): the multi-process tests wait on startup and rendezvous, so two workers keep the
# two cores busy; TEST_WORKERS=0 runs the suite in one process
TEST_WORKERS ?= 2

.PHONY: venv install build demo test bench clean

$(STAMP): Makefile
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade "setuptools>=61" wheel
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q accelerate==1.15.0 transformers==5.24.0 tensorboard==2.21.0 \
		peft==0.21.2 trl==1.16.0 datasets==5.2.0 \
		safetensors pytest pytest-xdist numpy tqdm pyyaml psutil
	touch $(STAMP)

venv: $(STAMP)

build: venv
	$(VPY) setup.py -q build_ext --inplace

install: build
	$(VPY) -m pip install -q --no-build-isolation --no-deps -e .

demo: install
	$(VPY) -m accelerate_c launch --num_processes 2 examples/train_gpt.py $(or $(DEMO_ARGS),--overwrite)

test: install
	$(VPY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=40 tests

bench: install
	$(VPY) benchmarks/run_all.py

clean:
	rm -rf build dist *.egg-info accelerate_c/_C*.so
