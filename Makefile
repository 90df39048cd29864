# The two quick-start commands (README): `make demo` and `make test`.
# Both install what they need into the current Python environment.
PYTHON ?= python3
PIP = $(PYTHON) -m pip install --disable-pip-version-check -q
MEGATRON_CORE = megatron-core==0.16.1
# Side-by-side megatron stacks for tests/compat (tests/compat/stacks.py), each in its own
# --target directory so neither replaces the environment's megatron-core. Megatron-Bridge
# declares Python >= 3.12 (the CPU torch wheel is for 3.11): --ignore-requires-python; its
# data modules also need HF datasets (pure Python), pinned here without their deps.
DEPS = .deps
PIP_TARGET = $(PIP) --no-deps --ignore-requires-python --target
STACK_CORE_016 = $(DEPS)/megatron-core-0.16.1
STACK_BRIDGE_062 = $(DEPS)/megatron-bridge-0.6.2

.PHONY: install install-test install-compat demo test bench

# The main job needs no torch: the reader, the builder, preprocessing and the gate are numpy+numba.
install:
	$(PIP) -e '.[preprocess,gate]'

# torch first and pinned (a CPU wheel); megatron-core without deps so it cannot replace it.
install-test:
	$(PIP) torch==2.13.0
	$(PIP) -e '.[all]'
	$(PIP) --no-deps $(MEGATRON_CORE)
	$(MAKE) install-compat

install-compat: $(STACK_CORE_016)/.installed $(STACK_BRIDGE_062)/.installed

$(STACK_CORE_016)/.installed:
	rm -rf $(STACK_CORE_016)
	$(PIP_TARGET) $(STACK_CORE_016) megatron-core==0.16.1
	touch $@

$(STACK_BRIDGE_062)/.installed:
	rm -rf $(STACK_BRIDGE_062)
	$(PIP_TARGET) $(STACK_BRIDGE_062) megatron-core==0.19.2 megatron-bridge==0.6.2 \
		datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0
	touch $@

demo: install
	$(PYTHON) tools/demo.py

test: install-test
	$(PYTHON) -m pytest -n 2 -q tests

bench: install-test
	$(PYTHON) -m bench.compare
