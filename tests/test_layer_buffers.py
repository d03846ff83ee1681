"""The sampler's per-layer weight buffers (``SamplerService(layer_buffers=)``, ``decoder.unstack_layers``).

A sampler on CPU whose one layer outgrows the last-level cache holds its own copy of the weights with one buffer per
layer, read by a Python loop over the layers instead of a ``scan`` (which copies every layer's weights out of the
stacks on every decode step). These tests hold the two layouts to the same tokens and log-probabilities, the
loop's write to no copy of the cache, and ``auto`` to its rule.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from comprl_jax import config as config_lib
from comprl_jax.config.run import RunConfig
from comprl_jax.models import ModelConfig, decoder, init_decoder
from comprl_jax.sampling import SamplerService, SamplingParams
from comprl_jax.sampling import service as service_lib

DENSE = ModelConfig.tiny("qwen3", num_layers=3)
# layers 0 and 2 dense, 1 and 3 MoE: layer(i) must find each MLP at its place in its kind's stack
MIXED = ModelConfig.tiny(
    "qwen3_moe", num_layers=4, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=2
)


def _services(cfg, kind, seed=0):
    graphdef, params = init_decoder(cfg, seed=seed)
    return {
        lb: SamplerService(
            graphdef,
            params,
            cfg,
            stop_token_ids=(3,),
            pad_id=0,
            kv_cache=kind,
            layer_buffers=lb,
            page_size=16,
        )
        for lb in ("stacked", "per_layer")
    }


def test_unstack_round_trip_and_forward_needs_the_stacks():
    graphdef, params = init_decoder(MIXED, seed=1)
    per = decoder.unstack_layers(params)
    q = per["layers"]["q_proj"].get_value()
    assert (
        isinstance(q, tuple)
        and len(q) == 4
        and q[0].shape == params["layers"]["q_proj"].get_value().shape[1:]
    )
    assert len(per["layers"]["gate_proj"].get_value()) == 2  # the dense MLP stack: layers 0 and 2
    assert len(per["layers"]["router"].get_value()) == 2
    back = decoder.stack_layers(per)
    assert jax.tree.structure(back) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(a, b)
    assert decoder.bytes_per_layer(per) == decoder.bytes_per_layer(params) > 0
    toks = jnp.array([[5, 6, 7]], jnp.int32)
    with pytest.raises(ValueError, match="stack_layers"):
        decoder.forward(graphdef, per, toks, jnp.arange(3)[None], toks > 0)


@pytest.mark.parametrize("cfg", [DENSE, MIXED], ids=["dense_model", "moe_model"])
@pytest.mark.parametrize("kind", ["dense", "paged"])
def test_per_layer_sampler_samples_the_stacked_tokens(cfg, kind):
    svcs = _services(cfg, kind)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(4, cfg.vocab_size, n).tolist() for n in (9, 1, 23)]
    turns = [[rng.integers(4, cfg.vocab_size, n).tolist() for n in (5, 17, 2)] for _ in range(2)]
    out = {}
    for lb, svc in svcs.items():
        gen = [svc.generate(prompts, jax.random.key(k), SamplingParams(max_new_tokens=12, temperature=1.0))
               for k in range(2)]  # fmt: skip
        greedy = svc.generate(prompts, jax.random.key(0), SamplingParams(max_new_tokens=12, greedy=True))
        conv = svc.conversation(3, 96)
        talk = [conv.turn(t, jax.random.key(5 + i), SamplingParams(max_new_tokens=8, temperature=1.0))
                for i, t in enumerate([prompts, *turns])]  # fmt: skip
        out[lb] = [*gen, greedy, *talk]
    assert svcs["per_layer"].owns_params and not svcs["stacked"].owns_params
    for a, b in zip(out["stacked"], out["per_layer"], strict=True):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.lengths, b.lengths)
        # The same ops, but XLA fuses the unrolled loop's elementwise work differently: float32 rounding apart.
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=2e-6, rtol=0)


def test_update_params_makes_a_new_per_layer_copy():
    svcs = _services(DENSE, "dense")
    _, other = init_decoder(DENSE, seed=7)
    prompts = [[5, 6, 7, 8], [9, 10]]
    sp = SamplingParams(max_new_tokens=10, greedy=True)
    before = svcs["per_layer"].generate(prompts, jax.random.key(0), sp)
    for svc in svcs.values():
        svc.update_params(other)
    a, b = (svc.generate(prompts, jax.random.key(0), sp) for svc in svcs.values())
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=2e-6, rtol=0)
    assert np.abs(b.logprobs - before.logprobs).max() > 1e-3
    assert isinstance(svcs["per_layer"].params["layers"]["q_proj"].get_value(), tuple)


def _cache_copies(hlo: str, cache_shapes) -> list[str]:
    pats = [re.escape(f"f32[{','.join(map(str, s))}]") for s in cache_shapes]
    return [line.strip()[:160] for line in hlo.splitlines()
            if re.search(rf"= ({'|'.join(pats)})\S* copy\(", line)]  # fmt: skip


@pytest.mark.parametrize("layer_buffers", ["stacked", "per_layer"])
def test_decode_loop_copies_no_cache(layer_buffers):
    """The layer loop's cache write is tied to the last layer's read: without that tie the compiled decode step
    copied the whole K and V caches twice per step (measured: tiny Tunix model 2.7 ms a step with the copies)."""
    graphdef, params = init_decoder(DENSE, seed=0)
    svc = SamplerService(graphdef, params, DENSE, pad_id=0, kv_cache="dense", layer_buffers=layer_buffers)
    cache = svc.new_cache(8, 64)
    lowered = svc.lower(
        cache, 16, jax.random.key(0), SamplingParams(max_new_tokens=8, greedy=True), fresh=True
    )
    hlo = lowered.compile().as_text()
    assert "while" in hlo
    assert _cache_copies(hlo, [cache.k.shape, cache.v.shape]) == []


def test_auto_picks_per_layer_where_a_layer_outgrows_the_cache(monkeypatch):
    graphdef, params = init_decoder(DENSE, seed=0)
    layer = decoder.bytes_per_layer(params)
    assert service_lib.last_level_cache_bytes() > 0
    monkeypatch.setattr(service_lib, "last_level_cache_bytes", lambda: layer - 1)
    assert SamplerService(graphdef, params, DENSE).layer_buffers == "per_layer"
    assert SamplerService(graphdef, params, DENSE, extend_fn=decoder.extend).layer_buffers == "stacked"
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    assert service_lib.auto_layer_buffers(abstract, True) == "stacked"  # an AOT compile: no host arrays
    monkeypatch.setattr(service_lib, "last_level_cache_bytes", lambda: layer)
    assert SamplerService(graphdef, params, DENSE).layer_buffers == "stacked"
    with pytest.raises(ValueError, match="layer_buffers='per_layer' needs the default model layer"):
        SamplerService(graphdef, params, DENSE, extend_fn=decoder.extend, layer_buffers="per_layer")
    with pytest.raises(ValueError, match="layer_buffers='rows'"):
        SamplerService(graphdef, params, DENSE, layer_buffers="rows")


def test_deferred_refresh_with_a_per_layer_sampler(tmp_path, monkeypatch):
    """The sampler's own per-layer copy stands in for the copy a stacked sampler on the training state needs
    before an update donates that state: during a deferred refresh it answers with the old weights."""
    from comprl_jax.models.zoo import load_model, tiny_tokenizer
    from comprl_jax.rl import ActorLossConfig
    from comprl_jax.roles import batching
    from comprl_jax.roles import role as roles

    monkeypatch.setattr(service_lib, "last_level_cache_bytes", lambda: 0)
    c = config_lib.build("tiny", "t")
    tok = tiny_tokenizer(["Observation: go north east south west"] * 10, str(tmp_path))
    section = dataclasses.replace(RunConfig.of(c).actor, lr=3e-2, micro_batch=1)
    role = roles.build_role(load_model("tiny", role="actor", tokenizer=tok, seed=3), "actor", section,
                            ActorLossConfig(), 2)  # fmt: skip
    assert role.layout.same and role.sampler.owns_params
    prompts = [tok.encode(f"Observation: go {d}") for d in ("north", "south")]
    sp = SamplingParams(max_new_tokens=8, greedy=True)
    before = role.sampler.generate(prompts, jax.random.key(0), sp)
    seqs = [p + before.tokens[b, : before.lengths[b]].tolist() for b, p in enumerate(prompts)]
    masks = [[0] * len(p) + [1] * int(before.lengths[b]) for b, p in enumerate(prompts)]
    lps = [[0.0] * len(p) + before.logprobs[b, : before.lengths[b]].tolist() for b, p in enumerate(prompts)]
    batch = batching.pack(seqs, masks, tok.pad_id, logprobs=lps)
    batch.pop("row_valid")
    batch["behaviour_mask"] = batch["loss_mask"]
    batch["use_behaviour"] = np.ones(2, bool)  # every update: pi_old = the sampling weights
    batch["advantages"] = np.array([1.0, -1.0], np.float32)
    batch["subgroup"] = np.zeros(2, np.int32)
    for _ in range(2):
        roles.dispatch_update(role, batch, refresh=False)
    during = role.sampler.generate(prompts, jax.random.key(0), sp)
    np.testing.assert_array_equal(during.logprobs, before.logprobs)
    assert role.apply_refresh()
    after = role.sampler.generate(prompts, jax.random.key(0), sp)
    assert np.abs(after.logprobs - before.logprobs).max() > 1e-3
    assert isinstance(role.sampler.params["layers"]["q_proj"].get_value(), tuple)


def test_per_layer_on_a_decode_mesh_keeps_the_tensor_split():
    """On the sampler's decode mesh (8 fake devices: data 4 x tensor 2), each layer's buffer keeps its stack's
    tensor split less the layer axis, and both layouts sample the same tokens."""
    from comprl_jax.runtime import sharding as shd
    from comprl_jax.sampling.layout import rollout_layout

    mesh = shd.make_mesh({"fsdp": 8})
    graphdef, params = init_decoder(DENSE, seed=0, mesh=mesh)
    layout = rollout_layout(params, DENSE, mesh, 2)
    copy = layout.refresh(params)
    svcs = [SamplerService(graphdef, copy, DENSE, pad_id=0, mesh=layout.mesh, layer_buffers=lb)
            for lb in ("stacked", "per_layer")]  # fmt: skip
    stacked = svcs[0].params["layers"]["q_proj"].get_value().sharding
    per = svcs[1].params["layers"]["q_proj"].get_value()
    assert len(per) == 3 and all(x.sharding.mesh.shape == stacked.mesh.shape for x in per)
    assert all(tuple(x.sharding.spec) == tuple(stacked.spec)[1:] for x in per)
    assert "tensor" in str(stacked.spec)
    prompts = [[5, 6, 7], [8, 9], [10], [11, 12, 13, 14]]
    sp = SamplingParams(max_new_tokens=8, temperature=1.0)
    a, b = (s.generate(prompts, jax.random.key(2), sp) for s in svcs)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=2e-6, rtol=0)
