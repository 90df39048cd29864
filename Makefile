# The two quick-start commands (README): `make demo` and `make test`.
# Both install what they need into the current Python environment, editable (the native
# reader/validator is built into megatron_sft_idx/_native/ when g++ is present).
# .ci/constraints.txt pins this repo's dev/CI versions (torch 2.13.0 CPU, megatron-core);
# the package metadata (pyproject.toml) pins neither.
PYTHON ?= python3
PIP = $(PYTHON) -m pip install --disable-pip-version-check -q -c .ci/constraints.txt

.PHONY: install install-test demo test bench

# The main job needs no torch: the reader, the builder, preprocessing and the gate are numpy+numba.
install:
	$(PIP) -e '.[preprocess,gate]'

# torch first, on its own, so the CPU wheel is in place before anything could ask for another.
install-test:
	$(PIP) torch
	$(PIP) -e '.[all]'

demo: install
	$(PYTHON) tools/demo.py

test: install-test
	$(PYTHON) -m pytest -n 2 -q tests

bench: install-test
	$(PYTHON) -m bench.compare
