"""Qwen3-MoE (issue 18): the MoE layer against transformers' block, capacity slots and the load-balancing loss by
hand, the decoder against ``Qwen3MoeForCausalLM`` (logits, routing decisions, aux loss, greedy generation through
our sampler, safetensors in and out), and the expert-parallel forward on 8 fake devices."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from comprl_jax.models import ModelConfig, moe
from comprl_jax.models import decoder as D
from comprl_jax.runtime import sharding

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _hf_block_params(blk, f):
    """Our layer dict from a transformers ``Qwen3MoeSparseMoeBlock`` (fused gate_up [E, 2F, D], down [E, D, F])."""
    gu = blk.experts.gate_up_proj.detach().numpy()
    return {
        "router": blk.gate.weight.detach().numpy().T,
        "expert_gate": gu[:, :f].transpose(0, 2, 1),
        "expert_up": gu[:, f:].transpose(0, 2, 1),
        "expert_down": blk.experts.down_proj.detach().numpy().transpose(0, 2, 1),
    }


@pytest.mark.parametrize("experts,k,norm", [(4, 1, False), (8, 2, True), (16, 4, False), (8, 8, True)])
def test_layer_matches_transformers_block(experts, k, norm):
    from transformers.models.qwen3_moe import modeling_qwen3_moe as hf_moe

    d, f = 32, 16
    hc = transformers.Qwen3MoeConfig(
        hidden_size=d,
        num_experts=experts,
        num_experts_per_tok=k,
        moe_intermediate_size=f,
        norm_topk_prob=norm,
    )
    hc._experts_implementation = "eager"  # the per-expert loop (the block is used outside a model)
    torch.manual_seed(0)
    blk = hf_moe.Qwen3MoeSparseMoeBlock(hc)
    with torch.no_grad():
        for p in blk.parameters():
            p.normal_(0, 0.3)
    x = np.random.default_rng(0).normal(size=(3, 7, d)).astype(np.float32)
    with torch.no_grad():
        want = blk(torch.tensor(x)).numpy()
    params = _hf_block_params(blk, f)
    cfg = ModelConfig.tiny(
        "qwen3_moe", hidden_size=d, num_experts=experts, num_experts_per_tok=k, moe_intermediate_size=f,
        norm_topk_prob=norm,
    )  # fmt: skip
    layer = jax.jit(moe.moe_mlp, static_argnums=0)
    valid = np.ones((3, 7), bool)
    y, stats = layer(cfg, params, jnp.asarray(x), valid)
    np.testing.assert_allclose(np.asarray(y), want, atol=1e-5)
    assert float(stats["dropped"]) == 0 and float(stats["expert_counts"].sum()) == 3 * 7 * k
    # The capacity dispatch with capacity_factor E/k has C = T slots per expert and row: nothing is dropped.
    roomy = dataclasses.replace(cfg, moe_dispatch="capacity", capacity_factor=experts / k)
    assert moe.capacity(roomy, 7) == 7
    y2, stats2 = layer(roomy, params, jnp.asarray(x), valid)
    np.testing.assert_allclose(np.asarray(y2), want, atol=1e-5)
    assert float(stats2["dropped"]) == 0


def test_capacity_slots_by_hand():
    # T=4 tokens, k=2, E=3 experts, C=2 slots each. First choices claim slots before second choices.
    ids = jnp.array([[0, 1], [0, 2], [0, 1], [1, 0]], jnp.int32)
    # expert 0: t0, t1 (first choices) fill it; t2's first choice and t3's second are dropped (slot 6 = E*C).
    # expert 1: t3 (first choice) slot 2, then t0's second choice slot 3; t2's second choice is dropped.
    # expert 2: t1's second choice, slot 4.
    slots = moe._slots(ids, jnp.ones(4, bool), 3, 2)
    np.testing.assert_array_equal(np.asarray(slots), [[0, 3], [1, 4], [6, 6], [2, 6]])
    # Token 0 is padding: it takes no slot, so t2's first choice now fits in expert 0.
    slots = moe._slots(ids, jnp.array([False, True, True, True]), 3, 2)
    np.testing.assert_array_equal(np.asarray(slots), [[6, 6], [0, 4], [1, 3], [2, 6]])


def test_capacity_output_drops_exactly_the_overflow():
    """Capacity 1 per expert: the layer output equals the reference sum over the kept assignments only."""
    cfg = ModelConfig.tiny("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_dispatch="capacity")
    cfg = dataclasses.replace(cfg, capacity_factor=0.5)  # C = ceil(0.5 * 4 * 2 / 4) = 1
    assert moe.capacity(cfg, 4) == 1
    rng = np.random.default_rng(1)
    shapes = moe.param_shapes(cfg)
    p = {n: rng.normal(0, 0.3, s).astype(np.float32) for n, s in shapes.items()}
    x = rng.normal(size=(2, 4, cfg.hidden_size)).astype(np.float32)
    valid = np.array([[1, 1, 1, 1], [1, 1, 0, 1]], bool)
    y, stats = jax.jit(moe.moe_mlp, static_argnums=0)(cfg, p, jnp.asarray(x), valid)
    _, w, ids = moe.route(cfg, p["router"], jnp.asarray(x))
    w, ids = np.asarray(w), np.asarray(ids)
    want = np.zeros_like(x)
    dropped = 0
    for b in range(2):
        taken = set()
        order = [(c, t) for c in range(2) for t in range(4)]  # choice rank first, then token order
        keep = {}
        for c, t in order:
            e = ids[b, t, c]
            keep[(t, c)] = bool(valid[b, t]) and e not in taken
            if keep[(t, c)]:
                taken.add(e)
            elif valid[b, t]:
                dropped += 1
        for t in range(4):
            for c in range(2):
                if keep[(t, c)]:
                    e = ids[b, t, c]
                    h = x[b, t] @ p["expert_gate"][e]
                    h = h / (1 + np.exp(-h)) * (x[b, t] @ p["expert_up"][e])
                    want[b, t] += w[b, t, c] * (h @ p["expert_down"][e])
    for b, t in np.argwhere(valid):
        np.testing.assert_allclose(np.asarray(y)[b, t], want[b, t], atol=1e-5)
    assert float(stats["dropped"]) == dropped > 0
    assert float(stats["tokens"]) == 7


def test_load_balancing_loss_by_hand():
    # One layer, E=2, top-1, three tokens with router probabilities (.75, .25), (.4, .6), (.9, .1):
    # choices 0, 1, 0 -> f = (2/3, 1/3); mean probs P = (2.05/3, .95/3); loss = 2 * (2/3 * 2.05/3 + 1/3 * .95/3).
    stats = {
        "expert_counts": jnp.array([[2.0, 1.0]]),
        "router_prob_sum": jnp.array([[2.05, 0.95]]),
        "tokens": jnp.array([3.0]),
    }
    want = 2 * (2 / 3 * 2.05 / 3 + 1 / 3 * 0.95 / 3)
    assert float(moe.load_balancing_loss(stats, 2)) == pytest.approx(want, rel=1e-6)
    # Two layers pool their counts: perfectly balanced top-1 routing gives exactly 1.
    uniform = {
        "expert_counts": jnp.array([[2.0, 2.0], [2.0, 2.0]]),
        "router_prob_sum": jnp.array([[2.0, 2.0], [2.0, 2.0]]),
        "tokens": jnp.array([4.0, 4.0]),
    }
    assert float(moe.load_balancing_loss(uniform, 2)) == pytest.approx(1.0)


def test_expert_rule_and_expert_parallel_spec():
    mesh = sharding.make_mesh({"data": 2, "fsdp": 4})
    # expert weights [L, E, D, F]: experts over fsdp; embed would reuse fsdp, so it stays whole.
    assert sharding.logical_to_spec(("layers", "expert", "embed", "mlp"), mesh=mesh) == P(None, "fsdp")
    # A dispatched buffer [B, E, C, D]: rows over the batch axes left (data), experts over fsdp.
    assert sharding.expert_parallel_spec(mesh) == P("data", "fsdp")
    assert sharding.expert_parallel_spec(sharding.make_mesh({"fsdp": 4, "tensor": 2})) == P(None, "fsdp")
    assert sharding.expert_parallel_spec(sharding.make_mesh({"data": 8})) == P("data", None)


# --- the decoder against Qwen3MoeForCausalLM ---------------------------------------------------------------

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6, moe_intermediate_size=32,
)  # fmt: skip
# Greedy generation through the sampler (a compile of the decode loop per config) for the mixed dense/MoE cases.
GREEDY = ("e8-top2-norm-tied-mlp_only0", "e16-top4-untied-step2")
CASES = {  # expert count, top-k, renormalisation, tied embeddings, dense layers (mlp_only_layers / sparse step)
    "e4-top1-untied": dict(
        num_experts=4, num_experts_per_tok=1, norm_topk_prob=False, tie_word_embeddings=False
    ),
    "e8-top2-norm-tied-mlp_only0": dict(
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        tie_word_embeddings=True,
        mlp_only_layers=[0],
    ),
    "e16-top4-untied-step2": dict(
        num_experts=16,
        num_experts_per_tok=4,
        norm_topk_prob=False,
        tie_word_embeddings=False,
        decoder_sparse_step=2,
    ),
    "e8-top8-norm-tied": dict(
        num_experts=8, num_experts_per_tok=8, norm_topk_prob=True, tie_word_embeddings=True
    ),
}
LENGTHS = [9, 5, 12]  # ragged rows, right-padded to 12
NEW = 16


def _hf_moe(extra: dict, folder):
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**TINY, **extra)).eval()
    with torch.no_grad():  # larger-than-init weights: sharp logits and routing, clear greedy margins
        for p in hf.parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.15)
            else:
                p.uniform_(0.8, 1.2)  # norm weights: not all ones, so a missing norm would show
    hf.save_pretrained(folder)
    return hf


def _batch(vocab):
    rng = np.random.default_rng(0)
    b, t = len(LENGTHS), max(LENGTHS)
    lengths = np.array(LENGTHS, np.int32)
    mask = np.arange(t)[None] < lengths[:, None]
    tokens = np.where(mask, rng.integers(0, vocab, (b, t)), 0).astype(np.int32)
    positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
    return tokens, positions, mask, lengths


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_decoder_matches_transformers(case, tmp_path):
    from comprl_jax.models.hf_io import load_hf, save_hf
    from comprl_jax.sampling import SamplerService, SamplingParams

    extra = CASES[case]
    hf = _hf_moe(extra, tmp_path / "hf")
    cfg, graphdef, params = load_hf(str(tmp_path / "hf"))
    assert (cfg.arch, cfg.num_experts, cfg.num_experts_per_tok) == (
        "qwen3_moe", extra["num_experts"], extra["num_experts_per_tok"]
    )  # fmt: skip
    assert cfg.moe_layers == tuple(i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "gate"))
    tokens, positions, mask, lengths = _batch(TINY["vocab_size"])
    fwd = jax.jit(D.forward, static_argnums=0, static_argnames="return_aux")
    ours, aux = fwd(graphdef, params, tokens, positions, mask, return_aux=True)
    with torch.no_grad():
        ref = hf(
            input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask.astype(np.int64)),
            output_router_logits=True,
        )  # fmt: skip
    diff = np.abs(np.asarray(ours) - ref.logits.numpy())[mask].max()
    assert diff <= 1e-4, f"max |logit diff| {diff:.2e} on valid tokens"

    # Routing decisions: every MoE layer picks the same top-k set for every valid token.
    k = cfg.num_experts_per_tok
    got = np.sort(np.asarray(aux["experts"]), axis=-1)  # [L_moe, B, T, k]
    for li, router_logits in enumerate(ref.router_logits):
        want = np.sort(
            torch.topk(router_logits, k, dim=-1).indices.numpy().reshape(*tokens.shape, k), axis=-1
        )
        np.testing.assert_array_equal(got[li][mask], want[mask], err_msg=f"MoE layer {li} routing")
    # The auxiliary load-balancing loss over the valid tokens, as transformers computes it.
    assert float(aux["load_balancing_loss"]) == pytest.approx(float(ref.aux_loss), rel=1e-5)

    # Greedy generation through our sampler (padded prefill + decode steps) equals HF generate row by row.
    prompts = [tokens[i, :n].tolist() for i, n in enumerate(LENGTHS)] if case in GREEDY else []
    if prompts:
        svc = SamplerService(graphdef, params, cfg, pad_id=0)
        res = svc.generate(prompts, jax.random.key(0), SamplingParams(max_new_tokens=NEW, greedy=True))
    for i, p in enumerate(prompts):
        with torch.no_grad():
            want = hf.generate(
                torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0,
                eos_token_id=None,
            )[0, len(p):].numpy()  # fmt: skip
        np.testing.assert_array_equal(res.tokens[i, :NEW], want, err_msg=f"row {i} greedy continuation")

    # Safetensors out: transformers reads our files back to the same logits.
    save_hf(str(tmp_path / "ours"), cfg, params)
    back = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "ours"), dtype=torch.float32
    ).eval()
    assert type(back).__name__ == "Qwen3MoeForCausalLM"
    with torch.no_grad():
        again = back(
            input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask.astype(np.int64))
        ).logits
    np.testing.assert_allclose(again.numpy()[mask], ref.logits.numpy()[mask], atol=1e-5)


# --- expert parallelism on 8 fake devices ------------------------------------------------------------------

# (data x fsdp layouts of the dispatched buffer: test_expert_rule_and_expert_parallel_spec)
MESHES = {"fsdp8": {"fsdp": 8}, "fsdp4_tensor2": {"fsdp": 4, "tensor": 2}}


def _flat(params) -> dict[str, nnx.Variable]:
    flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
    return {"/".join(str(k.key) for k in path): v for path, v in flat}


@pytest.fixture(scope="module")
def moe_reference():
    cfg = ModelConfig.tiny("qwen3_moe", num_layers=3, mlp_only_layers=(1,), intermediate_size=96)
    graphdef, params = D.init_decoder(cfg, seed=5)
    rng = np.random.default_rng(0)
    b, t = 8, 12
    lengths = rng.integers(4, t + 1, b).astype(np.int32)
    mask = np.arange(t)[None] < lengths[:, None]
    tokens = rng.integers(0, cfg.vocab_size, (b, t)).astype(np.int32)
    positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
    out = {}
    for dispatch in ("dropless", "capacity"):
        c = dataclasses.replace(cfg, moe_dispatch=dispatch)
        gd, _ = D.abstract_decoder(c)
        out[dispatch] = np.asarray(jax.jit(D.forward, static_argnums=0)(gd, params, tokens, positions, mask))
    return cfg, params, (tokens, positions, mask), out


@pytest.mark.slow
@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_expert_parallel_forward_matches_one_device(mesh_name, moe_reference):
    cfg, ref_params, (tokens, positions, mask), ref = moe_reference
    mesh = sharding.make_mesh(MESHES[mesh_name])
    _, params = D.init_decoder(cfg, seed=5, mesh=mesh)
    flat, ref_flat = _flat(params), _flat(ref_params)
    fsdp, tensor = mesh.shape["fsdp"], mesh.shape["tensor"]
    # Expert weights [L_moe, E, D, F] / [L_moe, E, F, D]: experts over fsdp (E / fsdp whole experts per device),
    # the expert width over tensor; the dense MLP of layer 1 keeps the dense layout. Written out by hand.
    want = {
        "layers/expert_gate": P(None, "fsdp", None, "tensor") if tensor > 1 else P(None, "fsdp"),
        "layers/expert_down": P(None, "fsdp", "tensor") if tensor > 1 else P(None, "fsdp"),
        "layers/router": P(None, "fsdp"),
        "layers/gate_proj": P(None, "fsdp", "tensor") if tensor > 1 else P(None, "fsdp"),
    }
    for name, spec in want.items():
        assert flat[name].get_value().sharding.spec == spec, name
    shard = flat["layers/expert_gate"].get_value().addressable_shards[0].data.shape
    assert shard == (2, cfg.num_experts // fsdp, cfg.hidden_size, cfg.moe_intermediate_size // tensor)
    for name, var in flat.items():
        np.testing.assert_array_equal(
            np.asarray(var.get_value()), np.asarray(ref_flat[name].get_value()), name
        )

    batch = sharding.put_batch((tokens, positions, mask), mesh)
    # Dropless: plain jit on the sharded inputs (GSPMD lays the computation out from the parameter shardings).
    gd, _ = D.abstract_decoder(cfg)
    got = jax.jit(D.forward, static_argnums=0)(gd, params, *batch)
    np.testing.assert_allclose(np.asarray(got)[mask], ref["dropless"][mask], atol=1e-5)
    if (
        mesh_name == "fsdp4_tensor2"
    ):  # under the ambient mesh (as the sampler runs it) each layer's experts are
        with jax.set_mesh(mesh):  # gathered over fsdp and kept split over tensor: same numbers
            got = jax.jit(D.forward, static_argnums=0)(gd, params, *batch)
        np.testing.assert_allclose(np.asarray(got)[mask], ref["dropless"][mask], atol=1e-5)
    # Capacity, under the ambient mesh: the dispatched [B, E, C, D] buffer is pinned to the expert layout, so the
    # token exchange is an all-to-all (expert parallelism) and each device runs only its own experts.
    gd, _ = D.abstract_decoder(dataclasses.replace(cfg, moe_dispatch="capacity"))
    with jax.set_mesh(mesh):
        compiled = jax.jit(D.forward, static_argnums=0).lower(gd, params, *batch).compile()
        got = compiled(params, *batch)
    assert "all-to-all" in compiled.as_text()
    np.testing.assert_allclose(np.asarray(got)[mask], ref["capacity"][mask], atol=1e-5)


@pytest.mark.slow
def test_aux_loss_reaches_the_router_through_remat_and_the_hidden_path():
    """The load-balancing loss is differentiable in the router weights (what an update adds as coef x aux), also
    through per-layer remat and ``return_hidden`` (the chunked-head update path); a dense model reports 0."""
    cfg = ModelConfig.tiny("qwen3_moe", mlp_only_layers=(0,))  # layer 0 dense, layer 1 MoE: two scans
    graphdef, params = D.init_decoder(cfg, seed=2)
    tokens, positions, mask, _ = _batch(cfg.vocab_size)

    def aux_loss(p, remat):
        hidden, aux = D.forward(
            graphdef, p, tokens, positions, mask, return_hidden=True, remat=remat, return_aux=True
        )
        return aux["load_balancing_loss"] + 0.0 * hidden.sum()

    grads = {}
    for remat in (False, True):
        value, g = jax.jit(jax.value_and_grad(aux_loss), static_argnums=1)(params, remat)
        grads[remat] = np.asarray(_flat(g)["layers/router"].get_value())
        assert 0.0 < float(value) <= cfg.num_experts  # E * sum_e f_e P_e with sum f = k, sum P = 1, P_e <= 1
    assert grads[False].shape == (1, cfg.hidden_size, cfg.num_experts)
    assert np.abs(grads[False]).max() > 0
    np.testing.assert_allclose(grads[True], grads[False], rtol=1e-5, atol=1e-8)
    dense = ModelConfig.tiny("qwen3")
    gd, p = D.init_decoder(dense, seed=0)
    fwd = jax.jit(D.forward, static_argnums=0, static_argnames="return_aux")
    _, aux = fwd(gd, p, tokens, positions, mask, return_aux=True)
    assert float(aux["load_balancing_loss"]) == 0.0


def test_bench_prints_one_json_line(capsys):
    """launch/bench/moe.py at toy sizes: one JSON line with both dispatches' ratios to the dense MLP."""
    import importlib.util
    import json
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "launch" / "bench" / "moe.py"
    spec = importlib.util.spec_from_file_location("bench_moe", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main(
        [
            "--batch",
            "2",
            "--seq",
            "16",
            "--d_model",
            "32",
            "--experts",
            "4",
            "--expert_width",
            "8",
            "--repeats",
            "1",
        ]
    )
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert len(lines) == 1 and lines[0]["bench"] == "moe" and lines[0]["dense_width"] == 2 * 8
    for key in ("dense_ms", "dropless_ms", "capacity_ms", "dropless_ratio", "capacity_ratio"):
        assert lines[0][key] > 0, key
    assert lines[0]["capacity_slots_per_expert_row"] == 10  # ceil(1.25 x 16 tokens x top-2 / 4 experts)
