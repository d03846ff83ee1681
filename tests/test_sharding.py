"""Mesh construction and logical-axis resolution (comprl_jax/runtime/sharding.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from comprl_jax.runtime import sharding as sh


def test_resolve_axes_fills_and_validates():
    assert sh.resolve_axes({"data": -1}, 8) == {"data": 8, "fsdp": 1, "tensor": 1}
    assert sh.resolve_axes({"fsdp": 4, "tensor": -1}, 8) == {"data": 1, "fsdp": 4, "tensor": 2}
    with pytest.raises(ValueError, match="at most one mesh axis"):
        sh.resolve_axes({"data": -1, "fsdp": -1}, 8)
    with pytest.raises(ValueError, match="spans 6 devices"):
        sh.resolve_axes({"fsdp": 3, "tensor": 2}, 8)
    with pytest.raises(ValueError, match="unknown"):
        sh.resolve_axes({"model": 2}, 8)


def test_logical_to_spec_rules():
    mesh = sh.make_mesh({"fsdp": 4, "tensor": 2})
    assert sh.logical_to_spec(("embed", "mlp"), mesh=mesh) == P("fsdp", "tensor")
    assert sh.logical_to_spec(("vocab", "embed"), mesh=mesh) == P("tensor", "fsdp")
    # batch maps to (data, fsdp); data has size 1 here so it is dropped.
    assert sh.logical_to_spec(("batch", "length"), mesh=mesh) == P("fsdp")
    # A mesh axis is used at most once.
    assert sh.logical_to_spec(("heads", "mlp"), mesh=mesh) == P("tensor")
    with pytest.raises(KeyError, match="no sharding rule"):
        sh.logical_to_spec(("nonsense",))
    mesh2 = sh.make_mesh({"data": 2, "fsdp": 4})
    assert sh.logical_to_spec(("batch",), mesh=mesh2) == P(("data", "fsdp"))


class _Toy(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (8, 16)), out_sharding=("embed", "mlp"))
        self.b = nnx.Param(jnp.zeros((16,)), out_sharding=("mlp",))


def test_create_sharded_places_params_by_rules():
    mesh = sh.make_mesh({"fsdp": 4, "tensor": 2})
    _, state = sh.create_sharded(lambda: _Toy(nnx.Rngs(0)), mesh)
    assert state["w"][...].sharding.spec == P("fsdp", "tensor")
    assert state["b"][...].sharding.spec == P("tensor")
    # Same values as an unsharded init with the same seed.
    with sh.own_sharding_rules():  # (a module built by hand: our logical names, no NNX eager sharding)
        ref = _Toy(nnx.Rngs(0))
    np.testing.assert_array_equal(np.asarray(state["w"][...]), np.asarray(ref.w[...]))


def test_put_batch_shards_over_batch_axes():
    mesh = sh.make_mesh({"data": 2, "fsdp": 4})
    x = np.arange(16 * 3).reshape(16, 3)
    out = sh.put_batch({"x": x}, mesh)
    assert out["x"].sharding.spec == P(("data", "fsdp"))
    np.testing.assert_array_equal(np.asarray(out["x"]), x)
