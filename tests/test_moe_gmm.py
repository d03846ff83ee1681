"""The "gmm" MoE dispatch (issue 30, point 5): sorted tokens through grouped matmuls (the megablox Pallas kernel,
here in interpret mode, or ``jax.lax.ragged_dot``) and the expert-parallel all-to-all under ``shard_map``. Forward
and gradients equal the "dropless" dispatch (f32) for the MoE layer and a whole tiny qwen3_moe decoder, on one device
and on 8 fake CPU devices (``tests/conftest.py``); the TPU path compiles for ``v5p:2x2x1`` with libtpu."""

import dataclasses
import importlib.util
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from comprl_jax.models import ModelConfig, moe
from comprl_jax.models import decoder as D
from comprl_jax.runtime import sharding

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIBTPU_DIR = os.path.join(REPO, ".libtpu")

# f32: the grouped matmuls sum in another order than the dropless path's masked products; nothing else differs.
RTOL, ATOL = 1e-5, 1e-6


def _close(got, want, name=""):
    """allclose with the absolute floor scaled to the array (gradients of different layers differ in size)."""
    got, want = np.asarray(got), np.asarray(want)
    np.testing.assert_allclose(
        got, want, rtol=RTOL, atol=ATOL * max(1.0, float(np.abs(want).max())), err_msg=name
    )


def _layer_case(e=8, k=2, t=6):
    cfg = ModelConfig.tiny(
        "qwen3_moe", hidden_size=32, num_experts=e, num_experts_per_tok=k, moe_intermediate_size=48
    )
    rng = np.random.default_rng(0)
    p = {n: jnp.asarray(rng.normal(0, 0.3, s), jnp.float32) for n, s in moe.param_shapes(cfg).items()}
    b = 8
    x = jnp.asarray(rng.normal(size=(b, t, cfg.hidden_size)), jnp.float32)
    valid = jnp.asarray(np.arange(t)[None] < rng.integers(2, t + 1, b)[:, None])
    return cfg, p, x, valid


def _layer_fn(cfg):
    def loss(p, x, valid):
        y, stats = moe.moe_mlp(cfg, p, x, valid)
        w = jnp.sin(jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape))  # every output element matters
        return jnp.sum(jnp.where(valid[..., None], y * w, 0.0)), (y, stats["expert_counts"])

    return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)


def _check_layer(got, want):
    (_, (y, counts)), (gp, gx) = got
    (_, (y_ref, counts_ref)), (gp_ref, gx_ref) = want
    _close(y, y_ref, "y")
    np.testing.assert_array_equal(np.asarray(counts), np.asarray(counts_ref))
    _close(gx, gx_ref, "d/dx")
    for n in gp_ref:
        _close(gp[n], gp_ref[n], f"d/d{n}")


@pytest.fixture(scope="module")
def layer_ref():
    cfg, p, x, valid = _layer_case()
    return cfg, p, x, valid, jax.jit(_layer_fn(cfg))(p, x, valid)


@pytest.mark.parametrize("dispatch", ["gmm", "gmm_interpret"])
def test_layer_matches_dropless_one_device(dispatch, layer_ref):
    cfg, p, x, valid, want = layer_ref
    got = jax.jit(_layer_fn(dataclasses.replace(cfg, moe_dispatch=dispatch)))(p, x, valid)
    _check_layer(got, want)


def test_layer_matches_dropless_with_the_expert_weights_transposed():
    """Hidden 128, expert width 48: the gate and up matmuls ([E, 128, 48]) go to the megablox kernel transposed
    (``transpose_rhs``; the layout the TPU gives such weights), the down one ([E, 48, 128]) as it is. Forward and
    gradients equal the dropless dispatch's."""
    assert moe.rhs_transposed(128, 48) and not moe.rhs_transposed(48, 128) and not moe.rhs_transposed(32, 48)
    cfg = ModelConfig.tiny(
        "qwen3_moe", hidden_size=128, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48
    )
    rng = np.random.default_rng(1)
    p = {n: jnp.asarray(rng.normal(0, 0.1, s), jnp.float32) for n, s in moe.param_shapes(cfg).items()}
    x = jnp.asarray(rng.normal(size=(4, 5, cfg.hidden_size)), jnp.float32)
    valid = jnp.asarray(np.arange(5)[None] < np.array([5, 3, 4, 1])[:, None])
    want = jax.jit(_layer_fn(cfg))(p, x, valid)
    got = jax.jit(_layer_fn(dataclasses.replace(cfg, moe_dispatch="gmm_interpret")))(p, x, valid)
    _check_layer(got, want)


# expert parallelism over fsdp (1 or 2 experts per device), with and without a tensor split of the expert width,
# and a mesh with no expert axis (each device sorts its own tokens, no exchange)
# and a mesh with no expert axis (each device sorts its own tokens, no exchange). "ragged": the exchange TPU runs
# (jax.lax.ragged_all_to_all, which XLA:CPU lacks) with a reference of its documented semantics in its place.
MESHES = {
    "fsdp8": ({"fsdp": 8}, "gmm_interpret", False),
    # 6 tokens per device in rounds of at most 4 (ModelConfig.moe_exchange_tokens): 2 rounds of 3
    "fsdp8_rounds": ({"fsdp": 8}, "gmm", False),
    "data2_fsdp2_tensor2": ({"data": 2, "fsdp": 2, "tensor": 2}, "gmm", False),
    "data2_fsdp4_ragged": ({"data": 2, "fsdp": 4}, "gmm", True),
    "data8": ({"data": 8}, "gmm", False),
}


def _ragged_all_to_all_reference(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name
):
    """``jax.lax.ragged_all_to_all`` as its docstring states it, through a dense ``all_to_all``."""
    n, m, p = operand.shape[0], output.shape[0], input_offsets.shape[0]
    idx = jnp.arange(n)
    col = (n,) + (1,) * (operand.ndim - 1)
    padded = jnp.concatenate([operand, jnp.zeros_like(operand)])
    blocks = jnp.stack(
        [
            jnp.where(
                (idx < send_sizes[i]).reshape(col),
                jax.lax.dynamic_slice_in_dim(padded, input_offsets[i], n),
                0,
            )
            for i in range(p)
        ]
    )
    got = jax.lax.all_to_all(blocks, axis_name, 0, 0, tiled=True)  # block j: the slice shard j sent here
    offsets = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
    for j in range(p):
        output = output.at[jnp.where(idx < recv_sizes[j], offsets[j] + idx, m)].set(got[j], mode="drop")
    return output


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_layer_expert_parallel_matches_dropless(mesh_name, layer_ref, monkeypatch):
    cfg, p, x, valid, want = layer_ref
    axes, dispatch, ragged = MESHES[mesh_name]
    if ragged:
        monkeypatch.setattr(moe, "RAGGED_EXCHANGE", True)
        monkeypatch.setattr(jax.lax, "ragged_all_to_all", _ragged_all_to_all_reference)
    mesh = sharding.make_mesh(axes)
    c = dataclasses.replace(cfg, moe_dispatch=dispatch)
    if mesh_name.endswith("_rounds"):
        c = dataclasses.replace(c, moe_exchange_tokens=4)
    specs = {n: sharding.named_sharding(mesh, moe.PARAM_AXES[n]) for n in p}
    ps = {n: jax.device_put(v, specs[n]) for n, v in p.items()}
    xs, vs = sharding.put_batch((x, valid), mesh)
    with jax.set_mesh(mesh):
        compiled = jax.jit(_layer_fn(c)).lower(ps, xs, vs).compile()
        got = compiled(ps, xs, vs)
    hlo = compiled.as_text()
    assert ("all-to-all" in hlo) == (mesh.shape["fsdp"] > 1), (
        mesh_name
    )  # the exchange only with an expert axis
    if mesh_name.endswith("_rounds"):  # the rounds are a loop (forward, and the rematerialised backward)
        one = jax.jit(_layer_fn(dataclasses.replace(c, moe_exchange_tokens=0))).lower(ps, xs, vs)
        with jax.set_mesh(mesh):
            one_hlo = one.compile().as_text()
        assert hlo.count("while") > one_hlo.count("while"), mesh_name
    _check_layer(got, want)


def test_rounds_pad_a_token_count_that_does_not_split_evenly():
    """7 tokens per device in rounds of at most 3: 3 rounds of 3, the last two slots padding (dropped)."""
    cfg, p, x, valid = _layer_case(t=7)
    want = jax.jit(_layer_fn(cfg))(p, x, valid)
    mesh = sharding.make_mesh({"fsdp": 8})
    c = dataclasses.replace(cfg, moe_dispatch="gmm", moe_exchange_tokens=3)
    ps = {n: jax.device_put(v, sharding.named_sharding(mesh, moe.PARAM_AXES[n])) for n, v in p.items()}
    xs, vs = sharding.put_batch((x, valid), mesh)
    with jax.set_mesh(mesh):
        got = jax.jit(_layer_fn(c))(ps, xs, vs)
    _check_layer(got, want)


def _decoder_case():
    cfg = ModelConfig.tiny("qwen3_moe", mlp_only_layers=(0,))  # a dense layer, then an MoE layer
    rng = np.random.default_rng(1)
    b, t = 8, 8
    lengths = rng.integers(3, t + 1, b).astype(np.int32)
    mask = np.arange(t)[None] < lengths[:, None]
    tokens = rng.integers(0, cfg.vocab_size, (b, t)).astype(np.int32)
    positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
    return cfg, (tokens, positions, mask)


def _decoder_fn(cfg):
    gd, _ = D.abstract_decoder(cfg)

    def loss(params, tokens, positions, mask):
        logits, aux = D.forward(gd, params, tokens, positions, mask, return_aux=True)
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        tok = jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]
        return -jnp.sum(jnp.where(mask, tok, 0.0)) + aux["load_balancing_loss"], logits

    return jax.value_and_grad(loss, has_aux=True)


def _check_decoder(got, want, mask):
    (value, logits), grads = got
    (value_ref, logits_ref), grads_ref = want
    _close(value, value_ref, "loss")
    _close(np.asarray(logits)[mask], np.asarray(logits_ref)[mask], "logits")
    flat = dict(jax.tree_util.tree_flatten_with_path(grads)[0])
    for path, g_ref in jax.tree_util.tree_flatten_with_path(grads_ref)[0]:
        _close(flat[path], g_ref, jax.tree_util.keystr(path))


@pytest.mark.slow
def test_decoder_matches_dropless():
    """A whole tiny qwen3_moe (a dense and an MoE layer): loss, logits and every parameter gradient, with the Pallas
    kernel (interpret mode) on one device and the expert-parallel exchange on fsdp=4 x tensor=2."""
    cfg, batch = _decoder_case()
    _, params = D.init_decoder(cfg, seed=3)
    want = jax.jit(_decoder_fn(cfg))(params, *batch)
    got = jax.jit(_decoder_fn(dataclasses.replace(cfg, moe_dispatch="gmm_interpret")))(params, *batch)
    _check_decoder(got, want, batch[2])

    mesh = sharding.make_mesh({"fsdp": 4, "tensor": 2})
    params_m = jax.device_put(
        params, sharding.state_shardings(params, mesh)
    )  # experts over fsdp, width over tensor
    batch_m = sharding.put_batch(batch, mesh)
    fn = jax.jit(_decoder_fn(dataclasses.replace(cfg, moe_dispatch="gmm")))
    with jax.set_mesh(mesh):
        compiled = fn.lower(params_m, *batch_m).compile()
        got = compiled(params_m, *batch_m)
    assert "all-to-all" in compiled.as_text()
    _check_decoder(got, want, batch[2])


# --- the TPU compiler ---------------------------------------------------------------------------------------------

_TPU_SCRIPT = textwrap.dedent(
    """
    import json, re, time
    from jax.experimental import topologies
    from launch.bench.moe_exchange import compile_tiny_moe

    devs = list(topologies.get_topology_desc("v5p:2x2x1", platform="tpu").devices)
    t0 = time.perf_counter()
    # expert axis (fsdp) of 2, width over tensor; expert width 256 (the kernel's tiles: 128 per tensor shard)
    compiled = compile_tiny_moe(devs, {"fsdp": 2, "tensor": 2}, 8, 256, moe_width=256)
    hlo = compiled.as_text()
    mem = compiled.memory_analysis()
    print(json.dumps({
        "ragged_all_to_all": hlo.count("ragged-all-to-all("),
        "compile_s": round(time.perf_counter() - t0, 1),
        "tpu_custom_call": hlo.count('custom_call_target="tpu_custom_call"'),
        # Mosaic custom calls named after the Pallas kernel
        "gmm": len(re.findall(r"%gmm(\\.\\d+)? = [^\\n]*custom-call\\(", hlo)),
        "tgmm": len(re.findall(r"%tgmm(\\.\\d+)? = [^\\n]*custom-call\\(", hlo)),
        "all_to_all": len(re.findall(r"(?<!ragged-)all-to-all\\(", hlo)),
        "ragged_dot": "ragged-dot" in hlo or "ragged_dot" in hlo,
        "temp_mib": round(mem.temp_size_in_bytes / 2**20, 1) if mem else None,
        "devices": len(devs),
    }))
    """
)


def _libtpu_available() -> bool:
    return importlib.util.find_spec("libtpu") is not None or os.path.isdir(os.path.join(LIBTPU_DIR, "libtpu"))


@pytest.mark.slow
@pytest.mark.skipif(
    not _libtpu_available(), reason="libtpu is not installed (make libtpu installs it in .libtpu/)"
)
def test_gmm_compiles_for_v5p():
    """A tiny qwen3_moe forward + grad with the gmm dispatch AOT-compiles for a v5p:2x2x1 slice (4 chips; fsdp=2 is
    the expert axis, tensor=2): the megablox kernels are Mosaic custom calls and the tokens move by all-to-all."""
    import json

    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env.update(
        JAX_PLATFORMS="cpu",
        ALLOW_MULTIPLE_LIBTPU_LOAD="1",
        PYTHONPATH=os.pathsep.join([LIBTPU_DIR, REPO, env.get("PYTHONPATH", "")]),
    )
    p = subprocess.run(
        [sys.executable, "-c", _TPU_SCRIPT], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert p.returncode == 0, p.stderr[-4000:]
    line = json.loads(p.stdout.strip().splitlines()[-1])
    print(line)
    # forward: gmm for gate, up, down; backward: gmm (d lhs) and tgmm (d rhs) for each
    assert line["gmm"] >= 6 and line["tgmm"] >= 3
    assert line["tpu_custom_call"] >= line["gmm"] + line["tgmm"]
    # the group counts go by a dense all-to-all, the tokens out and back by ragged ones (only the filled rows)
    assert line["all_to_all"] >= 2
    assert line["ragged_all_to_all"] >= 2
    assert not line["ragged_dot"]
