"""Model layer: the Qwen2/Qwen2.5/Qwen3/Llama decoder (Flax NNX), HF safetensors I/O, embedders.

Main entry points::

    from comprl_jax.models import ModelConfig, init_decoder, forward, extend, init_cache, load_hf, save_hf
"""

from comprl_jax.models.config import ModelConfig, named_config
from comprl_jax.models.decoder import (
    CACHE_AXES,
    Decoder,
    KVCache,
    abstract_decoder,
    count_params,
    extend,
    forward,
    init_cache,
    init_decoder,
)

__all__ = [
    "CACHE_AXES",
    "Decoder",
    "KVCache",
    "ModelConfig",
    "abstract_decoder",
    "count_params",
    "extend",
    "forward",
    "init_cache",
    "init_decoder",
    "load_hf",
    "named_config",
    "save_hf",
]


def __getattr__(name):
    # hf_io pulls in safetensors; import it on first use so `import comprl_jax.models` stays light.
    if name in ("load_hf", "save_hf"):
        from comprl_jax.models import hf_io

        return getattr(hf_io, name)
    raise AttributeError(f"module 'comprl_jax.models' has no attribute {name!r}")
