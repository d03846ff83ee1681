"""Memory of the sampler's prefill: logits only where a token is drawn (``extend(..., logits_at=)``), so the
compiled decode's buffers do not grow with input length x vocabulary."""

import jax
import jax.numpy as jnp
import numpy as np

from comprl_jax.models import ModelConfig, extend, init_cache, init_decoder
from comprl_jax.models import decoder as D
from comprl_jax.sampling import SamplerService
from comprl_jax.sampling.decode import make_decode_fn
from comprl_jax.sampling.filters import SamplingParams


def test_extend_logits_at_equals_full_logits():
    cfg = ModelConfig.tiny("qwen3")
    graphdef, params = init_decoder(cfg, seed=0)
    rng = np.random.default_rng(0)
    toks = rng.integers(0, cfg.vocab_size, (3, 9)).astype(np.int32)
    num_new = np.array([9, 4, 0], np.int32)  # a full row, a ragged row, an idle row
    ext = jax.jit(extend, static_argnums=0)
    full, c_full = ext(graphdef, params, init_cache(cfg, 3, 16), toks, num_new)
    at = np.array([8, 3, 0], np.int32)
    part, c_part = ext(graphdef, params, init_cache(cfg, 3, 16), toks, num_new, jnp.asarray(at))
    assert part.shape == (3, cfg.vocab_size)
    np.testing.assert_allclose(np.asarray(part), np.asarray(full)[np.arange(3), at], atol=1e-6)
    np.testing.assert_array_equal(np.asarray(c_part.k), np.asarray(c_full.k))
    assert np.asarray(c_part.lengths).tolist() == [9, 4, 0]


def _decode_temp_bytes(rows: int, width: int, vocab: int, new: int = 16, groups: int = 1) -> int:
    """XLA's temp buffer bytes of the jitted turn (prefill of ``rows x width`` + a ``new``-token decode) on a
    tiny decoder with ``vocab`` entries. Compiled from abstract shapes: nothing is allocated."""
    cfg = ModelConfig.tiny("qwen3", vocab_size=vocab)
    graphdef, params = D.abstract_decoder(cfg)
    cache = jax.eval_shape(lambda: init_cache(cfg, rows, width + new))
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    fn = make_decode_fn(extend)
    lowered = fn.lower(
        graphdef, params, cache, i32(rows, width), i32(rows), i32(rows), jax.random.key(0), None, None,
        sp=SamplingParams(max_new_tokens=new), stop_ids=(1,), pad_id=0, prefill_groups=groups,
    )  # fmt: skip
    return lowered.compile().memory_analysis().temp_size_in_bytes


def test_prefill_memory_does_not_grow_with_tokens_times_vocab():
    """32 rows x 2,048 tokens: doubling the vocabulary must not add a [B, T, dV] float32 buffer (4 GiB here at
    dV = 16,384; the decode computed full prefill logits before, and measured +4,100 MiB and 8,216 MiB in all).
    The V-dependent part left is the head's weights use and [B, V] per step: a few MiB."""
    b, t, v = 32, 2048, 16384
    small, big = _decode_temp_bytes(b, t, v), _decode_temp_bytes(b, t, 2 * v)
    logits_bytes = b * t * v * 4  # one [B, T, dV] float32 buffer
    assert big - small < logits_bytes / 64, (small, big)
    assert big < logits_bytes, (
        big
    )  # the whole turn needs less than full logits alone would (~1.9 GiB: attention)


def test_prefill_row_groups_bound_attention_memory():
    """32 x 2,048 tokens in 4 strided row groups: XLA temp 1,887 -> 480 MiB on the tiny model (SmolLM2's shape:
    4,375 -> 1,843 MiB): the prefill's attention buffers follow the group, not the batch."""
    one, four = _decode_temp_bytes(32, 2048, 512), _decode_temp_bytes(32, 2048, 512, groups=4)
    assert four < one / 2, (one, four)


def test_prefill_row_groups_same_results():
    """Grouped prefill (8 groups of 1 row, and 2 of 4) gives the ungrouped turn's tokens and logprobs, on a fresh
    prompt and on a second turn of a live conversation."""
    cfg = ModelConfig.tiny("qwen3")
    graphdef, params = init_decoder(cfg, seed=0)
    vocab = [b"", b""] + [bytes([i]) for i in range(2, cfg.vocab_size)]
    rng = np.random.default_rng(3)
    first = [rng.integers(2, cfg.vocab_size, int(n)).tolist() for n in rng.integers(1, 40, 8)]
    second = [rng.integers(2, cfg.vocab_size, int(n)).tolist() for n in rng.integers(1, 20, 8)]
    sp = SamplingParams(max_new_tokens=8, temperature=1.0)
    out = {}
    for budget in (0, 64, 256):  # 0: one group; 64: 8 x 64 tokens -> 8 groups; 256: 2 groups
        svc = SamplerService(
            graphdef, params, cfg, vocab=vocab, stop_token_ids=(1,), pad_id=0, prefill_tokens=budget
        )
        conv = svc.conversation(batch=8, max_len=128)
        r1 = conv.turn(first, jax.random.key(0), sp)
        r2 = conv.turn(second, jax.random.key(1), sp)
        out[budget] = (r1, r2)
    assert SamplerService.prefill_groups(svc, 8, 64) == 2 and svc.prefill_groups(8, 16) == 1
    for budget in (64, 256):
        for a, b in zip(out[0], out[budget], strict=True):
            np.testing.assert_array_equal(a.tokens, b.tokens)
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_prefill_groups_by_hand():
    """Halve while a group's share of one batch shard holds more than the budget, keeping each group a multiple
    of the batch shards: the rule the service and launch/compile_check.py share. 256 rows x 2,048 tokens over 32
    shards at 16,384 tokens: one group (8 rows per shard fit); 512 rows: 2 groups."""
    from comprl_jax.sampling import PREFILL_TOKENS, prefill_groups

    assert (
        prefill_groups(8, 64, 256) == 2 and prefill_groups(8, 64, 64) == 8 and prefill_groups(8, 64, 0) == 1
    )
    assert prefill_groups(8, 64, 64, multiple=4) == 2  # 8 rows over 4 shards: 2 per shard, then 1 (64 tokens)
    assert prefill_groups(8, 64, 128, multiple=4) == 1  # 2 rows x 64 per shard fit 128
    # the budget is per batch shard: 8 rows x 2k per chip of a 32-shard mesh fit 16,384 tokens; 16 do not
    assert (
        prefill_groups(256, 2048, PREFILL_TOKENS, 32) == 1
        and prefill_groups(512, 2048, PREFILL_TOKENS, 32) == 2
    )
    assert prefill_groups(7, 64, 64) == 1  # an odd batch does not split
    assert prefill_groups(512, 2048, PREFILL_TOKENS, 32, context_kernel=True) == 1  # onto context, a kernel


def test_prefill_onto_context_through_a_kernel_takes_one_group():
    """The groups bound the ``xla`` attention's scores; a prefill onto context whose attention is a kernel with no
    score matrix (splash from 128 new tokens, cuDNN) takes one group, since each group would copy its rows' share
    of the cache for the kernel (v5p-64 7B actor prefill at tensor 2: temp 12.8 GiB in 2 groups, 4.3 in one). A
    fresh prefill reads no cache and keeps the budget (its groups bound the activations)."""
    from comprl_jax.models import attention

    bf16 = jnp.bfloat16
    assert attention.context_kernel("auto", bf16, 128, 128, platform="tpu")  # splash from 128 new tokens
    assert not attention.context_kernel("auto", bf16, 128, 64, platform="tpu")  # below: xla
    assert attention.context_kernel("auto", bf16, 128, 16, platform="gpu")  # cuDNN at any length
    assert not attention.context_kernel("auto", bf16, 128, 4096, platform="cpu")  # xla
    assert not attention.context_kernel("auto", jnp.float32, 128, 4096, platform="gpu")  # cuDNN wants 16-bit
    cfg = ModelConfig.tiny("qwen3", attention="splash")  # splash runs on CPU in interpret mode
    graphdef, params = init_decoder(cfg, seed=0)
    svc = SamplerService(graphdef, params, cfg, stop_token_ids=(), pad_id=0, prefill_tokens=64)
    assert svc.prefill_groups(8, 128) == 1  # onto context, through the kernel
    assert svc.prefill_groups(8, 128, fresh=True) == 8  # fresh: 8 x 128 tokens at 64 a group -> one row each
    assert svc.prefill_groups(8, 64) == 8  # 64 new tokens: xla, the budget
    xla = SamplerService(*init_decoder(ModelConfig.tiny("qwen3"), seed=0), ModelConfig.tiny("qwen3"),
                         stop_token_ids=(), pad_id=0, prefill_tokens=64)  # fmt: skip
    assert xla.prefill_groups(8, 128) == 8
