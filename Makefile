# The two commands of the README: `make demo` (the main job) and `make test`.
# Both create .venv on first use; torch stays pinned by constraints.txt; DeepSpeed (a test
# dependency: tests run it on CPU to produce real checkpoints) installs without building ops.
VENV ?= .venv
PY := $(VENV)/bin/python

$(VENV)/.installed: pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	DS_BUILD_OPS=0 $(PY) -m pip install -q -c constraints.txt -e '.[test]'
	touch $@

.PHONY: demo test bench docs
demo: $(VENV)/.installed
	$(VENV)/bin/ucp-zarr demo

# two workers (one file each at a time: module fixtures such as the DeepSpeed and Megatron
# jobs run once): most tests wait on processes, servers and the disk, so two cores overlap them
TEST_WORKERS ?= 2
test: $(VENV)/.installed
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25

# the documentation site (mkdocs.yml) into build/site; any warning fails the build
docs: $(VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

# every benchmark, one table and the plots in benchmarks/results/ (about 15 minutes on 2 cores);
# zarrs (the Rust codec pipeline for zarr-python) is a peer of the codec benchmark only
bench: $(VENV)/.installed
	$(PY) -m pip install -q -c constraints.txt zarrs
	$(PY) benchmarks/run_all.py
