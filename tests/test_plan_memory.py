"""launch/plan_memory.py: per-device bytes equal hand computations from the real configs."""

import importlib.util
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "launch", "plan_memory.py")


def _qwen25_7b_counts():
    """(total, replicated) parameter counts of Qwen2.5-7B-Instruct, by hand from its config.json."""
    c = json.load(open(os.path.join(ROOT, "configs", "models", "qwen2.5-7b-instruct.json")))
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
    spec = importlib.util.spec_from_file_location("plan_memory", SCRIPT)
    pm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pm)
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
