"""launch/plan_memory.py: per-device bytes equal hand computations from the real configs."""

import functools
import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "launch", "plan_memory.py")


def _qwen25_7b_counts():
    """(total, replicated) parameter counts of Qwen2.5-7B-Instruct, by hand from its config.json."""
    c = json.load(open(os.path.join(ROOT, "comprl_jax", "models", "presets", "qwen2.5-7b-instruct.json")))
    d, f, v, n = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_hidden_layers"]
    dh = d // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * dh
    per_layer = d * d + d + 2 * (d * kv + kv) + d * d + 3 * d * f + 2 * d  # q(+b), k/v(+b), o, mlp, 2 norms
    total = 2 * v * d + n * per_layer + d  # untied embed + lm_head, final norm
    replicated = n * (2 * d + d + 2 * kv) + d  # norms and qkv biases: 1-D, not sharded on fsdp
    return total, replicated


def test_qwen25_7b_fsdp8_optimizer_state_matches_hand_computation():
    total, replicated = _qwen25_7b_counts()
    assert total == 7_615_616_512  # the model card's 7.62 B
    out = subprocess.run(
        [sys.executable, SCRIPT, "--config=qwen2.5-7b-instruct", "--mesh=fsdp=8", "--batch=8", "--seq_len=4096"],
        capture_output=True, text=True, check=True, cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )  # fmt: skip
    lines = out.stdout.strip().splitlines()
    plan = json.loads(lines[0])
    assert plan["param_count"] == total and plan["replicated_param_count"] == replicated
    assert "float32" in plan["adamw_state_dtype"]
    # AdamW mu + nu in fp32 = 8 bytes/param; sharded params split over the 8 fsdp devices, 1-D ones replicated.
    want_opt = (total - replicated) * 8 // 8 + replicated * 8
    assert plan["bytes_per_device"]["adamw_state"] == want_opt == 7_617_949_696
    assert plan["bytes_per_device"]["params"] == want_opt // 2  # fp32 params: 4 bytes/param
    # KV cache: 2 (k, v) x L x B x S x Hkv x Dh x 2 bytes (bf16), batch split over fsdp=8.
    assert plan["bytes_per_device"]["kv_cache"] == 2 * 28 * (8 // 8) * 4096 * 4 * 128 * 2
    assert "qwen2.5-7b-instruct" in lines[-1] and "7.095" in lines[-1]  # the table row, GiB


def test_qwen3_4b_tensor_mesh_and_disjoint_extractor(capsys):
    pm = _pm()
    plan = pm.plan("qwen3-4b", pm.parse_mesh("data=2,fsdp=2,tensor=2"), 8, 1024, "bfloat16", "bfloat16")
    assert plan["devices"] == 8 and plan["param_count"] == 4_022_468_096
    # KV cache: L=36, batch 8 over data x fsdp (4), kv heads 8 over tensor (2), Dh 128, bf16.
    assert plan["bytes_per_device"]["kv_cache"] == 2 * 36 * (8 // 4) * 1024 * (8 // 2) * 128 * 2
    # Tied embedding [V, D] = [151936, 2560] -> vocab over tensor, embed over fsdp: 1/4 per device, bf16.
    emb = 151936 * 2560 * 2 // 4
    assert plan["bytes_per_device"]["params"] > emb
    assert pm.parse_mesh("fsdp=8") == {"data": 1, "fsdp": 8, "tensor": 1}

    # Disjoint meshes: actor on 8 devices, extractor on 4 more; one JSON line holds both.
    pm.FLAGS(
        [
            "plan_memory",
            "--config=qwen3-4b",
            "--mesh=fsdp=8",
            "--extractor_config=qwen3-4b",
            "--extractor_mesh=fsdp=4",
        ]
    )
    pm.main([])
    out = json.loads(capsys.readouterr().out.splitlines()[0])
    assert out["total_devices_disjoint"] == 12
    assert out["extractor"]["bytes_per_device"]["adamw_state"] > out["bytes_per_device"]["adamw_state"]


@functools.lru_cache(maxsize=1)
def _pm():  # absl flags may be defined once per process: one module, shared with launch/reproduce.py
    if "plan_memory" in sys.modules:
        return sys.modules["plan_memory"]
    spec = importlib.util.spec_from_file_location("plan_memory", SCRIPT)
    pm = importlib.util.module_from_spec(spec)
    sys.modules["plan_memory"] = pm
    try:
        spec.loader.exec_module(pm)
    except BaseException:  # never leave a half-initialised module for the next test to find
        del sys.modules["plan_memory"]
        raise
    return pm


def test_paper_plan_terms_by_hand():
    pm = _pm()
    from comprl_jax.models.config import named_config

    actor = named_config("qwen2.5-7b-instruct")
    # K and V, bf16: 2 x 28 layers x 32,768 tokens x 4 kv heads x 128 x 2 bytes; kv heads split over tensor=2.
    assert pm.kv_bytes_per_row(actor, 32_768, 1) == 2 * 28 * 32_768 * 4 * 128 * 2 == 1_879_048_192
    assert pm.kv_bytes_per_row(actor, 32_768, 2) == 1_879_048_192 // 2
    act = pm.update_activation_bytes(actor, 1, 32_768, 1, 2048)
    assert act["residual_stream"] == 28 * 32_768 * 3584 * 2  # each layer's bf16 input, kept by remat
    # q, k, v (+RoPE'd copies) 2 x (28 + 8) x 128, attention out 28 x 128, MLP 3 x 18944, 2 norms: x2 bytes x2
    assert act["layer_working_set"] == 32_768 * (2 * 36 * 128 + 28 * 128 + 3 * 18_944 + 2 * 3584) * 4
    # 3 float32 buffers of one 512-query chunk per band; 4 bands see 1/4 .. 4/4 of the keys: x 2.5
    assert act["attention_chunk"] == 28 * 512 * 32_768 * 4 * 3 * 5 // 2
    # logits, exp, cotangent of a 2048-position chunk (float32) + the float32 hidden state and its cotangent
    assert act["head"] == 3 * 2048 * 152_064 * 4 + 2 * 32_768 * 3584 * 4


def test_paper_plan_verdicts():
    """The figures quoted in WORKSPACE.md: v5p-64 fits with plain FSDP either way; one 8xH100 node does not,
    and fits once the extractor (64k sequences) is split over tensor=2."""
    pm = _pm()
    v5p = pm.paper_plan("v5p-64", "colocated")
    assert v5p["fits"] and v5p["mesh"]["actor"] == {"data": 1, "fsdp": 32, "tensor": 1}
    # Both samplers' bf16 copies split over 4 chips (7B: 3.55 GiB, 4B: 1.87 GiB per chip), resident throughout:
    # rollout beside the extractor update has 85.5 - (4.45 + 2.38 + 3.55 + 1.87) - 58.36 = 14.9 GiB per chip,
    # 34 rows of 0.44 GiB (a 32k row's cache over 4 chips) per group x 8 groups = 272 (4 waves of 1,024);
    # distillation beside the actor update 85.5 - 12.25 - 32.98 = 40.3 GiB: 17 rows of 2.25 GiB x 8 = 136.
    assert v5p["rollout_tensor"] == {"actor": 4, "extractor": 4}
    assert v5p["sampler_copy_gib"] == {"actor": 3.55, "extractor": 1.87}
    assert v5p["rollout_rows_at_once"] == 272 and v5p["rollout_waves"] == 4
    assert v5p["distill_rows_at_once"] == 136 and v5p["distill_waves"] == 8
    # the whole bf16 model per chip at t = 1 (7.6 B x 2 bytes = 14.2 GiB), a quarter at t = 4 (plus the norms and
    # biases, which every chip keeps whole)
    assert pm.sampler_copy_bytes("qwen2.5-7b-instruct", 32, 1) == 15_231_233_024
    assert pm.sampler_copy_bytes("qwen2.5-7b-instruct", 32, 4) == pytest.approx(15_231_233_024 / 4, rel=1e-3)
    assert pm.paper_plan("v5p-64", "disjoint")["fits"]
    for placement in ("colocated", "disjoint"):
        assert not pm.paper_plan("8xh100", placement)["fits"]
        best = pm.best_paper_plan("8xh100", placement)
        assert best["fits"] and best["mesh"]["extractor"]["tensor"] == 2, best["mesh"]
        assert best["peak_update_gib"] <= best["usable_gib"]


def test_activation_estimate_tracks_xla_buffer_plan():
    """The activation formula against XLA's own plan of the real update (remat + chunked head) on small models."""
    import jax
    import jax.numpy as jnp

    from comprl_jax.models.config import ModelConfig
    from comprl_jax.models.decoder import forward, init_decoder, logits_from_hidden
    from comprl_jax.rl import losses
    from comprl_jax.rl.update import ChunkedHead, accumulate_gradients

    pm = _pm()
    base = dict(
        vocab_size=2048, hidden_size=256, intermediate_size=768, num_layers=4, num_heads=8, num_kv_heads=2
    )
    for extra, t in [({}, 2048), ({"num_heads": 16}, 2048), ({}, 1024)]:
        cfg = ModelConfig.tiny("qwen3", **{**base, "head_dim": 32, **extra})
        graphdef, params = init_decoder(cfg, seed=0)
        hidden = functools.partial(forward, graphdef, return_hidden=True, remat=True)
        scorer = ChunkedHead(hidden, functools.partial(logits_from_hidden, graphdef), 256)
        batch = {
            "tokens": jnp.zeros((1, t), jnp.int32),
            "positions": jnp.arange(t, dtype=jnp.int32)[None],
            "attn_mask": jnp.ones((1, t), bool),
            "loss_mask": jnp.ones((1, t), jnp.float32),
            "old_logprobs": jnp.zeros((1, t), jnp.float32),
            "advantages": jnp.ones((1,), jnp.float32),
            "subgroup": jnp.zeros((1,), jnp.int32),
        }
        fn = jax.jit(lambda p, b, s=scorer: accumulate_gradients(s, losses.ActorLossConfig(), p, b))
        xla = fn.lower(params, batch).compile().memory_analysis().temp_size_in_bytes
        est = sum(pm.update_activation_bytes(cfg, 1, t, 1, 256, compute_bytes=4).values())
        assert 0.9 * xla <= est <= 1.5 * xla, (extra, t, est, xla)


def _qwen3_30b_a3b_count():
    """Qwen3-30B-A3B-Instruct-2507 parameters by hand from its config.json: (total, active per token)."""
    c = json.load(
        open(os.path.join(ROOT, "comprl_jax", "models", "presets", "qwen3-30b-a3b-instruct-2507.json"))
    )
    d, v, n, dh = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"], c["head_dim"]
    q, kv = c["num_attention_heads"] * dh, c["num_key_value_heads"] * dh
    e, k, f = c["num_experts"], c["num_experts_per_tok"], c["moe_intermediate_size"]
    attn = d * q + 2 * d * kv + q * d + 2 * dh + 2 * d  # q, k, v, o, q/k norms, two layer norms
    total = 2 * v * d + d + n * (attn + d * e + e * 3 * d * f)  # untied embed + lm_head, final norm, router
    active = 2 * v * d + d + n * (attn + d * e + k * 3 * d * f)
    return total, active


def test_qwen3_30b_a3b_experts_over_fsdp():
    total, active = _qwen3_30b_a3b_count()
    assert total == 30_532_122_624 and active == 3_353_032_704  # the model card's 30.5 B / 3.3 B
    pm = _pm()
    plan = pm.plan("qwen3-30b-a3b", pm.parse_mesh("fsdp=8"), 1, 1, "float32", "float32")
    assert plan["param_count"] == total and plan["arch"] == "qwen3_moe"
    # Expert weights [48, 128, 2048, 768] x 3: 128 experts over fsdp=8 -> 16 whole experts per device.
    experts = 48 * 128 * 3 * 2048 * 768
    # the rest: embed [V, D] (embed over fsdp), lm_head [D, V] (fsdp), attention [.., D, ..] (fsdp), router
    # [48, D, E] (D over fsdp); norms replicated: 48 x (2 x 2048 + 2 x 128) + 2048.
    norms = 48 * (2 * 2048 + 2 * 128) + 2048
    want = (experts // 8 + (total - experts - norms) // 8 + norms) * 4
    assert plan["bytes_per_device"]["params"] == want


def test_moe_activation_estimate_tracks_xla_buffer_plan():
    """The MoE layer's activation terms against XLA's plan of the real update (remat + chunked head), with the
    capacity dispatch (plain einsums on every backend; the dropless grouped matmul has no CPU kernel, see
    models/moe.py, so its CPU buffers are not the accelerators')."""
    import jax
    import jax.numpy as jnp

    from comprl_jax.models.config import ModelConfig
    from comprl_jax.models.decoder import forward, init_decoder, logits_from_hidden
    from comprl_jax.rl import losses
    from comprl_jax.rl.update import ChunkedHead, accumulate_gradients

    pm = _pm()
    cfg = ModelConfig.tiny(
        "qwen3_moe", vocab_size=2048, hidden_size=256, intermediate_size=768, num_layers=4, num_heads=8,
        num_kv_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=384,
        moe_dispatch="capacity", capacity_factor=1.0,
    )  # fmt: skip
    t = 2048
    graphdef, params = init_decoder(cfg, seed=0)
    hidden = functools.partial(forward, graphdef, return_hidden=True, remat=True)
    scorer = ChunkedHead(hidden, functools.partial(logits_from_hidden, graphdef), 256)
    batch = {
        "tokens": jnp.zeros((1, t), jnp.int32),
        "positions": jnp.arange(t, dtype=jnp.int32)[None],
        "attn_mask": jnp.ones((1, t), bool),
        "loss_mask": jnp.ones((1, t), jnp.float32),
        "old_logprobs": jnp.zeros((1, t), jnp.float32),
        "advantages": jnp.ones((1,), jnp.float32),
        "subgroup": jnp.zeros((1,), jnp.int32),
    }
    fn = jax.jit(lambda p, b: accumulate_gradients(scorer, losses.ActorLossConfig(), p, b))
    xla = fn.lower(params, batch).compile().memory_analysis().temp_size_in_bytes
    est = pm.update_activation_bytes(cfg, 1, t, 1, 256, compute_bytes=4)
    # per token: attention + norms, 2 x (2 D + 3 F_moe) per slot, k x D gathered, 2 E float32 router; x2
    attn = 2 * (8 + 2 * 2) * 32 + 8 * 32 + 2 * 256
    assert est["layer_working_set"] == t * ((attn + 2 * (2 * 256 + 3 * 384) + 2 * 256) * 4 + 2 * 8 * 4) * 2
    assert 0.9 * xla <= sum(est.values()) <= 1.5 * xla, (est, xla)


def test_capacity_study_plan_verdicts():
    """The figures quoted in WORKSPACE.md (Mixture of experts): the capacity study fits a v5p-64 once the MoE
    extractor's update takes tensor=4; one 8xH100 node cannot hold the resident state; with the samplers' copies
    (the MoE's bf16 copy is 57 GiB, split at most 4 ways by its KV heads) no single 8xH200 node fits either, two
    do (co-located, extractor fsdp=8 x tensor=2)."""
    pm = _pm()
    for placement in ("colocated", "disjoint"):
        assert not pm.paper_plan("v5p-64", placement, study="capacity")["fits"]
        best = pm.best_paper_plan("v5p-64", placement, study="capacity")
        assert best["fits"] and best["extractor"].startswith("qwen3-30b")
    colo = pm.best_paper_plan("v5p-64", "colocated", study="capacity")
    assert colo["mesh"]["extractor"] == {"data": 1, "fsdp": 8, "tensor": 4}
    assert (colo["rollout_rows_at_once"], colo["distill_rows_at_once"]) == (152, 64)
    assert colo["sampler_copy_gib"] == {"actor": 3.55, "extractor": 14.24}
    h100 = pm.paper_plan("8xh100", "colocated", study="capacity")
    resident = sum(h100["state_gib"]["actor"].values()) + sum(h100["state_gib"]["extractor"].values())
    assert resident > h100["usable_gib"]  # f32 master + AdamW + gradients of 38 B parameters over 8 devices
    for hw in ("8xh100", "8xh200"):
        assert not any(pm.best_paper_plan(hw, p, study="capacity")["fits"] for p in ("colocated", "disjoint"))
    h200 = pm.best_paper_plan("8xh200", "colocated", study="capacity")
    assert h200["peak_update_gib"] == 138.61 > h200["usable_gib"]  # the least peak over every split
    two = pm.best_paper_plan("16xh200", "colocated", study="capacity")
    assert two["fits"] and two["mesh"]["extractor"] == {"data": 1, "fsdp": 8, "tensor": 2}
    assert (two["rollout_rows_at_once"], two["distill_rows_at_once"]) == (144, 80)
    # Two 8xH100 nodes hold the state but not the 64k-token extractor update next to it.
    assert not any(
        pm.best_paper_plan("16xh100", p, study="capacity")["fits"] for p in ("colocated", "disjoint")
    )


def test_gmm_exchange_rounds_by_hand():
    """The gmm dispatch's exchange (models/moe.py): per MoE layer 2 x P x k rows per token of one round, each
    7 D + 3 F_moe / tensor wide in bf16 (values + cotangents). Qwen3-30B-A3B (D 2,048, k 8, F_moe 768) at 65,536
    tokens, tensor 4, 8 expert shards: 2 x 8 x 8 x 4,096 x 14,912 x 2 = 15,636,365,312 bytes (14.56 GiB) in rounds
    of 4,096, 16 times that (233 GiB) in one round; without an expert axis all tokens at once, 3 D + 3 F wide."""
    import dataclasses

    from comprl_jax.models.config import named_config

    pm = _pm()
    cfg = dataclasses.replace(named_config("qwen3-30b-a3b-instruct-2507"), moe_dispatch="gmm")
    rounds = pm.update_activation_bytes(cfg, 1, 65_536, 4, 2048, expert_shards=8)
    assert rounds["expert_exchange"] == 2 * 8 * 8 * 4096 * (7 * 2048 + 3 * 192) * 2 == 15_636_365_312
    assert "expert_weights_gathered" not in rounds  # gmm never gathers the experts' weights
    one = pm.update_activation_bytes(
        dataclasses.replace(cfg, moe_exchange_tokens=0), 1, 65_536, 4, 2048, expert_shards=8
    )
    assert one["expert_exchange"] == 16 * rounds["expert_exchange"]
    local = pm.update_activation_bytes(cfg, 1, 65_536, 4, 2048, expert_shards=1)
    assert local["expert_exchange"] == 2 * 8 * 65_536 * (3 * 2048 + 3 * 192) * 2
    # the capacity study with the TPU dispatch still fits a v5p-64, in rounds
    best = pm.best_paper_plan("v5p-64", "colocated", study="capacity", moe_dispatch="gmm")
    assert best["fits"] and best["mesh"]["extractor"] == {"data": 1, "fsdp": 8, "tensor": 4}
    assert best["update_activations_gib"]["extractor"]["expert_exchange"] == 14.56
