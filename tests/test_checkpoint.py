"""RunCheckpointer: round trip of sharded train state + host arrays + JSON, and corruption fallback."""

import json
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np

from comprl_jax.runtime import sharding as sh
from comprl_jax.runtime.checkpoint import RunCheckpointer


def _train_state(mesh, scale):
    spec = sh.named_sharding(mesh, ("embed", "mlp"))
    w = jax.device_put(jnp.arange(32, dtype=jnp.float32).reshape(4, 8) * scale, spec)
    return {
        "actor": {"w": w},
        "step": jnp.asarray(scale, jnp.int32),
        "key": jax.random.key_data(jax.random.key(3)),
    }


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def test_round_trip_keeps_values_and_shardings(tmp_path):
    mesh = sh.make_mesh({"fsdp": 4, "tensor": 2})
    ckpt = RunCheckpointer(tmp_path / "ckpt", save_every=2)
    train = _train_state(mesh, 1)
    arrays = {"bank_emb": np.random.default_rng(0).normal(size=(5, 3)).astype(np.float32)}
    host = {"bank": {"entries": [{"uid": "a", "text": "<title>t</title>"}]}, "counters": {"step": 2}}
    assert not ckpt.save(1, train, arrays, host)  # not due
    assert ckpt.save(2, train, arrays, host)
    step, train2, arrays2, host2 = ckpt.restore_latest(_abstract(train))
    assert step == 2
    np.testing.assert_array_equal(np.asarray(train2["actor"]["w"]), np.asarray(train["actor"]["w"]))
    assert train2["actor"]["w"].sharding.spec == train["actor"]["w"].sharding.spec
    np.testing.assert_array_equal(arrays2["bank_emb"], arrays["bank_emb"])
    assert host2 == host
    ckpt.close()


def test_empty_arrays_round_trip(tmp_path):
    mesh = sh.make_mesh({"data": -1})
    ckpt = RunCheckpointer(tmp_path / "c", save_every=1)
    train = _train_state(mesh, 1)
    ckpt.save(1, train, {"bank": np.zeros((0, 384), np.float32)}, {"x": 1})
    _, _, arrays, host = ckpt.restore_latest(_abstract(train))
    assert host == {"x": 1}
    assert arrays["bank"].shape == (0, 384) and arrays["bank"].dtype == np.float32


def test_corrupted_latest_falls_back_with_log(tmp_path, caplog):
    mesh = sh.make_mesh({"data": -1})
    directory = tmp_path / "ckpt"
    ckpt = RunCheckpointer(directory, save_every=1, max_to_keep=3)
    for step in (1, 2):
        ckpt.save(step, _train_state(mesh, step), {"a": np.full((2,), step)}, {"step": step})
    # Corrupt step 2's JSON item.
    host_dir = directory / "2" / "host"
    files = [os.path.join(r, f) for r, _, fs in os.walk(host_dir) for f in fs]
    assert files, f"no host files under {host_dir}"
    for f in files:
        with open(f, "w") as fh:
            fh.write("{not json")
    ckpt2 = RunCheckpointer(directory, save_every=1, max_to_keep=3)
    with caplog.at_level(logging.WARNING):
        step, train, arrays, host = ckpt2.restore_latest(_abstract(_train_state(mesh, 1)))
    assert step == 1 and host == {"step": 1}
    np.testing.assert_array_equal(arrays["a"], [1, 1])
    assert "checkpoint step 2" in caplog.text and "falling back" in caplog.text
    json.dumps(host)
