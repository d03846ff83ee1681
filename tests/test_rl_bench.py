"""Smoke test of the training benchmark script (tiny preset): it runs and prints the agreed JSON fields."""

import importlib.util
import json
import pathlib

BENCH = pathlib.Path(__file__).resolve().parents[1] / "launch" / "bench" / "train.py"


def test_train_bench_prints_json(capsys):
    spec = importlib.util.spec_from_file_location("bench_train", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main(["--preset", "tiny", "--batch", "2", "--seq", "32", "--steps", "1", "--peak-n", "256"])
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert [x["fn"] for x in lines] == ["actor_update", "old_logprobs"]
    for x in lines:
        assert x["bench"] == "train"
        for k in ("tokens_s", "model_tflops", "peak_tflops", "mfu"):
            assert x[k] > 0, k
    # hand check of the FLOP model for the tiny preset: N_matmul = 2·(64·64 + 2·64·32 + 64·64 + 3·64·128) + 64·128
    cfg = mod.ModelConfig(**mod.PRESETS["tiny"])
    assert mod.matmul_params(cfg) == 2 * (4096 + 4096 + 4096 + 24576) + 8192
    assert mod.model_flops_per_token(cfg, 32, True) == 6 * mod.matmul_params(cfg) + 12 * 2 * 4 * 16 * 32
