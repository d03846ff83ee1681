"""The decoder on 8 fake CPU devices: parameters created sharded as the rules say; sharded forward/extend
equal the unsharded ones."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from comprl_jax.models import ModelConfig
from comprl_jax.models import decoder as D
from comprl_jax.runtime import sharding

# Expected specs written out by hand from DEFAULT_RULES (layers/norm/head_dim replicated, embed->fsdp,
# vocab/heads/mlp->tensor; size-1 mesh axes dropped, trailing Nones trimmed).
EXPECTED = {
    "fsdp4_tensor2": {
        "embed": P("tensor", "fsdp"),
        "lm_head": P("fsdp", "tensor"),
        "final_norm": P(),
        "layers/attn_norm": P(),
        "layers/mlp_norm": P(),
        "layers/q_proj": P(None, "fsdp", "tensor"),
        "layers/k_proj": P(None, "fsdp", "tensor"),
        "layers/v_proj": P(None, "fsdp", "tensor"),
        "layers/o_proj": P(None, "tensor", "fsdp"),
        "layers/q_bias": P(None, "tensor"),
        "layers/k_bias": P(None, "tensor"),
        "layers/v_bias": P(None, "tensor"),
        "layers/gate_proj": P(None, "fsdp", "tensor"),
        "layers/up_proj": P(None, "fsdp", "tensor"),
        "layers/down_proj": P(None, "tensor", "fsdp"),
    },
    "data2_fsdp4": {
        "embed": P(None, "fsdp"),
        "lm_head": P("fsdp"),
        "final_norm": P(),
        "layers/attn_norm": P(),
        "layers/mlp_norm": P(),
        "layers/q_proj": P(None, "fsdp"),
        "layers/k_proj": P(None, "fsdp"),
        "layers/v_proj": P(None, "fsdp"),
        "layers/o_proj": P(None, None, "fsdp"),
        "layers/q_bias": P(),
        "layers/k_bias": P(),
        "layers/v_bias": P(),
        "layers/gate_proj": P(None, "fsdp"),
        "layers/up_proj": P(None, "fsdp"),
        "layers/down_proj": P(None, None, "fsdp"),
    },
}
MESHES = {"fsdp4_tensor2": {"fsdp": 4, "tensor": 2}, "data2_fsdp4": {"data": 2, "fsdp": 4}}


def _flat(params) -> dict[str, nnx.Variable]:
    flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
    return {"/".join(str(k.key) for k in path): v for path, v in flat}


@pytest.fixture(scope="module")
def reference():
    cfg = ModelConfig.tiny("qwen2")  # qwen2: has the bias parameters too
    graphdef, params = D.init_decoder(cfg, seed=3)
    rng = np.random.default_rng(0)
    b, t = 8, 10
    lengths = rng.integers(3, t + 1, b).astype(np.int32)
    mask = np.arange(t)[None] < lengths[:, None]
    tokens = rng.integers(0, cfg.vocab_size, (b, t)).astype(np.int32)
    positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
    logits = jax.jit(D.forward, static_argnums=0)(graphdef, params, tokens, positions, mask)
    return cfg, params, (tokens, positions, mask, lengths), np.asarray(logits)


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_sharded_forward_matches_unsharded(mesh_name, reference):
    cfg, ref_params, (tokens, positions, mask, lengths), ref_logits = reference
    mesh = sharding.make_mesh(MESHES[mesh_name])
    graphdef, params = D.init_decoder(cfg, seed=3, mesh=mesh)

    flat, ref_flat = _flat(params), _flat(ref_params)
    assert set(flat) == set(EXPECTED[mesh_name])
    for name, var in flat.items():
        arr = var.get_value()
        assert arr.sharding.spec == EXPECTED[mesh_name][name], name
        assert arr.sharding.spec == sharding.logical_to_spec(var.get_metadata()["out_sharding"], mesh=mesh), (
            name
        )
        # Created inside one jit with the same keys: same values as the unsharded init.
        np.testing.assert_allclose(
            np.asarray(arr), np.asarray(ref_flat[name].get_value()), atol=0, err_msg=name
        )

    batch = sharding.put_batch((tokens, positions, mask), mesh)
    logits = jax.jit(D.forward, static_argnums=0)(graphdef, params, *batch)
    np.testing.assert_allclose(np.asarray(logits)[mask], ref_logits[mask], atol=1e-5)

    # Under an ambient mesh the decoder also pins activations to the batch axes: same numbers.
    with jax.set_mesh(mesh):
        fwd = jax.jit(D.forward, static_argnums=0)
        assert "sharding_constraint" in str(jax.make_jaxpr(fwd, static_argnums=0)(graphdef, params, *batch))
        np.testing.assert_allclose(
            np.asarray(fwd(graphdef, params, *batch))[mask], ref_logits[mask], atol=1e-5
        )

    # The cached path under the same sharding, in both cache layouts (the accelerators' [L, B, S, Hkv, Dh], whose
    # write batches over layers and rows, and the CPU's keys_last): prefill logits equal the cache-free forward,
    # and a decode step after it gives the unsharded model's logits and cache.
    ext_fn = jax.jit(D.extend, static_argnums=0)
    step = jnp.asarray(tokens[:, :1])
    for keys_last in (False, True):
        cache = D.init_cache(cfg, tokens.shape[0], 16, keys_last=keys_last)
        shardings = [sharding.named_sharding(mesh, a) for a in cache.axes]
        cache = jax.device_put(cache, D.KVCache(*shardings, None, keys_last=keys_last))
        ext, cache = ext_fn(graphdef, params, cache, batch[0], jnp.asarray(lengths))
        np.testing.assert_allclose(np.asarray(ext)[mask], ref_logits[mask], atol=1e-5)
        np.testing.assert_array_equal(np.asarray(cache.lengths), lengths)
        assert cache.k.sharding.spec == shardings[0].spec, keys_last  # the write kept the cache's split
        ones = jnp.ones((tokens.shape[0],), jnp.int32)
        got, cache = ext_fn(graphdef, params, cache, step, ones)
        ref_cache = D.init_cache(cfg, tokens.shape[0], 16, keys_last=keys_last)
        _, ref_cache = ext_fn(graphdef, ref_params, ref_cache, jnp.asarray(tokens), jnp.asarray(lengths))
        want, ref_cache = ext_fn(graphdef, ref_params, ref_cache, step, ones)
        np.testing.assert_allclose(
            np.asarray(got), np.asarray(want), atol=1e-5, err_msg=f"keys_last={keys_last}"
        )
        for a, b in ((cache.k, ref_cache.k), (cache.v, ref_cache.v)):
            np.testing.assert_allclose(
                np.asarray(a), np.asarray(b), atol=1e-5, err_msg=f"keys_last={keys_last}"
            )
