"""Attention backends (models/attention.py, issue 30) against the ``xla`` reference, values and gradients.

- ``splash``: the Pallas TPU kernel itself, run on CPU in Pallas' interpreter (``interpret=True``), forward and
  its custom backward kernels, with GQA, left / right padding, packed rows (segment ids) and a length that is not a
  multiple of 128 (padded); and through the whole decoder. A subprocess compiles it for a v5p:2x2x1 topology
  (libtpu) and finds the Mosaic kernel (``tpu_custom_call``) in the HLO.
- ``cudnn``: **the cuDNN kernel itself is untested here (no GPU)**. What runs on CPU is tested: the row compaction
  (valid tokens to the front), the causal + sequence-length + segment-mask arguments, passed with the same values
  through ``jax.nn.dot_product_attention(implementation="xla")``, and the decoder's dispatch to that path.

Only the rows of valid tokens are compared (the cotangent is zero on padding rows): the decoder never reads the
others, and backends may differ there.
"""

import functools
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

from comprl_jax.config import upgrade
from comprl_jax.models import attention as A
from comprl_jax.models import decoder
from comprl_jax.models import layers as L
from comprl_jax.models.config import ModelConfig
from comprl_jax.roles.role_config import ActorConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# float32 parity: the backends sum in another order (blocks, online softmax), so agreement is to rounding.
ATOL = RTOL = 2e-5


def _case(t, h, hkv, pads, segments):
    """q/k/v ``[2, t, ...]``, mask (row 0: ``pads[0]`` left padding, row 1: ``pads[1]`` right padding) and
    optional segment ids (three packed segments per row)."""
    kq, kk, kv, kw = jax.random.split(jax.random.key(t + h + hkv), 4)
    q = jax.random.normal(kq, (2, t, h, 16))
    k = jax.random.normal(kk, (2, t, hkv, 16))
    v = jax.random.normal(kv, (2, t, hkv, 16))
    col = jnp.arange(t)[None]
    mask = jnp.concatenate([col >= pads[0], col < t - pads[1]], axis=0)
    seg = None
    if segments:
        seg = (col >= t // 3).astype(jnp.int32) + (col >= t // 2).astype(jnp.int32) + jnp.array([[0], [5]])
    w = jax.random.normal(kw, (2, t, h * 16)) * mask[:, :, None]  # zero cotangent on padding rows
    return q, k, v, mask, seg, w


def _reference(q, k, v, mask, seg):
    return L.attention(q, k, v, jnp.arange(q.shape[1])[None], mask, causal=True, segment_ids=seg)


def _check(fn, case):
    q, k, v, mask, seg, w = case
    m = np.asarray(mask)[:, :, None]
    loss = lambda f: lambda q, k, v: (f(q, k, v, mask, seg) * w).sum()  # noqa: E731
    ref = _reference(q, k, v, mask, seg)
    out = jax.jit(fn)(q, k, v, mask, seg)
    np.testing.assert_allclose(np.asarray(out) * m, np.asarray(ref) * m, atol=ATOL, rtol=RTOL)
    g_ref = jax.grad(loss(_reference), argnums=(0, 1, 2))(q, k, v)
    g = jax.jit(jax.grad(loss(fn), argnums=(0, 1, 2)))(q, k, v)
    for name, a, b in zip("qkv", g, g_ref, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=ATOL, rtol=RTOL, err_msg=f"d{name}")


CASES = {
    # t, H, Hkv, (left pad of row 0, right pad of row 1), segment ids
    "gqa_left_right_pad": (40, 4, 2, (7, 5), False),
    "gqa_packed_padded": (40, 4, 2, (3, 6), True),
    "mqa_packed_256": (256, 4, 1, (130, 0), True),  # two 128 blocks: the kernel's block skipping and dkv grid
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_splash_matches_xla(name):
    _check(functools.partial(A.splash_attention, interpret=True), _case(*CASES[name]))


@pytest.mark.parametrize("name", sorted(CASES))
def test_cudnn_arguments_match_xla(name):
    """The cudnn path's compaction, causal flag, lengths and segment mask, run by JAX's xla implementation."""
    _check(functools.partial(A.cudnn_attention, implementation="xla"), _case(*CASES[name]))


# A later turn's prefill onto cached context (attention.context_attention): window S, T new columns; per row
# the context length (a prefix of the window) and the valid new columns.
CONTEXT_CASES = {
    # S, T, H, Hkv, context lengths, new lengths
    "gqa_window_not_lanes": (48, 20, 4, 2, (0, 30, 48), (20, 7, 1)),  # S and T padded to 128 for splash
    "mqa_two_query_blocks": (256, 130, 4, 1, (200, 0), (130, 129)),  # queries span two 128 blocks
}


def _context_case(s, t, h, hkv, ctx, new):
    ks = jax.random.split(jax.random.key(s + t), 5)
    b = len(ctx)
    q = jax.random.normal(ks[0], (b, t, h, 16))
    k_ctx, v_ctx = (jax.random.normal(x, (b, s, hkv, 16)) for x in ks[1:3])
    k_new, v_new = (jax.random.normal(x, (b, t, hkv, 16)) for x in ks[3:5])
    ctx_valid = jnp.arange(s)[None] < jnp.asarray(ctx)[:, None]
    new_valid = jnp.arange(t)[None] < jnp.asarray(new)[:, None]
    return q, k_ctx, v_ctx, ctx_valid, k_new, v_new, new_valid


def _context_by_hand(q, k_ctx, v_ctx, ctx_valid, k_new, v_new, new_valid):
    """Per row and valid query, numpy softmax over the valid context keys and the valid new keys <= its own."""
    q, k_ctx, v_ctx, k_new, v_new = (np.asarray(x, np.float64) for x in (q, k_ctx, v_ctx, k_new, v_new))
    b, t, h, dh = q.shape
    g = h // k_ctx.shape[2]
    out = np.zeros((b, t, h, dh))
    for r in range(b):
        keys = np.concatenate([k_ctx[r][np.asarray(ctx_valid[r])], k_new[r]])
        vals = np.concatenate([v_ctx[r][np.asarray(ctx_valid[r])], v_new[r]])
        n_ctx = int(np.asarray(ctx_valid[r]).sum())
        for i in range(int(np.asarray(new_valid[r]).sum())):
            kk, vv = keys[: n_ctx + i + 1], vals[: n_ctx + i + 1]
            for head in range(h):
                sc = kk[:, head // g] @ q[r, i, head] / np.sqrt(dh)
                p = np.exp(sc - sc.max())
                out[r, i, head] = (p / p.sum()) @ vv[:, head // g]
    return out.reshape(b, t, h * dh)


@pytest.mark.parametrize("backend", ["xla", "splash", "cudnn"])
@pytest.mark.parametrize("name", sorted(CONTEXT_CASES))
def test_context_prefill_backends_match_by_hand(name, backend, monkeypatch):
    """Each backend's prefill onto context (splash in the interpreter, cudnn's mask and arguments through JAX's
    xla implementation) equals a numpy softmax over each valid query's visible keys; ragged context and new
    lengths, an empty context and a full one."""
    fn = functools.partial(A.context_attention, backend=backend)
    if backend == "cudnn":
        monkeypatch.setattr(A, "resolve", lambda choice, *a, **k: choice)
        monkeypatch.setattr(A, "cudnn_context", functools.partial(A.cudnn_context, implementation="xla"))
    if backend == "splash":  # the kernel itself: context_attention keeps xla below 128 new tokens
        fn = functools.partial(A.splash_context, interpret=True)
    case = _context_case(*CONTEXT_CASES[name])
    got = jax.jit(fn)(*case)
    want = _context_by_hand(*case)
    m = np.asarray(case[-1])[:, :, None]
    np.testing.assert_allclose(np.asarray(got) * m, want * m, atol=ATOL, rtol=RTOL)
    assert np.isfinite(np.asarray(got)).all()  # padding queries too: no empty softmax row


def test_context_prefill_takes_the_kernel_from_128_new_tokens(monkeypatch):
    """Below one 128-query block a prefill onto context keeps xla (a decode turn's first step); from 128 on it
    runs the kernel."""
    calls = []
    monkeypatch.setattr(
        A, "splash_context", lambda *a, **k: calls.append(a[0].shape[1]) or a[0].reshape(*a[0].shape[:2], -1)
    )
    for t in (16, 127, 128, 300):
        jax.jit(functools.partial(A.context_attention, backend="splash"))(
            *_context_case(64, t, 2, 1, (10, 0), (t, 1))
        )
    assert calls == [128, 300]


@pytest.mark.parametrize("kind", ["dense", "paged"])
def test_decoder_context_prefill_through_splash_equals_xla(kind):
    """A tiny Qwen3 (GQA 4 / 2): a ragged prompt, then a second ragged turn of up to 130 tokens onto it (one row
    adds nothing): splash (interpreter) gives the xla reference's logits on valid columns and the same cache."""
    rng = np.random.default_rng(5)
    B, S, T = 3, 192, 130  # T >= 128: context_attention takes the kernel
    first, second = np.array([40, 3, 17]), np.array([130, 0, 101])
    toks1 = rng.integers(1, 256, (B, 40)).astype(np.int32)
    toks2 = rng.integers(1, 256, (B, T)).astype(np.int32)
    pages = jnp.asarray(rng.permutation(3 * 12).reshape(3, 12), jnp.int32)
    got = {}
    for name in ("xla", "splash"):
        cfg = ModelConfig.tiny("qwen3", attention=name, vocab_size=256)
        gd, params = decoder.init_decoder(cfg, seed=0)
        if kind == "dense":
            cache = decoder.init_cache(cfg, B, S)
        else:
            cache = decoder.init_paged_cache(cfg, B, S, num_pages=36, page_size=16).replace(pages=pages)
        ext = jax.jit(functools.partial(decoder.extend, gd))
        _, cache = ext(params, cache, toks1, jnp.asarray(first))
        logits, cache = ext(params, cache, toks2, jnp.asarray(second))
        got[name] = (np.asarray(logits), cache)
    m = (np.arange(T)[None] < second[:, None])[:, :, None]
    np.testing.assert_allclose(got["splash"][0] * m, got["xla"][0] * m, atol=ATOL, rtol=RTOL)
    np.testing.assert_array_equal(got["splash"][1].lengths, first + second)
    for field in ("k", "v"):
        np.testing.assert_allclose(getattr(got["splash"][1], field), getattr(got["xla"][1], field), atol=ATOL)


def test_compact_order_puts_valid_tokens_first_in_order():
    mask = jnp.array([[0, 0, 1, 1, 1], [1, 0, 1, 0, 1], [1, 1, 1, 0, 0]], bool)
    order, counts = A.compact_order(mask)
    np.testing.assert_array_equal(counts, [3, 3, 3])
    np.testing.assert_array_equal(order[:, :3], [[2, 3, 4], [0, 2, 4], [0, 1, 2]])


def _decoder_loss(params, gd, tokens, positions, mask, seg, w):
    logits = decoder.forward(gd, params, tokens, positions, mask, segment_ids=seg)
    return (logits * w).sum(), logits


@pytest.mark.parametrize("backend", ["splash", "cudnn"])
def test_decoder_forward_and_gradients_match_xla(backend, monkeypatch):
    """A tiny Qwen3 (GQA 4 / 2 heads) with left padding in one row and two packed segments in the other: logits
    and every parameter's gradient equal the ``xla`` reference. ``cudnn`` is forced to its CPU stand-in."""
    if backend == "cudnn":
        monkeypatch.setattr(A, "resolve", lambda choice, *a, **k: "cudnn" if choice == "cudnn" else choice)
        monkeypatch.setattr(A, "cudnn_attention", functools.partial(A.cudnn_attention, implementation="xla"))
    t = 24
    cfg = ModelConfig.tiny("qwen3")
    _, params = decoder.init_decoder(cfg, seed=1)
    tokens = jax.random.randint(jax.random.key(2), (2, t), 0, cfg.vocab_size)
    col = jnp.arange(t)[None]
    mask = jnp.concatenate([col >= 5, col < t], axis=0)  # row 0: 5 left-padding columns
    seg = jnp.concatenate([jnp.zeros((1, t), jnp.int32), (col >= 10).astype(jnp.int32)], axis=0)
    positions = jnp.concatenate([jnp.maximum(col - 5, 0), jnp.where(col >= 10, col - 10, col)], axis=0)
    w = jax.random.normal(jax.random.key(3), (2, t, cfg.vocab_size)) * mask[:, :, None]
    results = {}
    for name in ("xla", backend):
        c = ModelConfig.tiny("qwen3", attention=name)
        gd_c, _ = decoder.abstract_decoder(c)
        loss = functools.partial(
            _decoder_loss, gd=gd_c, tokens=tokens, positions=positions, mask=mask, seg=seg, w=w
        )
        results[name] = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    ((v0, l0), g0), ((v1, l1), g1) = results["xla"], results[backend]
    m = np.asarray(mask)[:, :, None]
    np.testing.assert_allclose(np.asarray(l1) * m, np.asarray(l0) * m, atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(float(v1), float(v0), rtol=RTOL)
    flat0, flat1 = jax.tree.leaves_with_path(g0), jax.tree.leaves(g1)
    assert len(flat0) > 10
    for (path, a), b in zip(flat0, flat1, strict=True):
        # Normwise per leaf: the tied embedding's gradient sums the head's terms over every token (entries up to
        # ~30), so its small entries carry float32 rounding of that size times 1e-6. Against a float64 run of this
        # setup every path is ~4e-5 off there (xla 4.5e-5 / 4.1e-5 before the G * T matmuls, cudnn 4.2e-5), more
        # than a fixed 2e-5; the backends still agree with xla to 2e-5 of each leaf's largest entry.
        scale = max(1.0, float(np.abs(np.asarray(a)).max()))
        np.testing.assert_allclose(
            np.asarray(b), np.asarray(a), atol=ATOL * scale, rtol=RTOL, err_msg=jax.tree_util.keystr(path)
        )


def test_resolve_and_validation():
    assert A.resolve("auto", jnp.float32, 16) == "xla"  # this CPU
    assert A.resolve("auto", jnp.bfloat16, 128, platform="tpu") == "splash"
    assert A.resolve("auto", jnp.bfloat16, 128, platform="gpu") == "cudnn"
    assert (
        A.resolve("auto", jnp.float32, 128, platform="gpu") == "xla"
    )  # cuDNN flash attention: bf16 / f16 only
    assert A.resolve("cudnn", jnp.bfloat16, 128, platform="cpu") == "xla"
    assert A.resolve("cudnn", jnp.float32, 128, platform="gpu") == "xla"
    assert A.resolve("splash", jnp.float32, 16, platform="cpu") == "splash"  # the interpreter
    assert A.resolve("splash", jnp.bfloat16, 128, platform="gpu") == "xla"
    with pytest.raises(ValueError, match="auto.*xla.*cudnn.*splash"):
        ModelConfig.tiny(attention="flash")
    assert "attention" not in ModelConfig.tiny(attention="splash").to_hf_config()  # never in a checkpoint
    with pytest.raises(ValueError, match="attention"):
        ActorConfig(attention="flash")
    old = upgrade.upgrade_saved({"actor": {"model": "tiny"}, "extractor": {"model": "tiny"}})
    assert old["actor"]["attention"] == "auto" and old["extractor"]["attention"] == "auto"


_TPU_SCRIPT = textwrap.dedent(
    """
    import json, os
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    import jax, jax.numpy as jnp
    from jax.experimental import topologies
    from comprl_jax.models import attention, decoder
    from comprl_jax.models.config import ModelConfig
    from comprl_jax.runtime import sharding as shd

    devs = list(topologies.get_topology_desc("v5p:2x2x1", platform="tpu").devices)
    mesh = shd.make_mesh({"data": 1, "fsdp": -1, "tensor": 1}, devs)
    out = {}
    for choice in ("splash", "auto"):
        cfg = ModelConfig.tiny("qwen3", attention=choice, dtype="bfloat16")
        gd, ap = decoder.abstract_decoder(cfg)
        ap = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), ap,
                          shd.state_shardings(ap, mesh))
        rows = shd.named_sharding(mesh, ("batch",))
        tok = jax.ShapeDtypeStruct((4, 200), jnp.int32, sharding=rows)
        msk = jax.ShapeDtypeStruct((4, 200), bool, sharding=rows)

        def loss(p, tok, msk):
            pos = jnp.broadcast_to(jnp.arange(200), tok.shape)
            logits = decoder.forward(gd, p, tok, pos, msk, remat=True, segment_ids=tok % 2)
            return (logits.mean(-1) * msk).sum()

        with jax.set_mesh(mesh):
            picked = attention.resolve(choice, jnp.bfloat16, cfg.head_dim)
            hlo = jax.jit(jax.value_and_grad(loss)).lower(ap, tok, msk).compile().as_text()
        out[choice] = {"picked": picked, "kernels": hlo.count("tpu_custom_call")}
    # The sampler's prefill through the cache: fresh (an empty cache, SamplerService.generate) and onto context
    # (a later turn: attention.context_attention) both attend through the backend.
    cfg = ModelConfig.tiny("qwen3", attention="auto", dtype="bfloat16")
    gd, ap = decoder.abstract_decoder(cfg)
    n = jax.ShapeDtypeStruct((4,), jnp.int32)
    for fresh in (True, False):
        with jax.set_mesh(mesh):
            cache = jax.eval_shape(lambda: decoder.init_cache(cfg, 4, 256))
            fn = lambda p, c, t, n: decoder.extend(gd, p, c, t, n, logits_at=n - 1, fresh=fresh)
            hlo = jax.jit(fn).lower(ap, cache, tok, n).compile().as_text()
        out[f"prefill_fresh_{fresh}"] = hlo.count("tpu_custom_call")
    print("RESULT " + json.dumps(out))
    """
)


@pytest.mark.slow
def test_splash_compiles_for_v5p_and_auto_picks_it():
    """Forward + gradient of a tiny decoder compiled for v5p:2x2x1 (4 chips, rows split over fsdp=4 in
    shard_map): the Mosaic kernels are in the HLO, and ``auto`` picks splash for that mesh on this CPU host. A
    fresh prefill (``extend(fresh=True)``) and a prefill onto context (a later turn) run splash too."""
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
    assert out["splash"]["picked"] == "splash" and out["auto"]["picked"] == "splash"
    # forward, and the backward's recomputed forward + dq + dkv kernels
    assert out["splash"]["kernels"] >= 3 and out["auto"]["kernels"] == out["splash"]["kernels"]
    assert out["prefill_fresh_True"] >= 1 and out["prefill_fresh_False"] >= 1
