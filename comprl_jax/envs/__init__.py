"""Text environments (gymnasium API, ``spaces.Text``) and the async environment pool.

``make(env_id, **kwargs)`` builds one of ``ENV_IDS`` (lazy: NLE / TextWorld load on first use);
``EnvPool`` (``comprl_jax.envs.pool``) runs many of them on worker threads or processes.
"""

from comprl_jax.envs.base import TextEnv, parse_answer
from comprl_jax.envs.registry import ENV_IDS, EnvSpec, make, register, register_with_gymnasium, spec

register_with_gymnasium()

__all__ = ["ENV_IDS", "EnvSpec", "TextEnv", "make", "parse_answer", "register", "spec"]
