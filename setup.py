"""comprl_jax: Complementary RL (co-evolving actor and experience extractor) in JAX/Flax."""

from setuptools import find_packages, setup

CORE = [
    "jax>=0.9,<0.13",
    "flax>=0.12,<0.13",
    "optax>=0.2.5,<0.3",
    "orbax-checkpoint>=0.11,<0.13",
    "chex>=0.1.90,<0.2",
    "numpy>=1.26,<3",
    "ml-collections>=1.0,<2",
    "absl-py>=2.1,<3",
    "safetensors>=0.4,<1",
    "tokenizers>=0.21,<1",
    "sentencepiece>=0.2,<0.3",
    "gguf>=0.17,<1",
    "outlines-core>=0.2,<0.3",
    "scann>=1.4,<2",
    "gymnasium>=1.0,<2",
    "setuptools<81",  # minihack / gym-sokoban import pkg_resources
    "nle>=1.2,<2",
    "minihack>=1.0.2,<2",
    "gym-sokoban==0.0.6",
    "alfworld==0.4.2",
    "rank-bm25>=0.2.2,<0.3",
    "rapidfuzz>=3,<4",
    "jax-smi>=1.0.4,<2",
    "tensorboardX>=2.6,<3",
    "tensorboard>=2.16,<3",  # the viewer the demo points to (tensorboardX only writes)
    "matplotlib>=3.8,<4",
    "tqdm>=4.66,<5",
    "psutil>=5.9,<8",
]

setup(
    name="comprl_jax",
    version="0.1.0",
    description="Complementary RL (arXiv 2603.17621) in JAX/Flax: co-evolving LLM actor and experience extractor.",
    packages=find_packages(include=["comprl_jax", "comprl_jax.*"]),
    package_data={
        "comprl_jax.envs": ["alfworld_rl_train.txt"],  # ALFWorld's training games (a data file)
        "comprl_jax.envs.swe": ["tasks.jsonl"],  # SWE-Lite's tasks (launch/make_swe_tasks.py rebuilds them)
        "comprl_jax.models": ["presets/*.json", "presets/README.md"],  # the shipped model configs
    },
    python_requires=">=3.10",
    install_requires=CORE,
    extras_require={
        # Test-time references only: torch CPU for transformers parity, hypothesis for fuzzing.
        # Install torch==2.13.0 *before* this extra (the Makefile does) so pip keeps the CPU build.
        "test": [
            "torch==2.13.0",
            "transformers>=4.56,<6",
            "accelerate>=1.0,<2",
            "pytest>=8,<10",
            "pytest-timeout>=2.3,<3",
            "pytest-xdist>=3.5,<4",
            "hypothesis>=6.100,<7",
            "filelock>=3.12,<4",  # JAX's lock around a shared persistent compilation cache (tests)
            "jupytext>=1.16,<2",
            "nbclient>=0.10,<1",
            "ipykernel>=6.29,<8",
            "ruff>=0.6,<1",
        ],
        "cuda12": ["jax[cuda12]>=0.9,<0.13"],
        # libtpu: the TPU runtime and compiler, pinned to the version jax[tpu] pins for jax 0.10.2 (also what
        # launch/compile_check.py compiles with on a CPU: `make libtpu` installs it into .libtpu/ instead).
        "tpu": ["jax[tpu]>=0.9,<0.13", "libtpu==0.0.42.*"],
    },
)
