"""megatron-prefix-reuse: shared-prefix reuse for RL post-training on Megatron-LM."""
from setuptools import find_packages, setup

setup(
    name="megatron-prefix-reuse",
    version="0.1.0",
    description=(
        "Run the shared prompt of a GRPO/PPO group once (prefix forward, suffix microbatches "
        "over cached K/V, prefix backward once) inside Megatron-LM, exactly equal to dense training."
    ),
    packages=find_packages(include=["prefix_schedule", "prefix_schedule.*", "megatron_patches",
                                    "megatron_patches.*"]),
    package_data={"megatron_patches": ["snapshots/*.json", "patches/*/*.patch"]},
    python_requires=">=3.10",
    # megatron-core: 0.19.1, 0.19.2 and Megatron-LM main 0.20.0 are supported (see
    # megatron_patches/patching/declarations.py); the PyPI release tested is 0.19.2. On Python 3.11 it installs
    # with `pip install --no-deps --ignore-requires-python megatron-core==0.19.2` (the Makefile).
    install_requires=["torch>=2.4", "numpy", "packaging"],
    extras_require={
        "megatron": ["megatron-core==0.19.2"],
        "gpu": ["transformer-engine[pytorch]>=2.4", "flash-attn>=2.6"],
        "dev": ["pytest>=8", "hypothesis>=6"],
    },
)
