"""The sampler's own weight copy (issue 27 item 3, ``comprl_jax.sampling.layout``): chosen by memory, laid out
for decoding (no weight all-gather inside the decode loop, read from the compiled HLO on 8 fake CPU devices),
the same tokens as one device, and refreshed from the training state after each update."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from comprl_jax.models import ModelConfig, decoder
from comprl_jax.runtime import sharding as shd
from comprl_jax.sampling import SamplerService, SamplingParams
from comprl_jax.sampling.layout import choose_tensor, copy_bytes, decode_mesh, rollout_layout

GB = 10**9


def test_tensor_split_by_memory_by_hand():
    """Qwen2.5-7B in bfloat16 is 15.2 GB (7.62e9 parameters x 2 bytes); a quarter of a v5p chip (95.74 GB) is
    23.9 GB: replicated. On a 16 GB v5e chip (4 GB budget) it needs 4 devices (15.2 / 4 = 3.8); Qwen3-30B-A3B
    (61.1 GB) on v5p needs 4 (30.5 > 23.9 at 2). Unknown memory (CPU): replicated."""
    assert choose_tensor(32, 4, int(15.23 * GB), int(95.74 * GB)) == 1
    assert choose_tensor(256, 4, int(15.23 * GB), 16 * GB) == 4
    assert choose_tensor(32, 4, int(61.06 * GB), int(95.74 * GB)) == 4
    assert choose_tensor(8, 2, 10**12, None) == 1
    with pytest.raises(ValueError, match="rollout_tensor"):
        choose_tensor(8, 2, int(61.06 * GB), int(95.74 * GB) // 8)  # would need t = 8, but only 2 KV heads


def test_copy_bytes_counts_the_compute_dtype():
    cfg = ModelConfig.tiny("qwen3")
    _, params = decoder.abstract_decoder(cfg)
    n = decoder.count_params(params)
    assert copy_bytes(params, "bfloat16") == 2 * n and copy_bytes(params, "float32") == 4 * n


CFG = ModelConfig.tiny(
    "qwen3", vocab_size=512, hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2
)
SP = SamplingParams(max_new_tokens=8, greedy=True)


def _sampler(params, mesh, cfg=CFG):
    return SamplerService(*params, cfg, mesh=mesh, stop_token_ids=(), pad_id=0)


def _gathers(text):
    """Shapes of every all-gather in the compiled module."""
    return re.findall(r"= (\S+\[[0-9,]*\])\S* all-gather(?:-start)?\(", text)


@pytest.fixture(scope="module")
def trained():
    """A model created FSDP-sharded over 8 fake devices, as a role's training state holds it."""
    mesh = shd.make_mesh({"fsdp": 8})
    graphdef, params = decoder.init_decoder(CFG, seed=0, mesh=mesh)
    return mesh, graphdef, params


@pytest.mark.parametrize("tensor", [1, 2])
def test_no_weight_gather_in_decoding(trained, tensor):
    """Prefill + decode loop on the decode layout: no all-gather at all (t = 1: a replica per device, no
    collective; t = 2: Megatron-style all-reduces of activations only). On the training layout (what the sampler
    used before issue 27) every layer's weights are all-gathered inside the loop."""
    mesh, graphdef, params = trained
    layout = rollout_layout(params, CFG, mesh, tensor)
    assert dict(layout.mesh.shape) == {"data": 8 // tensor, "fsdp": 1, "tensor": tensor}
    svc = _sampler((graphdef, layout.refresh(params)), layout.mesh)
    cache = svc.new_cache(8, 64)
    text = svc.lower(cache, 16, jax.random.key(0), SP).compile().as_text()
    # no weight (nor a hidden / MLP / vocabulary-wide activation) is gathered; with t = 2 the sampler's greedy
    # choice gathers each row's best (value, id) per vocabulary shard: [rows / data, t]
    widths = {CFG.hidden_size, CFG.intermediate_size, CFG.vocab_size, CFG.num_heads * CFG.head_dim}
    weight_like = [
        g for g in _gathers(text) if widths & set(map(int, re.findall(r"[0-9]+", g.split("[")[1])))
    ]
    assert not weight_like, weight_like
    if tensor == 1:  # a full replica per device: no collective moves anything bigger than a scalar per row
        assert not _gathers(text), _gathers(text)
        assert not re.search(r"all-reduce\(\S*\[[0-9]+,[0-9]+", text)

    old = _sampler((graphdef, params), mesh)  # the FSDP training layout
    old_text = old.lower(old.new_cache(8, 64), 16, jax.random.key(0), SP).compile().as_text()
    d, f = CFG.hidden_size, CFG.intermediate_size
    assert any(f"[{d},{f}]" in g or f"[{f},{d}]" in g for g in _gathers(old_text)), _gathers(old_text)


def test_decode_layout_samples_what_one_device_samples(trained):
    mesh, graphdef, params = trained
    prompts = [[1 + (7 * b + i) % 500 for i in range(5 + b)] for b in range(8)]
    one = _sampler((graphdef, jax.device_put(params, jax.devices()[0])), None)
    want = one.generate(prompts, jax.random.key(0), SP)
    for tensor in (1, 2):
        layout = rollout_layout(params, CFG, mesh, tensor)
        got = _sampler((graphdef, layout.refresh(params)), layout.mesh).generate(
            prompts, jax.random.key(0), SP
        )
        np.testing.assert_array_equal(got.tokens, want.tokens)
        np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)


def test_refresh_casts_and_follows_the_training_state(trained):
    """bfloat16 compute: the copy is the master weights rounded to bfloat16 on the decode mesh; a role's update
    hands the sampler a fresh copy and times it (``rollout_refresh_s``)."""
    mesh, graphdef, params = trained
    cfg16 = ModelConfig(**{**CFG.__dict__, "dtype": "bfloat16"})
    layout = rollout_layout(params, cfg16, mesh, 2)
    copy = layout.refresh(params)
    leaves, want = jax.tree.leaves(copy), jax.tree.leaves(params)
    assert all(x.dtype == jnp.bfloat16 for x in leaves)
    for got, w in zip(leaves, want, strict=True):
        assert got.sharding.mesh.shape == layout.mesh.shape
        np.testing.assert_array_equal(np.asarray(got), np.asarray(w.astype(jnp.bfloat16)))
    # no mesh, same dtype: the sampler shares the training arrays (no copy on the CPU scales)
    single = rollout_layout(params, CFG, None)
    assert single.same and single.refresh(params) is params
    assert decode_mesh(mesh, 4).devices.reshape(-1).tolist() == mesh.devices.reshape(-1).tolist()
