"""comprl_jax: Complementary RL (arXiv 2603.17621) in JAX/Flax.

Subpackages: ``models`` (decoders, embedders, HF/GGUF I/O), ``envs`` (text environments + async pool),
``experience`` (bank, ScaNN retrieval, extractor ops, manager), ``rl`` (losses, train states, update steps).
Modules: ``sharding``, ``tokenizer``, ``sampling``, ``trainer``, ``checkpoint``, ``metrics``.
"""

__version__ = "0.1.0"
