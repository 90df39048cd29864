# The two quick-start commands (README): `make demo` and `make test`.
# Both install what they need into the current Python environment.
PYTHON ?= python3
PIP = $(PYTHON) -m pip install --disable-pip-version-check -q
MEGATRON_CORE = megatron-core==0.16.1

.PHONY: install install-test demo test bench

# The main job needs no torch: the reader, the builder, preprocessing and the gate are numpy+numba.
install:
	$(PIP) -e '.[preprocess,gate,fast]'

# torch first and pinned (a CPU wheel); megatron-core without deps so it cannot replace it.
install-test:
	$(PIP) torch==2.13.0
	$(PIP) -e '.[all]'
	$(PIP) --no-deps $(MEGATRON_CORE)

demo: install
	$(PYTHON) tools/demo.py

test: install-test
	$(PYTHON) -m pytest -n 2 -q tests

bench: install-test
	$(PYTHON) -m bench.compare
