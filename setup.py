"""megatron_sft_idx: packed SFT data in an extended Megatron .bin/.idx format."""

import os

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))
version = {}
with open(os.path.join(HERE, "megatron_sft_idx", "version.py")) as f:
    exec(f.read(), version)

# torch is pinned: 2.13.0 is the CPU wheel found locally; anything looser pulls GBs of CUDA.
TORCH = "torch==2.13.0"
# megatron-core is installed by the Makefile with --no-deps after the pinned torch
# (its own requirements would otherwise be resolved against the registry's newest torch).
EXTRAS = {
    # transformers renders chat templates; it does not need torch.
    "preprocess": ["tokenizers>=0.19", "transformers>=4.44", "jinja2>=3.1", "tqdm>=4.66",
                   "pyarrow>=15", "zstandard>=0.22"],
    # Batched tokenization for the main job (several times faster than per-text tokenizers.encode);
    # checked against tokenizers at start-up and on a sample of every batch, which stays the fallback.
    "fast": ["gigatoken>=0.10"],
    # Same CRC-32 as zlib, several times faster; the gate and builder fall back to zlib without it.
    "gate": ["zlib-ng>=0.5"],
    "train": [TORCH, "packaging", "pyarrow>=15"],
    "test": [TORCH, "pytest>=8", "hypothesis>=6.100", "pytest-xdist>=3.5", "pyarrow>=15",
             "packaging"],
    "bench": [TORCH, "pyarrow>=15", "matplotlib>=3.8", "psutil>=5.9"],
}
EXTRAS["all"] = sorted({req for reqs in EXTRAS.values() for req in reqs})

setup(
    name="megatron_sft_idx",
    version=version["__version__"],
    description="Packed SFT data for Megatron in an extended, upstream-compatible .bin/.idx format",
    long_description=open(os.path.join(HERE, "README.md")).read() if os.path.exists(os.path.join(HERE, "README.md")) else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_sft_idx", "megatron_sft_idx.*"]),
    install_requires=["numpy>=1.24", "numba>=0.59"],
    extras_require=EXTRAS,
    entry_points={"console_scripts": [
        "preprocess-sft = megatron_sft_idx.preprocess.cli:main",
        "check-idx = megatron_sft_idx.gate.cli:main",
        "write-sft-manifest = megatron_sft_idx.training.manifest_cli:main",
    ]},
    classifiers=["Programming Language :: Python :: 3", "License :: OSI Approved :: Apache Software License"],
)
