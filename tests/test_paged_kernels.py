"""A paged cache's decode step through the Pallas paged-attention kernels (``models/paged_kernels.py``; issue 30
point 2): the TPU (Mosaic) and GPU (Triton) kernels in Pallas' interpreter on CPU against the gather path, at
the kernel (exact on bfloat16-representable pages) and through ``Decoder.extend`` over decode steps with
scattered pages, ragged lengths and an idle row; the choice per platform; and a subprocess that compiles a
decode step for a v5p:2x2x1 topology (libtpu) and finds the Mosaic kernel in the HLO with no copy of the pool."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from trainer_helpers import libtpu_path

from comprl_jax.models import ModelConfig, init_decoder
from comprl_jax.models import decoder as D
from comprl_jax.models import kv_cache as KV
from comprl_jax.models import paged_kernels as PK

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("kernel", ["tpu", "gpu"])
def test_kernel_equals_the_gather_reference(kernel):
    """decode_attention (layer and head folded into the page ids, ``P`` entries clamped) equals softmax
    attention over the row's gathered pages: GQA 2 x 2 heads, head_dim 128, pages in random order."""
    rng = np.random.default_rng(0)
    L, hkv, n_pages, ps, dh, b, w, g = 2, 2, 14, 16, 128, 3, 4, 2
    # bfloat16-representable values: the TPU kernel reads pages as bfloat16
    pool = lambda: jnp.asarray(rng.normal(size=(L, hkv, n_pages, ps, dh)), jnp.bfloat16).astype(jnp.float32)  # noqa: E731
    kp, vp = pool(), pool()
    pages = np.full((b, w), n_pages, np.int32)
    pages[:, :3] = rng.permutation(n_pages)[:9].reshape(b, 3)  # the last column: no page
    lengths = jnp.array([21, 8, 48], jnp.int32)
    q = jnp.asarray(rng.normal(size=(b, 1, hkv * g, dh)), jnp.float32)
    layer = 1
    with PK.forced(kernel, interpret=True):
        out = PK.decode_attention(q, kp, vp, layer, jnp.asarray(pages), lengths, kernel=kernel)
    k = jnp.take(kp[layer], pages, axis=1, mode="fill", fill_value=0).reshape(hkv, b, w * ps, dh)
    v = jnp.take(vp[layer], pages, axis=1, mode="fill", fill_value=0).reshape(hkv, b, w * ps, dh)
    s = jnp.einsum("bkgd,kbsd->bkgs", q[:, 0].reshape(b, hkv, g, dh), k, precision="highest") / np.sqrt(dh)
    s = jnp.where((jnp.arange(w * ps)[None, :] < lengths[:, None])[:, None, None], s, -1e30)
    want = jnp.einsum("bkgs,kbsd->bkgd", jax.nn.softmax(s, -1), v, precision="highest").reshape(b, 1, -1)
    np.testing.assert_allclose(out, want, atol=2e-6, rtol=0)


@pytest.mark.parametrize("kernel,dtype,atol", [("tpu", "bfloat16", 3e-3), ("gpu", "float32", 2e-6)])
def test_decode_steps_through_the_kernel_equal_the_gather_path(kernel, dtype, atol):
    """A tiny Qwen3 (head_dim 128): prefill on the gather path, then 3 decode steps through the kernel and
    through the gather path: same logits (float32 pool: to rounding; bfloat16 pool: the kernel keeps q in
    float32, the gather path rounds it), same argmax, same cache (pools and lengths). Pages are scattered in a
    random order, lengths ragged, and in the last step row 2 is idle (num_new = 0: nothing written)."""
    cfg = ModelConfig.tiny("qwen3", head_dim=128)
    graphdef, params = init_decoder(cfg, seed=0)
    rng = np.random.default_rng(0)
    B, PS, W, NP = 3, 16, 4, 14
    toks = rng.integers(1, cfg.vocab_size, (B, 40)).astype(np.int32)
    cache = D.init_paged_cache(cfg, B, W * PS, num_pages=NP, page_size=PS, dtype=dtype)
    cache = cache.replace(pages=jnp.asarray(rng.permutation(NP)[:12].reshape(B, W), jnp.int32))
    _, cache = D.extend(graphdef, params, cache, toks[:, :33], jnp.array([20, 7, 33], jnp.int32))
    gather = jax.jit(lambda p, c, t, n: D.extend(graphdef, p, c, t, n))
    with PK.forced(kernel, interpret=True):
        assert KV.decode_kernel(cache, 1) == kernel and KV.decode_kernel(cache, 2) is None
        fused = jax.jit(lambda p, c, t, n: D.extend(graphdef, p, c, t, n))
        fused.lower(params, cache, toks[:, :1], jnp.ones((B,), jnp.int32))  # traced with the kernel forced
    c1 = c2 = cache
    for s in range(3):
        tok = toks[:, 33 + s : 34 + s]
        num = jnp.array([1, 1, 1 if s < 2 else 0], jnp.int32)
        l1, c1 = gather(params, c1, tok, num)
        with PK.forced(kernel, interpret=True):
            l2, c2 = fused(params, c2, tok, num)
        live = slice(0, 3 if s < 2 else 2)
        np.testing.assert_allclose(l2[live], l1[live], atol=atol, rtol=0)
        np.testing.assert_array_equal(np.argmax(l2[live], -1), np.argmax(l1[live], -1))
        np.testing.assert_array_equal(c2.lengths, c1.lengths)
        np.testing.assert_allclose(c2.k.astype(jnp.float32), c1.k.astype(jnp.float32), atol=max(atol, 2e-2))
        np.testing.assert_allclose(c2.v.astype(jnp.float32), c1.v.astype(jnp.float32), atol=max(atol, 2e-2))
    np.testing.assert_array_equal(c2.lengths, [23, 10, 35])


def test_the_choice():
    """CPU default: the gather path; dense caches and prefills never take a kernel; a forced kernel does (in
    the interpreter); an unknown name raises."""
    cfg = ModelConfig.tiny("qwen3", head_dim=128)
    paged = jax.eval_shape(lambda: KV.init_paged_cache(cfg, 2, 64, 8, 16, dtype=jnp.bfloat16))
    dense = jax.eval_shape(lambda: KV.init_cache(cfg, 2, 64))
    assert KV.decode_kernel(paged, 1) is None  # CPU: gather
    with PK.forced("tpu", interpret=True):
        assert KV.decode_kernel(paged, 1) == "tpu"
        assert KV.decode_kernel(paged, 4) is None and KV.decode_kernel(dense, 1) is None
    with PK.forced("gpu", interpret=False):  # the Triton kernel on a CPU platform: gather, logged
        assert KV.decode_kernel(paged, 1) is None
    assert PK.KERNEL == "auto" and PK.INTERPRET is None
    with pytest.raises(ValueError, match="paged kernel"), PK.forced("flash"):
        pass


_TPU_SCRIPT = textwrap.dedent(
    """
    import json, os, re
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    import jax, jax.numpy as jnp
    from jax.experimental import topologies
    from comprl_jax.models import decoder, kv_cache
    from comprl_jax.models.config import ModelConfig
    from comprl_jax.runtime import sharding as shd
    from comprl_jax.sampling.service import cache_shardings

    devs = list(topologies.get_topology_desc("v5p:2x2x1", platform="tpu").devices)
    mesh = shd.make_mesh({"data": 1, "fsdp": -1, "tensor": 1}, devs)
    cfg = ModelConfig.tiny("qwen3", head_dim=128, dtype="bfloat16")
    gd, ap = decoder.abstract_decoder(cfg)
    ap = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), ap,
                      shd.state_shardings(ap, mesh))
    B, W, PS, NP = 8, 8, 64, 64
    cache = jax.eval_shape(lambda: kv_cache.init_paged_cache(cfg, B, W * PS, NP, PS))
    cache = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), cache,
                         cache_shardings(mesh, cfg, cache))
    rows = shd.named_sharding(mesh, ("batch",))
    pool = re.escape("bf16[%d,%d,%d,%d,%d]" % cache.k.shape)
    out = {}
    for t in (1, 16):  # a decode step; a prefill (the gather path)
        tok = jax.ShapeDtypeStruct((B, t), jnp.int32, sharding=rows)
        num = jax.ShapeDtypeStruct((B,), jnp.int32, sharding=rows)
        step = lambda p, c, tok, num: decoder.extend(gd, p, c, tok, num, logits_at=num - 1)
        with jax.set_mesh(mesh):
            picked = kv_cache.decode_kernel(cache, t)
            compiled = jax.jit(step, donate_argnums=1).lower(ap, cache, tok, num).compile()
        hlo = compiled.as_text()
        out[t] = {
            "picked": picked,
            "kernels": hlo.count('custom_call_target="tpu_custom_call"'),
            "pool_copies": len(re.findall(r"= %s\\{[^}]*\\} copy\\(" % pool, hlo)),
            "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
            "pool_bytes": 2 * cache.k.size * 2,
        }
    print("RESULT " + json.dumps(out))
    """
)


@pytest.mark.slow
def test_paged_decode_compiles_for_v5p_with_the_mosaic_kernel():
    """A paged decode step of a tiny Qwen3 (bf16, head_dim 128; rows over fsdp=4) compiled for v5p:2x2x1: auto
    picks the TPU kernel, the Mosaic custom call is in the HLO, and the pool is never copied (the in-scan write
    keeps its layout); a prefill keeps the gather path (no kernel)."""
    libtpu = libtpu_path()
    if libtpu is None:
        pytest.skip("libtpu is not importable (`make libtpu` installs it into .libtpu/)")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (libtpu, REPO, env.get("PYTHONPATH", "")) if p)
    p = subprocess.run(
        [sys.executable, "-c", _TPU_SCRIPT], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT ") :])
    print(out)
    assert out["1"]["picked"] == "tpu" and out["1"]["kernels"] >= 1 and out["1"]["pool_copies"] == 0
    assert out["1"]["temp_bytes"] < out["1"]["pool_bytes"]
    assert out["16"]["picked"] is None and out["16"]["kernels"] == 0


# The Triton kernel in Pallas' interpreter: the TPU kernel's interpreter (force_tpu_interpret_mode) hung under
# shard_map on several fake devices (no CPU use after minutes; 2026-12-06).
KERNEL_ON_MESH = "gpu"


def test_kernel_path_with_heads_split_over_tensor_equals_one_device():
    """The kernel path on a decode mesh of 8 fake devices (rows over data 4, KV heads over tensor 2, the pool
    split over its KV heads as the sampler places it): three decode steps give the one-device gather path's
    logits and cache. The in-scan write (``kv_cache.write_layer``) scatters with the KV heads as a batch dim of
    the scatter; its flat ``[L * Hkv * P, page, Dh]`` view merged the split head axis, and the TPU compiler
    all-gathered the whole pool for every layer of every step (``tests/test_compile_check.py``)."""
    from comprl_jax.runtime import sharding as shd
    from comprl_jax.sampling.service import cache_shardings

    cfg = ModelConfig.tiny("qwen3", head_dim=128, num_heads=4, num_kv_heads=2)
    graphdef, params = init_decoder(cfg, seed=0)
    rng = np.random.default_rng(1)
    B, PS, W, NP = 4, 16, 4, 16
    toks = rng.integers(1, cfg.vocab_size, (B, 40)).astype(np.int32)
    cache = D.init_paged_cache(cfg, B, W * PS, num_pages=NP, page_size=PS)
    cache = cache.replace(pages=jnp.asarray(rng.permutation(NP).reshape(B, W), jnp.int32))
    _, cache = D.extend(graphdef, params, cache, toks[:, :33], jnp.array([20, 7, 33, 1], jnp.int32))
    mesh = shd.make_mesh({"data": 4, "tensor": 2})
    sp = jax.device_put(params, shd.state_shardings(params, mesh))
    sc = jax.device_put(cache, cache_shardings(mesh, cfg, cache))
    assert sc.k.sharding.spec[1] == "tensor", sc.k.sharding  # the pool is split over its KV heads
    rows = shd.named_sharding(mesh, ("batch",))
    gather = jax.jit(lambda p, c, t, n: D.extend(graphdef, p, c, t, n))
    with PK.forced(KERNEL_ON_MESH, interpret=True), jax.set_mesh(mesh):
        fused = jax.jit(lambda p, c, t, n: D.extend(graphdef, p, c, t, n))
        assert KV.decode_kernel(sc, 1) == KERNEL_ON_MESH
    c1, c2 = cache, sc
    for s in range(3):
        tok = toks[:, 33 + s : 34 + s]
        num = jnp.array([1, 1, 1, 1 if s < 2 else 0], jnp.int32)
        l1, c1 = gather(params, c1, tok, num)
        with PK.forced(KERNEL_ON_MESH, interpret=True), jax.set_mesh(mesh):
            l2, c2 = fused(sp, c2, jax.device_put(tok, rows), jax.device_put(num, rows))
        live = slice(0, 4 if s < 2 else 3)
        np.testing.assert_allclose(np.asarray(l2)[live], np.asarray(l1)[live], atol=2e-6, rtol=0)
        np.testing.assert_array_equal(c2.lengths, c1.lengths)
        # sharded matmuls round differently (1e-6); a key or value in the wrong slot differs by O(1)
        np.testing.assert_allclose(np.asarray(c2.k), np.asarray(c1.k), atol=1e-5, rtol=0)
        np.testing.assert_allclose(np.asarray(c2.v), np.asarray(c1.v), atol=1e-5, rtol=0)
    assert c2.k.sharding.spec[1] == "tensor"
    np.testing.assert_array_equal(c2.lengths, [23, 10, 36, 3])
