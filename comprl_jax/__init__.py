"""comprl_jax: Complementary RL (arXiv 2603.17621) in JAX/Flax.

Subpackages: ``models`` (decoders, embedders, HF/GGUF I/O), ``envs`` (text environments + async pool),
``experience`` (bank, ScaNN retrieval, extractor ops, manager), ``rl`` (losses, train states, update steps).
Modules: ``sharding``, ``tokenizer``, ``sampling``, ``trainer``, ``checkpoint``, ``metrics``.
"""

__version__ = "0.1.0"

# Parameters carry logical axis names (``out_sharding=`` metadata) that *we* resolve with the rule table in
# ``comprl_jax.sharding``; NNX's eager sharding would instead demand a mesh context whenever a module is built
# (even unsharded, on one CPU). Turn it off for the process: the same model code then runs with and without a mesh.
from flax import nnx as _nnx  # noqa: E402

_nnx.use_eager_sharding(False)
